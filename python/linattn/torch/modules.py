"""MultiheadAttention: torch.nn.MultiheadAttention's projections (same parameter names, so
weights load from one with from_torch) around any linattn method, batch-first, with recurrent
decoding for the causal kernelized methods."""

import math
import sys

import numpy as np
import torch
import torch.nn.functional as F

from .. import _linattn, _options
from ._checks import array as _array
from ._ops import accumulator_dtype
from .feature_maps import learned_feature_maps, step_features

# The module's method names: registered methods, and the kernelized feature maps by name.
_METHODS = {"softmax": ("softmax", {}), "linear": ("linear", {}), "elu": ("linear", {"feature_map": "elu"}),
            "relu": ("linear", {"feature_map": "relu"}), "focused": ("linear", {"feature_map": "focused"}),
            "favor": ("favor", {}), "nystrom": ("nystrom", {}), "linformer": ("linformer", {}),
            "efficient": ("efficient", {})}
# The learned maps (feature_maps.register_feature_map's: "hedgehog", ...) are methods too, made
# of torch modules around linattn's kernels rather than one registered method; each takes its
# map's options and init, and these (window 0: none; w > 0: the sliding-window hybrid).
_LEARNED_METHOD_OPTIONS = {"window": 0, "eps": 1e-6}

# The kinds of linattn.random_features.
_FEATURE_KINDS = ("orthogonal", "iid", "orthogonal_fixed", "quantile")


class DecodingState:
    """One batch of sequences being decoded by MultiheadAttention.step: the kernelized method's
    constant-size state (S, z per head) and, with a depthwise convolution, the last K−1 values.
    Its memory does not grow with the number of steps; copy() it to branch (beam search)."""

    def __init__(self, recurrent, values, maker, batch_size):
        self._recurrent = recurrent
        self._values = values  # [B, H, K-1, head_dim] or None
        self.maker, self.batch_size = maker, batch_size  # what made it: MultiheadAttention.step checks

    @property
    def tokens(self):
        """Tokens decoded so far."""
        return self._recurrent.tokens

    def copy(self):
        """An independent copy."""
        return DecodingState(self._recurrent.copy(), None if self._values is None else self._values.clone(),
                             self.maker, self.batch_size)

    __copy__ = copy

    def __deepcopy__(self, memo):
        return self.copy()


class LearnedDecodingState:
    """One batch of sequences decoded by MultiheadAttention.step with a learned map (method
    "hedgehog" or another registered one), in the C++ hybrid step's state
    (include/linattn/hybrid.h): the sums [S | z] of the keys that have left the window and a
    ring of the last `window` keys and values (none without a window: every key enters the sums
    at once), which linattn.hybrid_decode_step advances in place. Its memory does not grow with
    the number of steps. A bfloat16/float16 module's state is float32; step() rounds its output
    once."""

    def __init__(self, batch_size, heads, head_dim, features, window, like, maker):
        self.window, self.maker, self.batch_size = window, maker, batch_size
        dtype = accumulator_dtype(like.dtype)
        self.tokens = 0
        zeros = lambda *shape, dtype=dtype: torch.zeros(shape, dtype=dtype)  # noqa: E731
        self.arrays = dict(sums=zeros(batch_size, heads, features, head_dim),
                           normaliser=zeros(batch_size, heads, features),
                           exact_keys=zeros(batch_size, heads, window, head_dim),
                           exact_values=zeros(batch_size, heads, window, head_dim),
                           exact_valid=zeros(batch_size, window, dtype=torch.bool),
                           counts=zeros(batch_size, dtype=torch.int64))

    @property
    def state(self):
        """The sums [B, H, m', d] of the keys that have left the window (every key without one)."""
        return self.arrays["sums"]

    @property
    def normaliser(self):
        """Their normaliser [B, H, m']."""
        return self.arrays["normaliser"]

    def copy(self):
        """An independent copy."""
        c = LearnedDecodingState.__new__(LearnedDecodingState)
        c.__dict__.update(self.__dict__)
        c.arrays = {k: v.clone() for k, v in self.arrays.items()}
        return c

    __copy__ = copy

    def __deepcopy__(self, memo):
        return self.copy()

    def step(self, q, k, v, maps, gamma, scale, eps):
        """q, k, v [B, H, d] and the maps (query_map, key_map: LearnedFeatureMap) -> the next
        output [B, H, d]: the row of the causal forward for the newest token. The step applies
        maps that give kernel_maps (Hedgehog's) itself; others are applied here, to q and to the
        key entering the sums (the one leaving the ring, read before the step overwrites it;
        without a window the new one)."""
        dtype = q.dtype
        wide = accumulator_dtype(dtype)
        a = self.arrays
        kernel_maps = [m.kernel_maps(dtype) for m in maps]
        if all(t is not None for t in kernel_maps):
            given = (None, None)
            names = ("query_weight", "query_bias", "key_weight", "key_bias")
            applied = dict(zip(names, (_array(t.to(wide)) for pair in kernel_maps for t in pair)))
        else:
            fq, fk = step_features(lambda x, side: maps[0 if side == "query" else 1](x), q, k, a["exact_keys"], a["counts"],
                                   self.window)
            given, applied = (_array(fq.to(wide)), _array(fk.to(wide))), {}
        out = _linattn.hybrid_decode_step(
            *(_array(t.to(wide)) for t in (q, k, v)), *given, advance=np.ones(q.shape[0], bool),
            window_weight=_array(gamma.to(wide)), log_decay=None, sums=a["sums"].numpy(),
            normaliser=a["normaliser"].numpy(), exact_keys=a["exact_keys"].numpy(),
            exact_values=a["exact_values"].numpy(), exact_valid=a["exact_valid"].numpy(), counts=a["counts"].numpy(),
            window=self.window, sinks=0, scale=scale, eps=eps, **applied)
        self.tokens += 1  # after the call: a call that raises leaves the state as it was
        return torch.from_numpy(out).to(dtype)


