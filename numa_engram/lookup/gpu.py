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
        import torch

        view = DeviceView(array.ctypes.data, array.shape, device, self.lease)
        tensor = torch.as_tensor(view, device=self.device)
        if tensor.data_ptr() != view.pointer:
            raise RuntimeError("torch copied the host table instead of viewing it; the device "
                               f"must be the registering one (cuda:{device})")
        return tensor

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
        from .triton_kernels import NO_ERROR

        count, pos, value = (int(x) for x in self.errors.tolist())
        formats, self._formats = self._formats, set()
        if not count:
            return
        self.errors.copy_(self.errors.new_tensor([0, NO_ERROR, 0]))
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
