#include "linattn/core/error.h"
#include "linattn/core/attention_args.h"

#include <cmath>

#include "linattn/core/simd.h"
#include "linattn/core/parallel.h"
#include "linattn/low_precision.h"

namespace linattn {
namespace {

// A value as a number: bfloat16 widened (exactly), for finiteness tests and messages.
template <class T>
auto number(T x) {
  if constexpr (is_low_precision_v<T>) return to_float(x);
  else return x;
}

template <class T>
void check_rank4(const char* fn, const char* name, const TensorView<const T>& x) {
  require(x.rank() == 4, fn, ": ", name, " must have rank 4 [batch, heads, seq, head_dim], got shape ",
          shape_string(x.shape));
  require(x.size() == 0 || x.data != nullptr, fn, ": ", name, " has no data");
}

// Checks that rows [0, rows_b) of every (b, h) of a [B,H,N,D] tensor are finite and returns the
// largest |value| among them.
template <class T>
double check_rows_finite(const char* fn, const char* name, const TensorView<const T>& x,
                         const std::vector<int64_t>& rows_per_batch) {
  const int64_t B = x.dim(0), H = x.dim(1), D = x.dim(3);
  // The rows of one (b, h) are contiguous: one SIMD pass per (b, h) on all workers gives both
  // answers (this pass reads every input once, as much memory traffic as some methods' whole
  // forward), and only look for the offending index, serially, when something is off.
  std::vector<double> max_abs(static_cast<size_t>(B * H), 0.0);
  parallel_for(B * H, [&](int64_t bh) {
    max_abs[static_cast<size_t>(bh)] = static_cast<double>(
        simd::finite_max_abs(x.row(bh, 0), static_cast<size_t>(rows_per_batch[static_cast<size_t>(bh / H)] * D)));
  });
  double largest = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const double m = max_abs[static_cast<size_t>(b * H + h)];
      if (!std::isnan(m)) {
        largest = std::max(largest, m);
        continue;
      }
      for (int64_t i = 0; i < rows_per_batch[b]; ++i) {
        const T* r = x.row(b * H + h, i);
        for (int64_t c = 0; c < D; ++c)
          if (!std::isfinite(number(r[c])))
            fail(fn, ": ", name, " has a non-finite value (", number(r[c]), ") at [", b, ", ", h, ", ", i,
                 ", ", c, "]; inputs must be finite");
      }
    }
  return largest;
}

}  // namespace

template <class T>
AttentionDims check_attention_args(const char* fn, TensorView<const T> q, TensorView<const T> k,
                                   TensorView<const T> v, const AttentionOptions& opts) {
  check_rank4(fn, "q", q);
  check_rank4(fn, "k", k);
  check_rank4(fn, "v", v);
  AttentionDims d{{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3), v.dim(3)}};
  require(d.head_dim >= 1, fn, ": head_dim (last dimension of q) must be >= 1, got shape ",
          shape_string(q.shape));
  require(d.value_dim >= 1, fn, ": value_dim (last dimension of v) must be >= 1, got shape ",
          shape_string(v.shape));
  require(k.dim(0) == d.batch && k.dim(1) == d.heads && k.dim(3) == d.head_dim, fn,
          ": k has shape ", shape_string(k.shape), "; expected [", d.batch, ", ", d.heads,
          ", n_k, ", d.head_dim, "] (batch, heads and head_dim of q ", shape_string(q.shape), ")");
  require(v.dim(0) == d.batch && v.dim(1) == d.heads && v.dim(2) == d.n_k, fn, ": v has shape ",
          shape_string(v.shape), "; expected [", d.batch, ", ", d.heads, ", ", d.n_k,
          ", value_dim] (batch and heads of q, sequence length of k)");
  std::vector<int64_t> key_rows(static_cast<size_t>(d.batch), d.n_k);
  if (opts.key_lengths) {
    const auto& kl = *opts.key_lengths;
    require(static_cast<int64_t>(kl.size()) == d.batch, fn, ": key_lengths has ", kl.size(),
            " entries; expected one per batch item (", d.batch, ")");
    for (size_t b = 0; b < kl.size(); ++b) {
      require(kl[b] >= 0 && kl[b] <= d.n_k, fn, ": key_lengths[", b, "] = ", kl[b],
              "; expected 0 <= key_lengths[b] <= n_k = ", d.n_k);
      key_rows[b] = kl[b];
    }
  }
  d.q_max = check_rows_finite(fn, "q", q, std::vector<int64_t>(static_cast<size_t>(d.batch), d.n_q));
  d.k_max = check_rows_finite(fn, "k", k, key_rows);
  d.v_max = check_rows_finite(fn, "v", v, key_rows);
  const double scale = resolve_scale(fn, opts, d.head_dim);
  // 16-bit calls apply the scale in float32.
  using Scale = accumulator_t<T>;
  const Scale as_t = static_cast<Scale>(scale);
  require(std::isfinite(as_t) && (scale == 0 || as_t != 0), fn, ": scale = ", scale,
          " is outside the range of ", dtype_name<Scale>(),
          " (it would round to ", as_t, ")");
  return d;
}

