// Highway kernels behind tile_matmul.h; foreach_target compiles this file once per instruction
// set and HWY_DYNAMIC_DISPATCH picks the best the CPU has.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "linattn/core/tile_matmul.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"
#include "linattn/core/tile_matmul.h"

HWY_BEFORE_NAMESPACE();
namespace linattn {
namespace tile_matmul {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Vectors of at most 16 floats (CappedTag), so that a strip of whole vectors always ends on the
// 16-column boundaries multiply() requires, whatever the target's width.
// The register block: kRows rows × kVectors vectors of c in accumulators, plus kVectors vectors
// of B and one broadcast of A. AVX-512 has 32 vector registers: 6 × 4 = 24 accumulators (64
// columns), 4 loads of B and 6 broadcasts per 24 FMAs. The other x86 targets have 16: 6 × 2.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kVectors = 4;
#else
constexpr int kVectors = 2;
#endif
constexpr int kRows = kBlockRows;

template <int R, int V>
HWY_INLINE void Block(const float* HWY_RESTRICT a, size_t lda, const float* HWY_RESTRICT b, size_t ldb,
                      size_t inner, float* HWY_RESTRICT c, size_t ldc, bool accumulate) {
  const hn::CappedTag<float, 16> d;
  const size_t N = hn::Lanes(d);
  // The unroll pragmas keep acc and bv in registers at any optimisation level (at -O2 GCC left
  // the loops rolled and acc in memory: 27% of the FMA peak against 93–98% unrolled).
  hn::Vec<decltype(d)> acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) acc[r][j] = accumulate ? hn::LoadU(d, c + r * ldc + j * N) : hn::Zero(d);
  for (size_t p = 0; p < inner; ++p) {
    const float* bp = b + p * ldb;
    hn::Vec<decltype(d)> bv[V];
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) bv[j] = hn::LoadU(d, bp + j * N);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const auto av = hn::Set(d, a[r * lda + p]);
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) acc[r][j] = hn::MulAdd(av, bv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) hn::StoreU(acc[r][j], d, c + r * ldc + j * N);
}

using BlockFn = void (*)(const float*, size_t, const float*, size_t, size_t, float*, size_t, bool);

template <int R>
BlockFn BlockFor(size_t vectors) {
  if constexpr (kVectors == 4) {
    switch (vectors) {
      case 1: return Block<R, 1>;
      case 2: return Block<R, 2>;
      case 3: return Block<R, 3>;
      default: return Block<R, 4>;
    }
  } else {
    return vectors == 1 ? Block<R, 1> : Block<R, 2>;
  }
}

BlockFn BlockFor(size_t rows, size_t vectors) {
  switch (rows) {
    case 1: return BlockFor<1>(vectors);
    case 2: return BlockFor<2>(vectors);
    case 3: return BlockFor<3>(vectors);
    case 4: return BlockFor<4>(vectors);
    case 5: return BlockFor<5>(vectors);
    default: return BlockFor<6>(vectors);
  }
}

// Column strips outside, row blocks inside: one strip of B (inner × kVectors·N) is read from
// memory once and from L1 by the other row blocks (16 KiB at inner = 64 on AVX-512).
void Multiply(const float* a, size_t lda, size_t rows, const float* b, size_t ldb, size_t inner, size_t cols,
              float* c, size_t ldc, bool accumulate) {
  const size_t N = hn::Lanes(hn::CappedTag<float, 16>());
  const size_t strip = kVectors * N;
  for (size_t j = 0; j < cols; j += strip) {
    const size_t vectors = std::min(strip, cols - j) / N;  // cols is a multiple of 16, so of N
    const BlockFn full = BlockFor(kRows, vectors);
    size_t r = 0;
    for (; r + kRows <= rows; r += kRows) full(a + r * lda, lda, b + j, ldb, inner, c + r * ldc + j, ldc, accumulate);
    if (r < rows) BlockFor(rows - r, vectors)(a + r * lda, lda, b + j, ldb, inner, c + r * ldc + j, ldc, accumulate);
  }
}

int64_t CurrentTarget() { return HWY_TARGET; }
int64_t BlockColumns() { return static_cast<int64_t>(kVectors * hn::Lanes(hn::CappedTag<float, 16>())); }

}  // namespace HWY_NAMESPACE
}  // namespace tile_matmul
}  // namespace linattn
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "linattn/core/error.h"

namespace linattn {
namespace tile_matmul {
HWY_EXPORT(Multiply);
HWY_EXPORT(CurrentTarget);
HWY_EXPORT(BlockColumns);

void multiply(const float* a, int64_t lda, int64_t rows, const float* b, int64_t ldb, int64_t inner, int64_t cols,
              float* c, int64_t ldc, bool accumulate) {
  require(cols >= 0 && cols % 16 == 0, "tile_matmul::multiply: cols must be a multiple of 16, got ", cols);
  require(rows >= 0 && inner >= 0, "tile_matmul::multiply: rows and inner must be >= 0, got ", rows, " and ", inner);
  require(lda >= inner && ldb >= cols && ldc >= cols,
          "tile_matmul::multiply: each leading dimension must hold its row (lda ", lda, " >= ", inner, ", ldb ", ldb,
          " >= ", cols, ", ldc ", ldc, " >= ", cols, ")");
  HWY_DYNAMIC_DISPATCH(Multiply)(a, static_cast<size_t>(lda), static_cast<size_t>(rows), b, static_cast<size_t>(ldb),
                                 static_cast<size_t>(inner), static_cast<size_t>(cols), c, static_cast<size_t>(ldc),
                                 accumulate);
}

const char* target_name() { return hwy::TargetName(HWY_DYNAMIC_DISPATCH(CurrentTarget)()); }
int64_t block_rows() { return kBlockRows; }
int64_t block_columns() { return HWY_DYNAMIC_DISPATCH(BlockColumns)(); }

}  // namespace tile_matmul
}  // namespace linattn
#endif  // HWY_ONCE
