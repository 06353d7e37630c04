"""linattn.torch.state: the state operations through torch, their autograd (gradcheck in
float64 through every chain the distributed path uses) and their errors. The C++ tests
(tests/test_state_ops.cc) hold the kernels to the float64 reference and to central differences."""

import pytest
import torch

import linattn
import linattn.torch as lt
from linattn.torch import state as st

MAPS = ["elu", "relu", "focused", "given", "positive", "hyperbolic", "trig"]


def _opts(name, d):
    if name in ("positive", "hyperbolic", "trig"):
        w = torch.from_numpy(linattn.random_features(8, d, seed=3, dtype="float64"))
        return dict(feature_map="favor", kernel=name, projection=w)
    return dict(feature_map=name)


def _inputs(name, n, d=4, dv=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, x, generator=gen, dtype=torch.float64) for x in (d, d, dv))
    if name == "given":
        q, k = q.abs(), k.abs()
    return q, k, v


def _whole(name, q, k, v, causal, lengths):
    o = _opts(name, q.shape[3])
    if o["feature_map"] == "favor":
        return lt.favor_attention(q, k, v, o["projection"], kernel=o["kernel"], causal=causal, key_lengths=lengths)
    return lt.linear_attention(q, k, v, feature_map=name, causal=causal, key_lengths=lengths)


def _blockwise(name, q, k, v, causal, lengths, cuts):
    """The whole sequence's output from blocks, as linattn.torch.distributed composes them."""
    o = _opts(name, q.shape[3])
    local = [None if lengths is None else [min(max(n - a, 0), b - a) for n in lengths] for a, b in zip(cuts, cuts[1:])]
    blocks = [(slice(a, b), L) for (a, b), L in zip(zip(cuts, cuts[1:]), local)]
    states = [st.key_state(k[:, :, s], v[:, :, s], key_lengths=L, **o) for s, L in blocks]
    if not causal:
        total = st.add_states(states)
        return torch.cat([st.apply_state(q[:, :, s], total, **o) for s, _ in blocks], 2)
    outs = []
    for i, (s, L) in enumerate(blocks):
        prefix = st.add_states(torch.stack(states), weights=torch.arange(len(states)) < i)
        outs.append(st.causal_from_state(q[:, :, s], k[:, :, s], v[:, :, s], prefix, key_lengths=L, **o)[0])
    return torch.cat(outs, 2)


def _expect_same_gradients(got, want, xs, ys, labels):
    """The gradients of Σ g∘got in xs against those of Σ g∘want in ys, g random (float64: to 1e-10)."""
    g = torch.randn_like(want)
    (got * g).sum().backward()
    (want * g).sum().backward()
    for a, b, label in zip(xs, ys, labels):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10, msg=lambda m: "d%s: %s" % (label, m))


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_equal_the_whole_sequence(name, causal):
    """Blocks of 11, 1, 8 and 25 rows (padding ending inside one, and a block with no key),
    against linattn.torch on the whole sequence, forward and gradients (float64: the same sums in
    another order, to 1e-11 of their size)."""
    q, k, v = _inputs(name, 45)
    lengths = [45, 15]
    cuts = [0, 11, 12, 20, 45]
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    ys = [x.clone().requires_grad_() for x in (q, k, v)]
    got = _blockwise(name, *xs, causal, lengths, cuts)
    want = _whole(name, *ys, causal, lengths)
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
    _expect_same_gradients(got, want, xs, ys, "qkv")


@pytest.mark.parametrize("name", MAPS)
def test_gradcheck(name):
    """torch.autograd.gradcheck (central differences, float64) of key_state -> apply_state, and
    of causal_from_state from a key_state prefix, through its output and its final state."""
    o = _opts(name, 3)
    q, k, v = _inputs(name, 6, d=3, dv=2, seed=1)
    q0, k0, v0 = _inputs(name, 4, d=3, dv=2, seed=2)
    args = [x.clone().requires_grad_() for x in (q, k, v, q0, k0, v0)]

    def noncausal(q, k, v, q0, k0, v0):
        return st.apply_state(q, st.key_state(k, v, key_lengths=[6, 4], **o), **o)

    def causal(q, k, v, q0, k0, v0):
        out, after = st.causal_from_state(q, k, v, st.key_state(k0, v0, **o), key_lengths=[6, 5], **o)
        return out, st.apply_state(q0, after, **o)
    assert torch.autograd.gradcheck(noncausal, args, eps=1e-6, atol=1e-7)
    assert torch.autograd.gradcheck(causal, args, eps=1e-6, atol=1e-7)


