"""linattn.torch.distributed: attention over a sequence split across processes (context
parallelism), on torch.distributed (gloo on CPU).

Every rank holds a block of the sequence, q, k, v [batch, heads, n_local, head_dim] at the same
positions, and calls the same function with the same options, key_lengths (of the whole
sequence) and shared tensors; each gets its block of the output, equal to linattn.torch's
single-process result to float rounding, with backward. The functions take linattn.torch's
names, arguments and defaults, plus

    group:  the process group (None: the default group);
    layout: "contiguous" (rank r holds one block, in rank order; blocks of any sizes >= 1) or
            "zigzag" (the sequence cut into 2P chunks, rank r holding chunks r and 2P−1−r, so
            that a causal mask gives every rank the same work; shard() cuts it so).

What travels, per (batch, head) and rank:
    softmax_attention    ring attention: P−1 steps each passing a k, v block (O(n/P·d) each),
                         and in backward the block's dk, dv once more round the ring
    linear_attention,    one all-reduce of [S | z] (O(m'·d_v), independent of n); causal: an
    favor_attention,     all-gather of every segment's [S | z]; FAVOR adds its m' key-shift
    hedgehog_attention   maxima (an all-reduce; causal: gathered beside each segment's state);
                         conv_weight adds an all-gather of K−1 edge rows
    hybrid_attention     an all-gather of every segment's state of the keys delayed (and, not
                         causal, advanced) past the window, and of every segment's first and
                         last w (+1) rows of [k | v | 1 | φ(k)] for the windows near its edges
    efficient_attention  one all-reduce of [d, d_v+1] and one of d maxima
    linformer_attention  one all-reduce of [s, d+d_v]
    nystrom_attention    refused (ValueError); see docs/distributed.md
    gated_delta_rule     an all-gather of every segment's transition and state [T | B]
                         (O(d_k·(d_k+d_v)), independent of n), after one more agreement
                         (each segment's values checked by the kernel first); each rank runs
                         its segments twice (from 0, and from I for T)
and every call starts with an all-gather of a few numbers that checks the ranks agree, so that
bad input raises the same error on every rank instead of hanging the others.

Gradients: dq, dk, dv (and a hybrid's query_features, key_features) are this rank's rows. A
parameter shared by the ranks (conv_weight, e, f, Hedgehog's weights and biases, window_gate)
gets this rank's share of its gradient on each rank: sum them over ranks for the whole
sequence's gradient (DistributedDataParallel averages instead: scale the loss by the world
size, or all-reduce with SUM yourself). Every rank must run backward, with the same
requires_grad on its inputs, since backward makes collectives too.

See docs/distributed.md."""

import functools
import math

import torch
# Imported before the caller's init_process_group, on purpose: torch._dynamo, imported for the
# first time after it (torch.optim does so when the first optimizer is made), keeps references
# to the default process group, so destroy_process_group() no longer ends gloo's worker threads
# and they live on into interpreter exit, where one can abort the process (PyTorch 2.15;
# docs/distributed.md, "Exiting cleanly").
import torch._dynamo  # noqa: F401

from .. import _lengths, _tensor
from ..._options import renamed as _renamed
from ..._options import former_spellings as _former_spellings
from ... import _linattn as _lx, methods as _methods, _default
from .. import feature_maps as _feature_maps
from . import _context, _delta, _hybrid, _kernelized, _ring
from ._comm import Group, reset_traffic, traffic
from ._layout import LAYOUTS, check_sizes, segments, shard_of, unshard

__all__ = ["softmax_attention", "linear_attention", "favor_attention", "hedgehog_attention", "hybrid_attention",
           "efficient_attention", "linformer_attention", "nystrom_attention", "gated_delta_rule", "shard", "gather",
           "traffic", "reset_traffic"]

_INFO = {m["function"]: m for m in _methods()}
_DTYPES = {torch.float32: 1, torch.float64: 2}
_FIELDS = 40  # numbers each rank sends to the agreement check


def _option_default(fn, name):
    return _default(next(o for o in _INFO[fn]["options"] if o["name"] == name))


