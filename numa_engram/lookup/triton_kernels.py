"""The GPU lookup as one fused Triton kernel (the only module that imports
triton).

For ids ``[T, n_hash_cols]`` on the device (int64 or int32, rows may be
strided; bucket ids or global rows), one persistent kernel reads each row's
weights and scales straight from the registered host table (its UVA view),
dequantises FP8 e4m3 x ue8m0 to BF16 with integer bit arithmetic (so NaN,
infinities and subnormals match the CPU kernel bit for bit: NaN is 0x7FC0),
writes zeros for DEAD (-1) and, for ids outside their head's buckets,
zeros plus a device error record (count, the smallest flat position
``t * heads + h`` of a bad id, that id's value) instead of a host sync.
The grid is persistent: ``min(tiles, max_sms)`` programs walk the tiles
(``background=True``: half the SMs, as vLLM does, to overlap compute).
``packed=True`` writes the gathered FP8 rows and scales as stored instead
(dequantise later with ``dequantize_rows``).

``ple_rows`` is the same for a Qwen4-Exp PLE shard: 1-D layer row ids,
rows another shard holds as zeros, FP8 bytes to BF16 through the table's
256-entry lookup table (byte x per-tensor scale), or the stored bytes.

Everything here is graph-capturable: no host sync, buffers given by the
caller.  Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors
(set it before this module is first imported).
"""

from __future__ import annotations

import triton
import triton.language as tl

NO_ERROR = (1 << 63) - 1  # the error record's "no bad position" value
ROWS_PER_TILE = 16


@triton.jit
def _bf16_bits(w, s):
    """BF16 bits of e4m3(w) * 2^(s - 127), as the CPU kernel rounds them
    (fp32 product, round to nearest even), from integers alone."""
    sign = (w >> 7) & 1
    e = (w >> 3) & 15
    m = w & 7
    normal = e > 0
    mag = tl.where(normal, m + 8, m)                   # value = mag * 2^exp2
    exp2 = tl.where(normal, e - 10, -9) + s - 127
    nbits = tl.where(mag >= 8, 4, tl.where(mag >= 4, 3, tl.where(mag >= 2, 2, 1)))
    top = exp2 + nbits - 1                              # value = 1.f * 2^top
    frac = ((mag - (1 << (nbits - 1))) << (8 - nbits)) & 0x7F
    normal_bits = ((top + 127) << 7) | frac
    shift = -(exp2 + 133)                               # bf16 subnormal unit 2^-133
    right = tl.maximum(shift, 0)
    kept = mag >> right
    rest = mag & ((1 << right) - 1)
    half = (1 << right) >> 1
    round_up = (right > 0) & ((rest > half) | ((rest == half) & ((kept & 1) == 1)))
    sub_bits = tl.where(shift <= 0, mag << tl.maximum(-shift, 0), kept + round_up.to(tl.int32))
    bits = tl.where(top > 127, 0x7F80, tl.where(top >= -126, normal_bits, sub_bits))
    bits = tl.where(mag == 0, 0, bits) | (sign << 15)
    return tl.where(((w & 0x7F) == 0x7F) | (s == 255), 0x7FC0, bits)


