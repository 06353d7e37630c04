"""The linattn.hf backends: one Backend object per transformers attention implementation, each
knowing the linattn.torch function it calls, the options its name fixes, the user options it
takes (with defaults), the learned tensors it needs on attention modules and how it passes
them. attention_function(name) is the function transformers calls; set_options() checks a
model's options and creates what they need. See linattn.hf's documentation.

Learned tensors (feature maps, window gates, convolutions, Linformer's e and f) are created in
one place, create_learned (called by set_options, hence by linearize and from_pretrained), and
never by a forward: a forward finds them (learned_tensor) or raises, and casts a tensor whose
dtype differs from the activations' (autocast, a bfloat16 forward) without replacing it."""

import copy
import functools as _functools
import math
import threading as _threading
import weakref as _weakref

import numpy as _np
import torch as _torch

from .. import _linattn
from .. import _options
from .. import torch as _lt
from . import masks as _masks

PREFIX = "linattn_"  # attribute names of what linattn.hf attaches to attention modules
FEATURE_KINDS = ("orthogonal", "iid", "orthogonal_fixed", "quantile")
KERNELS = ("positive", "hyperbolic", "trig")
# LinattnCache.update's note to the attention function that runs next on this thread:
# .note = (cache layer, the key tensor update returned). See linattn.hf.cache. The attention
# function reaches the cache only through that layer (its attend method): this module never
# imports the cache module, which imports this one.
PENDING_CACHE = _threading.local()


# The methods whose every output depends on every key: a causal form would leak the future.
_NO_CAUSAL_FORM = {"nystrom_attention": "its landmarks are means over segments of the whole sequence",
                   "linformer_attention": "it projects keys and values over the whole sequence",
                   "efficient_attention": "it normalises keys over all positions"}


def _decay_option(fn, name, value):
    """The linear part's decay: None (none), "retnet" (RetNet's per-head γ_h = 1 − 2^(−5−h·10/H):
    half-lives of about 22 tokens to 10k), or one log-decay λ <= 0 per position for every head."""
    if value is None or value == "retnet":
        return value
    if isinstance(value, str):
        raise ValueError("%s: %s must be None, 'retnet' or a number <= 0 (a log-decay per position), got %r"
                         % (fn, name, value))
    return _options.real(fn, name, value, maximum=0.0)


def log_decay(user, heads):
    """The hybrid's log_decay [heads] (a list of floats) for the option `decay`, or None."""
    decay = user.get("decay")
    if decay is None:
        return None
    if decay == "retnet":
        return [math.log1p(-2.0 ** (-5.0 - 10.0 * h / max(heads - 1, 1))) for h in range(heads)]
    return [float(decay)] * heads


def _optional(check):
    return lambda fn, name, value: None if value is None else check(fn, name, value)


# Every option of every backend: name -> its check, which returns the plain Python value (so
# NumPy scalars are stored as int/float and the config stays JSON) or raises ValueError naming it.
_OPTION_CHECKS = {
    "num_features": lambda fn, k, v: _options.integer(fn, k, v, 1),
    "num_landmarks": lambda fn, k, v: _options.integer(fn, k, v, 1),
    "pinv_iterations": lambda fn, k, v: _options.integer(fn, k, v, 0),
    "s_proj": lambda fn, k, v: _options.integer(fn, k, v, 1),
    "feature_dim": lambda fn, k, v: _options.integer(fn, k, v, 1),
    "seed": lambda fn, k, v: _options.integer(fn, k, v, -2 ** 63),  # layer l draws with (seed + l) mod 2^63
    "max_seq_len": _optional(lambda fn, k, v: _options.integer(fn, k, v, 1)),
    "conv_kernel_size": _optional(lambda fn, k, v: _options.integer(fn, k, v, 1)),
    "eps": lambda fn, k, v: _options.real(fn, k, v, minimum=0.0),
    "focus_power": lambda fn, k, v: _options.real(fn, k, v, minimum=1.0, maximum=1000.0),  # the C++ map's range
    "sinks": lambda fn, k, v: _options.integer(fn, k, v, 0),
    "decay": lambda fn, k, v: _decay_option(fn, k, v),
    "features": lambda fn, k, v: _options.choice(fn, k, v, FEATURE_KINDS),
    "kernel": lambda fn, k, v: _options.choice(fn, k, v, KERNELS),
    "pinv": lambda fn, k, v: _options.choice(fn, k, v, ("iterative", "exact")),
}


