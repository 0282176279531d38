"""PLE scenarios run by tests/support/dist_harness.py in spawned ranks (gloo,
127.0.0.1): vLLM's TP x DP layout, ETP = TP."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from numa_engram.checkpoints.synthetic import write_ple_checkpoint
from numa_engram.groups.group import sharing_groups
from numa_engram.host.procfs import smaps
from numa_engram.model.ple import PLESpec
from numa_engram.tables.pletable import SharedPLETable, reduce_rows

LAYER = 5


def whole_table(checkpoint: str, spec: PLESpec, layer: int) -> tuple[torch.Tensor, float]:
    """The layer's whole table and scale, read by the safetensors library."""
    from safetensors.torch import load_file

    tensors = load_file(checkpoint)
    prefix = f"model.layers.{layer - 1}.ple.ple_embedding.ngram_embedding."
    parts = [tensors[f"{prefix}shard_{i}.weight"] for i in range(spec.split_ngram_parts)]
    return torch.cat(parts), float(tensors[f"{prefix}weight_scale"])


def vllm_rows(weight: torch.Tensor, scale: float, ids: np.ndarray) -> np.ndarray:
    """vLLM's rows: ``F.embedding`` of the FP8 table, then ``rows.to(bf16) *
    scale.to(bf16)``; NaNs written 0x7FC0 (their payload is not data)."""
    rows = torch.nn.functional.embedding(torch.from_numpy(ids), weight)
    out = rows.to(torch.bfloat16) * torch.tensor(scale, dtype=torch.float32).to(torch.bfloat16)
    bits = out.view(torch.int16).numpy().view(np.uint16).copy()
    bits[torch.isnan(out.float()).numpy()] = 0x7FC0
    return bits


def tp2_dp2_shared(rank: int, world: int, *, checkpoint: str, spec: dict, directory: str,
                   page_size: str) -> dict:
    """Ranks r = dp * 2 + tp.  The two DP replicas of a TP rank share one
    copy of its row range; each replica looks up its own ids and the TP pair
    all-reduces the rows."""
    spec_ = PLESpec.from_dict(spec)
    tp_rank, dp_rank = rank % 2, rank // 2
    tp_groups = [dist.new_group([2 * d, 2 * d + 1]) for d in range(world // 2)]
    group = sharing_groups(tp_rank=tp_rank, directory=directory, timeout_s=60)
    dist.barrier()
    free_before = free_huge_pages()
    table = SharedPLETable.create(spec_, LAYER, etp_rank=tp_rank, etp_size=2, group=group,
                                  mode="dp_shared", checkpoint=checkpoint, directory=directory,
                                  page_size=page_size, timeout_s=120)
    ids = np.random.default_rng(dp_rank).integers(0, spec_.rows(LAYER), size=(64, spec_.n_heads))
    got = reduce_rows(table, ids, tp_groups[dp_rank]).view(torch.int16).numpy().view(np.uint16)
    weight, scale = whole_table(checkpoint, spec_, LAYER)
    want = vllm_rows(weight, scale, ids)
    dist.barrier()
    pss = smaps("self", "numa-engram-").pss
    taken = free_before - free_huge_pages()
    dist.barrier()
    out = {"exact": bool(np.array_equal(np.where(got == 0x7FC0, 0x7FC0, got), want)),
           "values": int(got.size), "pss": pss, "huge_pages_taken": taken,
           "backing_bytes": table.backing_bytes,
           "mode": table.mode, "group": [m.rank for m in table.members],
           "rows": [table.shard.row_start, table.shard.row_end]}
    table.close()
    return out


def free_huge_pages() -> int:
    with open("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages") as f:
        return int(f.read())


def write_ple_model(model: Path, spec: PLESpec, seed: int = 5) -> Path:
    """A Qwen4-Exp model directory: config.json (the PLE fields under
    text_config, as vLLM reads them) and the split-parts checkpoint."""
    text = {"ple_layer_ids": list(spec.layer_ids), "ple_embed_dim": spec.ple_embed_dim,
            "vocab_size": spec.vocab_size, "eos_token_id": spec.eos_token_id,
            "ngram_size": spec.ngram_size, "heads_per_ngram": spec.heads_per_ngram,
            "ngram_vocab_size_base": spec.ngram_vocab_size_base, "seed": spec.seed,
            "make_ngram_vocab_size_divisible_by": spec.make_ngram_vocab_size_divisible_by,
            "ple_embedding_dtype": spec.dtype, "hidden_size": 160, "num_hidden_layers": 6,
            "split_ngram_parts": spec.split_ngram_parts}
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen4_exp",
                                                   "text_config": text}))
    write_ple_checkpoint(model / "model.safetensors", spec, seed=seed)
    return model


