"""linattn.hf: linattn's methods as Hugging Face transformers attention backends.

    import linattn.hf
    linattn.hf.register()
    model = AutoModel.from_pretrained(path, attn_implementation="linattn_favor")
    linattn.hf.set_options(model, num_features=128)      # optional; before building an optimizer

Every model whose attention goes through transformers' AttentionInterface (BERT and MiniLM,
Llama, Qwen, GPT-2, ...) then runs its attention on linattn's kernels, forward and backward
(through linattn.torch). The names are BACKENDS' keys: linattn_softmax (exact), linattn_elu,
linattn_relu, linattn_focused (kernelized), linattn_favor (Performer), linattn_nystrom,
linattn_linformer, linattn_efficient, linattn_hedgehog (learned feature maps, below),
linattn_window (exact softmax within a sliding window, nothing beyond: a baseline).

Converting a pretrained model (docs/linearize.md):

    linattn.hf.linearize(model, feature_map="hedgehog", feature_dim=32)   # maps added, the rest frozen
    losses = linattn.hf.attention_transfer(model, tokenizer, texts, steps=300)  # stage 1
    model.save_pretrained(path)
    model = linattn.hf.from_pretrained(transformers.AutoModel, path)        # maps included

Masks: the model's padding mask becomes linattn's key_lengths, so padding must be at the end of
each sequence (right padding, what encoders use). A mask that is not "a prefix of the keys"
(left padding, packed sequences, sliding windows, additive biases such as ALiBi) raises
ValueError: linattn cannot apply it, and attending to the wrong keys silently is worse.
Causal models (module.is_causal) use the causal forms: the kernelized methods and softmax;
Nyström, Linformer and Efficient Attention have none and raise ValueError. With a KV cache,
one new query attends to every cached key (no mask needed); a chunk of several new queries
over a longer cache works for softmax (bottom-right aligned) and raises for the others.

Options live in the model config as the dict `config.linattn_options` (saved with the model);
set_options(model, **options) checks them against the model's backend, stores them and creates
the learned tensors they need (Linformer's e and f, depthwise convolutions) as parameters of
each attention module, so an optimizer built afterwards trains them. Per backend:
  linattn_favor: num_features (256), features ("orthogonal"; linattn.random_features' kinds:
    "iid", "orthogonal_fixed", "quantile"), kernel ("positive"; "hyperbolic", "trig"), seed (0).
    Layer l uses projection seed + l: fixed, reproducible constants (buffers, not parameters).
  linattn_elu / linattn_relu: eps. linattn_focused: focus_power (3.0), eps, dwc_kernel_size
    (None; a learned depthwise convolution of v, initialised to zero so a pretrained model's
    output is unchanged until it is trained).
  linattn_nystrom: num_landmarks (64), pinv_iterations (6), pinv ("iterative"),
    conv_kernel_size (None; as dwc_kernel_size).
  linattn_linformer: s_proj (256), max_seq_len (config.max_position_embeddings), init ("pool":
    e and f average s_proj equal segments of the max_seq_len positions, so an untrained model
    sees segment means of its keys and values; "random": linattn.linformer_projections).
  linattn_hedgehog: feature_dim (32; m' = 2·feature_dim features per head), init ("identity"
    or "random"): HedgehogFeatureMap submodules for queries and keys in every attention module;
    window (0).
  linattn_elu, linattn_relu, linattn_hedgehog: window (0; w > 0: the sliding-window hybrid,
    linattn.torch.hybrid_attention, with a learned gate linattn_window_gate [heads]).
  linattn_window: window (64, >= 1).
  linattn_softmax, linattn_efficient: none.
The model's own scaling (1/sqrt(head_dim) for BERT) is passed as `scale` to every method that
takes one; the linear maps (elu, relu, focused) have no scale.

Attention dropout: the linear methods never form attention weights to drop, and softmax here
has no dropout; a model in training mode with attention dropout > 0 raises ValueError (set
config.attention_probs_dropout_prob / attention_dropout to 0) instead of training without it.
Attention weights are not returned (output_attentions gives None)."""

import numpy as _np
import torch as _torch

from . import _linattn
from . import torch as _lt

