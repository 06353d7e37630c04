#include "harness.h"

#include <cpuid.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <malloc.h>
#include <sstream>
#include <thread>
#include <vector>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>

#include "linattn/core/avx512_bf16.h"
#include "linattn/core/blas.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/simd.h"
#include "linattn/linattn.h"

namespace linattn::bench {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A field of a /proc file in kB, in bytes (e.g. "VmHWM:" of /proc/self/status), or -1.
int64_t proc_field_bytes(const char* file, const std::string& key) {
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) {
      std::istringstream is(line.substr(key.size()));
      int64_t kb = -1;
      is >> kb;
      return kb < 0 ? -1 : kb * 1024;
    }
  return -1;
}
int64_t proc_status_bytes(const std::string& key) { return proc_field_bytes("/proc/self/status", key); }
int64_t proc_meminfo_bytes(const std::string& key) { return proc_field_bytes("/proc/meminfo", key); }

// Allocations of 1 MiB and more get pages of their own, returned on free; otherwise glibc
// raises its mmap threshold after the first free and serves big buffers from pages that are
// already resident, which the high-water mark cannot see. Set before main(): set at the first
// measurement, the timing runs before it had already left big free chunks in the arenas,
// which later calls were served from (the RSS column read 0 for most methods).
[[maybe_unused]] const bool kMmapThresholdPinned = mallopt(M_MMAP_THRESHOLD, 1 << 20) == 1;

bool reset_rss_high_water_mark() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace

Timing time_runs(const std::function<void()>& fn, int warmup, int min_runs, double min_seconds,
                 int max_runs) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  const auto start = std::chrono::steady_clock::now();
  while (static_cast<int>(times.size()) < max_runs &&
         (static_cast<int>(times.size()) < min_runs || seconds_since(start) < min_seconds)) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    times.push_back(seconds_since(t0));
  }
  std::sort(times.begin(), times.end());
  Timing t;
  t.runs = static_cast<int>(times.size());
  t.min_s = times.front();
  t.median_s = times.size() % 2 ? times[times.size() / 2]
                                : 0.5 * (times[times.size() / 2 - 1] + times[times.size() / 2]);
  return t;
}

double sgemm_gflops(int threads, int n) {
  // The rate our kernels can reach: the BLAS is single-threaded (see core/blas.h), so split the
  // product into row panels over `threads` of our workers, as the methods do.
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a), c(a.size());
  const int saved = num_threads();
  set_num_threads(threads);
  const int64_t panel = 64;
  const int64_t panels = (n + panel - 1) / panel;
  const Timing t = time_runs(
      [&] {
        parallel_for(panels, [&](int64_t p) {
          const int64_t r0 = p * panel, rows = std::min<int64_t>(panel, n - r0);
          matmul<float>(mat(c.data() + r0 * n, rows, n), mat(a.data() + r0 * n, rows, n),
                        mat(b.data(), n, n));
        });
      },
      2, 10, 2.0);
  set_num_threads(saved);
  // The best run: on a shared machine the rate varies run to run, and the fastest one is
  // the conservative denominator for "fraction of the GEMM rate".
  return 2.0 * n * n * static_cast<double>(n) / t.min_s * 1e-9;
}

std::string cpu_features() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  std::string out;
  auto add = [&](bool has, const char* name) {
    if (!has) return;
    if (!out.empty()) out += ' ';
    out += name;  // appended in two steps: GCC 12 warns falsely (-Wrestrict) on "" + std::string
  };
  if (__get_cpuid(1, &a, &b, &c, &d)) add(c & (1u << 12), "fma");
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    add(b & (1u << 5), "avx2");
    add(b & (1u << 16), "avx512f");
    add(c & (1u << 11), "avx512_vnni");
    add(d & (1u << 23), "avx512_fp16");
    add(d & (1u << 22), "amx_bf16");
    add(d & (1u << 24), "amx_tile");
  }
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) add(a & (1u << 5), "avx512_bf16");
  return out.empty() ? "none of avx2/avx512" : out;
}

PeakMemory measure_peak_memory(const std::function<void()>& fn) {
  // The blocks linattn keeps for reuse (memory.h) are resident already: give them back, so that
  // the call's own allocations show in the high-water mark.
  (void)release_cached_memory();
  // And so must glibc's arenas: freed chunks below 1 MiB coalesce there into free space that a
  // later big request is served from without a page fault (after linear attention's many
  // small buffers, the next rows read 0). malloc_trim gives every arena's free pages back.
  (void)malloc_trim(0);
  PeakMemory m;
  reset_workspace_peak();
  const int64_t ws_before = workspace_stats().current_bytes;
  const bool rss_ok = reset_rss_high_water_mark();
  const int64_t rss_before = proc_status_bytes("VmRSS:");
  fn();
  m.workspace_bytes = workspace_stats().peak_bytes - ws_before;
  if (rss_ok && rss_before >= 0) m.rss_growth_bytes = proc_status_bytes("VmHWM:") - rss_before;
  return m;
}

std::string machine_summary() {
  std::string cpu = "unknown CPU";
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  std::ostringstream os;
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  os << std::thread::hardware_concurrency() << " cores (" << cpu << "; " << cpu_features() << "), " << num_threads()
     << " linattn threads, " << build_info() << ", OPENBLAS_CORETYPE "
     << (coretype ? std::string("set to ") + coretype : std::string("unset"));
  return os.str();
}

std::string scripts_dir() {
  if (const char* env = std::getenv("LINATTN_BENCH_DIR")) return env;
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::runtime_error("cannot find the program's own path (/proc/self/exe): " + ec.message());
  return (exe.parent_path().parent_path() / "share" / "linattn" / "bench").string();
}

std::string python() {
  if (const char* env = std::getenv("LINATTN_PYTHON")) return env;
  return "python3";
}

void require_writable_dir(const std::string& flag, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error(flag + " " + dir + ": cannot create the folder (" + ec.message() + ")");
  const std::filesystem::path probe = std::filesystem::path(dir) / ".linattn-write-test";
  std::ofstream f(probe);
  if (!f) throw std::runtime_error(flag + " " + dir + ": cannot write there");
  f.close();
  std::filesystem::remove(probe, ec);
}

void require_memory(const std::string& what, double bytes) {
  const int64_t available = proc_meminfo_bytes("MemAvailable:");
  if (available > 0 && bytes > static_cast<double>(available))
    throw std::runtime_error(what + " needs " + human_bytes(static_cast<int64_t>(std::min(bytes, 9e18))) +
                             "; this machine has " + human_bytes(available) + " available");
}

std::string human_bytes(int64_t bytes) {
  if (bytes < 0) return "n/a";
  if (bytes >= (1 << 20)) return linattn::human_bytes(static_cast<double>(bytes));
  char buf[32];  // the tables keep KiB below 1 MiB ("0.0 KiB", not "0 B")
  std::snprintf(buf, sizeof buf, "%.1f KiB", bytes / 1024.0);
  return buf;
}

}  // namespace linattn::bench
