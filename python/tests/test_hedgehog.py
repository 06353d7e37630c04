"""Hedgehog feature maps (linattn.torch.feature_maps) and linear attention on given features
(feature_map="given"): against a float64 reference written as plain loops over the n×n
weights, gradients of q, k, v, W and b by central differences (torch.autograd.gradcheck in
float64), thread counts, decoding, bad input.

Tolerances. The features lie in [0, 1] and every weight A_ij = φq_i·φk_j >= 0, so an output
out_i = Σ_j A_ij v_j / (Σ_j A_ij + eps) is a weighted mean of v rows. The kernel forms num and
den as sums of at most N = n + m' + 4 rounded products in another order than the reference,
each within γ_N = N·u/(1 − N·u) relative of the sum of magnitudes (Higham §3.1). With
Σ_j |A_ij v_j| <= max|v|·den, both sums move by at most γ_N·max|v|·den and γ_N·den, so
|δout_i| <= 2γ_N·max|v| / (1 − γ_N) (first order: 2γ_N·max|v|). In float32 the features carry
errors too (see _float32_bound)."""
import math

import numpy as np
import pytest
import torch

import linattn
import linattn.torch as lt
from linattn.torch.feature_maps import HedgehogFeatureMap, hedgehog_features


def _reference_features(x, w, b):
    """float64 loops: [softmax(x·W_h + b_h), softmax(−(x·W_h + b_h))] per row."""
    B, H, n, d = x.shape
    f = w.shape[2]
    out = np.zeros((B, H, n, 2 * f))
    for bi in range(B):
        for h in range(H):
            for i in range(n):
                u = [sum(x[bi, h, i, c] * w[h, c, r] for c in range(d)) + b[h, r] for r in range(f)]
                for half, sign in ((0, 1.0), (1, -1.0)):
                    top = max(sign * ur for ur in u)
                    e = [math.exp(sign * ur - top) for ur in u]
                    s = sum(e)
                    for r in range(f):
                        out[bi, h, i, half * f + r] = e[r] / s
    return out


def _reference_attention(fq, fk, v, causal, key_lengths, eps):
    """out_i = Σ_j A_ij v_j / (Σ_j A_ij + eps) over the keys i sees, A_ij = φq_i·φk_j."""
    B, H, n_q, m = fq.shape
    n_k, dv = fk.shape[2], v.shape[3]
    out = np.zeros((B, H, n_q, dv))
    for bi in range(B):
        length = n_k if key_lengths is None else key_lengths[bi]
        for h in range(H):
            for i in range(n_q):
                end = min(length, i + 1) if causal else length
                num, den = np.zeros(dv), 0.0
                for j in range(end):
                    a = sum(fq[bi, h, i, r] * fk[bi, h, j, r] for r in range(m))
                    num += a * v[bi, h, j]
                    den += a
                out[bi, h, i] = num / (den + eps)
    return out