class Backend:
    """A backend: `function` (linattn.torch's), `fixed` (options its name sets), `defaults`
    (the user options it takes). The methods below are the defaults (exact softmax,
    Efficient Attention: nothing learned, the model's scaling passed as `scale`); the
    subclasses add their options and tensors."""

    takes_scale = True  # the model's scaling goes to the method's `scale`
    inits = ()  # the values of the option `init`, when it has one
    minimum_window = 0

    def __init__(self, name, function, fixed=None, defaults=None):
        self.name, self.function = name, function
        self.fixed, self.defaults = dict(fixed or {}), dict(defaults or {})

    def __repr__(self):
        return "Backend(%r, %r, fixed=%r, defaults=%r)" % (self.name, self.function, self.fixed, self.defaults)

    def check(self, o, config):
        """Backend-specific checks and completions of the options o (defaults already merged)."""

    def learned(self, module, user):
        """The learned tensors the options `user` need on an attention module: {attribute name
        (without PREFIX): (shape, the option that sets it, make(factory) -> Parameter or
        Module)}. A module's shape is its parameters' shapes. The window gate comes with any window."""
        h, _ = heads(module, module.config)
        if user.get("window") and self.minimum_window == 0:
            # g = 0: γ = sigmoid(g) = 1/2, the window and the linear part weighed alike
            return {"window_gate": ((h,), "window", lambda f: _torch.nn.Parameter(_torch.zeros(h, **f)))}
        return {}

    def options(self, module, query, user):
        """The keyword arguments of `function` besides key_lengths, causal and scale."""
        return dict(self.fixed)

    def inputs(self, module, query, key, user):
        """What `function` takes as q and k: query and key themselves (a learned map: their features)."""
        return query, key

    def hybrid_features(self, module, query, key, user):
        """With window > 0: the arguments of hybrid_attention that give the linear part."""
        raise ValueError("%s has no sliding-window form" % self.name)


def _zero_conv(h, k):
    # zero: a pretrained model's output is unchanged until the convolution is trained
    return lambda f: _torch.nn.Parameter(_torch.zeros((h, k), **f))


class Kernelized(Backend):
    """elu, relu, focused: linear_attention with a fixed map; eps, focus_power, a learned
    depthwise convolution (conv_kernel_size), and the sliding-window hybrid (window)."""

    takes_scale = False  # the maps have no scale

    def learned(self, module, user):
        out = super().learned(module, user)
        if user.get("conv_kernel_size"):
            h, _ = heads(module, module.config)
            k = user["conv_kernel_size"]
            out["conv_weight"] = ((h, k), "conv_kernel_size", _zero_conv(h, k))
        return out

    def options(self, module, query, user):
        options = dict(self.fixed, eps=user["eps"])
        if "focus_power" in user:
            options["focus_power"] = user["focus_power"]
        if user.get("conv_kernel_size") is not None:
            options["conv_weight"] = learned_tensor(module, self, user, "conv_weight", query)
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

    def options(self, module, query, user):
        return dict(self.fixed, kernel=user["kernel"], projection=projection(module, query, user))

    def hybrid_features(self, module, query, key, user):
        # eps = 0, as favor_attention: every row with a key has a positive denominator anyway, and
        # an absolute eps (in units of e^{q·k}) would pull rows whose logits are all low to 0.
        return {"feature_map": "favor", "kernel": user["kernel"], "projection": projection(module, query, user),
                "eps": 0.0}


class Nystrom(Backend):
    def learned(self, module, user):
        if not user.get("conv_kernel_size"):
            return {}
        h, _ = heads(module, module.config)
        k = user["conv_kernel_size"]
        return {"conv_weight": ((h, k), "conv_kernel_size", _zero_conv(h, k))}

    def options(self, module, query, user):
        options = dict(self.fixed, num_landmarks=user["num_landmarks"], pinv_iterations=user["pinv_iterations"],
                       pinv=user["pinv"])
        if user["conv_kernel_size"] is not None:
            options["conv_weight"] = learned_tensor(module, self, user, "conv_weight", query)
        return options