# backend name -> (linattn.torch function, options fixed by the name, user options with defaults)
BACKENDS = {
    "linattn_softmax": ("softmax_attention", {}, {}),
    "linattn_elu": ("linear_attention", {"feature_map": "elu"}, {"eps": 1e-6, "window": 0}),
    "linattn_relu": ("linear_attention", {"feature_map": "relu"}, {"eps": 1e-6, "window": 0}),
    "linattn_focused": ("linear_attention", {"feature_map": "focused"},
                        {"eps": 1e-6, "focus_power": 3.0, "dwc_kernel_size": None}),
    "linattn_favor": ("favor_attention", {}, {"num_features": 256, "features": "orthogonal", "kernel": "positive",
                                              "seed": 0}),
    "linattn_nystrom": ("nystrom_attention", {}, {"num_landmarks": 64, "pinv_iterations": 6, "pinv": "iterative",
                                                  "conv_kernel_size": None}),
    "linattn_linformer": ("linformer_attention", {}, {"s_proj": 256, "max_seq_len": None, "init": "pool"}),
    "linattn_efficient": ("efficient_attention", {}, {}),
    "linattn_hedgehog": ("hedgehog_attention", {}, {"feature_dim": 32, "init": "identity", "window": 0}),
    "linattn_window": ("hybrid_attention", {}, {"window": 64}),
}
_FEATURE_KINDS = ("orthogonal", "iid", "orthogonal_fixed", "quantile")
_PREFIX = "linattn_"  # attribute names of what this module attaches to attention modules


