// The causal hybrid's decoding state after a prompt (include/linattn/hybrid.h, hybrid_prefill):
// what LinattnCache's prefill leaves for hybrid_decode_step, made here in one call per layer
// instead of rebuilt from the prompt in torch. Each row's tokens are sorted once into ring
// slots, sink slots and the keys that enter the sums; per (row, query head) the entering keys'
// features (given, a fixed map's, or Hedgehog's key map: a BLAS product and
// core/hedgehog_map.h's row formula, as hedgehog_features) are weighed by their decay and summed
// by one BLAS product, sums = Φᵀ·V. Its float64 reference is reference::hybrid_prefill (plain
// loops); tests/test_hybrid.cc also checks that a prefill followed by steps gives the causal
// forward's rows.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/error.h"
#include "linattn/core/feature_map.h"
#include "linattn/core/hedgehog_map.h"
#include "linattn/core/parallel.h"
#include "linattn/hybrid.h"
#include "linattn/hybrid/decode_state.h"
#include "linattn/kernelized.h"

namespace linattn {
namespace {

// x [B, heads, n, width] finite at every token (valid [B, n]; empty: every position): padding may
// hold anything (it goes nowhere). An Error naming fn, x and the first bad place otherwise.
template <class T>
void check_tokens_finite(const char* fn, const char* name, TensorView<const T> x, TensorView<const bool> valid) {
  const int64_t B = x.dim(0), heads = x.dim(1), n = x.dim(2), width = x.dim(3);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < n; ++p) {
      if (valid.data && !valid.data[b * n + p]) continue;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < width; ++i) {
          const double a = static_cast<double>(x.data[((b * heads + h) * n + p) * width + i]);
          require(std::isfinite(a), fn, ": ", name, " must be finite at its tokens, got ", a, " at [", b, ", ", h, ", ",
                  p, ", ", i, "]");
        }
    }
}

struct PrefillDims {
  int64_t B, H, Hkv, G, n, d, dv, m, w, s, slots;
};

// The checks of every argument but the features: the dims (H and m' from the sums), or an Error
// naming the first bad argument.
template <class T>
PrefillDims check_prefill(const char* fn, TensorView<const T> k, TensorView<const T> v, TensorView<const bool> valid,
                          TensorView<const T> log_decay, const HybridDecodeState<T>& state,
                          const HybridDecodeOptions& opts, bool favor = false) {
  require(k.rank() == 4, fn, ": k must be [batch, kv_heads, n, head_dim], got shape ", shape_string(k.shape));
  require(v.rank() == 4, fn, ": v must be [batch, kv_heads, n, value_dim], got shape ", shape_string(v.shape));
  require(state.sums.rank() == 4, fn, ": sums must be [batch, heads, m', value_dim], got shape ",
          shape_string(state.sums.shape));
  PrefillDims s{k.dim(0), state.sums.dim(1), k.dim(1), 0, k.dim(2), k.dim(3), v.dim(3), state.sums.dim(2),
                opts.window, opts.sinks, 0};
  require(s.Hkv >= 1 && s.H % s.Hkv == 0, fn, ": k has ", s.Hkv, " key/value heads, which must divide the sums' ",
          s.H, " heads");
  s.G = s.H / s.Hkv;
  s.slots = s.s + s.w;
  check_shape(fn, "v", v, {s.B, s.Hkv, s.n, s.dv});
  if (valid.data) check_shape(fn, "valid", valid, {s.B, s.n});
  check_tokens_finite(fn, "k", k, valid);
  check_tokens_finite(fn, "v", v, valid);
  check_decode_state(fn, opts, log_decay, state, DecodeShape{s.B, s.H, s.Hkv, s.m, s.d, s.dv}, favor, false);
  return s;
}

// Where the entering keys' features come from: given [B, H, n, m'], Hedgehog's key map, or a
// fixed map.
template <class T>
struct KeyFeatures {
  const T* given;
  TensorView<const T> weight, bias;  // Hedgehog's key map (weight.data null: none)
  const FeatureMap<T>* fixed;
  const FeatureMap<T>* favor = nullptr;  // FAVOR's, in log form
};

