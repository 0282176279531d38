"""vLLM plugin scenarios run by tests/support/dist_harness.py in each spawned rank:
vLLM's own Engram modules (tests/support/vllm_harness.py) over the plugin's tables,
with real gloo groups as vLLM's TP and Engram-DP groups (TP-minor ranks)."""

import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.bindings import native
from numa_engram.host.procfs import smaps
from numa_engram.integrations.vllm import patch
from numa_engram.integrations.vllm.patch_vl_model import patch as patch_vl

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


def _join(rank, world, tp):
    """This rank's TP and Engram-DP groups set in the harness's state, its
    DP group the Engram-DP one (one node)."""
    harness.State.tp, harness.State.edp = _groups(rank, world, tp)
    harness.State.dp = harness.State.edp


def _patched_v41(root, version):
    """A release's V4.1 modules and VL model module, patched by the plugin:
    (nv, common, vl)."""
    nv, common = harness.vllm_modules(Path(root), version)
    patch(nv, common)
    vl = vl_module(root)
    patch_vl(vl)
    return nv, common, vl


def serve(rank, world, *, model_dir, root, spec, mode, tp=2, additional=None,
          version=harness.VERSION):
    """Every layer's embedding built by vLLM's Engram through the plugin
    (``mode``: vLLM's DP-shared branch, or its DP-sharded one,
    ``embedding_across_dp``), loaded by vLLM's loader (a writer copies, the
    group meets), looked up by vLLM's forward with its collectives: rows
    compared with a whole-table reference; each rank's PSS of its tables
    and their size."""
    spec = EngramSpec.from_dict(spec)
    nv, common = harness.vllm_modules(Path(root), version)
    patch(nv, common)
    _join(rank, world, tp)
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
        ids = global_ids(spec, layer, 40 + replica, seed=100 * replica + layer)
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
    _join(rank, world, tp)
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


def global_ids(spec, layer, tokens, seed):
    """Rows of the layer's whole table per head (V4.1's id format), some -1."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray(spec.bucket_sizes(layer))
    base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    ids = base + (rng.integers(0, 1 << 40, (tokens, len(sizes))) % sizes)
    ids[rng.random(ids.shape) < 0.1] = -1
    return torch.from_numpy(ids.astype(np.int64))


def vl_module(root):
    """vLLM's WeightsMapper and its V4.1 VL mapper factory, as vLLM wrote them
    (taken from the wheel's sources; the text checkpoint's own rules, which
    touch no Engram name, left empty)."""
    import ast
    import re
    import types
    from collections.abc import Iterable, Mapping
    from dataclasses import dataclass, field
    from typing import Any, Literal, TypeAlias

    def source_of(path, name):
        text = path.read_text()
        for node in ast.parse(text).body:
            if getattr(node, "name", None) == name:
                lines = text.splitlines()[node.lineno - 1 - len(node.decorator_list):
                                          node.end_lineno]
                return "\n".join(lines)
        raise AssertionError(f"{name} is not in {path}")
    namespace = dict(dataclass=dataclass, field=field, Mapping=Mapping, Iterable=Iterable,
                     re=re, torch=torch, Any=Any, Literal=Literal, TypeAlias=TypeAlias,
                     ShardIds=Any, WeightRenaming=Any, WeightsTransformFn=Any,
                     logger=harness._init_logger("utils"))
    exec(source_of(Path(root) / "vllm/model_executor/models/utils.py", "WeightsMapper"),
         namespace)
    namespace["_make_deepseek_v4_weights_mapper"] = lambda *a: namespace["WeightsMapper"]()
    exec(source_of(Path(root) / "vllm/models/deepseek_v41/nvidia/vl_model.py",
                   "_make_deepseek_v4_vl_weights_mapper"), namespace)
    module = types.ModuleType("vl_model")
    module._make_deepseek_v4_vl_weights_mapper = namespace[
        "_make_deepseek_v4_vl_weights_mapper"]
    return module


def load_through_mapper(vl, embs, model_dir):
    """vLLM's VL loading of the Engram tensors: every checkpoint name through
    the VL model's weights mapper (made now, as the model makes it after
    its language model), each Engram tensor that survives handed to its
    parameter's weight_loader; how many such loader calls were made."""
    from safetensors import safe_open

    from numa_engram.checkpoints.checkpoint import checkpoint_files, find_names

    files = checkpoint_files(model_dir)
    params = {}
    for layer, emb in embs.items():
        w_name, s_name = find_names(files, layer).of(layer)
        params[w_name], params[s_name] = emb.weight, emb.weight_scale_inv
    mapper = vl._make_deepseek_v4_vl_weights_mapper("fp4", "scale")
    calls = 0
    for _new, name in mapper.apply((name, name) for name in sorted(files)):
        param = params.get(name)
        if param is None:
            continue
        with safe_open(files[name], framework="pt") as f:
            tensor = f.get_tensor(name)
        if tensor.dtype == torch.uint8 and name.endswith("scale"):
            tensor = tensor.view(torch.float8_e8m0fnu)
        param.weight_loader(param, tensor)
        calls += 1
    return calls


