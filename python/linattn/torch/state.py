"""linattn.torch.state: kernelized attention in pieces, differentiable (the C++ library's
key_state, apply_state and causal_from_state; include/linattn/kernelized.h), and Efficient
Attention's context state (efficient_key_state, efficient_apply_state; include/linattn/efficient.h)
and Linformer's projection of a block of keys (linformer_project; include/linattn/linformer.h).

For a sequence split into blocks (context parallelism: linattn.torch.distributed uses them;
pipelines; prefill in parts): the state of a block's keys, a state applied to queries, and a
causal block that starts from the state of the keys before it. A state is
[batch, heads, m', value_dim + 2]: per feature r the row

    [S_r | z_r | c_r] = [Σ_j φ_r(k_j)·v_j | Σ_j φ_r(k_j)] / exp(c_r) | c_r

over the keys it holds, c_r a per-feature log-shift that keeps FAVOR's exponentials in range
(−inf where no key reached the feature; 0 for the plain maps). `add_states` adds states as
the shifts require. The shifts take no gradient (every result is the same function of q, k
and v whatever they are); S and z do, and so every function here is differentiable in q, k, v
and the states it takes.

Options, as linattn.torch.RecurrentState / linattn.recurrent_state name them: feature_map
"elu", "relu", "focused", "given" (q and k are features, >= 0; "identity" before 0.2) or "favor" (with projection
[m, head_dim], kernel "positive", "hyperbolic" or "trig", and scale); eps (not for favor);
focus_power. eps: None means 1e-6 for the plain maps, and favor takes none. float32 and float64; every value of q, k and v must be finite (padded keys too:
give them zeros); sums beyond the dtype's range raise ValueError."""

import torch
from torch.autograd.function import once_differentiable

from .. import _linattn
from .._options import current_feature_map, renamed
from . import _lengths, _tensor
from ._checks import constant, full_precision_inputs
from ._ops import _array, _tensor as _from_numpy

__all__ = ["key_state", "apply_state", "causal_from_state", "add_states", "rescale_state", "empty_state",
           "efficient_key_state", "efficient_apply_state", "linformer_project"]

def _opts(fn, feature_map, projection, kernel, scale, eps, focus_power):
    """The binding's keyword options, projection checked: a constant (no gradient flows to it).
    eps: None is 1e-6 for the plain maps; FAVOR takes none (its features estimate exp(q·k))."""
    if feature_map == "favor" and eps is not None:
        raise ValueError("%s: eps is not used with feature_map='favor' (its denominators are sums of exponentials); "
                         "leave it None" % fn)
    eps = 1e-6 if eps is None else eps
    if projection is not None:
        projection = _tensor(fn, "projection", projection)
        constant(fn, "projection", projection)
    if not isinstance(feature_map, str):
        raise TypeError("%s: feature_map must be a str, got %r" % (fn, feature_map))
    return dict(feature_map=current_feature_map(fn, feature_map, stacklevel=5), kernel=kernel, scale=scale,
                eps=float(eps), focus_power=float(focus_power), projection=_array(projection))


def _inputs(fn, named):
    """The tensors (name, tensor or None), contiguous, float32/float64, of one dtype."""
    return full_precision_inputs(fn, named, "the state operations")


def _length_list(fn, key_lengths):
    lengths = _lengths(fn, key_lengths)
    return None if lengths is None else lengths.tolist()


class _KeyState(torch.autograd.Function):
    """A block's key state from a pair of C++ kernels, (forward, backward) =
    (f(k, v, key_lengths, **opts) -> state, b(k, v, state, dstate, key_lengths, **opts) -> (dk, dv)):
    the kernelized maps' (_KERNELIZED_KEY_STATE) and Efficient Attention's (_EFFICIENT_KEY_STATE)."""

    @staticmethod
    def forward(ctx, k, v, lengths, kernels, opts):
        state = _from_numpy(kernels[0](_array(k), _array(v), lengths, **opts))
        ctx.save_for_backward(k, v, state)
        ctx.lengths, ctx.kernels, ctx.opts = lengths, kernels, opts
        return state

    @staticmethod
    @once_differentiable  # the backward is a kernel: no graph for second derivatives
    def backward(ctx, dstate):
        k, v, state = ctx.saved_tensors
        dk, dv = ctx.kernels[1](_array(k), _array(v), _array(state), _array(dstate), ctx.lengths, **ctx.opts)
        return _from_numpy(dk), _from_numpy(dv), None, None, None


