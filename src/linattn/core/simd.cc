// Highway kernels behind simd.h. foreach_target re-includes this file once per instruction
// set; HWY_DYNAMIC_DISPATCH picks the best one the CPU supports on first use.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "linattn/core/simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "linattn/low_precision.h"

HWY_BEFORE_NAMESPACE();
namespace linattn {
namespace simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The first `count` (< lanes) values at p, the other lanes 0; and storing the first `count` lanes
// of v. Why not hn::MaskedLoad / hn::BlendedStore for the tails of arrays: on SSE4 and below
// Highway 1.0.3 does them as whole-vector loads and load-blend-store sequences, which read, and
// write back, past the end of the array (a race with whoever owns the next bytes). Tests run
// every target (tests/test_util.h, for_each_simd_target) under ASan.
// On AVX2 and AVX-512, for 32- and 64-bit lanes, they are masked loads and stores (vmaskmov,
// AVX-512 masks), which touch only the lanes asked for: the copy through a buffer was 4% of the
// causal exact forward at n = 1024, whose rows end inside a vector on every diagonal block.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
constexpr bool kMaskedTails = true;
#else
constexpr bool kMaskedTails = false;
#endif
template <class D>
HWY_INLINE hn::Vec<D> LoadTail(D d, const hn::TFromD<D>* p, size_t count) {
  if constexpr (kMaskedTails && sizeof(hn::TFromD<D>) >= 4) {
    return hn::MaskedLoad(hn::FirstN(d, count), d, p);
  } else {
    HWY_ALIGN hn::TFromD<D> buf[hn::MaxLanes(d)] = {};
    std::copy(p, p + count, buf);
    return hn::Load(d, buf);
  }
}
template <class D>
HWY_INLINE void StoreTail(D d, hn::Vec<D> v, hn::TFromD<D>* p, size_t count) {
  if constexpr (kMaskedTails && sizeof(hn::TFromD<D>) >= 4) {
    hn::BlendedStore(v, hn::FirstN(d, count), d, p);
  } else {
    HWY_ALIGN hn::TFromD<D> buf[hn::MaxLanes(d)];
    hn::Store(v, d, buf);
    std::copy(buf, buf + count, p);
  }
}

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
    m1 = hn::Max(m1, hn::IfThenElse(mask, LoadTail(d, x + i, n - i), lowest));
  }
  return hn::GetLane(hn::MaxOfLanes(d, hn::Max(m0, m1)));
}

// exp(x) for the x <= 0 of a shifted softmax (x = s − max), float: one Cody–Waite reduction
// r = x − n·ln2, Cephes' expf polynomial for exp(r), and 2^n put into the exponent bits; below
// ln(2^−126) (and for −inf) the result is 0, dropping subnormals under 1.2e−38 of a row whose
// sum is >= 1. Why not hn::Exp: it serves the whole range (a second scaling multiply, the
// overflow side), and on this path it was 16% of exact attention's forward; this one is about
// 1.5× faster (0.48 against 0.71 ns per value, AVX2) at <= 1.3 ULP against its 1.0
// (test_core.cc checks every 29th float in [−87.3, 0]). It also serves 0 < x < 88 exactly as well.
// elu+1 takes it too, for exp(min(x, 0)) (hn::Exp was 22% of a bfloat16 elu forward).
// double keeps hn::Exp.
template <class D>
HWY_INLINE hn::Vec<D> ExpNonPositive(D d, hn::Vec<D> x) {
  using T = hn::TFromD<D>;
  if constexpr (sizeof(T) != 4) {
    return hn::Exp(d, hn::Max(x, hn::Set(d, std::numeric_limits<T>::lowest())));
  } else {
    const hn::RebindToSigned<D> di;
    const auto low = hn::Set(d, -87.33654f);  // ln(2^−126)
    const auto xc = hn::Max(x, low);
    // n = round(x·log2 e) by adding 1.5·2^23 + 127, where a float's ulp is 1: t holds n + 127 in
    // its low mantissa bits (2^n's biased exponent, shifted into place below) and t − magic = n
    // exactly. Four instructions fewer than Round, ConvertTo and an add.
    const auto magic = hn::Set(d, 12583039.0f);  // 1.5·2^23 + 127
    const auto t = hn::MulAdd(xc, hn::Set(d, 1.44269504088896341f), magic);
    const auto n = hn::Sub(t, magic);
    auto r = hn::NegMulAdd(n, hn::Set(d, 0.693359375f), xc);  // ln2 = 0.693359375 − 2.12194440e−4
    r = hn::NegMulAdd(n, hn::Set(d, -2.12194440e-4f), r);
    auto p = hn::Set(d, 1.9875691500e-4f);
    p = hn::MulAdd(p, r, hn::Set(d, 1.3981999507e-3f));
    p = hn::MulAdd(p, r, hn::Set(d, 8.3334519073e-3f));
    p = hn::MulAdd(p, r, hn::Set(d, 4.1665795894e-2f));
    p = hn::MulAdd(p, r, hn::Set(d, 1.6666665459e-1f));
    p = hn::MulAdd(p, r, hn::Set(d, 5.0000001201e-1f));
    p = hn::MulAdd(p, hn::Mul(r, r), hn::Add(r, hn::Set(d, 1.0f)));  // 1 + r + r²·P(r)
    const auto two_n = hn::BitCast(d, hn::ShiftLeft<23>(hn::BitCast(di, t)));
    return hn::IfThenElseZero(hn::Gt(x, low), hn::Mul(p, two_n));
  }
}

template <class T>
T ExpShiftedSum(T* x, size_t n, T shift) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto vshift = hn::Set(d, shift);
  auto s0 = hn::Zero(d), s1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    const auto e0 = ExpNonPositive(d, hn::Sub(hn::LoadU(d, x + i), vshift));
    const auto e1 = ExpNonPositive(d, hn::Sub(hn::LoadU(d, x + i + N), vshift));
    hn::StoreU(e0, d, x + i);
    hn::StoreU(e1, d, x + i + N);
    s0 = hn::Add(s0, e0);
    s1 = hn::Add(s1, e1);
  }
  for (; i + N <= n; i += N) {
    const auto e = ExpNonPositive(d, hn::Sub(hn::LoadU(d, x + i), vshift));
    hn::StoreU(e, d, x + i);
    s0 = hn::Add(s0, e);
  }
  if (i < n) {
    const auto mask = hn::FirstN(d, n - i);
    // Lanes past the end compute exp(0) and are dropped: no inf/NaN enters the sum.
    const auto v = hn::IfThenElse(mask, LoadTail(d, x + i, n - i), vshift);
    const auto e = hn::IfThenElseZero(mask, ExpNonPositive(d, hn::Sub(v, vshift)));
    StoreTail(d, e, x + i, n - i);
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

// Column sums are taken in blocks of kColumnBlock rows, each block's partial sum then added to
// the total: rounding error ~(kColumnBlock + rows/kColumnBlock)·u instead of rows·u.
constexpr size_t kColumnBlock = 256;

// acc[c] += a[c]·b[c] (b == nullptr: acc[c] += a[c]) for one row of cols values.
template <class T>
HWY_INLINE void AccumulateRow(T* acc, const T* a, const T* b, size_t cols) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  size_t c = 0;
  for (; c + N <= cols; c += N) {
    const auto x = b ? hn::Mul(hn::LoadU(d, a + c), hn::LoadU(d, b + c)) : hn::LoadU(d, a + c);
    hn::StoreU(hn::Add(hn::LoadU(d, acc + c), x), d, acc + c);
  }
  for (; c < cols; ++c) acc[c] += b ? a[c] * b[c] : a[c];
}

// sum[c] = Σ_r a[r,c]·b[r,c] (b == nullptr: Σ_r a[r,c]) over `rows` contiguous rows of cols,
// blocked as above; part is scratch of cols values.
template <class T>
void ColumnSums(const T* a, const T* b, size_t rows, size_t cols, T* sum, T* part) {
  for (size_t c = 0; c < cols; ++c) sum[c] = 0;
  for (size_t r0 = 0; r0 < rows; r0 += kColumnBlock) {
    for (size_t c = 0; c < cols; ++c) part[c] = 0;
    const size_t r1 = r0 + kColumnBlock < rows ? r0 + kColumnBlock : rows;
    for (size_t r = r0; r < r1; ++r) AccumulateRow(part, a + r * cols, b ? b + r * cols : nullptr, cols);
    AccumulateRow(sum, part, static_cast<const T*>(nullptr), cols);
  }
}

template <class T>
bool SoftmaxColumns(const T* src, size_t ld, T* dst, size_t rows, size_t cols, T scale,
                    T* inv_sums, T* work) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto vs = hn::Set(d, scale);
  T* col_max = work;
  for (size_t c = 0; c < cols; ++c) col_max[c] = -std::numeric_limits<T>::infinity();
  for (size_t r = 0; r < rows; ++r) {
    const T* x = src + r * ld;
    size_t c = 0;
    for (; c + N <= cols; c += N)
      hn::StoreU(hn::Max(hn::LoadU(d, col_max + c), hn::Mul(hn::LoadU(d, x + c), vs)), d, col_max + c);
    for (; c < cols; ++c) col_max[c] = std::max(col_max[c], x[c] * scale);
  }
  for (size_t c = 0; c < cols; ++c)
    if (!(col_max[c] - col_max[c] == 0)) return false;  // ±inf or NaN (or no rows)
  // e = exp(scale·x − max), the same product as above, so each column's max gives exp(0) = 1.
  for (size_t r = 0; r < rows; ++r) {
    const T* x = src + r * ld;
    T* y = dst + r * cols;
    size_t c = 0;
    for (; c + N <= cols; c += N)
      hn::StoreU(hn::Exp(d, hn::Sub(hn::Mul(hn::LoadU(d, x + c), vs), hn::LoadU(d, col_max + c))), d, y + c);
    for (; c < cols; ++c) y[c] = std::exp(x[c] * scale - col_max[c]);
  }
  ColumnSums(dst, static_cast<const T*>(nullptr), rows, cols, inv_sums, work + cols);
  for (size_t c = 0; c < cols; ++c) inv_sums[c] = T(1) / inv_sums[c];
  return true;
}

