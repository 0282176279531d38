"""Rows of a Qwen4-Exp PLE table shard: FP8 (e4m3) with one fp32 scale for
the whole table, or BF16.

vLLM 0.31.0 turns looked-up FP8 rows into activations as
``rows.to(bf16) * scale.to(bf16)``: the product of two BF16 values is exact
in fp32 and rounded once to BF16, so each of the 256 FP8 bytes has one
result.  The lookup is a gather through that 256-entry table (``bf16_lut``),
bit-exact by construction; ``reference_rows`` is the same in plain numpy.
A shard holds rows ``row_start .. row_start + rows`` of the layer (vLLM's
row-range split): other ids give zero rows, so the shards' results summed
(FP8 as raw bytes, as vLLM all-reduces them) are the whole table's rows.
No torch here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..bindings import native
from ..errors import LookupIdError
from ..model.ple import PLEDtype

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


def bf16_lut(scale: float) -> np.ndarray:
    """uint16 ``[256]``: BF16 bits of ``bf16(e4m3(byte)) * bf16(scale)``."""
    s = bf16_value(bf16_bits(np.array([scale], dtype=np.float32)))[0]
    with np.errstate(over="ignore", invalid="ignore"):
        return bf16_bits(fp8_e4m3_values() * s)


def _ids(ids: Any) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise LookupIdError(f"PLE row ids must be integers, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


class PLERows:
    """Lookups in one shard of one layer's PLE table: ``table`` is uint8
    ``[rows, row_bytes]`` (C-contiguous; a mapping's view), the layer's rows
    ``row_start ..``, ``total_rows`` the layer's (ids at or beyond it, or
    negative, are refused)."""

    def __init__(self, table: np.ndarray, *, dtype: PLEDtype, row_start: int, total_rows: int,
                 scale: float | None = None) -> None:
        if table.dtype != np.uint8 or table.ndim != 2 or not table.flags.c_contiguous:
            raise ValueError(f"a PLE shard is C-contiguous uint8 [rows, row_bytes], got "
                             f"{table.dtype} {table.shape}")
        if dtype == "float8_e4m3fn" and scale is None:
            raise ValueError("an FP8 PLE table needs its per-tensor scale (weight_scale)")
        if dtype == "bfloat16" and table.shape[1] % 2:
            raise ValueError(f"BF16 rows of {table.shape[1]} bytes: not whole values")
        if not 0 <= row_start <= row_start + table.shape[0] <= total_rows:
            raise ValueError(f"rows {row_start}..{row_start + table.shape[0]} are not inside "
                             f"the layer's {total_rows}")
        self.table, self.dtype, self.scale = table, dtype, scale
        self.row_start, self.total_rows = row_start, total_rows
        self.head_dim = table.shape[1] if dtype == "float8_e4m3fn" else table.shape[1] // 2
        self._lut = bf16_lut(scale) if scale is not None else None

    def _checked(self, ids: Any) -> np.ndarray:
        flat = _ids(ids)
        bad = np.flatnonzero((flat < 0) | (flat >= self.total_rows))
        if len(bad):
            where = bad[0]
            raise LookupIdError(f"PLE row id {int(flat.reshape(-1)[where])} (position "
                                f"{int(where)}) is outside the layer's {self.total_rows} rows")
        return flat

    def rows_bf16(self, ids: Any) -> np.ndarray:
        """uint16 BF16 bits ``[*ids.shape, head_dim]``."""
        flat = self._checked(ids)
        out = np.empty((*flat.shape, self.head_dim), dtype=np.uint16)
        lut = self._lut if self.dtype == "float8_e4m3fn" else None
        native.ple_rows(self.table, self.row_start, flat.reshape(-1), lut, out)
        return out

    def rows_packed(self, ids: Any) -> np.ndarray:
        """The stored bytes ``[*ids.shape, row_bytes]`` (FP8 rows to scale
        later, or BF16 bits as uint8)."""
        flat = self._checked(ids)
        out = np.empty((*flat.shape, self.table.shape[1]), dtype=np.uint8)
        native.ple_rows(self.table, self.row_start, flat.reshape(-1), None, out)
        return out


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
        s = bf16_value(bf16_bits(np.array([scale], dtype=np.float32)))[0]
        with np.errstate(over="ignore", invalid="ignore"):
            bits = bf16_bits(fp8_e4m3_values()[raw] * s)
    return np.where(inside[..., None], bits, np.uint16(0))
