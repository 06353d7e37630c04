// Core: BLAS wrapper, SIMD kernels against scalar loops, random numbers, memory.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <set>
#include <stdexcept>
#include <vector>

#include "linattn/core/blas.h"
#include "linattn/core/error.h"
#include "linattn/memory.h"
#include "linattn/core/random.h"
#include "linattn/core/simd.h"
#include "linattn/core/tile_matmul.h"
#include "linattn/linattn.h"
#include "linattn/core/parallel.h"
#include "test_util.h"

namespace linattn {
namespace {

using testing::gamma;
using testing::ScopedThreads;
using testing::unit_roundoff;

// matmul against a float64 triple loop, all transposes, odd sizes and leading dimensions.
// Bound: |δc| ≤ γ_{K+2}·(|α|·|A|·|B| + |β|·|C|) elementwise.
TEST(Blas, MatmulMatchesLoops) {
  const int64_t M = 13, N = 7, K = 29, pad = 3;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const int64_t lda = (!ta ? K : M) + pad, ldb = (!tb ? N : K) + pad, ldc = N + pad;
      std::vector<float> A((!ta ? M : K) * lda), B((!tb ? K : N) * ldb), C(M * ldc);
      fill_normal(A.data(), A.size(), 1);
      fill_normal(B.data(), B.size(), 2);
      fill_normal(C.data(), C.size(), 3);
      auto a = [&](int64_t i, int64_t k) { return double(!ta ? A[i * lda + k] : A[k * lda + i]); };
      auto b = [&](int64_t k, int64_t j) { return double(!tb ? B[k * ldb + j] : B[j * ldb + k]); };
      std::vector<double> want(M * N), bound(M * N);
      const double alpha = 0.75, beta = -0.5;
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double s = 0, abs_s = 0;
          for (int64_t k = 0; k < K; ++k) {
            s += a(i, k) * b(k, j);
            abs_s += std::abs(a(i, k) * b(k, j));
          }
          want[i * N + j] = alpha * s + beta * C[i * ldc + j];
          bound[i * N + j] = gamma<float>(K + 2) * (alpha * abs_s + std::abs(beta * C[i * ldc + j]));
        }
      const Mat<const float> am = !ta ? mat<const float>(A.data(), M, K, lda) : mat<const float>(A.data(), K, M, lda).t();
      const Mat<const float> bm = !tb ? mat<const float>(B.data(), K, N, ldb) : mat<const float>(B.data(), N, K, ldb).t();
      matmul<float>(mat(C.data(), M, N, ldc), am, bm, float(alpha), float(beta));
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j)
          EXPECT_NEAR(C[i * ldc + j], want[i * N + j], bound[i * N + j]) << i << "," << j;
    }
}

TEST(Blas, EmptyInnerDimensionScalesC) {
  std::vector<double> C{1, 2, 3, 4};
  matmul<double>(mat(C.data(), 2, 2), mat<const double>(nullptr, 2, 0), mat<const double>(nullptr, 0, 2), 1.0, 0.5);
  EXPECT_EQ(C, (std::vector<double>{0.5, 1, 1.5, 2}));
}

// Shapes that do not agree, and leading dimensions shorter than their rows, are caught before
// the BLAS reads anything.
TEST(Blas, MatmulChecksShapesAndLeadingDimensions) {
  std::vector<float> A(12), B(12), C(16);
  EXPECT_THROW(matmul<float>(mat(C.data(), 4, 4), mat<const float>(A.data(), 4, 3), mat<const float>(B.data(), 4, 3)),
               std::logic_error);  // inner 3 vs 4
  EXPECT_THROW(matmul<float>(mat(C.data(), 4, 4), mat<const float>(A.data(), 4, 3, 2), mat<const float>(B.data(), 3, 4)),
               std::logic_error);  // lda 2 < 3 columns
  EXPECT_THROW(matmul<float>(mat(C.data(), 4, 4).t(), mat<const float>(A.data(), 4, 3), mat<const float>(B.data(), 3, 4)),
               std::logic_error);  // a transposed result
  EXPECT_NO_THROW(matmul<float>(mat(C.data(), 4, 4), mat<const float>(A.data(), 3, 4).t(), mat<const float>(B.data(), 3, 4)));
}

