"""linattn.torch.gated_linear_attention: the C++ chunked kernel (include/linattn/gated.h) with
autograd, state in and state out. The formulas live in C++; this file passes tensors."""

import torch
from torch.autograd.function import once_differentiable

from .. import _linattn
from ._checks import SIXTEEN_BIT, check_tensors
from ._checks import array as _array

__all__ = ["gated_linear_attention"]

_FN = "linattn.torch.gated_linear_attention"


class _GatedLinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_gate, initial_state, scale, causal):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        result = _linattn.gated_linear_attention(_array(q), _array(k), _array(v), _array(log_gate), scale=scale,
                                                 causal=causal, initial_state=_array(initial_state),
                                                 return_state=causal)
        out, state = result if causal else (result, q.new_zeros(0).numpy())  # non-causal: no state
        ctx.save_for_backward(q, k, v, log_gate, initial_state)
        ctx.scale, ctx.causal = scale, causal
        return torch.from_numpy(out), torch.from_numpy(state)

    @staticmethod
    @once_differentiable  # the gradients are computed in C++: no graph for a second derivative
    def backward(ctx, dout, dstate):
        q, k, v, log_gate, initial_state = ctx.saved_tensors
        if dout is None:
            dout = q.new_zeros(v.shape)
        grads = _linattn.gated_linear_attention_backward(
            _array(q), _array(k), _array(v), _array(log_gate), _array(dout), scale=ctx.scale, causal=ctx.causal,
            initial_state=_array(initial_state), dstate=_array(dstate) if ctx.causal else None)
        dq, dk, dv, dg, ds = (torch.from_numpy(g) for g in grads)  # ds: zeros without an initial state
        return dq, dk, dv, dg, (ds if initial_state is not None else None), None, None


def gated_linear_attention(q, k, v, log_gate, *, scale=None, causal=True, initial_state=None, return_state=False):
    """Gated (decayed) linear attention with autograd: S_t = diag(exp(g_t))·S_{t−1} + k_t v_tᵀ,
    o_t = scale·S_tᵀ q_t (linattn.gated_linear_attention, docs/methods/gated.md).

    q, k [B, H, n, d_k], v [B, H, n, d_v]; log_gate [B, H, n] (per head) or [B, H, n, d_k] (per
    channel), values <= 0 (-inf: a reset); scale: d_k^-1/2 by default; initial_state
    [B, H, d_k, d_v] continues a sequence; return_state=True returns (out, S_n). causal=False:
    every output reads every position, decayed both ways (o_t = scale·Σ_s (q_t ⊙ e_ts)ᵀ k_s v_s,
    e_ts = Π exp(g_u) over min(s,t) < u <= max(s,t)), with no state in or out. CPU tensors of
    one dtype: float32 or float64, or bfloat16/float16 (computed in float32, the output rounded
    once, the state float32, and a float32 initial_state accepted; no 16-bit kernel yet). Gradients reach q, k, v, log_gate and
    initial_state."""
    check_tensors(_FN, {"q": q, "k": k, "v": v, "log_gate": log_gate, "initial_state": initial_state}, "q",
                  optional=("initial_state",), state=("initial_state",))
    if not isinstance(causal, bool):
        raise TypeError("%s: causal must be a bool, got %r" % (_FN, causal))
    if not causal and (initial_state is not None or return_state):
        raise ValueError("%s: %s needs causal=True: the non-causal form reads the whole sequence and has no state"
                         % (_FN, "initial_state" if initial_state is not None else "return_state=True"))
    if q.dtype in SIXTEEN_BIT:
        # Computed in float32 and the output rounded once; the state stays float32 (as a decoding
        # state accumulates). The casts are torch's, so gradients come back in the inputs' dtypes.
        out, state = _GatedLinearAttention.apply(q.float(), k.float(), v.float(), log_gate.float(),
                                                 None if initial_state is None else initial_state.float(),
                                                 None if scale is None else float(scale), causal)
        out = out.to(q.dtype)
    else:
        out, state = _GatedLinearAttention.apply(q, k, v, log_gate, initial_state,
                                                 None if scale is None else float(scale), causal)
    return (out, state) if return_state else out
