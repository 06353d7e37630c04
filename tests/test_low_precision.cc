// bfloat16 and float16 (low_precision.h): the conversions, and every registered method on 16-bit
// inputs. A 16-bit call widens its inputs exactly, runs the float32 kernels and rounds once, so
// its output and gradients must be bitwise the float32 ones (on the widened inputs) rounded to
// nearest even, and what it saves bitwise the float32 saved tensors. Their distance to float64
// then follows: |rn(x32) − x64| ≤ u16·|x32| + |x32 − x64|, u16 = 2^-8 (bfloat16) or 2^-11
// (float16) and |x32 − x64| within the float32 bounds the other suites check. What rounding the
// inputs themselves costs is measured in docs/precision.md. The one exception is a method's own
// bfloat16 forward (exact attention on AMX tiles or AVX512-BF16, where the CPU has them), which
// test_softmax_bf16.cc checks against float64; its AVX512-BF16 product kernel is checked here.
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "linattn/linattn.h"
#include "linattn/core/avx512_bf16.h"
#include "linattn/core/products.h"
#include "linattn/core/simd.h"
#include "test_util.h"

namespace linattn {
namespace {

using testing::narrowed;
using testing::random_tensor;
using testing::ScopedThreads;

uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }

// Every bit pattern widens to the same value in bulk (Highway) as one at a time.
template <class Low>
void expect_widen_all_patterns() {
  std::vector<Low> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i].bits = static_cast<uint16_t>(i);
  std::vector<float> bulk(all.size());
  simd::widen(all.data(), bulk.data(), all.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    const float one = to_float(all[i]);
    if (std::isnan(one)) {
      EXPECT_TRUE(std::isnan(bulk[i])) << dtype_name<Low>() << " bits " << i;
    } else {
      ASSERT_EQ(bits_of(bulk[i]), bits_of(one)) << dtype_name<Low>() << " bits " << i;
    }
  }
}

TEST(LowPrecision, WideningEveryPatternMatchesTheOneValueForm) {
  expect_widen_all_patterns<bfloat16>();
  expect_widen_all_patterns<float16>();
}

// widen_rows: each row of a block widens as simd::widen widens it, into rows ld_dst apart, and
// the columns past cols are left alone; odd widths below and across a vector's lanes.
TEST(LowPrecision, WideningRowsMatchesWideningEachRow) {
  std::vector<bfloat16> src(7 * 37);
  for (size_t i = 0; i < src.size(); ++i) src[i].bits = static_cast<uint16_t>((i * 2654435761u) >> 16);
  for (const size_t cols : {size_t{1}, size_t{5}, size_t{16}, size_t{37}}) {
    const size_t rows = src.size() / cols > 7 ? 7 : src.size() / cols, ld = cols + 3;
    std::vector<float> got(rows * ld, -2.5f), want(rows * ld, -2.5f);
    simd::widen_rows(src.data(), rows, cols, got.data(), ld);
    for (size_t r = 0; r < rows; ++r) simd::widen(src.data() + r * cols, want.data() + r * ld, cols);
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::isnan(want[i])) {
        EXPECT_TRUE(std::isnan(got[i])) << "cols " << cols << " at " << i;
      } else {
        ASSERT_EQ(bits_of(got[i]), bits_of(want[i])) << "cols " << cols << " at " << i;
      }
    }
  }
}

// Known values: the largest finite, the smallest subnormal, ties to even, overflow to inf.
TEST(LowPrecision, KnownRoundings) {
  EXPECT_EQ(to_bfloat16(1.0f).bits, 0x3F80);
  EXPECT_EQ(to_bfloat16(std::bit_cast<float>(0x3F808000u)).bits, 0x3F80);  // tie: stays even
  EXPECT_EQ(to_bfloat16(std::bit_cast<float>(0x3F818000u)).bits, 0x3F82);  // tie: up to even
  EXPECT_EQ(to_bfloat16(std::bit_cast<float>(0x3F808001u)).bits, 0x3F81);
  EXPECT_EQ(to_bfloat16(std::bit_cast<float>(0x7F7F8000u)).bits, 0x7F80);  // past the largest: inf
  EXPECT_TRUE(std::isnan(to_float(to_bfloat16(std::nanf("")))));
  EXPECT_EQ(to_float16(65504.0f).bits, 0x7BFF);
  EXPECT_EQ(to_float16(65519.0f).bits, 0x7BFF);
  EXPECT_EQ(to_float16(65520.0f).bits, 0x7C00);
  EXPECT_EQ(to_float16(-1.0f).bits, 0xBC00);
  EXPECT_EQ(to_float(float16{0x0001}), std::ldexp(1.0f, -24));
  EXPECT_EQ(to_float16(std::ldexp(1.0f, -25)).bits, 0x0000);                 // tie: to even (0)
  EXPECT_EQ(to_float16(std::ldexp(3.0f, -25)).bits, 0x0002);                 // tie: to even (2)
  EXPECT_EQ(to_float16(std::ldexp(1.0f, -14) * (1 - 1.0f / 4096)).bits, 0x0400);  // up to the normals
  EXPECT_TRUE(std::isnan(to_float(to_float16(std::nanf("")))));
}