class Linformer(Backend):
    inits = ("pool", "random")

    def check(self, o, config):
        if o["max_seq_len"] is None:
            o["max_seq_len"] = getattr(config, "max_position_embeddings", None)
            if o["max_seq_len"] is None:
                raise ValueError("linattn.hf: linattn_linformer needs max_seq_len (the model config has no "
                                 "max_position_embeddings)")
            o["max_seq_len"] = _options.integer("linattn.hf", "max_seq_len (max_position_embeddings)",
                                                o["max_seq_len"], 1)

    def learned(self, module, user):
        s, n = user["s_proj"], user["max_seq_len"]

        def make(which):
            def made(factory):
                if user["init"] == "pool":
                    # segment j: positions floor(j·n/s) .. floor((j+1)·n/s) − 1 (none when s > n)
                    e = _torch.zeros((s, n), **factory)
                    for j in range(s):
                        lo, hi = j * n // s, (j + 1) * n // s
                        if hi > lo:
                            e[j, lo:hi] = 1.0 / (hi - lo)
                    return _torch.nn.Parameter(e)
                np_dtype = _np.float64 if factory["dtype"] == _torch.float64 else _np.float32
                pair = _linattn.linformer_projections(s, n, seed=0, dtype=np_dtype)
                return _torch.nn.Parameter(_torch.from_numpy(pair[which]).to(**factory))
            return made
        return {"e": ((s, n), "s_proj", make(0)), "f": ((s, n), "s_proj", make(1))}

    def options(self, module, query, user):
        return dict(self.fixed, e=learned_tensor(module, self, user, "e", query),
                    f=learned_tensor(module, self, user, "f", query))


class Learned(Backend):
    """A learned feature map's backend (linattn.torch.LearnedFeatureMap: Hedgehog's, or one
    registered by register_feature_map): the map's modules for queries and keys on each
    attention layer (attributes PREFIX + map name + "_q" / "_k"), alone (linear_attention with
    their features) or as the linear part of the hybrid. The maps take q and k as the model makes
    them: no scale. Options: the map's own (Hedgehog: feature_dim), init, window, sinks, decay,
    eps."""

    takes_scale = False

    def __init__(self, map_name, cls):
        super().__init__(PREFIX + map_name, "linear_attention", {"feature_map": "given"},
                         {**cls.options, "init": cls.inits[0], "eps": 1e-6, **_WINDOWED})
        self.map_name, self.cls, self.inits = map_name, cls, cls.inits

    def check(self, o, config):
        # The map's own options, by its rules (ValueError naming the option); each side's map is
        # then made with them, in create_learned.
        o.update(self.cls.check_options("linattn.hf", {k: o[k] for k in self.cls.options}))

    def learned(self, module, user):
        out = super().learned(module, user)
        h, d = heads(module, module.config)
        own = {k: user[k] for k in self.cls.options}
        shape = self._shapes(h, d, tuple(own.items()))
        for side in ("_q", "_k"):
            out[self.map_name + side] = (shape, next(iter(own), "init"),
                                         lambda factory: self.cls(h, d, init=user["init"], **own, **factory))
        return out

    @_functools.lru_cache(maxsize=64)
    def _shapes(self, heads, head_dim, own):
        """The shapes of the parameters of a map with these options (made on the meta device:
        no memory, no values): what a layer's map must have."""
        m = self.cls(heads, head_dim, init=self.inits[0], **dict(own), device="meta")
        return tuple(tuple(p.shape) for p in m.parameters())

    def map(self, module, user, side, like):
        """The query map (side "query") or the key map, a LearnedFeatureMap."""
        return learned_tensor(module, self, user, self.map_name + ("_q" if side == "query" else "_k"), like,
                              cast=False)

    def features(self, module, user, x, side):
        """The map's features of x (side "query" or "key"), in x's dtype. A map with kernel_maps
        (Hedgehog's) runs on them cast to x's dtype, in the graph, as the other learned tensors
        are cast (the parameters themselves stay as they are); another map whose parameters have
        another dtype than x (a float32 model under autocast, say) takes x in theirs, and its
        features are rounded to x's. Neither changes the module, which other threads may use."""
        m = self.map(module, user, side, x)
        maps = m.kernel_maps(x.dtype)
        if maps is not None:
            return _lt.hedgehog_features(x, *maps)
        dtype = next((p.dtype for p in m.parameters()), x.dtype)
        return m(x) if dtype == x.dtype else m(x.to(dtype)).to(x.dtype)

    def inputs(self, module, query, key, user):
        return self.features(module, user, query, "query"), self.features(module, user, key, "key")

    def options(self, module, query, user):
        return dict(self.fixed, eps=user["eps"])

    def hybrid_features(self, module, query, key, user):
        return {"feature_map": "given", "query_features": self.features(module, user, query, "query"),
                "key_features": self.features(module, user, key, "key"), "eps": user["eps"]}