template <class T>
void SoftmaxColumnsBackward(const T* e, const T* inv_sums, T* g, size_t rows, size_t cols, T scale,
                            T* work) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  T* delta = work;          // δ_c = inv_c·Σ_r e[r,c]·g[r,c] = Σ_r P[r,c]·dP[r,c]
  T* coef = work + cols;    // scale·inv_c
  ColumnSums(e, g, rows, cols, delta, work + 2 * cols);
  for (size_t c = 0; c < cols; ++c) {
    delta[c] *= inv_sums[c];
    coef[c] = scale * inv_sums[c];
  }
  for (size_t r = 0; r < rows; ++r) {
    const T* er = e + r * cols;
    T* gr = g + r * cols;
    size_t c = 0;
    for (; c + N <= cols; c += N) {
      const auto p = hn::Mul(hn::LoadU(d, coef + c), hn::LoadU(d, er + c));
      hn::StoreU(hn::Mul(p, hn::Sub(hn::LoadU(d, gr + c), hn::LoadU(d, delta + c))), d, gr + c);
    }
    for (; c < cols; ++c) gr[c] = coef[c] * er[c] * (gr[c] - delta[c]);
  }
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
    s1 = hn::MulAdd(LoadTail(d, a + i, n - i), LoadTail(d, b + i, n - i), s1);
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(s0, s1)));
}

template <class T>
T Sum(const T* x, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  auto s0 = hn::Zero(d), s1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    s0 = hn::Add(s0, hn::LoadU(d, x + i));
    s1 = hn::Add(s1, hn::LoadU(d, x + i + N));
  }
  for (; i + N <= n; i += N) s0 = hn::Add(s0, hn::LoadU(d, x + i));
  if (i < n) s1 = hn::Add(s1, LoadTail(d, x + i, n - i));
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
    m = hn::Max(m, hn::Abs(LoadTail(d, x + i, n - i)));
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
    const auto v = LoadTail(d, x + i, n - i);
    StoreTail(d, hn::Sin(d, v), s + i, n - i);
    StoreTail(d, hn::Cos(d, v), c + i, n - i);
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
void SelectPositive(const T* x, const T* a, const T* b, T* out, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto zero = hn::Zero(d);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto va = hn::LoadU(d, a + i);
    const auto other = b ? hn::Mul(va, hn::LoadU(d, b + i)) : zero;
    hn::StoreU(hn::IfThenElse(hn::Gt(hn::LoadU(d, x + i), zero), va, other), d, out + i);
  }
  for (; i < n; ++i) out[i] = x[i] > 0 ? a[i] : (b ? a[i] * b[i] : T(0));
}

template <class T>
void EluPlusOne(const T* x, T* out, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto zero = hn::Zero(d), one = hn::Set(d, T(1));
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto v = hn::LoadU(d, x + i);
    hn::StoreU(hn::IfThenElse(hn::Gt(v, zero), hn::Add(v, one), ExpNonPositive(d, hn::Min(v, zero))), d, out + i);
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
    acc1 = hn::MulAdd(LoadTail(d, x + i, n - i), zero, acc1);
  }
  return hn::AllTrue(d, hn::IsFinite(hn::Add(acc0, acc1)));
}

// m[c] = max(m[c], max_r x[r, c]): vectors run along the columns, rows one after another.
template <class T>
void ColumnMax(const T* x, size_t rows, size_t cols, size_t ld, T* m) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  size_t c = 0;
  for (; c + N <= cols; c += N) {
    auto acc = hn::LoadU(d, m + c);
    for (size_t r = 0; r < rows; ++r) acc = hn::Max(acc, hn::LoadU(d, x + r * ld + c));
    hn::StoreU(acc, d, m + c);
  }
  for (; c < cols; ++c)
    for (size_t r = 0; r < rows; ++r) m[c] = std::max(m[c], x[r * ld + c]);
}

// x[r, c] = exp(x[r, c] − shift[c]); arguments are clamped at the lowest finite value, so an
// x of −inf (or one far below its shift) gives 0, never NaN. Callers keep x − shift <= 0.
template <class T>
void ExpMinusColumns(T* x, size_t rows, size_t cols, size_t ld, const T* shift) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto lowest = hn::Set(d, std::numeric_limits<T>::lowest());
  for (size_t r = 0; r < rows; ++r) {
    T* row = x + r * ld;
    size_t c = 0;
    for (; c + N <= cols; c += N) {
      const auto a = hn::Max(hn::Sub(hn::LoadU(d, row + c), hn::LoadU(d, shift + c)), lowest);
      hn::StoreU(hn::Exp(d, a), d, row + c);
    }
    if (c < cols) {
      const auto a = hn::Max(hn::Sub(LoadTail(d, row + c, cols - c), LoadTail(d, shift + c, cols - c)), lowest);
      StoreTail(d, hn::Exp(d, a), row + c, cols - c);
    }
  }
}

// y = x + offset, t = max y, x = exp(y − t); returns t. A row whose every y is −inf becomes 0
// and returns −inf.
template <class T>
T ExpRowOffset(T* x, size_t cols, const T* offset) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const T ninf = -std::numeric_limits<T>::infinity();
  auto m = hn::Set(d, ninf);
  size_t c = 0;
  for (; c + N <= cols; c += N) m = hn::Max(m, hn::Add(hn::LoadU(d, x + c), hn::LoadU(d, offset + c)));
  T t = hn::GetLane(hn::MaxOfLanes(d, m));
  for (; c < cols; ++c) t = std::max(t, x[c] + offset[c]);
  if (t == ninf) {
    std::fill(x, x + cols, T(0));
    return t;
  }
  const auto vt = hn::Set(d, t);
  c = 0;
  for (; c + N <= cols; c += N) {
    const auto y = hn::Add(hn::LoadU(d, x + c), hn::LoadU(d, offset + c));
    hn::StoreU(ExpNonPositive(d, hn::Sub(y, vt)), d, x + c);
  }
  for (; c < cols; ++c) {
    const T a = x[c] + offset[c] - t;
    x[c] = a == ninf ? T(0) : std::exp(a);
  }
  return t;
}

// max |x[i]| when every x[i] is finite, else NaN: one pass for both questions.
template <class T>
T FiniteMaxAbs(const T* x, size_t n) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const auto zero = hn::Zero(d);
  auto m = hn::Zero(d), nan = hn::Zero(d);  // x·0 + nan stays 0 unless some x is not finite
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto v = hn::LoadU(d, x + i);
    m = hn::Max(m, hn::Abs(v));
    nan = hn::MulAdd(v, zero, nan);
  }
  if (i < n) {
    const auto v = LoadTail(d, x + i, n - i);
    m = hn::Max(m, hn::Abs(v));
    nan = hn::MulAdd(v, zero, nan);
  }
  if (!hn::AllTrue(d, hn::IsFinite(nan))) return std::numeric_limits<T>::quiet_NaN();
  return hn::GetLane(hn::MaxOfLanes(d, m));
}

// Decay products of gated linear attention's diagonal blocks (src/linattn/gated/gated.cc). A
// block of `rows` rows keeps its pairs (j, i), i <= j, packed row after row at j(j+1)/2 + i,
// `dim` values each (one per channel).
HWY_INLINE size_t Pair(size_t j, size_t i) { return j * (j + 1) / 2 + i; }

// e[pair(j, i)] = Π_{i < t <= j} a[t] (1 for i = j), from the row before: one multiply a value.
template <class T>
void DecayPairs(const T* a, size_t rows, size_t dim, T* e) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  for (size_t j = 0; j < rows; ++j) {
    T* row = e + Pair(j, 0) * dim;
    if (j > 0) {
      const T* prev = e + Pair(j - 1, 0) * dim;
      const T* aj = a + j * dim;
      for (size_t i = 0; i < j; ++i) {
        size_t c = 0;
        for (; c + N <= dim; c += N)
          hn::StoreU(hn::Mul(hn::LoadU(d, prev + i * dim + c), hn::LoadU(d, aj + c)), d, row + i * dim + c);
        if (c < dim)
          StoreTail(d, hn::Mul(LoadTail(d, prev + i * dim + c, dim - c), LoadTail(d, aj + c, dim - c)),
                    row + i * dim + c, dim - c);
      }
    }
    std::fill(row + j * dim, row + (j + 1) * dim, T(1));
  }
}

// out[j·ld + i] = Σ_c q[j][c]·k[i][c]·e[pair(j, i)][c] for i <= j < rows.
template <class T>
void DecayedDots(const T* q, const T* k, const T* e, size_t rows, size_t dim, T* out, size_t ld) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  for (size_t j = 0; j < rows; ++j)
    for (size_t i = 0; i <= j; ++i) {
      const T* qj = q + j * dim;
      const T* ki = k + i * dim;
      const T* eji = e + Pair(j, i) * dim;
      auto acc = hn::Zero(d);
      size_t c = 0;
      for (; c + N <= dim; c += N)
        acc = hn::MulAdd(hn::Mul(hn::LoadU(d, qj + c), hn::LoadU(d, ki + c)), hn::LoadU(d, eji + c), acc);
      if (c < dim)
        acc = hn::MulAdd(hn::Mul(LoadTail(d, qj + c, dim - c), LoadTail(d, ki + c, dim - c)),
                         LoadTail(d, eji + c, dim - c), acc);
      out[j * ld + i] = hn::GetLane(hn::SumOfLanes(d, acc));
    }
}

