// Hedgehog's learned map over whole tensors (include/linattn/kernelized.h: hedgehog_features and
// its backward): the logits U = X·W_h of a block of rows are one BLAS product, the rest is
// core/hedgehog_map.h's row formula, which hybrid_decode_step runs on one row. The torch and
// NumPy layers call these; the float64 reference is reference::hedgehog_features.
#include <algorithm>
#include <optional>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/error.h"
#include "linattn/core/hedgehog_map.h"
#include "linattn/core/parallel.h"
#include "linattn/kernelized.h"

namespace linattn {
namespace {

// Rows per task: at least 256 (a product worth a BLAS call), at most 16 blocks per item (the
// backward keeps a part of ∂W per head and block). Fixed by n alone, so that the weights'
// gradient sums its parts in the same order at every thread count (bitwise the same result).
constexpr int64_t kRowsPerBlock = 256;
struct RowBlocks {
  int64_t rows, count;
};
RowBlocks row_blocks(int64_t n) {
  const int64_t count = std::clamp<int64_t>((n + kRowsPerBlock - 1) / kRowsPerBlock, 1, 16);
  return {std::max<int64_t>((n + count - 1) / count, 1), count};
}

struct HedgehogDims {
  int64_t B, H, n, d, f;
};

template <class T>
HedgehogDims check_hedgehog(const char* fn, TensorView<const T> x, TensorView<const T> weight,
                            TensorView<const T> bias) {
  require(x.rank() == 4, fn, ": x must be [batch, heads, n, head_dim], got shape ", shape_string(x.shape));
  require(x.dim(3) >= 1, fn, ": head_dim (the last dimension of x) must be >= 1, got ", x.dim(3));
  const int64_t H = x.dim(1), d = x.dim(3);
  const int64_t f = check_hedgehog_map(fn, "weight", "bias", weight, bias, H, d);
  check_finite(fn, "x", x);
  return {x.dim(0), H, x.dim(2), d, f};
}

}  // namespace

template <class T>
void hedgehog_block(const T* x, const T* W, const T* bias, int64_t rows, int64_t d, int64_t f, T* phi) {
  matmul(mat(phi, rows, f, 2 * f), mat(x, rows, d), mat(W, d, f));
  for (int64_t i = 0; i < rows; ++i) {
    T* u = phi + i * 2 * f;
    for (int64_t j = 0; j < f; ++j) u[j] += bias[j];
    hedgehog_from_logits(u, f, u);
  }
}
template void hedgehog_block(const float*, const float*, const float*, int64_t, int64_t, int64_t, float*);
template void hedgehog_block(const double*, const double*, const double*, int64_t, int64_t, int64_t, double*);

template <class T>
Tensor<T> hedgehog_features(TensorView<const T> x, TensorView<const T> weight, TensorView<const T> bias) {
  const HedgehogDims s = check_hedgehog("hedgehog_features", x, weight, bias);
  Tensor<T> phi({s.B, s.H, s.n, 2 * s.f}, false, Init::Uninitialized);
  const RowBlocks rb = row_blocks(s.n);
  parallel_for(s.B * s.H * rb.count, [&](int64_t task) {
    const int64_t bh = task / rb.count, first = (task % rb.count) * rb.rows, h = bh % s.H;
    const int64_t rows = std::min(rb.rows, s.n - first);
    if (rows <= 0) return;
    hedgehog_block(x.data + (bh * s.n + first) * s.d, weight.data + h * s.d * s.f, bias.data + h * s.f, rows, s.d,
                   s.f, phi.data() + (bh * s.n + first) * 2 * s.f);
  });
  return phi;
}

template <class T>
HedgehogGrads<T> hedgehog_features_backward(TensorView<const T> x, TensorView<const T> weight,
                                            TensorView<const T> bias, TensorView<const T> dphi,
                                            std::optional<TensorView<const T>> phi_given) {
  const char* fn = "hedgehog_features_backward";
  const HedgehogDims s = check_hedgehog(fn, x, weight, bias);
  const int64_t d = s.d, f = s.f;
  check_same_shape_finite(fn, "dphi", dphi, {s.B, s.H, s.n, 2 * f});
  if (phi_given) check_same_shape_finite(fn, "phi", *phi_given, {s.B, s.H, s.n, 2 * f});
  HedgehogGrads<T> g{Tensor<T>(x.shape), Tensor<T>(weight.shape, false, Init::Zero),
                     Tensor<T>(bias.shape, false, Init::Zero)};
  if (g.dx.size() == 0) return g;
  // Each task is one head's block of rows in every batch row: their ∂U, then ∂x = ∂U·W_hᵀ and
  // the block's part of ∂W_h = Xᵀ·∂U and ∂b_h, summed per head afterwards in block order.
  const RowBlocks rb = row_blocks(s.n);
  const int64_t tasks = s.H * rb.count;
  std::vector<T> part_w(static_cast<size_t>(tasks * d * f), T(0)), part_b(static_cast<size_t>(tasks * f), T(0));
  parallel_for(tasks, [&](int64_t task) {
    const int64_t h = task / rb.count, first = (task % rb.count) * rb.rows;
    const int64_t rows = std::min(rb.rows, s.n - first);
    if (rows <= 0) return;
    const T* W = weight.data + h * d * f;
    T* dw = part_w.data() + task * d * f;
    T* db = part_b.data() + task * f;
    std::vector<T> made(phi_given ? 0 : static_cast<size_t>(rows * 2 * f)), du(static_cast<size_t>(rows * f)),
        scratch(static_cast<size_t>(f));
    for (int64_t b = 0; b < s.B; ++b) {
      const int64_t at = (b * s.H + h) * s.n + first;  // the block's first row in x
      const T* phi = phi_given ? phi_given->data + at * 2 * f : made.data();
      if (!phi_given) hedgehog_block(x.data + at * d, W, bias.data + h * f, rows, d, f, made.data());
      const T* dp = dphi.data + at * 2 * f;
      for (int64_t i = 0; i < rows; ++i)
        hedgehog_logits_backward(phi + i * 2 * f, dp + i * 2 * f, f, du.data() + i * f, scratch.data());
      const Mat<const T> dU = mat<const T>(du.data(), rows, f);
      matmul(mat(g.dx.data() + at * d, rows, d), dU, mat(W, d, f).t());
      matmul(mat(dw, d, f), mat(x.data + at * d, rows, d).t(), dU, T(1), T(1));
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < f; ++j) db[j] += du[i * f + j];
    }
  });
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t h = task / rb.count;
    T* dw = g.dweight.data() + h * d * f;
    T* db = g.dbias.data() + h * f;
    const T* pw = part_w.data() + task * d * f;
    const T* pb = part_b.data() + task * f;
    for (int64_t i = 0; i < d * f; ++i) dw[i] += pw[i];
    for (int64_t j = 0; j < f; ++j) db[j] += pb[j];
  }
  return g;
}

#define LINATTN_HEDGEHOG(T)                                                                                    \
  template Tensor<T> hedgehog_features(TensorView<const T>, TensorView<const T>, TensorView<const T>);        \
  template HedgehogGrads<T> hedgehog_features_backward(TensorView<const T>, TensorView<const T>,              \
                                                       TensorView<const T>, TensorView<const T>,               \
                                                       std::optional<TensorView<const T>>);
LINATTN_HEDGEHOG(float)
LINATTN_HEDGEHOG(double)
#undef LINATTN_HEDGEHOG

}  // namespace linattn