// The one-value narrowing returns the nearest value of the type (ties to even), judged in
// double against both neighbours, on random float bit patterns over the whole range.
template <class Low>
void expect_nearest(float x) {
  const Low r = from_float<Low>(x);
  const double got = to_float(r), xd = x;
  if (std::isinf(got)) return;  // overflow is checked in KnownRoundings
  for (int step : {-1, 1}) {
    Low n{static_cast<uint16_t>(r.bits + step)};
    const double other = to_float(n);
    if (std::isnan(other) || std::isinf(other) || ((r.bits & 0x7FFF) == 0 && step == -1)) continue;
    const double dg = std::abs(got - xd), doth = std::abs(other - xd);
    ASSERT_LE(dg, doth) << dtype_name<Low>() << " x=" << x << " bits " << bits_of(x);
    if (dg == doth) {
      ASSERT_EQ(r.bits & 1, 0) << "tie not to even: x=" << x;
    }
  }
}

TEST(LowPrecision, OneValueNarrowingIsNearestEven) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 200000; ++i) {
    const float x = std::bit_cast<float>(any(rng));
    if (!std::isfinite(x)) continue;
    expect_nearest<bfloat16>(x);
    if (std::abs(x) < 65504.0f) expect_nearest<float16>(x);
  }
}

// Bulk narrowing (Highway; F16C for float16) equals the one-value form, including the values
// one float ulp either side of every 16-bit value and its midpoints, NaN and ±inf.
template <class Low>
void expect_narrow_matches() {
  std::vector<float> x;
  for (uint32_t i = 0; i < 65536; ++i) {
    const float v = to_float(Low{static_cast<uint16_t>(i)});
    if (!std::isfinite(v)) continue;
    const float next = to_float(Low{static_cast<uint16_t>(i + 1)});
    const float mid = std::isfinite(next) ? static_cast<float>((double(v) + double(next)) / 2) : v;
    for (float y : {v, mid, std::nextafter(mid, -INFINITY), std::nextafter(mid, INFINITY)}) x.push_back(y);
  }
  x.push_back(std::numeric_limits<float>::infinity());
  x.push_back(-std::numeric_limits<float>::infinity());
  x.push_back(std::nanf(""));
  std::vector<Low> bulk(x.size());
  simd::narrow(x.data(), bulk.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const Low one = from_float<Low>(x[i]);
    if (std::isnan(x[i])) {
      EXPECT_TRUE(std::isnan(to_float(bulk[i])));
    } else {
      ASSERT_EQ(bulk[i].bits, one.bits) << dtype_name<Low>() << " x=" << x[i] << " bits " << bits_of(x[i]);
    }
  }
}

// narrow_finite writes narrow()'s bits and says whether every value written is finite: over every
// finite bfloat16 and the midpoints around it (all finite, the largest rounding to inf beyond
// the last), then with an inf or a NaN at a vector position and in the tail.
TEST(LowPrecision, NarrowFiniteWritesNarrowsBitsAndChecksThem) {
  std::vector<float> x;
  for (uint32_t i = 0; i < 0x7F80; ++i) x.push_back(to_float(bfloat16{static_cast<uint16_t>(i)}));
  for (const size_t n : {x.size(), size_t{37}, size_t{5}}) {
    std::vector<bfloat16> want(n), got(n);
    simd::narrow(x.data(), want.data(), n);
    EXPECT_TRUE(simd::narrow_finite(x.data(), got.data(), n)) << n;
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i].bits, want[i].bits) << i;
    for (const float bad : {std::numeric_limits<float>::infinity(), std::nanf(""), 3.4e38f})  // the last rounds to inf
      for (const size_t at : {size_t{0}, n - 1}) {
        std::vector<float> y(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n));
        y[at] = bad;
        EXPECT_FALSE(simd::narrow_finite(y.data(), got.data(), n)) << n << " " << at << " " << bad;
      }
  }
}