// SIMD kernels against scalar loops, for lengths that exercise the full-vector, two-vector
// and masked-tail paths of every instruction set.
template <class T>
void check_simd_kernels() {
  const double u = unit_roundoff<T>();
  for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{8}, size_t{15}, size_t{16}, size_t{17},
                   size_t{33}, size_t{100}, size_t{257}}) {
    SCOPED_TRACE(n);
    std::vector<T> x(n), y(n);
    fill_normal(x.data(), int64_t(n), 7 + n, 4.0);
    fill_normal(y.data(), int64_t(n), 9 + n);
    double mx = -std::numeric_limits<double>::infinity();
    for (T v : x) mx = std::max<double>(mx, v);
    EXPECT_EQ(double(simd::max_value(x.data(), n)), mx);

    // exp within 1.3 ulp (ours for float, SimdExpIsWithin1Point3Ulp; Highway's documented 1 ulp
    // for double) after an exactly rounded subtraction: relative error ≤ 2.6u ≤ 3u per element,
    // and γ_n on the sum.
    const T shift = n ? T(mx) : T(0);
    std::vector<T> e = x;
    const T sum = simd::exp_shifted_sum(e.data(), n, shift);
    double want_sum = 0;
    for (size_t i = 0; i < n; ++i) {
      const double want = std::exp(double(T(x[i] - shift)));
      want_sum += want;
      EXPECT_NEAR(e[i], want, 3 * u * want) << i;
    }
    EXPECT_NEAR(sum, want_sum, (3 * u + gamma<T>(double(n))) * want_sum);

    double want_dot = 0, abs_dot = 0;
    for (size_t i = 0; i < n; ++i) {
      want_dot += double(x[i]) * y[i];
      abs_dot += std::abs(double(x[i]) * y[i]);
    }
    EXPECT_NEAR(simd::dot(x.data(), y.data(), n), want_dot, gamma<T>(double(n)) * abs_dot);

    // Any order of n − 1 additions: |error| <= γ_(n−1)·Σ|x| <= γ_n·Σ|x|.
    double want_total = 0, abs_total = 0;
    for (T v : x) want_total += v, abs_total += std::abs(double(v));
    EXPECT_NEAR(simd::sum(x.data(), n), want_total, gamma<T>(double(n)) * abs_total);

    std::vector<T> s = x, ds(n);
    simd::scale(s.data(), n, T(0.5));
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(s[i], x[i] * T(0.5));
    simd::softmax_grad(ds.data(), x.data(), y.data(), n, T(0.25));
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(ds[i], x[i] * (y[i] - T(0.25)));

    double want_abs = 0;
    for (T v : x) want_abs = std::max<double>(want_abs, std::abs(v));
    EXPECT_EQ(double(simd::max_abs(x.data(), n)), want_abs);

    std::vector<T> pd(n), pm(n), el(n), sn(n), cs(n);
    simd::product_difference(x.data(), y.data(), y.data(), x.data(), pd.data(), n);
    simd::product_difference(x.data(), y.data(), static_cast<const T*>(nullptr),
                             static_cast<const T*>(nullptr), pm.data(), n);
    for (size_t i = 0; i < n; ++i) {
      EXPECT_NEAR(pd[i], 0.0, 2 * u * std::abs(double(x[i]) * y[i])) << i;  // a·b − b·a, FMA or not
      EXPECT_EQ(pm[i], x[i] * y[i]);
    }
    // select_positive: exact, zeros (both signs) taking the x <= 0 branch, in place too.
    std::vector<T> sx = x, sa(n), sb(n), sel(n);
    if (n > 2) sx[1] = T(0), sx[2] = -T(0);
    for (size_t i = 0; i < n; ++i) sa[i] = y[i] + T(3), sb[i] = x[i] - T(2);
    simd::select_positive(sx.data(), sa.data(), sb.data(), sel.data(), n);
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(sel[i], sx[i] > 0 ? sa[i] : sa[i] * sb[i]) << i;
    simd::select_positive(sx.data(), sx.data(), static_cast<const T*>(nullptr), sel.data(), n);
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(sel[i], sx[i] > 0 ? sx[i] : T(0)) << i;
    simd::select_positive(sx.data(), sa.data(), sb.data(), sa.data(), n);
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(sa[i], sx[i] > 0 ? y[i] + T(3) : (y[i] + T(3)) * sb[i]) << i;
    // elu(x)+1: exact x+1 for x > 0, otherwise exp within 1.3 ulp (float: ExpNonPositive, the
    // softmax's exp, tested below) or 1 ulp (double: Highway's), an ulp being at most 2u·|exp|.
    simd::elu_plus_one(x.data(), el.data(), n);
    const double exp_ulps = std::is_same_v<T, float> ? 1.3 : 1.0;
    for (size_t i = 0; i < n; ++i) {
      const double want = x[i] > 0 ? double(T(x[i] + T(1))) : std::exp(double(x[i]));
      EXPECT_NEAR(el[i], want, exp_ulps * 2 * u * want) << i;
    }
    EXPECT_TRUE(simd::all_finite(x.data(), n));
    for (size_t bad = 0; bad < n; bad += 7) {
      for (T v : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                  -std::numeric_limits<T>::infinity()}) {
        std::vector<T> y2 = x;
        y2[bad] = v;
        EXPECT_FALSE(simd::all_finite(y2.data(), n)) << bad;
      }
    }
    // sin, cos within Highway's 3 ulp (absolute 4u on values of magnitude <= 1).
    simd::sin_cos(x.data(), n, sn.data(), cs.data());
    for (size_t i = 0; i < n; ++i) {
      EXPECT_NEAR(sn[i], std::sin(double(x[i])), 4 * u) << i;
      EXPECT_NEAR(cs[i], std::cos(double(x[i])), 4 * u) << i;
    }
  }
}

TEST(Simd, FloatKernelsMatchScalar) { check_simd_kernels<float>(); }
TEST(Simd, DoubleKernelsMatchScalar) { check_simd_kernels<double>(); }

// Softmax down the columns of a row-major block and its backward, against float64 loops, on
// column counts that exercise full vectors and scalar tails and row counts that cross the
// 256-row summation blocks. Bounds: e = exp(scale·x − max), the max exact, scale·x rounded or
// fused into the subtraction (the compiler may contract it to an FMA), the subtraction rounded,
// exp within 1 ulp: e is within (u(|scale·x| + |scale·x − max|) + 3u)·e; the blocked sums carry at most γ_{256 + rows/256 + 1}; 1/sum one
// more u. The backward's δ and the products: γ_{256 + rows/256 + 1} + 4u relative to Σ|P dP|.
template <class T>
void check_softmax_columns() {
  const double u = unit_roundoff<T>();
  for (size_t rows : {size_t{1}, size_t{5}, size_t{300}, size_t{1000}})
    for (size_t cols : {size_t{1}, size_t{7}, size_t{16}, size_t{37}, size_t{64}}) {
      SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
      const size_t ld = cols + 3;  // a source with a larger leading dimension
      std::vector<T> src(rows * ld), e(rows * cols), inv(cols), work(3 * cols), g(rows * cols);
      fill_normal(src.data(), int64_t(src.size()), 11 + rows + cols, 3.0);
      fill_normal(g.data(), int64_t(g.size()), 13 + rows + cols);
      const T scale = T(0.7);
      ASSERT_TRUE(simd::softmax_columns(src.data(), ld, e.data(), rows, cols, scale, inv.data(), work.data()));
      const double gsum = gamma<T>(256.0 + double(rows) / 256 + 1);
      // x[r,c] = scale·src rounded, minus the column max, and the exps in long double so the
      // reference's own rounding (to double, +u) is all it adds; rel_e: e's relative error bound.
      std::vector<long double> x(rows * cols);
      std::vector<double> rel_e(rows * cols), p(rows * cols), rel_p(rows * cols);
      for (size_t c = 0; c < cols; ++c) {
        long double mx = -INFINITY;
        for (size_t r = 0; r < rows; ++r) mx = std::max<long double>(mx, T(src[r * ld + c] * scale));
        long double sum = 0;
        double sum_err = 0;
        for (size_t r = 0; r < rows; ++r) {
          const size_t i = r * cols + c;
          x[i] = static_cast<long double>(T(src[r * ld + c] * scale)) - mx;
          rel_e[i] = u * (std::abs(double(src[r * ld + c]) * scale) + std::abs(double(x[i]))) + 4 * u;
          const double want = double(std::exp(x[i]));
          EXPECT_NEAR(e[i], want, rel_e[i] * want) << r << "," << c;
          sum += std::exp(x[i]);
          sum_err += rel_e[i] * want;
        }
        const double rel_inv = sum_err / double(sum) + gsum + 2 * u;
        EXPECT_NEAR(inv[c], double(1 / sum), rel_inv / double(sum)) << c;
        for (size_t r = 0; r < rows; ++r) {
          const size_t i = r * cols + c;
          p[i] = double(std::exp(x[i]) / sum);
          rel_p[i] = rel_e[i] + rel_inv;
        }
      }
      // Backward: g = scale·P∘(dP − δ), δ_c = Σ_r P dP, against the double P; the fast path
      // rounds δ's sum (gsum), its product by inv (u), and coef = scale·inv, coef·e, dP − δ
      // and the last product (4u).
      std::vector<T> dk = g;
      simd::softmax_columns_backward(e.data(), inv.data(), dk.data(), rows, cols, scale, work.data());
      for (size_t c = 0; c < cols; ++c) {
        double delta = 0, delta_err = 0;
        for (size_t r = 0; r < rows; ++r) {
          const size_t i = r * cols + c;
          delta += p[i] * g[i];
          delta_err += (rel_p[i] + gsum) * std::abs(p[i] * g[i]);
        }
        delta_err += u * std::abs(delta);
        for (size_t r = 0; r < rows; ++r) {
          const size_t i = r * cols + c;
          const double dP = g[i], diff = dP - delta;
          const double want = scale * p[i] * diff;
          const double bound = scale * p[i] * ((rel_p[i] + 4 * u) * std::abs(diff) + delta_err) + 4 * u * std::abs(want);
          EXPECT_NEAR(dk[i], want, bound) << r << "," << c;
        }
      }
    }
}

