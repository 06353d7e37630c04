"""LinattnCache: a transformers Cache that generates in constant memory on linattn's kernelized
and hybrid backends (linattn_elu, linattn_relu, linattn_focused, linattn_favor,
linattn_hedgehog, linattn_window, with or without a window).

Per layer and batch row it keeps the linear state ([S | z] over the keys that have left the
window, FAVOR's on its per-feature scale, as the C++ kernels keep it), the last `window` tokens'
keys and values (exact softmax over them; slots not filled yet are masked), and for a depthwise
convolution the last K − 1 values: its size does not grow with the context. The first forward
(the prompt) runs the backend's own causal kernel, the chunked one a forward without cache
runs, and its keys and values then fill the state in one C++ call per layer (hybrid_prefill, the
state hybrid_decode_step continues from); each later token is one hybrid_decode_step call per
layer, O(1) in the context length.

Padded batches (generate() on prompts of different lengths, left- or right-padded): the model's
attention mask says which positions hold tokens. Each row's prompt runs alone on its tokens,
and padded positions never enter a row's state, window or convolution (φ(0) ≠ 0 for elu+1 and
Hedgehog, so zeroing them would not do), so each row gets the outputs it gets alone.

How it reaches the attention function: a transformers attention layer calls
cache.update(key, value, layer_idx) and passes what it returns to the attention function.
update() returns the new keys as they are and leaves a note (thread-local) naming the layer;
linattn's attention function takes the note, checks that the keys it got are the very tensor
the cache returned, and runs attend() below. A model that is not on a linattn backend, or that
changes the keys between the two calls, gets a ValueError instead of attention over the new
tokens alone. The cache records the backend and its options when it is made and refuses a
model that runs another since: a state means something only for the map that made it."""

import math
import threading
from typing import NamedTuple, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerationMixin

from .. import _linattn
from ..torch._checks import array as _array
from ..torch._ops import accumulator_dtype
from ..torch.feature_maps import step_features as _step_features
from . import backends as _backends
from . import masks as _masks

__all__ = ["LinattnCache", "CACHED_BACKENDS", "supports"]

# The backends with a causal recurrent form (the others: softmax keeps transformers' caches;
# Nyström, Linformer and Efficient Attention have no causal form).
CACHED_BACKENDS = ("linattn_elu", "linattn_relu", "linattn_focused", "linattn_favor", "linattn_hedgehog",
                   "linattn_window")


def supports(name):
    """Whether LinattnCache serves backend `name`: CACHED_BACKENDS, and every learned map's
    (linattn.torch.register_feature_map's maps too)."""
    return name in CACHED_BACKENDS or isinstance(_backends.BACKENDS.get(name), _backends.Learned)


def _model_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    text = getattr(config, "get_text_config", None)
    return text(decoder=True) if text is not None else config