def _former_names(function):
    """Function `function` of the registry, accepting its options' former names
    (linear_attention's dwc_weight, now conv_weight) and values (its feature_map 'identity', now
    'given') until the next release, with a
    DeprecationWarning, as linattn.torch's functions do; its signature stays linattn.torch's."""
    former, former_values = _former_spellings(_INFO[function.__name__]["options"])

    @functools.wraps(function)
    def call(*args, **kwargs):
        return function(*args, **_renamed(_full(function.__name__), kwargs, former, former_values=former_values))
    return call


def _full(name):
    return "linattn.torch.distributed." + name


def _checksum(t):
    """Numbers that differ when ranks pass different shared tensors: the C++ _fingerprint of the
    tensor's bytes (exact integer sums, the same on every rank whatever its threads; one pass
    with no copies). The tensors' dtypes are agreed on with q's."""
    if t is None:
        return [0.0, 0.0, 0.0]
    x = t.detach().cpu().contiguous()
    return list(_lx._fingerprint(x.reshape(-1).view(torch.uint8).numpy()))


def _all_finite(x):
    """Whether every value is finite: the smallest and largest, since both propagate NaN (one
    reduction, no temporary: 20 times faster than isfinite(x).all(), which took 14 ms of a
    40 ms linear_attention forward + backward at n = 8192)."""
    return math.isfinite(_max_abs(x)[0])


def _max_abs(*xs):
    """[max |x| of each tensor] (0 when empty), NaN where one has a non-finite value: one
    aminmax per tensor, and one conversion to Python numbers for all of them."""
    parts = torch.stack([torch.stack(torch.aminmax(x.detach())) if x.numel() else x.new_zeros(2) for x in xs])
    return [max(-lo, hi) if math.isfinite(lo) and math.isfinite(hi) else math.nan for lo, hi in parts.tolist()]


def _finite(fn, name, top):
    """top: the input's _max_abs."""
    if not math.isfinite(top):
        raise ValueError("%s: %s has a non-finite value; every rank's q, k and v must be finite (padded positions "
                         "too: give them zeros)" % (fn, name))


class _Call:
    """One call's checked inputs, agreed on by every rank. check_options(fn, q, k, v, top) checks
    the method's options and returns their agreement fields; top maps "q", "k", "v" to
    _max_abs of each (NaN where one is not finite, which is raised after the options' checks), so
    that each input is read once for every check that needs its range."""

    def __init__(self, name, group, layout, q, k, v, key_lengths, causal, check_options):
        fn = self.fn = _full(name)
        self.g = g = Group(fn, group)
        problem, fields = None, []
        try:
            _check_layout(fn, layout)
            if not isinstance(causal, bool):
                raise TypeError("%s: causal must be True or False, got %r" % (fn, causal))
            q, k, v = (_tensor(fn, n, x) for n, x in (("q", q), ("k", k), ("v", v)))
            for n, x in (("q", q), ("k", k), ("v", v)):
                if x.dim() != 4:
                    raise ValueError("%s: %s must be [batch, heads, n_local, dim], got shape %s" % (fn, n, list(x.shape)))
            if not (q.dtype == k.dtype == v.dtype):
                raise TypeError("%s: q, k and v must have one dtype, got %s, %s, %s" % (fn, q.dtype, k.dtype, v.dtype))
            if q.shape[:3] != k.shape[:3] or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
                raise ValueError("%s: q, k, v must be [B, H, n_local, d], [B, H, n_local, d], [B, H, n_local, d_v] at "
                                 "the same positions, got %s, %s, %s" % (fn, list(q.shape), list(k.shape), list(v.shape)))
            lengths = _lengths(fn, key_lengths)
            if lengths is not None and lengths.shape != (q.shape[0],):
                raise ValueError("%s: key_lengths must hold one length per batch item (%d), got shape %s"
                                 % (fn, q.shape[0], list(lengths.shape)))
            fields = [q.shape[0], q.shape[1], q.shape[3], v.shape[3], _DTYPES[q.dtype], causal, LAYOUTS.index(layout),
                      q.requires_grad, k.requires_grad, v.requires_grad]
            fields += [-1.0, 0.0] if lengths is None else [lengths.numel(), float((lengths * (torch.arange(
                lengths.numel()) + 1)).sum())]
            top = dict(zip("qkv", _max_abs(q, k, v)))
            fields += check_options(fn, q, k, v, top)
            for n in ("q", "k", "v"):
                _finite(fn, n, top[n])
        except (TypeError, ValueError) as e:
            problem, fields = e, []
        assert len(fields) <= _FIELDS - 2
        fields = fields + [0.0] * (_FIELDS - 2 - len(fields))
        self.sizes = g.agree(q.shape[2] if problem is None else 0, fields, problem)
        self.n = n = sum(self.sizes)
        if lengths is not None and (int(lengths.min()) < 0 or int(lengths.max()) > n):
            raise ValueError("%s: key_lengths must lie in [0, n] for the whole sequence's n = %d, got %s"
                             % (fn, n, lengths.tolist()))
        message = check_sizes(fn, layout, self.sizes)
        if message:
            raise ValueError(message)
        self.segs = [segments(layout, self.sizes, r) for r in range(g.size)]
        self.q, self.k, self.v, self.lengths = q, k, v, lengths