class Window(Backend):
    """Exact softmax within the window and nothing beyond (the hybrid with features of zeros):
    the baseline that shows what a linear part earns. Nothing learned, no gate."""

    minimum_window = 1

    def hybrid_features(self, module, query, key, user):
        b, h, n_q, n_k = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        return {"feature_map": "given", "query_features": query.new_zeros((b, h, n_q, 1)),
                "key_features": key.new_zeros((b, h, n_k, 1))}


_WINDOWED = {"eps": 1e-6, "window": 0, "sinks": 0, "decay": None}
BACKENDS = {b.name: b for b in (
    Backend("linattn_softmax", "softmax_attention"),
    Kernelized("linattn_elu", "linear_attention", {"feature_map": "elu"}, _WINDOWED),
    Kernelized("linattn_relu", "linear_attention", {"feature_map": "relu"}, _WINDOWED),
    Kernelized("linattn_focused", "linear_attention", {"feature_map": "focused"},
               {"eps": 1e-6, "focus_power": 3.0, "conv_kernel_size": None}),
    Favor("linattn_favor", "favor_attention", {}, {"num_features": 256, "features": "orthogonal",
                                                   "kernel": "positive", "seed": 0, "window": 0,
                                                   "sinks": 0, "decay": None}),
    Nystrom("linattn_nystrom", "nystrom_attention", {}, {"num_landmarks": 64, "pinv_iterations": 6,
                                                         "pinv": "iterative", "conv_kernel_size": None}),
    Linformer("linattn_linformer", "linformer_attention", {}, {"s_proj": 256, "max_seq_len": None, "init": "pool"}),
    Backend("linattn_efficient", "efficient_attention"),
    Window("linattn_window", "hybrid_attention", {}, {"window": 64, "sinks": 0}),
)}




def _learned_backends():
    """A backend for each registered learned map (linattn.torch.register_feature_map) that has
    none yet: linattn_hedgehog, and maps registered since."""
    for map_name, cls in _lt.learned_feature_maps().items():
        if PREFIX + map_name not in BACKENDS:
            BACKENDS[PREFIX + map_name] = Learned(map_name, cls)


_learned_backends()


def backend(name):
    if name not in BACKENDS:
        raise ValueError("linattn.hf: unknown backend %r; the backends: %s" % (name, ", ".join(BACKENDS)))
    return BACKENDS[name]


def mask(*args, **kwargs):
    """sdpa's boolean mask (True = attend; None when nothing is masked), except that it is
    never left out for several queries against more keys: sdpa then relies on torch's top-left
    aligned is_causal (a static cache's prefill against its empty slots), while linattn aligns
    causal masks bottom-right, so it needs the mask to see which slots are empty."""
    sdpa_mask, signature = _sdpa_mask()
    bound = signature.bind(*args, **kwargs)
    q_length, kv_length = bound.arguments["q_length"], bound.arguments["kv_length"]
    if q_length not in (1, kv_length):
        bound.arguments["allow_is_causal_skip"] = False
    return sdpa_mask(*bound.args, **bound.kwargs)


@_functools.lru_cache(maxsize=None)
def _sdpa_mask():
    """transformers' sdpa_mask and its signature, looked up once (mask runs at every forward)."""
    import inspect
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask, inspect.signature(sdpa_mask)


