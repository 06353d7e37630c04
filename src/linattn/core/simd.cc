// Highway kernels behind simd.h. foreach_target re-includes this file once per instruction
// set; HWY_DYNAMIC_DISPATCH picks the best one the CPU supports on first use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "linattn/core/simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <cmath>
#include <limits>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace linattn {
namespace simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class T>
T MaxValue(const T* x, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto lowest = hn::Set(d, -std::numeric_limits<T>::infinity());
  auto m0 = lowest, m1 = lowest;
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    m0 = hn::Max(m0, hn::LoadU(d, x + i));
    m1 = hn::Max(m1, hn::LoadU(d, x + i + N));
  }
  for (; i + N <= n; i += N) m0 = hn::Max(m0, hn::LoadU(d, x + i));
  if (i < n) {
    const auto mask = hn::FirstN(d, n - i);
    m1 = hn::Max(m1, hn::IfThenElse(mask, hn::MaskedLoad(mask, d, x + i), lowest));
  }
  return hn::GetLane(hn::MaxOfLanes(d, hn::Max(m0, m1)));
}

template <class T>
T ExpShiftedSum(T* x, size_t n, T shift) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto vshift = hn::Set(d, shift);
  auto s0 = hn::Zero(d), s1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    const auto e0 = hn::Exp(d, hn::Sub(hn::LoadU(d, x + i), vshift));
    const auto e1 = hn::Exp(d, hn::Sub(hn::LoadU(d, x + i + N), vshift));
    hn::StoreU(e0, d, x + i);
    hn::StoreU(e1, d, x + i + N);
    s0 = hn::Add(s0, e0);
    s1 = hn::Add(s1, e1);
  }
  for (; i + N <= n; i += N) {
    const auto e = hn::Exp(d, hn::Sub(hn::LoadU(d, x + i), vshift));
    hn::StoreU(e, d, x + i);
    s0 = hn::Add(s0, e);
  }
  if (i < n) {
    const auto mask = hn::FirstN(d, n - i);
    // Lanes past the end compute exp(0) and are dropped: no inf/NaN enters the sum.
    const auto v = hn::IfThenElse(mask, hn::MaskedLoad(mask, d, x + i), vshift);
    const auto e = hn::IfThenElseZero(mask, hn::Exp(d, hn::Sub(v, vshift)));
    hn::BlendedStore(e, mask, d, x + i);
    s1 = hn::Add(s1, e);
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(s0, s1)));
}

template <class T>
void Scale(T* x, size_t n, T a) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto va = hn::Set(d, a);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, x + i), va), d, x + i);
  for (; i < n; ++i) x[i] *= a;
}

template <class T>
bool SoftmaxRows(T* x, size_t rows, size_t cols, size_t ld, T* inv_sums) {
  for (size_t r = 0; r < rows; ++r) {
    T* row = x + r * ld;
    const T mx = MaxValue(row, cols);
    if (!(mx - mx == 0)) return false;  // ±inf or NaN
    const T inv = T(1) / ExpShiftedSum(row, cols, mx);
    if (inv_sums) inv_sums[r] = inv;
    else Scale(row, cols, inv);
  }
  return true;
}

template <class T>
void SoftmaxGrad(T* ds, const T* p, const T* dp, size_t n, T delta) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto vdelta = hn::Set(d, delta);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto r = hn::Mul(hn::LoadU(d, p + i), hn::Sub(hn::LoadU(d, dp + i), vdelta));
    hn::StoreU(r, d, ds + i);
  }
  for (; i < n; ++i) ds[i] = p[i] * (dp[i] - delta);
}

template <class T>
T Dot(const T* a, const T* b, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  auto s0 = hn::Zero(d), s1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    s0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), s0);
    s1 = hn::MulAdd(hn::LoadU(d, a + i + N), hn::LoadU(d, b + i + N), s1);
  }
  for (; i + N <= n; i += N) s0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), s0);
  if (i < n) {
    const auto mask = hn::FirstN(d, n - i);
    s1 = hn::MulAdd(hn::MaskedLoad(mask, d, a + i), hn::MaskedLoad(mask, d, b + i), s1);
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(s0, s1)));
}

template <class T>
T MaxAbs(const T* x, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  auto m = hn::Zero(d);
  size_t i = 0;
  for (; i + N <= n; i += N) m = hn::Max(m, hn::Abs(hn::LoadU(d, x + i)));
  if (i < n) {
    const auto mask = hn::FirstN(d, n - i);
    m = hn::Max(m, hn::Abs(hn::MaskedLoad(mask, d, x + i)));
  }
  return hn::GetLane(hn::MaxOfLanes(d, m));
}

template <class T>
void SinCos(const T* x, size_t n, T* s, T* c) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto v = hn::LoadU(d, x + i);
    hn::StoreU(hn::Sin(d, v), d, s + i);
    hn::StoreU(hn::Cos(d, v), d, c + i);
  }
  if (i < n) {
    const auto mask = hn::FirstN(d, n - i);
    const auto v = hn::MaskedLoad(mask, d, x + i);
    hn::BlendedStore(hn::Sin(d, v), mask, d, s + i);
    hn::BlendedStore(hn::Cos(d, v), mask, d, c + i);
  }
}

