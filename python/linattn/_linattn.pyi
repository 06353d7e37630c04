"""
linattn: linear-cost attention and exact softmax attention (NumPy interface)
"""
from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
import typing
__all__: list[str] = ['RecurrentState', 'build_info', 'causal_conv1d', 'causal_conv1d_backward', 'chi_quantile_radii', 'feature_logits', 'feature_logits_backward', 'features', 'features_backward', 'gated_delta_rule', 'gated_delta_rule_backward', 'gated_linear_attention', 'gated_linear_attention_backward', 'get_num_threads', 'hedgehog_features', 'hedgehog_features_backward', 'hybrid_decode_step', 'hybrid_prefill', 'linformer_projections', 'measure_peak_rates', 'random_features', 'recurrent_state', 'release_cached_memory', 'reset_workspace_peak', 'set_num_threads', 'share_openmp_runtime', 'thread_pool', 'use_own_threads', 'workspace_stats']
class RecurrentState:
    """
    Constant-size decoding state; make one with recurrent_state().
    """
    def copy(self) -> RecurrentState:
        """
        An independent copy, to roll back to (or for another thread).
        """
    def prefill(self, q: numpy.ndarray, k: numpy.ndarray, v: numpy.ndarray) -> numpy.ndarray:
        """
        [B,H,n,d] in, [B,H,n,d_v] out: causal outputs of n tokens, chunked.
        """
    def step(self, q_t: numpy.ndarray, k_t: numpy.ndarray, v_t: numpy.ndarray) -> numpy.ndarray:
        """
        [B,H,d] in, [B,H,d_v] out: one token.
        """
    @property
    def dtype(self) -> numpy.dtype[typing.Any]:
        ...
    @property
    def tokens(self) -> int:
        ...
def _apply_state(q: typing.Any, state: typing.Any, feature_map: str, kernel: typing.Any, scale: typing.Any, eps: typing.SupportsFloat | typing.SupportsIndex, focus_power: typing.SupportsFloat | typing.SupportsIndex, projection: typing.Any) -> tuple:
    ...
def _apply_state_backward(q: typing.Any, state: typing.Any, dout: typing.Any, out: typing.Any, den: typing.Any, feature_map: str, kernel: typing.Any, scale: typing.Any, eps: typing.SupportsFloat | typing.SupportsIndex, focus_power: typing.SupportsFloat | typing.SupportsIndex, projection: typing.Any) -> tuple:
    ...
def _backward(name: str, q: numpy.ndarray, k: numpy.ndarray, v: numpy.ndarray, dout: numpy.ndarray, tensors: dict, options: dict, saved: dict) -> tuple:
    ...
def _causal_from_state(q: typing.Any, k: typing.Any, v: typing.Any, prefix: typing.Any, key_lengths: typing.Any, feature_map: str, kernel: typing.Any, scale: typing.Any, eps: typing.SupportsFloat | typing.SupportsIndex, focus_power: typing.SupportsFloat | typing.SupportsIndex, projection: typing.Any) -> tuple:
    ...
def _causal_from_state_backward(q: typing.Any, k: typing.Any, v: typing.Any, prefix: typing.Any, dout: typing.Any, out: typing.Any, den: typing.Any, dstate_after: typing.Any, key_lengths: typing.Any, feature_map: str, kernel: typing.Any, scale: typing.Any, eps: typing.SupportsFloat | typing.SupportsIndex, focus_power: typing.SupportsFloat | typing.SupportsIndex, projection: typing.Any) -> tuple:
    ...
def _efficient_apply_state(q: typing.Any, state: typing.Any, scale: typing.Any) -> numpy.ndarray:
    ...
def _efficient_apply_state_backward(q: typing.Any, state: typing.Any, dout: typing.Any, scale: typing.Any) -> tuple:
    ...
def _efficient_key_state(k: typing.Any, v: typing.Any, key_lengths: typing.Any, scale: typing.Any) -> numpy.ndarray:
    ...
