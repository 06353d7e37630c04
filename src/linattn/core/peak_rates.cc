// The measured arithmetic peaks that benchmarks report "% of peak" against (linattn.h).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "linattn/core/avx512_bf16.h"
#include "linattn/core/error.h"
#include "linattn/core/simd.h"
#include "linattn/linattn.h"

namespace linattn {
namespace {

// A register-only loop's rate on `threads` threads: one thread's iteration count calibrated to
// ~0.2 s, then run on `threads` threads of its own at once (not the library's pool, whose thread
// count other callers may be using meanwhile); the best of 3 runs, in GFLOP/s (on a shared
// machine the fastest run is the one least disturbed).
double loop_peak_gflops(int threads, float (*loop)(int64_t iterations, float seed), double flops_per_iteration) {
  int64_t iterations = 1 << 20;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile float sink = loop(iterations, 1.0f);
    (void)sink;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0.05 || iterations > (int64_t{1} << 34)) {
      iterations = static_cast<int64_t>(static_cast<double>(iterations) * 0.2 / std::max(s, 1e-6));
      break;
    }
    iterations *= 4;
  }
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    std::vector<std::thread> pool;
    pool.reserve(static_cast<size_t>(threads));
    const auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        volatile float sink = loop(iterations, 1.0f + static_cast<float>(t));
        (void)sink;
      });
    for (std::thread& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(threads) * static_cast<double>(iterations) * flops_per_iteration / s * 1e-9);
  }
  return best;
}

}  // namespace

PeakRates measure_peak_rates(int threads) {
  require(threads >= 1 && threads <= kMaxThreads, "measure_peak_rates: threads must be in [1, ", kMaxThreads,
          "], got ", threads);
  PeakRates r;
  r.float32_fma_gflops = loop_peak_gflops(
      threads, [](int64_t iterations, float seed) { return simd::fma_loop(static_cast<size_t>(iterations), seed); },
      static_cast<double>(simd::fma_loop_flops_per_iteration()));
  if (avx512_bf16::usable())
    r.bfloat16_dot_gflops = loop_peak_gflops(threads, avx512_bf16::dot_loop,
                                             static_cast<double>(avx512_bf16::dot_loop_flops_per_iteration()));
  return r;
}

}  // namespace linattn