TEST(Simd, FloatSoftmaxColumnsMatchesLoops) { check_softmax_columns<float>(); }
TEST(Simd, DoubleSoftmaxColumnsMatchesLoops) { check_softmax_columns<double>(); }

// A column whose scaled values overflow is reported, not turned into NaN.
TEST(Simd, SoftmaxColumnsReportsOverflow) {
  std::vector<float> src{1.f, 3e38f, 2.f, 1.f}, e(4), inv(2), work(6);
  EXPECT_FALSE(simd::softmax_columns(src.data(), 2, e.data(), 2, 2, 10.f, inv.data(), work.data()));
}

// tile_matmul::multiply against float64 sums on every SIMD target, at row counts around the
// 6-row register block, inner sizes from 0, column counts that end in every partial strip
// (16 to 144: AVX-512 strips of 64, AVX2 of 16, SSE4 of 8) and padded leading dimensions.
// Each c element is one chain of `inner` steps from its start c0 (0 without accumulate), each step
// a fused multiply-add (AVX2 and up) or a multiply and an add (SSE4 and below):
// |δc| ≤ γ_inner·(|c0| + Σ_p |a_p·b_p|) (Higham §3.1: one rounding per step with FMA; without
// it a product's rounding and the additions after it, one more when the chain starts from c0,
// as the first addition to 0 is exact). Padding columns of c are never written.
TEST(TileMatmul, MatchesFloat64OnEverySimdTarget) {
  int targets = 0;
  testing::for_each_simd_target([&](int64_t target) {
    ++targets;
    const bool fuses = testing::simd_target_fuses(target);
    ASSERT_EQ(std::string(tile_matmul::target_name()), hwy::TargetName(target));  // the dispatch follows
    uint64_t seed = 1;
    for (int64_t rows : {1, 5, 6, 7, 13})
      for (int64_t inner : {0, 1, 17, 64, 70})
        for (int64_t cols : {16, 48, 64, 80, 144})
          for (bool accumulate : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "rows=" << rows << " inner=" << inner << " cols=" << cols
                                              << " accumulate=" << accumulate);
            const int64_t lda = inner + 3, ldb = cols + 5, ldc = cols + 7;
            std::vector<float> a(static_cast<size_t>(rows * lda)), b(static_cast<size_t>(std::max<int64_t>(inner, 1) * ldb)),
                c(static_cast<size_t>(rows * ldc));
            fill_normal(a.data(), a.size(), seed++);
            fill_normal(b.data(), b.size(), seed++);
            fill_normal(c.data(), c.size(), seed++);
            const std::vector<float> c0 = c;
            tile_matmul::multiply(a.data(), lda, rows, b.data(), ldb, inner, cols, c.data(), ldc, accumulate);
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t j = 0; j < cols; ++j) {
                const double start = accumulate ? c0[r * ldc + j] : 0.0;
                double want = start, abs_sum = std::abs(start);
                for (int64_t p = 0; p < inner; ++p) {
                  want += double(a[r * lda + p]) * b[p * ldb + j];
                  abs_sum += std::abs(double(a[r * lda + p]) * b[p * ldb + j]);
                }
                ASSERT_LE(std::abs(c[r * ldc + j] - want),
                          gamma<float>(double(inner) + (!fuses && accumulate ? 1 : 0)) * abs_sum)
                    << "c[" << r << "][" << j << "]";
              }
              for (int64_t j = cols; j < ldc; ++j) ASSERT_EQ(c[r * ldc + j], c0[r * ldc + j]) << "padding " << j;
            }
          }
  });
  EXPECT_GE(targets, 1);
}

// The benchmarks' denominators: positive rates, the bfloat16 one exactly where vdpbf16ps runs,
// and a thread count outside [1, kMaxThreads] refused by name.
TEST(PeakRates, ArePositiveAndCheckTheirThreadCount) {
  const PeakRates r = measure_peak_rates(1);
  EXPECT_GT(r.float32_fma_gflops, 0);
  EXPECT_EQ(r.bfloat16_dot_gflops > 0, build_info().find("AVX512-BF16 (vdpbf16ps)") != std::string::npos);
  for (int bad : {0, -3, kMaxThreads + 1})
    EXPECT_THROW(
        {
          try {
            (void)measure_peak_rates(bad);
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("measure_peak_rates: threads must be in [1, 1024]"), std::string::npos);
            throw;
          }
        },
        Error);
}

