// Keeping results inside the dtype's range: inputs are finite (checked at the boundary), but
// finite values near the dtype's limit (v up to float32's 3.4e38) make sums of them overflow.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "linattn/attention.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/simd.h"
#include "linattn/tensor.h"

namespace linattn {

// t *= 2^e, exactly (unless it overflows or underflows).
template <class T>
void scale_by_power_of_two(Tensor<T>& t, int e) {
  if (e == 0) return;
  for (int64_t i = 0; i < t.size(); ++i) t[i] = std::ldexp(t[i], e);
}

// Every method's output is linear in v, and so are its gradients in dout: out(v) =
// 2^e·out(v·2^−e) exactly, since scaling by a power of two rounds nothing. So a tensor whose
// largest |value| exceeds 2^(emax/2) (float32: 9.2e18) is computed as a copy scaled down to
// below 2^(emax/4 + 1) (float32: 8.6e9), where no method's sums come near the range, and the
// results are scaled back. Only entries below 2^(emin + emax/4) lose digits in the copy, and
// next to an entry above 2^(emax/2) they are far below the result's rounding error. Below the
// threshold (every input of ordinary size): no copy, no cost.
template <class T>
class ValueScale {
 public:
  // The largest |value| taken as it is: 2^(emax/2), 2^64 for float. Beyond it, a scaled copy.
  static double unscaled_max() { return std::ldexp(1.0, std::numeric_limits<T>::max_exponent / 2); }
  ValueScale(TensorView<const T> x, double max_abs) : view_(x) {
    constexpr int emax = std::numeric_limits<T>::max_exponent;  // 128 (float), 1024 (double)
    if (max_abs > unscaled_max()) scale_copy(std::ilogb(max_abs) - emax / 4);
  }
  // x scaled by the same power of two as `like` (a saved output of the scaled input, say).
  ValueScale(TensorView<const T> x, const ValueScale& like) : view_(x) {
    if (like.exponent_ != 0) scale_copy(like.exponent_);
  }
  TensorView<const T> view() const { return view_; }
  int exponent() const { return exponent_; }
  // t *= 2^e: the result for the unscaled input (may overflow; check_result_finite says so).
  void restore(Tensor<T>& t) const { scale_by_power_of_two(t, exponent_); }
  // The largest |value| of view(): at most 2^(emax/4 + 1) when scaled.
  double max_abs(double unscaled_max_abs) const { return std::ldexp(unscaled_max_abs, -exponent_); }

 private:
  void scale_copy(int exponent) {
    exponent_ = exponent;
    copy_ = Tensor<T>(view_.shape, /*workspace=*/true, Init::Uninitialized);
    for (int64_t i = 0; i < copy_.size(); ++i) copy_[i] = std::ldexp(view_.data[i], -exponent_);
    view_ = copy_.view();
  }

  TensorView<const T> view_;
  Tensor<T> copy_;
  int exponent_ = 0;
};

// Error when a result computed from finite inputs is not finite: the true value is beyond the
// dtype's range (a gradient of huge inputs, say). Never a silent inf or NaN.
// One SIMD pass, split over the workers (it reads the whole result once: a few percent of the
// cheapest methods' time).
template <class T>
void check_result_finite(const char* fn, const char* what, const Tensor<T>& t) {
  constexpr int64_t kBlock = int64_t{1} << 16;
  const int64_t blocks = (t.size() + kBlock - 1) / kBlock;
  std::atomic<bool> finite{true};
  parallel_for(blocks, [&](int64_t b) {
    const int64_t begin = b * kBlock, count = std::min(kBlock, t.size() - begin);
    if (!simd::all_finite(t.data() + begin, static_cast<size_t>(count))) finite.store(false);
  });
  if (finite.load()) return;
  fail(fn, ": ", what, " overflows ", dtype_name<T>(),
       ": the inputs are finite but too large for this dtype; scale them down or use float64");
}

// Which of dq, dk, dv a backward's kernel already found finite while it wrote them (in cache),
// so restore_gradients need not read them again when it does not rescale them.
struct CheckedGradients {
  bool dq = false, dk = false, dv = false;
};

// A backward worker's check of the gradient values it writes, block by block while they are in
// cache (the pass over dq, dk, dv that restore_gradients would otherwise make): ok stays true
// while every value is finite.
struct WrittenFinite {
  bool ok = true;
  template <class T>
  void check(const T* x, int64_t count) {
    if (ok) ok = simd::all_finite(x, static_cast<size_t>(count));
  }
};

// Whether every worker's WrittenFinite (a PerWorker<WrittenFinite>) saw only finite values.
template <class Workers>
bool all_written_finite(Workers& written) {
  for (int w = 0; w < written.size(); ++w)
    if (!written[w].ok) return false;
  return true;
}

// After a backward computed from v·2^−v_exp and dout·2^−dout_exp (ValueScale): dq, dk and the
// parameter gradients are linear in v and in dout, dv in dout alone; then every gradient is
// checked to be finite (unless `checked` says so and it was not rescaled).
template <class T>
void restore_gradients(const char* fn, AttentionGrads<T>& g, int v_exp, int dout_exp,
                       CheckedGradients checked = {}) {
  scale_by_power_of_two(g.dq, v_exp + dout_exp);
  scale_by_power_of_two(g.dk, v_exp + dout_exp);
  scale_by_power_of_two(g.dv, dout_exp);
  for (auto& [name, t] : g.params) scale_by_power_of_two(t, v_exp + dout_exp);
  const bool qk_scaled = v_exp + dout_exp != 0, v_scaled = dout_exp != 0;
  if (!checked.dq || qk_scaled) check_result_finite(fn, "dq", g.dq);
  if (!checked.dk || qk_scaled) check_result_finite(fn, "dk", g.dk);
  if (!checked.dv || v_scaled) check_result_finite(fn, "dv", g.dv);
  for (const auto& [name, t] : g.params) check_result_finite(fn, ("the gradient of " + name).c_str(), t);
}

}  // namespace linattn
