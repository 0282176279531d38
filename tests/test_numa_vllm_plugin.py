"""The vLLM plugin on a host with 2 NUMA nodes (the 2-node guest on
single-node hosts): a rank's private table, made through vLLM's own Engram
module, has its pages on its reader's node (no GPU here: the node the rank
runs on stands in for its GPU's), verified page by page with move_pages."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from numa_engram import EngramSpec, write_synthetic_model  # noqa: E402
from numa_engram.bindings import native  # noqa: E402
from numa_engram.host.topology import Topology  # noqa: E402

from .support import vllm_harness as harness  # noqa: E402

pytestmark = [pytest.mark.numa, pytest.mark.torch]


def test_each_ranks_table_is_on_its_readers_node(numa_nodes, tmp_path):
    # (here, not at import: the 4-node guest collects this file, deselects
    # the test and imports no triton, ~10 s under emulation)
    pytest.importorskip("triton",
                        reason="triton is not installed (pip install 'numa_engram[test]')")
    pytest.importorskip("tokenizers", reason="the 'tokenizers' extra is not installed")
    if not all((harness.cache_dir() / f).is_file() for f in harness.FILES):
        pytest.skip("vLLM 0.31.0's files are not cached (the host suite's "
                    "tests/test_vllm_plugin.py fetches them first)")
    from numa_engram.integrations.vllm import patch

    nv, common = harness.vllm_modules(harness.cache_dir())
    patch(nv, common)
    spec = EngramSpec.small(rows_per_head=2000, n_head_per_ngram=4, head_dim=64,
                            max_ngram_size=3)
    model = str(write_synthetic_model(tmp_path / "model", spec))
    harness.State.config = harness.config(model, additional={"placement": "gpu-local"})
    layout = harness.layout_of(common, model)
    topology = Topology.detect()
    saved = os.sched_getaffinity(0)
    try:
        for node in numa_nodes[:2]:
            os.sched_setaffinity(0, topology.node(node).cpus)  # this "rank" runs on node
            emb = nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
            table = emb.numa_table
            mapping = table._backing.mapping
            native.madvise(mapping, native.MADV_POPULATE_READ)
            for name in ("weights", "scales"):
                region = table._backing.layout.region(name)
                pages = native.page_nodes(mapping, region.offset, region.length)
                assert set(np.unique(pages).tolist()) == {node}, (name, np.unique(pages))
            assert table.placement_report().ok
            table.close()
    finally:
        os.sched_setaffinity(0, saved)
