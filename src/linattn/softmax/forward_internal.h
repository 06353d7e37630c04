// Shared between the forward and the backward (which may recompute the forward).
#pragma once

#include "linattn/core/attention_args.h"
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

}  // namespace linattn::softmax_detail
