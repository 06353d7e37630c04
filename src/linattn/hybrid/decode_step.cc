// One decoding step of the causal hybrid (include/linattn/hybrid.h, hybrid_decode_step): what
// LinattnCache runs per layer and token, in one call for every batch row and head instead of some
// forty torch operations (docs/linearize.md: about 0.9 ms a layer before). Its features are given
// (made by the caller) or made here: by Hedgehog's maps (core/hedgehog_map.h, the formula
// hedgehog_features runs), a fixed map by name, or FAVOR's projection (favor_step: logits, the
// sums in log form), each query head's map applied to its query and to the key entering the
// sums (the one leaving the window; window 0: the new one). Per (row, query head): the sums decay
// and the key leaving the window enters them (one pass over the sums, simd::decay_rank_one) or
// its sink slot, the new key takes its ring slot, and the query reads the exact slots
// (simd::row_dots for the scores, simd::state_dots for the weighted values) and the sums
// (simd::state_dots). A task is a row, a key head and up to four of its query heads, which read
// the key head's slots in one pass. Highway's kernels rather than BLAS: these are products of a
// few rows by a matrix, where sgemm's calls cost more than the arithmetic; a step is bound by
// reading the window's keys and values, stored once per key head (1.6 MB at SmolLM2's 3 key
// heads of 1028 slots, 4.7 MB if they were kept per query head). The float64 reference is the
// causal hybrid_attention itself: tests/test_hybrid.cc steps through a sequence and compares each
// token's output with the forward's row, and the maps' step with the step given
// hedgehog_features' features.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/feature_map.h"
#include "linattn/core/hedgehog_map.h"
#include "linattn/core/parallel.h"
#include "linattn/core/simd.h"
#include "linattn/hybrid.h"
#include "linattn/hybrid/decode_state.h"
#include "linattn/kernelized.h"