TEST(LowPrecision, BulkNarrowingMatchesTheOneValueForm) {
  expect_narrow_matches<bfloat16>();
  expect_narrow_matches<float16>();
}

template <class Low>
void expect_rounded_from(const Tensor<Low>& got, const Tensor<float>& wide, const std::string& what) {
  ASSERT_EQ(got.shape(), wide.shape()) << what;
  for (int64_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i].bits, from_float<Low>(wide[i]).bits) << what << " [" << i << "]: float32 " << wide[i];
}

// A call of method m on random 16-bit q, k, v [B,H,n,d] (and dout), with the method's extra
// tensors; seeds seed, seed + 1, ... The arguments view the tensors held here.
template <class Low>
struct RandomCall {
  Tensor<Low> q, k, v, dout;
  std::vector<std::pair<std::string, Tensor<Low>>> extra;
  MethodArgs<Low> args;
  RandomCall(const MethodInfo& m, bool causal, int64_t B, int64_t H, int64_t n, int64_t d, uint64_t seed)
      : q(narrowed<Low>(random_tensor<double>({B, H, n, d}, seed))),
        k(narrowed<Low>(random_tensor<double>({B, H, n, d}, seed + 1))),
        v(narrowed<Low>(random_tensor<double>({B, H, n, d}, seed + 2))),
        dout(narrowed<Low>(random_tensor<double>({B, H, n, d}, seed + 3))),
        extra(m.functions<Low>().example_tensors(H, d, n, 0, seed + 4)) {
    args.q = q, args.k = k, args.v = v;
    args.options["causal"] = causal;
    for (const auto& [name, t] : extra) args.tensors[name] = t.view();
  }
};

// One method, causal or not, at a thread count: the 16-bit forward and backward against the
// float32 ones on the widened inputs.
template <class Low>
void expect_method_is_rounded_float32(const MethodInfo& m, bool causal, int threads) {
  SCOPED_TRACE(::testing::Message() << m.name << (causal ? " causal " : " ") << dtype_name<Low>() << " threads="
                                    << threads);
  ScopedThreads scope(threads);
  const RandomCall<Low> call(m, causal, 2, 3, m.block_rows + 29, 16, 11);
  const MethodArgs<Low>& a = call.args;
  const Tensor<Low>& dout = call.dout;
  std::vector<Tensor<float>> wide;
  wide.reserve(4 + call.extra.size());
  MethodArgs<float> w;
  auto keep = [&](const Tensor<Low>& t) {
    wide.push_back(widen(t.view()));
    return wide.back().view();
  };
  w.q = keep(call.q), w.k = keep(call.k), w.v = keep(call.v);
  w.options = a.options;
  for (const auto& [name, t] : call.extra) w.tensors[name] = keep(t);
  const TensorView<const float> dout32 = keep(dout);

  const MethodOutput<Low> low = m.functions<Low>().forward(a);
  const MethodOutput<float> f32 = m.f32.forward(w);
  // A method's own bfloat16 forward (exact attention on AMX tiles or AVX512-BF16) is not the
  // widened one: it is tested against the float64 reference in its own suite
  // (test_softmax_bf16.cc).
  bool own_forward = false;
  if constexpr (std::is_same_v<Low, bfloat16>) own_forward = m.bf16_kernel && m.bf16_kernel(a).has_value();
  if (!own_forward) {
    expect_rounded_from(low.out, f32.out, "out");
    ASSERT_EQ(low.saved.size(), f32.saved.size());
    for (size_t i = 0; i < low.saved.size(); ++i)
      testing::expect_identical(low.saved[i].second, f32.saved[i].second, low.saved[i].first);
  }

  // Likewise a method's own bfloat16 backward (exact attention on AVX512-BF16), tested in
  // test_softmax_bf16.cc.
  if constexpr (std::is_same_v<Low, bfloat16>)
    if (m.bf16_backward_kernel && m.bf16_backward_kernel(a, dout, {}).has_value()) return;
  const AttentionGrads<Low> g = m.functions<Low>().backward(a, dout, {});
  const AttentionGrads<float> g32 = m.f32.backward(w, dout32, {});
  expect_rounded_from(g.dq, g32.dq, "dq");
  expect_rounded_from(g.dk, g32.dk, "dk");
  expect_rounded_from(g.dv, g32.dv, "dv");
  ASSERT_EQ(g.params.size(), g32.params.size());
  for (size_t i = 0; i < g.params.size(); ++i) expect_rounded_from(g.params[i].second, g32.params[i].second, g.params[i].first);

  // From what the forward saved (float32; "out" widened from the 16-bit output).
  if (!m.saved.empty()) {
    const Tensor<float> out_wide = widen(low.out.view());
    SavedViews<Low> saved{{"out", out_wide.view()}};
    for (const auto& [name, t] : low.saved) saved[name] = t.view();
    const AttentionGrads<Low> gs = m.functions<Low>().backward(a, dout, saved);
    SavedViews<float> saved32{{"out", out_wide.view()}};
    for (const auto& [name, t] : own_forward ? low.saved : f32.saved) saved32[name] = t.view();
    const AttentionGrads<float> gs32 = m.f32.backward(w, dout32, saved32);
    expect_rounded_from(gs.dq, gs32.dq, "dq from saved");
    expect_rounded_from(gs.dk, gs32.dk, "dk from saved");
    expect_rounded_from(gs.dv, gs32.dv, "dv from saved");
    ASSERT_EQ(gs.params.size(), gs32.params.size());
    for (size_t i = 0; i < gs.params.size(); ++i)
      expect_rounded_from(gs.params[i].second, gs32.params[i].second, gs.params[i].first + " from saved");
  }
}

