"""Learned feature maps for linear attention, as small torch modules. Each maps q or k
[batch, heads, seq, head_dim] to non-negative features [batch, heads, seq, m'], which
linattn's kernel takes as they are (linear_attention(..., feature_map="given")); torch
differentiates the map, the kernel gives the gradients of its features.

    fq, fk = HedgehogFeatureMap(heads, head_dim, 32), HedgehogFeatureMap(heads, head_dim, 32)
    out = linear_attention(fq(q), fk(k), v, feature_map="given", causal=True)

hedgehog_attention() does exactly that, with the maps' parameters as arguments.

Every map's formula is the C++ library's own, differentiable here: hedgehog_features()
(Hedgehog's learned map), features() (elu, relu, focused, given) and feature_logits() (FAVOR's
maps in log form); linattn's decoding cache and context-parallel layers call them rather than a
formula of their own."""

import sys

import torch
from torch.autograd.function import once_differentiable

from .. import _linattn
from .._options import current_feature_map
from ._checks import constant, full_precision_inputs
from ._ops import _array, _tensor as _from_numpy, accumulator_dtype

__all__ = ["LearnedFeatureMap", "register_feature_map", "learned_feature_maps", "HedgehogFeatureMap",
           "hedgehog_features", "features", "feature_logits"]

_WHO = "the feature maps (a 16-bit model's decoding widens to float32 first)"


class _Features(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, feature_map, focus_power):
        ctx.save_for_backward(x)
        ctx.options = (feature_map, focus_power)
        return _from_numpy(_linattn.features(_array(x), feature_map, focus_power=focus_power))

    @staticmethod
    @once_differentiable  # the backward is a kernel: no graph for second derivatives
    def backward(ctx, dphi):
        (x,) = ctx.saved_tensors
        feature_map, focus_power = ctx.options
        return _from_numpy(_linattn.features_backward(_array(x), _array(dphi), feature_map,
                                                      focus_power=focus_power)), None, None


def features(x, feature_map="elu", *, focus_power=3.0):
    """φ(x) [B, H, n, d] for x [B, H, n, d] by linattn's own map (linattn.features), with its
    gradient: feature_map "elu" (elu(x) + 1), "relu", "focused" (‖r‖·rᵖ/‖rᵖ‖, r = relu(x),
    p = focus_power) or "given" (x, which must be >= 0; "identity" before 0.2). float32 or float64; finite."""
    fn = "features"
    (x,) = full_precision_inputs(fn, [("x", x)], _WHO)
    if not isinstance(feature_map, str):
        raise TypeError("%s: feature_map must be a str, got %r" % (fn, feature_map))
    if isinstance(focus_power, bool) or not isinstance(focus_power, (int, float)):
        raise TypeError("%s: focus_power must be a float, got %r" % (fn, focus_power))
    return _Features.apply(x, current_feature_map(fn, feature_map), float(focus_power))


class _FeatureLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, projection, options):
        logits, factors = _linattn.feature_logits(_array(x), _array(projection), **options)
        ctx.save_for_backward(x, projection)
        ctx.options, ctx.logits_shape = options, logits.shape
        ctx.set_materialize_grads(False)  # no zero tensor for unused factors
        return _from_numpy(logits), None if factors is None else _from_numpy(factors)

    @staticmethod
    @once_differentiable  # the backward is a kernel: no graph for second derivatives
    def backward(ctx, dlogits, dfactors):
        x, projection = ctx.saved_tensors
        if dlogits is None:
            dlogits = x.new_zeros(ctx.logits_shape)
        dx = _linattn.feature_logits_backward(_array(x), _array(projection), _array(dlogits), _array(dfactors),
                                              **ctx.options)
        return _from_numpy(dx), None, None


