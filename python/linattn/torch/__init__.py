"""linattn.torch: linattn's attention methods on PyTorch tensors, differentiable.

The functions have the names, options, defaults and shapes of the NumPy ones (linattn), take
CPU tensors (float32, float64, bfloat16 or float16, [batch, heads, seq, head_dim]) and return
one in the same dtype; their gradients
reach every floating input that has one (q, k, v, linformer's e and f, conv_weight). They are
PyTorch custom operators (torch.ops.linattn.*) with fake implementations and registered
autograd, so `torch.compile(model, fullgraph=True)` runs models that use them. The backward
reuses what the forward saved (softmax: each row's log-sum-exp; kernelized: each row's
normaliser and the key sums), not a second forward.

Inputs: contiguous tensors are used without a copy, others are made contiguous. CUDA (or any
non-CPU) tensors, other dtypes and inputs of mixed dtypes raise TypeError. bfloat16/float16 inputs
are widened to float32 inside the operator (bfloat16 a block at a time for linear_attention and
favor_attention, with no widened copy of the whole tensor); softmax statistics, linear states and normalisers
accumulate in float32, what the forward saves stays float32, and the output and gradients are
rounded once to the input dtype (docs/precision.md). The FAVOR projection is
a constant of the method, not a parameter: a projection with requires_grad=True raises
ValueError (keep it a buffer, or pass projection.detach()). key_lengths may be a list, a NumPy
array or an integer tensor [batch].

See docs/pytorch.md."""

import inspect as _inspect
import os as _os

import numpy as _np
import torch as _torch

from .. import _default, _linattn
from .._options import renamed as _renamed
from .._options import former_spellings as _former_spellings
from ._ops import OPS as _OPS
from .modules import MultiheadAttention

_ANNOTATIONS = {"bool": "bool", "int": "int", "float": "float", "str": "str",
                "lengths": "Union[Sequence[int], Tensor]", "tensor": "Tensor"}

# One thread team for torch and linattn: torch's OpenMP workers spin for milliseconds after each
# parallel torch operation, and on the same cores linattn's own helpers lost them meanwhile
# (FAVOR+ forward + backward at n = 1024: 15.7 ms against 9.4 ms). The runtime is the one
# libtorch_cpu binds to. LINATTN_OWN_THREADS=1 keeps linattn's own threads. docs/pytorch.md,
# "Threads".
_OWN_THREADS = _os.environ.get("LINATTN_OWN_THREADS", "")
if _OWN_THREADS not in ("", "0", "1"):
    raise ValueError("LINATTN_OWN_THREADS must be 1 (keep linattn's own threads) or 0 (share torch's OpenMP "
                     "threads, the default), got %r" % _OWN_THREADS)
if "parallel backend: OpenMP" in _torch.__config__.parallel_info() and _OWN_THREADS != "1":
    _linattn.share_openmp_runtime("libtorch_cpu.so")


def _tensor(fn, name, x, optional=False):
    """x as a contiguous CPU float tensor, or a TypeError naming fn and the argument."""
    if x is None and optional:
        return None
    if not isinstance(x, _torch.Tensor):
        raise TypeError("%s: %s must be a torch.Tensor, got %s" % (fn, name, type(x).__name__))
    if x.device.type not in ("cpu", "meta"):
        raise TypeError("%s: %s is on %s; linattn runs on the CPU only (move it with .cpu())" % (fn, name, x.device))
    if x.dtype not in _DTYPES:
        raise TypeError("%s: %s must have dtype torch.float32, torch.float64, torch.bfloat16 or torch.float16, got %s"
                        % (fn, name, x.dtype))
    return x.contiguous()


_DTYPES = (_torch.float32, _torch.float64, _torch.bfloat16, _torch.float16)


def _same_dtype(fn, named):
    """A TypeError naming both when the tensors (name, tensor or None) differ in dtype."""
    first = None
    for name, t in named:
        if t is None:
            continue
        if first is None:
            first = (name, t.dtype)
        elif t.dtype != first[1]:
            raise TypeError("%s: %s has dtype %s but %s has %s; all inputs must share one dtype"
                            % (fn, name, t.dtype, first[0], first[1]))