// Thread counts below and above batch·heads = 6.
TEST(LowPrecision, EveryMethodIsItsFloat32ResultRoundedOnce) {
  for (const MethodInfo& m : methods())
    for (bool causal : {false, true}) {
      if (causal && !m.no_causal.empty()) continue;
      for (int threads : {1, 4, 9}) {
        expect_method_is_rounded_float32<bfloat16>(m, causal, threads);
        expect_method_is_rounded_float32<float16>(m, causal, threads);
      }
    }
}

// Every method's 16-bit backward from the forward's out as it returned it (SavedViews::
// out_as_returned, what the Python module passes) gives the bits of the same backward from that
// out widened into the map: the kernelized methods read it a block at a time, the others widen
// it (with_float_out). Both storage and own kernels (exact attention's, the kernelized ones) and
// the registry's widened calls; causal or not. out_as_returned with den or state missing, or
// with an "out" in the map too, is an error naming what to pass.
template <class Low>
void expect_out_as_returned_matches(const MethodInfo& m, bool causal) {
  SCOPED_TRACE(::testing::Message() << m.name << (causal ? " causal " : " ") << dtype_name<Low>());
  const RandomCall<Low> call(m, causal, 1, 2, 70, 8, 21);
  const MethodArgs<Low>& a = call.args;
  const Tensor<Low>& dout = call.dout;
  const MethodOutput<Low> f = m.functions<Low>().forward(a);
  const Tensor<float> out_wide = widen(f.out.view());
  SavedViews<Low> widened{{"out", out_wide.view()}}, as_returned;
  for (const auto& [name, t] : f.saved) widened[name] = as_returned[name] = t.view();
  as_returned.out_as_returned = f.out.view();
  const AttentionGrads<Low> want = m.functions<Low>().backward(a, dout, widened);
  const AttentionGrads<Low> got = m.functions<Low>().backward(a, dout, as_returned);
  auto same_bits = [](const Tensor<Low>& x, const Tensor<Low>& y, const std::string& what) {
    ASSERT_EQ(x.shape(), y.shape()) << what;
    for (int64_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i].bits, y[i].bits) << what << " [" << i << "]";
  };
  same_bits(got.dq, want.dq, "dq");
  same_bits(got.dk, want.dk, "dk");
  same_bits(got.dv, want.dv, "dv");
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) same_bits(got.params[i].second, want.params[i].second, got.params[i].first);
  if (f.saved.empty()) return;
  SavedViews<Low> partial = as_returned;
  partial.erase(f.saved.back().first);
  const std::string e = testing::error_of([&] { m.functions<Low>().backward(a, dout, partial); });
  EXPECT_NE(e.find("pass out"), std::string::npos) << e;
  SavedViews<Low> both = as_returned;
  both["out"] = out_wide.view();
  const std::string e2 = testing::error_of([&] { m.functions<Low>().backward(a, dout, both); });
  EXPECT_NE(e2.find("out was given twice"), std::string::npos) << e2;
}