def _check_layout(fn, layout):
    if layout not in LAYOUTS:
        raise ValueError("%s: layout must be one of %s, got %r" % (fn, ", ".join(LAYOUTS), layout))


def _scale_of(fn, scale, d):
    if scale is None:
        return 1 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError("%s: scale must be a finite float > 0 or None, got %r" % (fn, scale))
    return float(scale)


def _no_causal(fn, causal, function):
    if causal is True:
        raise ValueError("%s: causal=True is not available: %s" % (fn, _INFO[function]["no_causal"]))


def softmax_attention(q, k, v, *, causal=False, scale=None, key_lengths=None, group=None, layout="contiguous"):
    """Exact softmax attention by ring attention; see the module's documentation."""
    holder = {}

    def check(fn, q, k, v, top):
        holder["scale"] = _scale_of(fn, scale, q.shape[3])
        return [holder["scale"]]
    c = _Call("softmax_attention", group, layout, q, k, v, key_lengths, causal, check)
    return _ring.RingSoftmax.apply(c.q, c.k, c.v, c.lengths, causal, holder["scale"], c.g, c.segs)


def _option_choices(fn, name):
    return tuple(next(o for o in _INFO[fn]["options"] if o["name"] == name)["choices"])


_LINEAR_MAPS = _option_choices("linear_attention", "feature_map")


def _nonnegative(fn, name, x, why):
    if x.numel() > 0 and not bool(x.detach().amin() >= 0):  # NaN too: _finite names it
        bad = x.detach() < 0
        if bool(bad.any()):
            raise ValueError("%s: %s must be >= 0 (%s); found %g" % (fn, name, why, float(x.detach()[bad][0])))


def _state_in_range(fn, k, v, feature_bound, top):
    """Refuses (on this rank, before any collective, so that every rank raises) k and v whose
    block state Σ_j φ(k_j)·[v_j, 1] could overflow: this rank's keys times the largest feature
    (feature_bound of max|k|) times max(1, max|v|) above the dtype's largest value / 2^8. A
    state that overflowed in the kernel would raise on this rank alone, and leave the others
    waiting in the all-reduce. top: _Call's max |x| per input."""
    k_max, v_max = top["k"], top["v"]
    if not (math.isfinite(k_max) and math.isfinite(v_max)) or k.numel() == 0 or v.numel() == 0:
        return  # _finite names the non-finite value
    bound = k.shape[2] * feature_bound(k_max) * max(1.0, v_max)
    if not bound <= torch.finfo(k.dtype).max / 2 ** 8:
        raise ValueError("%s: k and v are too large for %s: this rank's key state reaches %g (max |k| = %g, max |v| = "
                         "%g over %d keys), beyond the dtype's range; scale them down or use float64"
                         % (fn, k.dtype, bound, k_max, v_max, k.shape[2]))


