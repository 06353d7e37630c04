// Argument checks shared by the Linformer fast path and its reference.
#pragma once

#include <algorithm>

#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/parallel.h"
#include "linattn/linformer.h"

namespace linattn::linformer {

inline constexpr int64_t kRowBlock = 256;  // query rows per softmax(Q K'ᵀ) block
inline constexpr int64_t kColBlock = 256;  // columns of dE, dF per task of the backward

struct Setup : NonCausalArgs {
  int64_t s_proj = 0, n_max = 0;
  bool per_head = false;
  // Projection matrix of head h: rows of n_max values.
  int64_t offset(int64_t h) const { return per_head ? h * s_proj * n_max : 0; }
};

template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 TensorView<const T> e, TensorView<const T> f, const LinformerOptions& opts);

// dE[:, offset + j] += Σ_{b,h sharing E} dK'_bh K_bh[j]ᵀ over j < L_b, and dF likewise from dV'
// and V: dK'_bh at dkp + bh·dk_stride (rows of ld_k values), dV'_bh at dvp + bh·dv_stride (ld_v).
// Tasks own column blocks of one matrix, so no two write the same element (no atomics).
template <class T>
void add_projection_grads(const Setup& s, const KeyMask& mask, TensorView<const T> k, TensorView<const T> v,
                          const T* dkp, int64_t dk_stride, int64_t ld_k, const T* dvp, int64_t dv_stride, int64_t ld_v,
                          int64_t offset, T* de, T* df) {
  const AttentionDims& d = s.d;
  const int64_t sp = s.s_proj, hd = d.head_dim, dv = d.value_dim;
  const int64_t col_blocks = (d.n_k + kColBlock - 1) / kColBlock, mats = s.per_head ? d.heads : 1;
  parallel_for(mats * col_blocks, [&](int64_t task) {
    const int64_t which = task / col_blocks, j0 = (task % col_blocks) * kColBlock;
    for (int64_t bh = 0; bh < d.bh(); ++bh) {
      const int64_t h = bh % d.heads;
      if (s.per_head && h != which) continue;
      const int64_t j1 = std::min(j0 + kColBlock, mask.key_length(bh / d.heads));
      if (j1 <= j0) continue;
      const int64_t at = s.offset(h) + offset + j0;
      matmul<T>(mat(de + at, sp, j1 - j0, s.n_max), mat(dkp + bh * dk_stride, sp, hd, ld_k),
                mat(k.row(bh, j0), j1 - j0, hd).t(), T(1), T(1));
      matmul<T>(mat(df + at, sp, j1 - j0, s.n_max), mat(dvp + bh * dv_stride, sp, dv, ld_v),
                mat(v.row(bh, j0), j1 - j0, dv).t(), T(1), T(1));
    }
  });
}

}  // namespace linattn::linformer
