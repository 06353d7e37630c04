#include <cmath>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/blas.h"
#include "linattn/core/depthwise_conv.h"
#include "linattn/core/row_softmax.h"
#include "linattn/core/simd.h"
#include "linattn/nystrom/internal.h"

namespace linattn::nystrom {
namespace {

// Segment means of rows [0, L) of x (row stride ld) into m landmarks: out [m, d].
template <class T>
void pool(const T* x, int64_t ld, int64_t L, int64_t m, int64_t d, T* out) {
  for (int64_t j = 0; j < m; ++j) {
    const int64_t b = segment_begin(j, L, m), e = segment_end(j, L, m);
    T* o = out + j * d;
    std::fill(o, o + d, T(0));
    for (int64_t i = b; i < e; ++i)
      for (int64_t c = 0; c < d; ++c) o[c] += x[i * ld + c];
    const T inv = T(1) / static_cast<T>(e - b);
    for (int64_t c = 0; c < d; ++c) o[c] *= inv;
  }
}

}  // namespace

template <class T>
Setup check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                 const NystromOptions& opts, std::optional<TensorView<const T>> conv_weight) {
  Setup s{check_noncausal_args(fn, q, k, v, opts,
                               "Nyström landmarks are means over segments of the whole sequence, "
                               "so every output would see future positions")};
  require(s.d.n_q == s.d.n_k, fn, ": q and k must have the same sequence length (self-attention: ",
          "landmarks pool queries and keys over the same positions), got n_q = ", s.d.n_q,
          ", n_k = ", s.d.n_k);
  require(opts.num_landmarks >= 1, fn, ": num_landmarks must be >= 1, got ", opts.num_landmarks);
  require(opts.pinv_iterations >= 0, fn, ": pinv_iterations must be >= 0, got ",
          opts.pinv_iterations);
  s.pinv = parse_pinv(fn, opts.pinv);
  s.max_landmarks = std::min(opts.num_landmarks, s.d.n_k);
  s.iterations = opts.pinv_iterations;
  if (conv_weight) check_depthwise_conv(fn, "conv_weight", s.d, false, *conv_weight);
  return s;
}

template <class T>
HeadBuffers<T>::HeadBuffers(const Setup& s, bool backward) {
  const int64_t M = s.max_landmarks, n = s.d.n_k, d = s.d.head_dim, dv = s.d.value_dim,
                rows = std::min(kRowBlock, s.d.n_q);
  const bool iterative = s.pinv == PinvMethod::Iterative;
  qt = Buffer<T>(M * d);
  kt = Buffer<T>(M * d);
  a = Buffer<T>(M * M);
  f3 = Buffer<T>(M * n, true, Init::Uninitialized);  // written by a product before use
  inv_sums = Buffer<T>(M);
  z = Buffer<T>(M * M);
  if (backward && iterative) iterates = Buffer<T>((s.iterations + 1) * M * M);
  w = Buffer<T>(M * dv);
  y = Buffer<T>(M * dv);
  scores = Buffer<T>(rows * M);
  pinv_scratch = Buffer<T>(pinv_scratch_size(M));
  if (!backward) return;
  dscores = Buffer<T>(std::max(rows * M, M * n));  // dS1 blocks, then dF3
  dy = Buffer<T>(M * dv);
  dz = Buffer<T>(M * M);
  dw = Buffer<T>(M * dv);
  dqt = Buffer<T>(M * d);
  dkt = Buffer<T>(M * d);
  da = Buffer<T>(M * M);
}

template <class T>
void landmark_side(const char* fn, const Setup& s, TensorView<const T> q, TensorView<const T> k,
                   TensorView<const T> v, int64_t bh, int64_t L, int64_t m, HeadBuffers<T>& hb,
                   bool backward) {
  const int64_t d = s.d.head_dim, dv = s.d.value_dim;
  const T sc = static_cast<T>(s.scale);
  pool(q.row(bh, 0), d, L, m, d, hb.qt.data());
  pool(k.row(bh, 0), d, L, m, d, hb.kt.data());
  matmul<T>(mat(hb.a.data(), m, m), mat(hb.qt.data(), m, d), mat(hb.kt.data(), m, d).t(), sc);
  softmax_rows(fn, hb.a.data(), m, m, m);
  matmul<T>(mat(hb.f3.data(), m, L), mat(hb.qt.data(), m, d), mat(k.row(bh, 0), L, d).t(), sc);
  softmax_rows(fn, hb.f3.data(), m, L, L, backward ? nullptr : hb.inv_sums.data());
  pinv_forward<T>(s.pinv, hb.a.data(), m, s.iterations, hb.z.data(),
                  backward && s.pinv == PinvMethod::Iterative ? hb.iterates.data() : nullptr,
                  hb.pinv_scratch.data());
  matmul<T>(mat(hb.w.data(), m, dv), mat(hb.f3.data(), m, L), mat(v.row(bh, 0), L, dv));
  if (!backward)
    for (int64_t j = 0; j < m; ++j) simd::scale(hb.w.data() + j * dv, static_cast<size_t>(dv), hb.inv_sums[j]);
  matmul<T>(mat(hb.y.data(), m, dv), mat(hb.z.data(), m, m), mat(hb.w.data(), m, dv));
}

#define LINATTN_INSTANTIATE(T)                                                                 \
  template Setup check_args<T>(const char*, TensorView<const T>, TensorView<const T>,          \
                               TensorView<const T>, const NystromOptions&,                     \
                               std::optional<TensorView<const T>>);                            \
  template struct HeadBuffers<T>;                                                              \
  template void landmark_side<T>(const char*, const Setup&, TensorView<const T>,               \
                                 TensorView<const T>, TensorView<const T>, int64_t, int64_t,   \
                                 int64_t, HeadBuffers<T>&, bool);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn::nystrom