TEST(TileMatmul, BadArgumentsAreErrors) {
  std::vector<float> a(64), b(64), c(64);
  EXPECT_THROW(tile_matmul::multiply(a.data(), 4, 2, b.data(), 16, 4, 8, c.data(), 16, false), Error);   // cols % 16
  EXPECT_THROW(tile_matmul::multiply(a.data(), 3, 2, b.data(), 16, 4, 16, c.data(), 16, false), Error);  // lda < inner
  EXPECT_THROW(tile_matmul::multiply(a.data(), 4, -1, b.data(), 16, 4, 16, c.data(), 16, false), Error); // rows < 0
}

// The float exp of the shifted softmax (simd.cc, ExpNonPositive) against exp in double, over
// every 29th float in [ln(2^−126), 0] (36 million, every binade), on every SIMD target: at most 1.3 ulp of the result (the bound simd.cc and
// the tolerance above rely on). Below that range the result is 0.
TEST(Simd, SimdExpIsWithin1Point3Ulp) {
  testing::for_each_simd_target([](int64_t) {
    const float low = -87.33654f;
    uint32_t first, last;
    const float zero = -0.0f;
    std::memcpy(&first, &zero, 4);
    std::memcpy(&last, &low, 4);
    std::vector<float> x(4096), e(4096);
    double worst = 0;
    float worst_at = 0;
    for (uint64_t u = first; u <= last;) {
      size_t n = 0;
      for (; n < x.size() && u <= last; ++n, u += 29) {
        const uint32_t bits = static_cast<uint32_t>(u);
        std::memcpy(&x[n], &bits, 4);
      }
      std::copy(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n), e.begin());
      simd::exp_shifted_sum(e.data(), n, 0.f);
      for (size_t i = 0; i < n; ++i) {
        const double want = std::exp(double(x[i]));
        const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
        const double err = std::abs(e[i] - want) / ulp;
        if (err > worst) worst = err, worst_at = x[i];
      }
    }
    EXPECT_LE(worst, 1.3) << "at x = " << worst_at;
    RecordProperty("worst_ulp", std::to_string(worst));
    std::vector<float> below{-87.34f, -100.f, -std::numeric_limits<float>::infinity()};
    simd::exp_shifted_sum(below.data(), below.size(), 0.f);
    for (float v : below) EXPECT_EQ(v, 0.f);
  });
}

// Large negative arguments underflow to 0 rather than producing garbage.
TEST(Simd, ExpUnderflowsToZero) {
  std::vector<float> x{-200.f, -1e30f, 0.f};
  simd::exp_shifted_sum(x.data(), x.size(), 0.f);
  EXPECT_EQ(x[0], 0.f);
  EXPECT_EQ(x[1], 0.f);
  EXPECT_EQ(x[2], 1.f);
}

// The kernels of FAVOR's per-feature shifts against scalar loops, for row and column counts
// that cross every vector width (full vectors, tails): column maxima exact; exp(x − shift) and
// the row exp with offsets within 3u relative (one rounded subtraction or addition, then an
// exp within 1 ulp) plus the smallest normal number (results that underflow may flush to 0),
// entries of −inf and far below the shift giving exactly 0.
template <class T>
void check_shift_kernels() {
  const double u = unit_roundoff<T>();
  const double tiny = std::numeric_limits<T>::min();
  const T ninf = -std::numeric_limits<T>::infinity();
  for (size_t rows : {size_t{1}, size_t{3}, size_t{17}})
    for (size_t cols : {size_t{1}, size_t{5}, size_t{8}, size_t{16}, size_t{19}, size_t{33}}) {
      SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
      const size_t ld = cols + 3;
      std::vector<T> x(rows * ld), m(cols);
      fill_normal(x.data(), int64_t(x.size()), 5 + rows * cols, 30.0);
      fill_normal(m.data(), int64_t(m.size()), 6 + cols, 30.0);
      std::vector<T> want_m = m;
      for (size_t r = 0; r < rows; ++r)
        for (size_t c = 0; c < cols; ++c) want_m[c] = std::max(want_m[c], x[r * ld + c]);
      simd::column_max(x.data(), rows, cols, ld, m.data());
      EXPECT_EQ(m, want_m);

      std::vector<T> e = x;
      e[0] = ninf;  // an entry of −inf becomes 0
      if (cols > 1) e[1] = want_m[1] - T(1e30);
      simd::exp_minus_columns(e.data(), rows, cols, ld, want_m.data());
      for (size_t r = 0; r < rows; ++r)
        for (size_t c = 0; c < cols; ++c) {
          const size_t i = r * ld + c;
          double want = std::exp(double(T(x[i] - want_m[c])));
          if (i == 0 || (i == 1 && cols > 1)) want = 0;
          ASSERT_NEAR(double(e[i]), want, 3 * u * want + tiny) << r << "," << c;
        }
      for (size_t r = 0; r < rows; ++r)  // the padding between rows is untouched
        for (size_t c = cols; c < ld; ++c) ASSERT_EQ(e[r * ld + c], x[r * ld + c]);
      // arguments up to +20 (chunk_decay's U = e^{b − ref} takes them up to +10): the same bound
      std::vector<T> p = x, lower(cols);
      for (size_t c = 0; c < cols; ++c) lower[c] = want_m[c] - T(20);
      simd::exp_minus_columns(p.data(), rows, cols, ld, lower.data());
      for (size_t r = 0; r < rows; ++r)
        for (size_t c = 0; c < cols; ++c) {
          const size_t i = r * ld + c;
          const double want = std::exp(double(T(x[i] - lower[c])));
          ASSERT_NEAR(double(p[i]), want, 3 * u * want + tiny) << "positive " << r << "," << c;
        }

      std::vector<T> row(x.begin(), x.begin() + cols), offset(m.begin(), m.end());
      offset[0] = ninf;  // a feature no key reached
      double t = -std::numeric_limits<double>::infinity();
      for (size_t c = 0; c < cols; ++c) t = std::max(t, double(T(row[c] + offset[c])));
      const T got_t = simd::exp_row_offset(row.data(), cols, offset.data());
      EXPECT_EQ(double(got_t), t);
      for (size_t c = 0; c < cols; ++c) {
        const double want = c == 0 ? 0.0 : std::exp(double(T(T(x[c] + offset[c]) - got_t)));
        ASSERT_NEAR(double(row[c]), want, 3 * u * want + tiny) << c;
      }
      std::vector<T> none(cols, T(1)), all_ninf(cols, ninf);
      EXPECT_EQ(simd::exp_row_offset(none.data(), cols, all_ninf.data()), ninf);
      for (T v : none) EXPECT_EQ(v, T(0));
    }
}
TEST(Simd, FloatShiftKernelsMatchLoops) { check_shift_kernels<float>(); }
TEST(Simd, DoubleShiftKernelsMatchLoops) { check_shift_kernels<double>(); }