def _efficient_key_state_backward(k: typing.Any, v: typing.Any, state: typing.Any, dstate: typing.Any, key_lengths: typing.Any, scale: typing.Any) -> tuple:
    ...
def _feature_dim(name: str, head_dim: typing.SupportsInt | typing.SupportsIndex, tensor_shapes: dict, options: dict) -> int:
    ...
def _fingerprint(buffer: typing.Any) -> tuple:
    """
    (bytes, low, high 32 bits of the hash) of a C-contiguous buffer: the distributed agreement check's fingerprint of a tensor (exact integer sums of its 64-bit words, plain and position-weighted).
    """
def _forward(name: str, q: numpy.ndarray, k: numpy.ndarray, v: numpy.ndarray, tensors: dict, options: dict, want_saved: collections.abc.Sequence[str]) -> typing.Any:
    ...
def _key_state(k: typing.Any, v: typing.Any, key_lengths: typing.Any, feature_map: str, kernel: typing.Any, scale: typing.Any, eps: typing.SupportsFloat | typing.SupportsIndex, focus_power: typing.SupportsFloat | typing.SupportsIndex, projection: typing.Any) -> numpy.ndarray:
    ...
def _key_state_backward(k: typing.Any, v: typing.Any, state: typing.Any, dstate: typing.Any, key_lengths: typing.Any, feature_map: str, kernel: typing.Any, scale: typing.Any, eps: typing.SupportsFloat | typing.SupportsIndex, focus_power: typing.SupportsFloat | typing.SupportsIndex, projection: typing.Any) -> tuple:
    ...
def _linformer_project(k: typing.Any, v: typing.Any, e: typing.Any, f: typing.Any, offset: typing.SupportsInt | typing.SupportsIndex, key_lengths: typing.Any) -> numpy.ndarray:
    ...
def _linformer_project_backward(k: typing.Any, v: typing.Any, e: typing.Any, f: typing.Any, dprojected: typing.Any, offset: typing.SupportsInt | typing.SupportsIndex, key_lengths: typing.Any, param_grads: bool) -> tuple:
    ...
def _methods() -> list:
    ...
def _plain_feature_bound(feature_map: str, x_max: typing.SupportsFloat | typing.SupportsIndex, head_dim: typing.SupportsInt | typing.SupportsIndex) -> float:
    ...
def build_info() -> str:
    """
    The BLAS (and its kernels) and SIMD target this build runs on.
    """
def causal_conv1d(x: typing.Any, weight: typing.Any, bias: typing.Any = None, *, initial_state: typing.Any = None, return_state: bool = False, activation: typing.Any = 'silu') -> typing.Any:
    """
    The causal depthwise convolution in front of gated-delta-rule and KDA layers (causal_conv1d_fn):
    out[b,c,t] = act(bias[c] + Σ_j weight[c,j]·x̃[b,c,t+j]), x̃ = x [B, C, T] (float32 or float64) with
    the W-1 positions before it in front: initial_state [B, C, W-1] (the last inputs of the previous
    call), zeros without one. weight [C, W], bias [C] or None; activation "silu" (or "swish") or
    None. return_state=True returns (out, final state [B, C, W-1]): two calls over a split equal one
    call.
    """
def causal_conv1d_backward(x: typing.Any, weight: typing.Any, dout: typing.Any, *, bias: typing.Any = None, initial_state: typing.Any = None, dstate: typing.Any = None, activation: typing.Any = 'silu') -> tuple:
    """
    (dx, dweight, dbias, dinitial_state) of causal_conv1d for dout [B, C, T] and dstate (None: 0);
    dbias is None without a bias, dinitial_state of zeros' gradient without an initial state.
    """
def chi_quantile_radii(num_features: typing.SupportsInt | typing.SupportsIndex, head_dim: typing.SupportsInt | typing.SupportsIndex) -> numpy.ndarray:
    """
    The radii R_i, P(r <= R_i) = i/(m+1) for r ~ chi(head_dim), i = 1..m (sorted).
    """