def _eps_check(fn, eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError("%s: eps must be a finite float >= 0, got %r" % (fn, eps))


def _like_q(fn, name, t, q):
    """A tensor argument beside q, after its shape check: q's dtype, and finite."""
    if t.dtype != q.dtype:
        raise TypeError("%s: %s must have q's dtype %s, got %s" % (fn, name, q.dtype, t.dtype))
    if not _all_finite(t):
        raise ValueError("%s: %s has a non-finite value" % (fn, name))
    return t


def _shared(fn, name, t, shape, q):
    """A tensor every rank shares (a parameter): its shape, dtype and finiteness."""
    t = _tensor(fn, name, t)
    if list(t.shape) != list(shape):
        raise ValueError("%s: %s has shape %s; expected %s" % (fn, name, list(t.shape), list(shape)))
    return _like_q(fn, name, t, q)


def _conv_check(fn, w, q, v, causal):
    w = _tensor(fn, "conv_weight", w)
    if w.dim() != 2 or w.shape[0] != q.shape[1] or w.shape[1] < 1:
        raise ValueError("%s: conv_weight must be [heads = %d, K], got shape %s" % (fn, q.shape[1], list(w.shape)))
    if not causal and w.shape[1] % 2 == 0:
        raise ValueError("%s: conv_weight's K must be odd unless causal, got K = %d" % (fn, w.shape[1]))
    return _like_q(fn, "conv_weight", w, q)


@_former_names
def linear_attention(q, k, v, *, feature_map=_option_default("linear_attention", "feature_map"), causal=False,
                     key_lengths=None, eps=_option_default("linear_attention", "eps"),
                     focus_power=_option_default("linear_attention", "focus_power"), conv_weight=None, group=None,
                     layout="contiguous"):
    """Kernelized attention (elu, relu, focused) by an all-reduce of the key state; see the
    module's documentation."""
    holder = {}

    def check(fn, q, k, v, top):
        if feature_map not in _LINEAR_MAPS:
            raise ValueError("%s: feature_map must be one of %s, got %r" % (fn, ", ".join(_LINEAR_MAPS), feature_map))
        if feature_map == "given":
            for name, x in (("q", q), ("k", k)):
                _nonnegative(fn, name, x, "with feature_map='given', %s holds features; over ranks, padded "
                                          "positions too: give them zeros" % name)
        _eps_check(fn, eps)
        if isinstance(focus_power, bool) or not isinstance(focus_power, (int, float)) or not 1 <= focus_power <= 1000:
            raise ValueError("%s: focus_power must lie in [1, 1000], got %r" % (fn, focus_power))
        holder["w"] = None if conv_weight is None else _conv_check(fn, conv_weight, q, v, causal)
        _state_in_range(fn, k, v, lambda x: _lx._plain_feature_bound(feature_map, x, q.shape[3]), top)
        return [_LINEAR_MAPS.index(feature_map), eps, focus_power,
                conv_weight is not None and conv_weight.requires_grad] + _checksum(holder["w"])
    c = _Call("linear_attention", group, layout, q, k, v, key_lengths, causal, check)
    opts = dict(feature_map=feature_map, eps=float(eps), focus_power=float(focus_power))
    out = _kernelized.attention(c.g, c.segs, c.q, c.k, c.v, c.lengths, causal, opts)
    if holder["w"] is not None:
        out = out + _kernelized.depthwise_conv(c.g, c.segs, c.v, holder["w"], c.lengths, causal)
    return out


def _projection(fn, projection, kernel, kernels, scale, q, k, top):
    """FAVOR's projection ω [num_features, head_dim], checked with its kernel and the rows' size
    (top: _Call's max |x| per input)."""
    w = _tensor(fn, "projection", projection)
    if w.dim() != 2 or w.shape[1] != q.shape[3] or w.shape[0] < 1:
        raise ValueError("%s: projection must be [num_features, head_dim = %d], got shape %s"
                         % (fn, q.shape[3], list(w.shape)))
    if w.requires_grad:
        raise ValueError("%s: projection has requires_grad=True, but it is a constant of the method (no "
                         "gradient flows to it); register it as a buffer or pass projection.detach()" % fn)
    _like_q(fn, "projection", w, q)
    if kernel not in kernels:
        raise ValueError("%s: kernel must be %s, got %r" % (fn, " or ".join(kernels), kernel))
    if not scale > 0:
        raise ValueError("%s: scale must be > 0 for random features, got %r" % (fn, scale))
    limit = torch.finfo(q.dtype).max
    w_norm = float(w.double().norm(dim=1).max())

    def in_range(top_norm2):  # a row of squared norm top_norm2 (times scale): its logits stay finite
        return 0.5 * top_norm2 < limit and math.sqrt(top_norm2) * w_norm < limit
    for name, x in (("q", q), ("k", k)):
        # The largest squared row norm is at most head_dim·max|x|²: reading the rows again in
        # float64 (2 ms of a 3 ms FAVOR+ forward at n = 1024) is needed only where that bound fails.
        if not math.isfinite(top[name]) or in_range(x.shape[3] * top[name] * top[name] * scale):
            continue  # a non-finite value is _finite's to name
        if not in_range(float((x.detach().double() ** 2).sum(-1).max()) * scale):
            raise ValueError("%s: a row of %s is too large for %s random features; scale the inputs down or use "
                             "float64" % (fn, name, q.dtype))
    return w


def favor_attention(q, k, v, projection, *, kernel=_option_default("favor_attention", "kernel"), causal=False,
                    key_lengths=None, scale=None, group=None, layout="contiguous"):
    """Performer / FAVOR+ by an all-reduce of the key state (the whole sequence's key shift
    first); see the module's documentation."""
    holder = {}

    def check(fn, q, k, v, top):
        holder["scale"] = _scale_of(fn, scale, q.shape[3])
        holder["w"] = _projection(fn, projection, kernel, ("positive", "hyperbolic", "trig"), holder["scale"], q, k,
                                  top)
        _state_in_range(fn, k, v, lambda x: 1.0, top)  # features on the key shifts are <= 1
        return [("positive", "hyperbolic", "trig").index(kernel), holder["scale"]] + _checksum(holder["w"])
    c = _Call("favor_attention", group, layout, q, k, v, key_lengths, causal, check)
    opts = dict(feature_map="favor", projection=holder["w"], kernel=kernel, scale=holder["scale"])
    return _kernelized.attention(c.g, c.segs, c.q, c.k, c.v, c.lengths, causal, opts)


def hedgehog_attention(q, k, v, query_weight, query_bias, key_weight, key_bias, *, causal=False, key_lengths=None,
                       eps=1e-6, group=None, layout="contiguous"):
    """Linear attention with Hedgehog's learned maps (linattn.torch.hedgehog_attention) by an
    all-reduce of the key state: each rank maps its own rows (the maps are per row), then as
    linear_attention with feature_map="given". The weights [H, d, f] and biases [H, f] are
    shared: each rank gets its share of their gradients. See the module's documentation."""
    holder = {}

    def check(fn, q, k, v, top):
        _eps_check(fn, eps)
        H, d = q.shape[1], q.shape[3]
        w = _tensor(fn, "query_weight", query_weight)
        f = w.shape[2] if w.dim() == 3 and w.shape[2] >= 1 else 0
        if f == 0:
            raise ValueError("%s: query_weight has shape %s; expected [heads = %d, head_dim = %d, feature_dim >= 1]"
                             % (fn, list(w.shape), H, d))
        tensors = {"query_weight": _shared(fn, "query_weight", query_weight, [H, d, f], q),
                   "query_bias": _shared(fn, "query_bias", query_bias, [H, f], q),
                   "key_weight": _shared(fn, "key_weight", key_weight, [H, d, f], q),
                   "key_bias": _shared(fn, "key_bias", key_bias, [H, f], q)}
        holder.update(tensors)
        _state_in_range(fn, k, v, lambda x: 1.0, top)  # Hedgehog's features are softmax weights, <= 1
        fields = [eps, f]
        for t in tensors.values():
            fields += [t.requires_grad] + _checksum(t)
        return fields
    c = _Call("hedgehog_attention", group, layout, q, k, v, key_lengths, causal, check)
    fq = _feature_maps.hedgehog_features(c.q, holder["query_weight"], holder["query_bias"])
    fk = _feature_maps.hedgehog_features(c.k, holder["key_weight"], holder["key_bias"])
    return _kernelized.attention(c.g, c.segs, fq, fk, c.v, c.lengths, causal,
                                 dict(feature_map="given", eps=float(eps)))


_HYBRID_MAPS = _option_choices("hybrid_attention", "feature_map")


def hybrid_attention(q, k, v, *, query_features=None, key_features=None, window_gate=None,
                     window=_option_default("hybrid_attention", "window"), log_decay=None, sinks=0,
                     projection=None,
                     feature_map=_option_default("hybrid_attention", "feature_map"),
                     focus_power=_option_default("hybrid_attention", "focus_power"),
                     kernel=_option_default("hybrid_attention", "kernel"), causal=False, key_lengths=None,
                     scale=None, eps=_option_default("hybrid_attention", "eps"), group=None, layout="contiguous"):
    """The sliding-window + linear hybrid (linattn.torch.hybrid_attention): the linear part
    over the keys outside each window through the states of the other segments, and a halo of
    the neighbouring ranks' rows for the windows near a rank's edge. query_features and key_features (feature_map="given") are this rank's
    rows [B, H, n_local, m']; window_gate [H] is shared. sinks must be 0 and log_decay None: attention
    sinks and the decayed linear part are not in the distributed hybrid yet (the first rank's
    first keys would have to reach every rank; the segments' states would need their decays).
    See the module's documentation."""
    holder = {}
    if sinks != 0 or log_decay is not None:
        raise ValueError("linattn.torch.distributed.hybrid_attention: %s is not supported yet (sinks=0 and "
                         "log_decay=None only); use linattn.torch.hybrid_attention on one process"
                         % ("sinks=%r" % (sinks,) if sinks != 0 else "log_decay"))

    def check(fn, q, k, v, top):
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError("%s: window must be an integer >= 0 (0: no window, plain linear attention), got %r"
                             % (fn, window))
        if feature_map not in _HYBRID_MAPS:
            raise ValueError("%s: feature_map must be one of %s, got %r" % (fn, ", ".join(_HYBRID_MAPS), feature_map))
        given = (query_features is not None, key_features is not None)
        if feature_map == "given" and not all(given):
            raise ValueError("%s: feature_map='given' needs query_features [batch, heads, n_local, m'] and "
                             "key_features [batch, heads, n_local, m']" % fn)
        if feature_map != "given" and any(given):
            raise ValueError("%s: query_features or key_features is given, but feature_map is %r; pass "
                             "feature_map='given' to use them" % (fn, feature_map))
        _eps_check(fn, eps)
        holder["scale"] = _scale_of(fn, scale, q.shape[3])
        fields = [window, _HYBRID_MAPS.index(feature_map), eps, holder["scale"]]
        if feature_map == "focused":
            if isinstance(focus_power, bool) or not isinstance(focus_power, (int, float)) or not 1 <= focus_power <= 1000:
                raise ValueError("%s: focus_power must lie in [1, 1000], got %r" % (fn, focus_power))
            fields += [float(focus_power)]
        elif focus_power != _option_default("hybrid_attention", "focus_power"):
            raise ValueError("%s: focus_power=%r applies to feature_map='focused' only, but feature_map is %r"
                             % (fn, focus_power, feature_map))
        default_kernel = _option_default("hybrid_attention", "kernel")
        if feature_map == "favor":
            if projection is None:
                raise ValueError("%s: feature_map='favor' needs projection [num_features, head_dim] (from "
                                 "random_features)" % fn)
            holder["w"] = _projection(fn, projection, kernel, ("positive", "hyperbolic"), holder["scale"], q, k, top)
            fields += [kernel == "positive"] + _checksum(holder["w"])
        elif projection is not None:
            raise ValueError("%s: projection is given, but feature_map is %r; pass feature_map='favor' to use it"
                             % (fn, feature_map))
        elif kernel != default_kernel:
            raise ValueError("%s: kernel=%r applies to feature_map='favor' only, but feature_map is %r"
                             % (fn, kernel, feature_map))
        if feature_map == "given":
            fq, fk = _tensor(fn, "query_features", query_features), _tensor(fn, "key_features", key_features)
            for name, x in (("query_features", fq), ("key_features", fk)):
                if x.dim() != 4 or list(x.shape[:3]) != list(q.shape[:3]) or x.shape[3] < 1:
                    raise ValueError("%s: %s has shape %s; expected [batch, heads, n_local, m'] = [%d, %d, %d, m']"
                                     % (fn, name, list(x.shape), *q.shape[:3]))
                _like_q(fn, name, x, q)
                _nonnegative(fn, name, x, "features of a map of the caller's; over ranks, padded positions too: "
                                          "give them zeros")
            if fq.shape[3] != fk.shape[3]:
                raise ValueError("%s: query_features has m' = %d features and key_features %d; they must match"
                                 % (fn, fq.shape[3], fk.shape[3]))
            holder.update(fq=fq, fk=fk)
            fields += [fq.shape[3], fq.requires_grad, fk.requires_grad]
        holder["gate"] = None if window_gate is None else _shared(fn, "window_gate", window_gate, [q.shape[1]], q)
        fields += [window_gate is not None and holder["gate"].requires_grad] + _checksum(holder["gate"])
        return fields
    c = _Call("hybrid_attention", group, layout, q, k, v, key_lengths, causal, check)
    favor = None
    if feature_map == "given":
        fq, fk = holder["fq"], holder["fk"]
    elif feature_map == "favor":
        # The whole sequence's largest key logit per feature, as favor_attention over ranks shifts.
        phi = _kernelized.FavorKeys(holder["w"], kernel, holder["scale"])
        # Both sides in the key form: the query's −‖x̃‖²/2 no longer cancels against exact weights.
        Lq, Lk = (phi.logits(x, "query_with_norm")[0] for x in (c.q, c.k))
        mine = c.segs[c.g.rank]
        phi.fit(c.g, [s.rows(c.k) for s in mine], [_kernelized.key_mask(c.lengths, s) for s in mine])
        top = phi.shift
        # Padded keys may lie above the shift: their features are 0 (and zeroed by the key mask too).
        fq, fk, favor = None, torch.exp(torch.where(Lk - top <= 0, Lk - top, float("-inf"))), (Lq, top)
    else:
        fq, fk = (_feature_maps.features(x, feature_map, focus_power=float(focus_power)) for x in (c.q, c.k))
    return _hybrid.attention(c.g, c.segs, c.q, c.k, c.v, fq, fk, c.lengths, causal, window, holder["scale"],
                             holder["gate"], float(eps), favor)


def efficient_attention(q, k, v, *, key_lengths=None, scale=None, causal=False, group=None, layout="contiguous"):
    """Efficient Attention by an all-reduce of its context matrix; see the module's documentation."""
    holder = {}

    def check(fn, q, k, v, top):
        _no_causal(fn, causal, "efficient_attention")
        holder["scale"] = _scale_of(fn, scale, q.shape[3])
        return [holder["scale"]]
    c = _Call("efficient_attention", group, layout, q, k, v, key_lengths, causal, check)
    return _context.efficient(c.g, c.segs, c.q, c.k, c.v, c.lengths, holder["scale"])


def linformer_attention(q, k, v, e, f, *, key_lengths=None, scale=None, causal=False, group=None,
                        layout="contiguous"):
    """Linformer by an all-reduce of the projected keys and values; e and f [s, n_max] or
    [heads, s, n_max] are the whole sequence's (each rank uses its columns); see the module's
    documentation."""
    holder = {}

    def check(fn, q, k, v, top):
        _no_causal(fn, causal, "linformer_attention")
        E, Fm = _tensor(fn, "e", e), _tensor(fn, "f", f)
        for name, x in (("e", E), ("f", Fm)):
            if x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[0] != q.shape[1]):
                raise ValueError("%s: %s must be [s_proj, n_max] or [heads = %d, s_proj, n_max], got shape %s"
                                 % (fn, name, q.shape[1], list(x.shape)))
            _like_q(fn, name, x, q)
        if E.shape != Fm.shape:
            raise ValueError("%s: f must have e's shape %s, got %s" % (fn, list(E.shape), list(Fm.shape)))
        holder.update(scale=_scale_of(fn, scale, q.shape[3]), e=E, f=Fm)
        return [holder["scale"], E.requires_grad, Fm.requires_grad] + _checksum(E) + _checksum(Fm)
    c = _Call("linformer_attention", group, layout, q, k, v, key_lengths, causal, check)
    if c.n > holder["e"].shape[-1]:
        raise ValueError("%s: the whole sequence has n = %d positions, more than e's n_max = %d"
                         % (c.fn, c.n, holder["e"].shape[-1]))
    return _context.linformer(c.g, c.segs, c.q, c.k, c.v, holder["e"], holder["f"], c.lengths, holder["scale"])


