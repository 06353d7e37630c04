"""linattn.gated_linear_attention (NumPy) and linattn.torch.gated_linear_attention (autograd)
against the plain recurrence S_t = diag(exp(g_t))·S_{t−1} + k_t v_tᵀ, o_t = scale·S_tᵀ q_t
written out here in float64, per-head and per-channel gates, with and without an initial
state, sequences across chunk boundaries (64) and not multiples of them.

Tolerance (float64): the kernel's error bound (tests/test_gated.cc) is about
(2·(n + 2·d_k + 136)·u + 128·u·B)·Σ|terms|, below 1e-12 relative to Σ|terms| ≤ 10·|largest
output| here; 1e-11 of the largest value leaves a margin and is far below a wrong decay (1e-3)."""

import numpy as np
import pytest
import torch

import linattn
import linattn.torch as lt


def recurrence(q, k, v, g, scale, s0=None):
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    out = np.zeros((b, h, n, dv))
    state = np.zeros((b, h, dk, dv)) if s0 is None else s0.astype(np.float64).copy()
    for t in range(n):
        decay = np.exp(g[:, :, t] if g.ndim == 4 else g[:, :, t, None])  # [b, h, dk]
        state = decay[..., None] * state + k[:, :, t, :, None] * v[:, :, t, None, :]
        out[:, :, t] = scale * np.einsum("bhc,bhcd->bhd", q[:, :, t], state)
    return out, state


def torch_recurrence(q, k, v, g, scale):
    s = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[2]):
        decay = torch.exp(g[:, :, t] if g.dim() == 4 else g[:, :, t, None])
        s = decay[..., None] * s + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append(scale * torch.einsum("bhc,bhcd->bhd", q[:, :, t], s))
    return torch.stack(outs, 2)


def inputs(n, dk, dv, per_channel, seed=0, batch=2, heads=3):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, batch, heads, n, dk))
    v = rng.standard_normal((batch, heads, n, dv))
    g = -rng.uniform(0.001, 2.0, (batch, heads, n, dk) if per_channel else (batch, heads, n))
    s0 = rng.standard_normal((batch, heads, dk, dv))
    return q, k, v, g, s0