def install_atomic_config_save():
    """Wraps transformers' PreTrainedConfig.to_json_file once: for a config that carries linattn
    options, the options are checked and normalised (plain Python numbers) and the JSON text is
    made before anything is written, then written to a temporary file beside the target and
    renamed over it, so a failed save leaves the checkpoint that was there intact. Other
    configs go to transformers' own."""
    import os
    import uuid
    from transformers import PretrainedConfig
    original = PretrainedConfig.to_json_file
    if getattr(original, "linattn_hook", False):
        return

    def to_json_file(self, json_file_path, use_diff=True):
        if getattr(self, "linattn_options", None) is None and getattr(self, "linattn_backend", None) is None:
            return original(self, json_file_path, use_diff=use_diff)
        options = getattr(self, "linattn_options", None) or {}
        name = stored_backend(self)  # whose options they are (the model may run another backend now)
        if name in BACKENDS:
            options = _options.renamed("save_pretrained", dict(options), _options.RENAMED, stacklevel=4)
            full = checked(name, options, self, fn="save_pretrained")
            self.linattn_options = {k: full[k] for k in options}
        text = self.to_json_string(use_diff=use_diff)
        tmp = "%s.%s.tmp" % (os.path.abspath(json_file_path), uuid.uuid4().hex)
        # os.open with 0o666, as open() does: the umask gives config.json its usual mode
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, json_file_path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    to_json_file.linattn_hook = True
    to_json_file.__wrapped__ = original
    PretrainedConfig.to_json_file = to_json_file


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
        if cached is None:
            return attend_or_forward(module, query, key, value, attention_mask, scaling, dropout, None, kwargs)
        try:
            out = attend_or_forward(module, query, key, value, attention_mask, scaling, dropout, cached, kwargs)
        except BaseException:
            cached.end_forward(failed=True)  # the cache is free for other threads' forwards again
            raise
        cached.end_forward()
        return out

    def attend_or_forward(module, query, key, value, attention_mask, scaling, dropout, cached, kwargs):
        if dropout and module.training:
            raise ValueError("%s: attention dropout %g in training; linattn forms no attention weights to drop. "
                             "Set the model's attention dropout (attention_probs_dropout_prob, attention_dropout) to 0"
                             % (name, dropout))
        for unsupported in ("sliding_window", "softcap", "s_aux"):
            if kwargs.get(unsupported) is not None:
                raise ValueError("%s: the model asks for %s=%r, which linattn does not implement"
                                 % (name, unsupported, kwargs[unsupported]))
        if key.shape[1] != query.shape[1] and query.shape[1] % key.shape[1]:
            raise ValueError("%s: %d query heads are not a multiple of %d key heads"
                             % (name, query.shape[1], key.shape[1]))
        causal = bool(kwargs.get("is_causal") if kwargs.get("is_causal") is not None
                      else getattr(module, "is_causal", False))
        config = getattr(module, "config", None)
        # With a LinattnCache, its update() has just checked the options of this config against
        # the ones it was made with: those, without asking again (once per layer and token).
        owner = None if cached is None else cached.cache
        user = (dict(owner.options) if owner is not None and owner.backend == name and config is owner.config
                else options_of(config, name))
        if cached is not None:  # the cache keeps the model's key/value heads; it repeats them where it needs to
            if not causal:
                raise ValueError("%s: LinattnCache serves causal attention; this attention layer is not causal" % name)
            out = cached.attend(name, module, b, user, query, key, value, attention_mask, scaling,
                                lambda q, k, v: forward(module, q, k, v, None, True, causal, scaling, user))
            return out.transpose(1, 2).contiguous(), None
        key, value = per_query_head(key, query.shape[1]), per_query_head(value, query.shape[1])
        n_q, n_k = query.shape[2], key.shape[2]
        mask_causal = causal and n_q > 1  # a single new query sees the whole cache
        # Key slots masked for every query of every row at the end: a static cache's empty
        # slots (no token), or right padding. Dropped for one query (always the same result,
        # and its window is then the last keys that exist), and for several when the mask is
        # a causal mask only on the keys before them (a static cache's prompt against its
        # empty slots: causal masks align bottom-right on the keys that exist).
        used = _masks.used_keys(name, attention_mask, n_k)
        if used < n_k and (n_q == 1 or (used >= n_q and not _masks.fits(name, attention_mask, query.shape[0], n_q,
                                                                          n_k, mask_causal))):
            key, value, attention_mask = key[:, :, :used], value[:, :, :used], attention_mask[..., :used]
            n_k = used
        if mask_causal and b.function in _NO_CAUSAL_FORM:
            raise ValueError("%s: this attention layer is causal, and %s has no causal form (%s); use linattn_softmax "
                             "or a kernelized backend for a causal model" % (name, b.function, _NO_CAUSAL_FORM[b.function]))
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
        return op(*b.inputs(module, query, key, user), value, key_lengths=key_lengths, **options)

    attention.__name__ = attention.__qualname__ = name
    attention.__doc__ = "linattn's %s as a transformers attention function (see linattn.hf)." % b.function
    return attention


def per_query_head(t, heads):
    """t [B, H_kv, n, d] of a grouped-query model's key/value heads as one per query head
    [B, heads, n, d] (query head h reads key head h // (heads / H_kv)); t itself without groups."""
    groups = heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


# ---- options -----------------------------------------------------------------------------------

