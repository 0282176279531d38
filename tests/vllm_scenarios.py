"""vLLM plugin scenarios run by tests/dist_harness.py in each spawned rank:
vLLM's own Engram modules (tests/vllm_harness.py) over the plugin's tables,
with real gloo groups as vLLM's TP and Engram-DP groups (TP-minor ranks)."""

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.bindings import native
from numa_engram.host.procfs import smaps
from numa_engram.integrations.vllm import patch

from . import vllm_harness as harness


def _groups(rank, world, tp):
    """vLLM's TP group and node-local Engram-DP group of ``rank`` (every
    rank creates every group, in one order)."""
    dp = world // tp
    tp_ranks = [[d * tp + t for t in range(tp)] for d in range(dp)]
    edp_ranks = [[d * tp + t for d in range(dp)] for t in range(tp)]
    tp_pgs = [dist.new_group(r) for r in tp_ranks]
    edp_pgs = [dist.new_group(r) for r in edp_ranks]
    return (harness.Coordinator(tp_ranks[rank // tp], tp_pgs[rank // tp]),
            harness.Coordinator(edp_ranks[rank % tp], edp_pgs[rank % tp]))


def serve(rank, world, *, model_dir, root, spec, mode, tp=2, additional=None):
    """Every layer's embedding built by vLLM's Engram through the plugin
    (``mode``: vLLM's DP-shared branch, or its DP-sharded one,
    ``embedding_across_dp``), loaded by vLLM's loader (a writer copies, the
    group meets), looked up by vLLM's forward with its collectives: rows
    compared with a whole-table reference; each rank's PSS of its tables
    and their size."""
    spec = EngramSpec.from_dict(spec)
    nv, common = harness.vllm_modules(Path(root))
    patch(nv, common)
    harness.State.tp, harness.State.edp = _groups(rank, world, tp)
    harness.State.dp = harness.State.edp
    harness.State.config = harness.config(model_dir, dp_shared=mode == "dp_shared",
                                          additional=additional)
    layout = harness.layout_of(common, model_dir)
    shareable = nv.can_share_engram_tables(layout) if mode == "dp_shared" else None
    replica = rank // tp
    # vLLM's per-replica token counts of the step (DP metadata)
    counts = torch.tensor([40 + d for d in range(world // tp)])
    harness.State.forward = harness.SimpleNamespace(
        dp_metadata=harness.SimpleNamespace(num_tokens_across_dp_cpu=counts))
    out = {"shareable": shareable, "mismatches": [], "modes": [], "leaders": [], "pss": 0,
           "table_bytes": 0, "tp_rank": rank % tp, "heads": []}
    tables = []
    dist.barrier()
    free_before = _free_huge_pages()
    for index, layer in enumerate(layout.layer_ids):
        emb = nv.Engram._create_embedding(harness.thin_engram(nv, index), layout, index)
        harness.load_checkpoint(emb, model_dir, layer)
        table = emb.numa_table
        tables.append(table)
        out["modes"].append(table.mode)
        out["leaders"].append(table.leader)
        out["heads"].append([table.shard.head_start, table.shard.head_end])
        ids = _global_ids(spec, layer, 40 + replica, seed=100 * replica + layer)
        got = emb(ids)
        with SharedEngramTable.create(spec, layer, shard_heads(spec.bucket_sizes(layer), 1, 0),
                                      checkpoint=model_dir, mode="independent",
                                      directory=None) as whole:
            want = whole.lookup(ids.numpy(), id_format="global")
        if not torch.equal(got.contiguous().view(torch.int16), want.view(torch.int16)):
            out["mismatches"].append(layer)
        theirs = _vllms_own(nv, layout, index, model_dir, layer, mode)(ids)
        if not torch.equal(got.contiguous().view(torch.int16),
                           theirs.contiguous().view(torch.int16)):
            out["mismatches"].append(f"{layer} vs vLLM's own storage")
        native.madvise(table._backing.mapping, native.MADV_POPULATE_READ)
        out["table_bytes"] += table._backing.layout.file_size
        if mode == "dp_shared":
            out.setdefault("reported_copies", []).append(
                emb._shared_memory.report()["pss_copies"])
    dist.barrier()
    out["huge_pages_taken"] = free_before - _free_huge_pages()
    out["pss"] = smaps("self", "numa-engram-").pss
    dist.barrier()  # every rank has measured before any unmaps
    for table in tables:
        table.close()
    return out


def one_member_fails(rank, world, *, model_dir, root, tp=2):
    """DP-shared tables where the last rank asks for other pages than its
    group: what each rank's construction raised."""
    nv, common = harness.vllm_modules(Path(root))
    patch(nv, common)
    harness.State.tp, harness.State.edp = _groups(rank, world, tp)
    harness.State.dp = harness.State.edp
    page = "2M" if rank == world - 1 else "4K"
    harness.State.config = harness.config(model_dir, dp_shared=True,
                                          additional={"page_size": page})
    layout = harness.layout_of(common, model_dir)
    try:
        emb = nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}
    emb.numa_table.close()
    return {"raised": None}


def _vllms_own(nv, layout, index, model_dir, layer, mode):
    """vLLM's embedding on its own storage (torch tensors, cpu_offload=False),
    loaded by its loader: DP-sharded as vLLM shards it, or for the DP-shared
    case the TP-sharded table it shares (its own DP-shared storage needs
    CUDA registration, which this machine lacks)."""
    saved = harness.State.edp
    if mode == "dp_shared":
        harness.State.edp = None  # one replica's TP shards, as each DP peer reads them
    try:
        emb = nv.ParallelEngramEmbedding(
            layout.num_embeddings[index], layout.head_dim,
            tuple(s for order in layout.primes[index] for s in order), cpu_offload=False)
        harness.load_checkpoint(emb, model_dir, layer)
    finally:
        harness.State.edp = saved
    return emb


def _free_huge_pages():
    with open("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages") as f:
        return int(f.read())


def _global_ids(spec, layer, tokens, seed):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(spec.bucket_sizes(layer))
    base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    ids = base + (rng.integers(0, 1 << 40, (tokens, len(sizes))) % sizes)
    ids[rng.random(ids.shape) < 0.1] = -1
    return torch.from_numpy(ids.astype(np.int64))