def warm_restart(rank, world, *, model_dir, root, spec, service, tp=2, restarts=2,
                 version=harness.VERSION):
    """The README's warm-restart setup: a table service holding each TP
    shard (``serve --tp 2``) and the DP replicas of vLLM's TP 2 x DP 2 on
    one host, dp_shared asked (vLLM's default).  Each engine (``restarts``
    in a row, as a restart or an RL loop builds them): vLLM's model asks
    can_share_engram_tables, builds every Engram layer through the plugin,
    loads through the VL model's weights mapper (loader calls for Engram
    tensors counted) and looks up through vLLM's forward; rows against the
    whole table's lookup(id_format="global") and vLLM's own storage."""
    spec = EngramSpec.from_dict(spec)
    nv, common, vl = _patched_v41(root, version)
    _join(rank, world, tp)
    replica = rank // tp
    counts = torch.tensor([40 + d for d in range(world // tp)])
    harness.State.forward = harness.SimpleNamespace(
        dp_metadata=harness.SimpleNamespace(num_tokens_across_dp_cpu=counts))
    engines = []
    for restart in range(restarts):
        t0 = time.monotonic()
        config = harness.config(model_dir, dp_shared=True, additional={"service": service})
        harness.State.config = config
        layout = harness.layout_of(common, model_dir)
        # as vLLM's DeepseekV4Model does before it builds its layers
        config.engram_config.dp_shared_memory = nv.can_share_engram_tables(layout)
        embs = {layer: nv.Engram._create_embedding(harness.thin_engram(nv, index), layout,
                                                   index)
                for index, layer in enumerate(layout.layer_ids)}
        calls = load_through_mapper(vl, embs, model_dir)
        ready_s = time.monotonic() - t0
        out = {"shareable": config.engram_config.dp_shared_memory, "loader_calls": calls,
               "modes": [], "heads": [], "mismatches": [], "ready_s": round(ready_s, 3),
               "compared": 0}
        for index, (layer, emb) in enumerate(embs.items()):
            table = emb.numa_table
            out["modes"].append(table.mode)
            out["heads"].append([table.shard.head_start, table.shard.head_end])
            ids = global_ids(spec, layer, 40 + replica, seed=100 * replica + layer + restart)
            got = emb(ids)
            with SharedEngramTable.create(spec, layer,
                                          shard_heads(spec.bucket_sizes(layer), 1, 0),
                                          checkpoint=model_dir, mode="independent",
                                          directory=None) as whole:
                want = whole.lookup(ids.numpy(), id_format="global")
            if not torch.equal(got.contiguous().view(torch.int16), want.view(torch.int16)):
                out["mismatches"].append(layer)
            theirs = _vllms_own(nv, layout, index, model_dir, layer, "dp_shared")(ids)
            if not torch.equal(got.contiguous().view(torch.int16),
                               theirs.contiguous().view(torch.int16)):
                out["mismatches"].append(f"{layer} vs vLLM's own storage")
            out["compared"] += got.numel() * got.element_size()
        dist.barrier()
        for emb in embs.values():
            emb.numa_table.close()
        engines.append(out)
    return {"engines": engines}


def differing_settings(rank, world, *, model_dir, root, service, tp=2):
    """DP replicas given different plugin settings (the first replica a
    table service, the second none): what vLLM's can_share_engram_tables
    raised on each rank."""
    nv, common = harness.vllm_modules(Path(root))
    patch(nv, common)
    _join(rank, world, tp)
    additional = {"service": service} if rank < tp else {}
    harness.State.config = harness.config(model_dir, dp_shared=True, additional=additional)
    layout = harness.layout_of(common, model_dir)
    try:
        nv.can_share_engram_tables(layout)
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}
    return {"raised": None}



def _refused(load) -> str | None:
    """What the plugin said when ``load()`` ran vLLM's loader, None if it
    said nothing."""
    from numa_engram.integrations.vllm.settings import PluginError

    try:
        load()
    except PluginError as exc:
        return str(exc)
    return None


def write_into_attached(rank, world, *, model_dir, root, service, version=harness.VERSION):
    """vLLM's loader handing rows other than the service's to each parameter
    of an Engram table attached read-only from the table service (a weight
    update): what the plugin said for each, whether the table's bytes
    stayed.  In a world of its own: a write into the read-only mapping
    would kill this process (SIGSEGV), and the test with it."""
    nv, common = harness.vllm_modules(Path(root), version)
    patch(nv, common)
    harness.State.config = harness.config(model_dir, additional={"service": service})
    layout = harness.layout_of(common, model_dir)
    emb = nv.Engram._create_embedding(harness.thin_engram(nv, 0), layout, 0)
    table = emb.numa_table
    before = table.weights.tobytes() + table.scales.tobytes()
    said = []
    for param in (emb.weight, emb.weight_scale_inv):
        rows = param.engram_vocab_start + param.shape[0]
        other = torch.full((rows, *param.shape[1:]), 7, dtype=torch.uint8).view(param.dtype)
        said.append(_refused(lambda p=param, o=other: p.weight_loader(p, o)))
    out = {"mode": table.mode, "read_only": emb._shared_memory.read_only, "said": said,
           "unchanged": table.weights.tobytes() + table.scales.tobytes() == before}
    table.close()
    return out


def write_into_attached_ple(rank, world, *, model_dir, spec, service, version=harness.VERSION):
    """The same for a Qwen4-Exp PLE table: vLLM's module's load_weights
    handing another first checkpoint part."""
    root, why = harness.wheel_sources(version)
    assert root is not None, why
    v = harness.ple_modules(root, version)
    from numa_engram.integrations.vllm import patch_ple
    from numa_engram.model.ple import PLESpec

    patch_ple(v.common, v.ple)
    harness.State.tp = harness.Coordinator([0], None)
    spec = PLESpec.from_dict(spec)
    layer = spec.layer_ids[0]
    harness.State.config = harness.config(model_dir, additional={"service": service})
    module = harness.ple_layer(v.nv, spec.to_dict(), layer)
    emb = module.ngram_embedding
    table = emb._numa_ple.table
    before = table.weights.tobytes()
    first, end = spec.part_rows(layer, 0)
    other = torch.full((end - first, *emb.weight.shape[1:]), 3.0).to(emb.weight.dtype)
    said = _refused(lambda: module.load_weights([("ngram_embedding.shard_0.weight", other)]))
    out = {"mode": table.mode, "read_only": emb._numa_ple.read_only, "said": [said],
           "unchanged": table.weights.tobytes() == before}
    table.close()
    return out


def on_gpu_nodes(rank, world, *, nodes, then, **kwargs):
    """The scenario ``then`` with this rank's GPU on NUMA node ``nodes[rank]``: a
    fake, this machine having no GPU, at the one point that maps a CUDA
    device to its node, ``host.topology.gpu_node`` as the module of
    ``numa_engram.sharing_groups`` looks it up, in this spawned rank only.
    Nothing else sees a GPU: the plugin's device() is still None, so no
    table is registered with CUDA."""
    import sys

    import numa_engram

    module = sys.modules[numa_engram.sharing_groups.__module__]
    assert callable(module.gpu_node)  # (renamed: the fake would miss; fail instead)
    module.gpu_node = lambda device, root=None: nodes[rank]
    return then(rank, world, **kwargs)


def check_copies_socket(r, spec, nodes):
    """A rank's result of ``on_gpu_nodes`` with "copies": "socket" and
    dp_shared asked, DP 2 x TP 1 (either family): GPUs on two nodes, a
    private table per rank, each its own leader, with the plugin's fall
    back line once; both on one node, one shared copy led by rank 0 and no
    such line.  Rows equal to vLLM's in every layer either way."""
    split = nodes[0] != nodes[1]
    assert r["ok"], r.get("traceback", r)
    assert r["mismatches"] == [] and len(r["modes"]) == len(spec.layer_ids), r
    assert set(r["modes"]) == {"independent" if split else "dp_shared"}, r
    assert all(r["leaders"]) == (split or r["rank"] == 0), r
    fell_back = [line for line in r["logs"] if "the DP peers cannot share one copy (no DP "
                 "peer of this rank can map its copy" in line and "socket" in line
                 and "one table per rank" in line]
    assert len(fell_back) == (1 if split else 0), r["logs"]
