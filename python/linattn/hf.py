"""linattn.hf: linattn's methods as Hugging Face transformers attention backends.

    import linattn.hf
    linattn.hf.register()
    model = AutoModel.from_pretrained(path, attn_implementation="linattn_favor")
    linattn.hf.set_options(model, num_features=128)      # optional; before building an optimizer

Every model whose attention goes through transformers' AttentionInterface (BERT and MiniLM,
Llama, Qwen, GPT-2, ...) then runs its attention on linattn's kernels, forward and backward
(through linattn.torch). The names are BACKENDS' keys: linattn_softmax (exact), linattn_elu,
linattn_relu, linattn_focused (kernelized), linattn_favor (Performer), linattn_nystrom,
linattn_linformer, linattn_efficient.

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
    "linattn_elu": ("linear_attention", {"feature_map": "elu"}, {"eps": 1e-6}),
    "linattn_relu": ("linear_attention", {"feature_map": "relu"}, {"eps": 1e-6}),
    "linattn_focused": ("linear_attention", {"feature_map": "focused"},
                        {"eps": 1e-6, "focus_power": 3.0, "dwc_kernel_size": None}),
    "linattn_favor": ("favor_attention", {}, {"num_features": 256, "features": "orthogonal", "kernel": "positive",
                                              "seed": 0}),
    "linattn_nystrom": ("nystrom_attention", {}, {"num_landmarks": 64, "pinv_iterations": 6, "pinv": "iterative",
                                                  "conv_kernel_size": None}),
    "linattn_linformer": ("linformer_attention", {}, {"s_proj": 256, "max_seq_len": None, "init": "pool"}),
    "linattn_efficient": ("efficient_attention", {}, {}),
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
        if mask_causal and n_q != n_k and function != "softmax_attention":
            raise ValueError("%s: %d queries against %d cached keys; causal %s needs as many queries as keys "
                             "(decode one token at a time, or use linattn_softmax)" % (name, n_q, n_k, function))
        options = dict(fixed)
        config = getattr(module, "config", None)
        user = options_of(config, name)
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
        out = op(query, key, value, key_lengths=key_lengths, **options)
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
    if "init" in o and o["init"] not in ("pool", "random"):
        raise ValueError("linattn.hf: init must be 'pool' or 'random', got %r" % (o["init"],))
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
                    [a for a in vars(m)["_buffers"] if a.startswith(_PREFIX)]:
            delattr(m, attr)  # options changed: what was attached for the old ones goes
        anchor = next(m.parameters())
        if function == "favor_attention":
            _projection(m, anchor, user)
        elif function == "linformer_attention" or user.get("dwc_kernel_size") or user.get("conv_kernel_size"):
            _learned(m, name, anchor, user, create=True)
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
