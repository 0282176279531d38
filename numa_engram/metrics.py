"""Prometheus metrics for a serving stack (extra ``[prometheus]``).

Register once::

    from numa_engram.metrics import EngramCollector
    collector = EngramCollector(tables=[table_l1, table_l14], schedulers=[scheduler])
    prometheus_client.REGISTRY.register(collector)

Every scrape reads ``table.stats()`` and ``scheduler.stats()``: counters
and the last placement report's figures, never a new page walk.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import NumaEngramError


def _prometheus():
    try:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError as exc:
        raise NumaEngramError("numa_engram.metrics needs prometheus_client: pip install "
                              "'numa_engram[prometheus]'") from exc
    return CounterMetricFamily, GaugeMetricFamily


class EngramCollector:
    """A prometheus_client collector over tables and prefetch schedulers."""

    def __init__(self, tables: Iterable[Any] = (), schedulers: Iterable[Any] = ()) -> None:
        _prometheus()
        self.tables, self.schedulers = list(tables), list(schedulers)

    def collect(self):
        counter, gauge = _prometheus()
        labels = ["layer", "heads"]
        lookups = counter("numa_engram_lookups", "Engram table lookups", labels=labels)
        rows = counter("numa_engram_rows", "rows looked up (DEAD included)", labels=labels)
        read = counter("numa_engram_read_bytes", "FP8 row bytes looked up", labels=labels)
        seconds = counter("numa_engram_lookup_seconds", "CPU lookup time", labels=labels)
        size = gauge("numa_engram_table_bytes", "bytes of each table", labels=labels)
        on_plan = gauge("numa_engram_placement_on_plan_ratio",
                        "fraction of pages on their planned node (last report)", labels=labels)
        per_node = gauge("numa_engram_node_bytes", "table bytes per NUMA node (last report)",
                         labels=[*labels, "node"])
        for table in self.tables:
            s = table.stats()
            key = [str(s.layer_id), f"{s.head_start}-{s.head_end - 1}"]
            lookups.add_metric(key, s.lookups)
            rows.add_metric(key, s.rows)
            read.add_metric(key, s.bytes_read)
            seconds.add_metric(key, s.lookup_seconds)
            size.add_metric(key, s.table_bytes)
            if s.fraction_on_plan is not None:
                on_plan.add_metric(key, s.fraction_on_plan)
            for node, nbytes in s.bytes_per_node.items():
                per_node.add_metric([*key, str(node)], nbytes)
        yield from (lookups, rows, read, seconds, size, on_plan, per_node)
        yield from self._scheduler_metrics(counter)

    def _scheduler_metrics(self, counter):
        families = {
            "lookups": counter("numa_engram_prefetch_lookups", "prefetched lookups",
                               labels=["layer"]),
            "lookup_seconds": counter("numa_engram_prefetch_lookup_seconds",
                                      "time the prefetched lookups ran", labels=["layer"]),
            "lead_seconds": counter("numa_engram_prefetch_lead_seconds",
                                    "submit to wait, summed", labels=["layer"]),
            "exposed_wait_seconds": counter("numa_engram_prefetch_exposed_wait_seconds",
                                            "time the consumer waited for rows",
                                            labels=["layer"]),
        }
        for scheduler in self.schedulers:
            for layer, s in scheduler.stats().items():
                for name, family in families.items():
                    family.add_metric([str(layer)], getattr(s, name))
        yield from families.values()
