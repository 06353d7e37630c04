"""linattn.hf: linattn's methods as Hugging Face transformers attention backends.

    import linattn.hf
    linattn.hf.register()
    model = AutoModel.from_pretrained(path, attn_implementation="linattn_favor")
    linattn.hf.set_options(model, num_features=128)      # before the first forward and the optimizer

Every model whose attention goes through transformers' AttentionInterface (BERT and MiniLM,
Llama, Qwen, GPT-2, ...) then runs its attention on linattn's kernels, forward and backward
(through linattn.torch). The names are BACKENDS' keys: linattn_softmax (exact), linattn_elu,
linattn_relu, linattn_focused (kernelized), linattn_favor (Performer), linattn_nystrom,
linattn_linformer, linattn_efficient, linattn_hedgehog (learned feature maps, below),
linattn_window (exact softmax within a sliding window, nothing beyond: a baseline), and
linattn_<name> for each learned map registered with linattn.torch.register_feature_map.

Converting a pretrained model (docs/linearize.md):

    linattn.hf.linearize(model, feature_map="hedgehog", feature_dim=32)   # maps added, the rest frozen
    losses = linattn.hf.attention_transfer(model, tokenizer, texts, steps=300)  # stage 1
    model.save_pretrained(path)
    model = linattn.hf.from_pretrained(transformers.AutoModel, path)        # maps included

Masks: the model's padding mask becomes linattn's key_lengths, so padding must be at the end of
each sequence (right padding, what encoders use). A mask that is not "a prefix of the keys"
(left padding, packed sequences, sliding windows, additive biases such as ALiBi) raises
ValueError: linattn cannot apply it, and attending to the wrong keys silently is worse.
Key slots that every query masks at the end (a StaticCache's empty slots) are dropped first.
Causal models (module.is_causal) use the causal forms: the kernelized methods and softmax;
Nyström, Linformer and Efficient Attention have none and raise ValueError.

Generation: on the kernelized and hybrid backends (cache.CACHED_BACKENDS), generate() uses
LinattnCache (linattn.hf.cache): per layer a constant-size recurrent state plus the window's
last keys, the prompt through the chunked causal kernel, O(1) per new token; register()
installs that default, and LinattnCache(model) can be passed as past_key_values. Prompts of
different lengths, left- or right-padded, give each row the tokens it gets alone. With
transformers' DynamicCache (linattn_softmax, or one the caller passes), one new query attends
to every cached key (no mask needed); a chunk of several new queries over a longer cache works
for softmax (bottom-right aligned) and raises for the others.

Options live in the model config as the dict `config.linattn_options` (saved with the model);
set_options(model, **options) updates them (options not named keep their value), checks and
normalises them against the model's backend before anything is written, stores them and
creates the learned tensors they need (Linformer's e and f, depthwise convolutions, Hedgehog's
maps, window gates) as parameters of each attention module, so an optimizer built afterwards
trains them. Learned tensors are made there only: a forward never creates or replaces one (it
raises ValueError naming the call to make, and casts a tensor whose dtype differs from the
activations', under autocast say); set_options refuses options that would need an existing
one in another shape; remove_learned(model) takes them off when starting over is meant. A
config with linattn options is written atomically (temporary file, then rename). Per backend:
  linattn_favor: num_features (256), features ("orthogonal"; linattn.random_features' kinds:
    "iid", "orthogonal_fixed", "quantile"), kernel ("positive"; "hyperbolic", "trig"), seed (0).
    Layer l uses projection seed + l: fixed, reproducible constants (buffers, not parameters).
  linattn_elu / linattn_relu: eps. linattn_focused: focus_power (3.0), eps, conv_kernel_size
    (None; a learned depthwise convolution of v, initialised to zero so a pretrained model's
    output is unchanged until it is trained).
  linattn_nystrom: num_landmarks (64), pinv_iterations (6), pinv ("iterative"),
    conv_kernel_size (None; as linattn_focused's).
  conv_kernel_size was dwc_kernel_size for linattn_focused before; the old name (in calls and in
  saved configs) is accepted until the next release, with a DeprecationWarning.
  linattn_linformer: s_proj (256), max_seq_len (config.max_position_embeddings), init ("pool":
    e and f average s_proj equal segments of the max_seq_len positions, so an untrained model
    sees segment means of its keys and values; "random": linattn.linformer_projections).
  linattn_hedgehog: feature_dim (32; m' = 2·feature_dim features per head), init ("identity"
    or "random"): HedgehogFeatureMap submodules for queries and keys in every attention module;
    window (0), eps (1e-6). A registered map's backend takes its own options, its inits, and
    the same window, sinks, decay and eps.
  linattn_elu, linattn_relu, linattn_hedgehog, linattn_favor: window (0; w > 0: the
    sliding-window hybrid, linattn.torch.hybrid_attention, with a learned gate
    linattn_window_gate [heads]; favor: kernel positive or hyperbolic, eps 0).
  linattn_window: window (64, >= 1).
  linattn_softmax, linattn_efficient: none.
The model's own scaling (1/sqrt(head_dim) for BERT) is passed as `scale` to every method that
takes one; the linear maps (elu, relu, focused) have no scale.

Attention dropout: the linear methods never form attention weights to drop, and softmax here
has no dropout; a model in training mode with attention dropout > 0 raises ValueError (set
config.attention_probs_dropout_prob / attention_dropout to 0) instead of training without it.
Attention weights are not returned (output_attentions gives None).

The package: registration.py (register()), backends.py (BACKENDS, one Backend object per name, the
attention function, options), masks.py (attention masks -> key_lengths), convert.py (linearize, attention_transfer,
finetune, distillation_loss, from_pretrained), cache.py (LinattnCache, generation in constant memory)."""

from .backends import (BACKENDS, Backend, attention_function, attention_modules, options_of,  # noqa: F401
                       remove_learned, set_options)
from .registration import register  # noqa: F401
from .convert import (attention_transfer, distillation_loss, finetune, from_pretrained, learned_parameters,  # noqa: F401
                      linearize)
from . import backends, convert, masks  # noqa: F401


def __getattr__(attr):
    # linattn.hf.LinattnCache / linattn.hf.cache import transformers, which linattn.hf itself
    # does not need until register(): loaded on first use.
    if attr in ("LinattnCache", "cache"):
        import importlib
        # import_module, not `from . import cache`: that asks this module for the attribute
        # first, which would come back here.
        cache = importlib.import_module(__name__ + ".cache")
        return cache if attr == "cache" else cache.LinattnCache
    raise AttributeError("module 'linattn.hf' has no attribute %r" % attr)


__all__ = ["BACKENDS", "LinattnCache", "Backend", "attention_function", "attention_modules", "attention_transfer",
           "distillation_loss", "finetune", "from_pretrained", "learned_parameters", "linearize", "options_of", "register", "remove_learned", "set_options"]