// scale_rows on every SIMD target: each value is the one multiply x·factor of its row (float32,
// float64), and for a bfloat16 result that product rounded as to_bfloat16 rounds it (ties,
// overflow to inf and a zero factor included); padding columns of dst are left alone; widths
// that end in a full vector and in a tail.
template <class T>
void check_scale_rows() {
  testing::for_each_simd_target([](int64_t) {
    for (const size_t cols : {size_t{1}, size_t{7}, size_t{16}, size_t{33}}) {
      const size_t rows = 5, ld_src = cols + 2, ld_dst = cols + 3;
      std::vector<T> src(rows * ld_src), factor = {T(0.37), T(0), T(-3), T(1) / T(3), T(1e38)};
      fill_normal(src.data(), int64_t(src.size()), 31 + cols);
      src[0] = T(1) + T(1) / T(256);                 // a bfloat16 tie: rounds to even
      src[4 * ld_src + cols - 1] = T(4);             // times 1e38: past float32's range (row 4)
      std::vector<T> got(rows * ld_dst, T(-7)), want = got;
      std::vector<bfloat16> got16(rows * ld_dst, to_bfloat16(-7.0f)), want16 = got16;
      for (size_t r = 0; r < rows; ++r)
        for (size_t c = 0; c < cols; ++c) {
          want[r * ld_dst + c] = src[r * ld_src + c] * factor[r];
          if constexpr (std::is_same_v<T, float>) want16[r * ld_dst + c] = to_bfloat16(src[r * ld_src + c] * factor[r]);
        }
      bool finite = true, finite16 = true;
      for (size_t r = 0; r < rows; ++r)
        for (size_t c = 0; c < cols; ++c) {
          finite = finite && std::isfinite(want[r * ld_dst + c]);
          finite16 = finite16 && std::isfinite(to_float(want16[r * ld_dst + c]));
        }
      EXPECT_EQ(simd::scale_rows(src.data(), ld_src, rows, cols, factor.data(), got.data(), ld_dst), finite) << cols;
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "cols " << cols << " at " << i;
      // Without the row that overflows float32, every value is finite.
      EXPECT_TRUE(simd::scale_rows(src.data(), ld_src, rows - 1, cols, factor.data(), got.data(), ld_dst)) << cols;
      if constexpr (std::is_same_v<T, float>) {
        EXPECT_FALSE(finite16);  // 1e38·x rounds to inf somewhere (|x| > 3.4)
        EXPECT_EQ(simd::scale_rows(src.data(), ld_src, rows, cols, factor.data(), got16.data(), ld_dst), finite16) << cols;
        for (size_t i = 0; i < got16.size(); ++i) ASSERT_EQ(got16[i].bits, want16[i].bits) << "cols " << cols << " at " << i;
        EXPECT_TRUE(simd::scale_rows(src.data(), ld_src, rows - 1, cols, factor.data(), got16.data(), ld_dst)) << cols;
      }
    }
  });
}
TEST(Simd, FloatScaleRowsMatchesOneMultiply) { check_scale_rows<float>(); }
TEST(Simd, DoubleScaleRowsMatchesOneMultiply) { check_scale_rows<double>(); }

// finite_max_abs: the largest |x| exactly, NaN as soon as one entry is not finite, wherever
// it sits (full vector or tail).
TEST(Simd, FiniteMaxAbs) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{33}}) {
    std::vector<float> x(n);
    fill_normal(x.data(), int64_t(n), 11 + n);
    float want = 0;
    for (float v : x) want = std::max(want, std::abs(v));
    EXPECT_EQ(simd::finite_max_abs(x.data(), n), want) << n;
    for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()})
      for (size_t i = 0; i < n; ++i) {
        std::vector<float> y = x;
        y[i] = bad;
        ASSERT_TRUE(std::isnan(simd::finite_max_abs(y.data(), n))) << n << " " << i;
      }
  }
}

// The same for bfloat16 values, read on their bits: the largest |x| exactly (the largest finite
// bfloat16 and negative values included), NaN for ±inf or a NaN anywhere, over lengths that end
// in a full vector and in a tail.
TEST(Simd, FiniteMaxAbsBfloat16) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{100}}) {
    std::vector<float> x(n);
    fill_normal(x.data(), int64_t(n), 21 + n);
    std::vector<bfloat16> b(n);
    for (size_t i = 0; i < n; ++i) b[i] = to_bfloat16(x[i]);
    float want = 0;
    for (bfloat16 v : b) want = std::max(want, std::abs(to_float(v)));
    EXPECT_EQ(simd::finite_max_abs(b.data(), n), want) << n;
    EXPECT_TRUE(simd::all_finite(b.data(), n)) << n;
    for (size_t i = 0; i < n; ++i) {
      std::vector<bfloat16> y = b;
      y[i] = bfloat16{0xFF7F};  // −(largest finite bfloat16)
      ASSERT_EQ(simd::finite_max_abs(y.data(), n), -to_float(y[i])) << n << " " << i;
      for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN()}) {
        y[i] = to_bfloat16(bad);
        ASSERT_TRUE(std::isnan(simd::finite_max_abs(y.data(), n))) << n << " " << i;
        ASSERT_FALSE(simd::all_finite(y.data(), n)) << n << " " << i;
      }
    }
  }
}

// Sizes from arguments: a byte count that overflows is an Error naming the arguments, one
// beyond the machine's memory an OutOfMemory naming them; in range, the element count.
TEST(Sizes, ArgumentSizedArraysAreChecked) {
  EXPECT_EQ(sized_by_arguments("f", "x", {{"a", 3}, {"b", 5}}, 4), 15);
  const std::string overflow = testing::error_of([] {
    sized_by_arguments("linformer_projections", "e and f", {{"s_proj", int64_t{1} << 31}, {"n_max", int64_t{1} << 31}}, 4, 2);
  });
  EXPECT_NE(overflow.find("linformer_projections: e and f of s_proj × n_max = 2147483648 × 2147483648"), std::string::npos)
      << overflow;
  EXPECT_NE(testing::error_of([] { sized_by_arguments("f", "x", {{"a", 0}}, 4); }).find("a must be >= 1, got 0"),
            std::string::npos);
  try {
    sized_by_arguments("random_features", "the projection", {{"num_features", int64_t{1} << 40}, {"head_dim", 64}}, 4);
    ADD_FAILURE() << "no OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("num_features × head_dim"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("more than this machine's memory"), std::string::npos) << e.what();
  }
  // A failed allocation is an OutOfMemory (a std::bad_alloc) saying how much was asked for.
  try {
    Buffer<float> huge(int64_t{1} << 60);
    ADD_FAILURE() << "no OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("cannot allocate"), std::string::npos) << e.what();
  }
  EXPECT_THROW(element_count({int64_t{1} << 40, int64_t{1} << 40}), Error);
  EXPECT_THROW(element_count({3, -1}), Error);
}

