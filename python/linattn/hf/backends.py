"""The linattn.hf backends: one Backend object per transformers attention implementation, each
knowing the linattn.torch function it calls, the options its name fixes, the user options it
takes (with defaults), the tensors it attaches to attention modules and how it passes them.
attention_function(name) is the function transformers calls; set_options() checks a model's
options and attaches what they need. See linattn.hf's documentation."""

import threading as _threading

import numpy as _np
import torch as _torch

from .. import _linattn
from .. import torch as _lt
from . import masks as _masks

PREFIX = "linattn_"  # attribute names of what linattn.hf attaches to attention modules
FEATURE_KINDS = ("orthogonal", "iid", "orthogonal_fixed", "quantile")
# LinattnCache.update's note to the attention function that runs next on this thread:
# .note = (cache layer, the key tensor update returned). See linattn.hf.cache.
PENDING_CACHE = _threading.local()


def _positive_int(value):
    return not isinstance(value, bool) and isinstance(value, (int, _np.integer)) and value >= 1


class Backend:
    """A backend: `function` (linattn.torch's), `fixed` (options its name sets), `defaults`
    (the user options it takes). The methods below are the defaults (exact softmax,
    Efficient Attention: nothing attached, the model's scaling passed as `scale`); the
    subclasses add their options and tensors."""

    takes_scale = True  # the model's scaling goes to the method's `scale`
    inits = ()  # the values of the option `init`, when it has one

    def __init__(self, name, function, fixed=None, defaults=None):
        self.name, self.function = name, function
        self.fixed, self.defaults = dict(fixed or {}), dict(defaults or {})

    def __repr__(self):
        return "Backend(%r, %r, fixed=%r, defaults=%r)" % (self.name, self.function, self.fixed, self.defaults)

    def check(self, o, config):
        """Backend-specific checks and completions of the options o (defaults already merged)."""

    def attach(self, module, anchor, user):
        """set_options: creates what the options need on an attention module (anchor: one of
        its parameters, for dtype and device)."""

    def options(self, module, query, user):
        """The keyword arguments of `function` besides key_lengths, causal and scale."""
        return dict(self.fixed)

    def hybrid_features(self, module, query, key, user):
        """With window > 0: the arguments of hybrid_attention that give the linear part."""
        raise ValueError("%s has no sliding-window form" % self.name)


class Kernelized(Backend):
    """elu, relu, focused: linear_attention with a fixed map; eps, focus_power, a learned
    depthwise convolution (dwc_kernel_size), and the sliding-window hybrid (window)."""

    takes_scale = False  # the maps have no scale

    def attach(self, module, anchor, user):
        if user.get("dwc_kernel_size"):
            learned(module, self, anchor, user, create=True)

    def options(self, module, query, user):
        options = dict(self.fixed, eps=user["eps"])
        if "focus_power" in user:
            options["focus_power"] = user["focus_power"]
        if user.get("dwc_kernel_size") is not None:
            options["dwc_weight"] = learned(module, self, query, user)["conv_weight"]
        return options

    def hybrid_features(self, module, query, key, user):
        return {"feature_map": self.fixed["feature_map"], "eps": user["eps"]}


class Favor(Backend):
    """Performer / FAVOR+: a fixed projection per layer (a buffer, seed + layer index), and the
    sliding-window hybrid (window): exact e^{s} inside the window, FAVOR's estimate beyond it."""

    def check(self, o, config):
        if o.get("window") and o["kernel"] == "trig":
            raise ValueError("linattn.hf: linattn_favor with window > 0 needs kernel 'positive' or 'hyperbolic' "
                             "(the hybrid's weights must be >= 0; trig's are not), got 'trig'")

    def attach(self, module, anchor, user):
        projection(module, anchor, user)

    def options(self, module, query, user):
        return dict(self.fixed, kernel=user["kernel"], projection=projection(module, query, user))

    def hybrid_features(self, module, query, key, user):
        # eps = 0, as favor_attention: every row with a key has a positive denominator anyway, and
        # an absolute eps (in units of e^{q·k}) would pull rows whose logits are all low to 0.
        return {"feature_map": "favor", "kernel": user["kernel"], "projection": projection(module, query, user),
                "eps": 0.0}


class Nystrom(Backend):
    def attach(self, module, anchor, user):
        if user.get("conv_kernel_size"):
            learned(module, self, anchor, user, create=True)

    def options(self, module, query, user):
        options = dict(self.fixed, num_landmarks=user["num_landmarks"], pinv_iterations=user["pinv_iterations"],
                       pinv=user["pinv"])
        if user["conv_kernel_size"] is not None:
            options["conv_weight"] = learned(module, self, query, user)["conv_weight"]
        return options


