// Linformer's state-level operation (include/linattn/linformer.h), per (batch, head), with
// E_L the columns offset + j, j < L, of head h's projection:
//   forward:   [K' | V'] = [E_L·K_L | F_L·V_L]   [s, d + d_v]
//   backward:  dk_L = E_Lᵀ dK', dv_L = F_Lᵀ dV'; dE_L = Σ_{b,h sharing E} dK' K_Lᵀ (likewise dF),
//              summed in a second loop over column blocks, as linformer.cc's backward does
//              (each task owns its columns: no atomics).
#include <algorithm>

#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/linformer.h"
#include "linattn/linformer/internal.h"

namespace linattn {
namespace {

// The checks of linformer_attention with no queries, and offset + n_k <= n_max.
template <class T>
linformer::Setup check_block(const char* fn, TensorView<const T> k, TensorView<const T> v, TensorView<const T> e,
                             TensorView<const T> f, int64_t offset, const LinformerOptions& opts) {
  require(k.shape.size() == 4, fn, ": k must be [batch, heads, n, head_dim], got shape ", shape_string(k.shape));
  const TensorView<const T> no_queries{nullptr, {k.dim(0), k.dim(1), 0, k.dim(3)}};
  const linformer::Setup s = linformer::check_args(fn, no_queries, k, v, e, f, opts);
  require(offset >= 0 && offset + s.d.n_k <= s.n_max, fn, ": offset = ", offset, " with n = ", s.d.n_k,
          " keys needs 0 <= offset <= n_max − n = ", s.n_max - s.d.n_k, " (the columns of e and f)");
  return s;
}

}  // namespace

template <class T>
Tensor<T> linformer_project(TensorView<const T> k, TensorView<const T> v, TensorView<const T> e, TensorView<const T> f,
                            int64_t offset, const LinformerOptions& opts) {
  const char* fn = "linformer_project";
  const linformer::Setup s = check_block(fn, k, v, e, f, offset, opts);
  const AttentionDims& d = s.d;
  const KeyMask mask(d, s.mask_opts);
  const int64_t hd = d.head_dim, dv = d.value_dim, sp = s.s_proj, row = hd + dv;
  Tensor<T> out({d.batch, d.heads, sp, row}, false, Init::Uninitialized);
  parallel_for(d.bh(), [&](int64_t bh) {
    const int64_t L = mask.key_length(bh / d.heads), h = bh % d.heads;
    T* o = out.data() + bh * sp * row;
    if (L == 0) {
      std::fill(o, o + sp * row, T(0));
      return;
    }
    const int64_t at = s.offset(h) + offset;
    matmul<T>(mat(o, sp, hd, row), mat(e.data + at, sp, L, s.n_max), mat(k.row(bh, 0), L, hd));
    matmul<T>(mat(o + hd, sp, dv, row), mat(f.data + at, sp, L, s.n_max), mat(v.row(bh, 0), L, dv));
  });
  check_result_finite(fn, "the projection", out);
  return out;
}

template <class T>
AttentionGrads<T> linformer_project_backward(TensorView<const T> k, TensorView<const T> v, TensorView<const T> e,
                                             TensorView<const T> f, TensorView<const T> dprojected, int64_t offset,
                                             const LinformerOptions& opts, bool param_grads) {
  const char* fn = "linformer_project_backward";
  const linformer::Setup s = check_block(fn, k, v, e, f, offset, opts);
  const AttentionDims& d = s.d;
  const int64_t hd = d.head_dim, dv = d.value_dim, sp = s.s_proj, row = hd + dv;
  check_same_shape_finite(fn, "dprojected", dprojected, {d.batch, d.heads, sp, row});
  const KeyMask mask(d, s.mask_opts);
  AttentionGrads<T> g{{}, Tensor<T>(k.shape, false, Init::Uninitialized), Tensor<T>(v.shape, false, Init::Uninitialized), {}};
  parallel_for(d.bh(), [&](int64_t bh) {
    const int64_t L = mask.key_length(bh / d.heads), h = bh % d.heads;
    T* dk = g.dk.data() + bh * d.n_k * hd;
    T* dvo = g.dv.data() + bh * d.n_k * dv;
    std::fill(dk + L * hd, dk + d.n_k * hd, T(0));
    std::fill(dvo + L * dv, dvo + d.n_k * dv, T(0));
    if (L == 0) return;
    const int64_t at = s.offset(h) + offset;
    const T* gp = dprojected.data + bh * sp * row;
    matmul<T>(mat(dk, L, hd), mat(e.data + at, sp, L, s.n_max).t(), mat(gp, sp, hd, row));
    matmul<T>(mat(dvo, L, dv), mat(f.data + at, sp, L, s.n_max).t(), mat(gp + hd, sp, dv, row));
  });
  check_result_finite(fn, "dk", g.dk);
  check_result_finite(fn, "dv", g.dv);
  if (!param_grads) return g;
  g.params.emplace_back("e", Tensor<T>(e.shape));  // zeros outside the block's valid columns
  g.params.emplace_back("f", Tensor<T>(f.shape));
  Tensor<T>& de = g.params[0].second;
  Tensor<T>& df = g.params[1].second;
  linformer::add_projection_grads(s, mask, k, v, dprojected.data, sp * row, row, dprojected.data + hd, sp * row, row,
                                  offset, de.data(), df.data());
  check_result_finite(fn, "the gradient of e", de);
  check_result_finite(fn, "the gradient of f", df);
  return g;
}

#define LINATTN_INSTANTIATE(T)                                                                                     \
  template Tensor<T> linformer_project(TensorView<const T>, TensorView<const T>, TensorView<const T>,              \
                                       TensorView<const T>, int64_t, const LinformerOptions&);                     \
  template AttentionGrads<T> linformer_project_backward(TensorView<const T>, TensorView<const T>, TensorView<const T>, \
                                                        TensorView<const T>, TensorView<const T>, int64_t,         \
                                                        const LinformerOptions&, bool);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