TEST(LowPrecision, SavedOutAsReturnedGivesTheWidenedOutsBits) {
  for (const MethodInfo& m : methods())
    for (bool causal : {false, true}) {
      if (causal && !m.no_causal.empty()) continue;
      expect_out_as_returned_matches<bfloat16>(m, causal);
      expect_out_as_returned_matches<float16>(m, causal);
    }
}

// A gradient beyond float16's range is an error naming it, not inf: uniform attention over two
// keys sends half of each of 8 queries' dout (60000 each) to every key, dv = 240000.
TEST(LowPrecision, Float16OverflowIsAnError) {
  const MethodInfo& m = method("softmax");
  Tensor<float16> q({1, 1, 8, 4}), k({1, 1, 2, 4}), v({1, 1, 2, 4}), dout({1, 1, 8, 4});
  for (int64_t i = 0; i < dout.size(); ++i) dout[i] = to_float16(60000.0f);
  MethodArgs<float16> a;
  a.q = q, a.k = k, a.v = v;
  const std::string e = testing::error_of([&] { m.f16.backward(a, dout, {}); });
  EXPECT_NE(e.find("softmax_attention_backward: dv has a value"), std::string::npos) << e;
  EXPECT_NE(e.find("float16"), std::string::npos) << e;
  // bfloat16 has float32's range: the same call is fine.
  Tensor<bfloat16> qb({1, 1, 8, 4}), kb({1, 1, 2, 4}), vb({1, 1, 2, 4}), doutb({1, 1, 8, 4});
  for (int64_t i = 0; i < doutb.size(); ++i) doutb[i] = to_bfloat16(60000.0f);
  MethodArgs<bfloat16> b;
  b.q = qb, b.k = kb, b.v = vb;
  const AttentionGrads<bfloat16> g = m.bf16.backward(b, doutb, {});
  EXPECT_EQ(to_float(g.dv[0]), 4 * to_float(to_bfloat16(60000.0f)));  // 4 · 59904, exact
}

// Non-finite 16-bit inputs (inf and NaN, at a vector position and in the tail) are refused as
// float32 ones are.
template <class Low>
void expect_non_finite_refused() {
  for (const MethodInfo& m : methods())
    for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")})
      for (int64_t at : {int64_t{5}, int64_t{67}}) {
        Tensor<Low> q({1, 1, 17, 4}), k({1, 1, 17, 4}), v({1, 1, 17, 4});
        q[at] = from_float<Low>(bad);
        MethodArgs<Low> a;
        a.q = q, a.k = k, a.v = v;
        const auto extra = m.functions<Low>().example_tensors(1, 4, 17, 0, 1);
        for (const auto& [name, t] : extra) a.tensors[name] = t.view();
        EXPECT_THROW(m.functions<Low>().forward(a), Error) << m.name << " " << dtype_name<Low>() << " " << bad;
      }
}

TEST(LowPrecision, NonFiniteInputIsAnError) {
  expect_non_finite_refused<bfloat16>();
  expect_non_finite_refused<float16>();
}

