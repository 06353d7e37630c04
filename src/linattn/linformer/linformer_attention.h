// Linformer (Wang et al., 2020): keys and values projected along the sequence,
//   out = softmax(Q (E K)ᵀ·s) (F V),  E, F [s_proj, n_max] (shared by heads) or [heads, s_proj, n_max].
// O(n·s_proj·d) time. Never causal: each projected key mixes every position.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/bounded.h"
#include "linattn/core/tensor.h"

namespace linattn {

struct LinformerOptions {
  std::optional<std::vector<int64_t>> key_lengths;  // padded keys: their columns of E, F count as 0
  std::optional<double> scale;                      // default 1/sqrt(head_dim)
  bool causal = false;  // true is an error: there is no causal Linformer
};

template <class T>
struct LinformerGrads {
  Tensor<T> dq, dk, dv, de, df;  // de, df have the shapes of e, f
};

// q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v], e and f of one shape, [s,n_max] or
// [H,s,n_max] with n_k <= n_max (the first n_k columns are used) -> out [B,H,n_q,d_v].
template <class T>
Tensor<T> linformer_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                              TensorView<const T> e, TensorView<const T> f,
                              const LinformerOptions& opts = {});

template <class T>
LinformerGrads<T> linformer_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                               TensorView<const T> v, TensorView<const T> e,
                                               TensorView<const T> f, TensorView<const T> dout,
                                               const LinformerOptions& opts = {});

// E and F as fairseq's Linformer initialises its compression layers: Xavier-uniform with gain
// 1/√2, i.e. uniform on (−a, a) with a = sqrt(3 / (n_max + s_proj)). heads = 0 gives shared
// [s_proj, n_max] matrices, heads > 0 one per head. E from Rng(seed), F from Rng(seed + 1).
template <class T>
std::pair<Tensor<T>, Tensor<T>> linformer_projections(int64_t s_proj, int64_t n_max,
                                                      int64_t heads = 0, uint64_t seed = 0);

namespace reference {
// Float64 loops with rounding bounds at unit roundoff u (see tracked_matrix.h).
Bounded linformer_attention(TensorView<const double> q, TensorView<const double> k,
                            TensorView<const double> v, TensorView<const double> e,
                            TensorView<const double> f, const LinformerOptions& opts, double u = 0);
// dq, dk, dv, de, df.
std::vector<Bounded> linformer_attention_backward(TensorView<const double> q,
                                                  TensorView<const double> k,
                                                  TensorView<const double> v,
                                                  TensorView<const double> e,
                                                  TensorView<const double> f,
                                                  TensorView<const double> dout,
                                                  const LinformerOptions& opts, double u = 0);
}  // namespace reference

}  // namespace linattn