@triton.jit
def _lookup_kernel(ids_ptr, stride_t, col0, n_tokens, w_ptr, s_ptr, sizes_ptr, offsets_ptr,
                   base_ptr, out_ptr, out_s_ptr, err_ptr, n_tiles,
                   HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                   ROWS: tl.constexpr, PACKED: tl.constexpr):
    NS: tl.constexpr = DIM // BLOCK
    cols = tl.arange(0, DIM)
    scols = tl.arange(0, NS)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):  # persistent grid
        flat = tile * ROWS + tl.arange(0, ROWS)
        valid = flat < n_tokens * HEADS
        t = flat // HEADS
        h = flat % HEADS
        raw = tl.load(ids_ptr + t * stride_t + col0 + h, mask=valid, other=-1).to(tl.int64)
        size = tl.load(sizes_ptr + h, mask=valid, other=1)
        bucket = raw - tl.load(base_ptr + h, mask=valid, other=0)
        dead = raw == -1
        bad = valid & (raw != -1) & ((bucket < 0) | (bucket >= size))
        ok = valid & (raw != -1) & (bucket >= 0) & (bucket < size)
        n_bad = tl.sum(bad.to(tl.int64), axis=0)
        if n_bad > 0:
            tl.atomic_add(err_ptr, n_bad)
            tl.atomic_min(err_ptr + 1, tl.min(tl.where(bad, flat.to(tl.int64), NO_ERROR), axis=0))
        row = tl.where(ok, bucket + tl.load(offsets_ptr + h, mask=valid, other=0), 0)
        w = tl.load(w_ptr + row[:, None] * DIM + cols[None, :], mask=ok[:, None], other=0)
        s = tl.load(s_ptr + row[:, None] * NS + scols[None, :], mask=ok[:, None], other=0)
        out_rows = flat.to(tl.int64)[:, None]
        if PACKED:
            tl.store(out_ptr + out_rows * DIM + cols[None, :], w, mask=valid[:, None])
            tl.store(out_s_ptr + out_rows * NS + scols[None, :], s, mask=valid[:, None])
        else:
            w3 = tl.reshape(w.to(tl.int32), (ROWS, NS, BLOCK))
            s3 = tl.reshape(s.to(tl.int32), (ROWS, NS, 1))
            bits = tl.reshape(_bf16_bits(w3, s3), (ROWS, DIM))
            bits = tl.where(ok[:, None] & ~dead[:, None], bits, 0)
            tl.store(out_ptr + out_rows * DIM + cols[None, :], bits.to(tl.int16),
                     mask=valid[:, None])


@triton.jit
def _record_bad_id(ids_ptr, stride_t, col0, err_ptr, HEADS: tl.constexpr):
    """After the lookup, on the same stream: the value of the first bad id
    (still in the ids buffer), so reading the record needs no extra sync."""
    pos = tl.load(err_ptr + 1)
    if pos != NO_ERROR:
        t = pos // HEADS
        h = pos % HEADS
        tl.store(err_ptr + 2, tl.load(ids_ptr + t * stride_t + col0 + h).to(tl.int64))


def new_error_record(device):
    """int64 [3]: bad-id count, smallest bad flat position, its value."""
    import torch

    return torch.tensor([0, NO_ERROR, 0], dtype=torch.int64, device=device)


