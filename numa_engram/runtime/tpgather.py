"""The TP gather of Engram rows, as vLLM 0.31.0's ``Engram.embed`` does it.

Each TP rank looks up ``part = ceil(n_hash_cols / tp)`` heads for every
token of the replica (a rank past the last real head has zero rows for its
padding).  Without sequence parallelism the ranks all-gather those rows
along the head axis and drop the padding: every rank gets
``[T, n_hash_cols, head_dim]``.  With sequence parallelism the same
gathered rows are cut by token instead: rank r keeps its window of
``w = ceil(T / tp)`` tokens starting at ``r * w``, with every head; rows of
a window past the last token (when ``tp`` does not divide ``T``) are zeros,
as vLLM's row select writes them.

The gather goes over the stack's TP group (any backend: gloo on CPU
tensors, NCCL on CUDA ones) into buffers allocated once, so every step
reuses the same memory.

Before each gather the ranks exchange what they are about to gather (the
layer and the token count: 16 bytes, over the CPU group) and every rank
fails alike, naming each rank's, when they differ: ranks embedding layers
in different orders would otherwise get each other's rows, and different
token counts abort gloo (SIGABRT) or hang NCCL.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import TopologyError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the TP group and the process groups to gather
    over: ``cpu`` for host tensors, ``device`` for CUDA ones (the same for a
    plain ProcessGroup)."""

    rank: int
    size: int
    cpu: Any
    device: Any

    @classmethod
    def of(cls, tp_group: Any) -> TPGroup:
        """None (TP 1), a torch ProcessGroup, a vLLM GroupCoordinator
        (``rank_in_group``, ``world_size``, ``cpu_group``, ``device_group``)
        or one of our Groups (its ``process_group``)."""
        if tp_group is None:
            return cls(0, 1, None, None)
        if all(hasattr(tp_group, a) for a in ("rank_in_group", "world_size", "cpu_group")):
            device = getattr(tp_group, "device_group", None) or tp_group.cpu_group
            return cls(int(tp_group.rank_in_group), int(tp_group.world_size),
                       tp_group.cpu_group, device)
        if hasattr(tp_group, "process_group") and hasattr(tp_group, "rank"):
            pg = tp_group.process_group
            return cls(int(tp_group.rank), int(tp_group.size), pg, pg)
        import torch.distributed as dist

        if not dist.is_initialized():
            raise TopologyError("tp_group was given but torch.distributed is not initialised; "
                                "call init_process_group first (or pass tp_group=None for TP 1)")
        return cls(dist.get_rank(tp_group), dist.get_world_size(tp_group), tp_group, tp_group)

    def for_tensor(self, tensor: torch.Tensor) -> Any:
        return self.device if tensor.is_cuda else self.cpu


def head_part(n_cols: int, tp: int) -> int:
    """Heads per TP rank (vLLM's ``part``); a TP size that leaves a rank
    without any head is refused, as vLLM's constructor does."""
    part = math.ceil(n_cols / tp)
    if (tp - 1) * part >= n_cols:
        raise TopologyError(f"TP {tp} over {n_cols} hash heads leaves a rank with no head "
                            f"(ceil({n_cols}/{tp}) = {part} each); use a TP size that gives "
                            "every rank a head")
    return part