def feature_logits(x, projection, *, kernel="positive", scale=None, side="key"):
    """FAVOR's features of x [B, H, n, d] in log form by linattn's own map
    (linattn.feature_logits), with the gradient in x: (logits, factors), φ = factors·exp(logits)
    up to a factor shared by every row and feature; factors [sin U, cos U] for kernel "trig",
    else None. side "key", "query" (‖x̃‖²/2 cancels) or "query_with_norm". projection ω [m, d]
    is a constant of the method: one with requires_grad=True is refused."""
    fn = "feature_logits"
    x, projection = full_precision_inputs(fn, [("x", x), ("projection", projection)], _WHO)
    constant(fn, "projection", projection)
    for name, value in (("kernel", kernel), ("side", side)):
        if not isinstance(value, str):
            raise TypeError("%s: %s must be a str, got %r" % (fn, name, value))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError("%s: scale must be a float or None, got %r" % (fn, scale))
    options = dict(kernel=kernel, scale=None if scale is None else float(scale), side=side)
    return _FeatureLogits.apply(x, projection, options)


def _check_parameters(fn, x, weight, bias):
    """ValueError/TypeError naming fn and the argument when weight [H, d, f] or bias [H, f]
    does not fit x [B, H, n, d]."""
    for name, t in (("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: %s must be a torch.Tensor, got %s" % (fn, name, type(t).__name__))
        if t.dtype != x.dtype:
            raise TypeError("%s: %s has dtype %s, but the input has %s" % (fn, name, t.dtype, x.dtype))
    if x.dim() != 4:
        raise ValueError("%s: the input must be [batch, heads, seq, head_dim], got shape %s" % (fn, list(x.shape)))
    H, d = x.shape[1], x.shape[3]
    if weight.dim() != 3 or weight.shape[0] != H or weight.shape[1] != d or weight.shape[2] < 1:
        raise ValueError("%s: weight has shape %s; expected [heads = %d, head_dim = %d, feature_dim >= 1]"
                         % (fn, list(weight.shape), H, d))
    if bias.dim() != 2 or bias.shape[0] != H or bias.shape[1] != weight.shape[2]:
        raise ValueError("%s: bias has shape %s; expected [heads = %d, feature_dim = %d]"
                         % (fn, list(bias.shape), H, weight.shape[2]))


# Hedgehog's map as torch operators (linattn::hedgehog_features and its backward), with a fake
# implementation for torch.compile and meta tensors, as the registered methods have (_ops.py).
# A 16-bit input runs in float32, as the kernels widen it; each result is rounded once to its
# input's dtype.
def _wide(t):
    return t.to(accumulator_dtype(t.dtype))


@torch.library.custom_op("linattn::hedgehog_features", mutates_args=(), device_types="cpu")
def _hedgehog_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return _from_numpy(_linattn.hedgehog_features(*(_array(_wide(t)) for t in (x, weight, bias)))).to(x.dtype)


@_hedgehog_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[:-1] + (2 * weight.shape[2],))


@torch.library.custom_op("linattn::hedgehog_features_backward", mutates_args=(), device_types="cpu")
def _hedgehog_backward_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dphi: torch.Tensor,
                          phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    wide = [_wide(t) for t in (x, weight, bias)]
    # A 16-bit forward's φ was rounded: the backward makes it again in float32 instead.
    saved = _array(phi) if phi.dtype == wide[0].dtype else None
    grads = _linattn.hedgehog_features_backward(*(_array(t) for t in wide), _array(dphi.to(wide[0].dtype)), phi=saved)
    return tuple(_from_numpy(g).to(t.dtype) for g, t in zip(grads, (x, weight, bias)))


@_hedgehog_backward_op.register_fake
def _(x, weight, bias, dphi, phi):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


def _hedgehog_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output)  # φ, which the backward reads (as torch's softmax keeps its output)


def _hedgehog_backward(ctx, dphi):
    return _hedgehog_backward_op(*ctx.saved_tensors[:3], dphi.contiguous(), ctx.saved_tensors[3])


_hedgehog_op.register_autograd(_hedgehog_backward, setup_context=_hedgehog_setup)