// avx512_bf16::narrow_rows (vcvtneps2bf16) is the one-value to_bfloat16 (nearest even) on zeros and
// normal values of every binade of [2⁻¹²⁶, 2¹²⁸) and both signs, ties included; padding columns of
// the output (ld_out > cols) and columns past cols are not written.
TEST(LowPrecision, Avx512Bf16NarrowRowsRoundsToNearestEven) {
  if (!avx512_bf16::usable()) GTEST_SKIP() << "no AVX512-BF16 here: " << avx512_bf16::unavailable_reason();
  std::mt19937 rng(12);
  const int64_t rows = 5, cols = 48, ld = cols + 7, ld_out = cols + 16;
  std::vector<float> x(rows * ld);
  for (int64_t i = 0; i < rows * ld; ++i) {
    uint32_t bits = (static_cast<uint32_t>(1 + rng() % 254) << 23) | (rng() & 0x7FFFFFu) | (rng() % 2 ? 0x80000000u : 0);
    if (i % 11 == 0) bits = (bits & 0xFFFF0000u) | 0x8000u;  // a tie: the low 16 bits exactly half
    if (i % 13 == 0) bits = rng() % 2 ? 0u : 0x80000000u;    // ±0
    std::memcpy(&x[i], &bits, 4);
  }
  std::vector<bfloat16> out(rows * ld_out, bfloat16{0x1234});
  avx512_bf16::narrow_rows(x.data(), ld, rows, cols, out.data(), ld_out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < ld_out; ++c) {
      const uint16_t want = c < cols ? to_bfloat16(x[r * ld + c]).bits : uint16_t{0x1234};
      ASSERT_EQ(out[r * ld_out + c].bits, want) << "row " << r << " column " << c << " x = " << x[r * ld + std::min(c, cols - 1)];
    }
  EXPECT_THROW(avx512_bf16::narrow_rows(x.data(), ld, rows, 40, out.data(), ld_out), Error);
}

// avx512_bf16::dot against float64 sums of the same bfloat16 values, at odd sizes (row and
// column-block tails, a partial last chunk of 16 pairs), overwriting and accumulating, with B
// packed with gaps (strides larger than the data). Each pair is two fused multiply-adds, each
// rounded once (products of bfloat16 are exact in float32), so |c − ref| ≤ (2·pairs + 1)·u₃₂·
// (Σ|a·b| + |c₀|), u₃₂ = 2⁻²⁴, c₀ the value accumulated onto (0 when overwriting); normal
// N(0, 1) data has no subnormals.
TEST(LowPrecision, Avx512Bf16DotMatchesFloat64) {
  if (!avx512_bf16::usable()) GTEST_SKIP() << "no AVX512-BF16 here: " << avx512_bf16::unavailable_reason();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (const auto [rows, pairs, blocks] : {std::array<int64_t, 3>{1, 1, 1}, {7, 17, 5}, {13, 40, 9}, {6, 16, 4}}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows, " << pairs << " pairs, " << blocks << " column blocks");
    const int64_t lda = 2 * pairs + 4, ldc = 16 * blocks + 3;
    const int64_t chunks = (pairs + 15) / 16, column_stride = 512 + 64, chunk_stride = blocks * column_stride + 32;
    std::vector<bfloat16> a(rows * lda), b(chunks * chunk_stride + blocks * column_stride);
    for (auto& x : a) x = to_bfloat16(normal(rng));
    for (auto& x : b) x = to_bfloat16(normal(rng));
    // b[i][col]: pair p = i / 2 of column block col / 16 at the packed position.
    auto b_at = [&](int64_t i, int64_t col) {
      const int64_t p = i / 2;
      return to_float(b[(p / 16) * chunk_stride + (p % 16) * 32 + (col / 16) * column_stride + 2 * (col % 16) + i % 2]);
    };
    for (bool accumulate : {false, true}) {
      std::vector<float> c(rows * ldc);
      for (auto& x : c) x = normal(rng);
      const std::vector<float> c0 = c;
      avx512_bf16::dot(a.data(), lda, rows, {b.data(), column_stride, chunk_stride}, pairs, blocks, c.data(), ldc,
                       accumulate);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t col = 0; col < 16 * blocks; ++col) {
          double ref = accumulate ? c0[r * ldc + col] : 0.0, mag = std::abs(ref);
          for (int64_t i = 0; i < 2 * pairs; ++i) {
            const double t = static_cast<double>(to_float(a[r * lda + i])) * b_at(i, col);
            ref += t, mag += std::abs(t);
          }
          ASSERT_LE(std::abs(c[r * ldc + col] - ref), (2 * pairs + 1) * 0x1p-24 * mag) << "c[" << r << "][" << col << "]";
        }
      // Padding columns of c are left alone.
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t col = 16 * blocks; col < ldc; ++col) ASSERT_EQ(c[r * ldc + col], c0[r * ldc + col]);
    }
  }
}