// Everything checked: nothing is written before this.
template <class T>
void prefill(const PrefillDims& dims, TensorView<const T> k, TensorView<const T> v, const KeyFeatures<T>& features,
             TensorView<const bool> valid, TensorView<const T> log_decay, const HybridDecodeState<T>& state) {
  const int64_t B = dims.B, H = dims.H, Hkv = dims.Hkv, G = dims.G, n = dims.n, d = dims.d, dv = dims.dv, m = dims.m;
  const int64_t w = dims.w, s = dims.s, slots = dims.slots;
  // Each row's tokens in order: the last w to the ring, the first s of the others to the sinks,
  // the rest (positions and their distances c − 1 − i to the last token) to the sums.
  std::vector<std::vector<int64_t>> entering(static_cast<size_t>(B)), distance(static_cast<size_t>(B));
  std::vector<std::vector<int64_t>> exact_positions(static_cast<size_t>(B)), exact_slots(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> tokens;
    for (int64_t p = 0; p < n; ++p)
      if (!valid.data || valid.data[b * n + p]) tokens.push_back(p);
    const auto c = static_cast<int64_t>(tokens.size());
    for (int64_t i = 0; i < c; ++i) {
      const int64_t after = c - 1 - i, p = tokens[static_cast<size_t>(i)];
      const int64_t slot = after < w ? s + i % w : i < s ? i : -1;
      const auto row = static_cast<size_t>(b);
      if (slot < 0) {
        entering[row].push_back(p);
        distance[row].push_back(after);
      } else {
        exact_positions[row].push_back(p);
        exact_slots[row].push_back(slot);
      }
    }
  }
  // FAVOR: the entering keys' logits [rows × m'] (and trig's factors) per row and key head (the
  // map is shared by the heads), made before anything is written: logits() throws on a
  // non-finite one.
  const FeatureMap<T>* favor = features.favor;
  const bool trig = favor && favor->has_factor();
  std::vector<std::vector<T>> logits(favor ? static_cast<size_t>(B * Hkv) : 0),
      factors(trig ? static_cast<size_t>(B * Hkv) : 0);
  if (favor) {
    std::vector<T> rows_of_keys;
    for (int64_t g = 0; g < B * Hkv; ++g) {
      const std::vector<int64_t>& positions = entering[static_cast<size_t>(g / Hkv)];
      const auto rows = static_cast<int64_t>(positions.size());
      rows_of_keys.resize(static_cast<size_t>(rows * d));
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t p = positions[static_cast<size_t>(i)];
        std::copy(k.data + (g * n + p) * d, k.data + (g * n + p + 1) * d, rows_of_keys.data() + i * d);
      }
      logits[static_cast<size_t>(g)].resize(static_cast<size_t>(rows * m));
      if (trig) factors[static_cast<size_t>(g)].resize(static_cast<size_t>(rows * m));
      if (rows > 0)
        favor->logits("hybrid_prefill", rows_of_keys.data(), rows, Side::Key, logits[static_cast<size_t>(g)].data(),
                      trig ? factors[static_cast<size_t>(g)].data() : nullptr);
    }
  }
  // Nothing is written above this line.
  std::fill(state.sums.data, state.sums.data + state.sums.size(), T(0));
  std::fill(state.normaliser.data, state.normaliser.data + state.normaliser.size(), T(0));
  std::fill(state.exact_keys.data, state.exact_keys.data + state.exact_keys.size(), T(0));
  std::fill(state.exact_values.data, state.exact_values.data + state.exact_values.size(), T(0));
  std::fill(state.exact_valid.data, state.exact_valid.data + state.exact_valid.size(), false);
  if (favor) std::fill(state.shift.data, state.shift.data + state.shift.size(), -std::numeric_limits<T>::infinity());
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int64_t>& positions = exact_positions[static_cast<size_t>(b)];
    state.counts.data[b] = static_cast<int64_t>(positions.size() + entering[static_cast<size_t>(b)].size());
    for (size_t i = 0; i < positions.size(); ++i) {
      const int64_t p = positions[i], slot = exact_slots[static_cast<size_t>(b)][i];
      state.exact_valid.data[b * slots + slot] = true;
      for (int64_t g = b * Hkv; g < (b + 1) * Hkv; ++g) {
        std::copy(k.data + (g * n + p) * d, k.data + (g * n + p + 1) * d, state.exact_keys.data + (g * slots + slot) * d);
        std::copy(v.data + (g * n + p) * dv, v.data + (g * n + p + 1) * dv,
                  state.exact_values.data + (g * slots + slot) * dv);
      }
    }
  }
  int64_t most = 0;
  for (const auto& e : entering) most = std::max(most, static_cast<int64_t>(e.size()));
  if (most == 0) return;
  const bool mapped = features.weight.data || features.fixed;
  const int64_t f = m / 2;  // Hedgehog's feature_dim
  const ParallelLoop loop(B * H);
  // [most × m'] the features Φ, [most × d_v] the values, [most × d] the keys (a map's input)
  PerWorker<std::vector<T>> scratch(loop, [&] {
    return std::vector<T>(static_cast<size_t>(most * (m + dv + (mapped ? d : 0))));
  });
  loop.run([&](int64_t bh, int worker) {
    const int64_t b = bh / H, h = bh % H, g = b * Hkv + h / G;  // the key head it reads
    const std::vector<int64_t>& positions = entering[static_cast<size_t>(b)];
    const auto rows = static_cast<int64_t>(positions.size());
    if (rows == 0) return;
    T* phi = scratch[worker].data();
    T* values = phi + most * m;
    T* keys = values + most * dv;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t p = positions[static_cast<size_t>(i)];
      std::copy(v.data + (g * n + p) * dv, v.data + (g * n + p + 1) * dv, values + i * dv);
      if (mapped) std::copy(k.data + (g * n + p) * d, k.data + (g * n + p + 1) * d, keys + i * d);
      if (features.given) std::copy(features.given + (bh * n + p) * m, features.given + (bh * n + p + 1) * m, phi + i * m);
    }
    if (features.fixed) {
      features.fixed->features(keys, rows, phi);
    } else if (features.weight.data) {  // query head h's key map, as hedgehog_features runs it
      hedgehog_block<T>(keys, features.weight.data + h * d * f, features.bias.data + h * f, rows, d, f, phi);
    }
    const double lambda = log_decay.data ? static_cast<double>(log_decay.data[h]) : 0.0;
    const std::vector<int64_t>& after = distance[static_cast<size_t>(b)];
    if (favor) {  // weights s·e^{L + λ·after − c}, c_r = max_i (L_ir + λ·after_i): each <= 1
      const T* L = logits[static_cast<size_t>(g)].data();
      const T* factor = trig ? factors[static_cast<size_t>(g)].data() : nullptr;
      T* c = state.shift.data + bh * m;
      for (int64_t i = 0; i < rows; ++i) {
        const T decayed = static_cast<T>(lambda * static_cast<double>(after[static_cast<size_t>(i)]));
        for (int64_t r = 0; r < m; ++r) {
          phi[i * m + r] = L[i * m + r] + decayed;
          c[r] = std::max(c[r], phi[i * m + r]);
        }
      }
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t r = 0; r < m; ++r)
          phi[i * m + r] = (factor ? factor[i * m + r] : T(1)) * std::exp(phi[i * m + r] - c[r]);
    } else if (log_decay.data) {  // each key weighed by e^{λ·(its distance to the last token)}
      for (int64_t i = 0; i < rows; ++i) {
        const T weight = static_cast<T>(std::exp(lambda * static_cast<double>(after[static_cast<size_t>(i)])));
        for (int64_t r = 0; r < m; ++r) phi[i * m + r] *= weight;
      }
    }
    matmul(mat(state.sums.data + bh * m * dv, m, dv), mat<const T>(phi, rows, m).t(), mat<const T>(values, rows, dv));
    T* z = state.normaliser.data + bh * m;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t r = 0; r < m; ++r) z[r] += phi[i * m + r];
  });
}

}  // namespace