def feature_logits(x: typing.Any, projection: typing.Any, *, kernel: str = 'positive', scale: typing.Any = None, side: str = 'key') -> tuple:
    """
    FAVOR's feature maps in log form, by the kernels' own code: (logits, factors), phi = factors·exp(logits)
    up to a factor shared by every row and feature. x [B, H, n, d], projection omega [m, d] (float32 or
    float64, finite); scale default 1/sqrt(d). With U = x~·omegaᵀ, x~ = sqrt(scale)·x, h = |x~|²/2:
    side "key" or "query_with_norm": positive U - h, hyperbolic [U - h, -U - h], trig h; side "query"
    (h cancels in a query's row): U, [U, -U], 0. factors: [sin U, cos U] for trig, else None.
    "query_with_norm": a query whose weights share a normaliser with exact ones (hybrid_attention).
    """
def feature_logits_backward(x: typing.Any, projection: typing.Any, dlogits: typing.Any, dfactors: typing.Any = None, *, kernel: str = 'positive', scale: typing.Any = None, side: str = 'key') -> numpy.ndarray:
    """
    dx [B, H, n, d] of feature_logits for dlogits and (trig) dfactors (None: 0). The projection takes
    no gradient: it is a constant of the method.
    """
def features(x: typing.Any, feature_map: str = 'elu', *, focus_power: typing.SupportsFloat | typing.SupportsIndex = 3.0) -> numpy.ndarray:
    """
    The plain feature maps of linear attention on their own, by the kernels' own code: x [B, H, n, d]
    (float32 or float64, finite) -> phi(x) [B, H, n, d]. feature_map "elu" (elu(x) + 1), "relu",
    "focused" (|r|·r^p/|r^p|, r = relu(x), p = focus_power in [1, 1000]) or "given" (x itself,
    which must be >= 0). FAVOR's maps are in log form: feature_logits.
    """
def features_backward(x: typing.Any, dphi: typing.Any, feature_map: str = 'elu', *, focus_power: typing.SupportsFloat | typing.SupportsIndex = 3.0) -> numpy.ndarray:
    """
    dx = (d phi / d x)ᵀ·dphi [B, H, n, d] of features(x, feature_map, focus_power=...).
    """
def gated_delta_rule(q: typing.Any, k: typing.Any, v: typing.Any, g: typing.Any, beta: typing.Any, *, scale: typing.Any = None, initial_state: typing.Any = None, return_state: bool = False, use_qk_l2norm_in_kernel: bool = False) -> typing.Any:
    """
    The gated delta rule (Gated DeltaNet) and, with per-channel gates, KDA (Kimi Linear):
    S_t = (I - beta_t k_t k_tᵀ)·diag(exp(g_t))·S_{t-1} + beta_t k_t v_tᵀ, o_t = scale·S_tᵀ q_t.
    
    q, k [B, H_k, n, d_k], v [B, H, n, d_v] (float32 or float64), H a multiple of H_k (value head h
    reads key head h // (H // H_k)); g [B, H, n] (per head) or [B, H, n, d_k] (per channel, KDA),
    values <= 0 (-inf: a reset); beta [B, H, n] in [0, 2]; scale default d_k^-1/2.
    use_qk_l2norm_in_kernel: q and k divided by sqrt(|x|² + 1e-6) first. initial_state
    [B, H, d_k, d_v] continues a sequence (two calls over a split equal one call); return_state=True
    returns (out, S_n). Causal, chunked (64 positions, the UT transform).
    """
def gated_delta_rule_backward(q: typing.Any, k: typing.Any, v: typing.Any, g: typing.Any, beta: typing.Any, dout: typing.Any, *, scale: typing.Any = None, initial_state: typing.Any = None, dstate: typing.Any = None, use_qk_l2norm_in_kernel: bool = False) -> tuple:
    """
    (dq, dk, dv, dg, dbeta, dinitial_state) of gated_delta_rule for dout [B, H, n, d_v] and dstate,
    the gradient of the returned final state (None: 0). dq and dk have q's and k's shapes (grouped
    heads summed); dinitial_state is of zeros' gradient when no initial state was given.
    """
