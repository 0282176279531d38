"""table.stats(), scheduler.stats() and the Prometheus collector, read by
scraping the registry's text output."""

import numpy as np
import pytest

from numa_engram.lookup.prefetch import PrefetchScheduler

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="the 'prometheus' extra (prometheus_client) is not installed")


def test_table_stats_count_lookups_and_keep_the_last_placement_report(tp_shard_table):
    spec, t = tp_shard_table
    ids = np.zeros((10, spec.n_hash_cols), np.int64)
    t.lookup(ids)
    t.lookup(ids[:3])
    s = t.stats()
    assert (s.lookups, s.rows) == (2, 13 * 4)
    assert s.bytes_read == 13 * 4 * spec.row_bytes and s.lookup_seconds > 0
    assert s.fraction_on_plan == 1.0 and sum(s.bytes_per_node.values()) >= t.backing_bytes - 4096
    assert (s.layer_id, s.head_start, s.head_end) == (14, 4, 8)


def test_prometheus_collector_exposes_tables_and_schedulers(tp_shard_table):
    from prometheus_client import CollectorRegistry, generate_latest

    from numa_engram.metrics import EngramCollector

    spec, t = tp_shard_table
    ids = np.zeros((6, spec.n_hash_cols), np.int64)
    with PrefetchScheduler({14: t}, {14: (4, spec.head_dim)}, max_tokens=16) as sched:
        sched.submit(14, ids)
        sched.wait(14)
        registry = CollectorRegistry()
        registry.register(EngramCollector(tables=[t], schedulers=[sched]))
        text = generate_latest(registry).decode()
    key = 'heads="4-7",layer="14",mode="independent"'
    assert f'numa_engram_lookups_total{{{key}}} 1.0' in text
    assert f'numa_engram_rows_total{{{key}}} 24.0' in text
    assert f'numa_engram_table_bytes{{{key}}} {float(t.backing_bytes)}' in text
    assert f'numa_engram_table_physical_bytes{{{key}}} {float(t.backing_bytes)}' in text
    assert f'numa_engram_placement_on_plan_ratio{{{key}}} 1.0' in text
    assert 'numa_engram_prefetch_lookups_total{backend="cpu",layer="14"} 1.0' in text
    assert "numa_engram_prefetch_exposed_wait_seconds_total" in text
    assert "# TYPE numa_engram_read_bytes_total counter" in text


def _samples(text: str) -> dict:
    """{(sample name, frozenset of label items): value} of a scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(smp.name, frozenset(smp.labels.items())): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


@pytest.mark.slow
def test_two_processes_sharing_a_copy_are_scraped_with_labels_counted_once():
    """Each rank serves its own port; rank 0 scrapes both: rank and replica
    labels, latency histogram buckets, the bad-id and timeout counters
    moved, the shared copy's physical bytes counted once over the two."""
    from .support import dist_scenarios as scenarios
    from .support.dist_harness import run_world

    results = run_world(2, scenarios.scraped_metrics)
    for r in results:
        assert r["ok"], r.get("traceback") or r
    texts, table_bytes = results[0]["texts"], results[0]["table_bytes"]
    physical = []
    for rank, text in enumerate(texts):
        got = _samples(text)
        who = {"rank": str(rank), "replica": str(rank)}
        key = {**who, "heads": "0-7", "layer": "1", "mode": "dp_shared"}

        def value(name, got=got, key=key, **extra):
            return got[(name, frozenset({**key, **extra}.items()))]
        assert value("numa_engram_lookups_total") == 3
        assert value("numa_engram_bad_id_lookups_total") == 1
        assert value("numa_engram_lookup_latency_seconds_bucket", le="+Inf") == 3
        assert value("numa_engram_lookup_latency_seconds_count") == 3
        assert ("numa_engram_lookup_latency_seconds_bucket",
                frozenset({**key, "le": "0.001"}.items())) in got
        assert value("numa_engram_table_ready") == 1
        assert value("numa_engram_table_bytes") == table_bytes
        assert got[("numa_engram_prefetch_timeouts_total",
                    frozenset({**who, "layer": "1", "backend": "cpu"}.items()))] == 1
        physical.append(value("numa_engram_table_physical_bytes"))
    assert sorted(physical) == [0.0, float(table_bytes)]  # one copy, counted by its leader


def test_placement_is_re_verified_at_most_every_verify_every_s(tp_shard_table):
    from prometheus_client import CollectorRegistry, generate_latest

    from numa_engram.metrics import EngramCollector

    _, t = tp_shard_table
    first = t.placement_report(refresh=False)
    lazy, eager = CollectorRegistry(), CollectorRegistry()
    lazy.register(EngramCollector(tables=[t], verify_every_s=3600))
    generate_latest(lazy)
    measured = t.placement_report(refresh=False)
    assert measured is not first  # the first scrape measures
    generate_latest(lazy)
    assert t.placement_report(refresh=False) is measured  # not again within the hour
    eager.register(EngramCollector(tables=[t], verify_every_s=0))
    generate_latest(eager)
    assert t.placement_report(refresh=False) is not measured



def test_a_closed_engram_table_is_scraped_not_ready_and_not_re_verified(tp_shard_table):
    """The collector reads the public ``closed`` of either table class (PLE's:
    test_ple_table.py): an Engram table closed is ready 0 and never
    re-measured (its mapping is gone)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from numa_engram.metrics import EngramCollector

    _, t = tp_shard_table
    registry = CollectorRegistry()
    registry.register(EngramCollector(tables=[t], verify_every_s=0.0))
    key = 'heads="4-7",layer="14",mode="independent"'
    assert not t.closed
    assert f"numa_engram_table_ready{{{key}}} 1.0" in generate_latest(registry).decode()
    t.close()
    assert t.closed
    assert f"numa_engram_table_ready{{{key}}} 0.0" in generate_latest(registry).decode()