_KERNELIZED_KEY_STATE = (_linattn._key_state, _linattn._key_state_backward)
_EFFICIENT_KEY_STATE = (_linattn._efficient_key_state, _linattn._efficient_key_state_backward)


class _ApplyState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, state, opts):
        out, den = (_from_numpy(x) for x in _linattn._apply_state(_array(q), _array(state), **opts))
        ctx.save_for_backward(q, state, out, den)
        ctx.opts = opts
        return out

    @staticmethod
    @once_differentiable  # the backward is a kernel: no graph for second derivatives
    def backward(ctx, dout):
        q, state, out, den = ctx.saved_tensors
        dq, dstate = _linattn._apply_state_backward(_array(q), _array(state), _array(dout), _array(out), _array(den),
                                                    **ctx.opts)
        return _from_numpy(dq), _from_numpy(dstate), None


class _CausalFromState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, prefix, lengths, opts):
        out, den, state = (_from_numpy(x) for x in _linattn._causal_from_state(
            _array(q), _array(k), _array(v), _array(prefix), lengths, **opts))
        ctx.save_for_backward(q, k, v, prefix, out, den)
        ctx.lengths, ctx.opts = lengths, opts
        ctx.set_materialize_grads(False)  # no zero tensor for an unused state_after
        return out, state

    @staticmethod
    @once_differentiable  # the backward is a kernel: no graph for second derivatives
    def backward(ctx, dout, dstate_after):
        q, k, v, prefix, out, den = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dprefix = _linattn._causal_from_state_backward(
            _array(q), _array(k), _array(v), _array(prefix), _array(dout), _array(out), _array(den),
            _array(dstate_after), ctx.lengths, **ctx.opts)
        return _from_numpy(dq), _from_numpy(dk), _from_numpy(dv), _from_numpy(dprefix), None, None


def key_state(k, v, *, feature_map="elu", projection=None, kernel=None, scale=None, eps=None, focus_power=3.0,
              key_lengths=None):
    """k [B,H,n,d], v [B,H,n,d_v] -> the state [B,H,m',d_v+2] of the keys j < key_lengths[b]
    (default all). Differentiable in k and v."""
    fn = "linattn.torch.state.key_state"
    opts = _opts(fn, feature_map, projection, kernel, scale, eps, focus_power)
    k, v = _inputs(fn, [("k", k), ("v", v)])
    return _KeyState.apply(k, v, _length_list(fn, key_lengths), _KERNELIZED_KEY_STATE, opts)


def apply_state(q, state, *, feature_map="elu", projection=None, kernel=None, scale=None, eps=None, focus_power=3.0):
    """q [B,H,n,d] and a state -> out_i = φ(q_i)·S / (φ(q_i)·z + eps) [B,H,n,d_v] (0 where the
    denominator is 0). Differentiable in q and state."""
    fn = "linattn.torch.state.apply_state"
    opts = _opts(fn, feature_map, projection, kernel, scale, eps, focus_power)
    q, state = _inputs(fn, [("q", q), ("state", state)])
    return _ApplyState.apply(q, state, opts)


def causal_from_state(q, k, v, prefix, *, feature_map="elu", projection=None, kernel=None, scale=None, eps=None,
                      focus_power=3.0, key_lengths=None):
    """q, k [B,H,n,d], v [B,H,n,d_v] and prefix (the state of the keys before this block) ->
    (out, state): out_i = φ(q_i)·(S_P + Σ_{j<=i} φ(k_j)v_jᵀ) / (φ(q_i)·(z_P + Σ_{j<=i} φ(k_j)) + eps)
    [B,H,n,d_v], and the state after the block (prefix and its keys j < key_lengths[b]).
    Differentiable in q, k, v and prefix, through out and state."""
    fn = "linattn.torch.state.causal_from_state"
    opts = _opts(fn, feature_map, projection, kernel, scale, eps, focus_power)
    q, k, v, prefix = _inputs(fn, [("q", q), ("k", k), ("v", v), ("prefix", prefix)])
    return _CausalFromState.apply(q, k, v, prefix, _length_list(fn, key_lengths), opts)