// y[j] += Σ_{i <= j} w[j·ldw + i]·x[i] ⊙ e[pair(j, i)] (later: false), or
// y[i] += Σ_{j >= i} w[j·ldw + i]·x[j] ⊙ e[pair(j, i)] (later: true).
template <class T>
void DecayedWeigh(const T* w, size_t ldw, const T* x, const T* e, size_t rows, size_t dim, T* y, bool later) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  for (size_t r = 0; r < rows; ++r) {
    const size_t first = later ? r : 0, last = later ? rows - 1 : r;
    for (size_t c = 0; c < dim; c += N) {
      const size_t count = std::min(N, dim - c);
      auto acc = count == N ? hn::LoadU(d, y + r * dim + c) : LoadTail(d, y + r * dim + c, count);
      for (size_t o = first; o <= last; ++o) {
        const size_t j = later ? o : r, i = later ? r : o;
        const auto weight = hn::Set(d, w[j * ldw + i]);
        const T* xo = x + o * dim + c;
        const T* eji = e + Pair(j, i) * dim + c;
        const auto xv = count == N ? hn::LoadU(d, xo) : LoadTail(d, xo, count);
        const auto ev = count == N ? hn::LoadU(d, eji) : LoadTail(d, eji, count);
        acc = hn::MulAdd(hn::Mul(weight, xv), ev, acc);
      }
      if (count == N)
        hn::StoreU(acc, d, y + r * dim + c);
      else
        StoreTail(d, acc, y + r * dim + c, count);
    }
  }
}

// out[r·ld_out + c] (=, or += with accumulate) a[r·cols + c]·b[r·b_stride + c]: b a matrix of
// rows of `cols` (b_stride = cols) or one row for every row (b_stride = 0).
template <class T>
void Multiply(const T* a, const T* b, size_t b_stride, size_t rows, size_t cols, T* out, size_t ld_out,
              bool accumulate) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  for (size_t r = 0; r < rows; ++r) {
    const T* ar = a + r * cols;
    const T* br = b + r * b_stride;
    T* o = out + r * ld_out;
    size_t c = 0;
    for (; c + N <= cols; c += N) {
      const auto p = hn::Mul(hn::LoadU(d, ar + c), hn::LoadU(d, br + c));
      hn::StoreU(accumulate ? hn::Add(hn::LoadU(d, o + c), p) : p, d, o + c);
    }
    if (c < cols) {
      const size_t n = cols - c;
      const auto p = hn::Mul(LoadTail(d, ar + c, n), LoadTail(d, br + c, n));
      StoreTail(d, accumulate ? hn::Add(LoadTail(d, o + c, n), p) : p, o + c, n);
    }
  }
}

// x[c] = Σ_r a[r]·S[r][c] and y[c] = Σ_r b[r]·S[r][c] for c < cols (S rows × cols, row-major):
// both in one pass over S, four vectors of columns at a time (eight independent sums).
template <class T>
void StateDots(const T* S, size_t rows, size_t cols, const T* a, const T* b, T* x, T* y) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  size_t c = 0;
  for (; c + 4 * N <= cols; c += 4 * N) {
    auto x0 = hn::Zero(d), x1 = hn::Zero(d), x2 = hn::Zero(d), x3 = hn::Zero(d);
    auto y0 = hn::Zero(d), y1 = hn::Zero(d), y2 = hn::Zero(d), y3 = hn::Zero(d);
    for (size_t r = 0; r < rows; ++r) {
      const T* s = S + r * cols + c;
      const auto ar = hn::Set(d, a[r]), br = hn::Set(d, b[r]);
      const auto s0 = hn::LoadU(d, s), s1 = hn::LoadU(d, s + N), s2 = hn::LoadU(d, s + 2 * N),
                 s3 = hn::LoadU(d, s + 3 * N);
      x0 = hn::MulAdd(ar, s0, x0), x1 = hn::MulAdd(ar, s1, x1), x2 = hn::MulAdd(ar, s2, x2), x3 = hn::MulAdd(ar, s3, x3);
      y0 = hn::MulAdd(br, s0, y0), y1 = hn::MulAdd(br, s1, y1), y2 = hn::MulAdd(br, s2, y2), y3 = hn::MulAdd(br, s3, y3);
    }
    hn::StoreU(x0, d, x + c), hn::StoreU(x1, d, x + c + N), hn::StoreU(x2, d, x + c + 2 * N);
    hn::StoreU(x3, d, x + c + 3 * N);
    hn::StoreU(y0, d, y + c), hn::StoreU(y1, d, y + c + N), hn::StoreU(y2, d, y + c + 2 * N);
    hn::StoreU(y3, d, y + c + 3 * N);
  }
  for (; c < cols; c += N) {
    const size_t count = std::min(N, cols - c);
    auto xs = hn::Zero(d), ys = hn::Zero(d);
    for (size_t r = 0; r < rows; ++r) {
      const T* s = S + r * cols + c;
      const auto sv = count == N ? hn::LoadU(d, s) : LoadTail(d, s, count);
      xs = hn::MulAdd(hn::Set(d, a[r]), sv, xs);
      ys = hn::MulAdd(hn::Set(d, b[r]), sv, ys);
    }
    if (count == N) {
      hn::StoreU(xs, d, x + c), hn::StoreU(ys, d, y + c);
    } else {
      StoreTail(d, xs, x + c, count), StoreTail(d, ys, y + c, count);
    }
  }
}

// out[r] = Σ_c x[r][c]·a[c] for r < rows (x rows × cols, row-major): four rows at a time, each
// summed in vector lanes and then across them.
template <class T>
void RowDots(const T* x, size_t rows, size_t cols, const T* a, T* out) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  size_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const T* x0 = x + r * cols;
    auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
    size_t c = 0;
    for (; c + N <= cols; c += N) {
      const auto av = hn::LoadU(d, a + c);
      s0 = hn::MulAdd(hn::LoadU(d, x0 + c), av, s0);
      s1 = hn::MulAdd(hn::LoadU(d, x0 + cols + c), av, s1);
      s2 = hn::MulAdd(hn::LoadU(d, x0 + 2 * cols + c), av, s2);
      s3 = hn::MulAdd(hn::LoadU(d, x0 + 3 * cols + c), av, s3);
    }
    if (c < cols) {
      const size_t n = cols - c;
      const auto av = LoadTail(d, a + c, n);
      s0 = hn::MulAdd(LoadTail(d, x0 + c, n), av, s0);
      s1 = hn::MulAdd(LoadTail(d, x0 + cols + c, n), av, s1);
      s2 = hn::MulAdd(LoadTail(d, x0 + 2 * cols + c, n), av, s2);
      s3 = hn::MulAdd(LoadTail(d, x0 + 3 * cols + c, n), av, s3);
    }
    out[r] = hn::GetLane(hn::SumOfLanes(d, s0)), out[r + 1] = hn::GetLane(hn::SumOfLanes(d, s1));
    out[r + 2] = hn::GetLane(hn::SumOfLanes(d, s2)), out[r + 3] = hn::GetLane(hn::SumOfLanes(d, s3));
  }
  for (; r < rows; ++r) {
    const T* xr = x + r * cols;
    auto acc = hn::Zero(d);
    size_t c = 0;
    for (; c + N <= cols; c += N) acc = hn::MulAdd(hn::LoadU(d, xr + c), hn::LoadU(d, a + c), acc);
    if (c < cols) acc = hn::MulAdd(LoadTail(d, xr + c, cols - c), LoadTail(d, a + c, cols - c), acc);
    out[r] = hn::GetLane(hn::SumOfLanes(d, acc));
  }
}

// Q queries at once (a [Q × cols], out [Q × rows]: out[q·rows + r] = Σ_c x[r][c]·a[q][c]), two
// keys at a time: each key row is loaded once for the Q queries (2Q independent sums), which is
// what a decoding step's grouped query heads need (the key head's slots read once, not Q times).
template <int Q, class T>
void RowDotsGroup(const T* x, size_t rows, size_t cols, const T* a, T* out) {
  static_assert(Q >= 2 && Q <= 4);
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const T* a1 = a + cols;
  const T* a2 = a + (Q > 2 ? 2 : 1) * cols;
  const T* a3 = a + (Q > 3 ? 3 : 1) * cols;
  size_t r = 0;
  for (; r < rows; r += 2) {
    const bool pair = r + 1 < rows;  // the last row alone: its partner reads it again, unused
    const T* k0 = x + r * cols;
    const T* k1 = pair ? k0 + cols : k0;
    auto s00 = hn::Zero(d), s10 = hn::Zero(d), s20 = hn::Zero(d), s30 = hn::Zero(d);
    auto s01 = hn::Zero(d), s11 = hn::Zero(d), s21 = hn::Zero(d), s31 = hn::Zero(d);
    for (size_t c = 0; c < cols; c += N) {
      const size_t n = std::min(N, cols - c);
      const auto v0 = n == N ? hn::LoadU(d, k0 + c) : LoadTail(d, k0 + c, n);
      const auto v1 = n == N ? hn::LoadU(d, k1 + c) : LoadTail(d, k1 + c, n);
      const auto q0 = n == N ? hn::LoadU(d, a + c) : LoadTail(d, a + c, n);
      const auto q1 = n == N ? hn::LoadU(d, a1 + c) : LoadTail(d, a1 + c, n);
      s00 = hn::MulAdd(v0, q0, s00), s01 = hn::MulAdd(v1, q0, s01);
      s10 = hn::MulAdd(v0, q1, s10), s11 = hn::MulAdd(v1, q1, s11);
      if constexpr (Q > 2) {
        const auto q2 = n == N ? hn::LoadU(d, a2 + c) : LoadTail(d, a2 + c, n);
        s20 = hn::MulAdd(v0, q2, s20), s21 = hn::MulAdd(v1, q2, s21);
      }
      if constexpr (Q > 3) {
        const auto q3 = n == N ? hn::LoadU(d, a3 + c) : LoadTail(d, a3 + c, n);
        s30 = hn::MulAdd(v0, q3, s30), s31 = hn::MulAdd(v1, q3, s31);
      }
    }
    out[r] = hn::GetLane(hn::SumOfLanes(d, s00)), out[rows + r] = hn::GetLane(hn::SumOfLanes(d, s10));
    if constexpr (Q > 2) out[2 * rows + r] = hn::GetLane(hn::SumOfLanes(d, s20));
    if constexpr (Q > 3) out[3 * rows + r] = hn::GetLane(hn::SumOfLanes(d, s30));
    if (pair) {
      out[r + 1] = hn::GetLane(hn::SumOfLanes(d, s01)), out[rows + r + 1] = hn::GetLane(hn::SumOfLanes(d, s11));
      if constexpr (Q > 2) out[2 * rows + r + 1] = hn::GetLane(hn::SumOfLanes(d, s21));
      if constexpr (Q > 3) out[3 * rows + r + 1] = hn::GetLane(hn::SumOfLanes(d, s31));
    }
  }
}

