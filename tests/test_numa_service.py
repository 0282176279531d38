"""The table service on a host with 2 NUMA nodes (the 2-node guest on
single-node hosts): one copy per node, each client handed its node's."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads, write_synthetic_model
from numa_engram.bindings import native
from numa_engram.store import serviceclient

pytest.importorskip("tokenizers", reason="the 'tokenizers' extra is not installed")
pytestmark = [pytest.mark.numa, pytest.mark.multiproc]


def test_replicate_per_node_hands_every_node_its_own_copy(numa_nodes, tmp_path):
    spec = EngramSpec.small(rows_per_head=2000, n_head_per_ngram=4, head_dim=128)
    model = str(write_synthetic_model(tmp_path / "model", spec, raw=True))
    sock = str(tmp_path / "run" / "engram.sock")
    proc = subprocess.Popen([sys.executable, "-m", "numa_engram.cli.app", "serve", model,
                             "--socket", sock, "--placement", "replicate-per-node"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        doc = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            if os.path.exists(sock):
                doc = serviceclient.status(sock)
                if doc["ready"]:
                    break
            time.sleep(0.2)
        assert doc and doc["ready"], doc
        copies = {(t["layer"], t["node"]): t for t in doc["tables"]}
        assert set(copies) == {(layer, node) for layer in spec.layer_ids for node in numa_nodes}
        for (_, node), t in copies.items():
            assert set(t["bytes_per_node"]) == {str(node)}, t  # all of it on its own node
        shard = shard_heads(spec.bucket_sizes(1), 1, 0)
        for node in numa_nodes:
            with SharedEngramTable.attach(spec, 1, shard, service=sock, node=node) as table:
                mapping = table._backing.mapping
                native.madvise(mapping, native.MADV_POPULATE_READ)
                # (a header page of its own is not planned)
                rows = table._backing.layout.region("weights")
                pages = native.page_nodes(mapping, rows.offset, rows.length)
                assert set(np.unique(pages).tolist()) == {node}, np.unique(pages)
                print(f"client asking for node {node}: {len(pages)} pages, all on node {node}")
    finally:
        proc.terminate()
        proc.wait(60)
