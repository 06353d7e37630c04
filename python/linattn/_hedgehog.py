"""Hedgehog's learned feature maps on NumPy arrays (linattn.torch.feature_maps has the torch
modules): φ(x) = [softmax(x·W_h + b_h), softmax(−(x·W_h + b_h))] per head, and linear attention
on those features through linattn's kernel (linear_attention with feature_map="given").
The map and its backward are the C++ library's (linattn.hedgehog_features, the formula every
layer calls); the backward is the kernel's for the features, then the map's."""

import ml_dtypes
import numpy as np

from . import _linattn

# bfloat16/float16 inputs run in float32 (the maps, the kernel and the maps' backward) and the
# results are rounded once to the input dtype, as the registered methods do.
_LOW = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))

__all__ = ["hedgehog_features", "hedgehog_features_backward", "hedgehog_attention", "hedgehog_attention_backward"]


def _array(fn, name, x):
    if not isinstance(x, np.ndarray):
        raise TypeError("%s: %s must be a numpy.ndarray, got %s" % (fn, name, type(x).__name__))
    if x.dtype not in (np.float32, np.float64) + _LOW:
        raise TypeError("%s: %s must be float32, float64, bfloat16 or float16, got %s" % (fn, name, x.dtype))
    if not np.isfinite(x).all():
        raise ValueError("%s: %s has a non-finite value" % (fn, name))
    return x


def _check_map(fn, side, x, weight, bias):
    """side: '' (hedgehog_features) or 'query_' / 'key_'."""
    x = _array(fn, {"": "x", "query_": "q", "key_": "k"}[side], x)
    w, b = _array(fn, side + "weight", weight), _array(fn, side + "bias", bias)
    if x.ndim != 4:
        raise ValueError("%s: the input must be [batch, heads, seq, head_dim], got shape %s" % (fn, list(x.shape)))
    for name, t in ((side + "weight", w), (side + "bias", b)):
        if t.dtype != x.dtype:
            raise TypeError("%s: %s has dtype %s, but the input has %s" % (fn, name, t.dtype, x.dtype))
    H, d = x.shape[1], x.shape[3]
    if w.ndim != 3 or w.shape[0] != H or w.shape[1] != d or w.shape[2] < 1:
        raise ValueError("%s: %sweight has shape %s; expected [heads = %d, head_dim = %d, feature_dim >= 1]"
                         % (fn, side, list(w.shape), H, d))
    if b.shape != (H, w.shape[2]):
        raise ValueError("%s: %sbias has shape %s; expected [heads = %d, feature_dim = %d]"
                         % (fn, side, list(b.shape), H, w.shape[2]))
    if x.dtype in _LOW:
        x, w, b = (t.astype(np.float32) for t in (x, w, b))
    return x, w, b


def hedgehog_features(x: "ndarray", weight: "ndarray", bias: "ndarray") -> "ndarray":
    """φ(x) = [softmax(x·W_h + b_h), softmax(−(x·W_h + b_h))] over the feature axis, per head h:
    x [B, H, n, d], weight [H, d, f], bias [H, f] (x's dtype) -> [B, H, n, 2f], each half summing
    to 1."""
    dtype = np.asarray(x).dtype
    x, w, b = _check_map("hedgehog_features", "", x, weight, bias)
    return _linattn.hedgehog_features(x, w, b).astype(dtype, copy=False)


def hedgehog_features_backward(x: "ndarray", weight: "ndarray", bias: "ndarray",
                               dphi: "ndarray") -> "tuple[ndarray, ndarray, ndarray]":
    """(dx, dweight, dbias) of sum(dphi * hedgehog_features(x, weight, bias)), dphi [B, H, n, 2f]
    in x's dtype."""
    fn = "hedgehog_features_backward"
    dtype = np.asarray(x).dtype
    x, w, b = _check_map(fn, "", x, weight, bias)
    grads = _linattn.hedgehog_features_backward(x, w, b, _values(fn, dphi, dtype, "dphi"))
    return tuple(_rounded(fn, ["dx", "dweight", "dbias"], grads, dtype))


def _prepare(fn, q, k, query_weight, query_bias, key_weight, key_bias):
    """The checked inputs and both sides' features: q, k, (W_q, b_q, φ_q(q)), (W_k, b_k, φ_k(k))."""
    q_dtype, k_dtype = getattr(q, "dtype", None), getattr(k, "dtype", None)
    q, wq, bq = _check_map(fn, "query_", q, query_weight, query_bias)
    k, wk, bk = _check_map(fn, "key_", k, key_weight, key_bias)
    if k_dtype != q_dtype:
        raise TypeError("%s: k has dtype %s but q has %s; all inputs must share one dtype" % (fn, k_dtype, q_dtype))
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError("%s: k has shape %s; expected [batch = %d, heads = %d, n_k, head_dim = %d] as q %s"
                         % (fn, list(k.shape), q.shape[0], q.shape[1], q.shape[3], list(q.shape)))
    if wq.shape[2] != wk.shape[2]:
        raise ValueError("%s: query_weight has %d features and key_weight %d; they must match"
                         % (fn, wq.shape[2], wk.shape[2]))
    fq, fk = _linattn.hedgehog_features(q, wq, bq), _linattn.hedgehog_features(k, wk, bk)
    return q, k, (wq, bq, fq), (wk, bk, fk)