// Same seed, same numbers: a few values pinned so a change of generator is noticed.
TEST(Random, SeededStreamIsPinned) {
  Rng a(42), b(42), c(43);
  const uint64_t first = a.next_u64();
  EXPECT_EQ(first, b.next_u64());
  EXPECT_NE(first, c.next_u64());
  Rng r(0);
  EXPECT_EQ(r.next_u64(), 0x99ec5f36cb75f2b4ULL);
}

// Sample mean and variance of N(0,1) draws within 5 standard errors.
TEST(Random, NormalsHaveUnitVariance) {
  const int n = 200000;
  std::vector<double> x(n);
  fill_normal(x.data(), n, 3);
  double mean = 0, var = 0;
  for (double v : x) mean += v;
  mean /= n;
  for (double v : x) var += (v - mean) * (v - mean);
  var /= n - 1;
  EXPECT_NEAR(mean, 0.0, 5.0 / std::sqrt(n));           // sd of the mean: 1/sqrt(n)
  EXPECT_NEAR(var, 1.0, 5.0 * std::sqrt(2.0 / (n - 1)));  // sd of the variance: sqrt(2/(n-1))
}

// Buffers of 8 MiB and more start on a 2 MiB boundary (and are advised as huge pages,
// memory.cc); smaller ones on kAlignment. Both are usable to their last byte.
TEST(Memory, LargeBuffersAreHugePageAligned) {
  Buffer<float> big((int64_t{8} << 20) / 4 + 3, false, Init::Zero);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % (uintptr_t{2} << 20), 0u);
  EXPECT_EQ(big[big.size() - 1], 0.f);
  big[big.size() - 1] = 1.f;
  Buffer<float> small(1000, false, Init::Zero);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % kAlignment, 0u);
}

#ifdef LINATTN_SANITIZED
// Under AddressSanitizer a kept block is poisoned (memory.cc): touching a freed buffer while its
// block is in the cache is reported, in a child process (a death test), though the block was
// not given back.
TEST(Memory, KeptBlocksArePoisonedUnderAddressSanitizer) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the thread pool may be running
  EXPECT_DEATH(
      {
        float* stale = nullptr;
        {
          Buffer<float> a(int64_t{1} << 20, false, Init::Zero);
          stale = a.data();
        }
        volatile float x = stale[12345];
        (void)x;
      },
      "use-after-poison");
}
#endif

// Freed blocks of 1 MiB and more are kept and handed out again (memory.cc): the same block
// comes back, zeroed again when Init::Zero asks; smaller ones and blocks past 256 MiB are not
// kept; at most 64 blocks and 256 MiB; release_cached_memory() returns what it gave back, then 0; a cached
// block is never handed to a request that needs a larger alignment. Alloc/free from several
// threads at once leaves the cache consistent.
TEST(Memory, LargeFreedBlocksAreReusedAndReleased) {
  (void)release_cached_memory();
  float* first = nullptr;
  {
    Buffer<float> a(int64_t{1} << 20, false, Init::Uninitialized);  // 4 MiB
    for (int64_t i = 0; i < a.size(); ++i) a[i] = 7.f;
    first = a.data();
  }
  {
    Buffer<float> b(int64_t{1} << 20, false, Init::Zero);
    EXPECT_EQ(b.data(), first);
    for (int64_t i = 0; i < b.size(); i += 4097) ASSERT_EQ(b[i], 0.f) << i;
  }
  EXPECT_EQ(release_cached_memory(), size_t{4} << 20);
  EXPECT_EQ(release_cached_memory(), 0u);
  { Buffer<float> small(1000, false); }
  EXPECT_EQ(release_cached_memory(), 0u);
  { Buffer<char> huge(int64_t{300} << 20, false, Init::Uninitialized); }
  EXPECT_EQ(release_cached_memory(), 0u);
  {
    std::vector<Buffer<float>> many;
    for (int i = 0; i < 70; ++i) many.emplace_back(int64_t{1} << 19, false, Init::Uninitialized);  // 2 MiB each
  }
  EXPECT_EQ(release_cached_memory(), size_t{64} << 21);  // at most 64 blocks
  {
    std::vector<Buffer<float>> many;
    for (int i = 0; i < 10; ++i) many.emplace_back(int64_t{10} << 20, false, Init::Uninitialized);  // 40 MiB each
  }
  EXPECT_EQ(release_cached_memory(), size_t{6} * (size_t{40} << 20));  // at most 256 MiB
  {  // 8 MiB minus 1 KiB rounds to 8 MiB on 64 bytes; an 8 MiB request needs 2 MiB alignment
    Buffer<char> a((int64_t{8} << 20) - 1024, false, Init::Uninitialized);
  }
  {
    Buffer<char> b(int64_t{8} << 20, false, Init::Uninitialized);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % (uintptr_t{2} << 20), 0u);
  }
  (void)release_cached_memory();
  // Blocks handed out from several threads at once come zeroed; live blocks are distinct.
  parallel_for(64, [&](int64_t t) {
    Buffer<float> x((int64_t{1} << 18) + t * 1000, false, Init::Zero);
    ASSERT_EQ(x[0], 0.f);
    ASSERT_EQ(x[x.size() - 1], 0.f);
    x[0] = x[x.size() - 1] = 1.f;
  });
  {
    std::vector<Buffer<float>> live;
    for (int i = 0; i < 8; ++i) live.emplace_back(int64_t{1} << 18, false, Init::Zero);
    for (int i = 0; i < 8; ++i)
      for (int j = i + 1; j < 8; ++j) ASSERT_NE(live[i].data(), live[j].data());
  }
  const size_t kept = release_cached_memory();
  EXPECT_LE(kept, size_t{64} * ((size_t{1} << 20) + 64 * 4000 + (size_t{64} << 10)));
  EXPECT_EQ(release_cached_memory(), 0u);
}

