"""The feature maps on their own from Python: linattn.features / feature_logits (NumPy) and
linattn.torch.features / feature_logits (autograd). The C++ tests (tests/test_features.cc) hold
them to the float64 reference; here: the bindings give what the attention functions use
(linear_attention with a map equals linear_attention on the given features), torch's gradients
equal the NumPy backwards and central differences, and bad input raises."""

import numpy as np
import pytest
import torch

import linattn
import linattn.torch as lt

RNG = np.random.default_rng(7)


def _x(shape=(2, 3, 9, 5), dtype=np.float64):
    return RNG.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("feature_map, power", [("elu", 3.0), ("relu", 3.0), ("focused", 3.0), ("focused", 7.5)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_features_are_what_linear_attention_uses(feature_map, power, dtype):
    q, k, v = _x(dtype=dtype), _x(dtype=dtype), _x(dtype=dtype)
    fq = linattn.features(q, feature_map, focus_power=power)
    fk = linattn.features(k, feature_map, focus_power=power)
    assert fq.shape == q.shape and fq.dtype == dtype and (fq >= 0).all()
    opts = {"focus_power": power} if feature_map == "focused" else {}
    mapped = linattn.linear_attention(q, k, v, feature_map=feature_map, causal=True, **opts)
    given = linattn.linear_attention(fq, fk, v, feature_map="given", causal=True)
    # The same features, the same kernel: equal to the last bits but for summation order.
    np.testing.assert_allclose(mapped, given, rtol=50 * np.finfo(dtype).eps, atol=50 * np.finfo(dtype).eps)


@pytest.mark.parametrize("kernel", ["positive", "hyperbolic", "trig"])
@pytest.mark.parametrize("side", ["key", "query", "query_with_norm"])
def test_torch_logits_gradients(kernel, side):
    x = torch.randn(1, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, dtype=torch.float64)

    def f(x):
        logits, factors = lt.feature_logits(x, w, kernel=kernel, scale=0.4, side=side)
        assert (factors is not None) == (kernel == "trig")
        return (logits,) if factors is None else (logits, factors)
    assert torch.autograd.gradcheck(f, (x,))
    # The NumPy pair gives the same.
    logits, factors = linattn.feature_logits(x.detach().numpy(), w.numpy(), kernel=kernel, scale=0.4, side=side)
    torch.testing.assert_close(torch.from_numpy(logits), f(x)[0], rtol=0, atol=0)
    if kernel == "trig":  # only the factors' gradient: dlogits absent
        x.grad = None
        lt.feature_logits(x, w, kernel=kernel, scale=0.4, side=side)[1].sum().backward()
        g = linattn.feature_logits_backward(x.detach().numpy(), w.numpy(), np.zeros_like(logits),
                                            np.ones_like(factors), kernel=kernel, scale=0.4, side=side)
        np.testing.assert_array_equal(x.grad.numpy(), g)


@pytest.mark.parametrize("feature_map", ["elu", "relu", "focused", "given"])
def test_torch_features_gradients(feature_map):
    x = torch.randn(2, 1, 3, 4, dtype=torch.float64)
    if feature_map == "given":
        x = x.abs() + 0.1
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: lt.features(x, feature_map, focus_power=2.5), (x,))


def test_bad_input():
    x = _x()
    w = _x((4, 5))
    with pytest.raises(ValueError, match="feature_map must be"):
        linattn.features(x, "softmax")
    with pytest.raises(ValueError, match="is in log form: use feature_logits"):
        linattn.features(x, "favor")
    with pytest.raises(ValueError, match=r"focus_power must be a number in \[1, 1000\]"):
        linattn.features(x, "focused", focus_power=0.5)
    with pytest.raises(ValueError, match="x must be \\[batch, heads, n, head_dim\\]"):
        linattn.features(x[0], "elu")
    bad = x.copy()
    bad[0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="features: x"):
        linattn.features(bad, "elu")
    with pytest.raises(ValueError, match="side must be"):
        linattn.feature_logits(x, w, side="keys")
    with pytest.raises(ValueError, match="projection has shape"):
        linattn.feature_logits(x, w[:, :4])
    with pytest.raises(ValueError, match="dfactors is only used with kernel=\"trig\""):
        linattn.feature_logits_backward(x, w, np.zeros((2, 3, 9, 4)), np.zeros((2, 3, 9, 4)))
    with pytest.raises(TypeError, match="torch.float32 or torch.float64"):
        lt.features(torch.randn(1, 1, 2, 3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        lt.features(x)
    with pytest.raises(ValueError, match="projection has requires_grad=True"):
        lt.feature_logits(torch.from_numpy(x), torch.from_numpy(w).requires_grad_(True))
    with pytest.raises(TypeError, match="projection has dtype"):
        lt.feature_logits(torch.from_numpy(x), torch.from_numpy(w).float())


def test_torch_hedgehog_features_gradients_of_every_input():
    """linattn.torch.hedgehog_features runs the C++ map (linattn.hedgehog_features) and its
    backward: torch's gradcheck for x, weight and bias against central differences."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=g).requires_grad_()
    w = (0.7 * torch.randn(2, 4, 3, dtype=torch.float64, generator=g)).requires_grad_()
    b = (0.3 * torch.randn(2, 3, dtype=torch.float64, generator=g)).requires_grad_()
    assert torch.autograd.gradcheck(lt.hedgehog_features, (x, w, b))


def test_hedgehog_backward_in_numpy_equals_torch_autograd():
    rng = np.random.default_rng(4)
    x, w, b, g = rng.standard_normal((1, 3, 7, 4)), rng.standard_normal((3, 4, 2)), rng.standard_normal((3, 2)), \
        rng.standard_normal((1, 3, 7, 4))
    dx, dw, db = linattn.hedgehog_features_backward(x, w, b, g)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    (lt.hedgehog_features(xt, wt, bt) * torch.tensor(g)).sum().backward()
    for got, t in ((dx, xt), (dw, wt), (db, bt)):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_hedgehog_16_bit_runs_in_float32_rounded_once(dtype):
    g = torch.Generator().manual_seed(5)
    x, w, b = (torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in ((1, 2, 6, 4), (2, 4, 3), (2, 3)))
    phi = lt.hedgehog_features(x, w, b)
    want = lt.hedgehog_features(x.float(), w.float(), b.float())
    assert phi.dtype == dtype and torch.equal(phi, want.to(dtype))
    phi.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == dtype


def test_torch_hedgehog_compiles_and_runs_on_meta_tensors():
    x, w, b = torch.randn(1, 2, 5, 4), torch.randn(2, 4, 3), torch.randn(2, 3)
    compiled = torch.compile(lt.hedgehog_features, fullgraph=True)
    torch.testing.assert_close(compiled(x, w, b), lt.hedgehog_features(x, w, b), rtol=0, atol=0)
    meta = lt.hedgehog_features(*(t.to("meta") for t in (x, w, b)))
    assert meta.shape == (1, 2, 5, 6) and meta.device.type == "meta"


def test_hedgehog_bad_input():
    x, w, b = torch.randn(1, 2, 5, 4), torch.randn(2, 4, 3), torch.randn(2, 3)
    with pytest.raises(ValueError, match="weight has shape \\[2, 4, 2\\]|bias has shape"):
        lt.hedgehog_features(x, w, b[:, :2])
    with pytest.raises(TypeError, match="weight has dtype torch.float64"):
        lt.hedgehog_features(x, w.double(), b)
    bad = w.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="hedgehog_features: weight has a non-finite value"):
        lt.hedgehog_features(x, bad, b)
    with pytest.raises(ValueError, match="dphi has shape"):
        linattn.hedgehog_features_backward(x.numpy(), w.numpy(), b.numpy(), np.zeros((1, 2, 5, 5), np.float32))