def grid_size(n_tiles: int, max_sms: int | None, background: bool, device) -> int:
    """Programs of the persistent grid: at most the SMs allowed."""
    import torch

    if max_sms is None:
        max_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                   if getattr(device, "type", "cpu") == "cuda" else 4)
    if background:
        max_sms = max(1, max_sms // 2)
    return max(1, min(n_tiles, max_sms))


def lookup(weights, scales, ids, *, head_start: int, sizes, offsets, base, out, err,
           out_scales=None, block: int = 32, max_sms: int | None = None,
           background: bool = False) -> None:
    """Launch the fused lookup.  ``weights``/``scales``: uint8 ``[rows, dim]``
    / ``[rows, dim/block]`` tensors (the UVA views, or CPU tensors under the
    interpreter); ``ids`` ``[T, n_cols]`` on the same device; ``sizes``,
    ``offsets``, ``base`` int64 ``[heads]`` (bucket counts, first shard row,
    first global row or zeros); ``out`` int16 ``[T, heads, dim]`` (BF16
    bits), or uint8 with ``out_scales`` ``[T, heads, dim/block]`` for packed
    rows; ``err`` from ``new_error_record``."""
    heads, dim = len(sizes), weights.shape[1]
    n_tokens = ids.shape[0]
    if n_tokens == 0:
        return
    if ids.shape[1] > 1 and ids.stride(1) != 1:
        raise ValueError("hash ids: a token's columns must be adjacent (stride 1)")
    n_tiles = triton.cdiv(n_tokens * heads, ROWS_PER_TILE)
    packed = out_scales is not None
    grid = (grid_size(n_tiles, max_sms, background, ids.device),)
    _lookup_kernel[grid](ids, ids.stride(0), head_start, n_tokens, weights, scales, sizes,
                         offsets, base, out, out_scales if packed else out, err, n_tiles,
                         HEADS=heads, DIM=dim, BLOCK=block, ROWS=ROWS_PER_TILE, PACKED=packed)
    _record_bad_id[(1,)](ids, ids.stride(0), head_start, err, HEADS=heads)


@triton.jit
def _ple_rows_kernel(ids_ptr, n_ids, row_start, n_rows, total_rows, table_ptr, lut_ptr,
                     out_ptr, err_ptr, n_tiles, COLS: tl.constexpr, COLS_P2: tl.constexpr,
                     ROWS: tl.constexpr, LUT: tl.constexpr):
    cols = tl.arange(0, COLS_P2)
    in_row = cols < COLS
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):  # persistent grid
        pos = tile * ROWS + tl.arange(0, ROWS)
        valid = pos < n_ids
        raw = tl.load(ids_ptr + pos, mask=valid, other=0).to(tl.int64)
        bad = valid & ((raw < 0) | (raw >= total_rows))
        n_bad = tl.sum(bad.to(tl.int64), axis=0)
        if n_bad > 0:
            tl.atomic_add(err_ptr, n_bad)
            tl.atomic_min(err_ptr + 1, tl.min(tl.where(bad, pos.to(tl.int64), NO_ERROR), axis=0))
        local = raw - row_start
        mine = valid & ~bad & (local >= 0) & (local < n_rows)
        held = mine[:, None] & in_row[None, :]
        row = tl.where(mine, local, 0)
        w = tl.load(table_ptr + row[:, None] * COLS + cols[None, :], mask=held, other=0)
        if LUT:
            # a row another shard holds is zeros, not lut[0] (NaN for a NaN scale)
            w = tl.where(held, tl.load(lut_ptr + w.to(tl.int32), mask=held, other=0), 0)
        tl.store(out_ptr + pos.to(tl.int64)[:, None] * COLS + cols[None, :], w,
                 mask=valid[:, None] & in_row[None, :])


@triton.jit
def _record_bad_row(ids_ptr, err_ptr):
    pos = tl.load(err_ptr + 1)
    if pos != NO_ERROR:
        tl.store(err_ptr + 2, tl.load(ids_ptr + pos).to(tl.int64))


def ple_rows(table, ids, *, row_start: int, total_rows: int, out, err, lut=None,
             max_sms: int | None = None, background: bool = False) -> None:
    """Launch the PLE row gather on one shard (rows ``row_start ..`` of a
    layer of ``total_rows``).  ``table``: ``[rows, cols]`` (uint8 FP8 bytes,
    or int16 BF16 bits); ``ids`` contiguous 1-D int64/int32 layer row ids on
    the same device; ``out`` ``[len(ids), cols]``: int16 BF16 bits through
    ``lut`` (int16 ``[256]``, FP8 byte -> BF16 of byte x scale), else the
    table's dtype; rows another shard holds are zeros; ids outside the
    layer are zeros plus the error record (count, first position, value)."""
    n_ids = ids.shape[0]
    if n_ids == 0:
        return
    if ids.dim() != 1 or not ids.is_contiguous():
        raise ValueError("PLE row ids: the kernel takes a contiguous 1-D tensor")
    cols = table.shape[1]
    n_tiles = triton.cdiv(n_ids, ROWS_PER_TILE)
    grid = (grid_size(n_tiles, max_sms, background, ids.device),)
    _ple_rows_kernel[grid](ids, n_ids, row_start, table.shape[0], total_rows, table,
                           table if lut is None else lut, out, err, n_tiles, COLS=cols,
                           COLS_P2=triton.next_power_of_2(cols), ROWS=ROWS_PER_TILE,
                           LUT=lut is not None)
    _record_bad_row[(1,)](ids, err)