// Two vectors to p[0, n0) and p[N, N + n1) (n0, n1 <= N lanes; n1 may be 0).
template <class D>
HWY_INLINE void StorePair(D d, hn::Vec<D> v0, hn::Vec<D> v1, size_t n0, size_t n1, hn::TFromD<D>* p) {
  const size_t N = hn::Lanes(d);
  if (n0 == N) hn::StoreU(v0, d, p);
  else StoreTail(d, v0, p, n0);
  if (n1 == N) hn::StoreU(v1, d, p + N);
  else if (n1 > 0) StoreTail(d, v1, p + N, n1);
}

// x[q][c] = Σ_r a[q][r]·S[r][c] for q < Q (a [Q × rows], x [Q × cols]): S read once for the Q
// weightings, two vectors of columns at a time (2Q independent sums).
template <int Q, class T>
void StateDotsGroup(const T* S, size_t rows, size_t cols, const T* a, T* x) {
  static_assert(Q >= 1 && Q <= 4);
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  const T* a1 = a + (Q > 1 ? rows : 0);
  const T* a2 = a + (Q > 2 ? 2 * rows : 0);
  const T* a3 = a + (Q > 3 ? 3 * rows : 0);
  for (size_t c = 0; c < cols; c += 2 * N) {
    const size_t n0 = std::min(N, cols - c), n1 = cols - c > N ? std::min(N, cols - c - N) : 0;
    auto x00 = hn::Zero(d), x10 = hn::Zero(d), x20 = hn::Zero(d), x30 = hn::Zero(d);
    auto x01 = hn::Zero(d), x11 = hn::Zero(d), x21 = hn::Zero(d), x31 = hn::Zero(d);
    for (size_t r = 0; r < rows; ++r) {
      const T* s = S + r * cols + c;
      const auto s0 = n0 == N ? hn::LoadU(d, s) : LoadTail(d, s, n0);
      const auto s1 = n1 == N ? hn::LoadU(d, s + N) : n1 > 0 ? LoadTail(d, s + N, n1) : hn::Zero(d);
      const auto w0 = hn::Set(d, a[r]);
      x00 = hn::MulAdd(w0, s0, x00), x01 = hn::MulAdd(w0, s1, x01);
      if constexpr (Q > 1) {
        const auto w1 = hn::Set(d, a1[r]);
        x10 = hn::MulAdd(w1, s0, x10), x11 = hn::MulAdd(w1, s1, x11);
      }
      if constexpr (Q > 2) {
        const auto w2 = hn::Set(d, a2[r]);
        x20 = hn::MulAdd(w2, s0, x20), x21 = hn::MulAdd(w2, s1, x21);
      }
      if constexpr (Q > 3) {
        const auto w3 = hn::Set(d, a3[r]);
        x30 = hn::MulAdd(w3, s0, x30), x31 = hn::MulAdd(w3, s1, x31);
      }
    }
    StorePair(d, x00, x01, n0, n1, x + c);
    if constexpr (Q > 1) StorePair(d, x10, x11, n0, n1, x + cols + c);
    if constexpr (Q > 2) StorePair(d, x20, x21, n0, n1, x + 2 * cols + c);
    if constexpr (Q > 3) StorePair(d, x30, x31, n0, n1, x + 3 * cols + c);
  }
}

// count queries run through Kernel<Q>::Run(m, rows, cols, a_q, out_q) in groups of up to four:
// query q's operand at a + q·a_stride, its result at out + q·out_stride.
template <template <int> class Kernel, class T>
void InQueryGroups(const T* m, size_t rows, size_t cols, const T* a, size_t a_stride, size_t count, T* out,
                   size_t out_stride) {
  for (size_t q = 0; q < count;) {
    const size_t group = std::min<size_t>(4, count - q);
    const T* aq = a + q * a_stride;
    T* oq = out + q * out_stride;
    if (group == 1) Kernel<1>::Run(m, rows, cols, aq, oq);
    else if (group == 2) Kernel<2>::Run(m, rows, cols, aq, oq);
    else if (group == 3) Kernel<3>::Run(m, rows, cols, aq, oq);
    else Kernel<4>::Run(m, rows, cols, aq, oq);
    q += group;
  }
}

template <int Q>
struct RowDotsKernel {
  template <class T>
  static void Run(const T* x, size_t rows, size_t cols, const T* a, T* out) {
    if constexpr (Q == 1) RowDots(x, rows, cols, a, out);
    else RowDotsGroup<Q>(x, rows, cols, a, out);
  }
};

template <int Q>
struct StateDotsKernel {
  template <class T>
  static void Run(const T* S, size_t rows, size_t cols, const T* a, T* x) {
    StateDotsGroup<Q>(S, rows, cols, a, x);
  }
};

template <class T>
void RowDotsMany(const T* x, size_t rows, size_t cols, const T* a, size_t count, T* out) {
  InQueryGroups<RowDotsKernel>(x, rows, cols, a, cols, count, out, rows);
}

template <class T>
void StateDotsMany(const T* S, size_t rows, size_t cols, const T* a, size_t count, T* x) {
  InQueryGroups<StateDotsKernel>(S, rows, cols, a, rows, count, x, cols);
}

// out[r][c] = f[r]·S[r][c] + k[r]·u[c] (out may be S); whether every value written is finite.
template <class T>
bool DecayRankOne(const T* S, size_t rows, size_t cols, const T* f, const T* k, const T* u, T* out) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  auto finite = hn::IsFinite(hn::Zero(d));
  for (size_t r = 0; r < rows; ++r) {
    const T* s = S + r * cols;
    T* o = out + r * cols;
    const auto fr = hn::Set(d, f[r]), kr = hn::Set(d, k[r]);
    size_t c = 0;
    for (; c + N <= cols; c += N) {
      const auto v = hn::MulAdd(kr, hn::LoadU(d, u + c), hn::Mul(fr, hn::LoadU(d, s + c)));
      finite = hn::And(finite, hn::IsFinite(v));
      hn::StoreU(v, d, o + c);
    }
    if (c < cols) {
      const size_t n = cols - c;
      // the lanes past the tail load 0 and stay finite
      const auto v = hn::MulAdd(kr, LoadTail(d, u + c, n), hn::Mul(fr, LoadTail(d, s + c, n)));
      finite = hn::And(finite, hn::IsFinite(v));
      StoreTail(d, v, o + c, n);
    }
  }
  return hn::AllTrue(d, finite);
}

void StateDotsF32(const float* S, size_t r, size_t c, const float* a, const float* b, float* x, float* y) {
  StateDots(S, r, c, a, b, x, y);
}
void StateDotsF64(const double* S, size_t r, size_t c, const double* a, const double* b, double* x, double* y) {
  StateDots(S, r, c, a, b, x, y);
}
void RowDotsF32(const float* x, size_t r, size_t c, const float* a, size_t n, float* o) {
  RowDotsMany(x, r, c, a, n, o);
}
void RowDotsF64(const double* x, size_t r, size_t c, const double* a, size_t n, double* o) {
  RowDotsMany(x, r, c, a, n, o);
}
void StateDotsManyF32(const float* S, size_t r, size_t c, const float* a, size_t n, float* x) {
  StateDotsMany(S, r, c, a, n, x);
}
void StateDotsManyF64(const double* S, size_t r, size_t c, const double* a, size_t n, double* x) {
  StateDotsMany(S, r, c, a, n, x);
}
bool DecayRankOneF32(const float* S, size_t r, size_t c, const float* f, const float* k, const float* u, float* o) {
  return DecayRankOne(S, r, c, f, k, u, o);
}
bool DecayRankOneF64(const double* S, size_t r, size_t c, const double* f, const double* k, const double* u,
                     double* o) {
  return DecayRankOne(S, r, c, f, k, u, o);
}
void DecayPairsF32(const float* a, size_t r, size_t m, float* e) { DecayPairs(a, r, m, e); }
void DecayPairsF64(const double* a, size_t r, size_t m, double* e) { DecayPairs(a, r, m, e); }
void DecayedDotsF32(const float* q, const float* k, const float* e, size_t r, size_t m, float* o, size_t ld) {
  DecayedDots(q, k, e, r, m, o, ld);
}
void DecayedDotsF64(const double* q, const double* k, const double* e, size_t r, size_t m, double* o, size_t ld) {
  DecayedDots(q, k, e, r, m, o, ld);
}
void DecayedWeighF32(const float* w, size_t ldw, const float* x, const float* e, size_t r, size_t m, float* y,
                     bool later) {
  DecayedWeigh(w, ldw, x, e, r, m, y, later);
}
void DecayedWeighF64(const double* w, size_t ldw, const double* x, const double* e, size_t r, size_t m, double* y,
                     bool later) {
  DecayedWeigh(w, ldw, x, e, r, m, y, later);
}
void MultiplyF32(const float* a, const float* b, size_t bs, size_t r, size_t c, float* o, size_t ld, bool acc) {
  Multiply(a, b, bs, r, c, o, ld, acc);
}
void MultiplyF64(const double* a, const double* b, size_t bs, size_t r, size_t c, double* o, size_t ld, bool acc) {
  Multiply(a, b, bs, r, c, o, ld, acc);
}

