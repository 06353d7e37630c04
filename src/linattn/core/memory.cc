#include "linattn/core/memory.h"

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
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (!p) throw std::bad_alloc();
  return p;
}

void aligned_free(void* p) noexcept { std::free(p); }

WorkspaceStats workspace_stats() { return {g_current.load(), g_peak.load()}; }

void reset_workspace_peak() { g_peak.store(g_current.load()); }

namespace detail {
void workspace_add(int64_t bytes) {
  const int64_t now = g_current.fetch_add(bytes) + bytes;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}
}  // namespace detail

}  // namespace linattn
