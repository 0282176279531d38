"""A PLE table placed gpu-local on each node of the guest, verified page by
page (runs in the 2-node guest on single-node hosts)."""

import os

import numpy as np
import pytest

from numa_engram.checkpoints.synthetic import write_ple_checkpoint
from numa_engram.host.topology import Topology
from numa_engram.model.ple import PLESpec
from numa_engram.tables.pletable import SharedPLETable

pytestmark = pytest.mark.numa
SPEC = PLESpec(layer_ids=[3], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
               ngram_vocab_size_base=20_000, split_ngram_parts=16)  # 32,000+ rows: 5 MiB


def test_a_ple_table_lands_on_the_node_its_reader_runs_on(numa_nodes, tmp_path):
    ckpt = str(write_ple_checkpoint(tmp_path / "ple.safetensors", SPEC, seed=4))
    topo, before = Topology.detect(), os.sched_getaffinity(0)
    try:
        for node in topo.node_ids:
            os.sched_setaffinity(0, set(topo.node(node).cpus))
            with SharedPLETable.create(SPEC, 3, checkpoint=ckpt, mode="independent",
                                       placement="gpu-local") as table:
                report = table.placement_report()
                assert report is not None and report.fraction_on_plan == 1.0, report
                pages = report.to_dict()["pages_per_node"]
                assert set(pages) == {node}, pages
                assert np.count_nonzero(table.weights) > 0
                print(f"PLE layer 3 read from node {node}: pages per node {pages}")
    finally:
        os.sched_setaffinity(0, before)