def hedgehog_features(x, weight, bias):
    """φ(x) = [softmax(x·W_h + b_h), softmax(−(x·W_h + b_h))] over the feature axis, per head h
    (Hedgehog, Zhang et al., ICLR 2024): x [B, H, n, d], weight [H, d, f], bias [H, f] ->
    [B, H, n, 2f], by linattn's own map (linattn.hedgehog_features, the one LinattnCache's
    decoding step runs), with the gradients of x, weight and bias. Each half sums to 1, so
    φ(q)·φ(k) lies in (0, 2] whatever the inputs' size: the kernel's sums cannot overflow.
    softmax shifts by the row maximum, so any finite logit is safe. float32, float64, bfloat16 or
    float16 (16-bit runs in float32), one dtype; CPU tensors. First derivatives only: the
    backward is a kernel, and a second backward through it (create_graph=True, a gradient
    penalty) raises RuntimeError."""
    fn = "hedgehog_features"
    from . import _tensor  # linattn.torch's check, defined before this module is imported

    x = _tensor(fn, "x", x)
    _check_parameters(fn, x, weight, bias)
    for name, t in (("weight", weight), ("bias", bias)):
        _tensor(fn, name, t)
    return _hedgehog_op(x, weight.contiguous(), bias.contiguous())


class LearnedFeatureMap(torch.nn.Module):
    """The protocol of a learned feature map: one side's map (the queries' or the keys') of
    every head, a small module (as lolcats' feature_map.py), x [batch, heads, seq, head_dim] ->
    φ(x) [batch, heads, seq, dim], every feature >= 0 (the kernels check it).

    A map subclasses this, sets the class attributes
      options: its options besides init, with their defaults (Hedgehog: {"feature_dim": 32});
        integer defaults take integers >= 1, float defaults finite numbers (override
        check_options for other rules);
      inits: the values of the option `init` it takes, the first its default;
    and defines __init__(self, num_heads, head_dim, *, init, device=None, dtype=None,
    **options), the property dim (m') and forward(x). Then one line,
    register_feature_map("name", TheMap), makes it a method everywhere: MultiheadAttention
    (method="name"), linattn.hf's backend "linattn_name", linattn.hf.linearize(feature_map="name") and LinattnCache's decoding, with or
    without a window, sinks and decay. Its parameters are a module's attributes
    ("linattn_name_q", "linattn_name_k" on a transformers attention layer; query_map and key_map
    on MultiheadAttention), so checkpoints keep them.

    The forwards call the module and give the kernels its features (linear_attention or
    hybrid_attention with feature_map="given"). Optional, for decoding speed: kernel_maps(dtype)
    gives the maps to linattn's C++ decoding step and prefill, which then apply them themselves
    (Hedgehog's: a converted LLM's layer is one call per token); the default None has the cache
    and MultiheadAttention.step apply the module and hand the step its features."""

    options = {}
    inits = ("default",)

    @classmethod
    def check_options(cls, fn, options):
        """options (the map's, init excluded) checked and normalised: ValueError naming the
        option. The default: integer defaults take integers >= 1, float defaults finite numbers,
        other defaults any value of the same type."""
        from .._options import integer, real
        out = {}
        for name, value in options.items():
            default = cls.options[name]
            if isinstance(default, bool) or not isinstance(default, (int, float)):
                if not isinstance(value, type(default)):
                    raise ValueError("%s: %s must be a %s, got %r" % (fn, name, type(default).__name__, value))
                out[name] = value
            elif isinstance(default, int):
                out[name] = integer(fn, name, value, 1)
            else:
                out[name] = real(fn, name, value)
        return out

    @property
    def dim(self):
        """m', the number of features."""
        raise NotImplementedError

    def kernel_maps(self, dtype):
        """(weight [H, d, f], bias [H, f]) in dtype for a map whose formula is Hedgehog's,
        [softmax(x·W + b), softmax(−(x·W + b))], which linattn's kernels then apply themselves
        (the decoding step, the prefill, linattn.torch.hedgehog_features); or None: the caller
        applies the module and gives the kernels its features."""
        return None


