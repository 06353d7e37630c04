// What hybrid_decode_step (decode_step.cc) and hybrid_prefill (prefill.cc) check and build alike
// (internal).
#pragma once

#include <cstdint>

#include "linattn/core/feature_map.h"
#include "linattn/hybrid.h"

namespace linattn {

// FAVOR's per-feature shifts [B, H, m'] (each −inf or finite) with favor, none without; an Error
// naming fn otherwise.
template <class T>
void check_shift(const char* fn, const HybridDecodeState<T>& state, int64_t B, int64_t H, int64_t m, bool favor);

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