// b[j][c] = Σ_{t <= j} max(g[t][c], floor) in float64 (NaN stays NaN), rows of `width` values;
// and, where `floored` is not null, floored[j][c] = max(g[j][c], floor) in T.
template <class T>
void FlooredCumsum(const T* g, size_t rows, size_t width, double floor, double* b, T* floored) {
  const hn::ScalableTag<double> d;
  const hn::Rebind<T, decltype(d)> dt;
  const size_t N = hn::Lanes(d);
  const auto lo = hn::Set(d, floor);
  for (size_t j = 0; j < rows; ++j) {
    const T* gj = g + j * width;
    double* bj = b + j * width;
    size_t c = 0;
    for (; c < width; c += N) {
      const size_t count = std::min(N, width - c);
      const auto raw = count == N ? hn::LoadU(dt, gj + c) : LoadTail(dt, gj + c, count);
      // IfThenElse on x < floor keeps NaN (Max might not)
      hn::Vec<decltype(d)> x;
      if constexpr (std::is_same_v<T, double>)
        x = raw;
      else
        x = hn::PromoteTo(d, raw);
      x = hn::IfThenElse(hn::Lt(x, lo), lo, x);
      if (floored) {
        hn::Vec<decltype(dt)> narrow;
        if constexpr (std::is_same_v<T, double>)
          narrow = x;
        else
          narrow = hn::DemoteTo(dt, x);
        if (count == N)
          hn::StoreU(narrow, dt, floored + j * width + c);
        else
          StoreTail(dt, narrow, floored + j * width + c, count);
      }
      if (j > 0) x = hn::Add(x, count == N ? hn::LoadU(d, bj - width + c) : LoadTail(d, bj - width + c, count));
      if (count == N)
        hn::StoreU(x, d, bj + c);
      else
        StoreTail(d, x, bj + c, count);
    }
  }
}
void FlooredCumsumF32(const float* g, size_t r, size_t w, double f, double* b, float* o) {
  FlooredCumsum(g, r, w, f, b, o);
}
void FlooredCumsumF64(const double* g, size_t r, size_t w, double f, double* b, double* o) {
  FlooredCumsum(g, r, w, f, b, o);
}

// HWY_EXPORT needs one non-template name per function and type.
void ColumnMaxF32(const float* x, size_t r, size_t c, size_t ld, float* m) { ColumnMax(x, r, c, ld, m); }
void ColumnMaxF64(const double* x, size_t r, size_t c, size_t ld, double* m) { ColumnMax(x, r, c, ld, m); }
void ExpMinusColumnsF32(float* x, size_t r, size_t c, size_t ld, const float* s) { ExpMinusColumns(x, r, c, ld, s); }
void ExpMinusColumnsF64(double* x, size_t r, size_t c, size_t ld, const double* s) { ExpMinusColumns(x, r, c, ld, s); }
float ExpRowOffsetF32(float* x, size_t c, const float* o) { return ExpRowOffset(x, c, o); }
double ExpRowOffsetF64(double* x, size_t c, const double* o) { return ExpRowOffset(x, c, o); }
float FiniteMaxAbsF32(const float* x, size_t n) { return FiniteMaxAbs(x, n); }
double FiniteMaxAbsF64(const double* x, size_t n) { return FiniteMaxAbs(x, n); }
bool AllFiniteF32(const float* x, size_t n) { return AllFinite(x, n); }
bool AllFiniteF64(const double* x, size_t n) { return AllFinite(x, n); }
void SelectPositiveF32(const float* x, const float* a, const float* b, float* out, size_t n) {
  SelectPositive(x, a, b, out, n);
}
void SelectPositiveF64(const double* x, const double* a, const double* b, double* out, size_t n) {
  SelectPositive(x, a, b, out, n);
}
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
bool SoftmaxColumnsF32(const float* src, size_t ld, float* dst, size_t rows, size_t cols, float scale,
                       float* inv, float* work) {
  return SoftmaxColumns(src, ld, dst, rows, cols, scale, inv, work);
}
bool SoftmaxColumnsF64(const double* src, size_t ld, double* dst, size_t rows, size_t cols, double scale,
                       double* inv, double* work) {
  return SoftmaxColumns(src, ld, dst, rows, cols, scale, inv, work);
}
void SoftmaxColumnsBackwardF32(const float* e, const float* inv, float* g, size_t rows, size_t cols,
                               float scale, float* work) {
  SoftmaxColumnsBackward(e, inv, g, rows, cols, scale, work);
}
void SoftmaxColumnsBackwardF64(const double* e, const double* inv, double* g, size_t rows, size_t cols,
                               double scale, double* work) {
  SoftmaxColumnsBackward(e, inv, g, rows, cols, scale, work);
}
void ScaleF32(float* x, size_t n, float a) { Scale(x, n, a); }
void ScaleF64(double* x, size_t n, double a) { Scale(x, n, a); }
void SoftmaxGradF32(float* ds, const float* p, const float* dp, size_t n, float delta) {
  SoftmaxGrad(ds, p, dp, n, delta);
}
void SoftmaxGradF64(double* ds, const double* p, const double* dp, size_t n, double delta) {
  SoftmaxGrad(ds, p, dp, n, delta);
}
float SumF32(const float* x, size_t n) { return Sum(x, n); }
double SumF64(const double* x, size_t n) { return Sum(x, n); }
float DotF32(const float* a, const float* b, size_t n) { return Dot(a, b, n); }
double DotF64(const double* a, const double* b, size_t n) { return Dot(a, b, n); }
// bfloat16: the upper half of a float32. Widening shifts the bits up; narrowing rounds to
// nearest even by integer addition (Highway 1.0.3's DemoteTo to bfloat16 truncates) and keeps
// NaN quiet. The tails go through the one-value forms of low_precision.h.
void WidenBF16(const uint16_t* src, float* dst, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du32;
  const hn::Rebind<uint16_t, decltype(df)> du16;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  for (; i + N <= n; i += N)
    hn::StoreU(hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, src + i)))), df, dst + i);
  for (; i < n; ++i) dst[i] = to_float(bfloat16{src[i]});
}

void WidenRowsBF16(const uint16_t* src, size_t rows, size_t cols, float* dst, size_t ld_dst) {
  for (size_t r = 0; r < rows; ++r) WidenBF16(src + r * cols, dst + r * ld_dst, cols);
}

// The bfloat16 bits of v (float32 lanes) rounded to nearest even, NaN kept quiet, as 16-bit lanes.
template <class DF>
HWY_INLINE auto RoundToBF16Bits(DF df, hn::Vec<DF> v) {
  const hn::RebindToUnsigned<DF> du32;
  const hn::RebindToSigned<DF> di32;
  const hn::Rebind<uint16_t, DF> du16;
  const auto u = hn::BitCast(du32, v);
  const auto rounded = hn::Add(hn::Add(u, hn::Set(du32, 0x7FFFu)), hn::And(hn::ShiftRight<16>(u), hn::Set(du32, 1u)));
  const auto bits = hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(v)), hn::Or(u, hn::Set(du32, 0x400000u)), rounded);
  return hn::DemoteTo(du16, hn::BitCast(di32, hn::ShiftRight<16>(bits)));
}

void NarrowBF16(const float* src, uint16_t* dst, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> du16;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(RoundToBF16Bits(df, hn::LoadU(df, src + i)), du16, dst + i);
  for (; i < n; ++i) dst[i] = to_bfloat16(src[i]).bits;
}

// float32 values rounded to bfloat16 as NarrowBF16 rounds them (times a factor for kScaled),
// into y, with the largest magnitude written kept in top (vector lanes) and top_tail: below the
// sign bit a bfloat16's bits order its magnitudes, so every value written is finite when the
// largest is below 0x7F80 (inf; AllFiniteBF16Bits).
template <bool kScaled, class DF, class VU>
HWY_INLINE void RoundCheckedBF16(DF df, const float* x, size_t n, float factor, uint16_t* y, VU& top,
                                 uint16_t& top_tail) {
  const hn::Rebind<uint16_t, DF> du16;
  const size_t N = hn::Lanes(df);
  const auto f = hn::Set(df, factor);
  size_t c = 0;
  for (; c + N <= n; c += N) {
    const auto v = hn::LoadU(df, x + c);
    const auto bits = RoundToBF16Bits(df, kScaled ? hn::Mul(v, f) : v);
    hn::StoreU(bits, du16, y + c);
    top = hn::Max(top, hn::And(bits, hn::Set(du16, 0x7FFF)));
  }
  for (; c < n; ++c) {
    y[c] = to_bfloat16(kScaled ? x[c] * factor : x[c]).bits;
    top_tail = std::max<uint16_t>(top_tail, static_cast<uint16_t>(y[c] & 0x7FFFu));
  }
}
template <class DU, class VU>
HWY_INLINE bool AllFiniteBF16Bits(DU du16, VU top, uint16_t top_tail) {
  return std::max<uint16_t>(top_tail, hn::GetLane(hn::MaxOfLanes(du16, top))) < 0x7F80u;
}

bool NarrowFiniteBF16(const float* src, uint16_t* dst, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> du16;
  auto top = hn::Zero(du16);
  uint16_t top_tail = 0;
  RoundCheckedBF16<false>(df, src, n, 1.0f, dst, top, top_tail);
  return AllFiniteBF16Bits(du16, top, top_tail);
}

