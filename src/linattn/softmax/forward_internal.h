// Shared between the forward and the backward (which may recompute the forward).
#pragma once

#include <optional>

#include "linattn/core/attention_args.h"
#include "linattn/low_precision.h"
#include "linattn/softmax.h"

namespace linattn::softmax_detail {

// Query and key rows per tile: the forward's (one kBlockQ×kBlockK score tile per worker) and
// the backward's.
inline constexpr int64_t kForwardBlockQ = 128, kForwardBlockK = 512;
inline constexpr int64_t kBackwardBlockQ = 128, kBackwardBlockK = 128;

// The forward after its arguments are checked. `as_workspace`: the outputs are temporaries
// of a backward call and count as its workspace.
template <class T>
SoftmaxAttentionResult<T> forward(TensorView<const T> q, TensorView<const T> k,
                                  TensorView<const T> v, const AttentionDims& dims,
                                  const AttentionOptions& opts, double scale, bool as_workspace);

// The bfloat16 forward with bfloat16 products (forward_bf16.cc), on AMX tiles or AVX512-BF16.
enum class Bf16Engine { amx, avx512_bf16 };
// The best engine this machine has (AMX, then AVX512-BF16), or none.
std::optional<Bf16Engine> bf16_engine();
bool bf16_engine_usable(Bf16Engine engine);
const char* engine_name(Bf16Engine engine);
// Whether `engine` can take a checked call on this machine (engine usable, scale > 0,
// |v| ≤ 2^64), and the forward itself (Error otherwise).
bool bf16_tiles_usable(const AttentionDims& dims, double scale, Bf16Engine engine);
struct Bf16TilesResult {
  Tensor<bfloat16> out;  // [B, H, n_q, d_v]
  Tensor<float> lse;     // [B, H, n_q], as the float32 forward saves it
};
Bf16TilesResult forward_bf16_tiles(TensorView<const bfloat16> q, TensorView<const bfloat16> k,
                                   TensorView<const bfloat16> v, const AttentionDims& dims,
                                   const AttentionOptions& opts, double scale, Bf16Engine engine);

}  // namespace linattn::softmax_detail