def register():
    """Registers every backend of BACKENDS with transformers' AttentionInterface (and, for the
    masks, AttentionMaskInterface: the boolean masks of sdpa, which are None when nothing is
    masked). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    for name in BACKENDS:
        AttentionInterface.register(name, attention_function(name))
        AttentionMaskInterface.register(name, sdpa_mask)


def attention_function(name):
    """The AttentionInterface function of backend `name`: (module, query, key, value,
    attention_mask, scaling=None, dropout=0.0, **kwargs) -> (output [B, n_q, H, d_v], None),
    query [B, H, n_q, d], key and value [B, H_kv, n_k, d] (H a multiple of H_kv)."""
    if name not in BACKENDS:
        raise ValueError("linattn.hf: unknown backend %r; the backends: %s" % (name, ", ".join(BACKENDS)))
    function, fixed, _ = BACKENDS[name]
    op = getattr(_lt, function)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
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
        mask_causal = causal and n_q > 1  # a single new query sees the whole cache
        key_lengths = _key_lengths(name, attention_mask, query.shape[0], n_q, n_k, mask_causal)
        user = options_of(getattr(module, "config", None), name)
        if mask_causal and n_q != n_k and function != "softmax_attention" and not user.get("window"):
            raise ValueError("%s: %d queries against %d cached keys; causal %s needs as many queries as keys "
                             "(decode one token at a time, or use linattn_softmax)" % (name, n_q, n_k, function))
        options = dict(fixed)
        if mask_causal:
            options["causal"] = True
        if function != "linear_attention":
            options["scale"] = scaling
        if function == "linear_attention":
            options["eps"] = user["eps"]
            if "focus_power" in user:
                options["focus_power"] = user["focus_power"]
            if user.get("dwc_kernel_size") is not None:
                options["dwc_weight"] = _learned(module, name, query, user)["conv_weight"]
        elif function == "favor_attention":
            options["kernel"] = user["kernel"]
            options["projection"] = _projection(module, query, user)
        elif function == "nystrom_attention":
            options.update(num_landmarks=user["num_landmarks"], pinv_iterations=user["pinv_iterations"],
                           pinv=user["pinv"])
            if user["conv_kernel_size"] is not None:
                options["conv_weight"] = _learned(module, name, query, user)["conv_weight"]
        elif function == "linformer_attention":
            learned = _learned(module, name, query, user)
            options.update(e=learned["e"], f=learned["f"])
        elif function == "hedgehog_attention":
            options.pop("scale")  # the learned maps take q and k as the model makes them
            fq, fk = _hedgehog_maps(module, query, user)
            options.update(query_weight=fq.weight, query_bias=fq.bias, key_weight=fk.weight, key_bias=fk.bias)
        if user.get("window"):
            out = _hybrid(module, function, query, key, value, key_lengths, causal, scaling, user,
                          fixed.get("feature_map"))
        else:
            out = op(query, key, value, key_lengths=key_lengths, **options)
        if getattr(module, "linattn_transfer", False):
            out = _transfer_step(module, query, key, value, out, key_lengths, mask_causal, scaling)
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = attention.__qualname__ = name
    attention.__doc__ = "linattn's %s as a transformers attention function (see linattn.hf)." % function
    return attention


# ---- options -----------------------------------------------------------------------------------

def options_of(config, name):
    """Backend `name`'s options: its defaults, updated by config.linattn_options when `name` is
    the config's backend (the options are the model's backend's; another backend called on the
    same modules, as a comparison does, runs with its defaults)."""
    given = {}
    if getattr(config, "_attn_implementation", None) == name:
        given = dict(getattr(config, "linattn_options", None) or {})
    return _checked(name, given, config)


def _checked(name, given, config):
    function, _, defaults = BACKENDS[name]
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError("linattn.hf: backend %r takes no option %s (its options: %s)"
                         % (name, ", ".join(map(repr, unknown)), ", ".join(sorted(defaults)) or "none"))
    o = {**defaults, **given}
    positive = [k for k in ("num_features", "num_landmarks", "s_proj", "max_seq_len", "dwc_kernel_size",
                            "conv_kernel_size") if o.get(k) is not None]
    for k in positive:
        if isinstance(o[k], bool) or not isinstance(o[k], (int, _np.integer)) or o[k] < 1:
            raise ValueError("linattn.hf: %s must be a positive integer, got %r" % (k, o[k]))
    if "features" in o and o["features"] not in _FEATURE_KINDS:
        raise ValueError("linattn.hf: features must be one of %s, got %r" % (", ".join(_FEATURE_KINDS), o["features"]))
    inits = ("identity", "random") if function == "hedgehog_attention" else ("pool", "random")
    if "init" in o and o["init"] not in inits:
        raise ValueError("linattn.hf: init must be %s, got %r" % (" or ".join(map(repr, inits)), o["init"]))
    if function == "hedgehog_attention" and (isinstance(o["feature_dim"], bool) or
                                             not isinstance(o["feature_dim"], (int, _np.integer)) or o["feature_dim"] < 1):
        raise ValueError("linattn.hf: feature_dim must be a positive integer, got %r" % (o["feature_dim"],))
    if "window" in o and (isinstance(o["window"], bool) or not isinstance(o["window"], (int, _np.integer)) or
                          o["window"] < (1 if function == "hybrid_attention" else 0)):
        raise ValueError("linattn.hf: window must be an integer >= %d, got %r"
                         % (1 if function == "hybrid_attention" else 0, o["window"]))
    if function == "linformer_attention" and o["max_seq_len"] is None:
        o["max_seq_len"] = getattr(config, "max_position_embeddings", None)
        if o["max_seq_len"] is None:
            raise ValueError("linattn.hf: linattn_linformer needs max_seq_len (the model config has no "
                             "max_position_embeddings)")
    return o


def set_options(model, **options):
    """Sets the options of the model's linattn backend (model.config.linattn_options, checked)
    and attaches what they need to every attention module: FAVOR projections (buffers) and the
    learned tensors (Linformer e, f; depthwise convolution weights) as parameters, so that an
    optimizer built afterwards trains them. Call it with no options to attach the defaults'.
    Returns the model."""
    config = model.config
    name = getattr(config, "_attn_implementation", None)
    if name not in BACKENDS:
        raise ValueError("linattn.hf.set_options: the model's attention implementation is %r, not a linattn "
                         "backend (load it with attn_implementation='linattn_...'; see linattn.hf.BACKENDS)" % (name,))
    _checked(name, options, config)
    config.linattn_options = dict(options)
    user = options_of(config, name)
    modules = attention_modules(model)
    if not modules:
        raise ValueError("linattn.hf.set_options: found no attention module (a module with config, is_causal "
                         "and layer_idx attributes) in %s" % type(model).__name__)
    function = BACKENDS[name][0]
    for m in modules:
        for attr in [a for a in vars(m)["_parameters"] if a.startswith(_PREFIX)] + \
                    [a for a in vars(m)["_buffers"] if a.startswith(_PREFIX)] + \
                    [a for a in vars(m)["_modules"] if a.startswith(_PREFIX)]:
            delattr(m, attr)  # options changed: what was attached for the old ones goes
        anchor = next(m.parameters())
        if function == "favor_attention":
            _projection(m, anchor, user)
        elif function == "hedgehog_attention":
            _hedgehog_maps(m, anchor, user, create=True)
        elif function == "linformer_attention" or user.get("dwc_kernel_size") or user.get("conv_kernel_size"):
            _learned(m, name, anchor, user, create=True)
        if user.get("window") and function != "hybrid_attention":
            _window_gate(m, anchor, create=True)
    return model


def attention_modules(model):
    """The modules that call the attention function: those with config, is_causal and layer_idx
    attributes (transformers' attention classes, BertSelfAttention and LlamaAttention among them)."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("config", "is_causal", "layer_idx"))]


def _heads(module, config):
    h = getattr(module, "num_attention_heads", None) or getattr(config, "num_attention_heads", None)
    d = getattr(module, "attention_head_size", None) or getattr(module, "head_dim", None)
    if d is None:
        d = getattr(config, "head_dim", None) or config.hidden_size // h
    return h, d


def _projection(module, like, user):
    """Layer layer_idx's FAVOR projection [num_features, head_dim], a buffer made on first use."""
    key = _PREFIX + "projection"
    w = getattr(module, key, None)
    _, d = _heads(module, module.config)
    if w is None or w.shape != (user["num_features"], d) or w.dtype != like.dtype:
        seed = (int(user["seed"]) + int(module.layer_idx or 0)) % 2**63
        np_dtype = _np.float64 if like.dtype == _torch.float64 else _np.float32
        w = _torch.from_numpy(_linattn.random_features(user["num_features"], d, user["features"], seed, np_dtype))
        module.register_buffer(key, w.to(like.device), persistent=False)
    return getattr(module, key)


def _learned(module, name, like, user, create=False):
    """The module's learned tensors for backend `name` (made by set_options, create=True, or
    here on first use outside training): Linformer's e and f, or a depthwise convolution's weight."""
    function = BACKENDS[name][0]
    keys = ("e", "f") if function == "linformer_attention" else ("conv_weight",)
    have = {k: getattr(module, _PREFIX + k, None) for k in keys}
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
            e, f = (_torch.from_numpy(x).to(like.device) for x in _linattn.linformer_projections(s, n, seed=0, dtype=np_dtype))
        tensors = {"e": e, "f": f}
    else:
        h, _ = _heads(module, module.config)
        k = user.get("dwc_kernel_size") or user.get("conv_kernel_size")
        tensors = {"conv_weight": _torch.zeros((h, k), **factory)}  # zero: the pretrained output unchanged
    for k, t in tensors.items():
        module.register_parameter(_PREFIX + k, _torch.nn.Parameter(t))
    return {k: getattr(module, _PREFIX + k) for k in keys}


def _hedgehog_maps(module, like, user, create=False):
    """The module's learned Hedgehog feature maps (queries, keys): HedgehogFeatureMap
    submodules made by set_options or linearize (create=True), or here on first use outside
    training."""
    keys = (_PREFIX + "hedgehog_q", _PREFIX + "hedgehog_k")
    maps = [getattr(module, k, None) for k in keys]
    h, d = _heads(module, module.config)
    fits = all(m is not None and m.weight.shape == (h, d, user["feature_dim"]) and m.weight.dtype == like.dtype
               for m in maps)
    if fits and not create:
        return maps
    if not create and module.training and _torch.is_grad_enabled():
        raise ValueError("linattn_hedgehog: the learned feature maps do not exist yet; call linattn.hf.linearize(model, "
                         "...) or linattn.hf.set_options(model, ...) before building the optimizer, so that it trains them")
    from .torch.feature_maps import HedgehogFeatureMap
    for k in keys:
        module.add_module(k, HedgehogFeatureMap(h, d, int(user["feature_dim"]), init=user["init"], dtype=like.dtype,
                                                device=like.device))
    return [getattr(module, k) for k in keys]


def _window_gate(module, like, create=False):
    """The module's learned window gate g [heads] of the sliding-window hybrid (γ = sigmoid(g)
    scales the window term), a parameter made by set_options or linearize (create=True; g = 0,
    γ = 1/2, the window and the linear part weighed alike), or here on first use outside
    training."""
    key = _PREFIX + "window_gate"
    gate = getattr(module, key, None)
    h, _ = _heads(module, module.config)
    if gate is not None and gate.shape == (h,) and gate.dtype == like.dtype and not create:
        return gate
    if not create and module.training and _torch.is_grad_enabled():
        raise ValueError("linattn.hf: the window gate does not exist yet; call linattn.hf.linearize(model, ...) or "
                         "linattn.hf.set_options(model, ...) before building the optimizer, so that it trains it")
    module.register_parameter(key, _torch.nn.Parameter(_torch.zeros(h, dtype=like.dtype, device=like.device)))
    return getattr(module, key)


def _hybrid(module, function, query, key, value, key_lengths, causal, scaling, user, linear_map):
    """The sliding-window hybrid (linattn.torch.hybrid_attention) of backend `function`'s
    features: exact softmax over the last `window` keys (causal; |i - j| <= window otherwise),
    the feature map beyond, one normaliser. linattn_window: nothing beyond the window (features
    of zeros). Causal holds for one new query against a cache too: its window is the last
    `window` keys, as in training."""
    options = {"window": int(user["window"]), "causal": causal, "key_lengths": key_lengths, "scale": scaling}
    if function == "hybrid_attention":  # window only
        b, h, n_q, n_k = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        zeros = query.new_zeros((b, h, n_q, 1)), key.new_zeros((b, h, n_k, 1))
        return _lt.hybrid_attention(query, key, value, query_features=zeros[0], key_features=zeros[1],
                                    feature_map="given", **options)
    options["window_gate"] = _window_gate(module, query)
    if function == "hedgehog_attention":
        fq, fk = _hedgehog_maps(module, query, user)
        return _lt.hybrid_attention(query, key, value, query_features=fq(query), key_features=fk(key),
                                    feature_map="given", **options)
    return _lt.hybrid_attention(query, key, value, feature_map=linear_map, eps=user["eps"], **options)


def _transfer_step(module, query, key, value, out, key_lengths, causal, scaling):
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


# ---- conversion ----------------------------------------------------------------------------------

# linearize's feature_map -> the backend it switches to. "none": the window alone (exact softmax
# over the window, nothing beyond), the baseline that shows what the linear part earns.
_CONVERSIONS = {"hedgehog": "linattn_hedgehog", "elu": "linattn_elu", "relu": "linattn_relu", "none": "linattn_window"}


def linearize(model, feature_map="hedgehog", window=0, feature_dim=32, init="identity"):
    """Switches every attention layer of a transformers model to linear attention with learned
    feature maps, adds their parameters, and freezes everything else: the first step of
    converting a pretrained softmax model (then attention_transfer).

    feature_map: "hedgehog" (HedgehogFeatureMap per layer, for queries and keys; backend
    linattn_hedgehog), "elu" or "relu" (fixed maps; only the window gate is learned), or "none"
    (window > 0 required: exact softmax inside the window and nothing beyond, the baseline).
    window: 0, plain linear attention; w > 0, the sliding-window hybrid: exact softmax over the
    last w keys (causal models; |i - j| <= w in encoders) with the map beyond it and one
    normaliser, and a learned gate g per head (γ = sigmoid(g) scales the window; g = 0 at first).
    feature_dim: f, m' = 2f features per head (hedgehog). init: "identity" (W = the identity's
    first f columns, b = 0) or "random" (hedgehog). The model's other parameters get
    requires_grad=False; the new ones get True. Raises ValueError before changing anything when
    an argument is wrong or the model has no attention module that linattn can drive; a failure
    midway restores the model. Returns the model."""
    fn = "linattn.hf.linearize"
    if feature_map not in _CONVERSIONS:
        raise ValueError("%s: feature_map must be one of %s, got %r" % (fn, ", ".join(map(repr, _CONVERSIONS)),
                                                                       feature_map))
    if isinstance(window, bool) or not isinstance(window, (int, _np.integer)) or window < 0:
        raise ValueError("%s: window must be an integer >= 0, got %r" % (fn, window))
    if feature_map == "none" and window < 1:
        raise ValueError("%s: feature_map='none' keeps only the window, so window must be >= 1, got %r"
                         % (fn, window))
    if isinstance(feature_dim, bool) or not isinstance(feature_dim, (int, _np.integer)) or feature_dim < 1:
        raise ValueError("%s: feature_dim must be an integer >= 1, got %r" % (fn, feature_dim))
    if init not in ("identity", "random"):
        raise ValueError("%s: init must be 'identity' or 'random', got %r" % (fn, init))
    modules = attention_modules(model)
    if not modules:
        raise ValueError("%s: found no attention module (a module with config, is_causal and layer_idx attributes) "
                         "in %s" % (fn, type(model).__name__))
    name = _CONVERSIONS[feature_map]
    saved = {"implementation": model.config._attn_implementation,
             "options": getattr(model.config, "linattn_options", None),
             "requires_grad": [p.requires_grad for p in model.parameters()]}
    try:
        register()
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise ValueError("%s: %s does not let its attention implementation be changed (it does not call "
                             "transformers' AttentionInterface)" % (fn, type(model).__name__))
        for p in model.parameters():
            p.requires_grad_(False)
        options = {"window": int(window)}
        if feature_map == "hedgehog":
            options.update(feature_dim=int(feature_dim), init=init)
        set_options(model, **options)
        model.config.linattn_backend = name  # saved with the model: from_pretrained() reads it
        for p in learned_parameters(model):
            p.requires_grad_(True)
    except BaseException:
        for m in modules:
            for attr in [a for a in list(vars(m)["_modules"]) + list(vars(m)["_parameters"]) if a.startswith(_PREFIX)]:
                delattr(m, attr)
        if model.config._attn_implementation != saved["implementation"]:
            model.set_attn_implementation(saved["implementation"])
        model.config.linattn_options = saved["options"]
        model.config.__dict__.pop("linattn_backend", None)
        for p, flag in zip(model.parameters(), saved["requires_grad"]):
            p.requires_grad_(flag)
        raise
    return model


def from_pretrained(model_class, path, **kwargs):
    """Loads a model that was linearized (or given a linattn backend with set_options) and saved
    with save_pretrained(): model_class.from_pretrained(path, **kwargs) on the saved backend,
    then the learned tensors linattn attached (feature maps, convolutions, Linformer's e and f)
    from the checkpoint's weights. transformers alone would drop those, since the attention
    modules it builds do not have them. A checkpoint that lacks any of them raises ValueError.
    model_class: a transformers class such as AutoModel or LlamaForCausalLM."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging
    fn = "linattn.hf.from_pretrained"
    config = AutoConfig.from_pretrained(path)
    name = getattr(config, "linattn_backend", None)
    if name not in BACKENDS:
        raise ValueError("%s: %s holds no linattn conversion (its config has no linattn_backend); load it with "
                         "%s.from_pretrained" % (fn, path, getattr(model_class, "__name__", "the model class")))
    register()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the learned tensors are "unused weights" to transformers; loaded below
    try:
        model = model_class.from_pretrained(path, attn_implementation=name, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    set_options(model, **(config.linattn_options or {}))
    model.config.linattn_backend = name
    wanted = {k for k in model.state_dict() if (".%s" % _PREFIX) in k}
    loaded = {k: v for k, v in _checkpoint_tensors(path, wanted).items()}
    missing = sorted(wanted - set(loaded))
    if missing:
        raise ValueError("%s: the checkpoint in %s lacks %d learned tensors of linattn (%s, ...)"
                         % (fn, path, len(missing), missing[0]))
    model.load_state_dict(loaded, strict=False)
    return model


def _checkpoint_tensors(path, names):
    """The tensors of `names` from a save_pretrained directory (safetensors, one file or shards)."""
    import json
    import os
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            where = json.load(f)["weight_map"]
        files = sorted({where[n] for n in names if n in where})
    else:
        files = ["model.safetensors"]
    out = {}
    for file in files:
        with safe_open(os.path.join(path, file), framework="pt") as f:
            keys = set(f.keys())
            for n in names:
                # transformers may save a base model's weights with or without its prefix
                for key in (n, n.split(".", 1)[-1]):
                    if key in keys:
                        out[n] = f.get_tensor(key)
                        break
    return out


def learned_parameters(model):
    """The parameters linattn.hf attached to the model's attention modules (feature maps,
    projections, convolutions), in module order."""
    out = []
    for m in attention_modules(model):
        for attr, sub in vars(m)["_modules"].items():
            if attr.startswith(_PREFIX):
                out += list(sub.parameters())
        out += [p for attr, p in vars(m)["_parameters"].items() if attr.startswith(_PREFIX) and p is not None]
    return out


def attention_transfer(model, tokenizer, texts, steps=300, lr=1e-2, batch_size=8, max_length=128, seed=0,
                       progress=True):
    """Stage 1 of a conversion (LoLCATs' attention transfer): trains only the parameters that
    linearize() added, so that each layer's linear-attention output matches the softmax output
    the same layer computes on the same q, k, v in the same forward pass (teacher forcing: the
    softmax output goes on to the next layer, so every layer learns from the original model's
    activations, and no second copy of the model is needed).

    texts: a list of strings, cycled through in a shuffled order (seed); each step tokenizes
    batch_size of them (right padding, truncated to max_length) and takes one Adam step (lr)
    on the sum over layers of the mean squared error over valid queries. The model runs in
    eval mode (no dropout) with gradients on, and is left in the mode it was in. progress:
    a tqdm bar. Returns the per-layer losses: losses[layer][step]."""
    fn = "linattn.hf.attention_transfer"
    name = getattr(model.config, "_attn_implementation", None)
    params = learned_parameters(model)
    if name not in BACKENDS or not params:
        raise ValueError("%s: the model was never linearized (its attention is %r with no learned feature maps); call "
                         "linattn.hf.linearize(model, ...) first" % (fn, name))
    _check_training(fn, texts, steps=steps, batch_size=batch_size, max_length=max_length, lr=lr)
    modules = attention_modules(model)
    optimizer = _torch.optim.Adam(params, lr=lr)
    losses = [[] for _ in modules]
    was_training, side = model.training, getattr(tokenizer, "padding_side", "right")
    device = next(model.parameters()).device
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover (tqdm comes with transformers)
        tqdm = None
    bar = tqdm(total=steps, desc="attention transfer", disable=not progress) if tqdm else None
    model.eval()
    tokenizer.padding_side = "right"  # key_lengths: the padding at the end
    for m in modules:
        m.linattn_transfer = True
    try:
        with _torch.enable_grad():
            for batch in _batches(tokenizer, texts, steps, batch_size, max_length, seed, device):
                model(**batch)
                layer = [m.linattn_transfer_loss for m in modules]
                optimizer.zero_grad(set_to_none=True)
                _torch.stack(layer).sum().backward()
                optimizer.step()
                for l, x in zip(losses, layer):
                    l.append(float(x.detach()))
                if bar:
                    bar.update(1)
                    bar.set_postfix(loss="%.3g" % sum(l[-1] for l in losses))
    finally:
        for m in modules:
            m.linattn_transfer = False
            m.__dict__.pop("linattn_transfer_loss", None)
        tokenizer.padding_side = side
        model.train(was_training)
        if bar:
            bar.close()
    return losses


def _check_training(fn, texts, lr, **counts):
    """ValueError naming fn and the argument: counts (steps, batch_size, ...) must be integers
    >= 1, lr a finite number > 0, texts a non-empty list of strings."""
    for arg, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, _np.integer)) or value < 1:
            raise ValueError("%s: %s must be an integer >= 1, got %r" % (fn, arg, value))
    if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and 0 < lr < float("inf")):
        raise ValueError("%s: lr must be a finite number > 0, got %r" % (fn, lr))
    if isinstance(texts, str) or not len(texts) or not all(isinstance(t, str) for t in texts):
        raise ValueError("%s: texts must be a non-empty list of strings" % fn)


def _batches(tokenizer, texts, steps, batch_size, max_length, seed, device):
    """`steps` batches of batch_size texts, a shuffled cycle through `texts` (seed), tokenized
    with padding (the caller sets its side) and truncation to max_length, on `device`."""
    order = _np.random.default_rng(seed).permutation(len(texts))
    for step in range(steps):
        pick = [texts[order[(step * batch_size + i) % len(texts)]] for i in range(batch_size)]
        batch = tokenizer(pick, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        yield {k: v.to(device) for k, v in batch.items()}


def finetune(model, teacher, tokenizer, texts, steps=100, lr=1e-4, batch_size=8, max_length=128, lora=None,
             lora_rank=8, lora_alpha=16, target_modules=None, train=(), seed=0, progress=True):
    """Stage 2 of a conversion (optional, after attention_transfer): distillation of the
    linearized model against the original, end to end. Each step tokenizes batch_size texts
    (right padding, truncated to max_length), runs the teacher (no gradient) and the model, and
    takes one Adam step (lr) on the distillation loss over the valid tokens:
      causal LMs (outputs with logits): KL(teacher ‖ model) of the next-token distributions;
      encoders: the squared error of the last hidden states, relative to the teacher's mean
        square (so the sentence embeddings pooled from them follow the teacher's).
    What is trained: what linearize() added, always; LoRA adapters (peft) of rank lora_rank
    (alpha lora_alpha) on target_modules (default: every Linear inside the attention modules)
    when lora is True, or None and peft is installed; and the parameters whose names contain
    one of `train`. LoRA adapters are merged into the weights at the end, so the model saves
    and loads as any other (save_pretrained, from_pretrained). teacher: the original model (a
    second copy), left untouched. The model runs in eval mode (no dropout) with gradients on
    and is left in its mode; on failure it is restored as it was. Returns the losses, one per
    step."""
    fn = "linattn.hf.finetune"
    name = getattr(model.config, "_attn_implementation", None)
    if name not in BACKENDS or name == "linattn_softmax":
        raise ValueError("%s: the model was never linearized (its attention is %r); call linattn.hf.linearize(model, "
                         "...) and attention_transfer first" % (fn, name))
    if teacher is model or not isinstance(teacher, _torch.nn.Module):
        raise ValueError("%s: teacher must be the original model, a separate torch module" % fn)
    _check_training(fn, texts, steps=steps, batch_size=batch_size, max_length=max_length, lora_rank=lora_rank, lr=lr)
    if isinstance(train, str) or not all(isinstance(t, str) for t in train):
        raise ValueError("%s: train must be a list of parameter-name parts, got %r" % (fn, train))
    try:
        import peft
    except ImportError:
        peft = None
    if lora is None:
        lora = peft is not None
    if lora and peft is None:
        raise ValueError("%s: lora=True needs peft (pip install peft, or linattn[lora]); or pass lora=False and name "
                         "the parameters to train with train=[...]" % fn)
    modules = attention_modules(model)
    if target_modules is None:
        inside = {id(m) for a in modules for m in a.modules() if isinstance(m, _torch.nn.Linear)}
        target_modules = [n for n, m in model.named_modules() if id(m) in inside]
    flags = [p.requires_grad for p in model.parameters()]
    named = dict(model.named_parameters())
    chosen = [n for n in named if any(t in n for t in train)]
    missing = [t for t in train if not any(t in n for n in named)]
    if missing:
        raise ValueError("%s: no parameter name contains %s" % (fn, ", ".join(map(repr, missing))))
    snapshot = {n: p.detach().clone() for n, p in named.items() if n in chosen or p.requires_grad}
    injected = False
    was_training, side = model.training, getattr(tokenizer, "padding_side", "right")
    try:
        if lora:
            if not target_modules:
                raise ValueError("%s: target_modules is empty: no Linear module to adapt" % fn)
            peft.inject_adapter_in_model(peft.LoraConfig(r=int(lora_rank), lora_alpha=lora_alpha, lora_dropout=0.0,
                                                         target_modules=list(target_modules), bias="none"), model)
            injected = True
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n or n in chosen)
        for p in learned_parameters(model):
            p.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = _torch.optim.Adam(params, lr=lr)
        device = next(model.parameters()).device
        losses = []
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, desc="distillation", disable=not progress)
        model.eval()
        teacher.eval()
        tokenizer.padding_side = "right"
        with _torch.enable_grad():
            for batch in _batches(tokenizer, texts, steps, batch_size, max_length, seed, device):
                with _torch.no_grad():
                    target = teacher(**batch)
                out = model(**batch)
                valid = batch["attention_mask"].bool()
                if getattr(out, "logits", None) is not None:
                    loss = _torch.nn.functional.kl_div(_torch.log_softmax(out.logits[valid].float(), -1),
                                                       _torch.log_softmax(target.logits[valid].float(), -1),
                                                       log_target=True, reduction="batchmean")
                else:
                    h, t = out.last_hidden_state[valid], target.last_hidden_state[valid]
                    loss = (h - t).pow(2).mean() / t.pow(2).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
                bar.update(1)
                bar.set_postfix(loss="%.3g" % losses[-1])
        bar.close()
        if injected:
            _merge_lora(model, merge=True)
    except BaseException:
        if injected:
            _merge_lora(model, merge=False)
        with _torch.no_grad():
            for n, p in model.named_parameters():
                if n in snapshot:
                    p.copy_(snapshot[n])
        raise
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
    return losses


def _merge_lora(model, merge):
    """Replaces every peft LoRA layer of the model by its base layer: with the adapter merged
    into the weights (merge=True), or dropped (a failed fine-tune)."""
    from peft.tuners.lora import LoraLayer
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            if merge:
                module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())


# ---- masks -------------------------------------------------------------------------------------

def _key_lengths(name, mask, batch, n_q, n_k, causal):
    """The model's attention mask -> key_lengths [batch] (None: nothing masked). Accepted: boolean
    (True = attend) or additive float (0 = attend, -inf or the dtype's minimum = masked) masks of
    shape [batch or 1, heads or 1, n_q, >= n_k] that keep a prefix of the keys in every row,
    intersected with the causal pattern (bottom-right aligned) when causal."""
    if mask is None:
        return None
    if not isinstance(mask, _torch.Tensor) or mask.dim() != 4:
        raise ValueError("%s: expected a 4-D attention mask [batch, heads, n_q, n_k], got %r"
                         % (name, getattr(mask, "shape", type(mask))))
    mask = mask[..., :n_k]
    if mask.dtype == _torch.bool:
        keep = mask
    elif mask.dtype.is_floating_point:
        keep = mask == 0
        dropped = mask[~keep]
        if dropped.numel() and not bool((dropped <= _torch.finfo(mask.dtype).min / 2).all()):
            raise ValueError("%s: the attention mask adds a bias (values other than 0 and -inf); linattn applies "
                             "only key-padding (and causal) masks" % name)
    else:
        raise ValueError("%s: attention mask of dtype %s; expected bool or floating" % (name, mask.dtype))
    if mask.shape[2] not in (1, n_q) or mask.shape[0] not in (1, batch):
        raise ValueError("%s: attention mask of shape %s for %d queries and batch %d"
                         % (name, tuple(mask.shape), n_q, batch))
    keep = keep.expand(batch, keep.shape[1], n_q, n_k)
    lengths = keep[:, 0, -1, :].sum(dim=-1)  # the last query sees every valid key, causal or not
    positions = _torch.arange(n_k, device=keep.device)
    want = (positions[None, :] < lengths[:, None])[:, None, None, :]
    if causal:
        rows = _torch.arange(n_q, device=keep.device)[:, None] + (n_k - n_q)
        want = want & (positions[None, :] <= rows)[None, None]
    if not _torch.equal(keep, want.expand_as(keep)):
        raise ValueError("%s: the attention mask is not %s key-padding mask with the padding at the end of each "
                         "sequence (left padding, packed sequences, sliding windows and custom masks cannot be "
                         "expressed as key_lengths); pad on the right" % (name, "a causal" if causal else "a"))
    if bool((lengths == n_k).all()):
        return None
    return lengths.to(_torch.int64)
