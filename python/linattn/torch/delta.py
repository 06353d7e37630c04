"""linattn.torch.gated_delta_rule: the C++ chunked gated delta rule and KDA
(include/linattn/delta.h) with autograd, state in and state out. The formulas live in C++; this
file passes tensors."""

import torch
from torch.autograd.function import once_differentiable

from .. import _linattn
from ._checks import SIXTEEN_BIT, check_tensors, needs_graph
from ._checks import array as _array

__all__ = ["gated_delta_rule"]

_FN = "linattn.torch.gated_delta_rule"


def _forward(q, k, v, g, beta, initial_state, scale, l2norm):
    """The C++ forward on float32/float64 CPU tensors: (out, final state)."""
    out, state = _linattn.gated_delta_rule(_array(q), _array(k), _array(v), _array(g), _array(beta), scale=scale,
                                           initial_state=_array(initial_state), return_state=True,
                                           use_qk_l2norm_in_kernel=l2norm)
    return torch.from_numpy(out), torch.from_numpy(state)


class _GatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, l2norm):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale, ctx.l2norm = scale, l2norm
        return _forward(q, k, v, g, beta, initial_state, scale, l2norm)

    @staticmethod
    @once_differentiable  # the gradients are computed in C++: no graph for a second derivative
    def backward(ctx, dout, dstate):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        if dout is None:
            dout = v.new_zeros(v.shape)
        grads = _linattn.gated_delta_rule_backward(
            _array(q), _array(k), _array(v), _array(g), _array(beta), _array(dout), scale=ctx.scale,
            initial_state=_array(initial_state), dstate=_array(dstate), use_qk_l2norm_in_kernel=ctx.l2norm)
        dq, dk, dv, dg, dbeta, ds = (torch.from_numpy(x) for x in grads)  # ds: zeros without an initial state
        return dq, dk, dv, dg, dbeta, (ds if initial_state is not None else None), None, None


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, return_state=False,
                     use_qk_l2norm_in_kernel=False):
    """The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-hybrid) and, with
    per-channel gates, KDA (Kimi Linear), with autograd (linattn.gated_delta_rule,
    docs/methods/delta.md):
    S_t = (I − β_t k_t k_tᵀ)·diag(exp(g_t))·S_{t−1} + β_t k_t v_tᵀ, o_t = scale·S_tᵀ q_t.

    q, k [B, H_k, n, d_k], v [B, H, n, d_v] with H a multiple of H_k (value head h reads key head
    h // (H // H_k)); g [B, H, n] (per head) or [B, H, n, d_k] (per channel), values <= 0 (-inf:
    a reset); beta [B, H, n] in [0, 2]; scale: d_k^-1/2 by default; use_qk_l2norm_in_kernel
    divides q and k by sqrt(|x|² + 1e-6) first (fla's and transformers' l2norm). initial_state
    [B, H, d_k, d_v] continues a sequence; return_state=True returns (out, S_n). CPU tensors of
    one dtype: float32 or float64, or bfloat16/float16 (computed in float32, the output rounded
    once, the state float32, and a float32 initial_state accepted; no 16-bit kernel yet).
    Gradients reach q, k, v, g, beta and initial_state."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state}
    check_tensors(_FN, named, "q", optional=("initial_state",), state=("initial_state",))
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise TypeError("%s: use_qk_l2norm_in_kernel must be a bool, got %r" % (_FN, use_qk_l2norm_in_kernel))
    scale = None if scale is None else float(scale)
    wide = q.dtype in SIXTEEN_BIT
    # 16-bit: computed in float32 and the output rounded once; the state stays float32 (as a
    # decoding state accumulates). The casts are torch's, so gradients come back in the inputs'
    # dtypes.
    args = [None if t is None else (t.float() if wide else t) for t in (q, k, v, g, beta, initial_state)]
    # Inference (decoding: one call per layer and token) builds no autograd node.
    run = _GatedDeltaRule.apply if needs_graph(named.values()) else _forward
    out, state = run(*args, scale, use_qk_l2norm_in_kernel)
    if wide:
        out = out.to(q.dtype)
    return (out, state) if return_state else out