def test_empty_and_rescaled_states():
    """The empty state adds as zero; a state rescaled onto larger shifts gives the same output;
    a sum that leaves every state out is the empty state, for FAVOR and for the plain maps."""
    q, k, v = _inputs("positive", 5)
    o = _opts("positive", 4)
    s = st.key_state(k, v, **o)
    empty = st.empty_state(2, 2, 8, 3, favor=True, dtype=torch.float64)
    torch.testing.assert_close(st.add_states([empty, s]), s, rtol=0, atol=0)
    higher = st.rescale_state(s, s[..., -1:] + 3.0)
    torch.testing.assert_close(st.apply_state(q, higher, **o), st.apply_state(q, s, **o), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.add_states([s, s], weights=torch.tensor([0, 0])), empty, rtol=0, atol=0)
    plain = st.key_state(k, v)
    none = st.add_states([plain, plain], weights=torch.tensor([False, False]))
    torch.testing.assert_close(none, st.empty_state(2, 2, 4, 3, dtype=torch.float64), rtol=0, atol=0)
    with pytest.raises(ValueError, match="shift must be >= the state's own shifts"):
        st.rescale_state(s, s[..., -1:] - 1.0)
    with pytest.raises(ValueError, match="weights must hold one 0 or 1 per state"):
        st.add_states([plain, plain], weights=torch.tensor([0.5, 1.0]))


def test_bad_input():
    q, k, v = _inputs("elu", 5)
    o = _opts("positive", 4)
    s = st.key_state(k, v)
    with pytest.raises(ValueError, match="eps is not used with feature_map='favor'"):
        st.key_state(k, v, eps=1e-3, **o)
    with pytest.raises(TypeError, match="the state operations take torch.float32 or torch.float64"):
        st.key_state(k.bfloat16(), v.bfloat16())
    with pytest.raises(TypeError, match="v has dtype torch.float32 but k has torch.float64"):
        st.key_state(k, v.float())
    with pytest.raises(ValueError, match="projection has requires_grad=True"):
        st.key_state(k, v, feature_map="favor", projection=o["projection"].clone().requires_grad_())
    with pytest.raises(ValueError, match=r"apply_state: state has shape \[2, 2, 3, 5\]; expected \[2, 2, 4, 5\]"):
        st.apply_state(q, s[:, :, :3])
    with pytest.raises(ValueError, match="key_lengths must be in"):
        st.key_state(k, v, key_lengths=[9, 1])
    with pytest.raises(ValueError, match="feature_map"):
        st.key_state(k, v, feature_map="gelu")
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        st.apply_state(q.numpy(), s)
    from linattn import _linattn
    with pytest.raises(TypeError, match="key_state: k must be an array, got None"):
        _linattn._key_state(None, v.numpy(), None, feature_map="elu", kernel=None, scale=None, eps=1e-6,
                            focus_power=3.0, projection=None)


def _efficient_blockwise(q, k, v, lengths, cuts, scale):
    """linattn.torch.efficient_attention from blocks of keys, as linattn.torch.distributed
    composes it: each block's context state, their sum, applied to the queries."""
    local = [None if lengths is None else [min(max(n - a, 0), b - a) for n in lengths] for a, b in zip(cuts, cuts[1:])]
    states = [st.efficient_key_state(k[:, :, a:b], v[:, :, a:b], scale=scale, key_lengths=L)
              for (a, b), L in zip(zip(cuts, cuts[1:]), local)]
    return st.efficient_apply_state(q, st.add_states(states), scale=scale)


@pytest.mark.parametrize("lengths", [None, [45, 15], [0, 12]])
def test_efficient_blocks_equal_the_whole_sequence(lengths):
    """Efficient Attention from blocks of 11, 1, 8 and 25 keys (padding ending inside one, blocks
    with no key, an item with no key at all) against linattn.torch.efficient_attention on the
    whole sequence, forward and gradients (float64: the same sums in another order and the
    merge's rescaling, to 1e-11 of their size)."""
    q, k, v = _inputs("elu", 45)
    cuts = [0, 11, 12, 20, 45]
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    ys = [x.clone().requires_grad_() for x in (q, k, v)]
    got = _efficient_blockwise(*xs, lengths, cuts, 0.6)
    want = lt.efficient_attention(*ys, key_lengths=lengths, scale=0.6)
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
    _expect_same_gradients(got, want, xs, ys, "qkv")


