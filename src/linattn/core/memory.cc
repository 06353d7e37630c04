#include "linattn/memory.h"

#include <string>

#include "linattn/core/error.h"

#include <sys/mman.h>
#if defined(__SANITIZE_ADDRESS__)  // GCC's name, and clang's below
#define LINATTN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LINATTN_ASAN 1
#endif
#endif
#ifdef LINATTN_ASAN
#include <sanitizer/asan_interface.h>
#endif

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

namespace linattn {
namespace {
std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};

// Freed blocks of 1 MiB and more are kept for the next allocations of about their size instead
// of going back to the OS: a fresh large block costs a page fault and the kernel's zeroing per
// page on first touch, which was a fifth of exact attention's forward at n = 1024 (the same
// calls with the blocks reused: 5.7 against 7.2 ms). At most kCachedBlocks blocks and
// kCachedBytes in all are kept; release_cached_memory() gives them back. Under AddressSanitizer
// a kept block is poisoned until it is handed out again, so a use after free is reported (as
// use-after-poison) while the block stays in the cache, and the sanitizer tests run the cache
// as the release build does. (Once handed out again, a stale pointer reads live data
// unreported, where ASan's own quarantine would have kept the memory poisoned longer.)
constexpr size_t kCachedMin = size_t{1} << 20, kCachedBytes = size_t{256} << 20;
constexpr size_t kCachedBlocks = 64;

#ifdef LINATTN_ASAN
void poison(void* p, size_t bytes) { ASAN_POISON_MEMORY_REGION(p, bytes); }
void unpoison(void* p, size_t bytes) { ASAN_UNPOISON_MEMORY_REGION(p, bytes); }
#else
void poison(void*, size_t) {}
void unpoison(void*, size_t) {}
#endif

struct BlockCache {
  std::mutex mutex;
  std::unordered_map<void*, size_t> capacity;  // every live or cached block of kCachedMin and more
  std::vector<std::pair<void*, size_t>> free;  // cached blocks, oldest first
  size_t free_bytes = 0;
  BlockCache() { free.reserve(kCachedBlocks); }
};
BlockCache& cache() {
  static BlockCache* c = new BlockCache;  // never destroyed: frees may come from static destructors
  return *c;
}

// Buffers of 8 MiB and more (outputs, gradients) in 2 MiB pages where the kernel offers them on
// request (transparent_hugepage=madvise): first touch then faults once per 2 MiB instead of once
// per 4 KiB, which was a tenth of a kernelized backward's time. Cached sizes are rounded up to
// 64 KiB, so that a block fits the next call's slightly different sizes.
void* allocate(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t align = bytes >= 4 * kHuge ? kHuge : kAlignment;
  const size_t granule = bytes >= 4 * kHuge ? kHuge : bytes >= kCachedMin ? size_t{64} << 10 : kAlignment;
  const size_t rounded = (bytes + granule - 1) / granule * granule;
  if (rounded < bytes) return nullptr;
  const bool cached = rounded >= kCachedMin;
  if (cached) {
    BlockCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    // The smallest cached block that holds `rounded` with the alignment asked for, without
    // leaving more than half of it unused.
    auto best = c.free.end();
    for (auto it = c.free.begin(); it != c.free.end(); ++it)
      if (it->second >= rounded && it->second <= 2 * rounded && reinterpret_cast<uintptr_t>(it->first) % align == 0 &&
          (best == c.free.end() || it->second < best->second))
        best = it;
    if (best != c.free.end()) {
      void* p = best->first;
      c.free_bytes -= best->second;
      c.free.erase(best);
      unpoison(p, rounded);  // as a fresh block of this request (up to twice as large) would be
      return p;
    }
  }
  void* p = std::aligned_alloc(align, rounded);
  if (p && align == kHuge) (void)madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure is harmless
  if (p && cached) {
    BlockCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    try {
      c.capacity.insert_or_assign(p, rounded);
    } catch (...) {  // no room to record it: hand it back, the caller reports out of memory
      std::free(p);
      return nullptr;
    }
  }
  return p;
}
}  // namespace

void* aligned_alloc_bytes(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = allocate(bytes);
  if (!p && release_cached_memory() > 0) p = allocate(bytes);  // the cache may hold what it needs
  if (!p) throw OutOfMemory("linattn: cannot allocate " + human_bytes(static_cast<double>(bytes)) + " (out of memory)");
  return p;
}

void aligned_free(void* p) noexcept {
  if (!p) return;
  BlockCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const auto it = c.capacity.find(p);
  if (it != c.capacity.end()) {
    for (const auto& kept : c.free)
      if (kept.first == p) {  // freed twice: a bug of the caller; handing it out twice would be worse
        std::fputs("linattn: a buffer was freed twice\n", stderr);
        std::abort();
      }
    const size_t size = it->second;
    if (size <= kCachedBytes) {
      // The oldest blocks go back to the OS until this one fits the limits.
      while (!c.free.empty() && (c.free.size() >= kCachedBlocks || c.free_bytes + size > kCachedBytes)) {
        c.free_bytes -= c.free.front().second;
        c.capacity.erase(c.free.front().first);
        unpoison(c.free.front().first, c.free.front().second);
        std::free(c.free.front().first);
        c.free.erase(c.free.begin());
      }
      if (c.free.capacity() > c.free.size()) {  // reserved below: no allocation while freeing
        poison(p, size);
        c.free.emplace_back(p, size);
        c.free_bytes += size;
        return;
      }
    }
    c.capacity.erase(it);
  }
  std::free(p);
}

size_t release_cached_memory() noexcept {
  BlockCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const size_t released = c.free_bytes;
  for (const auto& [p, size] : c.free) {
    c.capacity.erase(p);
    unpoison(p, size);
    std::free(p);
  }
  c.free.clear();
  c.free_bytes = 0;
  return released;
}

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
