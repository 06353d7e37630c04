// Nyströmformer (Xiong et al., 2021): softmax attention through m landmarks,
//   out = softmax(Q K̃ᵀ·s) · pinv(softmax(Q̃ K̃ᵀ·s)) · softmax(Q̃ Kᵀ·s) V  (+ conv of V),
// Q̃, K̃ the segment means of the queries and keys. O(n·m·d) time, O(n·m) memory per head.
// Self-attention only (n_q == n_k) and never causal: landmarks pool over future positions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/bounded.h"
#include "linattn/core/tensor.h"

namespace linattn {

struct NystromOptions {
  // Landmarks m (>= 1). A sequence of n_b valid positions uses min(m, n_b), so with m >= n_b
  // every position is its own landmark.
  int64_t num_landmarks = 64;
  int64_t pinv_iterations = 6;     // Newton–Schulz-type steps of pinv="iterative" (>= 0)
  std::string pinv = "iterative";  // "iterative" or "exact" (SVD by LAPACK)
  std::optional<std::vector<int64_t>> key_lengths;  // one per batch item; later positions ignored
  std::optional<double> scale;                      // default 1/sqrt(head_dim)
  bool causal = false;  // true is an error: there is no causal Nyström attention
};

template <class T>
struct NystromGrads {
  Tensor<T> dq, dk, dv;
  Tensor<T> d_conv_weight;  // [heads, K] when a conv_weight was given, else empty
};

// q, k [B,H,n,d], v [B,H,n,d_v] -> out [B,H,n,d_v].
// conv_weight [heads, K], K odd: out[i] += Σ_t w[h,t]·v[i+t−(K−1)/2], v zero outside the
// sequence and at padded positions.
template <class T>
Tensor<T> nystrom_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                            const NystromOptions& opts = {},
                            std::optional<TensorView<const T>> conv_weight = std::nullopt);

// Gradients of Σ out∘dout through the pooling, all three softmaxes, the pseudo-inverse (the
// iterations as computed, or the SVD pseudo-inverse's derivative) and the convolution.
template <class T>
NystromGrads<T> nystrom_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                           TensorView<const T> v, TensorView<const T> dout,
                                           const NystromOptions& opts = {},
                                           std::optional<TensorView<const T>> conv_weight = std::nullopt);

// Landmark j of a sequence of n positions and m landmarks (adaptive average pooling) averages
// positions [segment_begin(j), segment_end(j)): floor(j·n/m) .. ceil((j+1)·n/m) − 1.
inline int64_t segment_begin(int64_t j, int64_t n, int64_t m) { return j * n / m; }
inline int64_t segment_end(int64_t j, int64_t n, int64_t m) { return ((j + 1) * n + m - 1) / m; }

namespace reference {
struct Arith;
struct Tracked;
// The iterative pseudo-inverse one step at a time (tracked_matrix.h): V₀ = Aᵀ/(‖A‖₁‖A‖∞), and
// V ↦ ¼·V(13I − AV(15I − AV(7I − AV))), each with the rounding bound of that step alone when its
// inputs carry no error. Lets a test check every float32 step of the fast path against its
// own derived bound.
Tracked pinv_initial_iterate(const Arith& a, const Tracked& A);
Tracked pinv_iteration(const Arith& a, const Tracked& A, const Tracked& V);

// Float64 loops (tracked_matrix.h) in the association the fast path uses. The result's bound
// is, per element, the worst-case rounding error of a fast path at unit roundoff u (0: none).
// The exact pseudo-inverse is computed here by Gauss–Jordan inversion (an independent method:
// A is square and, where the test applies, invertible).
Bounded nystrom_attention(TensorView<const double> q, TensorView<const double> k,
                          TensorView<const double> v, const NystromOptions& opts,
                          std::optional<TensorView<const double>> conv_weight, double u = 0);
// Values and bounds of dq, dk, dv (and d_conv_weight when given), in that order.
std::vector<Bounded> nystrom_attention_backward(TensorView<const double> q,
                                                TensorView<const double> k,
                                                TensorView<const double> v,
                                                TensorView<const double> dout,
                                                const NystromOptions& opts,
                                                std::optional<TensorView<const double>> conv_weight,
                                                double u = 0);
}  // namespace reference

}  // namespace linattn
