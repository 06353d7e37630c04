"""LinattnCache: a transformers Cache that generates in constant memory on linattn's kernelized
and hybrid backends (linattn_elu, linattn_relu, linattn_focused, linattn_favor,
linattn_hedgehog, linattn_window, with or without a window).

Per layer it keeps the linear state of linattn.torch.recurrent ([S | z] over the keys that have
left the window, FAVOR's on its per-feature scale), the last `window` keys and values (exact
softmax over them), and for a depthwise convolution the last K − 1 values: its size does not
grow with the context. The first forward (the prompt) runs the backend's own causal kernel, the
chunked one a forward without cache runs, and its keys and values then fill the state with
one product; each later token costs O(1) in the context length.

How it reaches the attention function: a transformers attention layer calls
cache.update(key, value, layer_idx) and passes what it returns to the attention function.
update() returns the new keys as they are and leaves a note (thread-local) naming the layer;
linattn's attention function takes the note, checks that the keys it got are the very tensor
the cache returned, and runs attend() below. A model that is not on a linattn backend, or that
changes the keys between the two calls, gets a ValueError instead of attention over the new
tokens alone."""

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerationMixin

from ..torch import recurrent as _recurrent
from ..torch._ops import accumulator_dtype
from . import backends as _backends
from . import masks as _masks

__all__ = ["LinattnCache", "CACHED_BACKENDS", "supports"]

# The backends with a causal recurrent form (the others: softmax keeps transformers' caches;
# Nyström, Linformer and Efficient Attention have no causal form).
CACHED_BACKENDS = ("linattn_elu", "linattn_relu", "linattn_focused", "linattn_favor", "linattn_hedgehog",
                   "linattn_window")

def supports(name):
    return name in CACHED_BACKENDS


def _model_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    text = getattr(config, "get_text_config", None)
    return text(decoder=True) if text is not None else config


