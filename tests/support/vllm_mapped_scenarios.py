"""The vLLM plugin's tier mapped in spawned ranks (tests/support/dist_harness.py,
gloo): vLLM's own V4.1 Engram modules (tests/support/vllm_harness.py) as TP 2 x DP 2
with dp_shared_memory, every rank mapping its TP slice of the checkpoint."""

import os
from pathlib import Path

import torch
import torch.distributed as dist

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.bindings import native
from numa_engram.host.procfs import smaps
from numa_engram.integrations.vllm import patch

from . import vllm_harness as harness
from .vllm_scenarios import _join, _patched_v41, _vllms_own, global_ids, load_through_mapper


def tp2_dp2_mapped(rank, world, *, model_dir, root, spec, version, tp=2):
    """Every layer's embedding built by vLLM's Engram through the plugin with
    tier mapped, in vLLM's DP-shared branch: whether vLLM may share (the
    settings agreed), the loader calls the weights mapper lets through,
    each table's tier, the checkpoint files' pages this rank holds (PSS:
    the replicas of a TP rank map the same pages), and vLLM's forward with
    its TP gather against the whole table's rows and vLLM's own storage's."""
    spec = EngramSpec.from_dict(spec)
    nv, common, vl = _patched_v41(root, version)
    _join(rank, world, tp)
    harness.State.config = harness.config(model_dir, dp_shared=True,
                                          additional={"tier": "mapped"}, max_tokens=64)
    layout = harness.layout_of(common, model_dir)
    out = {"shareable": nv.can_share_engram_tables(layout), "mismatches": [], "tiers": [],
           "mapped_bytes": 0, "tp_rank": rank % tp}
    embs = {layer: nv.Engram._create_embedding(harness.thin_engram(nv, index), layout, index)
            for index, layer in enumerate(layout.layer_ids)}
    out["loader_calls"] = load_through_mapper(vl, embs, model_dir)
    for emb in embs.values():
        table = emb.numa_table
        out["tiers"].append(table.tier)
        native.madvise(table._backing.mapping, native.MADV_POPULATE_READ)
        out["mapped_bytes"] += table._backing.mapping.length
    dist.barrier()
    files = sorted(name for name in os.listdir(model_dir) if name.endswith(".safetensors"))
    out["pss"] = sum(smaps("self", os.path.join(os.path.realpath(model_dir), name)).pss
                     for name in files)
    dist.barrier()  # every rank has measured before any reads more
    replica = rank // tp
    for index, (layer, emb) in enumerate(embs.items()):
        ids = global_ids(spec, layer, 40 + replica, seed=100 * replica + layer)
        got = emb(ids).contiguous().view(torch.int16)
        with SharedEngramTable.create(spec, layer, shard_heads(spec.bucket_sizes(layer), 1, 0),
                                      checkpoint=model_dir, mode="independent",
                                      directory=None) as whole:
            want = whole.lookup(ids.numpy(), id_format="global")
        if not torch.equal(got, want.view(torch.int16)):
            out["mismatches"].append(layer)
        theirs = _vllms_own(nv, layout, index, model_dir, layer, "dp_shared")(ids)
        if not torch.equal(got, theirs.contiguous().view(torch.int16)):
            out["mismatches"].append(f"{layer} vs vLLM's own storage")
    out["read_ahead"] = [emb._shared_memory.read_ahead.as_dict() for emb in embs.values()]
    dist.barrier()
    for emb in embs.values():
        emb.numa_table.close()
    return out


def tiers_differ(rank, world, *, model_dir, root, version, family, ple_spec=None):
    """Two DP replicas (TP 1) given different tiers (rank 0 mapped, rank 1
    resident): what each rank's construction raised (V4.1: vLLM's
    can_share_engram_tables then the layer, as its model asks with
    dp_shared_memory; PLE: the layer of ``ple_spec``)."""
    _join(rank, world, 1)
    additional = {"tier": "mapped"} if rank == 0 else {}
    harness.State.config = harness.config(model_dir, dp_shared=True, additional=additional)
    try:
        if family == "Engram":
            nv, common = harness.vllm_modules(Path(root), version)
            patch(nv, common)
            layout = harness.layout_of(common, model_dir)
            nv.can_share_engram_tables(layout)
            nv.Engram._create_embedding(harness.thin_engram(nv, 0), layout, 0)
        else:
            from numa_engram.integrations.vllm import patch_ple

            ple = harness.ple_modules(Path(root), version)
            patch_ple(ple.common, ple.ple, ple.nv)
            harness.ple_layer(ple.nv, ple_spec, ple_spec["layer_ids"][0], dp_rank=rank)
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}
    return {"raised": None}
