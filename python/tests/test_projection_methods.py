"""nystrom_attention, linformer_attention and efficient_attention from Python, against
independent NumPy implementations (numpy.linalg.pinv for the exact pseudo-inverse). float64
inputs are well conditioned here, so agreement to ~1e-10 relative checks the bindings and the
semantics; the derived rounding bounds are checked by the C++ tests."""
import numpy as np
import pytest

import linattn


def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def clustered(rng, shape, clusters, centres):
    """Runs of positions sharing a direction (as in trained models), plus unit noise."""
    n = shape[2]
    idx = np.arange(n) * clusters // n
    return rng.standard_normal(shape) + centres[:, :, idx, :]


def segments(L, m):
    return [(j * L // m, -(-(j + 1) * L // m)) for j in range(m)]


def numpy_nystrom(q, k, v, m, iters, pinv, w=None, lengths=None, scale=None):
    B, H, n, d = q.shape
    s = 1 / np.sqrt(d) if scale is None else scale
    out = np.zeros(v.shape[:3] + (v.shape[3],))
    for b in range(B):
        L = n if lengths is None else lengths[b]
        if L == 0:
            continue
        mm = min(m, L)
        for h in range(H):
            Q, K, V = q[b, h], k[b, h, :L], v[b, h, :L]
            qt = np.stack([Q[a:e].mean(0) for a, e in segments(L, mm)])
            kt = np.stack([K[a:e].mean(0) for a, e in segments(L, mm)])
            A = softmax(s * qt @ kt.T)
            if pinv == "exact":
                Z = np.linalg.pinv(A)
            else:
                Z = A.T / (np.abs(A).sum(0).max() * np.abs(A).sum(1).max())
                I = np.eye(mm)
                for _ in range(iters):
                    AV = A @ Z
                    Z = 0.25 * Z @ (13 * I - AV @ (15 * I - AV @ (7 * I - AV)))
            out[b, h] = softmax(s * Q @ kt.T) @ Z @ (softmax(s * qt @ K.T) @ V)
    if w is not None:
        K_ = w.shape[1]
        vp = v.copy()
        if lengths is not None:
            for b in range(B):
                vp[b, :, lengths[b]:] = 0
        pad = np.pad(vp, ((0, 0), (0, 0), (K_ // 2, K_ // 2), (0, 0)))
        for t in range(K_):
            out += w[None, :, t, None, None] * pad[:, :, t:t + n]
    return out


def numpy_linformer(q, k, v, e, f, lengths=None, scale=None):
    B, H, nq, d = q.shape
    nk = k.shape[2]
    s = 1 / np.sqrt(d) if scale is None else scale
    E = np.broadcast_to(e[..., :nk], (H,) + e.shape[-2:-1] + (nk,)).copy()
    F = np.broadcast_to(f[..., :nk], (H,) + f.shape[-2:-1] + (nk,)).copy()
    out = np.zeros((B, H, nq, v.shape[3]))
    for b in range(B):
        L = nk if lengths is None else lengths[b]
        for h in range(H):
            Kp = E[h, :, :L] @ k[b, h, :L]
            Vp = F[h, :, :L] @ v[b, h, :L]
            out[b, h] = softmax(s * q[b, h] @ Kp.T) @ Vp
    return out


def numpy_efficient(q, k, v, lengths=None, scale=None):
    B, H, nq, d = q.shape
    s = 1 / np.sqrt(d) if scale is None else scale
    out = np.zeros((B, H, nq, v.shape[3]))
    for b in range(B):
        L = k.shape[2] if lengths is None else lengths[b]
        if L == 0:
            continue
        rk = softmax(s * k[b, :, :L], axis=1)
        out[b] = softmax(s * q[b], axis=-1) @ (np.swapaxes(rk, 1, 2) @ v[b, :, :L])
    return out


@pytest.fixture
def inputs(rng):
    B, H, n, d, dv = 2, 3, 37, 8, 5
    centres = 2 * rng.standard_normal((B, H, 6, d))
    q = clustered(rng, (B, H, n, d), 6, centres)
    k = clustered(rng, (B, H, n, d), 6, centres)
    v = rng.standard_normal((B, H, n, dv))
    return q, k, v


@pytest.mark.parametrize("pinv", ["iterative", "exact"])
@pytest.mark.parametrize("lengths", [None, [37, 20]])
def test_nystrom_matches_numpy(inputs, rng, pinv, lengths):
    q, k, v = inputs
    w = 0.3 * rng.standard_normal((3, 5))
    got = linattn.nystrom_attention(q, k, v, num_landmarks=6, pinv=pinv, conv_weight=w, key_lengths=lengths)
    want = numpy_nystrom(q, k, v, 6, 6, pinv, w, lengths)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
    got32 = linattn.nystrom_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                      num_landmarks=6, pinv=pinv, key_lengths=lengths)
    assert got32.dtype == np.float32


def test_nystrom_defaults_and_exact_limit(inputs):
    q, k, v = inputs
    # With a landmark per position and pinv="exact", Nyström is softmax attention.
    got = linattn.nystrom_attention(q, k, v, num_landmarks=64, pinv="exact")
    want = linattn.softmax_attention(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-8)
    np.testing.assert_array_equal(linattn.nystrom_attention(q, k, v),
                                  linattn.nystrom_attention(q, k, v, num_landmarks=64, pinv_iterations=6,
                                                            pinv="iterative"))


def central_difference(f, x, g, idx, h=1e-6):
    xp, xm = x.copy(), x.copy()
    xp[idx] += h
    xm[idx] -= h
    return (np.sum(f(xp) * g) - np.sum(f(xm) * g)) / (2 * h)


def test_nystrom_backward_matches_numpy_differences(inputs, rng):
    q, k, v = (x[:, :, :11] for x in inputs)
    w = 0.3 * rng.standard_normal((3, 3))
    g = rng.standard_normal(v.shape)
    kw = dict(num_landmarks=4, conv_weight=w, key_lengths=[11, 7])
    dq, dk, dv, dw = linattn.nystrom_attention_backward(q, k, v, g, **kw)
    for x, dx, f in [(q, dq, lambda x: numpy_nystrom(x, k, v, 4, 6, "iterative", w, [11, 7])),
                     (k, dk, lambda x: numpy_nystrom(q, x, v, 4, 6, "iterative", w, [11, 7])),
                     (v, dv, lambda x: numpy_nystrom(q, k, x, 4, 6, "iterative", w, [11, 7])),
                     (w, dw, lambda x: numpy_nystrom(q, k, v, 4, 6, "iterative", x, [11, 7]))]:
        for idx in [(0,) * x.ndim, tuple(s - 1 for s in x.shape), tuple(s // 2 for s in x.shape)]:
            assert dx[idx] == pytest.approx(central_difference(f, x, g, idx), rel=1e-5, abs=1e-7)
    assert len(linattn.nystrom_attention_backward(q, k, v, g, num_landmarks=4)) == 3


@pytest.mark.parametrize("per_head", [False, True])
def test_linformer_matches_numpy(rng, per_head):
    B, H, nq, nk, d, dv = 2, 3, 17, 23, 8, 5
    q, k = rng.standard_normal((B, H, nq, d)), rng.standard_normal((B, H, nk, d))
    v = rng.standard_normal((B, H, nk, dv))
    e, f = linattn.linformer_projections(7, 30, heads=H if per_head else None, seed=3, dtype=np.float64)
    assert e.shape == ((H, 7, 30) if per_head else (7, 30))
    got = linattn.linformer_attention(q, k, v, e, f, key_lengths=[23, 9])
    want = numpy_linformer(q, k, v, e, f, [23, 9])
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
    g = rng.standard_normal(want.shape)
    grads = linattn.linformer_attention_backward(q, k, v, e, f, g, key_lengths=[23, 9])
    assert [x.shape for x in grads] == [q.shape, k.shape, v.shape, e.shape, f.shape]
    args = [q, k, v, e, f]
    for i, (x, dx) in enumerate(zip(args, grads)):
        def fn(y, i=i):
            a = list(args)
            a[i] = y
            return numpy_linformer(*a, lengths=[23, 9])
        idx = tuple(s // 3 for s in x.shape)
        assert dx[idx] == pytest.approx(central_difference(fn, x, g, idx), rel=1e-6, abs=1e-8)


def test_efficient_matches_numpy(rng):
    B, H, nq, nk, d, dv = 2, 2, 15, 19, 8, 5
    q, k = rng.standard_normal((B, H, nq, d)), rng.standard_normal((B, H, nk, d))
    v = rng.standard_normal((B, H, nk, dv))
    for lengths in [None, [19, 0]]:
        got = linattn.efficient_attention(q, k, v, key_lengths=lengths, scale=0.5)
        np.testing.assert_allclose(got, numpy_efficient(q, k, v, lengths, 0.5), rtol=1e-11, atol=1e-12)
    g = rng.standard_normal((B, H, nq, dv))
    grads = linattn.efficient_attention_backward(q, k, v, g, key_lengths=[19, 11])
    for i, (x, dx) in enumerate(zip([q, k, v], grads)):
        def fn(y, i=i):
            a = [q, k, v]
            a[i] = y
            return numpy_efficient(*a, lengths=[19, 11])
        idx = tuple(s // 2 for s in x.shape)
        assert dx[idx] == pytest.approx(central_difference(fn, x, g, idx), rel=1e-6, abs=1e-8)


def test_errors(rng):
    q = rng.standard_normal((1, 2, 10, 4)).astype(np.float32)
    e, f = linattn.linformer_projections(3, 8)
    for call in [lambda: linattn.nystrom_attention(q, q, q, causal=True),
                 lambda: linattn.linformer_attention(q, q, q, *linattn.linformer_projections(3, 10), causal=True),
                 lambda: linattn.efficient_attention(q, q, q, causal=True)]:
        with pytest.raises(ValueError, match="future positions"):
            call()
    with pytest.raises(ValueError, match="n_k = 10 exceeds n_max = 8"):
        linattn.linformer_attention(q, q, q, e, f)
    with pytest.raises(ValueError, match="pinv must be"):
        linattn.nystrom_attention(q, q, q, pinv="svd")
    with pytest.raises(ValueError, match="num_landmarks must be >= 1"):
        linattn.nystrom_attention(q, q, q, num_landmarks=0)
    with pytest.raises(TypeError, match="dtype"):
        linattn.efficient_attention(q, q, q.astype(np.float64))
    with pytest.raises(TypeError):
        linattn.nystrom_attention(q, q, q, num_landmarks=2.5)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        linattn.efficient_attention(q.tolist(), q, q)
    with pytest.raises(ValueError, match="heads must be >= 1"):
        linattn.linformer_projections(3, 8, heads=0)