def nystrom_attention(q, k, v, *, num_landmarks=_option_default("nystrom_attention", "num_landmarks"),
                      pinv_iterations=_option_default("nystrom_attention", "pinv_iterations"),
                      pinv=_option_default("nystrom_attention", "pinv"), conv_weight=None, key_lengths=None,
                      scale=None, causal=False, group=None, layout="contiguous"):
    """Not available: raises ValueError (on every rank, before any collective). Nyström's
    landmarks are means over segments of each item's valid length, and its m×m core and
    softmax(Q̃Kᵀ)V need them before any output; see docs/distributed.md for what it would take
    and what to use instead."""
    raise ValueError("%s is not available: Nyström's landmarks are means over segments of each item's valid "
                     "length, so the segments move with key_lengths and straddle ranks; see docs/distributed.md. "
                     "Gather the sequence (linattn.torch.distributed.gather) and call linattn.torch.nystrom_attention, "
                     "or use linformer_attention, efficient_attention or favor_attention, which run distributed"
                     % _full("nystrom_attention"))


def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm_in_kernel=False, group=None,
                     layout="contiguous"):
    """The gated delta rule and KDA (linattn.torch.gated_delta_rule: causal, from a zero state)
    over ranks: each rank holds the rows of q, k [B, H_k, n_local, d_k], v [B, H, n_local, d_v],
    g [B, H, n_local] or [B, H, n_local, d_k] and beta [B, H, n_local] at its positions, and
    gets its rows of the output, with gradients for all five. Each segment's map of the state
    (S ↦ T·S + B) is all-gathered and folded; see the module's documentation and _delta.py."""
    fn = _full("gated_delta_rule")
    grp = Group(fn, group)
    problem, fields, n_local = None, [], 0
    try:
        _check_layout(fn, layout)
        named = [(name, _tensor(fn, name, x)) for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))]
        q, k, v, g, beta = (x for _, x in named)
        for (name, x), ranks in zip(named, ((4,), (4,), (4,), (3, 4), (3,))):
            if x.dim() not in ranks:
                raise ValueError("%s: %s must have %s dimensions [batch, heads, n_local, ...], got shape %s"
                                 % (fn, name, " or ".join(map(str, ranks)), list(x.shape)))
        n_local = q.shape[2]
        for name, x in named[1:]:
            if x.shape[2] != n_local:
                raise ValueError("%s: %s has %d positions, q has %d: every input holds this rank's rows"
                                 % (fn, name, x.shape[2], n_local))
        if q.dtype not in _DTYPES:
            raise TypeError("%s: q must be float32 or float64 over ranks, got %s" % (fn, q.dtype))
        scale = _scale_of(fn, scale, q.shape[3])
        _delta.check(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
        fields = [q.shape[0], k.shape[1], v.shape[1], q.shape[3], v.shape[3], _DTYPES[q.dtype], LAYOUTS.index(layout),
                  g.dim(), use_qk_l2norm_in_kernel, scale] + [x.requires_grad for _, x in named]
    except (TypeError, ValueError) as e:
        problem, fields = e, []
    fields = fields + [0.0] * (_FIELDS - 2 - len(fields))
    sizes = grp.agree(n_local if problem is None else 0, fields, problem)
    message = check_sizes(fn, layout, sizes)
    if message:
        raise ValueError(message)
    segs = [segments(layout, sizes, r) for r in range(grp.size)]
    maps = None
    try:  # bad values (g > 0, beta outside [0, 2], non-finite) raise here, on this rank only
        maps = _delta.segment_maps(segs[grp.rank], q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    except (TypeError, ValueError) as e:
        problem = e
    grp.agree(n_local if problem is None else 0, [0.0] * (_FIELDS - 2), problem)
    return _delta.attention(grp, segs, maps, q.shape[3])


def shard(x, group=None, layout="contiguous"):
    """This rank's part of a whole-sequence tensor [B, H, n, ...] in the layout (contiguous:
    near-equal blocks in rank order; zigzag: chunks r and 2P−1−r of 2P)."""
    g = Group(_full("shard"), group)
    _check_layout(_full("shard"), layout)
    if x.dim() < 3 or x.shape[2] < (2 if layout == "zigzag" else 1) * g.size:
        raise ValueError("%s: x must be [B, H, n, ...] with n >= %d for %d ranks in layout %s, got shape %s"
                         % (_full("shard"), (2 if layout == "zigzag" else 1) * g.size, g.size, layout, list(x.shape)))
    return shard_of(x, g.rank, g.size, layout)


def gather(x, group=None, layout="contiguous"):
    """The whole-sequence tensor from every rank's block x [B, H, n_local, ...] (every rank gets
    it; no gradient: for evaluation and tests)."""
    g = Group(_full("gather"), group)
    with torch.no_grad():
        sizes = [int(s) for s in g.all_gather(torch.tensor([x.shape[2]]))[:, 0]]
        padded = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 3) + [0, max(sizes) - x.shape[2]])
        parts = g.all_gather(padded)
    return unshard([parts[r].narrow(2, 0, sizes[r]) for r in range(g.size)], layout)