class _EfficientApplyState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, state, scale):
        out = _from_numpy(_linattn._efficient_apply_state(_array(q), _array(state), scale))
        ctx.save_for_backward(q, state)
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable  # the backward is a kernel: no graph for second derivatives
    def backward(ctx, dout):
        q, state = ctx.saved_tensors
        dq, dstate = _linattn._efficient_apply_state_backward(_array(q), _array(state), _array(dout), ctx.scale)
        return _from_numpy(dq), _from_numpy(dstate), None


def _efficient_scale(fn, scale):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError("%s: scale must be a float or None, got %r" % (fn, scale))
    return None if scale is None else float(scale)


def efficient_key_state(k, v, *, scale=None, key_lengths=None):
    """Efficient Attention's context state of the keys j < key_lengths[b] (default all):
    k [B,H,n,d], v [B,H,n,d_v] -> [B,H,d,d_v+2], per feature r the row
    [Σ_j e_jr·v_j | Σ_j e_jr | c_r] with e_jr = exp(scale·k_jr − c_r), c_r = max_j scale·k_jr
    (−inf, and zeros, where the block holds no key). States add as add_states adds them, and
    efficient_apply_state of the whole sequence's state is linattn.torch.efficient_attention.
    scale: None is 1/sqrt(d). Differentiable in k and v (the shifts take no gradient)."""
    fn = "linattn.torch.state.efficient_key_state"
    scale = _efficient_scale(fn, scale)
    k, v = _inputs(fn, [("k", k), ("v", v)])
    return _KeyState.apply(k, v, _length_list(fn, key_lengths), _EFFICIENT_KEY_STATE, {"scale": scale})


def efficient_apply_state(q, state, *, scale=None):
    """q [B,H,n,d] and an efficient_key_state -> out_i = softmax_d(scale·q_i)·G [B,H,n,d_v],
    G_r = S_r / z_r (0 where z_r = 0: no key). Differentiable in q and the state's S and z."""
    fn = "linattn.torch.state.efficient_apply_state"
    scale = _efficient_scale(fn, scale)
    q, state = _inputs(fn, [("q", q), ("state", state)])
    return _EfficientApplyState.apply(q, state, scale)


class _LinformerProject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, e, f, offset, lengths):
        out = _from_numpy(_linattn._linformer_project(_array(k), _array(v), _array(e), _array(f), offset, lengths))
        ctx.save_for_backward(k, v, e, f)
        ctx.offset, ctx.lengths = offset, lengths
        return out

    @staticmethod
    @once_differentiable  # the backward is a kernel: no graph for second derivatives
    def backward(ctx, dprojected):
        k, v, e, f = ctx.saved_tensors
        params = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]  # frozen e and f: no dE, dF work
        dk, dv, de, df = _linattn._linformer_project_backward(_array(k), _array(v), _array(e), _array(f),
                                                              _array(dprojected), ctx.offset, ctx.lengths, params)
        return (_from_numpy(dk), _from_numpy(dv), None if de is None else _from_numpy(de),
                None if df is None else _from_numpy(df), None, None)


def linformer_project(k, v, e, f, *, offset=0, key_lengths=None):
    """Linformer's projection of a block of keys: k [B,H,n,d], v [B,H,n,d_v], e and f [s, n_max]
    or [H, s, n_max] as linattn.torch.linformer_attention takes them -> [B,H,s,d+d_v] =
    [E·K | F·V] over the keys j < key_lengths[b] (default all), key j at column offset + j of
    e and f. The blocks' projections add up to the whole sequence's, and softmax attention over
    them is linformer_attention. Differentiable in k, v, e and f."""
    fn = "linattn.torch.state.linformer_project"
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError("%s: offset must be an int, got %r" % (fn, offset))
    k, v, e, f = _inputs(fn, [("k", k), ("v", v), ("e", e), ("f", f)])
    return _LinformerProject.apply(k, v, e, f, offset, _length_list(fn, key_lengths))