def gated_linear_attention(q: typing.Any, k: typing.Any, v: typing.Any, log_gate: typing.Any, *, scale: typing.Any = None, causal: bool = True, initial_state: typing.Any = None, return_state: bool = False) -> typing.Any:
    """
    Gated (decayed) linear attention: S_t = diag(exp(g_t))·S_{t-1} + k_t v_tᵀ, o_t = scale·S_tᵀ q_t.
    
    q, k [B, H, n, d_k], v [B, H, n, d_v] (float32 or float64); log_gate g [B, H, n] (per head) or
    [B, H, n, d_k] (per channel), values <= 0 (-inf: a reset); scale default d_k^-1/2; no
    normaliser. initial_state [B, H, d_k, d_v] continues a sequence (two calls over a split equal
    one call); return_state=True returns (out, S_n). Chunked (64 positions). causal=False: every
    output reads every position, decayed both ways: o_t = scale·Σ_s (q_t ⊙ e_ts)ᵀ k_s v_s with e_ts
    = Π exp(g_u) over min(s,t) < u <= max(s,t); no state (initial_state and return_state need
    causal=True).
    """
def gated_linear_attention_backward(q: typing.Any, k: typing.Any, v: typing.Any, log_gate: typing.Any, dout: typing.Any, *, scale: typing.Any = None, causal: bool = True, initial_state: typing.Any = None, dstate: typing.Any = None) -> tuple:
    """
    (dq, dk, dv, dlog_gate, dinitial_state) of gated_linear_attention for dout [B, H, n, d_v] and
    dstate, the gradient of the returned final state (None: 0). dinitial_state is the gradient of
    the initial state (of zeros when none was given).
    """
def get_num_threads() -> int:
    ...
def hedgehog_features(x: typing.Any, weight: typing.Any, bias: typing.Any) -> numpy.ndarray:
    """
    Hedgehog's learned feature map by the kernels' code: phi(x) = [softmax(x·W_h + b_h),
    softmax(-(x·W_h + b_h))] per head h; x [B, H, n, d], weight [H, d, f], bias [H, f] (float32 or
    float64, one dtype, finite) -> [B, H, n, 2f], each half summing to 1.
    """
def hedgehog_features_backward(x: typing.Any, weight: typing.Any, bias: typing.Any, dphi: typing.Any, *, phi: typing.Any = None) -> tuple:
    """
    (dx, dweight, dbias) of sum(dphi * hedgehog_features(x, weight, bias)), dphi [B, H, n, 2f];
    phi: the forward's result, read instead of made again (None: made from x).
    """
def hybrid_decode_step(q: typing.Any, k: typing.Any, v: typing.Any, query_features: typing.Any, leaving_features: typing.Any, advance: typing.Any, window_weight: typing.Any, log_decay: typing.Any, sums: typing.Any, normaliser: typing.Any, exact_keys: typing.Any, exact_values: typing.Any, exact_valid: typing.Any, counts: typing.Any, *, window: typing.SupportsInt | typing.SupportsIndex, sinks: typing.SupportsInt | typing.SupportsIndex, scale: typing.SupportsFloat | typing.SupportsIndex, eps: typing.SupportsFloat | typing.SupportsIndex, query_weight: typing.Any = None, query_bias: typing.Any = None, key_weight: typing.Any = None, key_bias: typing.Any = None, feature_map: str = 'given', focus_power: typing.SupportsFloat | typing.SupportsIndex = 3.0, projection: typing.Any = None, kernel: str = 'positive', shift: typing.Any = None) -> typing.Any:
    """
    One decoding step of the causal sliding-window + linear hybrid for every batch row and head,
    in place on its state (include/linattn/hybrid.h; linattn.hf's LinattnCache runs it): q [B, H, d],
    k [B, H_kv, d], v [B, H_kv, d_v] (grouped queries: H_kv divides H; query head h reads key head
    h / (H / H_kv)), query_features φ(q) and leaving_features (φ of the key leaving the window, for each
    query head's map) [B, H, m'], advance [B] bool, window_weight γ [H], log_decay λ [H] or None; the
    state arrays sums [B, H, m', d_v], normaliser [B, H, m'], exact_keys [B, H_kv, s + w, d],
    exact_values [B, H_kv, s + w, d_v] (q's dtype),
    exact_valid [B, s + w] bool and counts [B] int64 are changed in place. Returns out [B, H, d_v].
    With Hedgehog's maps (query_weight, key_weight [H, d, f], query_bias, key_bias [H, f], all four)
    the step makes both features itself (hedgehog_features' formula, m' = 2f): pass None for
    query_features and leaving_features. So it does with feature_map "elu", "relu" or "focused"
    (focus_power; features()' formula, m' = d); "given" (the default) takes the features passed.
    window=0 (sinks 0, exact arrays of 0 slots) is linear attention's step: the new key enters the
    sums at once (leaving_features are its features). feature_map="favor" with projection ω
    [num_features, d] and kernel ("positive", "hyperbolic"; "trig" with window 0): FAVOR+'s features
    made by the step in log form, shift [B, H, m'] the sums' per-feature scales (-inf: no key yet),
    changed in place with them.
    """
