// AVX512-BF16 (vdpbf16ps): bfloat16 pair products summed into float32 lanes, on CPUs that have
// it without AMX (AMD Zen 4 and later, Intel Cooper Lake). Own code because Debian's Highway
// 1.0.3 has no vdpbf16ps: its ReorderWidenMulAccumulate for bfloat16 widens and uses FMA.
//
// The kernel is compiled with a function-level target attribute, so no other code in the
// library is compiled for AVX-512; it is only reached after usable() said yes.
#pragma once

#include <cstdint>
#include <string>

#include "linattn/low_precision.h"

namespace linattn::avx512_bf16 {

// CPUID reports AVX512F, AVX512BW, AVX512VL and AVX512_BF16, and the OS saves the zmm state
// (XCR0 bits 1, 2, 5, 6, 7). Asked once.
bool usable();
// Why not, in words ("" when usable): for build_info() and the benchmarks' header.
const std::string& unavailable_reason();

// One zmm of B: 16 columns × one pair of inner indices, as (b[2p][c], b[2p+1][c]) for c = 0..15
// (the VNNI layout, also AMX's B-tile row). Pair p of column block j lies at
//   b + (p / 16)·chunk_stride + (p % 16)·32 + j·column_stride     (bfloat16 elements),
// that is, 16 pairs (one 16×32 AMX tile) per chunk.
struct PackedB {
  const bfloat16* data;
  int64_t column_stride, chunk_stride;
};

// c[r][0 : 16·column_blocks) (+)= Σ_{i < 2·pairs} a[r][i]·b[i][·] for r < rows, float32 sums,
// a row-major with lda elements per row (read as pairs: 2·pairs readable elements per row).
// accumulate = false overwrites c. The last column block reads and writes only its first
// last_block_columns columns of c. Each pair is summed as vdpbf16ps sums it: two fused
// multiply-adds into the lane (odd element first), each rounded to nearest even, products of
// bfloat16 exact in float32; subnormal inputs read as zero and subnormal results flushed.
void dot(const bfloat16* a, int64_t lda, int64_t rows, PackedB b, int64_t pairs, int64_t column_blocks,
         float* c, int64_t ldc, bool accumulate, int64_t last_block_columns = 16);

// c[r][j] (+)= Σ_{i < 2·pairs} a[r][i]·b_j[i] for r < rows, j < columns, each b_j given as its
// own run of 2·pairs bfloat16 (column j's pairs in order, ldb elements apart). One vdpbf16ps
// covers 16 pairs of one row here, where dot()'s 16-column blocks would spend 16 lanes on each
// column: for a last block of one to four columns (the [num | den] products' d_v + 1). Each of
// the 16 lanes sums its pairs as dot() does; the lanes are then added in a tree of ordinary
// float32 additions (so the order differs from dot()'s, and a subnormal total is not flushed).
void dot_columns(const bfloat16* a, int64_t lda, int64_t rows, const bfloat16* b, int64_t ldb, int64_t pairs,
                 int64_t columns, float* c, int64_t ldc, bool accumulate);

// The rows of x [rows × 16·column_blocks] float32 (ld floats per row), rounded to bfloat16
// (nearest even), as B of a product over rows: pair p = rows (2p, 2p+1), zero past `rows`, at
//   out + (p / 16)·column_blocks·512 + (column block)·512 + (p % 16)·32,
// that is PackedB{out, 512, column_blocks·512}, for p < pairs. vcvtne2ps2bf16 flushes subnormal
// results to zero (|x| < 2⁻¹²⁶).
void pack_pairs(const float* x, int64_t ld, int64_t rows, int64_t column_blocks, int64_t pairs, bfloat16* out);

// out[r][0 : cols) = bfloat16(x[r][0 : cols)) for r < rows (vcvtneps2bf16: nearest even; subnormal
// inputs and results flush to zero, so callers pass values that are 0 or normal, like the
// attention probabilities, which simd's exp makes 0 below 2⁻¹²⁶). cols a multiple of 16.
void narrow_rows(const float* x, int64_t ld, int64_t rows, int64_t cols, bfloat16* out, int64_t ld_out);

// Any float32 operand of a product, rounded to bfloat16 (nearest even; subnormal results flush
// to zero): op(x) [rows × cols] is x itself (rows × cols, ld floats per row) or, transposed, the
// transpose of x (cols × rows, ld per row).
// narrow_matrix: op(x) row-major into out (ld_out per row, ld_out even and >= cols rounded up to
//   even; the column past an odd cols is written 0), as dot()'s A.
// pack_matrix: op(x) as dot()'s B: PackedB{out, 512, column_blocks·512} with column_blocks =
//   ceil(cols / 16) and pairs = ceil(rows / 2), every row past `rows` and column past `cols`
//   written 0; out holds packed_size(rows, cols) elements.
void narrow_matrix(const float* x, int64_t ld, int64_t rows, int64_t cols, bool transposed, bfloat16* out,
                   int64_t ld_out);
void pack_matrix(const float* x, int64_t ld, int64_t rows, int64_t cols, bool transposed, bfloat16* out);
inline int64_t packed_size(int64_t rows, int64_t cols) {
  return (rows + 31) / 32 * ((cols + 15) / 16) * 512;
}

// A register-only loop of vdpbf16ps (12 independent accumulators) for the benchmarks' peak:
// `iterations` rounds of dot_loop_flops_per_iteration() FLOPs (2 per multiply-add).
float dot_loop(int64_t iterations, float seed);
inline constexpr int64_t dot_loop_flops_per_iteration() { return 12 * 16 * 2 * 2; }

}  // namespace linattn::avx512_bf16