template <class T>
bool ScaleRows(const T* src, size_t ld_src, size_t rows, size_t cols, const T* factor, T* dst, size_t ld_dst) {
  const hn::ScalableTag<T> d;
  const size_t N = hn::Lanes(d);
  // x − x is 0 for a finite x and NaN for ±inf or NaN: one sum of them per row tells.
  auto finite = hn::Zero(d);
  for (size_t r = 0; r < rows; ++r) {
    const T* x = src + r * ld_src;
    T* y = dst + r * ld_dst;
    const auto f = hn::Set(d, factor[r]);
    size_t c = 0;
    for (; c + N <= cols; c += N) {
      const auto v = hn::Mul(hn::LoadU(d, x + c), f);
      hn::StoreU(v, d, y + c);
      finite = hn::Add(finite, hn::Sub(v, v));
    }
    if (c < cols) {
      const auto v = hn::Mul(LoadTail(d, x + c, cols - c), f);
      StoreTail(d, v, y + c, cols - c);
      finite = hn::Add(finite, hn::Sub(v, v));  // the lanes past cols are 0·f: 0 or NaN only if f is not finite
    }
  }
  return hn::AllTrue(d, hn::Eq(finite, hn::Zero(d)));
}
bool ScaleRowsF32(const float* src, size_t ld_src, size_t rows, size_t cols, const float* factor, float* dst,
                  size_t ld_dst) {
  return ScaleRows(src, ld_src, rows, cols, factor, dst, ld_dst);
}
bool ScaleRowsF64(const double* src, size_t ld_src, size_t rows, size_t cols, const double* factor, double* dst,
                  size_t ld_dst) {
  return ScaleRows(src, ld_src, rows, cols, factor, dst, ld_dst);
}
bool ScaleRowsBF16(const float* src, size_t ld_src, size_t rows, size_t cols, const float* factor, uint16_t* dst,
                   size_t ld_dst) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> du16;
  auto top = hn::Zero(du16);
  uint16_t top_tail = 0;
  for (size_t r = 0; r < rows; ++r)
    RoundCheckedBF16<true>(df, src + r * ld_src, cols, factor[r], dst + r * ld_dst, top, top_tail);
  return AllFiniteBF16Bits(du16, top, top_tail);
}

// The store of probabilities: float32 as computed, or rounded to bfloat16.
template <class DF>
HWY_INLINE void StoreProbabilities(DF df, hn::Vec<DF> e, float* p) {
  hn::StoreU(e, df, p);
}
template <class DF>
HWY_INLINE void StoreProbabilities(DF df, hn::Vec<DF> e, uint16_t* p) {
  hn::StoreU(RoundToBF16Bits(df, e), hn::Rebind<uint16_t, DF>(), p);
}

// p[i] = exp(scale·s[i] − shift) for scale·s[i] ≤ shift, stored as P (float, or bfloat16 bits
// rounded to nearest even); returns Σ exp(...) before rounding. p may be s (float). The product
// is rounded before the subtraction (no FMA), so that the argument is ≤ 0 whenever
// shift ≥ scale·max(s) was computed the same way. The tail goes through a masked vector, so that
// every value is computed and rounded by the same code.
template <bool kScaled, class P>
float ExpScaledShifted(const float* s, size_t n, float scale, float shift, P* p) {
  const hn::ScalableTag<float> df;
  const size_t N = hn::Lanes(df);
  const auto vscale = hn::Set(df, scale), vshift = hn::Set(df, shift);
  auto argument = [&](auto v) { return hn::Sub(kScaled ? hn::Mul(v, vscale) : v, vshift); };
  auto sum = hn::Zero(df), sum1 = hn::Zero(df);
  size_t i = 0;
  // Two vectors per iteration: two independent exp chains for the scheduler to interleave.
  for (; i + 2 * N <= n; i += 2 * N) {
    const auto e0 = ExpNonPositive(df, argument(hn::LoadU(df, s + i)));
    const auto e1 = ExpNonPositive(df, argument(hn::LoadU(df, s + i + N)));
    StoreProbabilities(df, e0, p + i);
    StoreProbabilities(df, e1, p + i + N);
    sum = hn::Add(sum, e0);
    sum1 = hn::Add(sum1, e1);
  }
  sum = hn::Add(sum, sum1);
  for (; i + N <= n; i += N) {
    const auto e = ExpNonPositive(df, argument(hn::LoadU(df, s + i)));
    StoreProbabilities(df, e, p + i);
    sum = hn::Add(sum, e);
  }
  if (i < n) {
    HWY_ALIGN float tail[hn::MaxLanes(df)] = {};
    HWY_ALIGN P out[hn::MaxLanes(df)];
    for (size_t j = i; j < n; ++j) tail[j - i] = s[j];
    const auto mask = hn::FirstN(df, n - i);
    const auto e = hn::IfThenElseZero(mask, ExpNonPositive(df, argument(hn::Load(df, tail))));
    StoreProbabilities(df, e, out);
    for (size_t j = i; j < n; ++j) p[j] = out[j - i];
    sum = hn::Add(sum, e);
  }
  return hn::GetLane(hn::SumOfLanes(df, sum));
}

// One online-softmax step of the attention tiles for a block of rows (see simd.h).
template <class P>
int64_t OnlineSoftmaxStep(const float* s, size_t ld_s, size_t rows, const int64_t* count, size_t width, float scale,
                          float* m, float* l, float* o, size_t ld_o, size_t o_cols, P* p, size_t ld_p) {
  for (size_t r = 0; r < rows; ++r) {
    const float* srow = s + r * ld_s;
    P* prow = p + r * ld_p;
    const size_t c = static_cast<size_t>(count[r]);
    std::fill(prow + c, prow + width, P{0});  // masked and padded keys: probability 0
    if (c == 0) continue;
    const float mx = MaxValue(srow, c) * scale;
    if (!std::isfinite(mx)) return static_cast<int64_t>(r);
    const float m_new = std::max(m[r], mx);
    // scale = 1 (the float32 forward scales q instead) skips a multiply per score.
    const float sum = scale == 1.0f ? ExpScaledShifted<false>(srow, c, scale, m_new, prow)
                                    : ExpScaledShifted<true>(srow, c, scale, m_new, prow);
    if (m_new != m[r]) {
      const float corr = std::exp(m[r] - m_new);  // 0 on the row's first visible block
      l[r] *= corr;
      Scale(o + r * ld_o, o_cols, corr);
      m[r] = m_new;
    }
    l[r] += sum;
  }
  return -1;
}

// The attention tiles' last step for a block of rows (see simd.h).
HWY_INLINE void StoreRow(const float* src, float* dst, size_t cols) { std::copy(src, src + cols, dst); }
HWY_INLINE void StoreRow(const float* src, uint16_t* dst, size_t cols) { NarrowBF16(src, dst, cols); }
template <class Out>
int64_t FinishRows(float* o, size_t ld_o, size_t rows, size_t cols, const float* l, Out* out, size_t ld_out) {
  for (size_t r = 0; r < rows; ++r) {
    float* orow = o + r * ld_o;
    Out* dst = out + r * ld_out;
    if (!(l[r] > 0)) {
      std::fill(dst, dst + cols, Out{0});
      continue;
    }
    Scale(orow, cols, 1.0f / l[r]);
    if (!AllFinite(orow, cols)) return static_cast<int64_t>(r);
    StoreRow(orow, dst, cols);
  }
  return -1;
}

int64_t OnlineSoftmaxBF16(const float* s, size_t ld_s, size_t rows, const int64_t* count, size_t width, float scale,
                          float* m, float* l, float* o, size_t ld_o, size_t o_cols, uint16_t* p, size_t ld_p) {
  return OnlineSoftmaxStep(s, ld_s, rows, count, width, scale, m, l, o, ld_o, o_cols, p, ld_p);
}
int64_t OnlineSoftmaxF32(const float* s, size_t ld_s, size_t rows, const int64_t* count, size_t width, float scale,
                         float* m, float* l, float* o, size_t ld_o, size_t o_cols, float* p, size_t ld_p) {
  return OnlineSoftmaxStep(s, ld_s, rows, count, width, scale, m, l, o, ld_o, o_cols, p, ld_p);
}
int64_t FinishRowsBF16(float* o, size_t ld_o, size_t rows, size_t cols, const float* l, uint16_t* out,
                       size_t ld_out) {
  return FinishRows(o, ld_o, rows, cols, l, out, ld_out);
}
int64_t FinishRowsF32(float* o, size_t ld_o, size_t rows, size_t cols, const float* l, float* out, size_t ld_out) {
  return FinishRows(o, ld_o, rows, cols, l, out, ld_out);
}

// finite_max_abs of bfloat16 values on their bits: below the sign bit, a bfloat16's bits order
// its magnitudes as integers (inf = 0x7F80, NaN above), so one unsigned maximum gives both
// the largest |x| and whether any value is not finite, reading 2 bytes per value.
float FiniteMaxAbsBF16(const uint16_t* x, size_t n) {
  const hn::ScalableTag<uint16_t> du;
  const size_t N = hn::Lanes(du);
  const auto magnitude = hn::Set(du, 0x7FFF);
  auto m = hn::Zero(du);
  size_t i = 0;
  for (; i + N <= n; i += N) m = hn::Max(m, hn::And(hn::LoadU(du, x + i), magnitude));
  uint16_t top = hn::GetLane(hn::MaxOfLanes(du, m));
  for (; i < n; ++i) top = std::max<uint16_t>(top, static_cast<uint16_t>(x[i] & 0x7FFFu));
  if (top >= 0x7F80u) return std::numeric_limits<float>::quiet_NaN();
  return to_float(bfloat16{top});
}

// float16 through Highway's PromoteTo / DemoteTo where they are F16C's vcvtph2ps / vcvtps2ph
// (round to nearest even, inf and NaN kept): AVX2 and AVX-512. Below AVX2, Highway 1.0.3's
// software forms truncate and widen inf/NaN to finite values, so those targets take the
// one-value forms.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
constexpr bool kHardwareF16 = true;
#else
constexpr bool kHardwareF16 = false;
#endif

