#include "linattn/low_precision.h"

#include <cmath>
#include <string>

#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/simd.h"

namespace linattn {
namespace {

// Conversions are memory-bound: blocks of 64k values (256 KiB of float) split across workers.
constexpr int64_t kBlock = int64_t{1} << 16;

template <class Fn>
void by_blocks(int64_t n, const Fn& fn) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (blocks <= 1) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  parallel_for(blocks, [&](int64_t b) { fn(b * kBlock, std::min(n, (b + 1) * kBlock)); });
}

}  // namespace

template <class T>
Tensor<float> widen(TensorView<const T> x) {
  Tensor<float> out(x.shape, /*workspace=*/false, Init::Uninitialized);
  by_blocks(out.size(), [&](int64_t begin, int64_t end) {
    simd::widen(x.data + begin, out.data() + begin, static_cast<size_t>(end - begin));
  });
  return out;
}

template <class T>
Tensor<T> narrow(const Tensor<float>& x, const char* what) {
  // Rounding is monotonic: some value overflows iff the largest magnitude does.
  const float largest = simd::finite_max_abs(x.data(), static_cast<size_t>(x.size()));
  if (std::isfinite(largest) && !std::isfinite(to_float(from_float<T>(largest)))) {
    throw Error(what + std::string(" has a value of magnitude ") + std::to_string(largest) +
                ", which rounds to infinity in " + dtype_name<T>() + "; compute in float32 instead");
  }
  Tensor<T> out(x.shape(), /*workspace=*/false, Init::Uninitialized);
  by_blocks(x.size(), [&](int64_t begin, int64_t end) {
    simd::narrow(x.data() + begin, out.data() + begin, static_cast<size_t>(end - begin));
  });
  return out;
}

template Tensor<float> widen(TensorView<const bfloat16>);
template Tensor<float> widen(TensorView<const float16>);
template Tensor<bfloat16> narrow(const Tensor<float>&, const char*);
template Tensor<float16> narrow(const Tensor<float>&, const char*);

}  // namespace linattn