namespace linattn {
namespace {

template <class T>
void check_all(const char* fn, const char* name, TensorView<const T> x, double lo, double hi, const char* what) {
  for (int64_t i = 0, n = x.size(); i < n; ++i) {
    const double a = static_cast<double>(x.data[i]);
    require(std::isfinite(a) && a >= lo && a <= hi, fn, ": ", name, " must be ", what, ", got ", a, " at flat index ",
            i);
  }
}

}  // namespace

template <class T>
void check_decode_state(const char* fn, const HybridDecodeOptions& opts, TensorView<const T> log_decay,
                        const HybridDecodeState<T>& state, const DecodeShape& shape, bool favor, bool shift_values) {
  const int64_t B = shape.B, H = shape.H, Hkv = shape.Hkv, m = shape.m, d = shape.d, dv = shape.dv;
  require(opts.window >= 0, fn, ": window must be >= 0, got ", opts.window);
  require(opts.sinks >= 0, fn, ": sinks must be >= 0, got ", opts.sinks);
  require(opts.window >= 1 || opts.sinks == 0, fn, ": sinks=", opts.sinks,
          " needs window >= 1 (window 0: linear attention alone)");
  require(favor || opts.kernel == "positive", fn, ": kernel=\"", opts.kernel, "\" applies to feature_map=\"favor\" only");
  if (log_decay.data) {
    check_shape(fn, "log_decay", log_decay, {H});
    check_all(fn, "log_decay", log_decay, -std::numeric_limits<double>::infinity(), 0, "finite and <= 0");
  }
  const int64_t slots = opts.sinks + opts.window;
  check_shape(fn, "sums", TensorView<const T>(state.sums), {B, H, m, dv});
  check_shape(fn, "normaliser", TensorView<const T>(state.normaliser), {B, H, m});
  check_shape(fn, "exact_keys", TensorView<const T>(state.exact_keys), {B, Hkv, slots, d});
  check_shape(fn, "exact_values", TensorView<const T>(state.exact_values), {B, Hkv, slots, dv});
  check_shape(fn, "exact_valid", TensorView<const bool>(state.exact_valid), {B, slots});
  check_shape(fn, "counts", TensorView<const int64_t>(state.counts), {B});
  if (!favor) {
    require(!state.shift.data, fn, ": shift is FAVOR's (feature_map=\"favor\"); plain features keep none");
    return;
  }
  require(state.shift.data != nullptr, fn, ": feature_map=\"favor\" keeps its sums in log form: shift [B, H, m'] is "
          "required");
  check_shape(fn, "shift", TensorView<const T>(state.shift), {B, H, m});
  for (int64_t i = 0, n = state.shift.size(); i < n && shift_values; ++i) {
    const double c = static_cast<double>(state.shift.data[i]);
    require(std::isfinite(c) || c == -std::numeric_limits<double>::infinity(), fn,
            ": shift must be finite or -inf, got ", c, " at flat index ", i);
  }
}
template void check_decode_state(const char*, const HybridDecodeOptions&, TensorView<const float>,
                                 const HybridDecodeState<float>&, const DecodeShape&, bool, bool);
template void check_decode_state(const char*, const HybridDecodeOptions&, TensorView<const double>,
                                 const HybridDecodeState<double>&, const DecodeShape&, bool, bool);

template <class T>
FeatureMap<T> fixed_decode_map(const char* fn, const HybridDecodeOptions& opts, int64_t head_dim) {
  const FeatureMapKind kind = parse_plain_feature_map(fn, opts.feature_map);  // names the fixed maps
  require(kind != FeatureMapKind::Given, fn, ": feature_map=\"", opts.feature_map,
          "\" names the given features: pass them (query_features, leaving_features or key_features)");
  return FeatureMap<T>::plain(fn, kind, head_dim, opts.focus_power);
}
template FeatureMap<float> fixed_decode_map(const char*, const HybridDecodeOptions&, int64_t);
template FeatureMap<double> fixed_decode_map(const char*, const HybridDecodeOptions&, int64_t);

template <class T>
FeatureMap<T> favor_decode_map(const char* fn, const FavorFeatures<T>& favor, int64_t head_dim,
                               const HybridDecodeOptions& opts) {
  require(opts.feature_map == "favor", fn, ": FAVOR's projection was given: feature_map must be \"favor\", got \"",
          opts.feature_map, "\"");
  const FeatureMapKind kind = parse_favor_kernel(fn, opts.kernel);
  require(kind != FeatureMapKind::FavorTrig || opts.window == 0, fn,
          ": kernel=\"trig\" needs window 0 (the hybrid's weights must be >= 0: \"positive\" or \"hyperbolic\")");
  require(favor.projection.data != nullptr, fn, ": feature_map=\"favor\" needs projection ω [num_features, head_dim]");
  return FeatureMap<T>::favor(fn, kind, favor.projection, head_dim, opts.scale);
}
template FeatureMap<float> favor_decode_map(const char*, const FavorFeatures<float>&, int64_t, const HybridDecodeOptions&);
template FeatureMap<double> favor_decode_map(const char*, const FavorFeatures<double>&, int64_t,
                                             const HybridDecodeOptions&);

namespace {

struct StepDims {
  int64_t B, H, d, dv, m, Hkv, G, w, s, slots;
};

// The checks of every argument but the features (m' given): the dims, or an Error naming the
// first bad argument. Reads nothing of the state but its shapes and counts.
template <class T>
StepDims check_step(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, int64_t m,
                    TensorView<const bool> advance, TensorView<const T> window_weight, TensorView<const T> log_decay,
                    const HybridDecodeState<T>& state, const HybridDecodeOptions& opts) {
  require(q.rank() == 3, fn, ": q must be [batch, heads, head_dim], got shape ", shape_string(q.shape));
  require(v.rank() == 3 && v.dim(1) >= 1, fn, ": v must be [batch, kv_heads >= 1, value_dim], got shape ",
          shape_string(v.shape));
  StepDims s{q.dim(0), q.dim(1), q.dim(2), v.dim(2), m, v.dim(1), 0, opts.window, opts.sinks, 0};
  // Grouped queries: query head h reads key/value head h / G, G = H / kv_heads (the exact slots
  // are stored once per key head, as the model makes them).
  require(s.H % s.Hkv == 0, fn, ": v has ", s.Hkv, " key/value heads, which must divide q's ", s.H, " heads");
  s.G = s.H / s.Hkv;
  require(std::isfinite(opts.scale), fn, ": scale must be finite, got ", opts.scale);
  require(std::isfinite(opts.eps) && opts.eps >= 0, fn, ": eps must be finite and >= 0, got ", opts.eps);
  s.slots = s.s + s.w;
  const int64_t B = s.B, H = s.H, Hkv = s.Hkv, d = s.d, dv = s.dv;
  check_finite(fn, "q", q);
  check_same_shape_finite(fn, "k", k, {B, Hkv, d});
  check_same_shape_finite(fn, "v", v, {B, Hkv, dv});
  check_shape(fn, "advance", advance, {B});
  check_shape(fn, "window_weight", window_weight, {H});
  check_all(fn, "window_weight", window_weight, 0, 1, "in [0, 1]");
  check_decode_state(fn, opts, log_decay, state, DecodeShape{B, H, Hkv, m, d, dv}, opts.feature_map == "favor", true);
  for (int64_t b = 0; b < B; ++b)
    require(state.counts.data[b] >= 0, fn, ": counts must be >= 0, got ", state.counts.data[b], " for row ", b);
  return s;
}

// Where a step's features come from: given ([B, H, m'] each), or Hedgehog's maps, which the step
// applies to each query head's query and to the key leaving the window (m' = 2f).
template <class T>
struct Features {
  const T* query;
  const T* leaving;
  const HedgehogMaps<T>* maps;
  const FeatureMap<T>* fixed;  // a fixed map (elu, relu, focused), m' = d
};

// FAVOR's step, every argument checked: nothing is written before this.
template <class T>
Tensor<T> favor_step(const StepDims& dims, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                     const FeatureMap<T>& fmap, TensorView<const bool> advance, TensorView<const T> window_weight,
                     TensorView<const T> log_decay, const HybridDecodeState<T>& state, const HybridDecodeOptions& opts);

// The step itself, every argument checked: nothing is written before this.
template <class T>
Tensor<T> step(const StepDims& dims, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
               const Features<T>& features, TensorView<const bool> advance, TensorView<const T> window_weight,
               TensorView<const T> log_decay, const HybridDecodeState<T>& state, const HybridDecodeOptions& opts);

}  // namespace

template <class T>
Tensor<T> hybrid_decode_step(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                             TensorView<const T> query_features, TensorView<const T> leaving_features,
                             TensorView<const bool> advance, TensorView<const T> window_weight,
                             TensorView<const T> log_decay, const HybridDecodeState<T>& state,
                             const HybridDecodeOptions& opts) {
  const char* fn = "hybrid_decode_step";
  constexpr double inf = std::numeric_limits<double>::infinity();
  require(opts.feature_map != "favor", fn, ": feature_map=\"favor\" takes FAVOR's projection (FavorFeatures), not features");
  if (opts.feature_map != "given") {  // a fixed map, applied here
    require(q.rank() == 3, fn, ": q must be [batch, heads, head_dim], got shape ", shape_string(q.shape));
    const FeatureMap<T> fixed = fixed_decode_map<T>(fn, opts, q.dim(2));
    require(!query_features.data && !leaving_features.data, fn, ": with feature_map=\"", opts.feature_map,
            "\" the step makes the features itself: query_features and leaving_features must be empty");
    const StepDims dims = check_step(fn, q, k, v, fixed.dim(), advance, window_weight, log_decay, state, opts);
    return step(dims, q, k, v, Features<T>{nullptr, nullptr, nullptr, &fixed}, advance, window_weight, log_decay,
                state, opts);
  }
  require(query_features.rank() == 3 && query_features.dim(2) >= 1, fn,
          ": query_features must be [batch, heads, m'] with m' >= 1, got shape ", shape_string(query_features.shape));
  const StepDims dims =
      check_step(fn, q, k, v, query_features.dim(2), advance, window_weight, log_decay, state, opts);
  check_shape(fn, "query_features", query_features, {dims.B, dims.H, dims.m});
  check_shape(fn, "leaving_features", leaving_features, {dims.B, dims.H, dims.m});
  check_all(fn, "query_features", query_features, 0, inf, "finite and >= 0");
  check_all(fn, "leaving_features", leaving_features, 0, inf, "finite and >= 0");
  return step(dims, q, k, v, Features<T>{query_features.data, leaving_features.data, nullptr, nullptr}, advance,
              window_weight, log_decay, state, opts);
}

template <class T>
Tensor<T> hybrid_decode_step(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                             const HedgehogMaps<T>& maps, TensorView<const bool> advance,
                             TensorView<const T> window_weight, TensorView<const T> log_decay,
                             const HybridDecodeState<T>& state, const HybridDecodeOptions& opts) {
  const char* fn = "hybrid_decode_step";
  require(opts.feature_map == "given", fn, ": Hedgehog's maps make the features: feature_map must be \"given\", got \"",
          opts.feature_map, "\"");
  require(q.rank() == 3, fn, ": q must be [batch, heads, head_dim], got shape ", shape_string(q.shape));
  const int64_t H = q.dim(1), d = q.dim(2);
  const int64_t f = check_hedgehog_map(fn, "query_weight", "query_bias", maps.query_weight, maps.query_bias, H, d);
  check_hedgehog_map(fn, "key_weight", "key_bias", maps.key_weight, maps.key_bias, H, d, f);
  const StepDims s = check_step(fn, q, k, v, 2 * f, advance, window_weight, log_decay, state, opts);
  return step(s, q, k, v, Features<T>{nullptr, nullptr, &maps, nullptr}, advance, window_weight, log_decay, state,
              opts);
}

template <class T>
Tensor<T> hybrid_decode_step(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                             const FavorFeatures<T>& favor, TensorView<const bool> advance,
                             TensorView<const T> window_weight, TensorView<const T> log_decay,
                             const HybridDecodeState<T>& state, const HybridDecodeOptions& opts) {
  const char* fn = "hybrid_decode_step";
  require(q.rank() == 3, fn, ": q must be [batch, heads, head_dim], got shape ", shape_string(q.shape));
  const FeatureMap<T> fmap = favor_decode_map(fn, favor, q.dim(2), opts);
  const StepDims dims = check_step(fn, q, k, v, fmap.dim(), advance, window_weight, log_decay, state, opts);
  return favor_step(dims, q, k, v, fmap, advance, window_weight, log_decay, state, opts);
}

namespace {

// The exact slots of each advancing row and key head, once for the G query heads that read them:
// the value leaving the window is kept for the sums (leaving [B·H_kv·d_v], and with `keys` its key
// in leaving_keys [B·H_kv·d]), a sink token leaving it moves to its sink slot, the new token takes
// its ring slot. Without a window the new token itself is the one entering the sums.
template <class T>
void move_ring(const StepDims& dims, TensorView<const T> k, TensorView<const T> v, TensorView<const bool> advance,
               const HybridDecodeState<T>& state, bool keys, std::vector<T>& leaving, std::vector<T>& leaving_keys) {
  const int64_t B = dims.B, d = dims.d, dv = dims.dv, Hkv = dims.Hkv, w = dims.w, s = dims.s, slots = dims.slots;
  leaving.assign(static_cast<size_t>(B * Hkv * dv), T(0));
  leaving_keys.assign(keys ? static_cast<size_t>(B * Hkv * d) : 0, T(0));
  for (int64_t b = 0; b < B; ++b) {
    if (!advance.data[b]) continue;
    if (w == 0) {  // no window: the new token itself enters the sums
      std::copy(v.data + b * Hkv * dv, v.data + (b + 1) * Hkv * dv, leaving.data() + b * Hkv * dv);
      if (keys) std::copy(k.data + b * Hkv * d, k.data + (b + 1) * Hkv * d, leaving_keys.data() + b * Hkv * d);
      continue;
    }
    const int64_t c = state.counts.data[b], slot = s + c % w;
    bool* valid = state.exact_valid.data + b * slots;
    if (c >= w && c - w < s) valid[c - w] = true;
    valid[slot] = true;
    for (int64_t g = b * Hkv; g < (b + 1) * Hkv; ++g) {
      T* exact_keys = state.exact_keys.data + g * slots * d;
      T* values = state.exact_values.data + g * slots * dv;
      std::copy(values + slot * dv, values + (slot + 1) * dv, leaving.data() + g * dv);
      if (keys) std::copy(exact_keys + slot * d, exact_keys + (slot + 1) * d, leaving_keys.data() + g * d);
      if (c >= w && c - w < s) {
        std::copy(exact_keys + slot * d, exact_keys + (slot + 1) * d, exact_keys + (c - w) * d);
        std::copy(values + slot * dv, values + (slot + 1) * dv, values + (c - w) * dv);
      }
      std::copy(k.data + g * d, k.data + (g + 1) * d, exact_keys + slot * d);
      std::copy(v.data + g * dv, v.data + (g + 1) * dv, values + slot * dv);
    }
  }
}

// Whether a row holding `count` tokens enters a key into the sums with its next one: the token w
// places back leaves the window for them, not for a sink slot (w = 0: the new token, at
// distance 0).
inline bool enters_sums(const StepDims& dims, int64_t count) {
  return count >= dims.w && count - dims.w >= dims.s;
}

// The query heads a task reads a key head's slots for at once: simd::row_dots and state_dots
// take up to four queries per pass over the keys or values.
constexpr int64_t kHeadsPerPass = 4;

// fn(b, kv, h0, count, scratch) for every advancing row b, key head kv and group of its G query
// heads h0 .. h0 + count − 1 (count <= kHeadsPerPass: a key head's slots are read once for the
// group), scratch `scratch_per_head`·count + `scratch_fixed` values of the worker's. A small step
// (work_per_head·B·H < 2^18) runs on the calling thread: a helper's wake-up cost more than it
// saved at w = 64 (cold, 9 heads: 46 µs on 2 threads, 32 on 1). Otherwise each group is a task:
// B·H_kv·⌈G/4⌉ of them (a model with one key head still spreads its query heads over workers).
template <class T, class Fn>
void for_each_head_group(const StepDims& dims, TensorView<const bool> advance, int64_t work_per_head,
                         int64_t scratch_per_head, int64_t scratch_fixed, Fn&& fn) {
  const int64_t groups = (dims.G + kHeadsPerPass - 1) / kHeadsPerPass, tasks = dims.B * dims.Hkv * groups;
  const bool serial = dims.B * dims.H * work_per_head < (int64_t{1} << 18);
  const ParallelLoop loop(serial ? 1 : tasks);
  const int64_t scratch_size = std::min(dims.G, kHeadsPerPass) * scratch_per_head + scratch_fixed;
  PerWorker<std::vector<T>> scratch(loop, [&] { return std::vector<T>(static_cast<size_t>(scratch_size)); });
  loop.run([&](int64_t index, int worker) {
    for (int64_t task = serial ? 0 : index; task < (serial ? tasks : index + 1); ++task) {
      const int64_t b = task / (dims.Hkv * groups), kv = task / groups % dims.Hkv, group = task % groups;
      const int64_t h0 = kv * dims.G + group * kHeadsPerPass, count = std::min(kHeadsPerPass, (kv + 1) * dims.G - h0);
      if (advance.data[b]) fn(b, kv, h0, count, scratch[worker].data());
    }
  });
}

// o[0, dv) divided by den; 0 where den is 0 (nothing to read: no key yet with eps 0, or trig's
// weights cancelling), as the forward gives.
template <class T>
void divide_or_zero(T* o, int64_t dv, T den) {
  if (den != T(0)) simd::scale(o, static_cast<size_t>(dv), T(1) / den);
  else std::fill(o, o + dv, T(0));
}

// The sums and their normaliser a position on with no key entering: times f = e^{λ}.
template <class T>
void decay_sums(T* S, T* z, int64_t m, int64_t dv, T f) {
  simd::scale(S, static_cast<size_t>(m * dv), f);
  simd::scale(z, static_cast<size_t>(m), f);
}

// The exact slots' scores of `count` queries q [count × d] of one key head in rows
// [count × slots] (scale·q·k_j, −inf where no token is), the keys read once for them; tops
// [count]: each row's maximum, finite (the new token's slot is valid).
template <class T>
void exact_scores(const StepDims& dims, const T* keys, const bool* valid, const T* q, int64_t count, T scale, T* rows,
                  T* tops) {
  const int64_t slots = dims.slots;
  simd::row_dots(keys, static_cast<size_t>(slots), static_cast<size_t>(dims.d), q, static_cast<size_t>(count), rows);
  for (int64_t j = 0; j < count; ++j) {
    T* row = rows + j * slots;
    for (int64_t t = 0; t < slots; ++t) row[t] = valid[t] ? scale * row[t] : -std::numeric_limits<T>::infinity();
    tops[j] = simd::max_value(row, static_cast<size_t>(slots));
  }
}

template <class T>
Tensor<T> step(const StepDims& dims, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
               const Features<T>& features, TensorView<const bool> advance, TensorView<const T> window_weight,
               TensorView<const T> log_decay, const HybridDecodeState<T>& state, const HybridDecodeOptions& opts) {
  const int64_t B = dims.B, H = dims.H, d = dims.d, dv = dims.dv, m = dims.m, Hkv = dims.Hkv;
  const int64_t w = dims.w, slots = dims.slots;
  // Nothing is written above this line. With a map applied here the leaving keys are kept too:
  // their features are made per head below.
  const HedgehogMaps<T>* maps = features.maps;
  const FeatureMap<T>* fixed = features.fixed;
  const bool mapped = maps || fixed;
  std::vector<T> leaving, leaving_keys;
  move_ring(dims, k, v, advance, state, mapped, leaving, leaving_keys);
  Tensor<T> out({B, H, dv}, false, Init::Zero);
  const int64_t fdim = m / 2;  // Hedgehog's feature_dim
  const T scale = static_cast<T>(opts.scale);
  // scratch per head: [slots] the scores then the weights, its maximum, the window's
  // denominator, [m] φ(q), [dv] the linear sums; and [2m] the entering key's factors and features
  const int64_t map_work = maps ? m * d : fixed ? 2 * d : 0;
  for_each_head_group<T>(dims, advance, slots * (d + dv) + 2 * m * dv + map_work, slots + 2 + m + dv, 2 * m,
                         [&](int64_t b, int64_t kv, int64_t h0, int64_t heads, T* scratch) {
    const int64_t c = state.counts.data[b], g = b * Hkv + kv, first = b * H + h0;  // the group's first query head
    T* rows = scratch;
    T* tops = rows + heads * slots;
    T* exact_den = tops + heads;
    T* made_q = exact_den + heads;
    T* linear = made_q + heads * m;
    T* factors = linear + heads * dv;  // [m] e^{λ}, then [m] the entering key's weighted features
    const bool enters = enters_sums(dims, c);
    // Per query head: φ(q), the sums a position on (the leaving key entering them), and φ(q)ᵀS.
    for (int64_t j = 0; j < heads; ++j) {
      const int64_t h = h0 + j, bh = first + j;
      T* S = state.sums.data + bh * m * dv;
      T* z = state.normaliser.data + bh * m;
      const double lambda = log_decay.data ? static_cast<double>(log_decay.data[h]) : 0.0;
      const T f = static_cast<T>(std::exp(lambda));  // one position on: the sums decay by e^{λ}
      const T* qb = q.data + bh * d;
      T* phi_q = made_q + j * m;
      T* scaled = factors + m;
      if (features.query) std::copy(features.query + bh * m, features.query + (bh + 1) * m, phi_q);
      else if (maps) hedgehog_row(qb, maps->query_weight.data + h * d * fdim, maps->query_bias.data + h * fdim, d, fdim, phi_q);
      else fixed->features(qb, 1, phi_q);
      if (enters) {  // S ← e^{λ}·S + (e^{λw}·φ) v_oldᵀ, z likewise: one pass over S
        if (features.leaving) std::copy(features.leaving + bh * m, features.leaving + (bh + 1) * m, scaled);
        else if (maps) hedgehog_row(leaving_keys.data() + g * d, maps->key_weight.data + h * d * fdim,
                                    maps->key_bias.data + h * fdim, d, fdim, scaled);
        else fixed->features(leaving_keys.data() + g * d, 1, scaled);
        const T weight = static_cast<T>(std::exp(lambda * static_cast<double>(w)));
        std::fill(factors, factors + m, f);
        for (int64_t r = 0; r < m; ++r) scaled[r] *= weight;
        simd::decay_rank_one(S, static_cast<size_t>(m), static_cast<size_t>(dv), factors, scaled,
                             leaving.data() + g * dv, S);
        for (int64_t r = 0; r < m; ++r) z[r] = f * z[r] + scaled[r];
      } else if (log_decay.data) {
        decay_sums(S, z, m, dv, f);
      }
      simd::state_dots(S, static_cast<size_t>(m), static_cast<size_t>(dv), phi_q, 1, linear + j * dv);
    }
    if (slots == 0) {  // linear attention alone: φ(q)ᵀS / (φ(q)·z + eps); a zero denominator gives 0
      for (int64_t j = 0; j < heads; ++j) {
        T* o = out.data() + (first + j) * dv;
        std::copy(linear + j * dv, linear + (j + 1) * dv, o);
        const T* z = state.normaliser.data + (first + j) * m;
        divide_or_zero(o, dv, simd::dot(made_q + j * m, z, static_cast<size_t>(m)) + static_cast<T>(opts.eps));
      }
      return;
    }
    // the exact slots, read once for the group's query heads: e_j = e^{s_j − M} over the valid ones
    exact_scores(dims, state.exact_keys.data + g * slots * d, state.exact_valid.data + b * slots, q.data + first * d,
                 heads, scale, rows, tops);
    T* o = out.data() + first * dv;  // the group's rows, one after another
    for (int64_t j = 0; j < heads; ++j)
      exact_den[j] = simd::exp_shifted_sum(rows + j * slots, static_cast<size_t>(slots), tops[j]);
    simd::state_dots(state.exact_values.data + g * slots * dv, static_cast<size_t>(slots), static_cast<size_t>(dv),
                     rows, static_cast<size_t>(heads), o);
    for (int64_t j = 0; j < heads; ++j) {
      const T gamma = window_weight.data[h0 + j];
      T* oj = o + j * dv;
      const T* lj = linear + j * dv;
      for (int64_t e = 0; e < dv; ++e) oj[e] = gamma * oj[e] + lj[e];
      const T* z = state.normaliser.data + (first + j) * m;
      const T den = gamma * exact_den[j] + simd::dot(made_q + j * m, z, static_cast<size_t>(m)) +
                    static_cast<T>(opts.eps);
      divide_or_zero(oj, dv, den);  // (0 over 0: γ = 0, nothing in the sums, eps = 0)
    }
  });
  for (int64_t b = 0; b < B; ++b) state.counts.data[b] += advance.data[b] ? 1 : 0;
  return out;
}

// FAVOR's step: the sums in log form, on per-feature shifts c (hybrid_decode_step's FAVOR
// overload in hybrid.h). Keys' and queries' logits are the key form (QueryWithNorm), as in
// hybrid_attention, so that e^{L_q + L_k} estimates e^{s_ij} itself and sits on one scale with
// the window's exact weights.
template <class T>
Tensor<T> favor_step(const StepDims& dims, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                     const FeatureMap<T>& fmap, TensorView<const bool> advance, TensorView<const T> window_weight,
                     TensorView<const T> log_decay, const HybridDecodeState<T>& state, const HybridDecodeOptions& opts) {
  const char* fn = "hybrid_decode_step";
  const int64_t B = dims.B, H = dims.H, d = dims.d, dv = dims.dv, m = dims.m, Hkv = dims.Hkv;
  const int64_t w = dims.w, slots = dims.slots;
  const bool trig = fmap.has_factor();
  // The logits are finite for finite inputs at any finite projection, and logits() checks them:
  // made for every advancing row first, so that an Error leaves the state as it was.
  std::vector<T> Lq(static_cast<size_t>(B * H * m)), sq(trig ? static_cast<size_t>(B * H * m) : 0);
  for (int64_t b = 0; b < B; ++b)
    if (advance.data[b])
      fmap.logits(fn, q.data + b * H * d, H, Side::QueryWithNorm, Lq.data() + b * H * m,
                  trig ? sq.data() + b * H * m : nullptr, Products::Native, "q");
  // ... and the logits of each key head's key entering the sums (the ring's leaving one; w = 0:
  // the new one), read before the ring moves
  std::vector<T> Lk(static_cast<size_t>(B * Hkv * m)), sk(trig ? static_cast<size_t>(B * Hkv * m) : 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = state.counts.data[b];
    if (!advance.data[b] || !enters_sums(dims, c)) continue;
    for (int64_t g = b * Hkv; g < (b + 1) * Hkv; ++g) {
      const T* key = w == 0 ? k.data + g * d : state.exact_keys.data + (g * slots + dims.s + c % w) * d;
      fmap.logits(fn, key, 1, Side::Key, Lk.data() + g * m, trig ? sk.data() + g * m : nullptr, Products::Native,
                  w == 0 ? "k" : "exact_keys");
    }
  }
  std::vector<T> leaving, unused_keys;
  move_ring(dims, k, v, advance, state, false, leaving, unused_keys);
  Tensor<T> out({B, H, dv}, false, Init::Zero);
  const T scale = static_cast<T>(opts.scale);
  const T inf = std::numeric_limits<T>::infinity();
  // scratch per head: [slots] the scores then the weights, its maximum, [dv] the linear sums,
  // their maximum R_lin and denominator, the window's denominator; and [2m] factors then the
  // sums' weights
  for_each_head_group<T>(dims, advance, slots * (d + dv) + 2 * m * dv, slots + 1 + dv + 3, 2 * m,
                         [&](int64_t b, int64_t kv, int64_t h0, int64_t heads, T* scratch) {
    const int64_t c = state.counts.data[b], g = b * Hkv + kv, first = b * H + h0;
    T* rows = scratch;
    T* tops = rows + heads * slots;
    T* keep = tops + heads;
    T* weights = keep + m;  // also the entering key's scaled features
    T* linear = weights + m;
    T* linear_top = linear + heads * dv;
    T* linear_den = linear_top + heads;
    T* exact_den = linear_den + heads;
    for (int64_t j = 0; j < heads; ++j) {
      const int64_t h = h0 + j, bh = first + j;
      T* S = state.sums.data + bh * m * dv;
      T* z = state.normaliser.data + bh * m;
      T* shift = state.shift.data + bh * m;
      const double lambda = log_decay.data ? static_cast<double>(log_decay.data[h]) : 0.0;
      const T f = static_cast<T>(std::exp(lambda));
      if (enters_sums(dims, c)) {  // c' = max(c, L_k + λw); S ← e^{λ}e^{c − c'}·S + s·e^{L_k + λw − c'} v_oldᵀ
        const T* lk = Lk.data() + g * m;  // the map is shared by the heads: its key head's logits
        const T entry = static_cast<T>(lambda * static_cast<double>(w));
        T* scaled = weights;
        for (int64_t r = 0; r < m; ++r) {
          const T L = lk[r] + entry, top = std::max(shift[r], L);
          keep[r] = shift[r] == -inf ? T(0) : f * std::exp(shift[r] - top);
          scaled[r] = (trig ? sk[g * m + r] : T(1)) * std::exp(L - top);
          shift[r] = top;
        }
        simd::decay_rank_one(S, static_cast<size_t>(m), static_cast<size_t>(dv), keep, scaled,
                             leaving.data() + g * dv, S);
        for (int64_t r = 0; r < m; ++r) z[r] = keep[r] * z[r] + scaled[r];
      } else if (log_decay.data) {
        decay_sums(S, z, m, dv, f);
      }
      // the sums' weights e^{L_q + c − R_lin}·s_q, R_lin = max_r (L_q,r + c_r) (−inf: nothing entered yet)
      const T* lq = Lq.data() + bh * m;
      T top = -inf;
      for (int64_t r = 0; r < m; ++r) top = std::max(top, lq[r] + shift[r]);
      for (int64_t r = 0; r < m; ++r)
        weights[r] = top == -inf ? T(0) : (trig ? sq[bh * m + r] : T(1)) * std::exp(lq[r] + shift[r] - top);
      simd::state_dots(S, static_cast<size_t>(m), static_cast<size_t>(dv), weights, 1, linear + j * dv);
      linear_top[j] = top;
      linear_den[j] = simd::dot(weights, z, static_cast<size_t>(m));
      if (slots == 0) {  // FAVOR alone: num/den on the scale e^{R_lin}/m'; a zero denominator (trig) gives 0
        const T den = linear_den[j] +
                      (opts.eps > 0 ? static_cast<T>(m) * std::exp(static_cast<T>(std::log(opts.eps)) - top) : T(0));
        T* o = out.data() + bh * dv;
        std::copy(linear + j * dv, linear + (j + 1) * dv, o);
        divide_or_zero(o, dv, den);
      }
    }
    if (slots == 0) return;
    // with the window: every term on e^{R}, R = max(M, R_lin); φ(q)·φ(k) = e^{L_q + L_k}/m'
    exact_scores(dims, state.exact_keys.data + g * slots * d, state.exact_valid.data + b * slots, q.data + first * d,
                 heads, scale, rows, tops);
    for (int64_t j = 0; j < heads; ++j) {
      tops[j] = std::max(tops[j], linear_top[j]);  // R
      exact_den[j] = simd::exp_shifted_sum(rows + j * slots, static_cast<size_t>(slots), tops[j]);
    }
    T* o = out.data() + first * dv;
    simd::state_dots(state.exact_values.data + g * slots * dv, static_cast<size_t>(slots), static_cast<size_t>(dv),
                     rows, static_cast<size_t>(heads), o);
    for (int64_t j = 0; j < heads; ++j) {
      const T gamma = window_weight.data[h0 + j], R = tops[j];
      const T share = linear_top[j] == -inf ? T(0) : std::exp(linear_top[j] - R) / static_cast<T>(m);
      T* oj = o + j * dv;
      for (int64_t e = 0; e < dv; ++e) oj[e] = gamma * oj[e] + share * linear[j * dv + e];
      const T den = gamma * exact_den[j] + share * linear_den[j] +
                    (opts.eps > 0 ? std::exp(static_cast<T>(std::log(opts.eps)) - R) : T(0));
      divide_or_zero(oj, dv, den);
    }
  });
  for (int64_t b = 0; b < B; ++b) state.counts.data[b] += advance.data[b] ? 1 : 0;
  return out;
}

}  // namespace

#define LINATTN_INSTANTIATE(T)                                                                                  \
  template Tensor<T> hybrid_decode_step(TensorView<const T>, TensorView<const T>, TensorView<const T>,          \
                                        TensorView<const T>, TensorView<const T>, TensorView<const bool>,       \
                                        TensorView<const T>, TensorView<const T>, const HybridDecodeState<T>&, \
                                        const HybridDecodeOptions&);                                     \
  template Tensor<T> hybrid_decode_step(TensorView<const T>, TensorView<const T>, TensorView<const T>,          \
                                        const HedgehogMaps<T>&, TensorView<const bool>, TensorView<const T>,   \
                                        TensorView<const T>, const HybridDecodeState<T>&,                      \
                                        const HybridDecodeOptions&);                                           \
  template Tensor<T> hybrid_decode_step(TensorView<const T>, TensorView<const T>, TensorView<const T>,          \
                                        const FavorFeatures<T>&, TensorView<const bool>, TensorView<const T>,  \
                                        TensorView<const T>, const HybridDecodeState<T>&,                      \
                                        const HybridDecodeOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