TEST(Memory, WorkspaceIsCountedAndReleased) {
  const int64_t before = workspace_stats().current_bytes;
  reset_workspace_peak();
  {
    Buffer<float> a(1000);
    Buffer<double> b(10);
    EXPECT_EQ(workspace_stats().current_bytes - before, 4000 + 80);
    Buffer<float> moved = std::move(a);
    EXPECT_EQ(workspace_stats().current_bytes - before, 4080);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(moved.data()) % kAlignment, 0u);
    Buffer<float> output(500, /*counted=*/false);
    EXPECT_EQ(workspace_stats().current_bytes - before, 4080);
  }
  EXPECT_EQ(workspace_stats().current_bytes, before);
  EXPECT_EQ(workspace_stats().peak_bytes - before, 4080);
}

// Gated linear attention's Highway kernels (simd.h) against plain float64 loops, on every SIMD
// target, odd widths and every block height: products of m roundings within γ_m of the exact
// value times the sum of the terms' magnitudes (Higham 3.1).
template <class T>
void check_gated_kernels() {
  auto pair = [](size_t j, size_t i) { return j * (j + 1) / 2 + i; };
  testing::for_each_simd_target([&](int64_t) {
    for (size_t dim : {size_t{1}, size_t{5}, size_t{17}, size_t{64}})
      for (size_t rows : {size_t{1}, size_t{7}, size_t{16}}) {
        SCOPED_TRACE(::testing::Message() << "dim " << dim << " rows " << rows);
        std::vector<T> a(rows * dim), q(rows * dim), k(rows * dim), x(rows * dim), w(rows * 20), f(dim);
        fill_normal(q.data(), int64_t(q.size()), 3 + dim + rows);
        fill_normal(k.data(), int64_t(k.size()), 5 + dim + rows);
        fill_normal(x.data(), int64_t(x.size()), 7 + dim + rows);
        fill_normal(w.data(), int64_t(w.size()), 11 + dim + rows);
        fill_normal(f.data(), int64_t(f.size()), 13 + dim + rows);
        fill_normal(a.data(), int64_t(a.size()), 17 + dim + rows);
        for (T& v : a) v = T(std::exp(-std::abs(double(v))));  // factors in (0, 1]
        std::vector<T> e(pair(rows, 0) * dim);
        simd::decay_pairs(a.data(), rows, dim, e.data());
        std::vector<double> exact(e.size());
        for (size_t j = 0; j < rows; ++j)
          for (size_t i = 0; i <= j; ++i)
            for (size_t c = 0; c < dim; ++c) {
              double p = 1;
              for (size_t t = i + 1; t <= j; ++t) p *= double(a[t * dim + c]);
              exact[pair(j, i) * dim + c] = p;
              ASSERT_NEAR(double(e[pair(j, i) * dim + c]), p, gamma<T>(double(j - i)) * p + 1e-300) << j << " " << i;
            }
        // dots: 2 products and dim − 1 additions a term
        std::vector<T> out(rows * 20, T(-7));
        simd::decayed_dots(q.data(), k.data(), e.data(), rows, dim, out.data(), 20);
        for (size_t j = 0; j < rows; ++j)
          for (size_t i = 0; i <= j; ++i) {
            double want = 0, mag = 0;
            for (size_t c = 0; c < dim; ++c) {
              const double t = double(q[j * dim + c]) * double(k[i * dim + c]) * double(e[pair(j, i) * dim + c]);
              want += t, mag += std::abs(t);
            }
            EXPECT_NEAR(double(out[j * 20 + i]), want, gamma<T>(double(dim + 2)) * mag) << j << " " << i;
          }
        for (size_t j = 0; j < rows; ++j)  // above the diagonal: untouched
          for (size_t i = j + 1; i < rows; ++i) EXPECT_EQ(out[j * 20 + i], T(-7));
        for (const bool later : {false, true}) {
          std::vector<T> y = x;
          simd::decayed_weigh(w.data(), 20, q.data(), e.data(), rows, dim, y.data(), later);
          for (size_t r = 0; r < rows; ++r)
            for (size_t c = 0; c < dim; ++c) {
              double want = double(x[r * dim + c]), mag = std::abs(want);
              for (size_t o = later ? r : 0; o <= (later ? rows - 1 : r); ++o) {
                const size_t j = later ? o : r, i = later ? r : o;
                const double t = double(w[j * 20 + i]) * double(q[o * dim + c]) * double(e[pair(j, i) * dim + c]);
                want += t, mag += std::abs(t);
              }
              EXPECT_NEAR(double(y[r * dim + c]), want, gamma<T>(double(rows + 2)) * mag) << later << " " << r;
            }
        }
        std::vector<T> prod(rows * (dim + 3), T(1));
        simd::multiply(q.data(), k.data(), rows, dim, prod.data(), dim + 3, true);
        std::vector<T> cols(rows * dim);
        simd::scale_columns(q.data(), rows, dim, f.data(), cols.data(), false);
        for (size_t r = 0; r < rows; ++r)
          for (size_t c = 0; c < dim; ++c) {
            const double p = double(q[r * dim + c]) * double(k[r * dim + c]);
            EXPECT_NEAR(double(prod[r * (dim + 3) + c]), 1 + p, gamma<T>(2) * (1 + std::abs(p)));
            EXPECT_EQ(cols[r * dim + c], T(q[r * dim + c] * f[c]));
          }
        // floored cumulative sums in float64: exact up to float64's own rounding; NaN stays
        std::vector<T> g(rows * dim), floored(rows * dim);
        for (size_t i = 0; i < g.size(); ++i) g[i] = T(-std::abs(double(w[i % w.size()])) * (i % 5 == 0 ? 2000 : 1));
        g[g.size() / 2] = std::numeric_limits<T>::quiet_NaN();
        std::vector<double> b(rows * dim);
        simd::floored_cumsum(g.data(), rows, dim, -1000.0, b.data(), floored.data());
        for (size_t c = 0; c < dim; ++c) {
          double sum = 0;
          for (size_t j = 0; j < rows; ++j) {
            const double x = double(g[j * dim + c]);
            const double fl = std::isnan(x) ? x : std::max(x, -1000.0);
            sum += fl;
            if (std::isnan(sum)) {
              EXPECT_TRUE(std::isnan(b[j * dim + c]));
            } else {
              EXPECT_NEAR(b[j * dim + c], sum, 1e-12 * std::abs(sum));
              EXPECT_EQ(double(floored[j * dim + c]), fl);
            }
          }
        }
      }
  });
}
// The decoding steps' kernels (simd::state_dots, row_dots, decay_rank_one) against float64 loops on every
// SIMD target, widths on and off the vector blocks, rows odd and even, 1 to 9 queries at once: a dot of `rows` terms is within
// γ_rows·Σ|terms| (Higham 3.1), a decayed rank-one entry within γ_2 of its two terms; a
// non-finite entry is reported, through the tail too.
template <class T>
void check_step_kernels() {
  testing::for_each_simd_target([&](int64_t) {
    for (size_t cols : {size_t{1}, size_t{7}, size_t{13}, size_t{16}, size_t{29}, size_t{64}, size_t{67}, size_t{128}})
      for (size_t rows : {size_t{1}, size_t{2}, size_t{5}, size_t{64}}) {
        SCOPED_TRACE(::testing::Message() << "rows " << rows << " cols " << cols);
        std::vector<T> S(rows * cols), a(rows), b(rows), f(rows), k(rows), u(cols);
        fill_normal(S.data(), int64_t(S.size()), 19 + rows + cols);
        fill_normal(a.data(), int64_t(rows), 23 + rows);
        fill_normal(b.data(), int64_t(rows), 29 + rows);
        fill_normal(k.data(), int64_t(rows), 31 + rows);
        fill_normal(u.data(), int64_t(cols), 37 + cols);
        fill_normal(f.data(), int64_t(rows), 41 + rows);
        for (T& v : f) v = T(std::exp(-std::abs(double(v))));
        std::vector<T> x(cols, T(-7)), y(cols, T(-7));
        simd::state_dots(S.data(), rows, cols, a.data(), b.data(), x.data(), y.data());
        for (size_t c = 0; c < cols; ++c) {
          double wx = 0, wy = 0, mx = 0, my = 0;
          for (size_t r = 0; r < rows; ++r) {
            const double s = double(S[r * cols + c]);
            wx += double(a[r]) * s, mx += std::abs(double(a[r]) * s);
            wy += double(b[r]) * s, my += std::abs(double(b[r]) * s);
          }
          EXPECT_NEAR(double(x[c]), wx, gamma<T>(double(rows)) * mx) << c;
          EXPECT_NEAR(double(y[c]), wy, gamma<T>(double(rows)) * my) << c;
        }
        // row_dots and state_dots for 1 to 9 queries at once (groups of four, three and
        // fewer, and their remainders): S a, a dot of `cols` terms a row; Sᵀa, of `rows` terms.
        for (size_t count = 1; count <= 9; ++count) {
          SCOPED_TRACE(::testing::Message() << "queries " << count);
          std::vector<T> queries(count * cols), weightings(count * rows);
          fill_normal(queries.data(), int64_t(queries.size()), 43 + cols + count);
          fill_normal(weightings.data(), int64_t(weightings.size()), 47 + rows + count);
          std::vector<T> dots(count * rows, T(-7)), sums(count * cols, T(-7));
          simd::row_dots(S.data(), rows, cols, queries.data(), count, dots.data());
          simd::state_dots(S.data(), rows, cols, weightings.data(), count, sums.data());
          for (size_t q = 0; q < count; ++q) {
            // each query's sums are its own, whatever the queries beside it: bitwise one query's
            std::vector<T> one_dots(rows), one_sums(cols);
            simd::row_dots(S.data(), rows, cols, queries.data() + q * cols, 1, one_dots.data());
            simd::state_dots(S.data(), rows, cols, weightings.data() + q * rows, 1, one_sums.data());
            EXPECT_TRUE(std::equal(one_dots.begin(), one_dots.end(), dots.begin() + q * rows)) << q;
            EXPECT_TRUE(std::equal(one_sums.begin(), one_sums.end(), sums.begin() + q * cols)) << q;
            // got against the float64 sum of `terms` terms term(i), within γ_terms·Σ|term|
            auto expect_sum = [](T got, size_t terms, auto term) {
              double want = 0, mag = 0;
              for (size_t i = 0; i < terms; ++i) want += term(i), mag += std::abs(term(i));
              EXPECT_NEAR(double(got), want, gamma<T>(double(terms)) * mag);
            };
            for (size_t r = 0; r < rows; ++r)
              expect_sum(dots[q * rows + r], cols, [&](size_t c) { return double(S[r * cols + c]) * double(queries[q * cols + c]); });
            for (size_t c = 0; c < cols; ++c)
              expect_sum(sums[q * cols + c], rows, [&](size_t r) { return double(weightings[q * rows + r]) * double(S[r * cols + c]); });
          }
        }
        std::vector<T> out(rows * cols);
        EXPECT_TRUE(simd::decay_rank_one(S.data(), rows, cols, f.data(), k.data(), u.data(), out.data()));
        for (size_t r = 0; r < rows; ++r)
          for (size_t c = 0; c < cols; ++c) {
            const double p = double(f[r]) * double(S[r * cols + c]), q = double(k[r]) * double(u[c]);
            EXPECT_NEAR(double(out[r * cols + c]), p + q, gamma<T>(2) * (std::abs(p) + std::abs(q)));
          }
        std::vector<T> in_place = S;  // out may be S: the same values
        EXPECT_TRUE(simd::decay_rank_one(in_place.data(), rows, cols, f.data(), k.data(), u.data(), in_place.data()));
        EXPECT_EQ(in_place, out);
        for (const T bad : {std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN()}) {
          std::vector<T> with_bad = S;
          with_bad.back() = bad;  // the last column: in a tail where cols is not a multiple of the lanes
          EXPECT_FALSE(simd::decay_rank_one(with_bad.data(), rows, cols, f.data(), k.data(), u.data(), out.data()));
        }
      }
  });
}
TEST(Simd, FloatStepKernelsMatchLoops) { check_step_kernels<float>(); }
TEST(Simd, DoubleStepKernelsMatchLoops) { check_step_kernels<double>(); }

TEST(Simd, FloatGatedKernelsMatchLoops) { check_gated_kernels<float>(); }
TEST(Simd, DoubleGatedKernelsMatchLoops) { check_gated_kernels<double>(); }

}  // namespace
}  // namespace linattn
