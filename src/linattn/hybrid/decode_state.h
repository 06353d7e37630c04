// What hybrid_decode_step (decode_step.cc) and hybrid_prefill (prefill.cc) check and build alike
// (internal).
#pragma once

#include <cstdint>

#include "linattn/core/feature_map.h"
#include "linattn/hybrid.h"

namespace linattn {

// The sizes a step's or a prefill's state must have.
struct DecodeShape {
  int64_t B, H, Hkv, m, d, dv;
};

// The checks a step and a prefill share: window >= 0, sinks >= 0 (0 without a window), kernel
// only with FAVOR, log_decay [H] finite and <= 0 (or empty), the state's arrays of `shape` with
// s + w exact slots, and FAVOR's shifts [B, H, m'] (each −inf or finite when shift_values: a
// prefill overwrites them) with favor, none without. An Error naming fn and the argument.
template <class T>
void check_decode_state(const char* fn, const HybridDecodeOptions& opts, TensorView<const T> log_decay,
                        const HybridDecodeState<T>& state, const DecodeShape& shape, bool favor, bool shift_values);

// A fixed map by name for a step or a prefill (elu, relu, focused: parse_plain_feature_map's
// names but "given", with opts.focus_power); an Error naming fn otherwise.
template <class T>
FeatureMap<T> fixed_decode_map(const char* fn, const HybridDecodeOptions& opts, int64_t head_dim);

// FAVOR's map for a step or a prefill: opts.feature_map "favor", opts.kernel (trig only without a
// window), the projection ω [m, head_dim] and opts.scale checked; an Error naming fn otherwise.
template <class T>
FeatureMap<T> favor_decode_map(const char* fn, const FavorFeatures<T>& favor, int64_t head_dim,
                               const HybridDecodeOptions& opts);

}  // namespace linattn