class Linformer(Backend):
    inits = ("pool", "random")

    def check(self, o, config):
        if o["max_seq_len"] is None:
            o["max_seq_len"] = getattr(config, "max_position_embeddings", None)
            if o["max_seq_len"] is None:
                raise ValueError("linattn.hf: linattn_linformer needs max_seq_len (the model config has no "
                                 "max_position_embeddings)")

    def attach(self, module, anchor, user):
        learned(module, self, anchor, user, create=True)

    def options(self, module, query, user):
        tensors = learned(module, self, query, user)
        return dict(self.fixed, e=tensors["e"], f=tensors["f"])


class Hedgehog(Backend):
    """Hedgehog's learned maps (HedgehogFeatureMap submodules for queries and keys), alone or
    as the linear part of the hybrid. The maps take q and k as the model makes them: no scale."""

    takes_scale = False
    inits = ("identity", "random")

    def check(self, o, config):
        if not _positive_int(o["feature_dim"]):
            raise ValueError("linattn.hf: feature_dim must be a positive integer, got %r" % (o["feature_dim"],))

    def attach(self, module, anchor, user):
        hedgehog_maps(module, anchor, user, create=True)

    def options(self, module, query, user):
        fq, fk = hedgehog_maps(module, query, user)
        return dict(self.fixed, query_weight=fq.weight, query_bias=fq.bias, key_weight=fk.weight, key_bias=fk.bias)

    def hybrid_features(self, module, query, key, user):
        fq, fk = hedgehog_maps(module, query, user)
        return {"feature_map": "given", "query_features": fq(query), "key_features": fk(key)}


class Window(Backend):
    """Exact softmax within the window and nothing beyond (the hybrid with features of zeros):
    the baseline that shows what a linear part earns. Nothing learned, no gate."""

    minimum_window = 1

    def hybrid_features(self, module, query, key, user):
        b, h, n_q, n_k = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        return {"feature_map": "given", "query_features": query.new_zeros((b, h, n_q, 1)),
                "key_features": key.new_zeros((b, h, n_k, 1))}


_WINDOWED = {"eps": 1e-6, "window": 0}
BACKENDS = {b.name: b for b in (
    Backend("linattn_softmax", "softmax_attention"),
    Kernelized("linattn_elu", "linear_attention", {"feature_map": "elu"}, _WINDOWED),
    Kernelized("linattn_relu", "linear_attention", {"feature_map": "relu"}, _WINDOWED),
    Kernelized("linattn_focused", "linear_attention", {"feature_map": "focused"},
               {"eps": 1e-6, "focus_power": 3.0, "dwc_kernel_size": None}),
    Favor("linattn_favor", "favor_attention", {}, {"num_features": 256, "features": "orthogonal",
                                                   "kernel": "positive", "seed": 0, "window": 0}),
    Nystrom("linattn_nystrom", "nystrom_attention", {}, {"num_landmarks": 64, "pinv_iterations": 6,
                                                         "pinv": "iterative", "conv_kernel_size": None}),
    Linformer("linattn_linformer", "linformer_attention", {}, {"s_proj": 256, "max_seq_len": None, "init": "pool"}),
    Backend("linattn_efficient", "efficient_attention"),
    Hedgehog("linattn_hedgehog", "hedgehog_attention", {}, {"feature_dim": 32, "init": "identity", "window": 0}),
    Window("linattn_window", "hybrid_attention", {}, {"window": 64}),
)}


def backend(name):
    if name not in BACKENDS:
        raise ValueError("linattn.hf: unknown backend %r; the backends: %s" % (name, ", ".join(BACKENDS)))
    return BACKENDS[name]


