"""linattn.torch.causal_conv1d: the C++ causal depthwise convolution (include/linattn/conv1d.h)
with autograd, state in and state out. The formula lives in C++; this file passes tensors."""

import torch
from torch.autograd.function import once_differentiable

from .. import _linattn
from ._checks import SIXTEEN_BIT, check_tensors, needs_graph
from ._checks import array as _array

__all__ = ["causal_conv1d"]

_FN = "linattn.torch.causal_conv1d"


def _forward(x, weight, bias, initial_state, activation):
    """The C++ forward on float32/float64 CPU tensors: (out, final state)."""
    out, state = _linattn.causal_conv1d(_array(x), _array(weight), _array(bias), initial_state=_array(initial_state),
                                        return_state=True, activation=activation)
    return torch.from_numpy(out), torch.from_numpy(state)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, activation):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, bias, initial_state)
        ctx.activation = activation
        return _forward(x, weight, bias, initial_state, activation)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dstate):
        x, weight, bias, initial_state = ctx.saved_tensors
        if dout is None:
            dout = x.new_zeros(x.shape)
        dx, dw, db, ds = _linattn.causal_conv1d_backward(
            _array(x), _array(weight), _array(dout), bias=_array(bias), initial_state=_array(initial_state),
            dstate=_array(dstate), activation=ctx.activation)
        return (torch.from_numpy(dx), torch.from_numpy(dw), None if db is None else torch.from_numpy(db),
                torch.from_numpy(ds) if initial_state is not None else None, None)


def causal_conv1d(x, weight, bias=None, *, initial_state=None, return_state=False, activation="silu"):
    """The causal depthwise convolution in front of the gated-delta-rule and KDA layers, with
    autograd (linattn.causal_conv1d, docs/methods/delta.md): out[b,c,t] = act(bias[c] +
    Σ_j weight[c,j]·x̃[b,c,t+j]), x̃ = x [B, C, T] with the W−1 positions before it in front
    (initial_state [B, C, W−1], zeros without one). weight [C, W], bias [C] or None; activation
    "silu" (or "swish") or None; return_state=True returns (out, final state [B, C, W−1]).
    CPU tensors of one dtype: float32 or float64, or bfloat16/float16 (computed in float32, the
    output rounded once, the state in the input dtype). Gradients reach x, weight, bias and
    initial_state."""
    named = {"x": x, "weight": weight, "bias": bias, "initial_state": initial_state}
    check_tensors(_FN, named, "x", optional=("bias", "initial_state"))
    wide = x.dtype in SIXTEEN_BIT
    args = [None if t is None else (t.float() if wide else t) for t in (x, weight, bias, initial_state)]
    # Inference (decoding) builds no autograd node.
    run = _CausalConv1d.apply if needs_graph(named.values()) else _forward
    out, state = run(*args, activation)
    if wide:
        out, state = out.to(x.dtype), state.to(x.dtype)
    return (out, state) if return_state else out