def _rounded(fn, names, arrays, dtype):
    """The results rounded to dtype; ValueError naming the one whose finite value would round to
    ±inf (float16's range ends at 65504), as the registered methods do."""
    out = []
    for name, x in zip(names, arrays):
        if dtype in _LOW:
            big = np.abs(x[np.isfinite(x)]).max(initial=0)
            with np.errstate(over="ignore"):  # the overflow is what is being tested for
                overflows = not np.isfinite(np.asarray(big).astype(dtype))
            if overflows:
                raise ValueError("%s: %s has a value of magnitude %g, which rounds to infinity in %s; compute in "
                                 "float32 instead" % (fn, name, big, np.dtype(dtype).name))
        out.append(x.astype(dtype, copy=False))
    return out


def _values(fn, v, dtype, name="v"):
    """v (or dout) in the dtype the kernel runs in: float32 for 16-bit inputs."""
    if isinstance(v, np.ndarray) and dtype in _LOW:
        if v.dtype != dtype:
            raise TypeError("%s: %s has dtype %s but q has %s; all inputs must share one dtype" % (fn, name, v.dtype, dtype))
        return v.astype(np.float32)
    return v


def _options(causal, key_lengths, eps):
    return {"feature_map": "given", "causal": causal, "key_lengths": key_lengths, "eps": eps, "focus_power": 3.0}


def _kernel(fn, call):
    """The kernel's call; its errors (about v, dout, key_lengths, eps, causal) under fn's name."""
    try:
        return call()
    except (TypeError, ValueError) as e:
        message = str(e)
        for name in ("linear_attention_backward", "linear_attention"):
            if message.startswith(name + ":"):
                message = fn + message[len(name):]
                break
        raise type(e)(message) from None


def hedgehog_attention(q: "ndarray", k: "ndarray", v: "ndarray", query_weight: "ndarray", query_bias: "ndarray",
                       key_weight: "ndarray", key_bias: "ndarray", *, causal: "bool" = False,
                       key_lengths: "Optional[Sequence[int]]" = None, eps: "float" = 1e-6) -> "ndarray":
    """Linear attention with Hedgehog's learned maps: φ_q = [softmax(q·W_q + b_q),
    softmax(−(q·W_q + b_q))] per head, φ_k likewise with W_k, b_k;
    out_i = Σ_j (φ_q(q_i)·φ_k(k_j)) v_j / (Σ_j φ_q(q_i)·φ_k(k_j) + eps).

    q, k [B, H, n, d], v [B, H, n_k, d_v]; query_weight, key_weight [H, d, f]; query_bias,
    key_bias [H, f]; float32, float64, bfloat16 or float16, all one dtype. Causal (chunked) or not, with
    key_lengths, on linattn's kernel (linear_attention with feature_map="given"). The same
    as linattn.torch.hedgehog_attention."""
    fn = "hedgehog_attention"
    dtype = q.dtype if isinstance(q, np.ndarray) else None
    q, k, (_, _, fq), (_, _, fk) = _prepare(fn, q, k, query_weight, query_bias, key_weight, key_bias)
    v = _values(fn, v, dtype)
    out = _kernel(fn, lambda: _linattn._forward("linear", fq, fk, v, {"conv_weight": None},
                                                _options(causal, key_lengths, eps), []))
    return _rounded(fn, ["out"], [out], dtype)[0]


def hedgehog_attention_backward(q: "ndarray", k: "ndarray", v: "ndarray", query_weight: "ndarray",
                                query_bias: "ndarray", key_weight: "ndarray", key_bias: "ndarray", dout: "ndarray", *,
                                causal: "bool" = False, key_lengths: "Optional[Sequence[int]]" = None,
                                eps: "float" = 1e-6) -> "tuple[ndarray, ...]":
    """Gradients (dq, dk, dv, d_query_weight, d_query_bias, d_key_weight, d_key_bias) of
    sum(dout * hedgehog_attention(...)): the kernel's gradients of the features, then the maps'."""
    fn = "hedgehog_attention_backward"
    dtype = q.dtype if isinstance(q, np.ndarray) else None
    q, k, (wq, bq, fq), (wk, bk, fk) = _prepare(fn, q, k, query_weight, query_bias, key_weight, key_bias)
    v, dout = _values(fn, v, dtype), _values(fn, dout, dtype, "dout")
    dfq, dfk, dv = _kernel(fn, lambda: _linattn._backward("linear", fq, fk, v, dout, {"conv_weight": None},
                                                          _options(causal, key_lengths, eps), {}))[:3]
    dq, dwq, dbq = _linattn.hedgehog_features_backward(q, wq, bq, dfq)
    dk, dwk, dbk = _linattn.hedgehog_features_backward(k, wk, bk, dfk)
    return tuple(_rounded(fn, ["dq", "dk", "dv", "d_query_weight", "d_query_bias", "d_key_weight", "d_key_bias"],
                          (dq, dk, dv, dwq, dbq, dwk, dbk), dtype))
