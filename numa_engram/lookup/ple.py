"""Rows of a Qwen4-Exp PLE table shard: FP8 (e4m3) with one fp32 scale for
the whole table, or BF16.

vLLM 0.31.0 turns looked-up FP8 rows into activations as
``rows.to(bf16) * scale.to(bf16)``: the product of two BF16 values is exact
in fp32 and rounded once to BF16, so each of the 256 FP8 bytes has one
result (``bf16_lut``, the GPU kernel's table).  The C kernel computes the
same product branch-free (vectorised); ``reference_rows`` is the rule in
plain numpy.
A shard holds rows ``row_start .. row_start + rows`` of the layer (vLLM's
row-range split): other ids give zero rows, so the shards' results summed
(FP8 as raw bytes, as vLLM all-reduces them) are the whole table's rows.
torch only inside the calls that hand out tensors.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ..bindings import lookupkernel
from ..bindings.native import ffi
from ..errors import LookupIdError, SpecError
from ..model.ple import PLEDtype
from .outputs import (
    Named,
    OutputPool,
    PreparedOutput,
    Span,
    array_span,
    check_apart,
    check_bf16_out,
    ids_span,
    prepare_out,
)

if TYPE_CHECKING:
    import torch

BF16_NAN_BITS = 0x7FC0


def fp8_e4m3_values() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn bytes (0x7F and 0xFF: NaN)."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, mant = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, mant / 8.0 * 2.0**-6, (1 + mant / 8.0) * 2.0 ** (exp - 7.0))
    value = np.where((exp == 15) & (mant == 7), np.nan, value)
    return (sign * value).astype(np.float32)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """uint16 BF16 bits of float32 ``values``, rounded to nearest even as
    torch rounds; NaN as 0x7FC0."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(BF16_NAN_BITS), rounded)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    """float32 of uint16 BF16 bits (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_scale(scale: float) -> np.float32:
    """The per-tensor scale as vLLM multiplies by it: ``scale.to(bf16)``."""
    return bf16_value(bf16_bits(np.array([scale], dtype=np.float32)))[0]


def bf16_lut(scale: float) -> np.ndarray:
    """uint16 ``[256]``: BF16 bits of ``bf16(e4m3(byte)) * bf16(scale)``."""
    s = bf16_scale(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        return bf16_bits(fp8_e4m3_values() * s)


_INT64 = np.dtype(np.int64)
_INT64_MAX = np.iinfo(np.int64).max


def _ids(ids: Any) -> np.ndarray:
    """int64 C-contiguous ids of the shape given (a 0-d id stays 0-d)."""
    if type(ids) is np.ndarray and ids.dtype == _INT64 and ids.flags.c_contiguous:
        return ids  # the serving case, checked in three attribute reads
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError, OverflowError) as exc:
        raise LookupIdError(f"PLE row ids must be integers in an array of one shape: "
                            f"{str(exc).splitlines()[0][:120]}") from None
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise LookupIdError(f"PLE row ids must be integers, got {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
        # named as given: as int64 its bits read as a negative id
        where = int(np.argmax(arr.reshape(-1) > _INT64_MAX))
        raise LookupIdError(f"PLE row id {int(arr.reshape(-1)[where])} (position {where}) is "
                            "outside every layer's rows (above int64)")
    return arr.astype(np.int64, order="C", copy=False)


_from_buffer = ffi.from_buffer


def _ids_arg(ids: Any) -> tuple[np.ndarray, Any]:
    """(``_ids(ids)``, the kernel's view of them): the serving case (a
    C-contiguous int64 array) in a type check and the buffer (cffi refuses
    a strided one: the general path)."""
    if type(ids) is np.ndarray and ids.dtype is _INT64:
        try:
            return ids, _from_buffer(ids)
        except ValueError:
            pass
    flat = _ids(ids)
    return flat, _from_buffer(flat)


def row_ids(ids: Any) -> np.ndarray:
    """``ids`` as the lookups take them (int64, C order, the shape given),
    or the LookupIdError a lookup of them raises."""
    return _ids(ids)


class PLERows:
    """Lookups in one shard of one layer's PLE table: ``table`` is uint8
    ``[rows, row_bytes]`` (C-contiguous; a mapping's view), the layer's rows
    ``row_start ..``, ``total_rows`` the layer's (ids at or beyond it, or
    negative, are refused); ``workers``: threads a large call is split
    over (the caller runs a part too); ``mapped``: the bytes of the
    mapping ``table`` lies in (None: its own), which no ``out`` may share;
    ``state``: the table's ``TableState`` (its lookups counted by the
    kernel, refused once it is closed: StorageError)."""

    def __init__(self, table: np.ndarray, *, dtype: PLEDtype, row_start: int, total_rows: int,
                 scale: float | None = None, workers: lookupkernel.Workers | None = None,
                 mapped: Span | None = None,
                 state: lookupkernel.TableState | None = None) -> None:
        if table.dtype != np.uint8 or table.ndim != 2 or not table.flags.c_contiguous:
            raise SpecError(f"a PLE shard is C-contiguous uint8 [rows, row_bytes], got "
                            f"{table.dtype} {table.shape}")
        if dtype == "float8_e4m3fn" and scale is None:
            raise SpecError("an FP8 PLE table needs its per-tensor scale (weight_scale)")
        if dtype == "bfloat16" and table.shape[1] % 2:
            raise SpecError(f"BF16 rows of {table.shape[1]} bytes: not whole values")
        if not 0 <= row_start <= row_start + table.shape[0] <= total_rows:
            raise SpecError(f"rows {row_start}..{row_start + table.shape[0]} are not inside "
                            f"the layer's {total_rows}")
        self.table, self.dtype, self.scale, self.workers = table, dtype, scale, workers
        self.row_start, self.total_rows = row_start, total_rows
        self._mapped = (("the table's mapping", array_span(table) if mapped is None else mapped),)
        self.head_dim = table.shape[1] if dtype == "float8_e4m3fn" else table.shape[1] // 2
        self.scale_bf16 = None if scale is None else float(bf16_scale(scale))
        self._mapped_span = self._mapped[0][1]
        self._shard = lookupkernel.PLEShard(table, row_start, total_rows, self.scale_bf16, workers,
                                            state, self._mapped_span)
        self._scaled = dtype == "float8_e4m3fn"
        self._kernel = self._shard.kernel
        self._outputs = OutputPool()  # lookup(ids)'s tensors, reused once nothing holds them
        self._take = self._outputs.take_with_buffer
        self._row_tail = (self.head_dim,)
        # rows_packed's arrays, pooled alike
        self._take_packed = OutputPool(packed=True).take_with_buffer
        self._packed_tail = (table.shape[1],)
        self._last_out: tuple[int, Any] = (0, ffi.NULL)  # a caller's out=: (address, its cast)

    def lookup(self, ids: Any, out: Any = None) -> torch.Tensor:
        """BF16 ``[*ids.shape, head_dim]`` as a tensor: a pooled one (reused
        once nothing refers to it), or ``out`` (a contiguous CPU bfloat16
        tensor of that shape, or what ``prepare_out`` made of one), which
        the kernel checks apart from the ids and the table's mapping at
        every call, in C (the decode budget, docs/design.md)."""
        if type(ids) is np.ndarray and ids.dtype is _INT64:  # _ids_arg's case, inline
            try:
                flat, address = ids, _from_buffer(ids)
            except ValueError:  # not C-contiguous
                flat, address = _ids_arg(ids)
        else:
            flat, address = _ids_arg(ids)
        shape = flat.shape + self._row_tail
        if out is None:
            result, _, buffer = self._take(shape)
        elif type(out) is PreparedOutput:
            if out.shape != shape or out.packed:
                raise SpecError(f"a prepared out= of {list(out.shape)}"
                                f"{' packed' if out.packed else ''} for a lookup of "
                                f"{list(shape)} BF16 values; prepare one of that shape")
            result, buffer = out.result, out.buffer
        else:
            check_bf16_out(out, shape)
            start = out.data_ptr()
            last = self._last_out
            if last[0] != start:  # (a cast is ~0.15 us: a caller passes the same buffer)
                last = self._last_out = (start, ffi.cast("uint16_t *", start))
            result, buffer = out, last[1]
        n = flat.size
        if n:
            found = self._kernel(address, n, self._scaled, buffer)
            if found != -1:
                self._failed(found, flat, address, buffer, 2 * n * self.head_dim)
        return result

    def _failed(self, found: int, flat: np.ndarray, address: Any, out: Any,
                out_bytes: int) -> NoReturn:
        """The error of the kernel's result ``found`` (not -1) for ``flat``
        ids at ``address`` into ``out`` (``out_bytes``): the first id
        outside the layer, an output over the ids or the table named,
        else the kernel's failure."""
        if found >= 0:
            self._raise_bad(flat, found)
        if found == lookupkernel.NE_OVERLAP:
            start = int(ffi.cast("uintptr_t", out))
            check_apart((("out", (start, start + out_bytes)),), (
                ("the ids", ids_span(address, flat.size, 1, 1)), *self._mapped))
        lookupkernel.ple_failed(found)

    def step_layer(self, out: Any) -> PLEStepLayer:
        """This shard's part of a step gather (``lookup.stepgather``): ``out``
        (what ``prepare_out`` takes) checked and cast once; a call's ids
        are ``out.shape[:-1]``."""
        prepared = out if isinstance(out, PreparedOutput) else self.prepare_out(out)
        if prepared.packed or prepared.shape[-1] != self.head_dim:
            raise SpecError(f"a PLE step layer's out must be BF16 [..., {self.head_dim}], got "
                            f"{list(prepared.shape)}{' packed' if prepared.packed else ''}")
        prepared.check_table(self._mapped_span)
        return PLEStepLayer(self, prepared)

    def prepare_out(self, out: Any) -> PreparedOutput:
        """``out`` (a contiguous CPU bfloat16 tensor ``[*ids.shape,
        head_dim]``) checked and cast once, apart from the table's mapping:
        pass the result as ``lookup``'s ``out=`` call after call (a staging
        buffer), and a call checks only that the ids lie apart from it."""
        if not hasattr(out, "shape") or len(out.shape) == 0 or out.shape[-1] != self.head_dim:
            raise SpecError(f"out must be a CPU bfloat16 tensor [..., {self.head_dim}], got "
                            f"{getattr(out, 'shape', type(out).__name__)}")
        return prepare_out(out, tuple(out.shape), read=self._mapped)

    def rows_bf16(self, ids: Any, out: np.ndarray | None = None) -> np.ndarray:
        """uint16 BF16 bits ``[*ids.shape, head_dim]`` (into ``out``, that
        shape, C-contiguous uint16: a server's buffer, no page faults)."""
        flat = _ids(ids)
        shape = (*flat.shape, self.head_dim)
        if out is None:
            out = np.empty(shape, dtype=np.uint16)
        else:
            self._check_out(out, shape, flat)
        if flat.size:
            address = ffi.from_buffer(flat)
            buffer = ffi.from_buffer(out)
            found = self._kernel(address, flat.size, self._scaled, buffer)
            if found != -1:
                self._failed(found, flat, address, buffer, out.nbytes)
        return out

    def _check_out(self, out: Any, shape: tuple[int, ...], flat: np.ndarray) -> None:
        """``out`` as the kernel writes it, sharing no byte with the ids or
        the table."""
        if not isinstance(out, np.ndarray) or out.dtype != np.uint16 or out.shape != shape or \
                not out.flags.c_contiguous or not out.flags.writeable:
            described = f"{out.dtype} {list(out.shape)}" + (
                "" if out.flags.writeable else ", read-only") \
                if isinstance(out, np.ndarray) else type(out).__name__
            raise SpecError(f"out must be writable C-contiguous BF16 bits (uint16) {list(shape)}, "
                            f"got {described}")
        check_apart((("out", array_span(out)),), (("the ids", array_span(flat)), *self._mapped))

    def rows_packed(self, ids: Any) -> np.ndarray:
        """The stored bytes ``[*ids.shape, row_bytes]`` (FP8 rows to scale
        later, or BF16 bits as uint8), in a pooled buffer reused once
        nothing refers to the array returned (a view of it: its base keeps
        the buffer busy, ``OutputPool``)."""
        if type(ids) is np.ndarray and ids.dtype is _INT64:  # _ids_arg's case, inline
            try:
                flat, address = ids, _from_buffer(ids)
            except ValueError:  # not C-contiguous
                flat, address = _ids_arg(ids)
        else:
            flat, address = _ids_arg(ids)
        # (the tensor held until the view is made: the pool sees the buffer busy)
        tensor, bits, buffer = self._take_packed(flat.shape + self._packed_tail)
        out = bits.view()
        del tensor
        n = flat.size
        if n:
            found = self._kernel(address, n, False, buffer)
            if found != -1:
                self._failed(found, flat, address, buffer, out.nbytes)
        return out

    def _raise_bad(self, flat: np.ndarray, where: int) -> None:
        if where >= 0:
            raise LookupIdError(f"PLE row id {int(flat.reshape(-1)[where])} (position "
                                f"{where}) is outside the layer's {self.total_rows} rows")


class PLEStepLayer:
    """A PLE shard's layer of a step gather (``PLERows.step_layer``): what
    ``lookup.stepgather`` fills the C step with, the ids' shape a call
    takes, and the shard, which names a failure as its own lookup would."""

    family = "PLE"

    def __init__(self, rows: PLERows, prepared: PreparedOutput) -> None:
        self.rows, self.prepared = rows, prepared
        self.ids_shape = tuple(prepared.shape[:-1])
        self.result, self.spans = prepared.result, prepared.spans
        self.mapped: Named = rows._mapped[0]
        self._n = math.prod(self.ids_shape)

    def fill(self, step: lookupkernel.StepKernel, i: int) -> None:
        """Layer ``i`` of ``step``: the shard's ids into the prepared output."""
        step.set_ple(i, self.rows._shard, self._n, self.rows._scaled, self.prepared.buffer)

    def ids_arg(self, ids: Any) -> tuple[Any, Any, int]:
        """(the ids kept alive, the kernel's view, 1) of a call's ids, of
        the output's ids shape."""
        flat, address = _ids_arg(ids)
        if flat.shape != self.ids_shape:
            raise SpecError(f"PLE ids of shape {list(flat.shape)} for an output of "
                            f"{list(self.ids_shape)} ids; bind a step for this shape")
        return flat, address, 1

    def failed(self, code: int, address: Any, _stride: int) -> NoReturn:
        """The error the shard's own lookup raises for the kernel's ``code``
        (``address``: the call's ids)."""
        flat = np.frombuffer(ffi.buffer(ffi.cast("int64_t *", address), 8 * self._n),
                             dtype=np.int64).reshape(self.ids_shape)
        self.rows._failed(code, flat, address, self.prepared.buffer, 2 * self._n *
                          self.rows.head_dim)

    def count_refused(self, exc: Exception) -> None:
        """A call's ids refused before the kernel (the table counts its own)."""


def reference_rows(table: np.ndarray, ids: np.ndarray, *, row_start: int,
                   scale: float | None) -> np.ndarray:
    """Plain numpy: BF16 bits of each id's row (FP8 x scale), zeros for ids
    outside the shard."""
    local = np.asarray(ids, dtype=np.int64) - row_start
    inside = (local >= 0) & (local < table.shape[0])
    raw = table[np.where(inside, local, 0)]
    if scale is None:
        bits = raw.view(np.uint16)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            bits = bf16_bits(fp8_e4m3_values()[raw] * bf16_scale(scale))
    return np.where(inside[..., None], bits, np.uint16(0))