class LinattnCacheLayer(CacheLayerMixin):
    """One decoder layer's recurrent state: `linear` (a LinearState, below, or
    None before the prompt), `exact_keys` / `exact_values` [B, H_kv, s + w, d] (per key/value
    head of a grouped-query model, as its own cache keeps them) with `exact_valid`
    [B, s + w] (False: a slot no token has filled yet): the keys and values the query sees
    exactly, in s sink slots (slot p: the row's token p, one of its first s, once it has left
    the window: attention sinks) and a ring of w window slots (the token at place p of its row
    at slot s + p mod w, overwritten in place by the token w places on, so a step copies no
    window), `conv_values` [B, H, K − 1, d_v] (a depthwise convolution's past values, zeros before
    the first tokens), `tokens` (the positions seen, padding included: what transformers counts)
    and `counts` [B] (the tokens of each row, padding excluded)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, index, cache=None):
        super().__init__()
        self.index, self.cache = index, cache
        self.reset()

    def reset(self):
        self.tokens = 0
        self.linear = self.counts = None
        self.exact_keys = self.exact_values = self.exact_valid = self.conv_values = None
        self.step_constants = self.decay_memo = None  # _step_constants' and _log_decay's memos
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

    def __getstate__(self):  # copy.deepcopy: the memo holds the model's parameters, which a copy must not clone
        state = dict(self.__dict__)
        state["step_constants"] = None
        return state

    def _tensors(self):
        return ("counts", "exact_keys", "exact_values", "exact_valid", "conv_values")

    def _map(self, fn):
        if self.linear is not None:
            self.linear = self.linear.map(fn)
        for attr in self._tensors():
            t = getattr(self, attr)
            if t is not None:
                setattr(self, attr, fn(t))

    def reorder_cache(self, beam_idx):
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self._map(lambda t: t[indices])

    def attend(self, name, module, b, user, query, key, value, attention_mask, scaling, forward_on):
        """The new tokens' attention with this layer, which it then advances (attend below): what
        linattn's attention function calls with the layer LinattnCache.update noted."""
        return attend(name, self, module, b, user, query, key, value, attention_mask, scaling, forward_on)

    def end_forward(self, failed=False):
        """The attention of this layer is done (LinattnCache.end_forward)."""
        if self.cache is not None:
            self.cache.end_forward(self.index, failed)

    def crop(self, tokens_to_remove):
        if tokens_to_remove != 0:  # transformers passes a negative count: "keep all but these"
            raise ValueError("LinattnCache.crop: a recurrent state cannot forget tokens (it keeps sums, not the "
                             "tokens); assisted generation and other rollbacks need transformers' DynamicCache")

    @property
    def nbytes(self):
        n = 0 if self.linear is None else self.linear.nbytes
        return n + sum(t.numel() * t.element_size() for t in (getattr(self, a) for a in self._tensors())
                       if t is not None)


_CONCURRENT = ("one LinattnCache is used by two forwards at once (concurrent generate() calls, or threads, sharing "
               "one cache; give each its own LinattnCache), or another thread's forward with it stopped between "
               "layers (the cache no longer describes one sequence: start a new one)")