template <class T>
void hybrid_prefill(TensorView<const T> k, TensorView<const T> v, TensorView<const T> key_features,
                    TensorView<const bool> valid, TensorView<const T> log_decay, const HybridDecodeState<T>& state,
                    const HybridDecodeOptions& opts) {
  const char* fn = "hybrid_prefill";
  require(opts.feature_map != "favor", fn, ": feature_map=\"favor\" takes FAVOR's projection (FavorFeatures), not features");
  if (opts.feature_map != "given") {  // a fixed map, applied here
    require(k.rank() == 4, fn, ": k must be [batch, kv_heads, n, head_dim], got shape ", shape_string(k.shape));
    const FeatureMap<T> fixed = fixed_decode_map<T>(fn, opts, k.dim(3));
    require(!key_features.data, fn, ": with feature_map=\"", opts.feature_map,
            "\" the prefill makes the features itself: key_features must be empty");
    const PrefillDims dims = check_prefill(fn, k, v, valid, log_decay, state, opts);
    require(dims.m == fixed.dim(), fn, ": sums has ", dims.m, " features; feature_map=\"", opts.feature_map,
            "\" makes ", fixed.dim());
    prefill(dims, k, v, KeyFeatures<T>{nullptr, {}, {}, &fixed}, valid, log_decay, state);
    return;
  }
  const PrefillDims dims = check_prefill(fn, k, v, valid, log_decay, state, opts);
  check_shape(fn, "key_features", key_features, {dims.B, dims.H, dims.n, dims.m});
  for (int64_t i = 0, size = key_features.size(); i < size; ++i) {
    const int64_t b = i / (dims.H * dims.n * dims.m), p = i / dims.m % dims.n;
    if (valid.data && !valid.data[b * dims.n + p]) continue;  // padding may hold anything
    const double a = static_cast<double>(key_features.data[i]);
    require(std::isfinite(a) && a >= 0, fn, ": key_features must be finite and >= 0 at the tokens, got ", a,
            " at flat index ", i);
  }
  prefill(dims, k, v, KeyFeatures<T>{key_features.data, {}, {}, nullptr}, valid, log_decay, state);
}