def hybrid_prefill(k: typing.Any, v: typing.Any, key_features: typing.Any, valid: typing.Any, log_decay: typing.Any, sums: typing.Any, normaliser: typing.Any, exact_keys: typing.Any, exact_values: typing.Any, exact_valid: typing.Any, counts: typing.Any, *, window: typing.SupportsInt | typing.SupportsIndex, sinks: typing.SupportsInt | typing.SupportsIndex, key_weight: typing.Any = None, key_bias: typing.Any = None, feature_map: str = 'given', focus_power: typing.SupportsFloat | typing.SupportsIndex = 3.0, projection: typing.Any = None, kernel: str = 'positive', scale: typing.SupportsFloat | typing.SupportsIndex = 0.0, shift: typing.Any = None) -> typing.Any:
    """
    The causal sliding-window + linear hybrid's decoding state after a prompt, written over the
    state arrays (include/linattn/hybrid.h; linattn.hf's LinattnCache runs it once per layer after
    the prompt): what hybrid_decode_step continues from, as if the prompt's tokens had been stepped
    through it. k [B, H_kv, n, d], v [B, H_kv, n, d_v]; valid [B, n] bool marks each row's tokens
    (None: all of them); key_features φ(k) [B, H, n, m'] of each query head's map on its key head's
    keys; log_decay λ [H] or None; sums [B, H, m', d_v], normaliser [B, H, m'], exact_keys
    [B, H_kv, s + w, d], exact_values [B, H_kv, s + w, d_v] (k's dtype), exact_valid [B, s + w] bool
    and counts [B] int64 are overwritten. Of a row's c tokens, the last w fill the ring (token i at
    slot s + i mod w), the first s of the others the sink slots, and the rest enter the sums weighed
    by e^{λ_h·(c − 1 − i)}. With Hedgehog's key map (key_weight [H, d, f], key_bias [H, f]) or
    feature_map "elu", "relu" or "focused" (focus_power) the prefill makes the features itself: pass
    None for key_features. feature_map="favor" with projection, kernel and scale (x̃ = √scale·x): FAVOR+'s
    features in log form, shift [B, H, m'] overwritten with the sums' per-feature scales. Returns None.
    """
def linformer_projections(s_proj: typing.SupportsInt | typing.SupportsIndex, n_max: typing.SupportsInt | typing.SupportsIndex, *, heads: int | None = None, seed: typing.SupportsInt | typing.SupportsIndex = 0, dtype: numpy.typing.DTypeLike = ...) -> tuple:
    """
    (e, f) initialised as fairseq's Linformer does: Xavier-uniform, gain 1/sqrt(2),
    i.e. uniform on (-a, a), a = sqrt(3 / (n_max + s_proj)). heads=None: shared [s_proj, n_max];
    else [heads, s_proj, n_max]. Reproducible by seed.
    """