double resolve_scale(const char* fn, const AttentionOptions& opts, int64_t head_dim) {
  if (!opts.scale) return 1.0 / std::sqrt(static_cast<double>(head_dim));
  require(std::isfinite(*opts.scale), fn, ": scale must be finite, got ", *opts.scale);
  return *opts.scale;
}

template <class T>
NonCausalArgs check_noncausal_args(const char* fn, TensorView<const T> q, TensorView<const T> k,
                                   TensorView<const T> v, const AttentionOptions& opts, const char* why) {
  require(!opts.causal, fn, ": causal=true is not supported: ", why);
  NonCausalArgs a;
  a.mask_opts = opts;
  a.d = check_attention_args(fn, q, k, v, a.mask_opts);
  a.scale = resolve_scale(fn, a.mask_opts, a.d.head_dim);
  return a;
}

template <class T>
double check_finite(const char* fn, const char* name, TensorView<const T> x) {
  if (x.size() == 0) return 0;
  const double m = simd::finite_max_abs(x.data, static_cast<size_t>(x.size()));
  if (!std::isnan(m)) return m;
  for (int64_t i = 0; i < x.size(); ++i)
    require(std::isfinite(number(x.data[i])), fn, ": ", name, " has a non-finite value at flat index ", i,
            " (", number(x.data[i]), ")");
  return m;
}

template <class T>
double check_same_shape_finite(const char* fn, const char* name, TensorView<const T> x,
                               const Shape& expected) {
  if (x.shape != expected)
    fail(fn, ": ", name, " has shape ", shape_string(x.shape), "; expected ", shape_string(expected));
  require(x.size() == 0 || x.data != nullptr, fn, ": ", name, " has no data");
  if (x.rank() == 4)
    return check_rows_finite(fn, name, x, std::vector<int64_t>(static_cast<size_t>(x.dim(0)), x.dim(2)));
  return check_finite(fn, name, x);
}

template AttentionDims check_attention_args<float>(const char*, TensorView<const float>,
                                                   TensorView<const float>,
                                                   TensorView<const float>,
                                                   const AttentionOptions&);
template AttentionDims check_attention_args<double>(const char*, TensorView<const double>,
                                                    TensorView<const double>,
                                                    TensorView<const double>,
                                                    const AttentionOptions&);
template AttentionDims check_attention_args<bfloat16>(const char*, TensorView<const bfloat16>,
                                                      TensorView<const bfloat16>,
                                                      TensorView<const bfloat16>,
                                                      const AttentionOptions&);
template NonCausalArgs check_noncausal_args<float>(const char*, TensorView<const float>,
                                                   TensorView<const float>, TensorView<const float>,
                                                   const AttentionOptions&, const char*);
template NonCausalArgs check_noncausal_args<double>(const char*, TensorView<const double>,
                                                   TensorView<const double>, TensorView<const double>,
                                                   const AttentionOptions&, const char*);
template double check_finite<float>(const char*, const char*, TensorView<const float>);
template double check_finite<double>(const char*, const char*, TensorView<const double>);
template double check_same_shape_finite<float>(const char*, const char*, TensorView<const float>,
                                             const Shape&);
template double check_same_shape_finite<double>(const char*, const char*, TensorView<const double>,
                                              const Shape&);
template double check_same_shape_finite<bfloat16>(const char*, const char*, TensorView<const bfloat16>,
                                                const Shape&);

}  // namespace linattn