def _lengths(fn, x):
    """key_lengths as an int64 tensor [batch], or None."""
    if x is None:
        return None
    if isinstance(x, _torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == _torch.bool:
            raise TypeError("%s: key_lengths must hold integers, got dtype %s" % (fn, x.dtype))
        if x.device.type not in ("cpu", "meta"):
            raise TypeError("%s: key_lengths is on %s; linattn runs on the CPU only" % (fn, x.device))
        return x.to(_torch.int64)
    a = _np.asarray(x)
    if a.size > 0 and a.dtype.kind not in "iu":
        raise TypeError("%s: key_lengths must hold integers, got %r" % (fn, x))
    return _torch.as_tensor(a.astype(_np.int64))


def _scalar(fn, option, x):
    """A TypeError for an option of the wrong type (before the operator's schema sees it)."""
    kind, name = option["kind"], option["name"]
    if x is None:
        if option["optional"]:
            return x
        raise TypeError("%s: %s must not be None" % (fn, name))
    ok = {"bool": lambda: isinstance(x, (bool, _np.bool_)),
          "int": lambda: not isinstance(x, (bool, _np.bool_)) and hasattr(x, "__index__"),
          "float": lambda: not isinstance(x, (bool, _np.bool_, str)) and hasattr(x, "__float__"),
          "str": lambda: isinstance(x, str)}[kind]()
    if not ok:
        raise TypeError("%s: %s must be %s, got %r" % (fn, name, {"bool": "True or False", "int": "an integer",
                                                                  "float": "a float", "str": "a string"}[kind], x))
    return {"bool": bool, "int": int, "float": float, "str": str}[kind](x)


def _make(ops):
    info = ops.info
    P = _inspect.Parameter
    opts = info["options"]
    params = [P(x, P.POSITIONAL_OR_KEYWORD, annotation="Tensor") for x in ("q", "k", "v")]
    params += [P(o["name"], P.POSITIONAL_OR_KEYWORD, annotation="Tensor") for o in opts if o["positional"]]
    params += [P(o["name"], P.KEYWORD_ONLY, default=_default(o),
                 annotation=("Optional[%s]" if o["optional"] else "%s") % _ANNOTATIONS[o["kind"]])
               for o in opts if not o["positional"]]
    signature = _inspect.Signature(params, return_annotation="Tensor")
    fn = info["function"]
    former, former_values = _former_spellings(opts)

    def call(*args, **kwargs):
        a = signature.bind(*args, **_renamed(fn, kwargs, former, former_values=former_values))
        a.apply_defaults()
        a = a.arguments
        tensors = [_tensor(fn, n, a[n]) for n in ("q", "k", "v")]
        for o in ops.tensor_options:
            t = _tensor(fn, o["name"], a[o["name"]], optional=not o["positional"])
            if t is not None and t.requires_grad and not o["has_gradient"]:
                raise ValueError("%s: %s has requires_grad=True, but it is a constant of the method (no gradient "
                                 "flows to it); register it as a buffer or pass %s.detach()" % (fn, o["name"], o["name"]))
            tensors.append(t)
        _same_dtype(fn, zip(["q", "k", "v"] + [o["name"] for o in ops.tensor_options], tensors))
        if ops.has_lengths:
            tensors.append(_lengths(fn, a["key_lengths"]))
        scalars = [_scalar(fn, o, a[o["name"]]) for o in ops.scalar_options]
        r = ops.forward_op(*tensors, *scalars)
        return r[0] if ops.saved else r

    call.__name__ = call.__qualname__ = fn
    call.__signature__ = signature
    call.__doc__ = (info["summary"] + ".\n\nThe PyTorch form of linattn." + fn + " (differentiable; "
                    "see its documentation for the options).")
    call.__module__ = __name__
    return call


__all__ = ["MultiheadAttention"]
for _ops in _OPS.values():
    _fn = _make(_ops)
    globals()[_fn.__name__] = _fn
    __all__.append(_fn.__name__)
del _ops, _fn

from . import feature_maps  # noqa: E402
from .feature_maps import (HedgehogFeatureMap, LearnedFeatureMap, feature_logits, features,  # noqa: E402
                           hedgehog_features, learned_feature_maps, register_feature_map)


def hedgehog_attention(q: "Tensor", k: "Tensor", v: "Tensor", query_weight: "Tensor", query_bias: "Tensor",
                       key_weight: "Tensor", key_bias: "Tensor", *, causal: "bool" = False,
                       key_lengths: "Optional[Union[Sequence[int], Tensor]]" = None, eps: "float" = 1e-6) -> "Tensor":
    """Linear attention with Hedgehog's learned feature maps (feature_maps.hedgehog_features):
    φ_q(q) = [softmax(q·W_q + b_q), softmax(−(q·W_q + b_q))] per head, φ_k(k) likewise with
    W_k, b_k; out_i = Σ_j (φ_q(q_i)·φ_k(k_j)) v_j / (Σ_j φ_q(q_i)·φ_k(k_j) + eps).

    q, k [B, H, n, d], v [B, H, n_k, d_v]; query_weight, key_weight [H, d, f]; query_bias,
    key_bias [H, f]. The maps run as torch operations (autograd gives the gradients of W and b),
    the attention on linattn's kernel (linear_attention with feature_map="given"), causal
    (chunked) or not, with key_lengths. Every argument that requires grad gets its gradient."""
    fn = "hedgehog_attention"
    q, k = _tensor(fn, "q", q), _tensor(fn, "k", k)
    for name, w, b, x in (("query", query_weight, query_bias, q), ("key", key_weight, key_bias, k)):
        try:
            feature_maps._check_parameters(fn, x, w, b)
        except (TypeError, ValueError) as e:
            raise type(e)(str(e).replace(": weight", ": %s_weight" % name).replace(": bias", ": %s_bias" % name)) from None
    if query_weight.shape[2] != key_weight.shape[2]:
        raise ValueError("%s: query_weight has %d features and key_weight %d; they must match"
                         % (fn, query_weight.shape[2], key_weight.shape[2]))
    fq = hedgehog_features(q, query_weight, query_bias)
    fk = hedgehog_features(k, key_weight, key_bias)
    return linear_attention(fq, fk, v, feature_map="given", causal=causal,  # noqa: F821 (made above)
                            key_lengths=key_lengths, eps=eps)


__all__ += ["HedgehogFeatureMap", "hedgehog_features", "hedgehog_attention", "features", "feature_logits",
            "LearnedFeatureMap", "register_feature_map", "learned_feature_maps"]

from .gated import gated_linear_attention  # noqa: E402
from .delta import gated_delta_rule  # noqa: E402
from .conv1d import causal_conv1d  # noqa: E402

__all__ += ["gated_linear_attention", "gated_delta_rule", "causal_conv1d"]

# Kernelized attention in pieces (key_state, apply_state, causal_from_state): linattn.torch.state.
from . import state  # noqa: E402
