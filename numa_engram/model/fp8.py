"""FP8 e4m3 rows with ue8m0 block scales: the dequantisation reference and a
quantiser for synthetic tables.

Value = fp8_e4m3fn(weight byte) * 2^(scale byte - 127); a scale byte covers
``block`` consecutive values; scale byte 255 and e4m3 bytes 0x7F/0xFF are
NaN.  ``dequantize_rows`` is the reference every fast path is compared with
(atol 0): torch's own float8 conversions, fp32 product, round to BF16, and
NaN written as the canonical quiet NaN 0x7FC0 (torch's vector and scalar
paths disagree on NaN bits, the reference must not).
"""

from __future__ import annotations

from typing import Any

import numpy as np

BF16_NAN_BITS = 0x7FC0
E4M3_MAX = 448.0


def _torch() -> Any:
    import torch  # lazily: storage/placement users never pay for it

    return torch


def dequantize_rows(weights_u8: Any, scales_u8: Any, block: int = 32) -> Any:
    """BF16 torch tensor ``[..., d]`` from uint8 weights ``[..., d]`` and
    uint8 scales ``[..., d / block]`` (numpy arrays or torch tensors)."""
    torch = _torch()
    w = torch.as_tensor(np.asarray(weights_u8) if not torch.is_tensor(weights_u8) else weights_u8)
    s = torch.as_tensor(np.asarray(scales_u8) if not torch.is_tensor(scales_u8) else scales_u8)
    if w.dtype != torch.uint8 or s.dtype != torch.uint8:
        raise TypeError(f"weights and scales must be uint8, got {w.dtype} and {s.dtype}")
    if w.shape[:-1] != s.shape[:-1] or w.shape[-1] != s.shape[-1] * block:
        raise ValueError(f"weights {tuple(w.shape)} and scales {tuple(s.shape)} do not match "
                         f"with {block} values per scale")
    values = w.view(torch.float8_e4m3fn).float()
    scale = s.view(torch.float8_e8m0fnu).float().repeat_interleave(block, dim=-1)
    out = (values * scale).to(torch.bfloat16)
    bits = out.view(torch.int16)
    bits.masked_fill_(torch.isnan(out), BF16_NAN_BITS)
    return out


def quantize_rows(values: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """FP8 e4m3 weights and ue8m0 scales for float rows ``[..., d]``: each
    block's scale is the smallest power of two that fits its max in e4m3."""
    torch = _torch()
    x = torch.as_tensor(np.ascontiguousarray(values, dtype=np.float32))
    if x.shape[-1] % block:
        raise ValueError(f"row width {x.shape[-1]} is not a multiple of the block {block}")
    blocks = x.reshape(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(dim=-1).clamp_min(2.0**-120)
    exp = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-127, 127)
    scale_bytes = (exp + 127).to(torch.uint8)
    q = (blocks / torch.exp2(exp).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    weights = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(x.shape)
    return weights.numpy(), scale_bytes.numpy()


def random_rows(rows: int, head_dim: int, seed: int = 0, block: int = 32,
                raw: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic rows: quantised normals, or (raw=True) uniformly random bytes,
    which include NaN weights and every scale byte."""
    rng = np.random.default_rng(seed)
    if raw:
        return (rng.integers(0, 256, size=(rows, head_dim), dtype=np.uint8),
                rng.integers(0, 256, size=(rows, head_dim // block), dtype=np.uint8))
    return quantize_rows(rng.standard_normal((rows, head_dim), dtype=np.float32), block)
