"""PLE scenarios run by tests/dist_harness.py in spawned ranks (gloo,
127.0.0.1): vLLM's TP x DP layout, ETP = TP."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from numa_engram.host.procfs import smaps
from numa_engram.model.ple import PLESpec
from numa_engram.sharing.group import sharing_groups
from numa_engram.sharing.pletable import SharedPLETable, reduce_rows

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