def options_of(config, name):
    """Backend `name`'s options: its defaults, updated by config.linattn_options when `name` is
    the config's backend (the options are the model's backend's; another backend called on the
    same modules, as a comparison does, runs with its defaults). Every attention layer asks at
    every forward (a decoded token: 30 layers of SmolLM2): the checked options are kept per
    config and checked again whenever what they come from differs (a new dict, or one changed)."""
    given = {}
    if getattr(config, "_attn_implementation", None) == name and stored_backend(config) == name:
        given = dict(getattr(config, "linattn_options", None) or {})
    # What the checks read: the options, and the config's max_position_embeddings (Linformer's default).
    # Types too: True == 1 and 4.0 == 4, which the checks tell apart.
    key = (name, [(k, type(v), v) for k, v in sorted(given.items(), key=lambda kv: str(kv[0]))],
           getattr(config, "max_position_embeddings", None))
    memo = _OPTIONS_MEMO.get(id(config))
    try:
        if memo is not None and memo[0]() is config and bool(memo[1] == key):
            return dict(memo[2])
    except (TypeError, ValueError):  # a value that does not compare as one bool (an array): checked below
        pass
    o = checked(name, given, config)
    if config is not None:
        try:
            _OPTIONS_MEMO[id(config)] = (_weakref.ref(config, lambda _, i=id(config): _OPTIONS_MEMO.pop(i, None)),
                                         copy.deepcopy(key), dict(o))
        except TypeError:  # a config that takes no weak reference, or a value no copy: checked every time
            pass
    return o


_OPTIONS_MEMO = {}  # id(config) -> (weak reference, key, checked options): options_of's


def stored_backend(config):
    """The backend whose options config.linattn_options holds: config.linattn_backend, which
    set_options writes, or (a config written before it did) the attention implementation."""
    return getattr(config, "linattn_backend", None) or getattr(config, "_attn_implementation", None)


def checked(name, given, config, fn="linattn.hf"):
    """The options `given` for backend `name`, checked (ValueError naming the option),
    normalised (plain Python values) and completed with the defaults."""
    b = backend(name)
    if not isinstance(given, dict):
        raise ValueError("%s: the linattn options must be a dict, got %s" % (fn, type(given).__name__))
    # A config saved before a rename too: read at every forward, so it warns once.
    given = _options.renamed(fn, dict(given), _options.RENAMED, once=True)
    unknown = sorted(set(given) - set(b.defaults), key=str)
    if unknown:
        raise ValueError("%s: backend %r takes no option %s (its options: %s)"
                         % (fn, name, ", ".join(map(repr, unknown)), ", ".join(sorted(b.defaults)) or "none"))
    o = {**b.defaults, **given}
    for k in o:
        if k == "window":
            o[k] = _options.integer(fn, k, o[k], b.minimum_window)
        elif k == "init":
            o[k] = _options.choice(fn, k, o[k], b.inits)
        elif k not in getattr(getattr(b, "cls", None), "options", {}) and k in _OPTION_CHECKS:
            o[k] = _OPTION_CHECKS[k](fn, k, o[k])  # (a learned map's own options: its own checks, b.check)
    if o.get("decay") is not None and not o.get("window"):
        raise ValueError("%s: decay=%r needs window >= 1: it decays the linear part of the sliding-window hybrid"
                         % (fn, o["decay"]))
    if o.get("sinks") and not o.get("window"):
        raise ValueError("%s: sinks=%d needs window >= 1: the sink tokens join the window's exact softmax (the "
                         "sliding-window hybrid)" % (fn, o["sinks"]))
    b.check(o, config)
    return o


def given_options(model, name, options):
    """What set_options stores for backend `name`: the model's stored options (when they are
    this backend's) updated by `options`, checked and normalised. The model is not changed."""
    config = model.config
    stored = dict(getattr(config, "linattn_options", None) or {})
    if stored_backend(config) != name:
        stored = {}  # another backend's options: they do not carry over
    fn = "linattn.hf.set_options"
    # Former names (a config saved before a rename, or the caller's) under their names now, each
    # side on its own before they merge. The warning points at set_options' caller.
    merged = {**_options.renamed(fn, stored, _options.RENAMED, stacklevel=5),
              **_options.renamed(fn, dict(options), _options.RENAMED, stacklevel=5)}
    full = checked(name, merged, config, fn=fn)
    return {k: full[k] for k in merged}, full