// Random stored operands of C = op(A)·op(B) (M×K, K×N) for the matmul_bf16 tests: A stored
// M×K (K×M when ta), B K×N (N×K when tb), each row with 3 padding columns, C M×N with 5, all
// filled from rng (a, b, then c); A and B view a and b as the product reads them.
struct RandomProductOperands {
  RandomProductOperands(int64_t M, int64_t N, int64_t K, bool ta, bool tb, std::mt19937& rng)
      : lda((ta ? M : K) + 3), ldb((tb ? K : N) + 3), ldc(N + 5),
        a((ta ? K : M) * lda), b((tb ? N : K) * ldb), c(M * ldc) {
    std::normal_distribution<float> normal;
    for (auto& x : a) x = normal(rng);
    for (auto& x : b) x = normal(rng);
    for (auto& x : c) x = normal(rng);
    A = Mat<const float>{a.data(), ta ? K : M, ta ? M : K, lda, false};
    B = Mat<const float>{b.data(), tb ? N : K, tb ? K : N, ldb, false};
    if (ta) A = A.t();
    if (tb) B = B.t();
  }
  RandomProductOperands(const RandomProductOperands&) = delete;  // A and B point into a and b
  int64_t lda, ldb, ldc;
  std::vector<float> a, b, c;
  Mat<const float> A{}, B{};
};