void WidenF16(const uint16_t* src, float* dst, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> df16;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  if (kHardwareF16)
    for (; i + N <= n; i += N)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(df16, reinterpret_cast<const hwy::float16_t*>(src + i))), df, dst + i);
  for (; i < n; ++i) dst[i] = to_float(float16{src[i]});
}

void NarrowF16(const float* src, uint16_t* dst, size_t n) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> df16;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  if (kHardwareF16)
    for (; i + N <= n; i += N)
      hn::StoreU(hn::DemoteTo(df16, hn::LoadU(df, src + i)), df16, reinterpret_cast<hwy::float16_t*>(dst + i));
  for (; i < n; ++i) dst[i] = to_float16(src[i]).bits;
}

// The benchmarks' FMA peak: 12 independent accumulators (two FMA ports × a latency of 4–6
// cycles need at least 8–12 in flight), registers only.
float FmaLoop(size_t iterations, float seed) {
  const hn::ScalableTag<float> d;
  const auto m = hn::Set(d, 0.999999f), a = hn::Set(d, 1e-7f);
  // Distinct starting values: identical chains would be merged into one by the compiler.
  auto x0 = hn::Set(d, seed), x1 = hn::Set(d, seed + 1), x2 = hn::Set(d, seed + 2), x3 = hn::Set(d, seed + 3),
       x4 = hn::Set(d, seed + 4), x5 = hn::Set(d, seed + 5), x6 = hn::Set(d, seed + 6), x7 = hn::Set(d, seed + 7),
       x8 = hn::Set(d, seed + 8), x9 = hn::Set(d, seed + 9), x10 = hn::Set(d, seed + 10), x11 = hn::Set(d, seed + 11);
  for (size_t i = 0; i < iterations; ++i) {
    x0 = hn::MulAdd(x0, m, a), x1 = hn::MulAdd(x1, m, a), x2 = hn::MulAdd(x2, m, a), x3 = hn::MulAdd(x3, m, a);
    x4 = hn::MulAdd(x4, m, a), x5 = hn::MulAdd(x5, m, a), x6 = hn::MulAdd(x6, m, a), x7 = hn::MulAdd(x7, m, a);
    x8 = hn::MulAdd(x8, m, a), x9 = hn::MulAdd(x9, m, a), x10 = hn::MulAdd(x10, m, a), x11 = hn::MulAdd(x11, m, a);
  }
  const auto sum = hn::Add(hn::Add(hn::Add(x0, x1), hn::Add(x2, x3)),
                           hn::Add(hn::Add(hn::Add(x4, x5), hn::Add(x6, x7)), hn::Add(hn::Add(x8, x9), hn::Add(x10, x11))));
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

size_t FloatLanes() { return hn::Lanes(hn::ScalableTag<float>()); }

int64_t CurrentTarget() { return HWY_TARGET; }

}  // namespace HWY_NAMESPACE
}  // namespace simd
}  // namespace linattn
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "linattn/core/simd.h"

