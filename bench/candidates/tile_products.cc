// The float32 products of exact attention's forward tiles on each candidate library, one
// thread, side by side (docs/design.md, "Own float32 kernels, by measurement"): what chose linattn's own
// kernels (src/linattn/core/tile_matmul.h) over OpenBLAS, BLIS, libxsmm and oneDNN.
// Built and run by bench/candidates/run.sh, not by the project's build: the three extra
// libraries are installed only for this comparison.
//
// Per task of 48 queries and 256 keys (forward_f32.cc's kRows and kKeys), head_dim 64:
//   S = Q·Kᵀ   M = 48, N = 256, K = 64   (Kᵀ given as one row-major 64 × 256 block; the forward
//                                         packs it in 64-key panels, four of which make this block)
//   O += P·V   M = 48, N = 64,  K = 256  (V row-major 256 × 64, as the caller holds it)
// Every library gets the same row-major operands; times are medians of 31 runs of 2000 calls.
#include <blis.h>
#include <libxsmm.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "linattn/core/simd.h"
#include "linattn/core/tile_matmul.h"

extern "C" void scipy_cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                                  const float* b, int ldb, float beta, float* c, int ldc);
extern "C" void scipy_openblas_set_num_threads(int);
extern "C" char* scipy_openblas_get_corename();

namespace {

double median_seconds(const std::function<void()>& call) {
  std::vector<double> t;
  for (int rep = 0; rep < 31; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 2000; ++i) call();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 2000);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main() {
  scipy_openblas_set_num_threads(1);
  bli_thread_set_num_threads(1);
  libxsmm_init();
  const double peak_s = [] {
    const size_t it = 20000000;
    const auto t0 = std::chrono::steady_clock::now();
    volatile float sink = linattn::simd::fma_loop(it, 1.0f);
    (void)sink;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
           (double(it) * double(linattn::simd::fma_loop_flops_per_iteration()));
  }();
  std::printf("one thread; FMA peak %.1f GFLOP/s (%s); OpenBLAS core %s; linattn kernels %s\n", 1e-9 / peak_s,
              linattn::simd::target_name(), scipy_openblas_get_corename(), linattn::tile_matmul::target_name());
  std::printf("%-28s %13s %10s %8s\n", "product", "library", "GFLOP/s", "% peak");

  struct Shape {
    const char* name;
    int M, N, K;
    float beta;
  };
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (const Shape s : {Shape{"S = Q·Kt (48x256x64)", 48, 256, 64, 0.0f}, Shape{"O += P·V (48x64x256)", 48, 64, 256, 1.0f}}) {
    std::vector<float> a(size_t(s.M) * s.K), b(size_t(s.K) * s.N), c(size_t(s.M) * s.N);
    for (auto* x : {&a, &b, &c})
      for (float& v : *x) v = normal(rng) * 0.01f;
    const double flops = 2.0 * s.M * s.N * s.K;
    auto report = [&](const char* lib, double seconds) {
      std::printf("%-28s %13s %10.1f %7.0f%%\n", s.name, lib, flops / seconds * 1e-9, 100 * peak_s * flops / seconds);
    };
    report("linattn", median_seconds([&] {
             linattn::tile_matmul::multiply(a.data(), s.K, s.M, b.data(), s.N, s.K, s.N, c.data(), s.N, s.beta != 0);
           }));
    // The kernels an AVX2-only machine runs, held to AVX2 here (against OpenBLAS's Haswell core,
    // the AVX2 kernels it picks there).
    if (hwy::SupportedTargets() & HWY_AVX2) {
      hwy::SetSupportedTargetsForTest(HWY_AVX2);
      report("linattn AVX2", median_seconds([&] {
               linattn::tile_matmul::multiply(a.data(), s.K, s.M, b.data(), s.N, s.K, s.N, c.data(), s.N, s.beta != 0);
             }));
      hwy::SetSupportedTargetsForTest(0);
    }
    report("OpenBLAS", median_seconds([&] {
             scipy_cblas_sgemm(101, 111, 111, s.M, s.N, s.K, 1.0f, a.data(), s.K, b.data(), s.N, s.beta, c.data(), s.N);
           }));
    float one = 1.0f, beta = s.beta;
    report("BLIS", median_seconds([&] {
             bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, s.M, s.N, s.K, &one, a.data(), s.K, 1, b.data(), s.N, 1,
                       &beta, c.data(), s.N, 1);
           }));
    // Column-major: C (M×N row-major) is Cᵀ (N×M column-major) = Bᵀ·Aᵀ.
    const libxsmm_blasint m = s.N, n = s.M, k = s.K, lda = s.N, ldb = s.K, ldc = s.N;
    const libxsmm_smmfunction kernel = libxsmm_smmdispatch(m, n, k, &lda, &ldb, &ldc, &one, &beta, nullptr, nullptr);
    if (kernel) report("libxsmm", median_seconds([&] { kernel(b.data(), a.data(), c.data()); }));
    else std::printf("%-28s %13s %10s\n", s.name, "libxsmm", "no kernel");
    report("oneDNN", median_seconds([&] {
             dnnl_sgemm('N', 'N', s.M, s.N, s.K, 1.0f, a.data(), s.K, b.data(), s.N, s.beta, c.data(), s.N);
           }));
  }
  libxsmm_finalize();
}