def empty_state(batch, heads, features=None, value_dim=None, *, favor=False, dtype=torch.float32, feature_dim=None):
    """The state of no keys [batch, heads, features, value_dim + 2]: zeros, and shifts −inf for
    FAVOR (0 for the plain maps). features: m', the feature count (head_dim for the plain maps;
    FAVOR's m, or 2m for the hyperbolic and trig kernels), as hybrid_decode_step's sums name it;
    its keyword was feature_dim before 0.2 (Hedgehog's f everywhere else), accepted until the
    next release with a DeprecationWarning."""
    fn = "linattn.torch.state.empty_state"
    given = {name: x for name, x in (("features", features), ("feature_dim", feature_dim)) if x is not None}
    features = renamed(fn, given, {"feature_dim": "features"}).get("features")
    if features is None or value_dim is None:
        raise TypeError("%s: needs batch, heads, features and value_dim" % fn)
    s = torch.zeros(batch, heads, features, value_dim + 2, dtype=dtype)
    if favor:
        s[..., -1] = float("-inf")
    return s


def _factors(c_i, c):
    """exp(c_i − c), 0 where either is −inf (a state of no keys, or none at all)."""
    live = torch.isfinite(c_i) & torch.isfinite(c)
    return torch.where(live, torch.exp(torch.where(live, c_i - c, 0)), 0)


def rescale_state(state, shift):
    """state [..., m', d_v+2] on the shifts `shift` [..., m', 1], each >= the state's own (a
    ValueError otherwise): [S | z]·exp(c − shift) | shift. Differentiable in S and z."""
    c = state[..., -1:].detach()
    if bool((shift < c).any()):
        raise ValueError("linattn.torch.state.rescale_state: shift must be >= the state's own shifts (its last "
                         "column) everywhere: a lower shift would raise S and z, and may overflow")
    return torch.cat([state[..., :-1] * _factors(c, shift), shift], -1)


def _keep(weights, states):
    """weights as a bool mask [N], one per state of states [N, ...]; only 0 and 1 are accepted."""
    w = torch.as_tensor(weights)
    if w.shape != (states.shape[0],) or not bool(((w == 0) | (w == 1)).all()):
        raise ValueError("linattn.torch.state.add_states: weights must hold one 0 or 1 per state (%d), got %s"
                         % (states.shape[0], w.tolist()))
    return w.to(torch.bool)


def add_states(states, weights=None):
    """The sum of states stacked along dim 0 ([N, B, H, m', d_v+2]; or a list of them): shifts
    c = max_i c_i, [S | z] = Σ_i [S_i | z_i]·exp(c_i − c), a term at c_i = −inf being 0.
    weights [N] (0 or 1, optional) leaves states out by multiplying them by 0, so that every
    state stays in the autograd graph (a collective's adjoint needs every rank's backward);
    where every state is left out, the sum is the empty state (shifts −inf, or 0 for the plain
    maps, whose states have every shift 0). Differentiable in S and z; the shifts carry no
    gradient."""
    if isinstance(states, (list, tuple)):
        states = torch.stack(list(states))
    return _sum_states(states, None if weights is None else _keep(weights, states))


def _sum_states(states, keep=None):
    """add_states on a stacked tensor, keep a bool tensor [N] or None, unchecked
    (linattn.torch.distributed's calls, whose masks it builds itself)."""
    if keep is not None:
        keep = keep.view(-1, *([1] * (states.dim() - 1)))
    c_i = states[..., -1:].detach()
    if not bool((c_i == 0).all()):  # FAVOR (the plain maps' shifts are all 0: nothing to rescale)
        if keep is not None:
            c_i = torch.where(keep, c_i, float("-inf"))
        c = c_i.amax(0)
        return torch.cat([(states[..., :-1] * _factors(c_i, c)).sum(0), c], -1)
    sz = states[..., :-1] if keep is None else states[..., :-1] * keep.to(states.dtype)
    return torch.cat([sz.sum(0), c_i[0]], -1)
