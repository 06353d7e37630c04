"""linear_attention, favor_attention, random_features and recurrent_state from Python, against
an independent NumPy implementation and SciPy's chi-square distribution."""
import numpy as np
import pytest
import scipy.stats

import linattn


def features(x, name, w=None, scale=None, p=3.0):
    """φ(x) for x [..., n, d] by the textbook formulas, float64."""
    x = x.astype(np.float64)
    if name == "elu":
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))
    if name == "relu":
        return np.maximum(x, 0)
    if name == "focused":
        r = np.maximum(x, 0)
        a = r**p
        na = np.linalg.norm(a, axis=-1, keepdims=True)
        return np.divide(np.linalg.norm(r, axis=-1, keepdims=True) * a, na, out=np.zeros_like(a), where=na > 0)
    d = x.shape[-1]
    xt = x * np.sqrt(1 / np.sqrt(d) if scale is None else scale)
    u = xt @ w.astype(np.float64).T
    h = 0.5 * np.sum(xt * xt, axis=-1, keepdims=True)
    m = w.shape[0]
    if name == "positive":
        return np.exp(u - h) / np.sqrt(m)
    if name == "hyperbolic":
        return np.concatenate([np.exp(u - h), np.exp(-u - h)], -1) / np.sqrt(2 * m)
    return np.exp(h) / np.sqrt(m) * np.concatenate([np.sin(u), np.cos(u)], -1)


def numpy_kernelized(q, k, v, fq, fk, causal=False, key_lengths=None, eps=0.0):
    B, H, n_q, _ = q.shape
    n_k = k.shape[2]
    a = fq @ np.swapaxes(fk, -1, -2)  # [B,H,n_q,n_k]
    allowed = np.ones((B, n_q, n_k), bool)
    if key_lengths is not None:
        allowed &= np.arange(n_k)[None, None, :] < np.asarray(key_lengths)[:, None, None]
    if causal:
        allowed &= np.arange(n_k)[None, None, :] <= np.arange(n_q)[None, :, None]
    a = np.where(allowed[:, None], a, 0)
    den = a.sum(-1, keepdims=True) + eps
    return np.divide(a @ v.astype(np.float64), den, out=np.zeros(q.shape[:3] + (v.shape[-1],)), where=den != 0)


def dwc_numpy(v, w, causal, key_lengths=None):
    B, H, n, dv = v.shape
    K = w.shape[1]
    off = K - 1 if causal else (K - 1) // 2
    vz = v.astype(np.float64).copy()
    if key_lengths is not None:
        for b, L in enumerate(key_lengths):
            vz[b, :, L:] = 0
    out = np.zeros_like(vz)
    for t in range(K):
        shift = t - off
        for i in range(n):
            j = i + shift
            if 0 <= j < n:
                out[:, :, i] += w[None, :, t, None] * vz[:, :, j]
    return out


MASKS = [dict(), dict(causal=True), dict(key_lengths=[30, 0, 17]), dict(causal=True, key_lengths=[30, 0, 17])]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name", ["elu", "relu", "focused"])
def test_linear_attention_matches_numpy(rng, mask, name):
    q, k, v = (rng.standard_normal((3, 2, 30, 8)) for _ in range(3))
    want = numpy_kernelized(q, k, v, features(q, name), features(k, name), eps=1e-6, **mask)
    got = linattn.linear_attention(q, k, v, feature_map=name, **mask)
    # float64, sums of <= 30·8 terms of size O(1): errors ~1e-14.
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kernel", ["positive", "hyperbolic", "trig"])
def test_favor_attention_matches_numpy(rng, mask, kernel):
    q, k, v = (rng.standard_normal((3, 2, 30, 8)) * (0.5 if kernel == "trig" else 1) for _ in range(3))
    w = linattn.random_features(32, 8, seed=3, dtype=np.float64)
    want = numpy_kernelized(q, k, v, features(q, kernel, w), features(k, kernel, w), **mask)
    got = linattn.favor_attention(q, k, v, w, kernel=kernel, **mask)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_dwc_weight(rng, causal):
    q, k, v = (rng.standard_normal((2, 3, 25, 6)) for _ in range(3))
    w = rng.standard_normal((3, 4 if causal else 5))
    lengths = [25, 11]
    base = numpy_kernelized(q, k, v, features(q, "focused"), features(k, "focused"), causal=causal,
                            key_lengths=lengths, eps=1e-6)
    got = linattn.linear_attention(q, k, v, feature_map="focused", causal=causal, key_lengths=lengths, conv_weight=w)
    np.testing.assert_allclose(got, base + dwc_numpy(v, w, causal, lengths), rtol=1e-11, atol=1e-12)
    g = rng.standard_normal(got.shape)
    grads = linattn.linear_attention_backward(q, k, v, g, feature_map="focused", causal=causal,
                                              key_lengths=lengths, conv_weight=w)
    assert len(grads) == 4 and grads[3].shape == w.shape
    # d/dw of sum(g * out) by central differences (out is linear in w: exact up to rounding).
    h = 1e-4
    for idx in np.ndindex(w.shape):
        wp, wm = w.copy(), w.copy()
        wp[idx] += h
        wm[idx] -= h
        fd = (np.sum(g * linattn.linear_attention(q, k, v, feature_map="focused", causal=causal,
                                                  key_lengths=lengths, conv_weight=wp))
              - np.sum(g * linattn.linear_attention(q, k, v, feature_map="focused", causal=causal,
                                                    key_lengths=lengths, conv_weight=wm))) / (2 * h)
        assert abs(grads[3][idx] - fd) <= 1e-8 * (1 + abs(fd))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("method", ["elu", "focused_dwc", "positive", "trig"])
