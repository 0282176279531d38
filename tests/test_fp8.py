import ml_dtypes
import numpy as np
import pytest
import torch

from numa_engram.model.fp8 import BF16_NAN_BITS, dequantize_rows, quantize_rows, random_rows


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _independent_bf16_bits(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """ml_dtypes decodes, float64 multiply (exact), ml_dtypes rounds to bf16."""
    values = w.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scale = s.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    with np.errstate(over="ignore"):
        prod = (values * scale).astype(np.float32)  # one rounding, as fp32 does
    out = prod.astype(ml_dtypes.bfloat16).view(np.uint16).copy()
    out[np.isnan(prod)] = BF16_NAN_BITS
    return out


def test_every_weight_byte_times_every_scale_byte():
    w = np.tile(np.arange(256, dtype=np.uint8), 256).reshape(256, 256)  # row r: all weights
    s = np.repeat(np.arange(256, dtype=np.uint8), 8).reshape(256, 8)    # row r: scale byte r
    got = _bits(dequantize_rows(w, s))
    want = _independent_bf16_bits(w, np.repeat(s, 32, axis=1))
    np.testing.assert_array_equal(got, want)
    assert (got[255] == BF16_NAN_BITS).all()  # scale byte 255 is NaN
    assert (got[:, 0x7F] == BF16_NAN_BITS).all() and (got[:, 0xFF] == BF16_NAN_BITS).all()
    assert got[127, 0x38] == 0x3F80  # 1.0 * 2^0


def test_quantiser_round_trip_is_close():
    x = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32) * 3
    w, s = quantize_rows(x)
    assert w.dtype == s.dtype == np.uint8 and s.shape == (64, 4)
    back = dequantize_rows(w, s).float().numpy()
    assert np.abs(back - x).max() <= np.abs(x).max() * 0.07
    assert not np.isnan(back).any()


def test_random_raw_rows_cover_nan_bytes():
    w, s = random_rows(2000, 64, raw=True)
    assert (w == 0x7F).any() and (s == 255).any()


def test_shape_and_dtype_errors():
    with pytest.raises(ValueError, match="do not match"):
        dequantize_rows(np.zeros((2, 64), np.uint8), np.zeros((2, 3), np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_rows(np.zeros((2, 64), np.int8), np.zeros((2, 2), np.uint8))