// matmul_bf16 against float64 sums of the operands rounded to bfloat16 (to_bfloat16, nearest
// even): every product is exact in float32 and vdpbf16ps rounds twice per pair, so a sum of K
// terms is within γ_{K+1}·Σ|terms| (Higham §3.1; K + 1 for the pair's two roundings), then alpha
// and beta add one rounding each: (K + 3)·2⁻²⁴·(|alpha|·Σ|terms| + |beta·c|) (dot_columns'
// 16 lane sums and their reduction stay within K roundings per term). Every transpose, odd
// sizes across the 16-column and 32-row packing blocks, last blocks of 1, 3, 4, 5 and 16 columns
// (dot_columns takes up to 4), padded leading dimensions; C's padding is never written.
TEST(LowPrecision, Bfloat16ProductsMatchFloat64OnRoundedOperands) {
  if (!bfloat16_products_usable()) GTEST_SKIP() << "no AVX512-BF16 here: " << avx512_bf16::unavailable_reason();
  std::mt19937 rng(12);
  for (const auto [M, N, K] : {std::array<int64_t, 3>{1, 1, 1}, {7, 65, 33}, {13, 16, 64}, {33, 17, 1}, {6, 80, 70}, {40, 3, 129},
                                 {5, 36, 40}, {9, 21, 31}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (const auto [alpha, beta] : {std::array<float, 2>{1, 0}, {1, 1}, {0.375f, 0}, {-2, 0.5f}}) {
          SCOPED_TRACE(::testing::Message() << M << "x" << N << "x" << K << " ta=" << ta << " tb=" << tb << " alpha=" << alpha
                                            << " beta=" << beta);
          RandomProductOperands ops(M, N, K, ta, tb, rng);
          const auto& [lda, ldb, ldc, a, b, c0, A, B] = ops;
          std::vector<float> c = c0;
          matmul_bf16(Mat<float>{c.data(), M, N, ldc, false}, A, B, alpha, beta);
          auto a_at = [&](int64_t i, int64_t l) { return to_float(to_bfloat16(ta ? a[l * lda + i] : a[i * lda + l])); };
          auto b_at = [&](int64_t l, int64_t j) { return to_float(to_bfloat16(tb ? b[j * ldb + l] : b[l * ldb + j])); };
          for (int64_t i = 0; i < M; ++i) {
            for (int64_t j = 0; j < N; ++j) {
              double sum = 0, mag = 0;
              for (int64_t l = 0; l < K; ++l) {
                const double t = double(a_at(i, l)) * b_at(l, j);
                sum += t, mag += std::abs(t);
              }
              const double c_old = c0[i * ldc + j];
              const double want = alpha * sum + (beta == 0 ? 0.0 : beta * c_old);
              const double bound = double(K + 3) * 0x1p-24 * (std::abs(alpha) * mag + std::abs(beta * c_old)) + 1e-30;
              ASSERT_LE(std::abs(c[i * ldc + j] - want), bound) << "c[" << i << "][" << j << "]";
            }
            for (int64_t j = N; j < ldc; ++j) ASSERT_EQ(c[i * ldc + j], c0[i * ldc + j]) << "padding c[" << i << "][" << j << "]";
          }
        }
  // K = 0 leaves beta·C; beta = 0 does not read C (NaN there stays out of the result).
  std::vector<float> c = {std::nanf(""), 2.0f}, none(1);
  matmul_bf16(Mat<float>{c.data(), 1, 2, 2, false}, Mat<const float>{none.data(), 1, 0, 1, false},
              Mat<const float>{none.data(), 0, 2, 2, false}, 1.0f, 0.0f);
  EXPECT_EQ(c[0], 0.0f);
  EXPECT_EQ(c[1], 0.0f);
  // Shapes that do not agree are the caller's bug.
  EXPECT_THROW(matmul_bf16(Mat<float>{c.data(), 1, 2, 2, false}, Mat<const float>{none.data(), 1, 1, 1, false},
                           Mat<const float>{none.data(), 2, 2, 2, false}),
               std::logic_error);
}

// A B packed once (Bf16PackedB) gives the bits of matmul_bf16 packing it per call, over the
// shapes above (thin last blocks, odd K, transposes, every alpha and beta form), twice from the
// same packing (it is read, never changed); K = 0 leaves beta·C; shapes are checked.
TEST(LowPrecision, PackedBfloat16OperandGivesTheUnpackedBits) {
  if (!bfloat16_products_usable()) GTEST_SKIP() << "no AVX512-BF16 here: " << avx512_bf16::unavailable_reason();
  std::mt19937 rng(13);
  Bf16PackedB reused;  // packed again for each B, larger and smaller, with and without a thin tail
  for (const auto [M, N, K] : {std::array<int64_t, 3>{1, 1, 1}, {7, 65, 33}, {13, 16, 64}, {33, 17, 1}, {6, 80, 70}, {40, 3, 129},
                                 {5, 36, 40}, {9, 21, 31}, {32, 256, 64}, {32, 64, 256}, {3, 20, 2}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const RandomProductOperands ops(M, N, K, ta, tb, rng);
        const int64_t ldc = ops.ldc;
        const std::vector<float>& c = ops.c;
        const Mat<const float> A = ops.A, B = ops.B;
        const Bf16PackedB packed(B);
        ASSERT_EQ(packed.rows(), K);
        ASSERT_EQ(packed.cols(), N);
        reused.pack(B);
        for (const auto [alpha, beta] : {std::array<float, 2>{1, 0}, {1, 1}, {0.375f, 0}, {-2, 0.5f}})
          for (int round = 0; round < 2; ++round) {
            SCOPED_TRACE(::testing::Message() << M << "x" << N << "x" << K << " ta=" << ta << " tb=" << tb
                                              << " alpha=" << alpha << " beta=" << beta << " round " << round);
            std::vector<float> want = c, got = c, got_reused = c;
            matmul_bf16(Mat<float>{want.data(), M, N, ldc, false}, A, B, alpha, beta);
            matmul_bf16(Mat<float>{got.data(), M, N, ldc, false}, A, packed, alpha, beta);
            matmul_bf16(Mat<float>{got_reused.data(), M, N, ldc, false}, A, reused, alpha, beta);
            for (size_t i = 0; i < c.size(); ++i) {
              ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i])) << "c flat " << i;
              ASSERT_EQ(std::bit_cast<uint32_t>(got_reused[i]), std::bit_cast<uint32_t>(want[i])) << "reused, c flat " << i;
            }
          }
      }
  std::vector<float> c = {std::nanf(""), 2.0f}, none(1);
  const Bf16PackedB empty(Mat<const float>{none.data(), 0, 2, 2, false});
  matmul_bf16(Mat<float>{c.data(), 1, 2, 2, false}, Mat<const float>{none.data(), 1, 0, 1, false}, empty, 1.0f, 0.0f);
  EXPECT_EQ(c[0], 0.0f);
  EXPECT_EQ(c[1], 0.0f);
  c = {1.0f, 2.0f};
  matmul_bf16(Mat<float>{c.data(), 1, 2, 2, false}, Mat<const float>{none.data(), 1, 0, 1, false}, empty, 1.0f, 0.5f);
  EXPECT_EQ(c[0], 0.5f);
  EXPECT_EQ(c[1], 1.0f);
  std::vector<float> b4(4, 1.0f);
  const Bf16PackedB two_by_two(Mat<const float>{b4.data(), 2, 2, 2, false});
  EXPECT_THROW(matmul_bf16(Mat<float>{c.data(), 1, 2, 2, false}, Mat<const float>{none.data(), 1, 1, 1, false}, two_by_two),
               std::logic_error);
}

}  // namespace
}  // namespace linattn