template <class T>
void ProductDifference(const T* a, const T* b, const T* c, const T* e, T* out, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  if (c) {
    for (; i + N <= n; i += N) {
      const auto ab = hn::Mul(hn::LoadU(d, a + i), hn::LoadU(d, b + i));
      hn::StoreU(hn::NegMulAdd(hn::LoadU(d, c + i), hn::LoadU(d, e + i), ab), d, out + i);
    }
    for (; i < n; ++i) out[i] = a[i] * b[i] - c[i] * e[i];
  } else {
    for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, a + i), hn::LoadU(d, b + i)), d, out + i);
    for (; i < n; ++i) out[i] = a[i] * b[i];
  }
}

template <class T>
void EluPlusOne(const T* x, T* out, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto zero = hn::Zero(d), one = hn::Set(d, T(1));
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto v = hn::LoadU(d, x + i);
    hn::StoreU(hn::IfThenElse(hn::Gt(v, zero), hn::Add(v, one), hn::Exp(d, hn::Min(v, zero))), d, out + i);
  }
  for (; i < n; ++i) out[i] = x[i] > 0 ? x[i] + T(1) : std::exp(x[i]);
}

template <class T>
bool AllFinite(const T* x, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  // x·0 is 0 for finite x and NaN otherwise; NaN survives the sum.
  auto acc0 = hn::Zero(d), acc1 = hn::Zero(d);
  const auto zero = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    acc0 = hn::MulAdd(hn::LoadU(d, x + i), zero, acc0);
    acc1 = hn::MulAdd(hn::LoadU(d, x + i + N), zero, acc1);
  }
  for (; i + N <= n; i += N) acc0 = hn::MulAdd(hn::LoadU(d, x + i), zero, acc0);
  if (i < n) {
    const auto mask = hn::FirstN(d, n - i);
    acc1 = hn::MulAdd(hn::MaskedLoad(mask, d, x + i), zero, acc1);
  }
  return hn::AllTrue(d, hn::IsFinite(hn::Add(acc0, acc1)));
}

// HWY_EXPORT needs one non-template name per function and type.
bool AllFiniteF32(const float* x, size_t n) { return AllFinite(x, n); }
bool AllFiniteF64(const double* x, size_t n) { return AllFinite(x, n); }
void EluPlusOneF32(const float* x, float* out, size_t n) { EluPlusOne(x, out, n); }
void EluPlusOneF64(const double* x, double* out, size_t n) { EluPlusOne(x, out, n); }
void ProductDifferenceF32(const float* a, const float* b, const float* c, const float* e, float* out,
                          size_t n) {
  ProductDifference(a, b, c, e, out, n);
}
void ProductDifferenceF64(const double* a, const double* b, const double* c, const double* e,
                          double* out, size_t n) {
  ProductDifference(a, b, c, e, out, n);
}
float MaxAbsF32(const float* x, size_t n) { return MaxAbs(x, n); }
double MaxAbsF64(const double* x, size_t n) { return MaxAbs(x, n); }
void SinCosF32(const float* x, size_t n, float* s, float* c) { SinCos(x, n, s, c); }
void SinCosF64(const double* x, size_t n, double* s, double* c) { SinCos(x, n, s, c); }
float MaxValueF32(const float* x, size_t n) { return MaxValue(x, n); }
double MaxValueF64(const double* x, size_t n) { return MaxValue(x, n); }
float ExpShiftedSumF32(float* x, size_t n, float s) { return ExpShiftedSum(x, n, s); }
double ExpShiftedSumF64(double* x, size_t n, double s) { return ExpShiftedSum(x, n, s); }
bool SoftmaxRowsF32(float* x, size_t rows, size_t cols, size_t ld, float* inv) {
  return SoftmaxRows(x, rows, cols, ld, inv);
}
bool SoftmaxRowsF64(double* x, size_t rows, size_t cols, size_t ld, double* inv) {
  return SoftmaxRows(x, rows, cols, ld, inv);
}
void ScaleF32(float* x, size_t n, float a) { Scale(x, n, a); }
void ScaleF64(double* x, size_t n, double a) { Scale(x, n, a); }
void SoftmaxGradF32(float* ds, const float* p, const float* dp, size_t n, float delta) {
  SoftmaxGrad(ds, p, dp, n, delta);
}
void SoftmaxGradF64(double* ds, const double* p, const double* dp, size_t n, double delta) {
  SoftmaxGrad(ds, p, dp, n, delta);
}
float DotF32(const float* a, const float* b, size_t n) { return Dot(a, b, n); }
double DotF64(const double* a, const double* b, size_t n) { return Dot(a, b, n); }
int64_t CurrentTarget() { return HWY_TARGET; }

}  // namespace HWY_NAMESPACE
}  // namespace simd
}  // namespace linattn
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "linattn/core/simd.h"

