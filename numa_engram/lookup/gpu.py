"""The GPU lookup on registered host memory: device views of a registered
shard (``__cuda_array_interface__``, zero copy over PCIe/C2C) and the fused
Triton gather + dequant on them.  torch is imported when a shard is built.
The registration itself is the runtime binding, ``numa_engram.bindings.cudart``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..bindings.cudart import RegistrationLease, device_pointer
from ..errors import LookupIdError, SpecError
from ..literals import IdFormat, check_id_format
from ..model.ple import PLEDtype
from ..model.sharding import prefix_offsets
from .cpu import bad_id_text
from .outputs import check_packed_pair, scales_shape


class DeviceView:
    """``__cuda_array_interface__`` over registered host memory: give it to
    ``torch.as_tensor(view, device=f"cuda:{view.device}")``, with exactly
    that device, or torch copies the whole table."""

    def __init__(self, address: int, shape: tuple[int, ...], device: int,
                 lease: RegistrationLease | None = None) -> None:
        self.device = device
        self.lease = lease  # the tensor torch makes holds this view, so the registration
        self.pointer = device_pointer(address)
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": "|u1",
                                         "data": (self.pointer, True), "version": 3,
                                         "strides": None}


def device_tensor(array: np.ndarray, device: int, lease: RegistrationLease | None = None):
    """uint8 CUDA tensor over the registered host bytes of ``array`` (zero
    copy); raises if torch copied instead of viewing."""
    import torch

    view = DeviceView(array.ctypes.data, array.shape, device, lease)
    tensor = torch.as_tensor(view, device=torch.device(f"cuda:{device}"))
    if tensor.data_ptr() != view.pointer:
        raise RuntimeError("torch copied the host table instead of viewing it; the device "
                           f"must be the registering one (cuda:{device})")
    return tensor


def take_error_record(errors) -> tuple[int, int, int]:
    """A kernel's device error record (``triton_kernels.new_error_record``)
    read with one sync, and cleared when it holds an error: (bad-id count,
    first bad position, its value)."""
    from .triton_kernels import NO_ERROR

    count, pos, value = (int(x) for x in errors.tolist())
    if count:
        errors.copy_(errors.new_tensor([0, NO_ERROR, 0]))
    return count, pos, value


class DeviceShard:
    """Zero-copy CUDA views of a registered shard and the GPU lookup on them.

    The views come from ``__cuda_array_interface__`` with the registering
    device; the constructor checks that torch did not copy the table."""

    def __init__(self, weights: np.ndarray, scales: np.ndarray, device: int, head_start: int,
                 bucket_sizes: np.ndarray, block: int = 32,
                 lease: RegistrationLease | None = None,
                 global_base: np.ndarray | None = None) -> None:
        import torch

        self.lease = lease
        self.device = torch.device(f"cuda:{device}")
        self.weights = self._view(weights, device)
        self.scales = self._view(scales, device)
        self.head_start, self.block = head_start, block
        sizes = np.asarray(bucket_sizes, dtype=np.int64)
        self._host_sizes, self._host_global_base = sizes, global_base  # for messages
        self._formats: set[str] = set()  # the id formats looked up since the last check
        self.sizes = torch.from_numpy(sizes).to(self.device)
        self.offsets = torch.from_numpy(prefix_offsets(sizes)).to(self.device)
        # each head's first row in the layer's whole table (global ids)
        self.global_base = None if global_base is None else torch.from_numpy(
            np.ascontiguousarray(global_base, dtype=np.int64)).to(self.device)
        self.zero_base = torch.zeros_like(self.sizes)
        from .triton_kernels import new_error_record

        self.errors = new_error_record(self.device)  # static: graph replays update it

    def _view(self, array: np.ndarray, device: int):
        return device_tensor(array, device, self.lease)

    def lookup(self, hash_ids, out=None, *, id_format: IdFormat = "bucket", packed: bool = False,
               out_scales=None, max_sms: int | None = None, background: bool = False):
        """BF16 ``[T, heads, head_dim]`` on the device for ids ``[T, n_hash_cols]``
        already on this GPU (int64 or int32; rows may be strided; bucket ids
        or global rows), by the fused Triton kernel: no host sync, so a CUDA
        graph can capture it (give ``out``).  Bad ids give zero rows and a
        device error record: ``check_errors()`` raises for them.
        ``packed=True``: the FP8 rows (uint8 ``out``) and scales
        (``out_scales``) as stored.  ``max_sms`` caps the persistent grid
        (``background=True``: half the SMs)."""
        import torch

        from . import triton_kernels as gpu_kernels

        ids = self._device_ids(hash_ids)
        base = self._base(id_format)
        self._formats.add(id_format)
        shape = (ids.shape[0], len(self.sizes), self.weights.shape[1])
        if packed:
            out = torch.empty(shape, dtype=torch.uint8, device=self.device) if out is None \
                else out
            out_scales = torch.empty(scales_shape(shape, self.block), dtype=torch.uint8,
                                     device=self.device) if out_scales is None else out_scales
            check_packed_pair(out, out_scales, shape, self.block, self.device)
            bits = out
        else:
            out = torch.empty(shape, dtype=torch.bfloat16, device=self.device) if out is None \
                else out
            if out.dtype != torch.bfloat16 or tuple(out.shape) != shape or \
                    not out.is_contiguous() or out.device != self.device:
                raise ValueError(f"out must be a contiguous bfloat16 tensor {list(shape)} on "
                                 f"{self.device}, got {out.dtype} {list(out.shape)} on "
                                 f"{out.device}")
            bits = out.view(torch.int16)
        gpu_kernels.lookup(self.weights, self.scales, ids, head_start=self.head_start,
                           sizes=self.sizes, offsets=self.offsets,
                           base=base, out=bits, err=self.errors,
                           out_scales=out_scales, block=self.block, max_sms=max_sms,
                           background=background)
        return (out, out_scales) if packed else out

    def check_errors(self) -> None:
        """Read (one sync) and clear the device error record; raise
        LookupIdError naming the first bad id of the lookups since the last
        check."""
        count, pos, value = take_error_record(self.errors)
        formats, self._formats = self._formats, set()
        if not count:
            return
        t, h = divmod(pos, len(self.sizes))
        raise LookupIdError(self._bad_id(value, t, h, formats, count) +
                            " (since the last check; their rows were written as zeros)")

    def _bad_id(self, value: int, t: int, h: int, formats: set[str], count: int = 1) -> str:
        """The one bad-id message (lookup.cpu.bad_id_text), with the head's
        range in the id format that was looked up."""
        base = self._host_global_base if formats == {"global"} else None
        text = bad_id_text(value, t, self.head_start + h, int(self._host_sizes[h]), base, h,
                           count)
        return text if len(formats) < 2 else text + " (bucket and global ids were both used)"

    def _device_ids(self, hash_ids):
        import torch

        if not torch.is_tensor(hash_ids) or hash_ids.device != self.device:
            where = hash_ids.device if torch.is_tensor(hash_ids) else "the host"
            raise LookupIdError(f"hash ids are on {where}; the GPU lookup needs them on "
                                f"{self.device} (copy them there once, ahead of the lookup)")
        if hash_ids.dtype not in (torch.int64, torch.int32) or hash_ids.dim() != 2:
            raise LookupIdError(f"hash ids must be int64 or int32 [T, n_hash_cols], got "
                                f"{hash_ids.dtype} {list(hash_ids.shape)}")
        return hash_ids

    def _base(self, id_format: IdFormat) -> Any:
        if check_id_format(id_format) == "bucket":
            return self.zero_base
        if self.global_base is None:
            raise SpecError("id_format='global' needs the layer's head offsets: build the "
                            "DeviceShard with global_base= (table.device_view() does)")
        return self.global_base

    def lookup_torch(self, hash_ids, *, id_format: IdFormat = "bucket"):
        """The plain torch path (several kernels, a host sync for bad ids):
        the reference the fused kernel is tested against."""
        import torch

        from ..model.fp8 import dequantize_rows

        ids = self._device_ids(hash_ids).long()
        heads = len(self.sizes)
        raw = ids[:, self.head_start:self.head_start + heads]
        dead = raw == -1
        cols = raw - self._base(id_format)
        bad = ~dead & ((cols < 0) | (cols >= self.sizes))
        if bool(bad.any()):
            t, h = (int(x) for x in bad.nonzero()[0])
            raise LookupIdError(self._bad_id(int(raw[t, h]), t, h, {id_format},
                                             int(bad.sum())))
        rows = torch.where(dead, 0, cols + self.offsets).reshape(-1)
        w = self.weights.index_select(0, rows)  # zero-copy reads over PCIe
        s = self.scales.index_select(0, rows)
        vals = dequantize_rows(w, s, self.block).view(cols.shape[0], heads, -1)
        return vals.masked_fill_(dead.unsqueeze(-1), 0)


class PLEDeviceRows:
    """A PLE shard's rows on the GPU: the gather (and FP8 x per-tensor scale
    to BF16 through the same 256-entry table as the CPU path) by one Triton
    kernel on ``raw``, the shard's uint8 ``[rows, row_bytes]`` on a device
    (``on_host`` views registered host memory, zero copy).  Bad ids give
    zero rows and a device error record (``check_errors``), no host sync."""

    def __init__(self, raw, *, dtype: PLEDtype, row_start: int, total_rows: int,
                 scale: float | None, lease: RegistrationLease | None = None) -> None:
        import torch

        from .ple import bf16_lut
        from .triton_kernels import new_error_record

        if dtype == "float8_e4m3fn" and scale is None:
            raise ValueError("an FP8 PLE table needs its per-tensor scale (weight_scale)")
        self.raw, self.dtype, self.lease, self.device = raw, dtype, lease, raw.device
        self.row_start, self.total_rows, self.scale = row_start, total_rows, scale
        self.table = raw if dtype == "float8_e4m3fn" else raw.view(torch.int16)
        self.head_dim = self.table.shape[1]
        self.lut = None if scale is None else \
            torch.from_numpy(bf16_lut(scale).view(np.int16)).to(self.device)
        self.errors = new_error_record(self.device)  # static: graph replays update it

    @classmethod
    def on_host(cls, table: np.ndarray, device: int, *, dtype: PLEDtype, row_start: int,
                total_rows: int, scale: float | None,
                lease: RegistrationLease | None = None) -> PLEDeviceRows:
        """Over a registered host shard (``table``: its uint8 rows)."""
        return cls(device_tensor(table, device, lease), dtype=dtype, row_start=row_start,
                   total_rows=total_rows, scale=scale, lease=lease)

    def lookup(self, ids, out=None, *, packed: bool = False, max_sms: int | None = None,
               background: bool = False):
        """BF16 ``[*ids.shape, head_dim]`` for layer row ids on this device
        (int64 or int32), zeros where another shard holds the row;
        ``packed=True``: the stored bytes, uint8 ``[*ids.shape, row_bytes]``."""
        import torch

        from . import triton_kernels as gpu_kernels

        flat = self._device_ids(ids).reshape(-1).contiguous()
        shape = (*ids.shape, self.raw.shape[1] if packed else self.head_dim)
        dtype = torch.uint8 if packed else torch.bfloat16
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=self.device)
        elif out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous() or \
                out.device != self.device:
            raise ValueError(f"out must be a contiguous {dtype} tensor {list(shape)} on "
                             f"{self.device}, got {out.dtype} {list(out.shape)} on {out.device}")
        table, lut = (self.raw, None) if packed else (self.table, self.lut)
        target = out if packed else out.view(torch.int16)
        gpu_kernels.ple_rows(table, flat, row_start=self.row_start, total_rows=self.total_rows,
                             out=target.view(-1, table.shape[1]), err=self.errors, lut=lut,
                             max_sms=max_sms, background=background)
        return out

    def check_errors(self) -> None:
        """Read (one sync) and clear the error record; raise LookupIdError
        naming the first bad id since the last check."""
        count, pos, value = take_error_record(self.errors)
        if not count:
            return
        raise LookupIdError(f"{count} PLE row id(s) outside the layer's {self.total_rows} "
                            f"rows, the first {value} (position {pos}) since the last check; "
                            "their rows were written as zeros")

    def lookup_torch(self, ids, *, packed: bool = False):
        """The plain torch reference (vLLM's rule: ``rows.to(bf16) *
        scale.to(bf16)``; a host sync for bad ids)."""
        import torch

        flat = self._device_ids(ids).reshape(-1).long()
        bad = (flat < 0) | (flat >= self.total_rows)
        if bool(bad.any()):
            where = int(bad.nonzero()[0])
            raise LookupIdError(f"PLE row id {int(flat[where])} (position {where}) is outside "
                                f"the layer's {self.total_rows} rows")
        local = flat - self.row_start
        inside = (local >= 0) & (local < self.raw.shape[0])
        rows = self.raw.index_select(0, torch.where(inside, local, 0))
        if not packed:
            if self.dtype == "float8_e4m3fn":
                scale = torch.tensor(self.scale, dtype=torch.float32).to(torch.bfloat16)
                rows = rows.view(torch.float8_e4m3fn).to(torch.bfloat16) * scale.to(self.device)
            else:
                rows = rows.view(torch.bfloat16)
        rows = torch.where(inside[:, None], rows, torch.zeros((), dtype=rows.dtype,
                                                               device=self.device))
        return rows.view(*ids.shape, -1)

    def _device_ids(self, ids):
        import torch

        if not torch.is_tensor(ids) or ids.device != self.device:
            where = ids.device if torch.is_tensor(ids) else "the host"
            raise LookupIdError(f"PLE row ids are on {where}; the GPU lookup needs them on "
                                f"{self.device}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise LookupIdError(f"PLE row ids must be int64 or int32, got {ids.dtype}")
        return ids
