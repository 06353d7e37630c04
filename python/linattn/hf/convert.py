"""Converting a pretrained softmax model to linear attention (docs/linearize.md): linearize()
switches every attention layer to a linattn backend with learned feature maps and freezes the
rest; attention_transfer() (stage 1) fits each layer's maps to the softmax output of the same
layer on the same q, k, v; finetune() (stage 2, optional) distils the whole model against the
original, with LoRA through peft; from_pretrained() loads a converted model with its maps."""

import warnings as _warnings

import numpy as _np
import torch as _torch

from .. import _options
from .. import torch as _lt
from .backends import (BACKENDS, PREFIX, _decay_option, attention_modules, create_learned, learned_parameters)  # noqa: F401
from .registration import register

# linearize's feature_map -> the backend it switches to. "window": the window alone (exact softmax
# over the window, nothing beyond; backend linattn_window), the baseline that shows what the
# linear part earns.
_CONVERSIONS = {"elu": "linattn_elu", "relu": "linattn_relu", "favor": "linattn_favor", "window": "linattn_window"}


def _conversions():
    """linearize's feature maps -> backends: the learned maps (hedgehog, and any registered with
    linattn.torch.register_feature_map; backend "linattn_" + name), then the fixed ones."""
    return {**{name: PREFIX + name for name in _lt.learned_feature_maps()}, **_CONVERSIONS}
# Spellings before 0.2 (issue 43, one name per thing), accepted until the next release with a
# DeprecationWarning: the window alone was feature_map "none"; FAVOR's count of random features
# was feature_dim, which is Hedgehog's f everywhere else (FAVOR's m is num_features, as in
# MultiheadAttention and the linattn_favor backend).
_FORMER_CONVERSIONS = {"none": "window"}
_FAVOR_FEATURES = 32  # the default of num_features (favor)