def test_backward_from_saved_equals_recomputed(rng, method, causal):
    """The forward's out, den and state give the backward bitwise what it computes without them."""
    q, k, v, g = (rng.standard_normal((2, 2, 150, 8)).astype(np.float32) for _ in range(4))
    if method in ("positive", "trig"):
        w = linattn.random_features(16, 8, seed=3)
        fwd = lambda **kw: linattn.favor_attention(q, k, v, w, kernel=method, causal=causal, key_lengths=[150, 90], **kw)
        bwd = lambda **kw: linattn.favor_attention_backward(q, k, v, w, g, kernel=method, causal=causal,
                                                            key_lengths=[150, 90], **kw)
        features = 16 if method == "positive" else 32
    else:
        opts = dict(feature_map=method.split("_")[0], causal=causal, key_lengths=[150, 90])
        if method.endswith("dwc"):
            opts["conv_weight"] = rng.standard_normal((2, 3)).astype(np.float32)
        fwd = lambda **kw: linattn.linear_attention(q, k, v, **opts, **kw)
        bwd = lambda **kw: linattn.linear_attention_backward(q, k, v, g, **opts, **kw)
        features = 8
    out, den, state = fwd(return_den=True, return_state=True)
    assert den.shape == (2, 2, 150) and state.shape == (2, 2, features, 10)
    np.testing.assert_array_equal(out, fwd())
    for got, want in zip(bwd(out=out, den=den, state=state), bwd()):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="pass out, den and state .from the forward., or none of them"):
        bwd(out=out, den=den)


def test_favor_gradient_by_central_differences(rng):
    q, k, v = (rng.standard_normal((1, 2, 9, 4)) for _ in range(3))
    g = rng.standard_normal((1, 2, 9, 4))
    w = linattn.random_features(16, 4, seed=1, dtype=np.float64)
    opts = dict(kernel="positive", causal=True, key_lengths=[7])
    grads = linattn.favor_attention_backward(q, k, v, w, g, **opts)
    h = 1e-5
    for x, gx in zip((q, k, v), grads):
        for idx in np.ndindex(x.shape):
            x0 = x[idx]
            x[idx] = x0 + h
            lp = np.sum(g * linattn.favor_attention(q, k, v, w, **opts))
            x[idx] = x0 - h
            lm = np.sum(g * linattn.favor_attention(q, k, v, w, **opts))
            x[idx] = x0
            assert abs(gx[idx] - (lp - lm) / (2 * h)) <= 1e-7 * (1 + abs(gx[idx]))


# ---- random features -----------------------------------------------------------------------

def test_random_features_are_reproducible():
    a = linattn.random_features(100, 16, kind="orthogonal", seed=5)
    assert a.dtype == np.float32 and a.shape == (100, 16)
    np.testing.assert_array_equal(a, linattn.random_features(100, 16, kind="orthogonal", seed=5))
    assert not np.array_equal(a, linattn.random_features(100, 16, kind="orthogonal", seed=6))
    b = linattn.random_features(100, 16, kind="orthogonal", seed=5, dtype=np.float64)
    np.testing.assert_array_equal(a, b.astype(np.float32))


