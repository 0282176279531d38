"""Tier "mapped" under vLLM (``"tier": "mapped"``): each layer's table is
the checkpoint files vLLM loads from (its model directory, or the hub
cache's snapshot of a hub id), mapped read-only (``tables/mappedtier.py``):
no copy at start, no loader write, one copy per host in the page cache
whatever the number of ranks.

vLLM's graphs are kept: the rows are gathered on the host from the mapping
into fixed staging buffers the plugin allocates once per layer (pinned
where CUDA runs; sized for ``max_num_batched_tokens``), copied into fixed
device buffers and dequantised there, where vLLM reads its table
(Engram: ``ParallelEngramEmbedding.lookup``; PLE:
``Qwen4ExpPLEPinnedHostEmbedding._lookup``), which every supported release
runs at an eager break of its piecewise CUDA graphs.  Not before the
forward, as 0.34's PLE ``disk_offload`` stages its rows: every release
computes the hash ids inside the model's forward (``manifest.Release.
ids_in_forward`` names the lines), said once per engine at startup; only
0.34's own ``disk_offload`` embedding is staged before it, and with tier
mapped its reads are the plugin's (``ple.MappedStagedPLE``).  CUDA never
registers the mapped pages (the kernel may evict them; the table refuses
``register_device`` itself): the device reads the staging."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import NumaEngramError
from . import manifest
from .settings import PluginError

log = logging.getLogger("vllm." + __name__)

DISK_OFFLOAD_034 = ("vLLM stages rows before the forward only for its own "
                    "Qwen4ExpPLEDiskOffloadEmbedding (qwen4_exp/nvidia/model_state.py:64-69 and "
                    "nvidia/ngram_embedding.py:612 pick it by isinstance): set "
                    "engram_config.disk_offload=True, and vLLM stages them there, read from the "
                    "plugin's mapping")
STAGED_034 = ("numa_engram: tier mapped with engram_config.disk_offload: vLLM stages the "
              "Qwen4-Exp PLE rows before the forward (qwen4_exp/nvidia/model_state.py:114, "
              "stage_checkpoint_rows) into its fixed pinned and device buffers, and the plugin "
              "reads them from its mapping of the checkpoint, read ahead by hash id "
              "(Qwen4ExpPLEDiskOffloadEmbedding.stage_rows), instead of a preadv per row")


def checkpoint_of(config: Any) -> str:
    """The checkpoint vLLM loads from: ``model_config.model_weights`` (0.34)
    or ``model_config.model``, a directory or a hub id found in the local
    hub cache (the tables are mapped before vLLM downloads anything)."""
    from ...runtime.hubcache import model_path

    model_config = config.model_config
    name = str(getattr(model_config, "model_weights", None) or model_config.model)
    try:
        path = model_path(name)
    except NumaEngramError as exc:
        raise PluginError(f"additional_config numa_engram.tier \"mapped\" reads the rows from "
                          f"the checkpoint files vLLM loads: {exc}") from None
    if not os.path.exists(path):
        raise PluginError(f"additional_config numa_engram.tier \"mapped\" reads the rows from "
                          f"the checkpoint files vLLM loads, and vLLM's model {name!r} is no "
                          "local file or directory: pass the model's directory")
    return path


def create(config: Any, what: str, make: Callable[[str], Any]) -> Any:
    """``make(checkpoint)``: a table of tier mapped over the checkpoint vLLM
    loads; what the library refuses of it (a tensor missing, parts it cannot
    map as one array, a file system it cannot map) a PluginError naming
    ``what``, the checkpoint and the library's reason."""
    path = checkpoint_of(config)
    try:
        return make(path)
    except NumaEngramError as exc:
        raise PluginError(f"{what}: tier mapped cannot read its rows in place from {path} "
                          f"({exc}); tier \"resident\" loads them into a table instead"
                          ) from exc


