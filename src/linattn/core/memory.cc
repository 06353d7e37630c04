#include "linattn/memory.h"

#include <string>

#include "linattn/core/error.h"

#include <sys/mman.h>

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
  // Buffers of 8 MiB and more (outputs, gradients) in 2 MiB pages where the kernel offers them
  // on request (transparent_hugepage=madvise): first touch then faults once per 2 MiB instead
  // of once per 4 KiB, which was a tenth of a kernelized backward's time.
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t align = bytes >= 4 * kHuge ? kHuge : kAlignment;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = rounded < bytes ? nullptr : std::aligned_alloc(align, rounded);
  if (p && align == kHuge) (void)madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure is harmless
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