def test_quantile_radii_match_scipy():
    for m, d in [(10, 4), (256, 64), (7, 1)]:
        want = np.sqrt(scipy.stats.chi2.ppf(np.arange(1, m + 1) / (m + 1), d))
        np.testing.assert_allclose(linattn.chi_quantile_radii(m, d), want, rtol=1e-10)
        w = linattn.random_features(m, d, kind="quantile", seed=2, dtype=np.float64)
        np.testing.assert_allclose(np.sort(np.linalg.norm(w, axis=1)), want, rtol=1e-10)


def test_orthogonal_norms_pass_ks_test_against_chi():
    d = 32
    w = linattn.random_features(64 * d, d, kind="orthogonal", seed=9, dtype=np.float64)
    assert scipy.stats.kstest(np.linalg.norm(w, axis=1), scipy.stats.chi(d).cdf).pvalue > 0.001
    blocks = w[: 2 * d].reshape(2, d, d)
    for blk in blocks:
        u = blk / np.linalg.norm(blk, axis=1, keepdims=True)
        np.testing.assert_allclose(u @ u.T, np.eye(d), atol=1e-13)


# ---- recurrent state -----------------------------------------------------------------------

@pytest.mark.parametrize("feature_map", ["elu", "relu", "focused", "favor"])
def test_recurrent_state_matches_causal(rng, feature_map):
    B, H, n, d, dv = 2, 2, 40, 8, 4
    q, k = rng.standard_normal((2, B, H, n, d))
    v = rng.standard_normal((B, H, n, dv))
    w = linattn.random_features(16, d, seed=1, dtype=np.float64) if feature_map == "favor" else None
    if w is None:
        full = linattn.linear_attention(q, k, v, feature_map=feature_map, causal=True)
    else:
        full = linattn.favor_attention(q, k, v, w, causal=True)
    st = linattn.recurrent_state(B, H, d, dv, feature_map=feature_map, projection=w, dtype=np.float64)
    first = st.prefill(q[:, :, :25], k[:, :, :25], v[:, :, :25])
    np.testing.assert_allclose(first, full[:, :, :25], rtol=1e-11, atol=1e-12)
    saved = st.copy()
    outs = [st.step(q[:, :, t], k[:, :, t], v[:, :, t]) for t in range(25, n)]
    np.testing.assert_allclose(np.stack(outs, 2), full[:, :, 25:], rtol=1e-11, atol=1e-12)
    assert st.tokens == n and saved.tokens == 25
    np.testing.assert_array_equal(saved.step(q[:, :, 25], k[:, :, 25], v[:, :, 25]), outs[0])


def test_recurrent_state_errors(rng):
    w = linattn.random_features(8, 4)
    with pytest.raises(ValueError, match="needs a projection"):
        linattn.recurrent_state(1, 1, 4, 4, feature_map="favor")
    with pytest.raises(ValueError, match="projection is only used"):
        linattn.recurrent_state(1, 1, 4, 4, feature_map="elu", projection=w)
    with pytest.raises(ValueError, match="kernel is only used"):
        linattn.recurrent_state(1, 1, 4, 4, feature_map="elu", kernel="trig")
    st = linattn.recurrent_state(1, 1, 4, 4, feature_map="favor", projection=w)
    assert st.dtype == np.float32
    with pytest.raises(TypeError, match="the state is float32"):
        st.step(*(np.zeros((1, 1, 4)) for _ in range(3)))
    with pytest.raises(ValueError, match="q_t has shape"):
        st.step(*(np.zeros((1, 2, 4), np.float32) for _ in range(3)))


# ---- errors --------------------------------------------------------------------------------

def test_kernelized_errors(rng):
    q = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    w = linattn.random_features(16, 8)
    with pytest.raises(ValueError, match="feature_map must be"):
        linattn.linear_attention(q, k, k, feature_map="softmax")
    with pytest.raises(ValueError, match="causal=true needs n_q == n_k"):
        linattn.linear_attention(q, k, k, causal=True)
    with pytest.raises(ValueError, match="kernel must be"):
        linattn.favor_attention(q, k, k, w, kernel="cosh")
    with pytest.raises(TypeError, match="projection has dtype float64 but q has float32"):
        linattn.favor_attention(q, k, k, w.astype(np.float64))
    with pytest.raises(ValueError, match="projection has shape"):
        linattn.favor_attention(q, k, k, linattn.random_features(16, 7))
    with pytest.raises(ValueError, match="kind must be one of"):
        linattn.random_features(16, 8, kind="gaussian")
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        linattn.random_features(16, 8, dtype=np.int32)
    with pytest.raises(ValueError, match="conv_weight needs an odd K"):
        linattn.linear_attention(k, k, k, conv_weight=np.ones((2, 4), np.float32))
