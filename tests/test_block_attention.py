"""The CPU's grouped block attention against MLX's own scaled_dot_product_attention."""

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.models.block_attention import grouped_attention


def _reference(q, k, v, scale, mask):
    """Plain attention with K/V repeated to every query head (numpy, float64)."""
    q, k, v = (np.array(a, dtype=np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    if mask is not None:
        s = np.where(np.array(mask), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("heads,kv_heads,L,S", [(8, 2, 5, 300), (4, 4, 1, 17), (6, 3, 16, 64),
                                                 (2, 1, 3, 3)])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_matches_plain_attention(heads, kv_heads, L, S, masked):
    rng = np.random.default_rng(heads * 100 + S)
    q = mx.array(rng.standard_normal((2, heads, L, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((2, kv_heads, S, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, kv_heads, S, 16)).astype(np.float32))
    mask = None
    if masked:  # a window over the context, the block's own keys always visible
        m = rng.random((L, S)) < 0.6
        m[:, S - L:] = True
        mask = mx.array(m)
    got = np.array(grouped_attention(q, k, v, 0.25, mask))
    np.testing.assert_allclose(got, _reference(q, k, v, 0.25, mask), rtol=1e-4, atol=1e-5)
    fused = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask))
    np.testing.assert_allclose(got, fused, rtol=1e-4, atol=1e-5)


def test_strided_cache_view_is_read_as_is():
    """The draft passes a slice of a larger cache buffer; rows past it must not leak in."""
    rng = np.random.default_rng(0)
    buf = mx.array(rng.standard_normal((1, 2, 64, 8)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, 4, 5, 8)).astype(np.float32))
    k, v = buf[:, :, 3:40], buf[:, :, 10:47]
    want = _reference(q, mx.contiguous(k), mx.contiguous(v), 0.5, None)
    np.testing.assert_allclose(np.array(grouped_attention(q, k, v, 0.5)), want, rtol=1e-4, atol=1e-5)