def set_options(model, **options):
    """Sets options of the model's linattn backend and creates the learned tensors they need.

    The options update those the model has (model.config.linattn_options, saved with the model):
    set_options(model, window=4) keeps feature_dim and every other option as it was. They are
    checked and normalised (plain Python numbers) before anything is written: a bad value raises
    ValueError naming it and the model is unchanged. Then every attention module gets what the
    options need and does not have yet, as parameters (Linformer e, f; depthwise convolution
    weights; Hedgehog's maps; the hybrid's window gate), so an optimizer built afterwards trains
    them. A learned tensor the module has already is kept as it is (trained maps are never
    replaced): options that would need it in another shape (feature_dim of existing maps, say)
    raise ValueError; remove_learned(model) removes them first when starting over is meant.
    Call it with no options to create the defaults' tensors. Returns the model."""
    create_learned(model, options)
    return model


def create_learned(model, options):
    """set_options' work; returns [(module, attribute)] of what it created (linearize removes
    exactly those when it fails midway)."""
    config = model.config
    name = getattr(config, "_attn_implementation", None)
    if name not in BACKENDS:
        raise ValueError("linattn.hf.set_options: the model's attention implementation is %r, not a linattn "
                         "backend (load it with attn_implementation='linattn_...'; see linattn.hf.BACKENDS)" % (name,))
    stored, user = given_options(model, name, options)
    modules = attention_modules(model)
    if not modules:
        raise ValueError("linattn.hf.set_options: found no attention module (a module with config, is_causal "
                         "and layer_idx attributes) in %s" % type(model).__name__)
    b = BACKENDS[name]
    plan = []  # every check first, over every module: nothing is written before all pass
    for m in modules:
        for attr, (shape, option, make) in b.learned(m, user).items():
            have = _existing(m, attr)
            if have is None:
                plan.append((m, attr, make))
            elif tuple(_shape_of(have)) != tuple(shape):
                raise ValueError("linattn.hf.set_options: %s=%r needs %s of shape %s, but layer %s has a learned one of "
                                 "shape %s, which would be lost; set %s back, or remove the learned tensors first "
                                 "with linattn.hf.remove_learned(model) to start over"
                                 % (option, user.get(option), PREFIX + attr, _shape_text(shape), m.layer_idx,
                                    _shape_text(_shape_of(have)), option))
    config.linattn_options = stored
    config.linattn_backend = name
    created = []
    for m, attr, make in plan:
        anchor = next(m.parameters())
        made = make({"dtype": anchor.dtype, "device": anchor.device})
        if isinstance(made, _torch.nn.Module):
            m.add_module(PREFIX + attr, made)
        else:
            m.register_parameter(PREFIX + attr, made)
        created.append((m, PREFIX + attr))
    if isinstance(b, Favor):
        for m in modules:
            projection(m, next(m.parameters()), user)
    return created


def remove_learned(model):
    """Removes every tensor linattn.hf attached to the model's attention modules and returns
    them, {qualified name: tensor or module}: the deliberate way to start a conversion over
    (set_options and linearize never replace a learned tensor)."""
    names = {id(m): n for n, m in model.named_modules()}
    removed = {}
    for m in attention_modules(model):
        for attr in [a for kind in ("_parameters", "_buffers", "_modules") for a in vars(m)[kind] if a.startswith(PREFIX)]:
            removed["%s.%s" % (names[id(m)], attr) if names[id(m)] else attr] = getattr(m, attr)
            delattr(m, attr)
    return removed


def _existing(module, attr):
    return vars(module)["_parameters"].get(PREFIX + attr, vars(module)["_modules"].get(PREFIX + attr))


def _shape_of(t):
    """A tensor's shape; a module's (a learned map): its parameters' shapes."""
    if isinstance(t, _torch.nn.Module):
        return tuple(tuple(p.shape) for p in t.parameters())
    return tuple(t.shape)


def _shape_text(shape):
    """[4, 8] for a tensor's shape; [4, 8, 8] and [4, 8] for a module's parameters'."""
    if shape and isinstance(shape[0], tuple):
        return " and ".join(str(list(s)) for s in shape)
    return str(list(shape))


def attention_modules(model):
    """The modules that call the attention function: those with config, is_causal and layer_idx
    attributes (transformers' attention classes, BertSelfAttention and LlamaAttention among them)."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("config", "is_causal", "layer_idx"))]


def learned_parameters(model):
    """The parameters of the learned tensors the model's backend and options use (feature maps,
    window gates, convolutions, Linformer's e and f), in module order."""
    name = getattr(model.config, "_attn_implementation", None)
    if name not in BACKENDS:
        return []
    user = options_of(model.config, name)
    return [p for m in attention_modules(model) for p in module_learned_parameters(m, BACKENDS[name], user)]