class LinattnCache(Cache):
    """A constant-memory generation cache for a causal model on a linattn kernelized or hybrid
    backend (CACHED_BACKENDS). After linattn.hf.register(), model.generate() makes one by
    itself for such a model; LinattnCache(model) passed as past_key_values works too, as for
    any transformers Cache. nbytes is its size in bytes. reorder_cache, batch_repeat_interleave
    and batch_select_indices serve beam search; crop (assisted generation) raises ValueError.
    Batches of prompts of different lengths, left- or right-padded, give each row the outputs it
    gets alone (the attention mask says which positions are padding). The backend and its
    options are recorded here: a model switched to another since raises ValueError."""

    def __init__(self, model):
        config = _model_config(model)
        name = getattr(config, "_attn_implementation", None)
        if not supports(name):
            raise ValueError("LinattnCache: the model runs attention implementation %r; the cache serves a model on "
                             "one of %s, or a learned map's (linattn.torch.register_feature_map)"
                             % (name, ", ".join(CACHED_BACKENDS)))
        self.config = config
        self.backend, self.options = name, _backends.options_of(config, name)
        self._lock = threading.Lock()
        self._forward = None  # (thread id, thread) of the forward in progress
        super().__init__(layers=[LinattnCacheLayer(i, self) for i in range(config.num_hidden_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        name = getattr(self.config, "_attn_implementation", None)
        if name != self.backend:
            raise ValueError("LinattnCache: the cache was made for %s, and the model now runs attention implementation "
                             "%r; its states hold %s's features, which mean nothing to another map: start a new cache"
                             % (self.backend, name, self.backend))
        options = _backends.options_of(self.config, name)
        if options != self.options:
            changed = sorted(k for k in options if options[k] != self.options.get(k))
            raise ValueError("LinattnCache: the model's %s options changed since the cache was made (%s); its states "
                             "were made with the old ones: start a new cache"
                             % (name, ", ".join("%s %r -> %r" % (k, self.options.get(k), options[k]) for k in changed)))
        self._enter_forward(layer_idx)
        try:
            return self._update(key_states, value_states, layer_idx)
        except BaseException:
            self.end_forward(layer_idx, failed=True)
            raise

    def _update(self, key_states, value_states, layer_idx):
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
                             "failed midway, an attention layer bypassed linattn, or two forwards used it at once; "
                             "start a new cache"
                             % [layer.tokens for layer in self.layers])
        layer = self.layers[layer_idx]
        layer.is_initialized = True
        pending.note = (layer, key_states)
        return key_states, value_states

    def __getstate__(self):  # copy.deepcopy (one prompt's cache for several continuations)
        state = dict(self.__dict__)
        state["_lock"], state["_forward"] = None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _enter_forward(self, layer_idx):
        """Refuses a second thread's forward while one is in progress (the first layer starts a
        forward, the last layer's attention ends it, and so does a failure in any layer's update
        or attention; a thread that is gone does not count)."""
        me = threading.get_ident()
        with self._lock:
            running = self._forward
            if layer_idx == 0:
                if running is not None and running[0] != me and running[1].is_alive():
                    raise ValueError("LinattnCache: %s" % _CONCURRENT)
                self._forward = (me, threading.current_thread())
            elif running is None or running[0] != me:
                raise ValueError("LinattnCache: layer %d's update without its forward's first layer on this thread: %s"
                                 % (layer_idx, _CONCURRENT))

    def end_forward(self, layer_idx, failed=False):
        """After layer layer_idx's attention (failed: it raised, or its update did): the last
        layer's, or a failure anywhere, ends this thread's forward."""
        if failed or layer_idx == len(self.layers) - 1:
            with self._lock:
                if self._forward is not None and self._forward[0] == threading.get_ident():
                    self._forward = None

    @property
    def nbytes(self):
        """Bytes held by the cache's tensors (states, windows, convolution rings)."""
        return sum(layer.nbytes for layer in self.layers)


# ---- the recurrent form of each backend ----------------------------------------------------------

def _wide(t):
    """t in what a 16-bit model's decoding accumulates in (float32); other dtypes unchanged."""
    return t.to(accumulator_dtype(t.dtype))


class LinearState(NamedTuple):
    """A layer's sums over the keys that have left the window (every key without one), as
    hybrid_prefill and hybrid_decode_step keep them, per batch row and query head."""
    sums: torch.Tensor                   # [B, H, m', d_v]
    normaliser: torch.Tensor             # [B, H, m']
    shift: Optional[torch.Tensor] = None  # [B, H, m']: FAVOR's per-feature scales (log form); None (plain)

    @property
    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self if t is not None)

    def map(self, fn):
        """The state with fn applied to each tensor (index_select for beam search, say)."""
        return LinearState(*(None if t is None else fn(t) for t in self))


def _scale(scaling, like):
    """The model's scaling (the window's scores and FAVOR's x̃ = √scale·x), 1/√d when it gives none."""
    return float(scaling) if scaling is not None else 1.0 / math.sqrt(like.shape[-1])


class _Map:
    """A backend's feature map after a prompt, as the C++ prefill takes it: its scale (_scale)
    and size m' (FAVOR: log form, the sums keep per-feature shifts; its projection is a step
    constant, _step_constants). Decoding needs neither: the state has its size."""

    def __init__(self, module, b, user, like, scaling):
        self.b, self.user = b, user
        self.scale = _scale(scaling, like)
        self.log_form = isinstance(b, _backends.Favor)
        self.learned_dim = b.map(module, user, "query", like).dim if isinstance(b, _backends.Learned) else None

    def dim(self, head_dim):
        if self.log_form:  # the projection's rows, twice for the hyperbolic and trig kernels
            return int(self.user["num_features"]) * (1 if self.user["kernel"] == "positive" else 2)
        if self.learned_dim is not None:
            return self.learned_dim
        return 1 if isinstance(self.b, _backends.Window) else head_dim

    def empty_state(self, batch, heads, head_dim, value_dim, dtype):
        """The sums of no key: zeros, and for FAVOR shifts of −inf (no key has set a scale)."""
        m = self.dim(head_dim)
        shift = torch.full((batch, heads, m), float("-inf"), dtype=dtype) if self.log_form else None
        return LinearState(torch.zeros((batch, heads, m, value_dim), dtype=dtype), torch.zeros((batch, heads, m), dtype=dtype),
                           shift)


def _eps(b, user):
    if isinstance(b, _backends.Favor):
        return 0.0  # favor_attention has none; linattn.hf's FAVOR hybrid passes 0
    return float(user.get("eps", 1e-6))


def token_validity(name, attention_mask, batch, n, layer):
    """Which of the n new positions of each row hold tokens: [B, n] bool, or None (all of them).

    The mask is the model's causal mask over every position so far, padding included
    ([B or 1, 1, n, tokens + n]). A position is a token when the last new query attends to it
    (the last query sees every real position, causally); the tokens before the new ones must be
    as many as the cache holds per row, and each new token's row must be the causal pattern
    over the real positions. Anything else (sliding windows, packed sequences, biases) raises."""
    if attention_mask is None:
        return None
    total = layer.tokens + n
    keep = _masks.keep_of(name, attention_mask)
    if keep.shape[-1] < total or keep.shape[2] not in (1, n) or keep.shape[0] not in (1, batch):
        raise ValueError("%s: LinattnCache: attention mask of shape %s for %d new positions after %d, batch %d"
                         % (name, tuple(keep.shape), n, layer.tokens, batch))
    keep = keep[..., :total]
    if keep.shape[1] > 1 and not bool((keep == keep[:, :1]).all()):
        raise ValueError("%s: LinattnCache: the attention mask differs between heads; the cache serves causal "
                         "padding masks" % name)
    keep = keep[:, 0].expand(batch, n, total)
    real = keep[:, -1, :]  # [B, tokens + n]
    new = real[:, layer.tokens:]
    if layer.counts is not None and not torch.equal(real[:, :layer.tokens].sum(dim=1).to(layer.counts.device),
                                                    layer.counts):
        raise ValueError("%s: LinattnCache: the attention mask marks %s tokens before the new ones, and the cache holds "
                         "%s per row: the mask does not describe the sequences the cache has seen"
                         % (name, real[:, :layer.tokens].sum(dim=1).tolist(), layer.counts.tolist()))
    positions = torch.arange(total, device=keep.device)
    rows = torch.arange(n, device=keep.device)[:, None] + layer.tokens
    want = real[:, None, :] & (positions[None, :] <= rows)[None]  # causal over the real positions
    wrong = (keep != want).any(dim=-1) & new  # rows of padding are not used: only tokens' rows must fit
    if bool(wrong.any()):
        raise ValueError("%s: LinattnCache: the attention mask is not a causal padding mask (sliding windows, packed "
                         "sequences and custom masks cannot be kept in a recurrent state)" % name)
    return None if bool(new.all()) else new


def attend(name, layer, module, b, user, query, key, value, attention_mask, scaling, forward_on):
    """Attention of the new tokens (query [B, H, n, d]; key, value [B, H_kv, n, d], the model's
    key/value heads: H_kv divides H) with the cache's layer, which it then advances. forward_on(q, k, v) is the
    backend's causal forward over new tokens alone: the prompt's outputs. (The attention
    function calls layer.end_forward afterwards.)"""
    batch, n = query.shape[0], query.shape[2]
    decoding = layer.linear is not None
    if decoding and layer.counts.shape[0] != batch:
        raise ValueError("LinattnCache: layer %d holds %d sequences, the model gave %d"
                         % (layer.index, layer.counts.shape[0], batch))
    if decoding and torch.is_grad_enabled() and (any(t.requires_grad for t in (query, key, value))
                                                 or any(p.requires_grad for p in _backends.module_learned_parameters(module, b, user))):
        raise ValueError("LinattnCache: a decoding step with autograd on; the state holds no graph of the tokens "
                         "before, so nothing before this token would get a gradient. Run decoding under "
                         "torch.no_grad(), as generate() does")
    valid = token_validity(name, attention_mask, batch, n, layer)
    window = int(user.get("window") or 0)
    sinks = int(user.get("sinks") or 0) if window else 0
    decay = _log_decay(layer, user, query.shape[1], query.device) if window else None  # λ [H]
    if not decoding:  # the prompt: the backend's own forward (with autograd when enabled)
        heads = query.shape[1]
        key_h, value_h = _backends.per_query_head(key, heads), _backends.per_query_head(value, heads)
        if valid is None:
            out = forward_on(query, key_h, value_h)
        else:  # each row on its tokens alone; padded positions' outputs are 0
            rows = []
            for r in range(batch):
                idx = valid[r].nonzero()[:, 0]
                row = query.new_zeros((1, query.shape[1], n, value.shape[-1]))
                if idx.numel():
                    pick = [t[r:r + 1].index_select(2, idx) for t in (query, key_h, value_h)]
                    row = row.index_copy(2, idx, forward_on(*pick).to(row.dtype))
                rows.append(row)
            out = torch.cat(rows, dim=0)
        with torch.no_grad():
            _fill(layer, _Map(module, b, user, query, scaling), module, b, user, query, key.detach(), value.detach(),
                  window, sinks, decay, valid)
        return out
    scale = _scale(scaling, query)
    with torch.no_grad():
        outs = [_step(layer, scale, module, b, user, query[:, :, t:t + 1], key[:, :, t:t + 1], value[:, :, t:t + 1],
                      window, sinks, decay, None if valid is None else valid[:, t]) for t in range(n)]
    # A bfloat16/float16 model's state and sums are float32 (the C++ step's); the output is rounded once.
    return (outs[0] if n == 1 else torch.cat(outs, dim=2)).to(query.dtype)


def _last_slots(valid, size):
    """For the last `size` tokens of each row: (rows, positions, slots) with slot size − 1 the
    newest, size − 2 the one before, ...; valid [B, n] marks the tokens."""
    after = valid.flip(1).cumsum(1).flip(1) - valid.long()  # tokens after each position
    rows, positions = (valid & (after < size)).nonzero(as_tuple=True)
    return rows, positions, size - 1 - after[rows, positions]


def _fill(layer, fmap, module, b, user, query, key, value, window, sinks, decay, valid):
    """The state after the prompt, in one C++ call (hybrid_prefill, in the dtype the step takes:
    float32 for a 16-bit model): per row, its tokens before its last `window` enter the linear
    state, except its first `sinks` tokens, which fill the sink slots; the last `window` tokens'
    keys and values fill the window's ring (token p of the row at slot sinks + p mod window);
    a convolution keeps the last K − 1 values. Padded positions go nowhere. With decay λ [H], a
    token entering the state is weighed by e^{λ·(tokens after it)}: the state is the last
    token's. key, value [B, H_kv, n, d]: the ring keeps them per key head; the state and the
    convolution, whose maps and weights are per query head, per query head. The step's constants
    (the maps, λ) are made here once and kept for the steps."""
    heads, wide = query.shape[1], accumulator_dtype(query.dtype)
    batch, kv_heads, n, head_dim = key.shape
    inputs = _step_constants(layer, module, b, user, query, decay)
    layer.linear = fmap.empty_state(batch, heads, head_dim, value.shape[-1], wide)
    layer.exact_keys = torch.zeros((batch, kv_heads, sinks + window, head_dim), dtype=wide)
    layer.exact_values = torch.zeros((batch, kv_heads, sinks + window, value.shape[-1]), dtype=wide)
    layer.exact_valid = torch.zeros((batch, sinks + window), dtype=torch.bool)
    layer.counts = torch.zeros(batch, dtype=torch.int64)
    # The key's map as the step takes it (Hedgehog's key map, a fixed map's or FAVOR's name and
    # options); features given to the step (the window alone's zeros) are given for the keys too.
    maps = {name: inputs[name] for name in _PREFILL_MAP_INPUTS if name in inputs}
    given = None
    if isinstance(b, _backends.Window):
        given = torch.zeros((batch, heads, n, 1), dtype=wide).numpy()
    elif layer.step_constants["features_here"]:  # a learned map that the C++ prefill does not apply: its features
        given = _array(_wide(b.features(module, user, _backends.per_query_head(key, heads), "key")))
    shift = layer.linear.shift
    _linattn.hybrid_prefill(_array(key.to(wide)), _array(value.to(wide)), given, None if valid is None else _array(valid),
                            inputs["log_decay"], sums=layer.linear.sums.numpy(),
                            normaliser=layer.linear.normaliser.numpy(), exact_keys=layer.exact_keys.numpy(),
                            exact_values=layer.exact_values.numpy(), exact_valid=layer.exact_valid.numpy(),
                            counts=layer.counts.numpy(), window=window, sinks=sinks, scale=fmap.scale,
                            shift=None if shift is None else shift.numpy(), **maps)
    conv = getattr(module, _backends.PREFIX + "conv_weight", None)
    if user.get("conv_kernel_size") and conv is not None:
        past = conv.shape[1] - 1
        layer.conv_values = value.new_zeros((batch, heads, past, value.shape[-1]))
        if past:
            rows, positions, slots = _last_slots(
                torch.ones((batch, n), dtype=torch.bool, device=key.device) if valid is None else valid, past)
            layer.conv_values[rows, :, slots] = _backends.per_query_head(value, heads)[rows, :, positions]
    layer.tokens = n


# The step constants (_step_constants) that hybrid_prefill takes as they are: the key's map.
_PREFILL_MAP_INPUTS = ("key_weight", "key_bias", "feature_map", "focus_power", "projection", "kernel")


def _step(layer, scale, module, b, user, q, k, v, window, sinks, decay, valid):
    """One position q [B, H, 1, d], k, v [B, H_kv, 1, d] -> its output [B, H, 1, d_v], the row of
    the backend's causal forward for the newest token; the layer advances by it in the rows where
    valid [B] (None: all) says it is a token (elsewhere the state stays and the output is 0).
    (A generated token runs this for each of a model's layers: it does only what the token needs.)"""
    batch, heads = q.shape[0], q.shape[1]
    advance = torch.ones(batch, dtype=torch.bool) if valid is None else valid
    out = _native(layer, scale, module, b, user, q, k, v, window, sinks, decay, advance, _eps(b, user))
    layer.tokens += 1  # after the call: a call that raises leaves the layer as it was
    if layer.conv_values is not None:
        out = out + _conv_step(layer, module, b, user, _backends.per_query_head(v, heads), advance)
        if valid is not None:  # the step leaves 0 in the rows that do not advance; the convolution's term does not
            out = torch.where(advance[:, None, None], out, torch.zeros_like(out))
    return out[:, :, None]


def _window_weight(module, b, user, q):
    """γ [H], the window's weight, in what decoding accumulates in: sigmoid(window_gate), or 1
    for the window alone (hybrid_attention's γ without a gate)."""
    if isinstance(b, _backends.Window) or not user.get("window"):  # (no window: γ weighs nothing)
        return q.new_ones(q.shape[1], dtype=accumulator_dtype(q.dtype))
    return _wide(torch.sigmoid(_backends.window_gate(module, b, user, q)))


def _conv_step(layer, module, b, user, v, advance):
    """The causal depthwise convolution's term of the newest token, Σ_t w[h, t]·v[i + t − (K − 1)]
    [B, H, d_v], and its past values advanced."""
    conv = _backends.learned_tensor(module, b, user, "conv_weight", v)
    past = torch.cat([layer.conv_values, v], dim=2)
    layer.conv_values = torch.where(advance[:, None, None, None], past[:, :, 1:], layer.conv_values)
    return torch.einsum("bhkd,hk->bhd", _wide(past), _wide(conv))


def _in_step_dtype(layer, wide):
    """The layer's sums and exact slots in the C++ step's dtype (what q accumulates in: q's dtype,
    float32 for a 16-bit model), contiguous: copies when the model's dtype changed since the
    prompt (a float32 state continued by a float64 model), else the tensors as they are."""
    linear = layer.linear
    if not all(t.dtype == wide and t.is_contiguous() for t in linear if t is not None):
        layer.linear = linear.map(lambda t: t.to(wide).contiguous())
    if not all(t.dtype == wide and t.is_contiguous() for t in (layer.exact_keys, layer.exact_values)):
        layer.exact_keys = layer.exact_keys.to(wide).contiguous()
        layer.exact_values = layer.exact_values.to(wide).contiguous()


def _log_decay(layer, user, heads, device):
    """The option decay's λ [H] (float64), or None; kept on the layer between tokens."""
    decays = _backends.log_decay(user, heads)
    if decays is None:
        return None
    memo = layer.decay_memo
    if memo is None or memo[0] != decays or memo[1].device != device:
        layer.decay_memo = memo = (decays, torch.tensor(decays, dtype=torch.float64, device=device))
    return memo[1]


def _parameters(t):
    """(the dict holding it, its name, the parameter, its version, its storage) for each
    parameter of t (a tensor, or a module and its submodules)."""
    if not isinstance(t, torch.nn.Module):
        return [(None, None, t, t._version, t.data_ptr())]
    return [(m._parameters, name, p, p._version, p.data_ptr()) for m in t.modules()
            for name, p in m._parameters.items() if p is not None]


def _step_constants(layer, module, b, user, q, decay):
    """What the C++ step takes besides the tokens and the state, as NumPy arrays in q's dtype:
    the window weight γ, λ, and the map (Hedgehog's four tensors, a fixed map's name, or the
    window's zero features). Made once and kept on the layer, and made again when q's dtype or
    the batch changed or one of the module's learned tensors was replaced, given new storage or
    changed in place (its version counter): decoding reads the model as it is now. A change
    written through `.data` bumps no version counter of the parameter's and is not seen: edit
    weights in place under torch.no_grad() (as optimizers do), or start a new cache."""
    memo = layer.step_constants
    if (memo is not None and memo["dtype"] == q.dtype and memo["batch"] == q.shape[0]
            and all(_backends._existing(module, attr) is t for attr, t in memo["sources"])
            and all((owner is None or owner.get(name) is p) and p._version == v and p.data_ptr() == ptr
                    for owner, name, p, v, ptr in memo["parameters"])):
        return memo["arrays"]
    sources = [(attr, _backends._existing(module, attr)) for attr in b.learned(module, user)]
    sources = [(attr, t) for attr, t in sources if t is not None]
    wide = accumulator_dtype(q.dtype)  # the step's dtype
    arrays = {"window_weight": _array(_window_weight(module, b, user, q).to(wide)),
              "log_decay": None if decay is None else _array(decay.to(wide))}
    features_here = False
    if isinstance(b, _backends.Learned):
        kernel_maps = [b.map(module, user, side, q).kernel_maps(q.dtype) for side in ("query", "key")]
        if all(m is not None for m in kernel_maps):  # the step applies the maps (Hedgehog's; in q's dtype,
            # then widened; the step keeps their features in float32, where a 16-bit forward rounds them)
            (qw, qb), (kw, kb) = kernel_maps
            arrays.update(query_features=None, leaving_features=None, query_weight=_array(qw.to(wide)),
                          query_bias=_array(qb.to(wide)), key_weight=_array(kw.to(wide)), key_bias=_array(kb.to(wide)))
        else:  # the module is applied at each step (_given_features), to q and the key entering the sums
            features_here = True
    elif isinstance(b, _backends.Window):  # the window alone: one feature, 0
        zeros = torch.zeros((q.shape[0], q.shape[1], 1), dtype=wide).numpy()
        arrays.update(query_features=zeros, leaving_features=zeros)
    elif isinstance(b, _backends.Favor):  # FAVOR's projection and kernel: the step makes the logits
        omega = _backends.projection(module, q.to(wide), user).to(wide)
        arrays.update(query_features=None, leaving_features=None, feature_map="favor", projection=_array(omega),
                      kernel=user["kernel"])
    else:  # a fixed map, which the step applies (the kernels' own)
        arrays.update(query_features=None, leaving_features=None, feature_map=b.fixed["feature_map"],
                      focus_power=float(user.get("focus_power", 3.0)))
    layer.step_constants = {"dtype": q.dtype, "batch": q.shape[0], "sources": sources, "arrays": arrays,
                            "features_here": features_here,
                            "parameters": [entry for _, t in sources for entry in _parameters(t)]}
    return arrays


def _given_features(layer, module, b, user, q, k, window, sinks):
    """For a learned map the C++ step does not apply (no kernel_maps): the features it takes,
    φ_q(q) and φ_k of the key entering the sums (linattn.torch.feature_maps.step_features), in
    the step's dtype."""
    wide = accumulator_dtype(q.dtype)
    fq, fk = _step_features(lambda x, side: b.features(module, user, x, side), q[:, :, 0], k[:, :, 0],
                            layer.exact_keys, layer.counts, window, sinks)
    return {"query_features": _array(fq.to(wide)), "leaving_features": _array(fk.to(wide))}


def _native(layer, scale, module, b, user, q, k, v, window, sinks, decay, advance, eps):
    """The step (sums, sinks, ring and the read; counts advanced) in one C++ call, in place on
    the layer's tensors: [B, H, d_v], 0 where a row does not advance. The step applies the map
    itself, to q and to the key entering the sums (the one leaving the window; without a window
    the new one): Hedgehog's maps, a fixed map by name, FAVOR's projection (its sums in log
    form, on the layer's shifts), or the window alone's features of zeros."""
    wide = accumulator_dtype(q.dtype)
    _in_step_dtype(layer, wide)
    linear = layer.linear
    inputs = _step_constants(layer, module, b, user, q, decay)
    if layer.step_constants["features_here"]:
        inputs = dict(inputs, **_given_features(layer, module, b, user, q, k, window, sinks))
    out = _linattn.hybrid_decode_step(
        *(_array(t.to(wide)).reshape(t.shape[0], t.shape[1], t.shape[3]) for t in (q, k, v)), advance=_array(advance),
        sums=linear.sums.numpy(), normaliser=linear.normaliser.numpy(), exact_keys=layer.exact_keys.numpy(),
        exact_values=layer.exact_values.numpy(), exact_valid=layer.exact_valid.numpy(), counts=layer.counts.numpy(),
        shift=None if linear.shift is None else linear.shift.numpy(), window=window, sinks=sinks, scale=scale,
        eps=eps, **inputs)
    return torch.from_numpy(out)


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

    _install_padding_hook()


def _right_padded(mask):
    """A 2-D 0/1 attention mask whose rows are ones, then zeros, with padding in some row."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return False
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        return False
    m = mask.to(torch.int64)
    return bool((m[:, 1:] <= m[:, :-1]).all()) and bool((m[:, -1] == 0).any()) and bool((m[:, 0] == 1).all())


def _install_padding_hook():
    """Wraps GenerationMixin.generate once: on a model with a cached backend, right-padded prompts
    (input ids and a 2-D attention mask whose rows are ones, then zeros) are moved to the left
    for the search and put back as given in the output. A right-padded row's next token would
    otherwise come from a padding position (transformers warns about it, for every attention):
    left padding gives each row the tokens it gets alone. Other calls are transformers' own."""
    original = GenerationMixin.generate
    if getattr(original, "linattn_hook", False):
        return

    def generate(self, inputs=None, *args, **kwargs):
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        config = _model_config(self)
        if not (supports(getattr(config, "_attn_implementation", None))
                and not getattr(self.config, "is_encoder_decoder", False) and isinstance(ids, torch.Tensor)
                and ids.dim() == 2 and isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(ids.shape)
                and _right_padded(mask)):
            return original(self, inputs, *args, **kwargs)
        n = ids.shape[1]
        pads = (mask == 0).sum(dim=1)
        order = (torch.arange(n, device=ids.device)[None, :] - pads[:, None].to(ids.device)) % n  # rows rolled right
        kwargs["attention_mask"] = mask.gather(1, order.to(mask.device))
        if inputs is not None:
            inputs = ids.gather(1, order)
        else:
            kwargs["input_ids"] = ids.gather(1, order)
        embeds = kwargs.get("inputs_embeds")
        if isinstance(embeds, torch.Tensor):  # rolled with the ids, or the mask would not fit them
            if embeds.dim() != 3 or tuple(embeds.shape[:2]) != tuple(ids.shape):
                raise ValueError("generate: inputs_embeds of shape %s for input ids of shape %s"
                                 % (tuple(embeds.shape), tuple(ids.shape)))
            kwargs["inputs_embeds"] = embeds.gather(1, order.to(embeds.device)[..., None].expand_as(embeds))
        out = original(self, inputs, *args, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        copies = sequences.shape[0] // ids.shape[0]  # num_return_sequences: each prompt's rows in a block
        if sequences.shape[1] >= n:  # the prompt as the caller gave it (generate may return new tokens only)
            sequences[:, :n] = ids.to(sequences.device).repeat_interleave(copies, dim=0)
        return out

    generate.linattn_hook = True
    generate.__wrapped__ = original
    generate.__doc__ = original.__doc__
    GenerationMixin.generate = generate
