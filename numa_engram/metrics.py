"""Prometheus metrics for a serving stack (extra ``[prometheus]``).

Register once per process::

    from numa_engram.metrics import EngramCollector, serve_metrics
    collector = EngramCollector(runtime=rt, labels={"rank": str(rank), "replica": str(dp_rank)})
    serve_metrics(collector, port=9400 + local_rank)   # one port per process

Every scrape reads ``table.stats()`` and ``scheduler.stats()``: counters, the
latency histograms, and the last placement report's figures; with
``verify_every_s`` the placement is re-measured at most that often (a page
walk: ~1 s per 10 GiB on 4 KiB pages, so keep it minutes apart).

Fleet rules: every family carries the constant ``labels`` (rank, replica:
whatever tells processes apart) and the table's ``mode``;
``numa_engram_table_bytes`` is what each process maps (a shared copy shows
in every member), ``numa_engram_table_physical_bytes`` counts each copy
once (the group's leader reports a shared copy, every member its private
one, an attached process none: its holder does), so a sum over a host is
its real memory.

Several processes (DP ranks, workers): prometheus_client's multiprocess
mode aggregates only its own metric types and cannot run custom collectors
such as this one, so each process serves its own registry on its own port
(``serve_metrics``; a scrape config lists the ports, or a file_sd target per
rank).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import NumaEngramError


def _prometheus() -> Any:
    try:
        from prometheus_client import core
    except ImportError as exc:
        raise NumaEngramError("numa_engram.metrics needs prometheus_client: pip install "
                              "'numa_engram[prometheus]'") from exc
    return core


class EngramCollector:
    """A prometheus_client collector over tables and prefetch schedulers (or
    an EngramRuntime's), each family labelled with ``labels``."""

    def __init__(self, tables: Iterable[Any] = (), schedulers: Iterable[Any] = (), *,
                 runtime: Any = None, labels: Mapping[str, str] | None = None,
                 verify_every_s: float | None = None) -> None:
        _prometheus()
        self.tables, self.schedulers = list(tables), list(schedulers)
        if runtime is not None:
            self.tables += [runtime._layers[layer].table for layer in runtime.layer_ids]
            self.schedulers.append(runtime._scheduler)
        self.labels = {str(k): str(v) for k, v in (labels or {}).items()}
        self.verify_every_s = verify_every_s
        self._verified: dict[int, float] = {}

    # ------------------------------------------------------------ tables --
    def collect(self) -> Iterable[Any]:
        core = _prometheus()
        const, values = list(self.labels), list(self.labels.values())
        names = [*const, "layer", "heads", "mode"]

        def family(kind: Any, name: str, text: str, extra: tuple[str, ...] = ()) -> Any:
            return kind(name, text, labels=[*names, *extra])
        c, g, h = core.CounterMetricFamily, core.GaugeMetricFamily, core.HistogramMetricFamily
        fams = {
            "lookups": family(c, "numa_engram_lookups", "Engram table lookups"),
            "rows": family(c, "numa_engram_rows", "rows looked up (DEAD included)"),
            "read": family(c, "numa_engram_read_bytes", "FP8 row bytes looked up"),
            "seconds": family(c, "numa_engram_lookup_seconds", "CPU lookup time"),
            "bad": family(c, "numa_engram_bad_id_lookups", "lookups refused for bad ids"),
            "failed": family(c, "numa_engram_failed_lookups", "lookups that failed otherwise"),
            "latency": family(h, "numa_engram_lookup_latency_seconds", "CPU lookup latency"),
            "size": family(g, "numa_engram_table_bytes", "bytes of each table this process "
                           "maps"),
            "physical": family(g, "numa_engram_table_physical_bytes", "bytes this process "
                               "accounts for: each copy counted once over a host"),
            "ready": family(g, "numa_engram_table_ready", "1 while the table is open and "
                            "READY"),
            "startup": family(g, "numa_engram_startup_seconds", "the table's create or attach "
                              "steps", ("phase",)),
            "on_plan": family(g, "numa_engram_placement_on_plan_ratio",
                              "fraction of pages on their planned node (last report)"),
            "per_node": family(g, "numa_engram_node_bytes",
                               "table bytes per NUMA node (last report)", ("node",)),
        }
        for table in self.tables:
            self._maybe_verify(table)
            s = table.stats()
            key = [*values, str(s.layer_id), f"{s.head_start}-{s.head_end - 1}", s.mode]
            fams["lookups"].add_metric(key, s.lookups)
            fams["rows"].add_metric(key, s.rows)
            fams["read"].add_metric(key, s.bytes_read)
            fams["seconds"].add_metric(key, s.lookup_seconds)
            fams["bad"].add_metric(key, s.bad_id_lookups)
            fams["failed"].add_metric(key, s.failed_lookups)
            if s.latency:
                buckets, total = s.latency
                fams["latency"].add_metric(key, list(buckets), total)
            fams["size"].add_metric(key, s.table_bytes)
            fams["physical"].add_metric(key, s.physical_bytes)
            fams["ready"].add_metric(key, 0.0 if table.closed else 1.0)
            for phase, seconds in table.startup_phases.items():
                fams["startup"].add_metric([*key, phase], seconds)
            if s.fraction_on_plan is not None:
                fams["on_plan"].add_metric(key, s.fraction_on_plan)
            for node, nbytes in s.bytes_per_node.items():
                fams["per_node"].add_metric([*key, str(node)], nbytes)
        yield from fams.values()
        yield from self._scheduler_metrics(core, const, values)

    def _maybe_verify(self, table: Any) -> None:
        """Re-measure placement at most every ``verify_every_s`` per table."""
        if self.verify_every_s is None or table.closed or table.plan is None:
            return
        now = time.monotonic()
        if now - self._verified.get(id(table), float("-inf")) >= self.verify_every_s:
            table.placement_report(refresh=True)
            self._verified[id(table)] = now

    # -------------------------------------------------------- schedulers --
    def _scheduler_metrics(self, core: Any, const: list[str], values: list[str]
                           ) -> Iterable[Any]:
        c, h = core.CounterMetricFamily, core.HistogramMetricFamily
        labels = [*const, "layer", "backend"]
        families = {
            "lookups": c("numa_engram_prefetch_lookups", "prefetched lookups", labels=labels),
            "lookup_seconds": c("numa_engram_prefetch_lookup_seconds",
                                "time the prefetched lookups ran", labels=labels),
            "lead_seconds": c("numa_engram_prefetch_lead_seconds",
                              "submit to wait, summed", labels=labels),
            "exposed_wait_seconds": c("numa_engram_prefetch_exposed_wait_seconds",
                                      "time the consumer waited for rows", labels=labels),
            "errors": c("numa_engram_prefetch_errors", "prefetched lookups that raised",
                        labels=labels),
            "timeouts": c("numa_engram_prefetch_timeouts", "waits that gave up",
                          labels=labels),
        }
        latency = h("numa_engram_prefetch_latency_seconds",
                    "prefetched lookups' own time (CUDA: from events)", labels=labels)
        for scheduler in self.schedulers:
            for layer, s in scheduler.stats().items():
                key = [*values, str(layer), scheduler.backend]
                for name, fam in families.items():
                    fam.add_metric(key, getattr(s, name))
                if s.latency:
                    buckets, total = s.latency
                    latency.add_metric(key, list(buckets), total)
        yield from families.values()
        yield latency


def serve_metrics(collector: EngramCollector, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``collector`` alone on ``addr:port`` (0: any free port) from a
    daemon thread; the server (its ``server_port`` is the port)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(collector)
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server