def measure_peak_rates(threads: typing.SupportsInt | typing.SupportsIndex | None = None) -> dict:
    """
    The measured arithmetic peak of `threads` threads (default: get_num_threads()), in GFLOP/s:
    {"float32_fma_gflops", "bfloat16_dot_gflops"} from register-only loops of float32 FMAs and of
    bfloat16 dot products (vdpbf16ps; 0.0 where the CPU has no AVX512-BF16), the best of 3 runs of
    about 0.2 s each. What the benchmarks' "% of peak" divides by. threads outside 1..1024: ValueError.
    """
def random_features(num_features: typing.SupportsInt | typing.SupportsIndex, head_dim: typing.SupportsInt | typing.SupportsIndex, kind: str = 'orthogonal', seed: typing.SupportsInt | typing.SupportsIndex = 0, dtype: numpy.typing.DTypeLike = ...) -> numpy.ndarray:
    """
    Random projection ω [num_features, head_dim] for FAVOR attention.
    
    kind: "iid" (rows N(0, I)), "orthogonal" (blocks of head_dim orthogonal rows, norms ~ chi(d)),
    "orthogonal_fixed" (norms sqrt(d)), "quantile" (norms the chi(d) quantiles at i/(m+1), in a
    seeded order). Same seed, same matrix on every machine and thread count.
    """
def recurrent_state(batch: typing.SupportsInt | typing.SupportsIndex, heads: typing.SupportsInt | typing.SupportsIndex, head_dim: typing.SupportsInt | typing.SupportsIndex, value_dim: typing.SupportsInt | typing.SupportsIndex, *, feature_map: str = 'elu', projection: numpy.ndarray | None = None, kernel: str = 'positive', scale: float | None = None, eps: typing.SupportsFloat | typing.SupportsIndex = 1e-06, focus_power: typing.SupportsFloat | typing.SupportsIndex = 3.0, dtype: numpy.typing.DTypeLike | None = None) -> RecurrentState:
    """
    A decoding state for feature_map "elu", "relu", "focused" or "favor" (with projection).
    
    dtype: float32 or float64 (default: the projection's, else float32). Step outputs equal the
    causal outputs of linear_attention / favor_attention over the same tokens. A state holds one
    batch of sequences: using it from two threads at once raises ValueError (copy() it instead).
    """
def release_cached_memory() -> int:
    """
    Give back to the OS the freed blocks of 1 MiB and more that the library keeps for its next
    calls (at most 64 blocks, 256 MiB in all; reusing them skips the page faults and zeroing of fresh
    memory). Returns the bytes given back.
    """
def reset_workspace_peak() -> None:
    ...
def set_num_threads(n: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    Threads used by every kernel, 1..1024 (default: LINATTN_NUM_THREADS; else, under linattn.torch, torch's thread count, followed as it changes; else all cores).
    """
def share_openmp_runtime(through: str = '') -> str:
    """
    Runs the kernels' loops on the OpenMP runtime already loaded in the process, not on
    linattn's own helper threads, and returns its file ('' when none is found: nothing changes).
    through: a loaded library whose runtime to share (linattn.torch passes 'libtorch_cpu.so', so that
    it is torch's, whatever its file is called); '' looks for libgomp.so.1, then libiomp5.so.
    linattn.torch does so at import when torch runs on OpenMP, since OpenMP's idle workers spin for
    milliseconds after each torch operation and would take the cores from linattn's helpers. Results
    are the same bits either way. A forked child goes back to linattn's own threads.
    """
def thread_pool() -> str:
    """
    Which threads run the kernels' loops: 'own' or 'openmp <file>'.
    """
def use_own_threads() -> None:
    """
    Back to linattn's own helper threads (the default).
    """
def workspace_stats() -> dict:
    """
    Scratch memory the library holds now and at its peak since reset_workspace_peak().
    """
__version__: str = '0.2.0'