namespace linattn {
namespace simd {
HWY_EXPORT(MaxValueF32);
HWY_EXPORT(MaxValueF64);
HWY_EXPORT(ExpShiftedSumF32);
HWY_EXPORT(ExpShiftedSumF64);
HWY_EXPORT(SoftmaxRowsF32);
HWY_EXPORT(SoftmaxRowsF64);
HWY_EXPORT(ScaleF32);
HWY_EXPORT(ScaleF64);
HWY_EXPORT(SoftmaxGradF32);
HWY_EXPORT(SoftmaxGradF64);
HWY_EXPORT(DotF32);
HWY_EXPORT(DotF64);
HWY_EXPORT(CurrentTarget);
HWY_EXPORT(MaxAbsF32);
HWY_EXPORT(MaxAbsF64);
HWY_EXPORT(SinCosF32);
HWY_EXPORT(SinCosF64);
HWY_EXPORT(AllFiniteF32);
HWY_EXPORT(AllFiniteF64);
HWY_EXPORT(EluPlusOneF32);
HWY_EXPORT(EluPlusOneF64);
HWY_EXPORT(ProductDifferenceF32);
HWY_EXPORT(ProductDifferenceF64);

bool all_finite(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(AllFiniteF32)(x, n); }
bool all_finite(const double* x, size_t n) { return HWY_DYNAMIC_DISPATCH(AllFiniteF64)(x, n); }
void elu_plus_one(const float* x, float* out, size_t n) { HWY_DYNAMIC_DISPATCH(EluPlusOneF32)(x, out, n); }
void elu_plus_one(const double* x, double* out, size_t n) { HWY_DYNAMIC_DISPATCH(EluPlusOneF64)(x, out, n); }
void product_difference(const float* a, const float* b, const float* c, const float* e, float* out,
                        size_t n) {
  HWY_DYNAMIC_DISPATCH(ProductDifferenceF32)(a, b, c, e, out, n);
}
void product_difference(const double* a, const double* b, const double* c, const double* e,
                        double* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(ProductDifferenceF64)(a, b, c, e, out, n);
}

float max_abs(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(MaxAbsF32)(x, n); }
double max_abs(const double* x, size_t n) { return HWY_DYNAMIC_DISPATCH(MaxAbsF64)(x, n); }
void sin_cos(const float* x, size_t n, float* s, float* c) {
  HWY_DYNAMIC_DISPATCH(SinCosF32)(x, n, s, c);
}
void sin_cos(const double* x, size_t n, double* s, double* c) {
  HWY_DYNAMIC_DISPATCH(SinCosF64)(x, n, s, c);
}

float max_value(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(MaxValueF32)(x, n); }
double max_value(const double* x, size_t n) { return HWY_DYNAMIC_DISPATCH(MaxValueF64)(x, n); }
float exp_shifted_sum(float* x, size_t n, float shift) {
  return HWY_DYNAMIC_DISPATCH(ExpShiftedSumF32)(x, n, shift);
}
double exp_shifted_sum(double* x, size_t n, double shift) {
  return HWY_DYNAMIC_DISPATCH(ExpShiftedSumF64)(x, n, shift);
}
void scale(float* x, size_t n, float a) { HWY_DYNAMIC_DISPATCH(ScaleF32)(x, n, a); }
void scale(double* x, size_t n, double a) { HWY_DYNAMIC_DISPATCH(ScaleF64)(x, n, a); }
bool softmax_rows(float* x, size_t rows, size_t cols, size_t ld, float* inv_sums) {
  return HWY_DYNAMIC_DISPATCH(SoftmaxRowsF32)(x, rows, cols, ld, inv_sums);
}
bool softmax_rows(double* x, size_t rows, size_t cols, size_t ld, double* inv_sums) {
  return HWY_DYNAMIC_DISPATCH(SoftmaxRowsF64)(x, rows, cols, ld, inv_sums);
}
void softmax_grad(float* ds, const float* p, const float* dp, size_t n, float delta) {
  HWY_DYNAMIC_DISPATCH(SoftmaxGradF32)(ds, p, dp, n, delta);
}
void softmax_grad(double* ds, const double* p, const double* dp, size_t n, double delta) {
  HWY_DYNAMIC_DISPATCH(SoftmaxGradF64)(ds, p, dp, n, delta);
}
float dot(const float* a, const float* b, size_t n) { return HWY_DYNAMIC_DISPATCH(DotF32)(a, b, n); }
double dot(const double* a, const double* b, size_t n) {
  return HWY_DYNAMIC_DISPATCH(DotF64)(a, b, n);
}
const char* target_name() { return hwy::TargetName(HWY_DYNAMIC_DISPATCH(CurrentTarget)()); }

}  // namespace simd
}  // namespace linattn
#endif  // HWY_ONCE