def vllm_plugin_dp_shared(rank: int, world: int, *, model_dir: str, root: str, spec: dict,
                          additional: dict, version: str | None = None, tp: int = 2) -> dict:
    """vLLM's Qwen4ExpNGramEmbedding under the plugin in ranks r = dp * tp +
    tp_rank, vLLM's TP (= ETP) and DP groups real gloo groups, dp_shared asked:
    each PLE layer's table made through the plugin and filled by vLLM's
    loader (the group's leader writes); its bytes against vLLM's own
    storage loaded by vLLM's loader; rows all-reduced over the TP pair
    against the whole table under vLLM's rule; PSS of the tables."""
    from . import vllm_harness as harness

    spec_ = PLESpec.from_dict(spec)
    v = harness.ple_modules(Path(root), version or harness.VERSION)
    from numa_engram.integrations.vllm import patch_ple

    patch_ple(v.common, v.ple, v.nv)
    tp_rank, dp_rank = rank % tp, rank // tp
    tp_ranks = [[tp * d + t for t in range(tp)] for d in range(world // tp)]
    dp_ranks = [[t + tp * d for d in range(world // tp)] for t in range(tp)]
    tp_pgs = [dist.new_group(r) for r in tp_ranks]
    dp_pgs = [dist.new_group(r) for r in dp_ranks]
    tp_group = harness.Coordinator(tp_ranks[dp_rank], tp_pgs[dp_rank])
    harness.State.tp = tp_group
    harness.State.dp = harness.Coordinator(dp_ranks[tp_rank], dp_pgs[tp_rank])
    checkpoint = str(Path(model_dir) / "model.safetensors")
    out: dict = {"modes": [], "leaders": [], "mismatches": [], "rows": [], "table_bytes": 0}
    tables = []
    dist.barrier()
    free_before = free_huge_pages()
    engine = harness.config(model_dir, dp_shared=True, additional=additional)  # one engine's
    for layer in spec_.layer_ids:
        harness.State.config = engine
        ours = harness.ple_layer(v.nv, spec, layer, dp_rank=dp_rank)
        harness.load_ple_checkpoint(ours, checkpoint, layer)
        emb = ours.ngram_embedding
        table = emb._numa_ple.table
        tables.append(table)
        out["modes"].append(table.mode)
        out["leaders"].append(table.leader)
        out["rows"].append([table.shard.row_start, table.shard.row_end])
        harness.State.config = harness.config(model_dir, cpu_offload=False)
        module = harness.ple_layer(v.nv, spec, layer, dp_rank=dp_rank)  # vLLM's own storage
        harness.load_ple_checkpoint(module, checkpoint, layer)
        theirs = module.ngram_embedding
        if emb.weight.data_ptr() != table.weights.ctypes.data or not torch.equal(
                emb.weight.view(torch.uint8), theirs.weight.view(torch.uint8)):
            out["mismatches"].append(f"layer {layer}: storage")
        if float(emb.weight_scale) != table.scale:
            out["mismatches"].append(f"layer {layer}: scale {table.scale}")
        ids = np.random.default_rng(10 * layer + dp_rank).integers(
            0, spec_.rows(layer), size=(32, spec_.n_heads))
        got = reduce_rows(table, ids, tp_group.cpu_group).view(torch.int16).numpy()
        got = got.view(np.uint16)
        weight, scale = whole_table(checkpoint, spec_, layer)
        if not np.array_equal(np.where(got == 0x7FC0, 0x7FC0, got),
                              vllm_rows(weight, scale, ids)):
            out["mismatches"].append(f"layer {layer}: rows")
        out["table_bytes"] += table.backing_bytes
    dist.barrier()
    out["pss"] = smaps("self", "numa-engram-").pss
    out["huge_pages_taken"] = free_before - free_huge_pages()
    dist.barrier()  # every rank has measured before any unmaps
    for table in tables:
        table.close()
    return out