namespace linattn {
namespace simd {
HWY_EXPORT(ColumnMaxF32);
HWY_EXPORT(ColumnMaxF64);
HWY_EXPORT(ExpMinusColumnsF32);
HWY_EXPORT(ExpMinusColumnsF64);
HWY_EXPORT(ExpRowOffsetF32);
HWY_EXPORT(ExpRowOffsetF64);
HWY_EXPORT(FiniteMaxAbsF32);
HWY_EXPORT(FiniteMaxAbsF64);
HWY_EXPORT(MaxValueF32);
HWY_EXPORT(MaxValueF64);
HWY_EXPORT(ExpShiftedSumF32);
HWY_EXPORT(ExpShiftedSumF64);
HWY_EXPORT(SoftmaxRowsF32);
HWY_EXPORT(SoftmaxRowsF64);
HWY_EXPORT(SoftmaxColumnsF32);
HWY_EXPORT(SoftmaxColumnsF64);
HWY_EXPORT(SoftmaxColumnsBackwardF32);
HWY_EXPORT(SoftmaxColumnsBackwardF64);
HWY_EXPORT(ScaleF32);
HWY_EXPORT(ScaleF64);
HWY_EXPORT(SoftmaxGradF32);
HWY_EXPORT(SoftmaxGradF64);
HWY_EXPORT(SumF32);
HWY_EXPORT(SumF64);
HWY_EXPORT(DecayPairsF32);
HWY_EXPORT(DecayPairsF64);
HWY_EXPORT(DecayedDotsF32);
HWY_EXPORT(DecayedDotsF64);
HWY_EXPORT(DecayedWeighF32);
HWY_EXPORT(DecayedWeighF64);
HWY_EXPORT(MultiplyF32);
HWY_EXPORT(MultiplyF64);
HWY_EXPORT(StateDotsF32);
HWY_EXPORT(StateDotsF64);
HWY_EXPORT(RowDotsF32);
HWY_EXPORT(StateDotsManyF32);
HWY_EXPORT(StateDotsManyF64);
HWY_EXPORT(RowDotsF64);
HWY_EXPORT(DecayRankOneF32);
HWY_EXPORT(DecayRankOneF64);
HWY_EXPORT(FlooredCumsumF32);
HWY_EXPORT(FlooredCumsumF64);
HWY_EXPORT(DotF32);
HWY_EXPORT(DotF64);
HWY_EXPORT(CurrentTarget);
HWY_EXPORT(FmaLoop);
HWY_EXPORT(FloatLanes);
HWY_EXPORT(WidenBF16);
HWY_EXPORT(WidenRowsBF16);
HWY_EXPORT(ScaleRowsF32);
HWY_EXPORT(NarrowFiniteBF16);
HWY_EXPORT(ScaleRowsF64);
HWY_EXPORT(ScaleRowsBF16);
HWY_EXPORT(NarrowBF16);
HWY_EXPORT(OnlineSoftmaxBF16);
HWY_EXPORT(OnlineSoftmaxF32);
HWY_EXPORT(FinishRowsBF16);
HWY_EXPORT(FinishRowsF32);
HWY_EXPORT(FiniteMaxAbsBF16);
HWY_EXPORT(WidenF16);
HWY_EXPORT(NarrowF16);
HWY_EXPORT(MaxAbsF32);
HWY_EXPORT(MaxAbsF64);
HWY_EXPORT(SinCosF32);
HWY_EXPORT(SinCosF64);
HWY_EXPORT(AllFiniteF32);
HWY_EXPORT(AllFiniteF64);
HWY_EXPORT(SelectPositiveF32);
HWY_EXPORT(SelectPositiveF64);
HWY_EXPORT(EluPlusOneF32);
HWY_EXPORT(EluPlusOneF64);
HWY_EXPORT(ProductDifferenceF32);
HWY_EXPORT(ProductDifferenceF64);

void column_max(const float* x, size_t rows, size_t cols, size_t ld, float* m) {
  HWY_DYNAMIC_DISPATCH(ColumnMaxF32)(x, rows, cols, ld, m);
}
void column_max(const double* x, size_t rows, size_t cols, size_t ld, double* m) {
  HWY_DYNAMIC_DISPATCH(ColumnMaxF64)(x, rows, cols, ld, m);
}
void exp_minus_columns(float* x, size_t rows, size_t cols, size_t ld, const float* shift) {
  HWY_DYNAMIC_DISPATCH(ExpMinusColumnsF32)(x, rows, cols, ld, shift);
}
void exp_minus_columns(double* x, size_t rows, size_t cols, size_t ld, const double* shift) {
  HWY_DYNAMIC_DISPATCH(ExpMinusColumnsF64)(x, rows, cols, ld, shift);
}
float exp_row_offset(float* x, size_t cols, const float* offset) {
  return HWY_DYNAMIC_DISPATCH(ExpRowOffsetF32)(x, cols, offset);
}
double exp_row_offset(double* x, size_t cols, const double* offset) {
  return HWY_DYNAMIC_DISPATCH(ExpRowOffsetF64)(x, cols, offset);
}
float finite_max_abs(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(FiniteMaxAbsF32)(x, n); }
double finite_max_abs(const double* x, size_t n) { return HWY_DYNAMIC_DISPATCH(FiniteMaxAbsF64)(x, n); }
bool all_finite(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(AllFiniteF32)(x, n); }
bool all_finite(const double* x, size_t n) { return HWY_DYNAMIC_DISPATCH(AllFiniteF64)(x, n); }
void select_positive(const float* x, const float* a, const float* b, float* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(SelectPositiveF32)(x, a, b, out, n);
}
void select_positive(const double* x, const double* a, const double* b, double* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(SelectPositiveF64)(x, a, b, out, n);
}
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
bool softmax_columns(const float* src, size_t ld_src, float* dst, size_t rows, size_t cols, float scale,
                     float* inv_sums, float* work) {
  return HWY_DYNAMIC_DISPATCH(SoftmaxColumnsF32)(src, ld_src, dst, rows, cols, scale, inv_sums, work);
}
bool softmax_columns(const double* src, size_t ld_src, double* dst, size_t rows, size_t cols,
                     double scale, double* inv_sums, double* work) {
  return HWY_DYNAMIC_DISPATCH(SoftmaxColumnsF64)(src, ld_src, dst, rows, cols, scale, inv_sums, work);
}
void softmax_columns_backward(const float* e, const float* inv_sums, float* g, size_t rows, size_t cols,
                              float scale, float* work) {
  HWY_DYNAMIC_DISPATCH(SoftmaxColumnsBackwardF32)(e, inv_sums, g, rows, cols, scale, work);
}
void softmax_columns_backward(const double* e, const double* inv_sums, double* g, size_t rows,
                              size_t cols, double scale, double* work) {
  HWY_DYNAMIC_DISPATCH(SoftmaxColumnsBackwardF64)(e, inv_sums, g, rows, cols, scale, work);
}
void softmax_grad(float* ds, const float* p, const float* dp, size_t n, float delta) {
  HWY_DYNAMIC_DISPATCH(SoftmaxGradF32)(ds, p, dp, n, delta);
}
void softmax_grad(double* ds, const double* p, const double* dp, size_t n, double delta) {
  HWY_DYNAMIC_DISPATCH(SoftmaxGradF64)(ds, p, dp, n, delta);
}
float sum(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(SumF32)(x, n); }
double sum(const double* x, size_t n) { return HWY_DYNAMIC_DISPATCH(SumF64)(x, n); }
void decay_pairs(const float* a, size_t rows, size_t dim, float* e) { HWY_DYNAMIC_DISPATCH(DecayPairsF32)(a, rows, dim, e); }
void decay_pairs(const double* a, size_t rows, size_t dim, double* e) {
  HWY_DYNAMIC_DISPATCH(DecayPairsF64)(a, rows, dim, e);
}
void decayed_dots(const float* q, const float* k, const float* e, size_t rows, size_t dim, float* out, size_t ld) {
  HWY_DYNAMIC_DISPATCH(DecayedDotsF32)(q, k, e, rows, dim, out, ld);
}
void decayed_dots(const double* q, const double* k, const double* e, size_t rows, size_t dim, double* out,
                  size_t ld) {
  HWY_DYNAMIC_DISPATCH(DecayedDotsF64)(q, k, e, rows, dim, out, ld);
}
void decayed_weigh(const float* w, size_t ldw, const float* x, const float* e, size_t rows, size_t dim, float* y,
                   bool later) {
  HWY_DYNAMIC_DISPATCH(DecayedWeighF32)(w, ldw, x, e, rows, dim, y, later);
}
void decayed_weigh(const double* w, size_t ldw, const double* x, const double* e, size_t rows, size_t dim,
                   double* y, bool later) {
  HWY_DYNAMIC_DISPATCH(DecayedWeighF64)(w, ldw, x, e, rows, dim, y, later);
}
void multiply(const float* a, const float* b, size_t rows, size_t cols, float* out, size_t ld_out, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(MultiplyF32)(a, b, cols, rows, cols, out, ld_out, accumulate);
}
void multiply(const double* a, const double* b, size_t rows, size_t cols, double* out, size_t ld_out,
              bool accumulate) {
  HWY_DYNAMIC_DISPATCH(MultiplyF64)(a, b, cols, rows, cols, out, ld_out, accumulate);
}
void scale_columns(const float* x, size_t rows, size_t cols, const float* f, float* y, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(MultiplyF32)(x, f, 0, rows, cols, y, cols, accumulate);
}
void scale_columns(const double* x, size_t rows, size_t cols, const double* f, double* y, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(MultiplyF64)(x, f, 0, rows, cols, y, cols, accumulate);
}
void state_dots(const float* S, size_t rows, size_t cols, const float* a, const float* b, float* x, float* y) {
  HWY_DYNAMIC_DISPATCH(StateDotsF32)(S, rows, cols, a, b, x, y);
}
void state_dots(const double* S, size_t rows, size_t cols, const double* a, const double* b, double* x, double* y) {
  HWY_DYNAMIC_DISPATCH(StateDotsF64)(S, rows, cols, a, b, x, y);
}
void row_dots(const float* x, size_t rows, size_t cols, const float* a, size_t count, float* out) {
  HWY_DYNAMIC_DISPATCH(RowDotsF32)(x, rows, cols, a, count, out);
}
void row_dots(const double* x, size_t rows, size_t cols, const double* a, size_t count, double* out) {
  HWY_DYNAMIC_DISPATCH(RowDotsF64)(x, rows, cols, a, count, out);
}
void state_dots(const float* S, size_t rows, size_t cols, const float* a, size_t count, float* x) {
  HWY_DYNAMIC_DISPATCH(StateDotsManyF32)(S, rows, cols, a, count, x);
}
void state_dots(const double* S, size_t rows, size_t cols, const double* a, size_t count, double* x) {
  HWY_DYNAMIC_DISPATCH(StateDotsManyF64)(S, rows, cols, a, count, x);
}
bool decay_rank_one(const float* S, size_t rows, size_t cols, const float* f, const float* k, const float* u,
                    float* out) {
  return HWY_DYNAMIC_DISPATCH(DecayRankOneF32)(S, rows, cols, f, k, u, out);
}
bool decay_rank_one(const double* S, size_t rows, size_t cols, const double* f, const double* k, const double* u,
                    double* out) {
  return HWY_DYNAMIC_DISPATCH(DecayRankOneF64)(S, rows, cols, f, k, u, out);
}
void floored_cumsum(const float* g, size_t rows, size_t width, double floor, double* b, float* floored) {
  HWY_DYNAMIC_DISPATCH(FlooredCumsumF32)(g, rows, width, floor, b, floored);
}
void floored_cumsum(const double* g, size_t rows, size_t width, double floor, double* b, double* floored) {
  HWY_DYNAMIC_DISPATCH(FlooredCumsumF64)(g, rows, width, floor, b, floored);
}
float dot(const float* a, const float* b, size_t n) { return HWY_DYNAMIC_DISPATCH(DotF32)(a, b, n); }
double dot(const double* a, const double* b, size_t n) {
  return HWY_DYNAMIC_DISPATCH(DotF64)(a, b, n);
}
void widen(const bfloat16* src, float* dst, size_t n) {
  HWY_DYNAMIC_DISPATCH(WidenBF16)(reinterpret_cast<const uint16_t*>(src), dst, n);
}
void narrow(const float* src, bfloat16* dst, size_t n) {
  HWY_DYNAMIC_DISPATCH(NarrowBF16)(src, reinterpret_cast<uint16_t*>(dst), n);
}
bool narrow_finite(const float* src, bfloat16* dst, size_t n) {
  return HWY_DYNAMIC_DISPATCH(NarrowFiniteBF16)(src, reinterpret_cast<uint16_t*>(dst), n);
}
bool scale_rows(const float* src, size_t ld_src, size_t rows, size_t cols, const float* factor, float* dst,
                size_t ld_dst) {
  return HWY_DYNAMIC_DISPATCH(ScaleRowsF32)(src, ld_src, rows, cols, factor, dst, ld_dst);
}
bool scale_rows(const double* src, size_t ld_src, size_t rows, size_t cols, const double* factor, double* dst,
                size_t ld_dst) {
  return HWY_DYNAMIC_DISPATCH(ScaleRowsF64)(src, ld_src, rows, cols, factor, dst, ld_dst);
}
bool scale_rows(const float* src, size_t ld_src, size_t rows, size_t cols, const float* factor, bfloat16* dst,
                size_t ld_dst) {
  return HWY_DYNAMIC_DISPATCH(ScaleRowsBF16)(src, ld_src, rows, cols, factor, reinterpret_cast<uint16_t*>(dst), ld_dst);
}
void widen_rows(const bfloat16* src, size_t rows, size_t cols, float* dst, size_t ld_dst) {
  HWY_DYNAMIC_DISPATCH(WidenRowsBF16)(reinterpret_cast<const uint16_t*>(src), rows, cols, dst, ld_dst);
}
int64_t online_softmax_step(const float* s, size_t ld_s, size_t rows, const int64_t* count, size_t width,
                            float scale, float* m, float* l, float* o, size_t ld_o, size_t o_cols, bfloat16* p,
                            size_t ld_p) {
  return HWY_DYNAMIC_DISPATCH(OnlineSoftmaxBF16)(s, ld_s, rows, count, width, scale, m, l, o, ld_o, o_cols,
                                                 reinterpret_cast<uint16_t*>(p), ld_p);
}
int64_t online_softmax_step(const float* s, size_t ld_s, size_t rows, const int64_t* count, size_t width,
                            float scale, float* m, float* l, float* o, size_t ld_o, size_t o_cols, float* p,
                            size_t ld_p) {
  return HWY_DYNAMIC_DISPATCH(OnlineSoftmaxF32)(s, ld_s, rows, count, width, scale, m, l, o, ld_o, o_cols, p, ld_p);
}
int64_t finish_rows(float* o, size_t ld_o, size_t rows, size_t cols, const float* l, bfloat16* out, size_t ld_out) {
  return HWY_DYNAMIC_DISPATCH(FinishRowsBF16)(o, ld_o, rows, cols, l, reinterpret_cast<uint16_t*>(out), ld_out);
}
int64_t finish_rows(float* o, size_t ld_o, size_t rows, size_t cols, const float* l, float* out, size_t ld_out) {
  return HWY_DYNAMIC_DISPATCH(FinishRowsF32)(o, ld_o, rows, cols, l, out, ld_out);
}
float finite_max_abs(const bfloat16* x, size_t n) {
  return HWY_DYNAMIC_DISPATCH(FiniteMaxAbsBF16)(reinterpret_cast<const uint16_t*>(x), n);
}
bool all_finite(const bfloat16* x, size_t n) { return !std::isnan(finite_max_abs(x, n)); }
void widen(const float16* src, float* dst, size_t n) {
  HWY_DYNAMIC_DISPATCH(WidenF16)(reinterpret_cast<const uint16_t*>(src), dst, n);
}
void narrow(const float* src, float16* dst, size_t n) {
  HWY_DYNAMIC_DISPATCH(NarrowF16)(src, reinterpret_cast<uint16_t*>(dst), n);
}
float fma_loop(size_t iterations, float seed) { return HWY_DYNAMIC_DISPATCH(FmaLoop)(iterations, seed); }
size_t fma_loop_flops_per_iteration() { return 12 * 2 * HWY_DYNAMIC_DISPATCH(FloatLanes)(); }
const char* target_name() { return hwy::TargetName(HWY_DYNAMIC_DISPATCH(CurrentTarget)()); }

}  // namespace simd
}  // namespace linattn
#endif  // HWY_ONCE
