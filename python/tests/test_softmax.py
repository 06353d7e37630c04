"""softmax_attention from Python: against an independent NumPy float64 implementation, every
mask, both dtypes and thread counts; gradients by finite differences; errors as exceptions."""
import numpy as np
import pytest

import linattn


def visible_counts(n_q, n_k, causal, key_lengths, batch):
    """vis[b, i]: query i of item b sees keys [0, vis[b, i])."""
    lengths = np.full(batch, n_k) if key_lengths is None else np.asarray(key_lengths)
    vis = np.repeat(lengths[:, None], n_q, axis=1)
    if causal:
        vis = np.minimum(vis, np.arange(n_q)[None, :] + (n_k - n_q) + 1)
    return np.maximum(vis, 0)


def numpy_attention(q, k, v, dout=None, causal=False, scale=None, key_lengths=None):
    """Dense float64 attention and its gradients, written from the formulas."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    B, H, n_q, d = q.shape
    n_k = k.shape[2]
    scale = 1 / np.sqrt(d) if scale is None else scale
    vis = visible_counts(n_q, n_k, causal, key_lengths, B)
    allowed = np.arange(n_k)[None, None, :] < vis[:, :, None]  # [B, n_q, n_k]
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    s = np.where(allowed[:, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    denom = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
    out = p @ v
    with np.errstate(divide="ignore"):
        lse = np.where(denom[..., 0] > 0, np.log(denom[..., 0]) + m[..., 0], -np.inf)
    if dout is None:
        return out, lse
    dout = dout.astype(np.float64)
    dp = dout @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    return out, lse, (scale * ds @ k, scale * ds.transpose(0, 1, 3, 2) @ q,
                      p.transpose(0, 1, 3, 2) @ dout)


def make(rng, B, H, n_q, n_k, d, dv, dtype):
    q = rng.standard_normal((B, H, n_q, d)).astype(dtype)
    k = rng.standard_normal((B, H, n_k, d)).astype(dtype)
    v = rng.standard_normal((B, H, n_k, dv)).astype(dtype)
    dout = rng.standard_normal((B, H, n_q, dv)).astype(dtype)
    return q, k, v, dout


MASKS = [
    dict(),
    dict(causal=True),
    dict(key_lengths=[9, 0, 4]),
    dict(causal=True, key_lengths=[9, 0, 4]),
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("n_q,n_k", [(1, 9), (7, 9), (9, 9), (12, 9)])
@pytest.mark.parametrize("threads", [1, 2])
def test_float64_matches_numpy(rng, mask, n_q, n_k, threads):
    linattn.set_num_threads(threads)
    q, k, v, dout = make(rng, 3, 2, n_q, n_k, 16, 8, np.float64)
    out, lse, grads = numpy_attention(q, k, v, dout, **mask)
    got, got_lse = linattn.softmax_attention(q, k, v, return_lse=True, **mask)
    # float64 arithmetic on O(1) values with at most 16-term sums: errors ~1e-15.
    np.testing.assert_allclose(got, out, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(lse))
    np.testing.assert_allclose(got_lse[np.isfinite(lse)], lse[np.isfinite(lse)], rtol=0, atol=1e-12)
    for name, g, want in zip("qkv", linattn.softmax_attention_backward(q, k, v, dout, **mask), grads):
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-12, err_msg=f"d{name}")
    saved = linattn.softmax_attention_backward(q, k, v, dout, out=got, lse=got_lse, **mask)
    for g, want in zip(saved, grads):
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mask", MASKS)
def test_float32_within_derived_bound(rng, mask):
    n, d = 300, 64
    q, k, v, _ = make(rng, 3, 2, n, n, d, d, np.float32)
    mask = {**mask, **({"key_lengths": [n, 0, 123]} if "key_lengths" in mask else {})}
    out, _ = numpy_attention(q, k, v, **mask)
    got = linattn.softmax_attention(q, k, v, **mask)
    assert got.dtype == np.float32 and got.shape == out.shape
    # The bound of docs/methods/softmax.md, row-wise maxima taken over all keys (looser):
    # |δout| <= (2η + γ_{n+16})·max|v|, η = 2·γ_{d+1}·scale·max_j Σ|q_i||k_j| + 4u.
    u = 2.0**-24
    gamma = lambda m: m * u / (1 - m * u)
    absdot = np.einsum("bhid,bhjd->bhij", np.abs(q.astype(np.float64)), np.abs(k.astype(np.float64)))
    eta = 2 * gamma(d + 1) * absdot.max(-1) / np.sqrt(d) + 4 * u
    bound = (2 * eta + gamma(n + 16))[..., None] * np.abs(v).max()
    assert np.all(np.abs(got - out) <= bound)


def test_gradient_by_central_differences(rng):
    q, k, v, g = make(rng, 2, 2, 5, 6, 4, 3, np.float64)
    opts = dict(causal=True, key_lengths=[6, 3], scale=0.8)
    grads = linattn.softmax_attention_backward(q, k, v, g, **opts)
    h = 1e-5  # truncation ~h², cancellation ~1e-16/h: both ~1e-11 here
    for x, gx in zip((q, k, v), grads):
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            x0 = x[idx]
            x[idx] = x0 + h
            lp = np.sum(linattn.softmax_attention(q, k, v, **opts) * g)
            x[idx] = x0 - h
            lm = np.sum(linattn.softmax_attention(q, k, v, **opts) * g)
            x[idx] = x0
            fd[idx] = (lp - lm) / (2 * h)
        np.testing.assert_allclose(gx, fd, rtol=1e-7, atol=1e-7)


def test_non_contiguous_inputs_are_accepted(rng):
    q, k, v, _ = make(rng, 1, 2, 8, 8, 16, 16, np.float64)
    qt = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # strided view
    assert not qt.flags.c_contiguous
    np.testing.assert_array_equal(linattn.softmax_attention(qt, k, v), linattn.softmax_attention(q, k, v))


def test_output_owns_its_memory(rng):
    q, k, v, _ = make(rng, 1, 1, 4, 4, 8, 8, np.float32)
    out = linattn.softmax_attention(q, k, v)
    assert out.flags.c_contiguous and out.flags.writeable
    del q, k, v
    out += 1  # still valid after the inputs are gone


def test_rows_without_keys_are_zero(rng):
    q, k, v, _ = make(rng, 2, 1, 3, 5, 4, 4, np.float32)
    out, lse = linattn.softmax_attention(q, k, v, key_lengths=[0, 5], return_lse=True)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    assert np.all(np.isfinite(out))


# ---- errors ---------------------------------------------------------------------------------

def test_wrong_dtype_is_type_error(rng):
    q, k, v, _ = make(rng, 1, 1, 4, 4, 8, 8, np.float32)
    with pytest.raises(TypeError, match="k must have dtype float32, float64, bfloat16 .* or float16, got int64"):
        linattn.softmax_attention(q, k.astype(np.int64), v)
    with pytest.raises(TypeError, match="v has dtype float64 but q has float32"):
        linattn.softmax_attention(q, k, v.astype(np.float64))
    with pytest.raises(TypeError, match="q must be a numpy.ndarray or a CPU array with __dlpack__, got list"):
        linattn.softmax_attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match="key_lengths must hold integers"):
        linattn.softmax_attention(q, k, v, key_lengths=[2.5])
    with pytest.raises(TypeError, match="scale must be a float"):
        linattn.softmax_attention(q, k, v, scale="big")


def test_bad_shapes_and_options_are_value_errors(rng):
    q, k, v, dout = make(rng, 2, 1, 4, 5, 8, 8, np.float32)
    with pytest.raises(ValueError, match=r"k has shape \[2, 1, 5, 7\]; expected \[2, 1, n_k, 8\]"):
        linattn.softmax_attention(q, k[..., :7], v)
    with pytest.raises(ValueError, match="q must have rank 4"):
        linattn.softmax_attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"key_lengths\[1\] = 6; expected 0 <= key_lengths\[b\] <= n_k = 5"):
        linattn.softmax_attention(q, k, v, key_lengths=[1, 6])
    with pytest.raises(ValueError, match="key_lengths has 1 entries"):
        linattn.softmax_attention(q, k, v, key_lengths=[1])
    with pytest.raises(ValueError, match="scale must be finite"):
        linattn.softmax_attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="dout has shape"):
        linattn.softmax_attention_backward(q, k, v, dout[:, :, :3])
    with pytest.raises(ValueError, match="pass out and lse .from the forward., or none of them"):
        linattn.softmax_attention_backward(q, k, v, dout, out=dout)
    with pytest.raises(ValueError, match=r"n must be in \[1, 1024\]"):
        linattn.set_num_threads(0)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_finite_inputs_are_value_errors(rng, which):
    arrays = dict(zip("qkv", make(rng, 1, 2, 4, 4, 8, 8, np.float32)[:3]))
    arrays[which][0, 1, 2, 3] = np.nan
    with pytest.raises(ValueError, match=rf"{which} has a non-finite value \(nan\) at \[0, 1, 2, 3\]"):
        linattn.softmax_attention(arrays["q"], arrays["k"], arrays["v"])


def test_nan_in_padded_keys_is_ignored(rng):
    q, k, v, _ = make(rng, 1, 1, 4, 6, 8, 8, np.float64)
    clean = linattn.softmax_attention(q, k, v, key_lengths=[4])
    k[..., 4:, :] = np.nan
    v[..., 4:, :] = np.inf
    np.testing.assert_array_equal(linattn.softmax_attention(q, k, v, key_lengths=[4]), clean)


def test_zero_sizes(rng):
    q = np.zeros((0, 2, 3, 4), np.float32)
    assert linattn.softmax_attention(q, q, q).shape == (0, 2, 3, 4)
    q = np.ones((1, 1, 3, 4), np.float32)
    k = np.zeros((1, 1, 0, 4), np.float32)
    out = linattn.softmax_attention(q, k, k)
    assert out.shape == (1, 1, 3, 4) and np.all(out == 0)
