// Argument checks shared by the Efficient Attention fast path and its reference.
#pragma once

#include <algorithm>

#include "linattn/core/attention_args.h"
#include "linattn/core/row_softmax.h"
#include "linattn/efficient.h"
#include "linattn/memory.h"

namespace linattn::efficient {

inline constexpr int64_t kRowBlock = 256;  // query rows per block

using Setup = NonCausalArgs;

template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 const EfficientAttentionOptions& opts);

// Per-worker buffers of the forward and backward (and of the state-level operations).
template <class T>
struct Buffers {
  Buffers(const Setup& s, bool backward)
      : e(s.d.head_dim * s.d.n_k),
        inv(s.d.head_dim),
        work(3 * s.d.head_dim),
        g(s.d.head_dim * s.d.value_dim),
        qb(std::min(kRowBlock, s.d.n_q) * s.d.head_dim),
        dg(backward ? s.d.head_dim * s.d.value_dim : 0),
        dqb(backward ? std::min(kRowBlock, s.d.n_q) * s.d.head_dim : 0) {}
  Buffer<T> e, inv, work, g, qb, dg, dqb;
};

// ρ_q = softmax over features of s·Q for `rows` query rows from r0, into b.qb.
template <class T>
void query_block(const char* fn, const Setup& s, TensorView<const T> q, int64_t bh, int64_t r0,
                 int64_t rows, Buffers<T>& b) {
  const int64_t hd = s.d.head_dim;
  const T sc = static_cast<T>(s.scale);
  const T* src = q.row(bh, r0);
  for (int64_t i = 0; i < rows * hd; ++i) b.qb[i] = sc * src[i];
  softmax_rows(fn, b.qb.data(), rows, hd, hd);
}

}  // namespace linattn::efficient