def test_efficient_gradcheck():
    """gradcheck (central differences, float64) of efficient_key_state on two blocks ->
    add_states -> efficient_apply_state, in q, k and v."""
    q, k, v = _inputs("elu", 6, d=3, dv=2, seed=1)
    args = [x.clone().requires_grad_() for x in (q, k, v)]

    def composed(q, k, v):
        return _efficient_blockwise(q, k, v, [6, 4], [0, 2, 6], None)
    assert torch.autograd.gradcheck(composed, args, eps=1e-6, atol=1e-7)


def test_efficient_bad_input():
    q, k, v = _inputs("elu", 5)
    s = st.efficient_key_state(k, v)
    with pytest.raises(TypeError, match="the state operations take torch.float32 or torch.float64"):
        st.efficient_key_state(k.bfloat16(), v.bfloat16())
    with pytest.raises(TypeError, match="scale must be a float or None"):
        st.efficient_apply_state(q, s, scale=True)
    with pytest.raises(ValueError, match=r"efficient_apply_state: state has shape \[2, 2, 3, 5\]; expected \[2, 2, 4, 5\]"):
        st.efficient_apply_state(q, s[:, :, :3])
    with pytest.raises(ValueError, match="key_lengths"):
        st.efficient_key_state(k, v, key_lengths=[9, 1])
    bad = k.clone()
    bad[0, 0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match="k has a non-finite value"):
        st.efficient_key_state(bad, v)


@pytest.mark.parametrize("per_head", [False, True])
def test_linformer_blocks_equal_the_whole_sequence(per_head):
    """Linformer from blocks of 11, 1, 8 and 25 keys (their projections summed, then softmax
    attention over them) against linattn.torch.linformer_attention on the whole sequence,
    forward and gradients in q, k, v, e and f (float64, to 1e-11 of their size)."""
    q, k, v = _inputs("elu", 45)
    lengths = [45, 15]
    cuts = [0, 11, 12, 20, 45]
    gen = torch.Generator().manual_seed(7)
    shape = (2, 6, 50) if per_head else (6, 50)
    e, f = (torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.3 for _ in range(2))
    xs = [x.clone().requires_grad_() for x in (q, k, v, e, f)]
    ys = [x.clone().requires_grad_() for x in (q, k, v, e, f)]
    qa, ka, va, ea, fa = xs
    local = [[min(max(n - a, 0), b - a) for n in lengths] for a, b in zip(cuts, cuts[1:])]
    projected = sum(st.linformer_project(ka[:, :, a:b], va[:, :, a:b], ea, fa, offset=a, key_lengths=L)
                    for (a, b), L in zip(zip(cuts, cuts[1:]), local))
    got = lt.softmax_attention(qa, projected[..., :4].contiguous(), projected[..., 4:].contiguous(), scale=0.5)
    want = lt.linformer_attention(*ys, key_lengths=lengths, scale=0.5)
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
    _expect_same_gradients(got, want, xs, ys, ["q", "k", "v", "e", "f"])


def test_linformer_gradcheck_and_bad_input():
    """gradcheck (central differences, float64) of linformer_project in k, v, e and f, with an
    offset and padded keys; errors name the argument."""
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 5, 3, generator=gen, dtype=torch.float64), torch.randn(2, 2, 5, 2, generator=gen, dtype=torch.float64)
    e, f = (torch.randn(4, 9, generator=gen, dtype=torch.float64) for _ in range(2))
    args = [x.clone().requires_grad_() for x in (k, v, e, f)]
    assert torch.autograd.gradcheck(lambda k, v, e, f: st.linformer_project(k, v, e, f, offset=2, key_lengths=[5, 3]),
                                    args, eps=1e-6, atol=1e-7)
    # Frozen e and f: no gradient for them, and k's and v's the same.
    kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
    g = torch.randn(2, 2, 4, 5, generator=gen, dtype=torch.float64)
    (st.linformer_project(kk, vv, e, f, offset=2, key_lengths=[5, 3]) * g).sum().backward()
    k2, v2, e2 = k.clone().requires_grad_(), v.clone().requires_grad_(), e.clone().requires_grad_()
    (st.linformer_project(k2, v2, e2, f, offset=2, key_lengths=[5, 3]) * g).sum().backward()
    assert e.grad is None and f.grad is None and e2.grad is not None
    assert torch.equal(kk.grad, k2.grad) and torch.equal(vv.grad, v2.grad)
    with pytest.raises(ValueError, match="offset = 5 with n = 5 keys needs 0 <= offset <= n_max − n = 4"):
        st.linformer_project(k, v, e, f, offset=5)
    with pytest.raises(TypeError, match="offset must be an int"):
        st.linformer_project(k, v, e, f, offset=1.0)
    with pytest.raises(TypeError, match="f has dtype torch.float32 but k has torch.float64"):
        st.linformer_project(k, v, e, f.float())