def say_where(config: Any, family: str) -> None:
    """The startup WARNING, once per engine and family: where vLLM's code
    makes the gather run inside the forward, and what the plugin does."""
    from .patches import say_once

    rel = manifest.release()
    where = rel.ids_in_forward.get(family) if rel is not None else None
    if where is None:
        return
    extra = f"; {DISK_OFFLOAD_034}" if family == "PLE" and rel is not None and \
        rel.ple_disk_offload else ""
    say_once(config, f"mapped-{family}",
             "numa_engram: tier mapped, %s tables: vLLM %s computes the hash ids inside the "
             "model's forward (vllm/models/%s) and reads the rows at vllm/models/%s, so they "
             "cannot be gathered before the forward; the plugin gathers them there, from the "
             "checkpoint's mapping into its fixed staging buffers, then copies and dequantises "
             "them on the device (the mapped pages are never registered with CUDA: the kernel "
             "may evict them)%s", family, rel.version if rel else "?", where[0], where[1],
             extra, level=logging.WARNING)


class Staging:
    """Fixed buffers of one layer's gathers, allocated once: ``host`` (the
    host gather's, pinned where CUDA runs) and ``device`` (the rows the
    forward reads: the host buffers themselves without a device), by name,
    each ``[rows, *shape]`` uint8; ``ids`` the host copy of a call's ids."""

    def __init__(self, rows: int, shapes: dict[str, tuple[int, ...]], id_cols: tuple[int, ...],
                 device: int | None) -> None:
        import torch

        pin = device is not None
        self.rows = rows
        self.host = {name: torch.zeros((rows, *shape), dtype=torch.uint8, pin_memory=pin)
                     for name, shape in shapes.items()}
        self.device = self.host if device is None else {
            name: torch.zeros_like(t, device=f"cuda:{device}") for name, t in self.host.items()}
        self.ids = torch.zeros((rows, *id_cols), dtype=torch.int64, pin_memory=pin)
        # the last copy to the device, on whichever stream vLLM ran it: the
        # host buffers are written again only once it is done
        self._copied = torch.cuda.Event() if pin else None

    def host_ids(self, ids: Any, what: str) -> np.ndarray:
        """``ids`` on the host, as int64 numpy (a device tensor copied into
        the pinned ids buffer after the current stream's work: the ids are
        computed on the device)."""
        import torch

        count = ids.shape[0]
        if self._copied is not None:
            self._copied.synchronize()
        if count > self.rows:
            raise PluginError(f"{what}: a lookup of {count} rows, but the plugin's staging "
                              f"holds {self.rows} (max_num_batched_tokens): raise "
                              "max_num_batched_tokens or use tier \"resident\"")
        if ids.device.type == "cpu":
            return ids.numpy() if ids.dtype == torch.int64 else ids.long().numpy()
        if torch.cuda.is_current_stream_capturing():
            raise PluginError(f"{what}: tier mapped gathers on the host, which a CUDA graph "
                              "capture cannot hold, and this lookup is not at one of vLLM's "
                              "eager breaks: use tier \"resident\"")
        out = self.ids[:count]
        out.copy_(ids, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return out.numpy()

    def to_device(self, count: int) -> dict[str, Any]:
        """The first ``count`` rows of each buffer on the device (copied
        there on the current stream)."""
        out = {}
        for name, host in self.host.items():
            dev = self.device[name][:count]
            if dev.data_ptr() != host.data_ptr():
                dev.copy_(host[:count], non_blocking=True)
            out[name] = dev
        if self._copied is not None:
            self._copied.record()
        return out


class ReadAhead:
    """What the lookups asked of the page cache: lookups, pages their rows
    span, pages already in memory (the rest asked for with MADV_WILLNEED,
    read in parallel before the gather faults on them).  On a warm page
    cache its mincore per run of pages (~1.5 us each: ~770 us for a
    64-token step of 8 heads, where the gather takes ~6 us) is the cost,
    so a read-ahead that finds every page in memory lets the next lookups
    go without one (``skipped``), a spell that doubles while the pages stay
    in memory, to ``QUIET_MAX``; a page found missing ends it: every
    lookup reads ahead again."""

    QUIET_MAX = 63

    def __init__(self) -> None:
        self.lookups = self.pages = self.resident = self.skipped = 0
        self._quiet = self._spell = 0

    def ahead(self, ask: Callable[[], tuple[int, int]]) -> None:
        """One lookup's read-ahead: ``ask()`` (the table's ``readahead``
        of its ids, giving (pages resident, pages)) unless in a quiet spell."""
        self.lookups += 1
        if self._quiet > 0:
            self._quiet -= 1
            self.skipped += 1
            return
        resident, pages = ask()
        self.pages += pages
        self.resident += resident
        warm = resident == pages
        self._spell = min(2 * self._spell + 1, self.QUIET_MAX) if warm else 0
        self._quiet = self._spell

    def as_dict(self) -> dict[str, int]:
        return {"lookups": self.lookups, "pages": self.pages, "resident": self.resident,
                "skipped": self.skipped}


def engram_lookup(table: Any, staging: Staging, read_ahead: ReadAhead, indices: Any,
                  out: Any) -> None:
    """vLLM's ``ParallelEngramEmbedding.lookup(indices, out)`` on a mapped
    table: ``indices [T, n_hash_cols]`` (global ids) gathered packed into
    the staging, copied to the device and written to ``out``, BF16 ``[T,
    heads, dim]`` (dequantised there) or vLLM's packed uint8 ``[T, heads,
    dim + dim / block]``; a contiguous BF16 ``out`` on the CPU (no device)
    gets the C kernel's rows directly."""
    import torch

    from ...model.fp8 import dequantize_rows

    count = indices.shape[0]
    if count == 0:
        return
    ids = staging.host_ids(indices, f"Engram layer {table.layer_id}")
    read_ahead.ahead(lambda: table.readahead(ids, id_format="global"))
    if out.device.type == "cpu" and out.dtype == torch.bfloat16 and out.is_contiguous():
        # no device: the C kernel dequantises straight into vLLM's rows
        table.lookup(ids, out=out, id_format="global")
        return
    table.lookup(ids, out=(staging.host["weights"][:count], staging.host["scales"][:count]),
                 id_format="global", packed=True)
    rows = staging.to_device(count)
    weights, scales = rows["weights"], rows["scales"]
    if out.dtype == torch.uint8:
        dim = weights.shape[-1]
        out[..., :dim].copy_(weights)
        out[..., dim:].copy_(scales)
    else:
        out.copy_(dequantize_rows(weights, scales, table.spec.block))


def gather_ple(table: Any, read_ahead: ReadAhead, ids: np.ndarray, out: Any) -> None:
    """This shard's stored rows of ``ids`` (1-D layer row ids; zeros for
    another shard's) into ``out``, a host uint8 ``[len(ids), row_bytes]``
    tensor, their pages read ahead first."""
    import torch

    read_ahead.ahead(lambda: table.readahead(ids))
    # (lookup_packed returns its own array: the table has no gather into a
    # caller's buffer for stored PLE bytes)
    out.copy_(torch.from_numpy(table.lookup_packed(ids)))


def ple_lookup(table: Any, staging: Staging, read_ahead: ReadAhead, ids: Any,
               output: Any) -> Any:
    """vLLM's ``Qwen4ExpPLEPinnedHostEmbedding._lookup`` on a mapped table:
    this shard's stored rows of ``ids`` (zeros for another shard's, as
    vLLM's kernel gives them) gathered into the staging, copied to the
    device into ``output`` (vLLM's lookup dtype: it dequantises later)."""
    import torch

    flat = ids.reshape(-1)
    count = flat.numel()
    if count == 0:
        return output
    host = staging.host_ids(flat, f"PLE layer {table.layer_id}")
    if output.device.type == "cpu" and output.is_contiguous():  # no device: straight into it
        gather_ple(table, read_ahead, host, output.view(torch.uint8).view(count, -1))
        return output
    gather_ple(table, read_ahead, host, staging.host["rows"][:count])
    rows = staging.to_device(count)["rows"]
    output.view(torch.uint8).view(count, -1).copy_(rows)
    return output
