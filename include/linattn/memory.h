// Aligned buffers. Workspace (scratch a kernel allocates beyond its inputs and outputs) is
// counted, so tests and benchmarks can check that extra memory grows as O(n·d), not O(n²).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

namespace linattn {

inline constexpr size_t kAlignment = 64;  // one cache line, and one AVX-512 vector

void* aligned_alloc_bytes(size_t bytes);  // throws OutOfMemory; nullptr for 0 bytes
void aligned_free(void* p) noexcept;
// Freed blocks of 1 MiB and more stay with the library (at most 64 blocks, 256 MiB in all) for
// the next calls, which then skip the OS's page faults and zeroing of fresh pages; this gives
// them back to the OS and returns their bytes. An allocation that fails releases them and tries
// again. (Under AddressSanitizer kept blocks are poisoned until handed out again.)
size_t release_cached_memory() noexcept;

// Workspace accounting (process-wide, thread-safe).
struct WorkspaceStats {
  int64_t current_bytes;
  int64_t peak_bytes;
};
WorkspaceStats workspace_stats();
void reset_workspace_peak();  // peak := current

namespace detail {
void workspace_add(int64_t bytes);
// count·elem_bytes, or OutOfMemory when that is negative or overflows.
size_t checked_bytes(int64_t count, size_t elem_bytes);
struct AlignedDeleter {
  void operator()(void* p) const noexcept { aligned_free(p); }
};
}  // namespace detail

enum class Init { Zero, Uninitialized };

// An owning, 64-byte-aligned array of T, zero-initialised unless the caller writes every
// element before reading it (Init::Uninitialized). `counted` buffers are workspace.
template <class T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(int64_t count, bool counted = true, Init init = Init::Zero)
      : data_(static_cast<T*>(aligned_alloc_bytes(detail::checked_bytes(count, sizeof(T))))),
        size_(count),
        counted_(counted) {
    if (count > 0 && init == Init::Zero) std::memset(data_.get(), 0, sizeof(T) * static_cast<size_t>(count));
    if (counted_) detail::workspace_add(bytes());
  }
  Buffer(Buffer&& o) noexcept
      : data_(std::move(o.data_)), size_(o.size_), counted_(o.counted_) {
    o.size_ = 0;
  }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::move(o.data_);
      size_ = o.size_;
      counted_ = o.counted_;
      o.size_ = 0;
    }
    return *this;
  }
  ~Buffer() { release(); }

  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  int64_t size() const { return size_; }
  T& operator[](int64_t i) { return data_.get()[i]; }
  const T& operator[](int64_t i) const { return data_.get()[i]; }

 private:
  int64_t bytes() const { return static_cast<int64_t>(sizeof(T)) * size_; }
  void release() {
    if (counted_ && size_ > 0) detail::workspace_add(-bytes());
    data_.reset();
    size_ = 0;
  }
  std::unique_ptr<T, detail::AlignedDeleter> data_;
  int64_t size_ = 0;
  bool counted_ = true;
};

}  // namespace linattn
