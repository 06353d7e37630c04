// Dense row-major tensors. Attention inputs are [batch, heads, seq, head_dim].
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "linattn/error.h"
#include "linattn/memory.h"

namespace linattn {

using Shape = std::vector<int64_t>;

struct bfloat16;  // low_precision.h
struct float16;

template <class T>
constexpr const char* dtype_name() {
  if constexpr (std::is_same_v<std::remove_const_t<T>, bfloat16>) return "bfloat16";
  else if constexpr (std::is_same_v<std::remove_const_t<T>, float16>) return "float16";
  else return sizeof(T) == 4 ? "float32" : "float64";
}

// "[2, 8, 1024, 64]".
inline std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The number of elements of a shape; Error for a negative dimension or a count beyond int64.
inline int64_t element_count(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0) throw Error("shape " + shape_string(shape) + " has a negative dimension");
    if (__builtin_mul_overflow(n, s, &n))
      throw Error("shape " + shape_string(shape) + " has more elements than fit in 64 bits");
  }
  return n;
}

// A non-owning view of contiguous row-major data. T may be const.
template <class T>
struct TensorView {
  T* data = nullptr;
  Shape shape;

  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  int64_t dim(int64_t i) const { return shape[static_cast<size_t>(i < 0 ? rank() + i : i)]; }
  int64_t size() const { return element_count(shape); }
  // Row `row` of a [B,H,N,D] view as (b*H + h)*N + n; returns a pointer to its D values.
  T* row(int64_t bh, int64_t n) const { return data + (bh * dim(2) + n) * dim(3); }
  operator TensorView<const T>() const { return {data, shape}; }
};

// An owning tensor (output memory: not counted as workspace). Zero-initialised by default.
template <class T>
class Tensor {
 public:
  Tensor() = default;
  // `workspace`: count this tensor as workspace (a temporary a kernel makes for itself).
  // init: Init::Uninitialized for outputs a kernel writes in full.
  explicit Tensor(Shape shape, bool workspace = false, Init init = Init::Zero)
      : shape_(std::move(shape)), buf_(element_count(shape_), workspace, init) {}

  const Shape& shape() const { return shape_; }
  int64_t rank() const { return static_cast<int64_t>(shape_.size()); }
  int64_t dim(int64_t i) const { return shape_[static_cast<size_t>(i < 0 ? rank() + i : i)]; }
  int64_t size() const { return buf_.size(); }
  T* data() { return buf_.data(); }
  const T* data() const { return buf_.data(); }
  T& operator[](int64_t i) { return buf_[i]; }
  const T& operator[](int64_t i) const { return buf_[i]; }

  TensorView<T> view() { return {data(), shape_}; }
  TensorView<const T> view() const { return {data(), shape_}; }
  operator TensorView<const T>() const { return view(); }

 private:
  Shape shape_;
  Buffer<T> buf_;
};

}  // namespace linattn
