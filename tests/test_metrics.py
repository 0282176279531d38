"""table.stats(), scheduler.stats() and the Prometheus collector, read by
scraping the registry's text output."""

import numpy as np
import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.lookup.prefetch import PrefetchScheduler

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="the 'prometheus' extra (prometheus_client) is not installed")


@pytest.fixture
def table():
    spec = EngramSpec.small(rows_per_head=400)
    shard = shard_heads(spec.bucket_sizes(14), 2, 1)
    with SharedEngramTable.create(spec, 14, shard, placement="interleave") as t:
        yield spec, t


def test_table_stats_count_lookups_and_keep_the_last_placement_report(table):
    spec, t = table
    ids = np.zeros((10, spec.n_hash_cols), np.int64)
    t.lookup(ids)
    t.lookup(ids[:3])
    s = t.stats()
    assert (s.lookups, s.rows) == (2, 13 * 4)
    assert s.bytes_read == 13 * 4 * spec.row_bytes and s.lookup_seconds > 0
    assert s.fraction_on_plan == 1.0 and sum(s.bytes_per_node.values()) >= t.backing_bytes - 4096
    assert (s.layer_id, s.head_start, s.head_end) == (14, 4, 8)


def test_prometheus_collector_exposes_tables_and_schedulers(table):
    from prometheus_client import CollectorRegistry, generate_latest

    from numa_engram.metrics import EngramCollector

    spec, t = table
    ids = np.zeros((6, spec.n_hash_cols), np.int64)
    with PrefetchScheduler({14: t}, {14: (4, spec.head_dim)}, max_tokens=16) as sched:
        sched.submit(14, ids)
        sched.wait(14)
        registry = CollectorRegistry()
        registry.register(EngramCollector(tables=[t], schedulers=[sched]))
        text = generate_latest(registry).decode()
    assert 'numa_engram_lookups_total{heads="4-7",layer="14"} 1.0' in text
    assert 'numa_engram_rows_total{heads="4-7",layer="14"} 24.0' in text
    assert f'numa_engram_table_bytes{{heads="4-7",layer="14"}} {float(t.backing_bytes)}' in text
    assert 'numa_engram_placement_on_plan_ratio{heads="4-7",layer="14"} 1.0' in text
    assert 'numa_engram_prefetch_lookups_total{layer="14"} 1.0' in text
    assert "numa_engram_prefetch_exposed_wait_seconds_total" in text
    assert "# TYPE numa_engram_read_bytes_total counter" in text