def window(tokens: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(first token, width, real tokens) of ``rank``'s sequence-parallel
    window: ``width = ceil(T / tp)`` rows, of which the first ``real`` are
    tokens (the rest, past the last token, are zeros)."""
    width = math.ceil(tokens / tp) if tokens else 0
    first = rank * width
    return first, width, max(0, min(width, tokens - first))


class HeadGather:
    """All-gathers one TP rank's rows ``[T, local_heads, head_dim]`` into
    what every rank's ``embed`` returns.  Buffers: one padded send buffer
    and one gather buffer shared by the layers (``gather`` is called for one
    layer at a time, under a lock), one output per layer."""

    def __init__(self, group: TPGroup, n_cols: int, head_dim: int, max_tokens: int,
                 layers: tuple[int, ...], *, sequence_parallel: bool = False,
                 device: Any = None) -> None:
        import torch

        self.group, self.n_cols, self.head_dim = group, n_cols, head_dim
        self.sequence_parallel, self.max_tokens = sequence_parallel, max_tokens
        tp = group.size
        self.part = head_part(n_cols, tp)
        self.local_heads = min(self.part, n_cols - group.rank * self.part)
        self._lock = threading.Lock()
        self._said: torch.Tensor | None = None  # the agreement's buffers, made at first use
        self._heard: list[torch.Tensor] = []
        if tp == 1:  # the staged rows are the answer: nothing to gather or copy
            return
        dev = torch.device("cpu") if device is None else torch.device(device)
        self._device = dev
        rows = math.ceil(max_tokens / tp) if sequence_parallel else max_tokens
        self._out = {layer: torch.empty((rows, n_cols, head_dim), dtype=torch.bfloat16,
                                        device=dev) for layer in layers}
        self._gathered = torch.empty((tp, max_tokens, self.part, head_dim),
                                     dtype=torch.bfloat16, device=dev)
        # the last rank's padding heads: zero rows, written once
        self._send = None if self.local_heads == self.part else torch.zeros(
            (max_tokens, self.part, head_dim), dtype=torch.bfloat16, device=dev)

    def gather(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """``[T, n_hash_cols, head_dim]`` (or the SP window) of ``rows``, this
        rank's ``[T, local_heads, head_dim]``.  Every TP rank calls it with
        the same T (the replica's tokens)."""
        if rows.shape[1:] != (self.local_heads, self.head_dim):
            raise TopologyError(f"rows of shape {list(rows.shape)} are not this TP rank's "
                                f"{self.local_heads} heads of {self.head_dim}")
        if self.group.size == 1:
            return rows
        tokens = int(rows.shape[0])
        with self._lock:
            self._agree(layer, tokens)
            gathered = self._all_gather(rows, tokens)
            if self.sequence_parallel:
                return self._select_window(layer, gathered, tokens)
            return self._select_heads(layer, gathered, 0, tokens, tokens)

    def _agree(self, layer: int, tokens: int) -> None:
        """Every rank gathers the same layer with the same token count, or
        every rank raises the same TopologyError."""
        import torch
        import torch.distributed as dist

        if self._said is None:  # over the CPU group; a bare NCCL group takes device tensors
            device = "cpu" if dist.get_backend(self.group.cpu) != "nccl" else self._device
            self._said = torch.empty((2,), dtype=torch.int64, device=device)
            self._heard = [torch.empty_like(self._said) for _ in range(self.group.size)]
        self._said[0], self._said[1] = layer, tokens
        dist.all_gather(self._heard, self._said, group=self.group.cpu)
        said = [(int(h[0]), int(h[1])) for h in self._heard]
        if any(s != said[0] for s in said):
            raise TopologyError(
                "the TP ranks disagree on what to gather: " + ", ".join(
                    f"rank {r} embeds layer {lay} with {n} tokens"
                    for r, (lay, n) in enumerate(said)) +
                "; every TP rank must begin the same step (the replica's tokens) and embed "
                "the layers in the same order")

    def _all_gather(self, rows: torch.Tensor, tokens: int) -> torch.Tensor:
        import torch.distributed as dist

        gathered = self._gathered[:, :tokens]
        if tokens == 0:  # every rank has the same T: all skip the collective alike
            return gathered
        send = rows
        if self._send is not None:
            send = self._send[:tokens]
            send[:, : self.local_heads].copy_(rows)
        elif not rows.is_contiguous():
            send = rows.contiguous()
        parts = [self._gathered[r, :tokens] for r in range(self.group.size)]
        dist.all_gather(parts, send, group=self.group.for_tensor(send))
        return gathered

    def _select_heads(self, layer: int, gathered: torch.Tensor, first: int, width: int,
                      real: int) -> torch.Tensor:
        """Tokens ``first .. first+real`` of every rank's heads side by side,
        padding heads dropped, zeros after ``real`` up to ``width``."""
        out = self._out[layer][:width]
        for r in range(self.group.size):
            h0 = r * self.part
            h1 = min(h0 + self.part, self.n_cols)
            out[:real, h0:h1].copy_(gathered[r, first:first + real, : h1 - h0])
        if real < width:
            out[real:].zero_()
        return out

    def _select_window(self, layer: int, gathered: torch.Tensor, tokens: int) -> torch.Tensor:
        first, width, real = window(tokens, self.group.size, self.group.rank)
        return self._select_heads(layer, gathered, first, width, real)