template <class T>
void hybrid_prefill(TensorView<const T> k, TensorView<const T> v, TensorView<const T> key_weight,
                    TensorView<const T> key_bias, TensorView<const bool> valid, TensorView<const T> log_decay,
                    const HybridDecodeState<T>& state, const HybridDecodeOptions& opts) {
  const char* fn = "hybrid_prefill";
  require(opts.feature_map == "given", fn, ": Hedgehog's key map makes the features: feature_map must be \"given\", got \"",
          opts.feature_map, "\"");
  const PrefillDims dims = check_prefill(fn, k, v, valid, log_decay, state, opts);
  const int64_t f = check_hedgehog_map(fn, "key_weight", "key_bias", key_weight, key_bias, dims.H, dims.d);
  require(dims.m == 2 * f, fn, ": sums has ", dims.m, " features; Hedgehog's key map of feature_dim ", f, " makes ",
          2 * f);
  prefill(dims, k, v, KeyFeatures<T>{nullptr, key_weight, key_bias, nullptr}, valid, log_decay, state);
}

template <class T>
void hybrid_prefill(TensorView<const T> k, TensorView<const T> v, const FavorFeatures<T>& favor,
                    TensorView<const bool> valid, TensorView<const T> log_decay, const HybridDecodeState<T>& state,
                    const HybridDecodeOptions& opts) {
  const char* fn = "hybrid_prefill";
  require(k.rank() == 4, fn, ": k must be [batch, kv_heads, n, head_dim], got shape ", shape_string(k.shape));
  const FeatureMap<T> fmap = favor_decode_map(fn, favor, k.dim(3), opts);
  const PrefillDims dims = check_prefill(fn, k, v, valid, log_decay, state, opts, true);
  require(dims.m == fmap.dim(), fn, ": sums has ", dims.m, " features; FAVOR's kernel=\"", opts.kernel, "\" with ",
          favor.projection.dim(0), " random features makes ", fmap.dim());
  prefill(dims, k, v, KeyFeatures<T>{nullptr, {}, {}, nullptr, &fmap}, valid, log_decay, state);
}

#define LINATTN_INSTANTIATE(T)                                                                                  \
  template void hybrid_prefill(TensorView<const T>, TensorView<const T>, TensorView<const T>,                  \
                               TensorView<const bool>, TensorView<const T>, const HybridDecodeState<T>&,       \
                               const HybridDecodeOptions&);                                                    \
  template void hybrid_prefill(TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>, \
                               TensorView<const bool>, TensorView<const T>, const HybridDecodeState<T>&,       \
                               const HybridDecodeOptions&);                                                    \
  template void hybrid_prefill(TensorView<const T>, TensorView<const T>, const FavorFeatures<T>&,              \
                               TensorView<const bool>, TensorView<const T>, const HybridDecodeState<T>&,       \
                               const HybridDecodeOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