def linearize(model, feature_map="hedgehog", window=0, feature_dim=None, init=None, sinks=0, decay=None,
              num_features=None, **map_options):
    """Switches every attention layer of a transformers model to linear attention with learned
    feature maps, adds their parameters, and freezes everything else: the first step of
    converting a pretrained softmax model (then attention_transfer).

    feature_map: "hedgehog" (HedgehogFeatureMap per layer, for queries and keys; backend
    linattn_hedgehog), "elu", "relu" or "favor" (fixed maps; only the window gate is learned;
    favor: FAVOR+ positive random features, num_features of them, which estimate e^{q·k} beyond an
    unshifted exact window), or "window" (backend linattn_window; window > 0 required: exact
    softmax inside the window and nothing beyond, the baseline; "none" before 0.2).
    window: 0, plain linear attention; w > 0, the sliding-window hybrid: exact softmax over the
    last w keys (causal models; |i - j| <= w in encoders) with the map beyond it and one
    normaliser, and a learned gate g per head (γ = sigmoid(g) scales the window; g = 0 at first).
    sinks: s > 0 (causal models, window >= 1): the first s tokens join every query's exact window
    (StreamingLLM's attention sinks; LLMs put much of their attention on them), in training,
    prefill and LinattnCache alike.
    decay: None, "retnet" (per-head γ_h = 1 − 2^(−5−10h/(H−1)), half-lives of ~22 to ~10k tokens)
    or a log-decay λ <= 0 for every head (causal models, window >= 1): the linear part's key j
    weighs e^{λ(i − j)} in row i, so its share stops growing with the position.
    A learned map registered with linattn.torch.register_feature_map is taken by its name as
    hedgehog is, its own options as keyword arguments (map_options; hedgehog's is feature_dim).
    feature_dim: hedgehog's f, m' = 2f features per head (None: 32); unused by the other maps.
    num_features: favor's m random features (None: 32); another map with it is an error. (Before
    0.2 favor's m was given as feature_dim: accepted until the next release, with a
    DeprecationWarning.) init: a learned map's start (None: its first, hedgehog's "identity":
    W = the identity's first f columns, b = 0; or "random"). The model's other parameters get
    requires_grad=False; the new ones get True. Raises ValueError before changing anything when
    an argument is wrong or the model has no attention module that linattn can drive; a failure
    midway restores the model. Returns the model."""
    fn = "linattn.hf.linearize"
    feature_map = _options.renamed(fn, {"feature_map": feature_map}, {},
                                   former_values={"feature_map": _FORMER_CONVERSIONS})["feature_map"]
    if feature_map == "favor" and feature_dim is not None:
        if num_features is not None:
            raise TypeError("%s: got num_features and feature_dim, its former name for feature_map='favor'; pass "
                            "num_features only" % fn)
        _warnings.warn("%s: feature_map='favor' takes its count of random features as num_features now (feature_dim "
                       "is Hedgehog's f); feature_dim is accepted for it until the next release" % fn,
                       DeprecationWarning, stacklevel=2)
        num_features, feature_dim = feature_dim, None
    conversions = _conversions()
    if not isinstance(feature_map, str) or feature_map not in conversions:
        raise ValueError("%s: feature_map must be one of %s, got %r" % (fn, ", ".join(map(repr, conversions)),
                                                                       feature_map))
    learned = _lt.learned_feature_maps().get(feature_map)  # the learned map's class, or None
    if num_features is not None and feature_map != "favor":
        raise ValueError("%s: num_features is FAVOR's count of random features: an option of feature_map='favor' "
                         "only, got feature_map=%r" % (fn, feature_map))
    window = _options.integer(fn, "window", window, 0)
    if feature_map == "window" and window < 1:
        raise ValueError("%s: feature_map='window' keeps only the window, so window must be >= 1, got %r"
                         % (fn, window))
    sinks = _options.integer(fn, "sinks", sinks, 0)
    decay = _decay_option(fn, "decay", decay)
    if decay is not None and window < 1:
        raise ValueError("%s: decay=%r needs window >= 1: it decays the linear part of the sliding-window hybrid"
                         % (fn, decay))
    if sinks and window < 1:
        raise ValueError("%s: sinks=%d needs window >= 1: the sink tokens join the window's exact softmax"
                         % (fn, sinks))
    num_features = _options.integer(fn, "num_features", _FAVOR_FEATURES if num_features is None else num_features, 1)
    if feature_dim is not None:  # hedgehog's option, by name (a map of its own may have one too)
        map_options["feature_dim"] = feature_dim
    if learned is None:
        if "feature_dim" in map_options:  # checked, unused by the fixed maps (as before)
            _options.integer(fn, "feature_dim", map_options.pop("feature_dim"), 1)
        if map_options:
            raise TypeError("%s: feature_map=%r takes no option %s" % (fn, feature_map, ", ".join(sorted(map_options))))
        if init is not None:
            _options.choice(fn, "init", init, ("identity", "random"))  # checked, unused (as before)
    else:
        unknown = sorted(set(map_options) - set(learned.options))
        if unknown:
            raise TypeError("%s: feature_map=%r takes no option %s (its options: %s)"
                            % (fn, feature_map, ", ".join(unknown), ", ".join(sorted(learned.options)) or "none"))
        map_options = learned.check_options(fn, {**learned.options, **map_options})
        init = _options.choice(fn, "init", learned.inits[0] if init is None else init, learned.inits)
    modules = attention_modules(model)
    if not modules:
        raise ValueError("%s: found no attention module (a module with config, is_causal and layer_idx attributes) "
                         "in %s" % (fn, type(model).__name__))
    causal = all(getattr(m, "is_causal", False) for m in modules)
    if sinks and not causal:
        raise ValueError("%s: sinks=%d needs a causal model: attention sinks are the first tokens of a causal "
                         "sequence" % (fn, sinks))
    if decay is not None and not causal:
        raise ValueError("%s: decay=%r needs a causal model: the decay runs along the sequence" % (fn, decay))
    name = conversions[feature_map]
    saved = {"implementation": model.config._attn_implementation,
             "options": getattr(model.config, "linattn_options", None),
             "backend": getattr(model.config, "linattn_backend", None),
             "requires_grad": [p.requires_grad for p in model.parameters()]}
    created = []
    try:
        register()
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise ValueError("%s: %s does not let its attention implementation be changed (it does not call "
                             "transformers' AttentionInterface)" % (fn, type(model).__name__))
        for p in model.parameters():
            p.requires_grad_(False)
        options = {"window": window}
        if sinks:
            options["sinks"] = sinks
        if decay is not None:
            options["decay"] = decay
        if learned is not None:
            options.update(map_options, init=init)
        elif feature_map == "favor":
            options.update(num_features=num_features)
        created = create_learned(model, options)
        for p in learned_parameters(model):
            p.requires_grad_(True)
    except BaseException:
        for m, attr in created:  # what this call made; tensors the model had before stay
            delattr(m, attr)
        if model.config._attn_implementation != saved["implementation"]:
            model.set_attn_implementation(saved["implementation"])
        model.config.linattn_options = saved["options"]
        if saved["backend"] is None:
            model.config.__dict__.pop("linattn_backend", None)
        else:
            model.config.linattn_backend = saved["backend"]
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
    if name is not None and name not in BACKENDS:
        raise ValueError("%s: %s was converted to backend %r, which this process does not know; a learned map of "
                         "your own must be registered first (linattn.torch.register_feature_map)" % (fn, path, name))
    if name not in BACKENDS:
        raise ValueError("%s: %s holds no linattn conversion (its config has no linattn_backend); load it with "
                         "%s.from_pretrained" % (fn, path, getattr(model_class, "__name__", "the model class")))
    asked = kwargs.pop("attn_implementation", name)
    if asked != name:
        raise ValueError("%s: attn_implementation=%r, but %s was converted to %s and its learned tensors are that "
                         "backend's; load it without attn_implementation (then model.set_attn_implementation to "
                         "compare)" % (fn, asked, path, name))
    register()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the learned tensors are "unused weights" to transformers; loaded below
    try:
        model = model_class.from_pretrained(path, attn_implementation=name, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.linattn_backend = name
    create_learned(model, dict(getattr(config, "linattn_options", None) or {}))
    wanted = {k for k in model.state_dict() if (".%s" % PREFIX) in k}
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


def attention_transfer(model, tokenizer, texts, steps=300, lr=1e-2, batch_size=8, max_length=None, seed=0,
                       progress=True):
    """Stage 1 of a conversion (LoLCATs' attention transfer): trains only the parameters that
    linearize() added, so that each layer's linear-attention output matches the softmax output
    the same layer computes on the same q, k, v in the same forward pass (teacher forcing: the
    softmax output goes on to the next layer, so every layer learns from the original model's
    activations, and no second copy of the model is needed).

    texts: a list of strings, cycled through in a shuffled order (seed); each step tokenizes
    batch_size of them (right padding, truncated to max_length) and takes one Adam step (lr)
    on the sum over layers of the mean squared error over valid queries. max_length: None (the
    default) trains at the longest length the texts and the model allow: each batch is as long
    as its longest text, up to the model's max_position_embeddings (and the tokenizer's
    model_max_length); long texts teach the maps the sums they meet at long context. The model runs in
    eval mode (no dropout) with gradients on, and is left in the mode it was in. progress:
    a tqdm bar. Returns the per-layer losses: losses[layer][step]."""
    fn = "linattn.hf.attention_transfer"
    name = getattr(model.config, "_attn_implementation", None)
    if name not in BACKENDS or name == "linattn_softmax":
        raise ValueError("%s: the model was never linearized (its attention is %r); call linattn.hf.linearize(model, "
                         "...) first" % (fn, name))
    params = learned_parameters(model)
    if not params:
        raise ValueError("%s: the model's backend %s with options %r learns nothing (no feature map, window gate or "
                         "convolution), so there is nothing to train; linearize with feature_map='hedgehog', or with "
                         "window > 0 for a learned gate" % (fn, name, getattr(model.config, "linattn_options", None)))
    steps, batch_size, lr = _check_training(fn, texts, steps=steps, batch_size=batch_size, lr=lr)
    max_length = _training_length(fn, model, tokenizer, max_length)
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
    """The counts (steps, batch_size, ...; integers >= 1, in the order given) and lr (a finite
    number > 0) as plain Python numbers, NumPy scalars included; texts a non-empty list of
    strings. ValueError naming fn and the argument otherwise."""
    values = [_options.integer(fn, arg, value, 1) for arg, value in counts.items()]
    values.append(_options.real(fn, "lr", lr, above=0.0))
    _check_texts(fn, "texts", texts)
    return values


def _check_texts(fn, arg, texts):
    if isinstance(texts, str) or not len(texts) or not all(isinstance(t, str) for t in texts):
        raise ValueError("%s: %s must be a non-empty list of strings" % (fn, arg))


def _training_length(fn, model, tokenizer, max_length):
    """max_length as an integer >= 1; None: the longest the model allows (its config's
    max_position_embeddings, and the tokenizer's model_max_length when that is a real limit)."""
    if max_length is not None:
        return _options.integer(fn, "max_length", max_length, 1)
    limits = [getattr(model.config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    limits = [int(n) for n in limits if isinstance(n, int) and 0 < n < 10 ** 7]  # transformers' "no limit" is ~1e30
    if not limits:
        raise ValueError("%s: max_length=None takes the model's max_position_embeddings, which neither its config "
                         "nor the tokenizer gives; pass max_length" % fn)
    return min(limits)


def _distillation(out, target, valid):
    """Stage 2's loss of the model's outputs `out` against the teacher's `target` over the valid
    tokens: KL(teacher ‖ model) of the next-token distributions (causal LMs), or the squared
    error of the last hidden states relative to the teacher's mean square (encoders)."""
    if getattr(out, "logits", None) is not None:
        return _torch.nn.functional.kl_div(_torch.log_softmax(out.logits[valid].float(), -1),
                                           _torch.log_softmax(target.logits[valid].float(), -1),
                                           log_target=True, reduction="batchmean")
    h, t = out.last_hidden_state[valid], target.last_hidden_state[valid]
    return (h - t).pow(2).mean() / t.pow(2).mean()


def distillation_loss(model, teacher, tokenizer, texts, batch_size=8, max_length=None):
    """The distillation loss that finetune() minimises, of `model` against `teacher` on `texts`
    (each text once, in order, batch_size at a time, right padding, truncated to max_length as in
    finetune), averaged over the texts' valid tokens. Both models run in eval mode and are left in
    their modes. The measure finetune uses to keep the better of stages 1 and 2."""
    fn = "linattn.hf.distillation_loss"
    batch_size = _options.integer(fn, "batch_size", batch_size, 1)
    _check_texts(fn, "texts", texts)
    max_length = _training_length(fn, model, tokenizer, max_length)
    return _held_out_loss(model, teacher, tokenizer, texts, batch_size, max_length)


def _held_out_loss(model, teacher, tokenizer, texts, batch_size, max_length):
    """distillation_loss on checked arguments (finetune's measure before and after)."""
    device = next(model.parameters()).device
    modes, side = (model.training, teacher.training), getattr(tokenizer, "padding_side", "right")
    total, tokens = 0.0, 0
    try:
        model.eval()
        teacher.eval()
        tokenizer.padding_side = "right"
        with _torch.no_grad():
            for i in range(0, len(texts), batch_size):
                batch = _tokenized(tokenizer, list(texts[i:i + batch_size]), max_length, device)
                valid = batch["attention_mask"].bool()
                count = int(valid.sum())
                total += float(_distillation(model(**batch), teacher(**batch), valid)) * count
                tokens += count
    finally:
        tokenizer.padding_side = side
        model.train(modes[0])
        teacher.train(modes[1])
    return total / max(tokens, 1)


def _batches(tokenizer, texts, steps, batch_size, max_length, seed, device):
    """`steps` batches of batch_size texts, a shuffled cycle through `texts` (seed), tokenized
    with padding (the caller sets its side) and truncation to max_length, on `device`."""
    order = _np.random.default_rng(seed).permutation(len(texts))
    for step in range(steps):
        pick = [texts[order[(step * batch_size + i) % len(texts)]] for i in range(batch_size)]
        yield _tokenized(tokenizer, pick, max_length, device)


def _tokenized(tokenizer, texts, max_length, device):
    """One batch of texts, padded (the caller sets the side) and truncated to max_length, on device."""
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {k: v.to(device) for k, v in batch.items()}


def finetune(model, teacher, tokenizer, texts, steps=100, lr=1e-4, batch_size=8, max_length=None, lora=None,
             lora_rank=8, lora_alpha=16, target_modules=None, train=(), seed=0, progress=True, held_out=None):
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
    and is left in its mode; on failure it is restored as it was. max_length: None (the default),
    the longest the texts and the model allow, as in attention_transfer.

    Stage 2 never leaves the model worse than it found it: the distillation loss on `held_out`
    texts (distillation_loss) is measured before and after, and when it did not go down, every
    parameter is put back as it was (a UserWarning says so). held_out: None (the default) holds
    out the last of `texts` and every tenth before it, which are then not trained on (a single
    text is both trained and measured on); or a non-empty list of strings. Returns the training
    losses, one per step."""
    fn = "linattn.hf.finetune"
    name = getattr(model.config, "_attn_implementation", None)
    if name not in BACKENDS or name == "linattn_softmax":
        raise ValueError("%s: the model was never linearized (its attention is %r); call linattn.hf.linearize(model, "
                         "...) and attention_transfer first" % (fn, name))
    if teacher is model or not isinstance(teacher, _torch.nn.Module):
        raise ValueError("%s: teacher must be the original model, a separate torch module" % fn)
    steps, batch_size, lora_rank, lr = _check_training(fn, texts, steps=steps, batch_size=batch_size,
                                                       lora_rank=lora_rank, lr=lr)
    max_length = _training_length(fn, model, tokenizer, max_length)
    if held_out is None:
        kept = set(range(len(texts) - 1, -1, -10)) if len(texts) > 1 else set()  # the last, and every tenth before
        held_out = [texts[i] for i in sorted(kept)] or list(texts)
        texts = [t for i, t in enumerate(texts) if i not in kept]
    else:
        _check_texts(fn, "held_out", held_out)
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
    learned = {id(p) for p in learned_parameters(model)}
    snapshot = {n: p.detach().clone() for n, p in named.items() if n in chosen or p.requires_grad or id(p) in learned}
    injected = False
    was_training, side = model.training, getattr(tokenizer, "padding_side", "right")
    try:
        if lora:
            if not target_modules:
                raise ValueError("%s: target_modules is empty: no Linear module to adapt" % fn)
            peft.inject_adapter_in_model(peft.LoraConfig(r=int(lora_rank), lora_alpha=lora_alpha, lora_dropout=0.0,
                                                         target_modules=list(target_modules), bias="none"), model)
            injected = True
            for n, p in model.named_parameters():  # the weights LoRA will merge into, under their own names
                if ".base_layer." in n:
                    snapshot.setdefault(n.replace(".base_layer.", "."), p.detach().clone())
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n or n in chosen)
        for p in learned_parameters(model):
            p.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = _torch.optim.Adam(params, lr=lr)
        device = next(model.parameters()).device
        losses = []
        before = _held_out_loss(model, teacher, tokenizer, held_out, batch_size, max_length)
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
                loss = _distillation(out, target, batch["attention_mask"].bool())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
                bar.update(1)
                bar.set_postfix(loss="%.3g" % losses[-1])
        bar.close()
        if injected:
            _merge_lora(model, merge=True)
            injected = False
        after = _held_out_loss(model, teacher, tokenizer, held_out, batch_size, max_length)
        if not after < before:
            _restore(model, snapshot)
            _warnings.warn("%s: stage 2 raised the held-out distillation loss (%.4g -> %.4g), so the model is put back "
                          "as it was before finetune" % (fn, before, after), UserWarning, stacklevel=2)
    except BaseException:
        if injected:
            _merge_lora(model, merge=False)
        _restore(model, snapshot)
        raise
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
    return losses


@_torch.no_grad()
def _restore(model, snapshot):
    for n, p in model.named_parameters():
        if n in snapshot:
            p.copy_(snapshot[n])


def _merge_lora(model, merge):
    """Replaces every peft LoRA layer of the model by its base layer: with the adapter merged
    into the weights (merge=True), or dropped (a failed fine-tune); and drops the peft_config
    that peft's injection leaves on the model (a second finetune would warn of two adapters)."""
    from peft.tuners.lora import LoraLayer
    model.__dict__.pop("peft_config", None)
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            if merge:
                module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