class MultiheadAttention(torch.nn.Module):
    """Multi-head attention with a linattn method inside: [batch, seq, embed_dim] in and out.

    method: "softmax" (exact), "elu", "relu", "focused" (linear attention with that feature map;
    "hedgehog" (or another learned map of feature_maps.register_feature_map): learned maps
    query_map and key_map, with the map's options (hedgehog: feature_dim, 32) and init
    ("identity"), window (0; w > 0: the sliding-window hybrid with a learned gate), eps;
    "linear" takes feature_map= as an option), "favor", "nystrom", "linformer", "efficient".
    method_options: the method's options (linattn.methods()), plus
      num_features (favor, default 256): rows of the random projection, a buffer in the
        state_dict; seed (default 0) draws it; features (favor, default "orthogonal"): the
        kind of linattn.random_features ("orthogonal", "iid", "orthogonal_fixed", "quantile");
        feature_redraw_interval (favor, default None):
        draw a new projection every that many training forwards (never in eval);
      s_proj (default 256) and max_seq_len (linformer, required): the learned projections e, f
        [s_proj, max_seq_len], shared by the heads;
      conv_kernel_size (focused/linear, nystrom): a learned depthwise convolution of v
        [num_heads, K] added to the attention output, as in focused linear attention and
        Nyströmformer (dwc_kernel_size, its former name for linear attention, is accepted until
        the next release with a DeprecationWarning).
    dropout: applied to the attention output before out_proj in training (the linear methods
    never form the attention weights that torch.nn.MultiheadAttention drops).
    """

    def __init__(self, embed_dim, num_heads, method="softmax", bias=True, dropout=0.0, *, device=None, dtype=None,
                 **method_options):
        super().__init__()
        if not isinstance(embed_dim, int) or not isinstance(num_heads, int) or embed_dim < 1 or num_heads < 1:
            raise ValueError("MultiheadAttention: embed_dim and num_heads must be positive integers, got %r and %r"
                             % (embed_dim, num_heads))
        if embed_dim % num_heads:
            raise ValueError("MultiheadAttention: embed_dim = %d is not divisible by num_heads = %d"
                             % (embed_dim, num_heads))
        learned = learned_feature_maps()
        if method not in _METHODS and method not in learned:
            raise ValueError("MultiheadAttention: method must be one of %s, got %r"
                             % (", ".join([*_METHODS, *learned]), method))
        if not 0.0 <= dropout < 1.0:
            raise ValueError("MultiheadAttention: dropout must be in [0, 1), got %r" % (dropout,))
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.method, self.dropout = method, dropout
        self.batch_first = True
        self._learned = learned.get(method)  # the learned map's class, or None
        if self._learned is not None:
            self._registered = method
            self._init_learned(method_options, factory, bias)
            return
        registered, fixed = _METHODS[method]
        self._registered = registered
        info = next(m for m in _linattn._methods() if m["name"] == registered)
        self._function = info["function"]
        fn = "MultiheadAttention"
        opts = _options.renamed(fn, dict(method_options), _options.RENAMED)

        def count(name, value, minimum=1):  # Python or NumPy integers, as plain ints; None stays
            return None if value is None else _options.integer(fn, name, value, minimum)
        self.seed = count("seed", opts.pop("seed", 0), -2 ** 63)
        num_features = count("num_features", opts.pop("num_features", None))
        features = opts.pop("features", None)
        self.feature_redraw_interval = count("feature_redraw_interval", opts.pop("feature_redraw_interval", None))
        s_proj, max_seq_len = count("s_proj", opts.pop("s_proj", None)), count("max_seq_len", opts.pop("max_seq_len", None))
        kernel_size = count("conv_kernel_size", opts.pop("conv_kernel_size", None))
        allowed = {o["name"] for o in info["options"] if o["kind"] != "tensor" and o["name"] not in ("causal", "key_lengths")}
        for name in opts:
            if name not in allowed:
                raise TypeError("MultiheadAttention: method %r takes no option %r (its options: %s)"
                                % (method, name, ", ".join(sorted(allowed)) or "none"))
        for name in fixed:
            if name in opts:
                raise TypeError("MultiheadAttention: method %r sets %s itself" % (method, name))
        self.method_options = {**fixed, **opts}
        if num_features is not None and registered != "favor":
            raise TypeError("MultiheadAttention: num_features is an option of method 'favor' only")
        if features is not None and registered != "favor":
            raise TypeError("MultiheadAttention: features is an option of method 'favor' only")
        if features is not None and features not in _FEATURE_KINDS:
            raise ValueError("MultiheadAttention: features must be one of %s, got %r" % (", ".join(_FEATURE_KINDS), features))
        self.features = features if features is not None else "orthogonal"
        if self.feature_redraw_interval is not None and registered != "favor":  # count() checked it is >= 1
            raise ValueError("MultiheadAttention: feature_redraw_interval is for method 'favor', an integer >= 1")
        if (s_proj is not None or max_seq_len is not None) and registered != "linformer":
            raise TypeError("MultiheadAttention: s_proj and max_seq_len are options of method 'linformer' only")
        if kernel_size is not None and registered not in ("linear", "nystrom"):
            raise TypeError("MultiheadAttention: a depthwise convolution is an option of the linear and nystrom "
                            "methods only")

        self._init_projections(factory, bias)

        np_dtype = np.float64 if dtype == torch.float64 else np.float32
        if registered == "favor":
            self.num_features = int(num_features if num_features is not None else info["default_size"])
            self.register_buffer("redraws", torch.zeros((), dtype=torch.int64, device=device))
            # Drawn in float32 for a bfloat16/float16 module, then rounded to its dtype.
            self.register_buffer("projection", self._draw_projection(0, np_dtype).to(**factory))
            self._forwards = 0
        if registered == "linformer":
            if max_seq_len is None:
                raise ValueError("MultiheadAttention: method 'linformer' needs max_seq_len (the columns of e and f)")
            s = int(s_proj if s_proj is not None else info["default_size"])
            e, f = _linattn.linformer_projections(s, int(max_seq_len), seed=self.seed, dtype=np_dtype)
            self.e = torch.nn.Parameter(torch.from_numpy(e).to(**factory))
            self.f = torch.nn.Parameter(torch.from_numpy(f).to(**factory))
        self.conv_weight = None
        if kernel_size is not None:  # count() checked it is an integer >= 1
            k = kernel_size
            self.conv_weight = torch.nn.Parameter(torch.empty((num_heads, k), **factory))
            torch.nn.init.uniform_(self.conv_weight, -1 / math.sqrt(k), 1 / math.sqrt(k))

    def _init_projections(self, factory, bias):
        self.in_proj_weight = torch.nn.Parameter(torch.empty((3 * self.embed_dim, self.embed_dim), **factory))
        self.in_proj_bias = torch.nn.Parameter(torch.empty(3 * self.embed_dim, **factory)) if bias else None
        self.out_proj = torch.nn.Linear(self.embed_dim, self.embed_dim, bias=bias, **factory)
        torch.nn.init.xavier_uniform_(self.in_proj_weight)
        if bias:
            torch.nn.init.zeros_(self.in_proj_bias)
            torch.nn.init.zeros_(self.out_proj.bias)

    def _init_learned(self, options, factory, bias):
        """A learned map's method: its query_map and key_map (the map's options and init), and
        with window > 0 the sliding-window hybrid with a learned gate window_gate [heads]
        (γ = sigmoid, 1/2 at first)."""
        cls, fn = self._learned, "MultiheadAttention"
        defaults = {**cls.options, "init": cls.inits[0], **_LEARNED_METHOD_OPTIONS}
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            raise TypeError("MultiheadAttention: method %r takes no option %s (its options: %s)"
                            % (self.method, ", ".join(map(repr, unknown)), ", ".join(sorted(defaults))))
        o = {**defaults, **options}
        o["window"] = window = _options.integer(fn, "window", o["window"], 0)
        o["eps"] = _options.real(fn, "eps", o["eps"], minimum=0.0)
        o["init"] = _options.choice(fn, "init", o["init"], cls.inits)
        own = cls.check_options(fn, {k: o[k] for k in cls.options})
        o.update(own)
        self.method_options = o
        self.feature_redraw_interval = None
        self._init_projections(factory, bias)
        self.query_map = cls(self.num_heads, self.head_dim, init=o["init"], **own, **factory)
        self.key_map = cls(self.num_heads, self.head_dim, init=o["init"], **own, **factory)
        self.window_gate = torch.nn.Parameter(torch.zeros(self.num_heads, **factory)) if window > 0 else None
        self.conv_weight = None

    def _learned_attention(self, q, k, v, causal, key_lengths):
        from . import hybrid_attention, linear_attention
        o = self.method_options
        if not o["window"]:
            return linear_attention(self.query_map(q), self.key_map(k), v, feature_map="given", causal=causal,
                                    key_lengths=key_lengths, eps=o["eps"])
        return hybrid_attention(q, k, v, query_features=self.query_map(q), key_features=self.key_map(k),
                                window_gate=self.window_gate, window=o["window"], feature_map="given", causal=causal,
                                key_lengths=key_lengths, eps=o["eps"])

    # ---- random features -----------------------------------------------------------------------

    def _draw_projection(self, redraw, np_dtype):
        # Draw i of the module's seeded sequence: the same projections in every run.
        return torch.from_numpy(_linattn.random_features(self.num_features, self.head_dim, self.features,
                                                         (self.seed + 0x9E3779B9 * redraw) % 2**63, np_dtype))

    def redraw_features(self):
        """Draws the next projection of the seeded sequence (favor); reproducible from the seed."""
        if self._registered != "favor":
            raise ValueError("MultiheadAttention: redraw_features() is for method 'favor', not %r" % self.method)
        with torch.no_grad():
            self.redraws += 1
            np_dtype = np.float64 if self.projection.dtype == torch.float64 else np.float32
            self.projection.copy_(self._draw_projection(int(self.redraws), np_dtype))

    # ---- forward -------------------------------------------------------------------------------

    def _heads(self, x):  # [B, n, E] -> [B, H, n, hd]
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def _project(self, query, key, value):
        w, b = self.in_proj_weight, self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        wq, wk, wv = w.chunk(3)
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _tensors(self):
        if self._registered == "favor":
            return {"projection": self.projection}
        if self._registered == "linformer":
            return {"e": self.e, "f": self.f}
        if self.conv_weight is not None:
            return {"conv_weight": self.conv_weight}
        return {}

    def forward(self, query, key=None, value=None, key_padding_mask=None, is_causal=False, key_lengths=None):
        """query [B, n_q, E], key and value [B, n_k, E] (default: query) -> [B, n_q, E].

        key_padding_mask: bool [B, n_k], True at padded keys, which must be a suffix of each row
        (padding at the end); or key_lengths [B] directly. is_causal: each query sees the keys
        up to its own position (n_q == n_k; not for nystrom, linformer, efficient)."""
        key = query if key is None else key
        value = key if value is None else value
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError("MultiheadAttention: query, key and value must be [batch, seq, embed_dim] (batch first)")
        if key_padding_mask is not None:
            if key_lengths is not None:
                raise ValueError("MultiheadAttention: pass key_padding_mask or key_lengths, not both")
            key_lengths = _lengths_of_mask(key_padding_mask, key.shape[:2])
        if self.training and self.feature_redraw_interval is not None:
            self._forwards += 1
            if self._forwards % self.feature_redraw_interval == 0:
                self.redraw_features()
        q, k, v = (self._heads(x) for x in self._project(query, key, value))
        if self._learned is not None:
            attn = self._learned_attention(q, k, v, bool(is_causal), key_lengths)
        else:
            attn = getattr(sys.modules[__package__], self._function)(q, k, v, **self._tensors(), causal=bool(is_causal),
                                                                     key_lengths=key_lengths, **self.method_options)
        out = attn.transpose(1, 2).reshape(query.shape[0], query.shape[1], self.embed_dim)
        if self.training and self.dropout > 0:
            out = F.dropout(out, self.dropout)
        return self.out_proj(out)

    # ---- decoding ------------------------------------------------------------------------------

    def init_state(self, batch_size):
        """A decoding state for batch_size sequences (causal kernelized methods: elu, relu,
        focused, linear, favor; the learned maps: hedgehog, ...). Decoding runs without autograd. The state records
        what made it (the method, its options, the heads and the dtype): step refuses a state
        of another kind of module."""
        batch_size = _options.integer("MultiheadAttention.init_state", "batch_size", batch_size, 1)
        if self._learned is not None:
            return LearnedDecodingState(batch_size, self.num_heads, self.head_dim, self.query_map.dim,
                                        self.method_options["window"], self.in_proj_weight.detach(), self._maker())
        if self._registered not in ("linear", "favor"):
            raise ValueError("MultiheadAttention: recurrent decoding is for the kernelized methods (elu, relu, "
                             "focused, linear, favor), not %r" % self.method)
        o = self.method_options
        dtype = np.float64 if self.in_proj_weight.dtype == torch.float64 else np.float32
        if self._registered == "favor":
            rs = _linattn.recurrent_state(batch_size, self.num_heads, self.head_dim, self.head_dim, feature_map="favor",
                                          projection=self.projection.detach().cpu().to(
                                              torch.float64 if dtype == np.float64 else torch.float32).numpy(),
                                          kernel=o.get("kernel", "positive"), scale=o.get("scale"), dtype=dtype)
        else:
            rs = _linattn.recurrent_state(batch_size, self.num_heads, self.head_dim, self.head_dim,
                                          feature_map=o.get("feature_map", "elu"), eps=o.get("eps", 1e-6),
                                          focus_power=o.get("focus_power", 3.0), dtype=dtype)
        values = None
        if self.conv_weight is not None:
            values = self.in_proj_weight.new_zeros((batch_size, self.num_heads, self.conv_weight.shape[1] - 1,
                                                    self.head_dim))
        return DecodingState(rs, values, self._maker(), batch_size)

    def _maker(self):
        """What a decoding state must have been made by: the method, its options, the heads and
        the state's dtype (the learned weights are read at each step, so they may change)."""
        conv = None if self.conv_weight is None else tuple(self.conv_weight.shape)
        return {"method": self.method, "options": dict(self.method_options), "num_heads": self.num_heads,
                "head_dim": self.head_dim, "convolution": conv,
                "num_features": getattr(self, "num_features", None),
                "dtype": accumulator_dtype(self.in_proj_weight.dtype)}

    def _check_state(self, state, batch):
        fn = "MultiheadAttention.step"
        if not isinstance(state, (DecodingState, LearnedDecodingState)):
            raise TypeError("%s: state must be what this module's init_state(batch_size) returned, got %s"
                            % (fn, type(state).__name__))
        mine = self._maker()
        if state.maker != mine:
            differ = sorted(k for k in mine if state.maker.get(k) != mine[k])
            raise ValueError("%s: the state was made by a MultiheadAttention with %s; this one has %s: a state holds "
                             "its own method's sums and window, start one with this module's init_state"
                             % (fn, ", ".join("%s=%r" % (k, state.maker.get(k)) for k in differ),
                                ", ".join("%s=%r" % (k, mine[k]) for k in differ)))
        if batch != state.batch_size:
            raise ValueError("%s: x_t has batch %d, the state holds %d sequences" % (fn, batch, state.batch_size))

    @torch.no_grad()
    def step(self, x_t, state):
        """x_t [B, E] (or [B, 1, E]): the next token of each sequence -> [B, E] (or [B, 1, E]):
        row t of the causal forward over the tokens so far, to float rounding. state: what this
        module's init_state(B) returned (TypeError otherwise; ValueError for a state made by a
        module with another method, options, heads or dtype, or for another batch size)."""
        if not isinstance(x_t, torch.Tensor):
            raise TypeError("MultiheadAttention.step: x_t must be a torch.Tensor, got %s" % type(x_t).__name__)
        squeeze = x_t.dim() == 2
        x = x_t.unsqueeze(1) if squeeze else x_t
        if x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != self.embed_dim:
            raise ValueError("MultiheadAttention.step: x_t must be [batch, embed_dim = %d] or [batch, 1, embed_dim], "
                             "got %s" % (self.embed_dim, tuple(x_t.shape)))
        self._check_state(state, x.shape[0])
        q, k, v = (self._heads(y)[:, :, 0] for y in self._project(x, x, x))
        if isinstance(state, LearnedDecodingState):
            gamma = torch.sigmoid(self.window_gate) if self.window_gate is not None else q.new_ones(self.num_heads)
            out = state.step(q, k, v, (self.query_map, self.key_map), gamma, 1 / math.sqrt(self.head_dim),
                             self.method_options["eps"])
            out = self.out_proj(out.reshape(x.shape[0], 1, self.embed_dim))
            return out[:, 0] if squeeze else out
        # The state is float32 for a bfloat16/float16 module: its sums accumulate in float32.
        state_dtype = accumulator_dtype(q.dtype)
        out = torch.from_numpy(state._recurrent.step(*(t.to(state_dtype).contiguous().numpy() for t in (q, k, v))))
        if state._values is not None:
            # Causal depthwise convolution: out += Σ_t w[h, t]·v[i + t − (K−1)], in the state's dtype.
            window = torch.cat([state._values, v.unsqueeze(2)], dim=2)  # [B, H, K, hd]
            out = out + torch.einsum("bhkd,hk->bhd", window.to(state_dtype), self.conv_weight.to(state_dtype))
            state._values = window[:, :, 1:].clone()
        out = out.to(q.dtype)
        out = self.out_proj(out.reshape(x.shape[0], 1, self.embed_dim))
        return out[:, 0] if squeeze else out

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_torch(cls, mha, method="softmax", **method_options):
        """A MultiheadAttention with `mha`'s (torch.nn.MultiheadAttention) projections and
        dropout, running `method`: swaps a method into a trained model. Batch-first: if mha was
        batch_first=False, transpose its inputs."""
        if not isinstance(mha, torch.nn.MultiheadAttention):
            raise TypeError("MultiheadAttention.from_torch: expected a torch.nn.MultiheadAttention, got %s"
                            % type(mha).__name__)
        if not mha._qkv_same_embed_dim:
            raise ValueError("MultiheadAttention.from_torch: kdim and vdim must equal embed_dim")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("MultiheadAttention.from_torch: add_bias_kv and add_zero_attn are not supported")
        w = mha.in_proj_weight
        m = cls(mha.embed_dim, mha.num_heads, method, bias=mha.in_proj_bias is not None, dropout=mha.dropout,
                device=w.device, dtype=w.dtype, **method_options)
        with torch.no_grad():
            m.in_proj_weight.copy_(w)
            m.out_proj.weight.copy_(mha.out_proj.weight)
            if mha.in_proj_bias is not None:
                m.in_proj_bias.copy_(mha.in_proj_bias)
                m.out_proj.bias.copy_(mha.out_proj.bias)
        return m


def _lengths_of_mask(mask, shape):
    """key_padding_mask (bool [B, n_k], True = padded) -> key_lengths [B]; the padding must be a
    suffix of each row."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError("MultiheadAttention: key_padding_mask must be a bool tensor (True at padded keys)")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError("MultiheadAttention: key_padding_mask has shape %s; expected %s"
                         % (tuple(mask.shape), tuple(shape)))
    lengths = (~mask).sum(dim=1)
    if not torch.compiler.is_compiling():
        suffix = torch.arange(mask.shape[1], device=mask.device)[None, :] >= lengths[:, None]
        if not torch.equal(suffix, mask):
            raise ValueError("MultiheadAttention: key_padding_mask must mark a suffix of each row (padding at "
                             "the end); linattn's masks keep a prefix of the keys")
    return lengths
