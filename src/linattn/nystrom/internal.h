// Shared by the Nyström forward and backward: argument checks and the landmark side of one head
// (everything that does not depend on the query block).
#pragma once

#include <algorithm>
#include <optional>

#include "linattn/core/attention_args.h"
#include "linattn/memory.h"
#include "linattn/nystrom.h"
#include "linattn/nystrom/pinv.h"

namespace linattn::nystrom {

inline constexpr int64_t kRowBlock = 1024;  // query rows per softmax(Q K̃ᵀ) block

struct Setup : NonCausalArgs {
  PinvMethod pinv = PinvMethod::Iterative;
  int64_t max_landmarks = 0;  // min(num_landmarks, n)
  int64_t iterations = 0;
};

template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 const NystromOptions& opts, std::optional<TensorView<const T>> conv_weight);

// Per-worker buffers, sized for the largest head before the parallel loop.
template <class T>
struct HeadBuffers {
  HeadBuffers(const Setup& s, bool backward);
  Buffer<T> qt, kt, a, f3, inv_sums, z, iterates, w, y, scores, pinv_scratch;
  // backward only
  Buffer<T> dscores, dy, dz, dw, dqt, dkt, da;
};

// For head bh with L valid positions and m = min(max_landmarks, L) landmarks, fills
// Q̃, K̃ [m,d]; A = softmax(Q̃K̃ᵀ·s) [m,m]; F3 = softmax(Q̃K_Lᵀ·s) [m,L]; Z = pinv(A)
// (and its iterates); W = F3·V_L [m,d_v]; Y = Z·W [m,d_v]. With keep_f3 false (the forward),
// F3 is left unnormalised and W's rows are divided by the sums instead (m·d_v divisions, not
// m·L).
template <class T>
void landmark_side(const char* fn, const Setup& s, TensorView<const T> q, TensorView<const T> k,
                   TensorView<const T> v, int64_t bh, int64_t L, int64_t m, HeadBuffers<T>& hb,
                   bool backward);

}  // namespace linattn::nystrom