def register():
    """Registers every backend of BACKENDS with transformers' AttentionInterface (and, for the
    masks, AttentionMaskInterface: the boolean masks of sdpa, which are None when nothing is
    masked). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from .cache import install_generation_hook
    for name in BACKENDS:
        AttentionInterface.register(name, attention_function(name))
        AttentionMaskInterface.register(name, sdpa_mask)
    install_generation_hook()


def take_pending(key):
    """The LinattnCache layer whose update() returned `key` (the note then cleared), or None
    when no LinattnCache is in use. ValueError when the note is for another tensor."""
    note = getattr(PENDING_CACHE, "note", None)
    if note is None:
        return None
    PENDING_CACHE.note = None
    if note[1] is not key:
        raise ValueError("LinattnCache: the attention function got other keys than LinattnCache.update returned "
                         "(the model changes them in between); this model cannot use the linattn cache")
    return note[0]


def attention_function(name):
    """The AttentionInterface function of backend `name`: (module, query, key, value,
    attention_mask, scaling=None, dropout=0.0, **kwargs) -> (output [B, n_q, H, d_v], None),
    query [B, H, n_q, d], key and value [B, H_kv, n_k, d] (H a multiple of H_kv)."""
    b = backend(name)
    op = getattr(_lt, b.function)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cached = take_pending(key)  # a LinattnCache layer, when generate() runs with one
        if dropout and module.training:
            raise ValueError("%s: attention dropout %g in training; linattn forms no attention weights to drop. "
                             "Set the model's attention dropout (attention_probs_dropout_prob, attention_dropout) to 0"
                             % (name, dropout))
        for unsupported in ("sliding_window", "softcap", "s_aux"):
            if kwargs.get(unsupported) is not None:
                raise ValueError("%s: the model asks for %s=%r, which linattn does not implement"
                                 % (name, unsupported, kwargs[unsupported]))
        if key.shape[1] != query.shape[1]:  # grouped-query attention: each key head serves several queries
            if query.shape[1] % key.shape[1]:
                raise ValueError("%s: %d query heads are not a multiple of %d key heads"
                                 % (name, query.shape[1], key.shape[1]))
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        n_q, n_k = query.shape[2], key.shape[2]
        causal = bool(kwargs.get("is_causal") if kwargs.get("is_causal") is not None
                      else getattr(module, "is_causal", False))
        user = options_of(getattr(module, "config", None), name)
        if cached is not None:
            from .cache import attend
            if not causal:
                raise ValueError("%s: LinattnCache serves causal attention; this attention layer is not causal" % name)
            out = attend(name, cached, module, b, user, query, key, value, attention_mask, scaling,
                         lambda: forward(module, query, key, value, None, True, causal, scaling, user))
            return out.transpose(1, 2).contiguous(), None
        mask_causal = causal and n_q > 1  # a single new query sees the whole cache
        key_lengths = _masks.key_lengths(name, attention_mask, query.shape[0], n_q, n_k, mask_causal)
        if mask_causal and n_q != n_k and b.function != "softmax_attention" and not user.get("window"):
            raise ValueError("%s: %d queries against %d cached keys; causal %s needs as many queries as keys "
                             "(decode one token at a time, or use linattn_softmax)" % (name, n_q, n_k, b.function))
        out = forward(module, query, key, value, key_lengths, mask_causal, causal, scaling, user)
        if getattr(module, "linattn_transfer", False):
            out = transfer_step(module, query, key, value, out, key_lengths, mask_causal, scaling)
        return out.transpose(1, 2).contiguous(), None

    def forward(module, query, key, value, key_lengths, mask_causal, causal, scaling, user):
        if user.get("window"):
            return hybrid(module, b, query, key, value, key_lengths, causal, scaling, user)
        options = b.options(module, query, user)
        if mask_causal:
            options["causal"] = True
        if b.takes_scale:
            options["scale"] = scaling
        return op(query, key, value, key_lengths=key_lengths, **options)

    attention.__name__ = attention.__qualname__ = name
    attention.__doc__ = "linattn's %s as a transformers attention function (see linattn.hf)." % b.function
    return attention


# ---- options -----------------------------------------------------------------------------------

def options_of(config, name):
    """Backend `name`'s options: its defaults, updated by config.linattn_options when `name` is
    the config's backend (the options are the model's backend's; another backend called on the
    same modules, as a comparison does, runs with its defaults)."""
    given = {}
    if getattr(config, "_attn_implementation", None) == name:
        given = dict(getattr(config, "linattn_options", None) or {})
    return checked(name, given, config)


def checked(name, given, config):
    """The options `given` for backend `name`, checked (ValueError naming the option) and
    completed with the defaults."""
    b = backend(name)
    unknown = sorted(set(given) - set(b.defaults))
    if unknown:
        raise ValueError("linattn.hf: backend %r takes no option %s (its options: %s)"
                         % (name, ", ".join(map(repr, unknown)), ", ".join(sorted(b.defaults)) or "none"))
    o = {**b.defaults, **given}
    for k in ("num_features", "num_landmarks", "s_proj", "max_seq_len", "dwc_kernel_size", "conv_kernel_size"):
        if o.get(k) is not None and not _positive_int(o[k]):
            raise ValueError("linattn.hf: %s must be a positive integer, got %r" % (k, o[k]))
    if "features" in o and o["features"] not in FEATURE_KINDS:
        raise ValueError("linattn.hf: features must be one of %s, got %r" % (", ".join(FEATURE_KINDS), o["features"]))
    if "init" in o and o["init"] not in b.inits:
        raise ValueError("linattn.hf: init must be %s, got %r" % (" or ".join(map(repr, b.inits)), o["init"]))
    least = getattr(b, "minimum_window", 0)
    if "window" in o and (isinstance(o["window"], bool) or not isinstance(o["window"], (int, _np.integer)) or
                          o["window"] < least):
        raise ValueError("linattn.hf: window must be an integer >= %d, got %r" % (least, o["window"]))
    b.check(o, config)
    return o


def set_options(model, **options):
    """Sets the options of the model's linattn backend (model.config.linattn_options, checked)
    and attaches what they need to every attention module: FAVOR projections (buffers) and the
    learned tensors (Linformer e, f; depthwise convolution weights; Hedgehog's maps; the
    hybrid's window gate) as parameters, so that an optimizer built afterwards trains them.
    Call it with no options to attach the defaults'. Returns the model."""
    config = model.config
    name = getattr(config, "_attn_implementation", None)
    if name not in BACKENDS:
        raise ValueError("linattn.hf.set_options: the model's attention implementation is %r, not a linattn "
                         "backend (load it with attn_implementation='linattn_...'; see linattn.hf.BACKENDS)" % (name,))
    checked(name, options, config)
    config.linattn_options = dict(options)
    user = options_of(config, name)
    modules = attention_modules(model)
    if not modules:
        raise ValueError("linattn.hf.set_options: found no attention module (a module with config, is_causal "
                         "and layer_idx attributes) in %s" % type(model).__name__)
    b = BACKENDS[name]
    for m in modules:
        detach_all(m)  # options changed: what was attached for the old ones goes
        anchor = next(m.parameters())
        b.attach(m, anchor, user)
        if user.get("window") and not isinstance(b, Window):
            window_gate(m, anchor, create=True)
    return model


def detach_all(module):
    """Removes every parameter, buffer and submodule linattn.hf attached to an attention module."""
    for attr in [a for kind in ("_parameters", "_buffers", "_modules") for a in vars(module)[kind]
                 if a.startswith(PREFIX)]:
        delattr(module, attr)


def attention_modules(model):
    """The modules that call the attention function: those with config, is_causal and layer_idx
    attributes (transformers' attention classes, BertSelfAttention and LlamaAttention among them)."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("config", "is_causal", "layer_idx"))]


# ---- what backends attach ------------------------------------------------------------------------

def heads(module, config):
    h = getattr(module, "num_attention_heads", None) or getattr(config, "num_attention_heads", None)
    d = getattr(module, "attention_head_size", None) or getattr(module, "head_dim", None)
    if d is None:
        d = getattr(config, "head_dim", None) or config.hidden_size // h
    return h, d


def projection(module, like, user):
    """Layer layer_idx's FAVOR projection [num_features, head_dim], a buffer made on first use."""
    key = PREFIX + "projection"
    w = getattr(module, key, None)
    _, d = heads(module, module.config)
    if w is None or w.shape != (user["num_features"], d) or w.dtype != like.dtype:
        seed = (int(user["seed"]) + int(module.layer_idx or 0)) % 2**63
        np_dtype = _np.float64 if like.dtype == _torch.float64 else _np.float32
        w = _torch.from_numpy(_linattn.random_features(user["num_features"], d, user["features"], seed, np_dtype))
        module.register_buffer(key, w.to(device=like.device, dtype=like.dtype), persistent=False)
    return getattr(module, key)


def learned(module, b, like, user, create=False):
    """The module's learned tensors for backend b (made by set_options, create=True, or here on
    first use outside training): Linformer's e and f, or a depthwise convolution's weight."""
    function, name = b.function, b.name
    keys = ("e", "f") if function == "linformer_attention" else ("conv_weight",)
    have = {k: getattr(module, PREFIX + k, None) for k in keys}
    if all(v is not None for v in have.values()):
        return have
    if not create and module.training and _torch.is_grad_enabled():
        raise ValueError("%s: the learned tensors (%s) do not exist yet; call linattn.hf.set_options(model, ...) "
                         "before building the optimizer, so that it trains them" % (name, ", ".join(keys)))
    factory = {"dtype": like.dtype, "device": like.device}
    if function == "linformer_attention":
        s, n = user["s_proj"], user["max_seq_len"]
        if user["init"] == "pool":
            e = _torch.zeros((s, n), **factory)
            for j in range(s):  # segment j: positions floor(j·n/s) .. floor((j+1)·n/s) − 1 (none when s > n)
                lo, hi = j * n // s, (j + 1) * n // s
                if hi > lo:
                    e[j, lo:hi] = 1.0 / (hi - lo)
            f = e.clone()
        else:
            np_dtype = _np.float64 if like.dtype == _torch.float64 else _np.float32
            e, f = (_torch.from_numpy(x).to(**factory) for x in _linattn.linformer_projections(s, n, seed=0, dtype=np_dtype))
        tensors = {"e": e, "f": f}
    else:
        h, _ = heads(module, module.config)
        k = user.get("dwc_kernel_size") or user.get("conv_kernel_size")
        tensors = {"conv_weight": _torch.zeros((h, k), **factory)}  # zero: the pretrained output unchanged
    for k, t in tensors.items():
        module.register_parameter(PREFIX + k, _torch.nn.Parameter(t))
    return {k: getattr(module, PREFIX + k) for k in keys}


def hedgehog_maps(module, like, user, create=False):
    """The module's learned Hedgehog feature maps (queries, keys): HedgehogFeatureMap
    submodules made by set_options or linearize (create=True), or here on first use outside
    training."""
    keys = (PREFIX + "hedgehog_q", PREFIX + "hedgehog_k")
    maps = [getattr(module, k, None) for k in keys]
    h, d = heads(module, module.config)
    fits = all(m is not None and m.weight.shape == (h, d, user["feature_dim"]) and m.weight.dtype == like.dtype
               for m in maps)
    if fits and not create:
        return maps
    if not create and module.training and _torch.is_grad_enabled():
        raise ValueError("linattn_hedgehog: the learned feature maps do not exist yet; call linattn.hf.linearize(model, "
                         "...) or linattn.hf.set_options(model, ...) before building the optimizer, so that it trains them")
    from ..torch.feature_maps import HedgehogFeatureMap
    for k in keys:
        module.add_module(k, HedgehogFeatureMap(h, d, int(user["feature_dim"]), init=user["init"], dtype=like.dtype,
                                                device=like.device))
    return [getattr(module, k) for k in keys]


def window_gate(module, like, create=False):
    """The module's learned window gate g [heads] of the sliding-window hybrid (γ = sigmoid(g)
    scales the window term), a parameter made by set_options or linearize (create=True; g = 0,
    γ = 1/2, the window and the linear part weighed alike), or here on first use outside
    training."""
    key = PREFIX + "window_gate"
    gate = getattr(module, key, None)
    h, _ = heads(module, module.config)
    if gate is not None and gate.shape == (h,) and gate.dtype == like.dtype and not create:
        return gate
    if not create and module.training and _torch.is_grad_enabled():
        raise ValueError("linattn.hf: the window gate does not exist yet; call linattn.hf.linearize(model, ...) or "
                         "linattn.hf.set_options(model, ...) before building the optimizer, so that it trains it")
    module.register_parameter(key, _torch.nn.Parameter(_torch.zeros(h, dtype=like.dtype, device=like.device)))
    return getattr(module, key)


def hybrid(module, b, query, key, value, key_lengths, causal, scaling, user):
    """The sliding-window hybrid (linattn.torch.hybrid_attention) with backend b's features as
    its linear part: exact softmax over the last `window` keys (causal; |i - j| <= window
    otherwise), the feature map beyond, one normaliser, and the learned window gate
    (linattn_window: nothing beyond the window, no gate). Causal holds for one new query against
    a cache too: its window is the last `window` keys, as in training."""
    options = {"window": int(user["window"]), "causal": causal, "key_lengths": key_lengths, "scale": scaling}
    if not isinstance(b, Window):
        options["window_gate"] = window_gate(module, query)
    options.update(b.hybrid_features(module, query, key, user))
    return _lt.hybrid_attention(query, key, value, **options)


def transfer_step(module, query, key, value, out, key_lengths, causal, scaling):
    """Attention transfer (attention_transfer): the softmax output on the same q, k, v is the
    target; the squared error of this layer's output against it, over the queries of each
    sequence (below its length), goes to module.linattn_transfer_loss; the softmax output goes
    on to the next layer (teacher forcing: each layer learns from the original model's inputs)."""
    with _torch.no_grad():
        target = _lt.softmax_attention(query.detach(), key.detach(), value.detach(), causal=causal, scale=scaling,
                                       key_lengths=key_lengths)
    err = (out - target).pow(2).mean(-1)  # [B, H, n]
    if key_lengths is not None:
        valid = _torch.arange(err.shape[2], device=err.device)[None, :] < key_lengths.to(err.device)[:, None]
        err = err * valid[:, None, :].to(err.dtype)
        module.linattn_transfer_loss = err.sum() / (valid.sum() * err.shape[1]).clamp(min=1)
    else:
        module.linattn_transfer_loss = err.mean()
    return target