@pytest.mark.parametrize("n", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_numpy_forward_and_state_equal_the_recurrence(n, per_channel, with_state):
    q, k, v, g, s0 = inputs(n, 5, 7, per_channel, seed=n)
    s0 = s0 if with_state else None
    out, state = linattn.gated_linear_attention(q, k, v, g, initial_state=s0, return_state=True)
    want, want_state = recurrence(q, k, v, g, 5 ** -0.5, s0)
    assert np.abs(out - want).max() <= 1e-11 * np.abs(want).max()
    assert np.abs(state - want_state).max() <= 1e-11 * np.abs(want_state).max()
    only = linattn.gated_linear_attention(q, k, v, g, initial_state=s0, scale=0.3)
    assert np.abs(only - want * 0.3 / 5 ** -0.5).max() <= 1e-11 * np.abs(want).max()


def test_float32_follows_float64_and_resets_forget():
    q, k, v, g, s0 = inputs(130, 8, 8, True, seed=3)
    g[:, :, 70] = -np.inf  # a reset: nothing before position 70 reaches 70 and after
    wide = linattn.gated_linear_attention(q, k, v, g)
    narrow = linattn.gated_linear_attention(*(x.astype(np.float32) for x in (q, k, v, g)))
    assert narrow.dtype == np.float32
    # float32: the chain of ~n + 2·d_k + 136 roundings of 2^-24 each on Σ|terms| ≤ 10·max
    assert np.abs(narrow - wide).max() <= 2 * (130 + 16 + 136) * 2.0 ** -24 * 10 * np.abs(wide).max()
    after = linattn.gated_linear_attention(q[:, :, 70:], k[:, :, 70:], v[:, :, 70:], g[:, :, 70:])
    assert np.abs(after - wide[:, :, 70:]).max() <= 1e-11 * np.abs(wide).max()


def test_two_calls_over_a_split_equal_one_call():
    q, k, v, g, s0 = inputs(150, 6, 4, False, seed=5)
    whole, end = linattn.gated_linear_attention(q, k, v, g, initial_state=s0, return_state=True)
    a, mid = linattn.gated_linear_attention(q[:, :, :77], k[:, :, :77], v[:, :, :77], g[:, :, :77], initial_state=s0,
                                            return_state=True)
    b, last = linattn.gated_linear_attention(q[:, :, 77:], k[:, :, 77:], v[:, :, 77:], g[:, :, 77:],
                                             initial_state=mid, return_state=True)
    assert np.abs(np.concatenate([a, b], axis=2) - whole).max() <= 1e-12 * np.abs(whole).max()
    assert np.abs(last - end).max() <= 1e-12 * np.abs(end).max()


@pytest.mark.parametrize("per_channel", [False, True])
def test_torch_gradients_of_every_input(per_channel):
    # torch.autograd.gradcheck: central differences of the forward in float64 for q, k, v, the
    # log-gates and the initial state, through the output and the returned state.
    q, k, v, g, s0 = (torch.tensor(x, requires_grad=True) for x in inputs(70, 3, 2, per_channel, seed=7, batch=1,
                                                                           heads=2))

    def f(q, k, v, g, s0):
        return lt.gated_linear_attention(q, k, v, g, initial_state=s0, return_state=True, scale=0.8)
    assert torch.autograd.gradcheck(f, (q, k, v, g, s0))
    # No state: gradients through the output alone, against torch's autograd of the recurrence
    # (an independent derivation), and no second derivative (the backward is C++'s).
    w = torch.randn(1, 2, 70, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (lt.gated_linear_attention(q, k, v, g) * w).sum().backward()
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]
    (torch_recurrence(*leaves, 3 ** -0.5) * w).sum().backward()
    for ours, theirs in zip((q, k, v, g), leaves):
        assert torch.allclose(ours.grad, theirs.grad, rtol=1e-10, atol=1e-12)
    out = lt.gated_linear_attention(q, k, v, g)
    (grad_q,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        grad_q.sum().backward()


def test_bad_input_is_refused_naming_the_argument():
    q, k, v, g, s0 = inputs(8, 4, 3, False)
    with pytest.raises(ValueError, match="log_gate must be <= 0"):
        linattn.gated_linear_attention(q, k, v, -g)
    with pytest.raises(ValueError, match="log_gate has shape"):
        linattn.gated_linear_attention(q, k, v, g[:, :, :5])
    with pytest.raises(ValueError, match="initial_state has shape"):
        linattn.gated_linear_attention(q, k, v, g, initial_state=s0[:, :, :2])
    with pytest.raises(ValueError, match="initial_state must be None with causal=false"):
        linattn.gated_linear_attention(q, k, v, g, causal=False, initial_state=s0)
    with pytest.raises(ValueError, match="return_state=True needs causal=True"):
        linattn.gated_linear_attention(q, k, v, g, causal=False, return_state=True)
    t = [torch.tensor(x) for x in (q, k, v, g, s0)]
    with pytest.raises(ValueError, match="return_state=True needs causal=True"):
        lt.gated_linear_attention(*t[:4], causal=False, return_state=True)
    with pytest.raises(ValueError, match="initial_state needs causal=True"):
        lt.gated_linear_attention(*t[:4], causal=False, initial_state=t[4])
    bad = q.copy()
    bad[0, 0, 3, 1] = np.nan
    with pytest.raises(ValueError, match="q has a non-finite value"):
        linattn.gated_linear_attention(bad, k, v, g)
    with pytest.raises(TypeError, match="must be float32, float64, bfloat16 or float16"):
        lt.gated_linear_attention(*(torch.tensor(x, dtype=torch.int64) for x in (q, k, v, g)))
    with pytest.raises(TypeError, match="log_gate has dtype torch.float32, q has torch.float64"):
        lt.gated_linear_attention(*(torch.tensor(x) for x in (q, k, v)), torch.tensor(g, dtype=torch.float32))
    with pytest.raises(TypeError, match="log_gate must be a torch.Tensor"):
        lt.gated_linear_attention(torch.tensor(q), torch.tensor(k), torch.tensor(v), g)


def test_bfloat16_is_computed_in_float32_and_rounded_once():
    q, k, v, g, s0 = inputs(90, 8, 8, True, seed=9)
    low = [torch.tensor(x, dtype=torch.bfloat16, requires_grad=True) for x in (q, k, v, g)]
    out, state = lt.gated_linear_attention(*low, return_state=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    want = lt.gated_linear_attention(*(x.detach().float() for x in low))  # the same rounded inputs
    assert torch.equal(out, want.to(torch.bfloat16))
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * w).sum().backward()
    wide = [x.detach().float().requires_grad_() for x in low]
    # The bfloat16 output's gradient is w rounded to bfloat16: the same dout on both sides.
    (lt.gated_linear_attention(*wide) * w.to(torch.bfloat16).float()).sum().backward()
    for narrow, full in zip(low, wide):  # float32's gradient, rounded once to bfloat16
        assert narrow.grad.dtype == torch.bfloat16 and torch.equal(narrow.grad, full.grad.to(torch.bfloat16))
    # The float32 state a 16-bit call returns continues the sequence.
    more = [torch.tensor(x, dtype=torch.bfloat16) for x in inputs(20, 8, 8, True, seed=10)[:4]]
    nxt = lt.gated_linear_attention(*more, initial_state=state.detach())
    assert nxt.dtype == torch.bfloat16 and torch.isfinite(nxt.float()).all()


def bidirectional(q, k, v, g, scale):
    """The non-causal form by its definition: o_t = scale·Σ_s Σ_c q_tc k_sc e_ts,c v_s with
    e_ts = Π exp(g_u) over min(s,t) < u <= max(s,t), in float64."""
    b, h, n, dk = q.shape
    gc = g if g.ndim == 4 else np.repeat(g[..., None], dk, -1)
    cum = np.concatenate([np.zeros((b, h, 1, dk)), np.cumsum(gc, 2)], 2)  # cum[t + 1] = Σ_{u<=t} g_u
    out = np.zeros((b, h, n, v.shape[-1]))
    for t in range(n):
        # e_ts = exp(|cum[t+1] − cum[s+1]|-signed sum): Σ_{min<u<=max} g_u = −|cum[t+1] − cum[s+1]|
        e = np.exp(-np.abs(cum[:, :, t + 1, None, :] - cum[:, :, 1:, :]))  # [b, h, n, dk]
        w = np.einsum("bhc,bhsc->bhs", q[:, :, t], k * e)
        out[:, :, t] = scale * np.einsum("bhs,bhsd->bhd", w, v)
    return out


@pytest.mark.parametrize("n", [1, 64, 130])
@pytest.mark.parametrize("per_channel", [False, True])
def test_noncausal_equals_its_definition_with_gradients(n, per_channel):
    q, k, v, g, _ = inputs(n, 5, 4, per_channel, seed=7 + n)
    g = g / 8  # gates in (−0.25, 0]: decays that reach across the sequence
    out = linattn.gated_linear_attention(q, k, v, g, causal=False, scale=0.4)
    want = bidirectional(q, k, v, g, 0.4)
    assert np.abs(out - want).max() <= 1e-11 * np.abs(want).max()
    # reversing the sequence (and the gates, shifted by one) gives the same outputs reversed
    rg = np.concatenate([np.zeros_like(g[:, :, :1]), g[:, :, :0:-1]], 2)
    rev = linattn.gated_linear_attention(q[:, :, ::-1].copy(), k[:, :, ::-1].copy(), v[:, :, ::-1].copy(),
                                         rg, causal=False, scale=0.4)
    assert np.abs(rev[:, :, ::-1] - out).max() <= 1e-11 * np.abs(want).max()
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v, g)]
    o = lt.gated_linear_attention(*t, causal=False, scale=0.4)
    assert o.shape == out.shape and torch.allclose(o.detach(), torch.tensor(out), rtol=0, atol=1e-13)
    w = torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (o * w).sum().backward()
    for i, x in enumerate(t):  # against central differences of the definition (a few entries each)
        flat = x.detach().numpy().reshape(-1)
        for j in np.random.default_rng(i).choice(flat.size, 4, replace=False):
            args = [y.detach().numpy().copy() for y in t]
            h = 1e-6
            args[i].reshape(-1)[j] += h
            up = (bidirectional(*args, 0.4) * w.numpy()).sum()
            args[i].reshape(-1)[j] -= 2 * h
            down = (bidirectional(*args, 0.4) * w.numpy()).sum()
            fd = (up - down) / (2 * h)
            assert abs(x.grad.reshape(-1)[j].item() - fd) <= 1e-6 * max(1.0, abs(fd)), (i, j)
