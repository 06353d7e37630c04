#include "linattn/memory.h"

#include <string>

#include "linattn/core/error.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace linattn {
namespace {
std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
}  // namespace

void* aligned_alloc_bytes(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = rounded < bytes ? nullptr : std::aligned_alloc(kAlignment, rounded);
  if (!p) throw OutOfMemory("linattn: cannot allocate " + human_bytes(static_cast<double>(bytes)) + " (out of memory)");
  return p;
}

void aligned_free(void* p) noexcept { std::free(p); }

WorkspaceStats workspace_stats() { return {g_current.load(), g_peak.load()}; }

void reset_workspace_peak() { g_peak.store(g_current.load()); }

namespace detail {
size_t checked_bytes(int64_t count, size_t elem_bytes) {
  size_t bytes = 0;
  if (count < 0 || __builtin_mul_overflow(static_cast<size_t>(count), elem_bytes, &bytes))
    throw OutOfMemory("linattn: cannot allocate " + std::to_string(count) + " values of " +
                      std::to_string(elem_bytes) + " bytes (the size overflows)");
  return bytes;
}

void workspace_add(int64_t bytes) {
  const int64_t now = g_current.fetch_add(bytes) + bytes;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}
}  // namespace detail

}  // namespace linattn