def _inputs(seed, B=2, H=2, n=37, d=5, f=3, dv=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return r(B, H, n, d), r(B, H, n, d), r(B, H, n, dv), r(H, d, f), r(H, f), r(H, d, f), r(H, f)


@pytest.mark.parametrize("causal,key_lengths", [(False, None), (True, None), (False, [37, 20]), (True, [37, 0])])
def test_float64_matches_the_reference(causal, key_lengths):
    q, k, v, wq, bq, wk, bk = _inputs(1)
    out = lt.hedgehog_attention(q, k, v, wq, bq, wk, bk, causal=causal, key_lengths=key_lengths)
    fq = _reference_features(q.numpy(), wq.numpy(), bq.numpy())
    fk = _reference_features(k.numpy(), wk.numpy(), bk.numpy())
    np.testing.assert_allclose(hedgehog_features(q, wq, bq).numpy(), fq, rtol=0, atol=8 * 2.0 ** -53 * 10)
    want = _reference_attention(fq, fk, v.numpy(), causal, key_lengths, 1e-6)
    n, m = q.shape[2], fq.shape[3]
    gamma = (n + m + 4) * 2.0 ** -53
    bound = 2 * gamma / (1 - gamma) * float(v.abs().max()) * 1.01  # 1.01: the features' own rounding
    assert float((out - torch.from_numpy(want)).abs().max()) <= bound


def _float32_bound(q, w, b, v, n, m):
    """The float32 bound: each feature's relative error e <= 2·max|δu| + (f + 4)u with
    |δu| <= γ_{d+1}·(Σ_c |x_c W_cr| + |b_r|) (the logit's dot product and bias; softmax's shift,
    exp within 1 ulp, its sum and division), so A_ij is within 2e of itself and num, den within
    2e + γ_N of theirs; |δout| <= 2·(2e + γ_N)·max|v| to first order."""
    u = 2.0 ** -24
    d, f = w.shape[1], w.shape[2]
    x64, w64, b64 = q.double(), w.double(), b.double()
    mag = torch.einsum("bhnd,hdf->bhnf", x64.abs(), w64.abs()) + b64.abs()[None, :, None, :]
    gamma_d = (d + 1) * u / (1 - (d + 1) * u)
    e = 2 * gamma_d * float(mag.max()) + (f + 4) * u
    gamma_n = (n + m + 4) * u
    return 2 * (2 * e + gamma_n) * float(v.abs().max()) * 1.01


@pytest.mark.parametrize("causal", [False, True])
def test_float32_within_its_derived_bound(causal):
    q, k, v, wq, bq, wk, bk = _inputs(2, n=300, d=16, f=8, dv=8, dtype=torch.float32)
    out = lt.hedgehog_attention(q, k, v, wq, bq, wk, bk, causal=causal, key_lengths=[300, 123])
    ref = lt.hedgehog_attention(*(t.double() for t in (q, k, v, wq, bq, wk, bk)), causal=causal,
                                key_lengths=[300, 123])
    bound = max(_float32_bound(q, wq, bq, v, 300, 16), _float32_bound(k, wk, bk, v, 300, 16))
    assert float((out.double() - ref).abs().max()) <= bound


@pytest.mark.parametrize("causal,key_lengths", [(False, None), (True, [9, 5])])
def test_gradients_match_central_differences(causal, key_lengths):
    """Every input with a gradient: q, k, v, both weights and both biases (float64)."""
    args = tuple(t.requires_grad_() for t in _inputs(3, n=9, d=3, f=2, dv=2))

    def f(*a):
        return lt.hedgehog_attention(*a, causal=causal, key_lengths=key_lengths)
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_given_features_equal_the_built_in_map():
    """feature_map="given" on elu(x)+1 features gives linear_attention's elu result (to the
    features' rounding: NumPy's exp against the kernel's), forward and gradients of v."""
    rng = np.random.default_rng(4)
    q, k, v, g = (rng.standard_normal((1, 2, 70, 8)) for _ in range(4))
    elu1 = lambda x: np.where(x > 0, x + 1, np.exp(x))  # noqa: E731
    for causal in (False, True):
        want = linattn.linear_attention(q, k, v, feature_map="elu", causal=causal)
        got = linattn.linear_attention(elu1(q), elu1(k), v, feature_map="given", causal=causal)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
        gv = linattn.linear_attention_backward(elu1(q), elu1(k), v, g, feature_map="given", causal=causal)[2]
        np.testing.assert_allclose(gv, linattn.linear_attention_backward(q, k, v, g, causal=causal)[2],
                                   rtol=0, atol=1e-13)


def test_decoding_state_on_given_features_equals_the_causal_output():
    q, k, v, wq, bq, wk, bk = _inputs(5, B=1, n=40)
    fq, fk = (hedgehog_features(x, w, b).numpy() for x, w, b in ((q, wq, bq), (k, wk, bk)))
    causal = lt.hedgehog_attention(q, k, v, wq, bq, wk, bk, causal=True).numpy()
    state = linattn.recurrent_state(1, 2, fq.shape[3], v.shape[3], feature_map="given", dtype=np.float64)
    first = state.prefill(fq[:, :, :25], fk[:, :, :25], v.numpy()[:, :, :25])
    steps = [state.step(*(np.ascontiguousarray(x[:, :, t]) for x in (fq, fk, v.numpy()))) for t in range(25, 40)]
    got = np.concatenate([first, np.stack(steps, axis=2)], axis=2)
    np.testing.assert_allclose(got, causal, rtol=0, atol=1e-14)


@pytest.fixture
def threads():
    saved = linattn.get_num_threads()
    yield
    linattn.set_num_threads(saved)


def test_thread_counts_give_bitwise_the_same_result(threads):
    """1, 2, 3 and 8 threads against batch·heads = 2, sequences over two causal chunks and the
    non-causal block; output and every gradient."""
    args = [t.float() for t in _inputs(6, B=1, n=1100, d=8, f=4, dv=8)]
    results = []
    for t in (1, 2, 3, 8):
        linattn.set_num_threads(t)
        for causal in (False, True):
            a = [x.clone().requires_grad_() for x in args]
            out = lt.hedgehog_attention(*a, causal=causal, key_lengths=[1000])
            out.sum().backward()
            results.append((t, causal, out.detach(), [x.grad for x in a]))
    for t, causal, out, grads in results[2:]:
        _, _, out1, grads1 = results[int(causal)]
        assert torch.equal(out, out1), (t, causal)
        assert all(torch.equal(g, g1) for g, g1 in zip(grads, grads1)), (t, causal)


def test_the_module_is_the_function_with_its_parameters():
    fmap = HedgehogFeatureMap(2, 5, 3, dtype=torch.float64)
    assert fmap.weight.shape == (2, 5, 3) and fmap.bias.shape == (2, 3) and fmap.dim == 6
    assert torch.equal(fmap.weight[1], torch.eye(5, 3, dtype=torch.float64)) and not fmap.bias.any()
    x = _inputs(7)[0]
    assert torch.equal(fmap(x), hedgehog_features(x, fmap.weight, fmap.bias))
    scaled = HedgehogFeatureMap(2, 5, 3, scale=0.5, dtype=torch.float64)
    assert torch.equal(scaled(x), hedgehog_features(0.5 * x, scaled.weight, scaled.bias))
    wide = HedgehogFeatureMap(1, 2, 4, init="random")
    assert wide.weight.abs().sum() > 0


def test_bad_input_is_refused_naming_the_argument():
    q, k, v, wq, bq, wk, bk = _inputs(8)
    with pytest.raises(ValueError, match=r"query_weight has shape \[2, 4, 3\]; expected \[heads = 2, head_dim = 5"):
        lt.hedgehog_attention(q, k, v, wq[:, :4], bq, wk, bk)
    with pytest.raises(ValueError, match=r"key_bias has shape \[2, 2\]; expected \[heads = 2, feature_dim = 3\]"):
        lt.hedgehog_attention(q, k, v, wq, bq, wk, bk[:, :2])
    with pytest.raises(TypeError, match="key_weight has dtype torch.float32, but the input has torch.float64"):
        lt.hedgehog_attention(q, k, v, wq, bq, wk.float(), bk)
    with pytest.raises(ValueError, match="query_weight has 3 features and key_weight 2"):
        lt.hedgehog_attention(q, k, v, wq, bq, wk[..., :2], bk[..., :2])
    for bad in (dict(num_heads=0), dict(feature_dim=-1), dict(head_dim=2.5)):
        kw = {**dict(num_heads=2, head_dim=5, feature_dim=3), **bad}
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            HedgehogFeatureMap(**kw)
    with pytest.raises(ValueError, match="init must be"):
        HedgehogFeatureMap(1, 2, 3, init="zeros")
    negative = torch.rand(1, 1, 4, 3, dtype=torch.float64)
    negative[0, 0, 2, 1] = -0.25
    with pytest.raises(ValueError, match=r"k holds features, which must be >= 0; got -0.25 at row 2 .*feature 1"):
        lt.linear_attention(negative.abs(), negative, negative.abs(), feature_map="given")


# ---- the NumPy functions: linattn.hedgehog_features, hedgehog_attention, and its backward ----

@pytest.mark.parametrize("causal,key_lengths", [(False, None), (True, [37, 0]), (False, [37, 20])])
def test_numpy_matches_the_reference(causal, key_lengths):
    """The same reference and bound as linattn.torch's (the same kernel on the same features)."""
    q, k, v, wq, bq, wk, bk = (t.numpy() for t in _inputs(11))
    out = linattn.hedgehog_attention(q, k, v, wq, bq, wk, bk, causal=causal, key_lengths=key_lengths)
    fq, fk = _reference_features(q, wq, bq), _reference_features(k, wk, bk)
    np.testing.assert_allclose(linattn.hedgehog_features(q, wq, bq), fq, rtol=0, atol=8 * 2.0 ** -53 * 10)
    want = _reference_attention(fq, fk, v, causal, key_lengths, 1e-6)
    gamma = (q.shape[2] + fq.shape[3] + 4) * 2.0 ** -53
    assert float(np.abs(out - want).max()) <= 2 * gamma / (1 - gamma) * float(np.abs(v).max()) * 1.01


@pytest.mark.parametrize("causal,key_lengths", [(False, None), (True, [9, 5])])
def test_numpy_backward_matches_central_differences(causal, key_lengths):
    """Every gradient (dq, dk, dv, d_query_weight, d_query_bias, d_key_weight, d_key_bias)
    against central differences of the NumPy forward in float64, step h = 1e-6: the truncation
    error is h²/6·|f'''| (about 1e-12 here: every third derivative is O(1)) and the rounding
    u·|f|/h (about 1e-10), so 1e-8 absolute holds with margin."""
    args = [t.numpy() for t in _inputs(12, n=9, d=3, f=2, dv=2)]
    dout = np.random.default_rng(5).standard_normal((2, 2, 9, 2))
    grads = linattn.hedgehog_attention_backward(*args, dout, causal=causal, key_lengths=key_lengths)
    assert len(grads) == 7
    h = 1e-6
    for which, grad in enumerate(grads):
        x = args[which]
        numeric = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            saved = x[index]
            values = []
            for step in (h, -h):
                x[index] = saved + step
                values.append(float((linattn.hedgehog_attention(*args, causal=causal, key_lengths=key_lengths)
                                     * dout).sum()))
            x[index] = saved
            numeric[index] = (values[0] - values[1]) / (2 * h)
        assert float(np.abs(grad - numeric).max()) <= 1e-8, which


def test_numpy_float32_equals_torch_and_keeps_its_dtype():
    """float32: the NumPy and torch paths run the same kernel on features computed in another
    order (NumPy's einsum and softmax against torch's), so they agree to the float32 bound."""
    args = _inputs(13, n=40, d=8, f=4, dv=4, dtype=torch.float32)
    out = linattn.hedgehog_attention(*(t.numpy() for t in args), causal=True)
    assert out.dtype == np.float32
    ref = lt.hedgehog_attention(*(t.double() for t in args), causal=True).numpy()
    bound = max(_float32_bound(args[0], args[3], args[4], args[2], 40, 8),
                _float32_bound(args[1], args[5], args[6], args[2], 40, 8))
    assert float(np.abs(out - ref).max()) <= bound
    grads = linattn.hedgehog_attention_backward(*(t.numpy() for t in args), np.ones_like(out), causal=True)
    assert all(g.dtype == np.float32 for g in grads)


def test_numpy_bad_input_is_refused_naming_the_argument():
    q, k, v, wq, bq, wk, bk = (t.numpy() for t in _inputs(14, n=5))
    with pytest.raises(ValueError, match="query_weight has shape"):
        linattn.hedgehog_attention(q, k, v, wq[:, :-1], bq, wk, bk)
    with pytest.raises(ValueError, match="key_bias has shape"):
        linattn.hedgehog_attention(q, k, v, wq, bq, wk, bk[:, :-1])
    with pytest.raises(TypeError, match="key_weight has dtype float32"):
        linattn.hedgehog_attention(q, k, v, wq, bq, wk.astype(np.float32), bk)
    with pytest.raises(ValueError, match="q has a non-finite value"):
        linattn.hedgehog_attention(q * np.nan, k, v, wq, bq, wk, bk)
    with pytest.raises(TypeError, match="query_bias must be a numpy.ndarray"):
        linattn.hedgehog_attention(q, k, v, wq, list(bq), wk, bk)
    with pytest.raises(ValueError, match="they must match"):
        linattn.hedgehog_attention(q, k, v, wq, bq, wk[..., :2], bk[:, :2])
    with pytest.raises(ValueError, match="^hedgehog_attention: key_lengths"):
        linattn.hedgehog_attention(q, k, v, wq, bq, wk, bk, key_lengths=[5])
    with pytest.raises(ValueError, match="^hedgehog_attention: k has shape"):
        linattn.hedgehog_attention(q, k[:1], v, wq, bq, wk, bk)
    with pytest.raises(ValueError, match="^hedgehog_attention_backward: dout"):
        linattn.hedgehog_attention_backward(q, k, v, wq, bq, wk, bk, v[..., :1])