def module_learned_parameters(module, b, user):
    """The parameters of the learned tensors backend b with options `user` uses on one module."""
    out = []
    for attr in b.learned(module, user):
        t = _existing(module, attr)
        if t is not None:
            out += list(t.parameters()) if isinstance(t, _torch.nn.Module) else [t]
    return out


# ---- what backends use ---------------------------------------------------------------------------

def heads(module, config):
    h = getattr(module, "num_attention_heads", None) or getattr(config, "num_attention_heads", None)
    d = getattr(module, "attention_head_size", None) or getattr(module, "head_dim", None)
    if d is None:
        d = getattr(config, "head_dim", None) or config.hidden_size // h
    return h, d


def projection(module, like, user):
    """Layer layer_idx's FAVOR projection [num_features, head_dim] in like's dtype: a buffer
    drawn from the options (features, seed + layer index: fixed constants, nothing learned, not
    saved) by set_options, and drawn again whenever those options differ from what it was drawn
    from (the module records it), so that what runs is what a reload draws; cast, not redrawn,
    for another dtype."""
    key = PREFIX + "projection"
    w = getattr(module, key, None)
    _, d = heads(module, module.config)
    seed = (int(user["seed"]) + int(module.layer_idx or 0)) % 2**63
    source = (user["num_features"], d, user["features"], seed)
    if w is None or getattr(module, "_linattn_projection_source", None) != source:
        anchor = next(module.parameters())
        np_dtype = _np.float64 if anchor.dtype == _torch.float64 else _np.float32
        w = _torch.from_numpy(_linattn.random_features(user["num_features"], d, user["features"], seed, np_dtype))
        module.register_buffer(key, w.to(device=anchor.device, dtype=anchor.dtype), persistent=False)
        module._linattn_projection_source = source
        w = getattr(module, key)
    return w.to(like.dtype)


def learned_tensor(module, b, user, attr, like, cast=True):
    """The module's learned tensor `attr` of backend b (made by set_options), cast to like's
    dtype when cast (a differentiable cast: the parameter itself stays as it is). ValueError
    when it does not exist or does not fit the options: a forward never creates one."""
    t = _existing(module, attr)
    shape = b.learned(module, user)[attr][0]
    if t is None:
        raise ValueError("%s: layer %s has no learned %s; call linattn.hf.set_options(model, ...) (or linearize) "
                         "once before running the model, and before building the optimizer, so that it trains it"
                         % (b.name, module.layer_idx, PREFIX + attr))
    if tuple(_shape_of(t)) != tuple(shape):
        raise ValueError("%s: layer %s's learned %s has shape %s, but the model's options need %s "
                         "(config.linattn_options was changed without linattn.hf.set_options, which refuses to "
                         "replace learned tensors); set the options back" % (b.name, module.layer_idx, PREFIX + attr,
                                                                             _shape_text(_shape_of(t)), _shape_text(shape)))
    if cast and t.dtype != like.dtype:
        return t.to(like.dtype)
    return t


def window_gate(module, b, user, like):
    """The hybrid's window gate g [heads] in like's dtype (γ = sigmoid(g) scales the window)."""
    return learned_tensor(module, b, user, "window_gate", like)


def hybrid(module, b, query, key, value, key_lengths, causal, scaling, user):
    """The sliding-window hybrid (linattn.torch.hybrid_attention) with backend b's features as
    its linear part: exact softmax over the last `window` keys (causal; |i - j| <= window
    otherwise) and the first `sinks` keys (causal only), the feature map beyond, one normaliser,
    and the learned window gate (linattn_window: nothing beyond the window, no gate). Causal holds
    for one new query against a cache too: its window is the last `window` keys, as in training,
    and its sinks the cache's first keys."""
    options = {"window": int(user["window"]), "causal": causal, "key_lengths": key_lengths, "scale": scaling}
    if user.get("sinks"):
        options["sinks"] = int(user["sinks"])
    decays = log_decay(user, query.shape[1])
    if decays is not None:
        options["log_decay"] = _torch.tensor(decays, dtype=query.dtype, device=query.device)
    if not isinstance(b, Window):
        options["window_gate"] = window_gate(module, b, user, query)
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
