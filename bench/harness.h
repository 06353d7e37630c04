// Measuring tools shared by `linattn demo` and `linattn bench`: medians after warm-up, the
// BLAS's own GEMM rate on this machine, and peak memory.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace linattn::bench {

struct Timing {
  double median_s = 0;
  double min_s = 0;
  int runs = 0;
};

// Runs fn `warmup` times untimed, then at least `min_runs` times and until `min_seconds`
// have passed (at most max_runs); returns the median and minimum of the timed runs.
Timing time_runs(const std::function<void()>& fn, int warmup = 1, int min_runs = 3,
                 double min_seconds = 0.5, int max_runs = 50);

// The float32 GEMM rate of the BLAS we link: the best of >= 10 runs of an n×n×n sgemm with
// the BLAS using `threads` threads, in GFLOP/s (2·n³ FLOPs per product).
double sgemm_gflops(int threads, int n = 2048);
// The CPU's vector features that decide linattn's and the BLAS's paths: "avx2 fma avx512f
// avx512_bf16 amx_bf16 ...", from cpuid.
std::string cpu_features();

// Peak memory while fn runs: the workspace counter of the library (exact bytes of scratch
// beyond inputs and outputs) and the growth of the process's resident high-water mark
// (everything, outputs included; -1 where the kernel does not let us reset it).
struct PeakMemory {
  int64_t workspace_bytes = 0;
  int64_t rss_growth_bytes = -1;
};
PeakMemory measure_peak_memory(const std::function<void()>& fn);

std::string machine_summary();  // cores, CPU model, BLAS, SIMD target
std::string human_bytes(int64_t bytes);

// Where the benchmarks' Python helpers (torch_bench.py, plot_bench.py, plot_accuracy.py) are:
// share/linattn/bench beside the program's own folder (the build tree and an installation lay
// them out alike). LINATTN_BENCH_DIR overrides.
std::string scripts_dir();
// The Python interpreter for them: LINATTN_PYTHON if set, else python3 from PATH.
std::string python();

// Makes `dir` (and its parents) and checks a file can be written there; throws
// std::runtime_error with a one-line reason naming `flag` otherwise.
void require_writable_dir(const std::string& flag, const std::string& dir);
// Throws std::runtime_error naming `what` when `bytes` exceed the memory this machine has
// available now (MemAvailable), so a run that cannot fit ends with a message, not the OOM killer.
void require_memory(const std::string& what, double bytes);

}  // namespace linattn::bench