def step_features(features, q, k, exact_keys, counts, window, sinks=0):
    """The features a hybrid decoding step (linattn.hybrid_decode_step) is given for a learned
    map it does not apply itself (no kernel_maps): φ_q(q) and φ_k of the key entering the sums,
    [B, H, m'] each, in the maps' output dtype. features(x, side) maps x [B, H, n, d] (side
    "query" or "key"). q [B, H, d], k [B, H_kv, d] (query head h reads key head h // (H / H_kv)).
    The key entering is the one in ring slot sinks + counts mod window of exact_keys
    [B, H_kv, sinks + window, d] (it leaves the window with this step, before the new key takes
    its slot: for the sums, or for its sink slot when it is one of the row's first `sinks`
    tokens, and then the step does not read its features), or without a window the new key k;
    a row whose ring is not yet full has none, and its features are 0 (the step checks them all
    the same)."""
    heads = q.shape[1]
    if window:
        entering = exact_keys[torch.arange(q.shape[0]), :, sinks + counts % window].to(q.dtype)  # [B, H_kv, d]
    else:
        entering = k
    if entering.shape[1] != heads:
        entering = entering.repeat_interleave(heads // entering.shape[1], dim=1)
    fq = features(q[:, :, None], "query")[:, :, 0]
    fk = features(entering[:, :, None], "key")[:, :, 0]
    if window:
        fk = torch.where((counts >= window)[:, None, None], fk, torch.zeros((), dtype=fk.dtype))
    return fq, fk


# The learned maps by name: register_feature_map's.
_LEARNED = {}
# Option names a map cannot take: those of the methods, the linattn.hf backends and linearize
# around it (feature_dim aside: Hedgehog's own, which other maps may take too).
_RESERVED_OPTIONS = {"init", "window", "sinks", "decay", "eps", "bias", "dropout", "device", "dtype", "num_heads",
                     "head_dim", "num_features", "num_landmarks", "pinv_iterations", "pinv", "s_proj", "seed",
                     "max_seq_len", "conv_kernel_size", "focus_power", "features", "kernel", "feature_map", "scale",
                     "causal", "key_lengths"}


def register_feature_map(name, cls):
    """Makes the LearnedFeatureMap subclass cls the learned map `name` (a lowercase identifier
    no method has): MultiheadAttention(method=name), linattn.hf's backend "linattn_" + name,
    linearize(feature_map=name) and LinattnCache take it. Registering a name again with the same
    class does nothing; with another, ValueError."""
    fn = "register_feature_map"
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        raise ValueError("%s: name must be a lowercase identifier, got %r" % (fn, name))
    if not (isinstance(cls, type) and issubclass(cls, LearnedFeatureMap)):
        raise TypeError("%s: cls must be a subclass of LearnedFeatureMap, got %r" % (fn, cls))
    taken = {"softmax", "linear", "elu", "relu", "focused", "favor", "nystrom", "linformer", "efficient", "window",
             "given", "identity", "none"}
    if name in taken:
        raise ValueError("%s: %r is a fixed method's or map's name" % (fn, name))
    if _LEARNED.get(name, cls) is not cls:
        raise ValueError("%s: %r is registered already, as %s" % (fn, name, _LEARNED[name].__name__))
    if (not isinstance(cls.inits, tuple) or not cls.inits or not all(isinstance(i, str) for i in cls.inits)
            or not isinstance(cls.options, dict)):
        raise ValueError("%s: %s needs inits (a non-empty tuple of strings) and options (a dict)" % (fn, cls.__name__))
    clash = sorted(set(cls.options) & _RESERVED_OPTIONS)
    if clash:
        raise ValueError("%s: %s's option %s is a name the methods and backends take themselves; name it otherwise"
                         % (fn, cls.__name__, ", ".join(map(repr, clash))))
    for option, default in cls.options.items():  # JSON values (a converted model's config keeps them)
        if not isinstance(option, str) or not isinstance(default, (bool, int, float, str)):
            raise ValueError("%s: %s's option %r has default %r; options are named by strings and default to "
                             "a bool, an integer, a float or a string" % (fn, cls.__name__, option, default))
    cls.check_options(fn, dict(cls.options))  # its defaults pass its own checks
    _LEARNED[name] = cls
    # linattn.hf loaded: its backend now (else, or while it is being imported, at the end of its import)
    make_backends = getattr(sys.modules.get("linattn.hf.backends"), "_learned_backends", None)
    if make_backends is not None:
        make_backends()
        registration = sys.modules.get("linattn.hf.registration")
        if registration is not None and registration.registered():  # transformers knows the others: this one too
            registration.register()


def learned_feature_maps():
    """{name: class} of the registered learned maps."""
    return dict(_LEARNED)


class HedgehogFeatureMap(LearnedFeatureMap):
    """Hedgehog's learned feature map of one side (queries or keys) of every head:
    φ(x) = [softmax(x·W_h + b_h), softmax(−(x·W_h + b_h))], W [heads, head_dim, feature_dim],
    b [heads, feature_dim]; m' = 2·feature_dim features.

    init: "identity" (default) sets W_h to the first feature_dim columns of the identity (the
    rest zero when feature_dim > head_dim) and b to 0, LoLCATs' choice for attention transfer:
    before training, φ follows the coordinates of x, a start the fit moves from; "random":
    W with Kaiming-uniform rows, as Hedgehog's paper. scale multiplies x first (the model's
    1/√d or 1, say); it is a constant, not a parameter."""

    def __init__(self, num_heads, head_dim, feature_dim, *, init="identity", scale=1.0, device=None, dtype=None):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("feature_dim", feature_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError("HedgehogFeatureMap: %s must be an integer >= 1, got %r" % (name, value))
        if init not in ("identity", "random"):
            raise ValueError("HedgehogFeatureMap: init must be 'identity' or 'random', got %r" % (init,))
        if not (isinstance(scale, (int, float)) and 0 < float(scale) < float("inf")):
            raise ValueError("HedgehogFeatureMap: scale must be a finite number > 0, got %r" % (scale,))
        factory = {"device": device, "dtype": dtype}
        self.num_heads, self.head_dim, self.feature_dim = num_heads, head_dim, feature_dim
        self.scale = float(scale)
        self.weight = torch.nn.Parameter(torch.empty(num_heads, head_dim, feature_dim, **factory))
        self.bias = torch.nn.Parameter(torch.zeros(num_heads, feature_dim, **factory))
        with torch.no_grad():
            if init == "identity":
                self.weight.copy_(torch.eye(head_dim, feature_dim, **factory).expand(num_heads, -1, -1))
            else:
                for h in range(num_heads):
                    torch.nn.init.kaiming_uniform_(self.weight[h])

    options = {"feature_dim": 32}
    inits = ("identity", "random")

    @property
    def dim(self):
        """m', the number of features: 2·feature_dim."""
        return 2 * self.feature_dim

    def kernel_maps(self, dtype):
        """(scale·W, b) in dtype: φ(s·x) = softmax(x·(s·W) + b), so the map's scale goes into its weight."""
        weight = self.weight * self.scale if self.scale != 1.0 else self.weight
        return weight.to(dtype), self.bias.to(dtype)

    def forward(self, x):
        """x [batch, heads, seq, head_dim] -> φ(x) [batch, heads, seq, 2·feature_dim]."""
        return hedgehog_features(x * self.scale if self.scale != 1.0 else x, self.weight, self.bias)

    def extra_repr(self):
        return "num_heads=%d, head_dim=%d, feature_dim=%d, scale=%g" % (self.num_heads, self.head_dim,
                                                                        self.feature_dim, self.scale)


register_feature_map("hedgehog", HedgehogFeatureMap)