class LinattnCacheLayer(CacheLayerMixin):
    """One decoder layer's recurrent state: `linear` (a linattn.torch.recurrent.LinearState or
    None before the prompt), `window_keys` / `window_values` [B, H, <= w, d] (the keys inside the
    sliding window, newest last), `conv_values` [B, H, K − 1, d_v] (a depthwise convolution's
    past values) and `tokens`, the tokens seen."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.reset()

    def reset(self):
        self.tokens = 0
        self.linear = None
        self.window_keys = self.window_values = self.conv_values = None
        self.is_initialized = False

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("LinattnCacheLayer.update: use LinattnCache.update")  # the cache notes the layer

    def get_mask_sizes(self, query_length):
        return self.tokens + query_length, 0  # the masks a full forward would build

    def get_seq_length(self):
        return self.tokens

    def get_max_length(self):
        return -1  # no maximum: the state does not grow

    def offload(self):
        pass  # constant size: nothing worth moving

    def prefetch(self):
        pass

    def _map(self, fn):
        if self.linear is not None:
            self.linear = self.linear.map(fn)
        for attr in ("window_keys", "window_values", "conv_values"):
            t = getattr(self, attr)
            if t is not None:
                setattr(self, attr, fn(t))

    def reorder_cache(self, beam_idx):
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self._map(lambda t: t[indices])

    def crop(self, tokens_to_remove):
        if tokens_to_remove != 0:  # transformers passes a negative count: "keep all but these"
            raise ValueError("LinattnCache.crop: a recurrent state cannot forget tokens (it keeps sums, not the "
                             "tokens); assisted generation and other rollbacks need transformers' DynamicCache")

    @property
    def nbytes(self):
        n = 0 if self.linear is None else self.linear.nbytes
        return n + sum(t.numel() * t.element_size() for t in (self.window_keys, self.window_values, self.conv_values)
                       if t is not None)


class LinattnCache(Cache):
    """A constant-memory generation cache for a causal model on a linattn kernelized or hybrid
    backend (CACHED_BACKENDS). After linattn.hf.register(), model.generate() makes one by
    itself for such a model; LinattnCache(model) passed as past_key_values works too, as for
    any transformers Cache. nbytes is its size in bytes. reorder_cache, batch_repeat_interleave
    and batch_select_indices serve beam search; crop (assisted generation) raises ValueError.
    Prompts must not be padded (one prompt, or prompts of one length): a padded batch raises
    ValueError, as linattn's masks do for left padding."""

    def __init__(self, model):
        config = _model_config(model)
        name = getattr(config, "_attn_implementation", None)
        if not supports(name):
            raise ValueError("LinattnCache: the model runs attention implementation %r; the cache serves a model on "
                             "one of %s" % (name, ", ".join(CACHED_BACKENDS)))
        self.config = config
        super().__init__(layers=[LinattnCacheLayer(i) for i in range(config.num_hidden_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        name = getattr(self.config, "_attn_implementation", None)
        if not supports(name):
            raise ValueError("LinattnCache: the model now runs attention implementation %r; the cache serves a model "
                             "on one of %s" % (name, ", ".join(CACHED_BACKENDS)))
        pending = _backends.PENDING_CACHE
        stale = getattr(pending, "note", None)
        pending.note = None
        # A note of this cache from an earlier layer of the same forward: that layer's attention
        # never took it. (Another cache's note is what a forward that failed midway left; the
        # token counts below catch this cache's own.)
        if stale is not None and self.layers[stale[0].index] is stale[0] and stale[0].index < layer_idx:
            raise ValueError("LinattnCache: layer %d's keys never reached linattn's attention function (its attention "
                             "does not go through transformers' AttentionInterface)" % stale[0].index)
        # Every layer holds the same tokens between forwards; within one, the layers before this
        # one have taken the new tokens already. Otherwise a forward failed midway or a layer's
        # attention bypassed linattn: the states no longer describe one sequence.
        first, n = self.layers[0].tokens, key_states.shape[2]
        if layer_idx == 0:
            consistent = all(layer.tokens == first for layer in self.layers)
        else:
            consistent = self.layers[layer_idx].tokens == first - n
        if not consistent:
            raise ValueError("LinattnCache: its layers hold different numbers of tokens (%s): a forward with this cache "
                             "failed midway, or an attention layer bypassed linattn; start a new cache"
                             % [layer.tokens for layer in self.layers])
        layer = self.layers[layer_idx]
        layer.is_initialized = True
        pending.note = (layer, key_states)
        return key_states, value_states

    @property
    def nbytes(self):
        """Bytes held by the cache's tensors (states, windows, convolution rings)."""
        return sum(layer.nbytes for layer in self.layers)


# ---- the recurrent form of each backend ----------------------------------------------------------

def _focused(x, power):
    """‖r‖·rᵖ/‖rᵖ‖, r = relu(x): the focused map, computed as ‖r‖·uᵖ/‖uᵖ‖ with u = r/max(r)
    (the same value), so that uᵖ <= 1 cannot overflow and its largest entry, 1, keeps ‖uᵖ‖ >= 1
    at any focus_power (the C++ map scales by a power of two for the same reason)."""
    r = torch.relu(x)
    top = r.amax(dim=-1, keepdim=True)
    up = (r / torch.where(top > 0, top, 1)) ** power
    return up * (r.norm(dim=-1, keepdim=True) / up.norm(dim=-1, keepdim=True).clamp(min=1))


def _wide(t):
    """t in what a 16-bit model's decoding accumulates in (float32); other dtypes unchanged."""
    return t.to(accumulator_dtype(t.dtype))


class _Map:
    """A backend's feature map on torch tensors: plain features, or FAVOR's logits (log form)."""

    def __init__(self, module, b, user, like, scaling):
        self.b, self.user = b, user
        # The model's scaling: the window's scores and FAVOR's x̃ = √scale·x.
        self.scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(like.shape[-1])
        self.log_form = isinstance(b, _backends.Favor)
        if self.log_form:
            self.omega = _backends.projection(module, like, user)
            self.kernel = user["kernel"]
        elif isinstance(b, _backends.Hedgehog):
            self.maps = _backends.hedgehog_maps(module, like, user)

    def plain(self, x, side):
        b = self.b
        if isinstance(b, _backends.Hedgehog):
            return self.maps[0 if side == "query" else 1](x)
        if isinstance(b, _backends.Window):
            return x.new_zeros(x.shape[:-1] + (1,))
        kind = b.fixed["feature_map"]
        if kind == "elu":
            return torch.nn.functional.elu(x) + 1
        if kind == "relu":
            return torch.relu(x)
        return _focused(x, float(self.user["focus_power"]))

    def logits(self, x, side):
        """(L, s): side "key" and "query_with_norm" L = U − h (hyperbolic [U − h, −U − h], trig h),
        side "query" L = U ([U, −U], trig 0); U = x̃·ωᵀ, h = ‖x̃‖²/2, x̃ = √scale·x; s = [sin U,
        cos U] for trig, else None."""
        # In float32 for a bfloat16/float16 model: h = ‖x̃‖²/2 scales a whole key's weight by e^{−h}.
        xt = _wide(x) * math.sqrt(self.scale)
        u = torch.einsum("...d,md->...m", xt, self.omega.to(xt.dtype))
        h = (xt * xt).sum(dim=-1, keepdim=True) / 2
        norm = side != "query"
        if self.kernel == "positive":
            return (u - h if norm else u), None
        if self.kernel == "hyperbolic":
            return (torch.cat([u - h, -u - h], dim=-1) if norm else torch.cat([u, -u], dim=-1)), None
        factors = torch.cat([torch.sin(u), torch.cos(u)], dim=-1)
        return (h if norm else torch.zeros_like(h)).expand_as(factors), factors

    def enter(self, state, keys, values):
        if self.log_form:
            logits, factors = self.logits(keys, "key")
            return _recurrent.enter(state, values, logits=logits, factors=factors)
        return _recurrent.enter(state, values, features=self.plain(keys, "key"))

    def read(self, state, q, with_norm):
        """q [B, H, 1, d] against the state: linattn.torch.recurrent.read."""
        if self.log_form:
            logits, factors = self.logits(q, "query_with_norm" if with_norm else "query")
            return _recurrent.read(state, logits=logits[:, :, 0], factors=None if factors is None else factors[:, :, 0])
        return _recurrent.read(state, features=self.plain(q, "query")[:, :, 0])

    def dim(self, head_dim):
        if self.log_form:
            return self.omega.shape[0] * (1 if self.kernel == "positive" else 2)
        if isinstance(self.b, _backends.Hedgehog):
            return 2 * int(self.user["feature_dim"])
        return 1 if isinstance(self.b, _backends.Window) else head_dim


def _eps(b, user):
    if isinstance(b, _backends.Favor):
        return 0.0  # favor_attention has none; linattn.hf's FAVOR hybrid passes 0
    return float(user.get("eps", 1e-6))


_UNPADDED = ("the cache keeps one state per sequence and cannot drop padded tokens: generate unpadded prompts (one "
             "prompt, or prompts of one length)")


def check_mask(name, attention_mask, batch, n_q, n_k):
    """The cache serves unpadded prompts: a mask must be the causal pattern alone."""
    if attention_mask is None:
        return
    try:
        lengths = _masks.key_lengths(name, attention_mask, batch, n_q, n_k, True)
    except ValueError as e:
        raise ValueError("LinattnCache: %s. The %s" % (e, _UNPADDED)) from None
    if lengths is not None:
        raise ValueError("%s: LinattnCache: the prompts are padded (lengths %s of %d); %s"
                         % (name, lengths.tolist(), n_k, _UNPADDED))


def attend(name, layer, module, b, user, query, key, value, attention_mask, scaling, full_forward):
    """Attention of the new tokens (query, key, value [B, H, n, d], keys already repeated for
    grouped queries) with the cache's layer, which it then advances. full_forward() is the
    backend's causal forward over the new tokens alone: the prompt's outputs."""
    batch, n = query.shape[0], query.shape[2]
    check_mask(name, attention_mask, batch, n, layer.tokens + n)
    if layer.linear is not None and torch.is_grad_enabled() and query.requires_grad:
        raise ValueError("LinattnCache: decoding runs without autograd (the state holds no graph of the tokens before); "
                         "run it under torch.no_grad(), as generate() does")
    if layer.linear is not None and layer.linear.sums.shape[0] != batch:
        raise ValueError("LinattnCache: layer %d holds %d sequences, the model gave %d"
                         % (layer.index, layer.linear.sums.shape[0], batch))
    fmap = _Map(module, b, user, query, scaling)
    window = int(user.get("window") or 0)
    if layer.linear is None:  # the prompt: the backend's own forward (with autograd when enabled)
        out = full_forward()
        with torch.no_grad():
            _fill(layer, fmap, module, user, key.detach(), value.detach(), window)
        return out
    with torch.no_grad():
        outs = [_step(layer, fmap, module, b, user, query[:, :, t:t + 1], key[:, :, t:t + 1], value[:, :, t:t + 1],
                      window) for t in range(n)]
    # A bfloat16/float16 model's state and sums are float32 (recurrent.py); the output is rounded once.
    return torch.cat(outs, dim=2).to(query.dtype)


def _fill(layer, fmap, module, user, key, value, window):
    """The state after the prompt: keys before the window enter the linear state; the last
    `window` keys and values are kept; a convolution keeps the last K − 1 values."""
    batch, heads, n, head_dim = key.shape
    state = _recurrent.empty_state(batch, heads, fmap.dim(head_dim), value.shape[-1], log_form=fmap.log_form,
                                   like=value)
    entering = max(n - window, 0)
    layer.linear = fmap.enter(state, key[:, :, :entering], value[:, :, :entering])
    if window:
        layer.window_keys, layer.window_values = key[:, :, entering:].clone(), value[:, :, entering:].clone()
    conv = getattr(module, _backends.PREFIX + "conv_weight", None)
    if user.get("dwc_kernel_size") and conv is not None:
        past = conv.shape[1] - 1
        pad = value.new_zeros((batch, heads, max(past - n, 0), value.shape[-1]))
        layer.conv_values = torch.cat([pad, value[:, :, max(n - past, 0):]], dim=2)
    layer.tokens = n


def _step(layer, fmap, module, b, user, q, k, v, window):
    """One token q, k, v [B, H, 1, d] -> its output [B, H, 1, d_v], the row of the backend's
    causal forward for the newest token; the layer advances by it."""
    layer.tokens += 1
    eps = _eps(b, user)
    if window == 0:
        layer.linear = fmap.enter(layer.linear, k, v)  # causal: the query sees its own key
        num, den, _ = fmap.read(layer.linear, q, with_norm=False)
        den = den + eps
        # A zero denominator (trig features can cancel) gives 0, as favor_attention does.
        out = torch.where(den[..., None] != 0, num / torch.where(den != 0, den, 1)[..., None], 0)
    else:
        keys, values = torch.cat([layer.window_keys, k], dim=2), torch.cat([layer.window_values, v], dim=2)
        leaving = keys.shape[2] - window
        if leaving > 0:  # the oldest key leaves the window for the linear state
            layer.linear = fmap.enter(layer.linear, keys[:, :, :leaving], values[:, :, :leaving])
            keys, values = keys[:, :, leaving:], values[:, :, leaving:]
        layer.window_keys, layer.window_values = keys, values
        # The window's scores and sums in float32 for a 16-bit model (the state already is).
        keys, values = _wide(keys), _wide(values)
        scores = torch.einsum("bhd,bhjd->bhj", _wide(q[:, :, 0]), keys) * fmap.scale
        top = scores.amax(dim=-1)
        if isinstance(b, _backends.Window):
            gamma = q.new_ones(())  # no gate: hybrid_attention's γ = 1
        else:
            gamma = _wide(torch.sigmoid(_backends.window_gate(module, q)))[None, :]
        num, den, shift = fmap.read(layer.linear, q, with_norm=True)
        if fmap.log_form:  # every term on the scale e^{R}, R = max(M, the linear part's)
            row = torch.maximum(top, shift)
            linear = torch.exp(shift - row) / fmap.dim(q.shape[-1])
            e = torch.exp(scores - row[..., None])
            num = gamma[..., None] * torch.einsum("bhj,bhjd->bhd", e, values) + linear[..., None] * num
            den = gamma * e.sum(dim=-1) + linear * den
            if eps > 0:
                den = den + torch.exp(math.log(eps) - row)
            out = num / den[..., None]
        else:  # the window shifted by its maximum M, as in hybrid_attention
            e = torch.exp(scores - top[..., None])
            num = num + gamma[..., None] * torch.einsum("bhj,bhjd->bhd", e, values)
            den = den + gamma * e.sum(dim=-1)
            out = num / (den + eps)[..., None]
    if layer.conv_values is not None:  # causal depthwise convolution: Σ_t w[h, t]·v[i + t − (K − 1)]
        conv = getattr(module, _backends.PREFIX + "conv_weight")
        past = torch.cat([layer.conv_values, v], dim=2)
        out = out + torch.einsum("bhkd,hk->bhd", _wide(past), _wide(conv))
        layer.conv_values = past[:, :, 1:]
    return out[:, :, None]


# The searches that only go forward; the others (assisted, contrastive, DoLa) roll tokens back.
_RECURRENT_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                    GenerationMode.BEAM_SAMPLE)


def install_generation_hook():
    """Makes generate() start a LinattnCache for a causal model on a cached backend when the
    caller gave no cache (and did not ask for use_cache=False or a cache_implementation) and the
    search is greedy, sampling or beam search (assisted, contrastive and DoLa decoding roll
    tokens back, which a recurrent state cannot: they keep transformers' DynamicCache):
    transformers' GenerationMixin._prepare_cache_for_generation, wrapped once. Every other
    model and call goes to transformers' own. Idempotent; linattn.hf.register() calls it."""
    original = GenerationMixin._prepare_cache_for_generation
    if getattr(original, "linattn_hook", False):
        return

    def prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        config = _model_config(self)
        if (supports(getattr(config, "_attn_implementation", None)) and generation_mode in _RECURRENT_MODES
                and not getattr(self.config, "is_encoder_decoder", False)
                and model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False
                and generation_config.cache_implementation is None):
            model_kwargs["past_key_values"] = LinattnCache(self)
            return None
        return original(self, generation_config, model_kwargs, generation_mode, *args, **kwargs)

    prepare_cache_for_generation.linattn_hook = True
    prepare_cache_for_generation.__wrapped__ = original
    GenerationMixin._prepare_cache_for_generation = prepare_cache_for_generation
