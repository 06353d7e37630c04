#include "linattn/core/avx512_bf16.h"

#include <algorithm>
#include <cstring>

#include "linattn/core/error.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LINATTN_AVX512_BF16 1
#include <cpuid.h>
#include <immintrin.h>

#include "linattn/core/xcr0.h"
#else
#define LINATTN_AVX512_BF16 0
#endif

namespace linattn::avx512_bf16 {
namespace {

std::string probe() {
#if LINATTN_AVX512_BF16
  const uint64_t xcr0 = cpu::os_saved_state();
  if (xcr0 == 0) return "the OS does not enable XSAVE";
  if ((xcr0 & 0xE6u) != 0xE6u) return "the OS does not enable the AVX-512 state";
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "CPUID leaf 7 is missing";
  if (!((b >> 16) & 1u) || !((b >> 30) & 1u) || !((b >> 31) & 1u)) return "the CPU has no AVX-512 (F, BW, VL)";
  if (a < 1) return "the CPU has no AVX512_BF16 (no CPUID leaf 7 subleaf 1)";  // a: the last subleaf
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1u)) return "the CPU has no AVX512_BF16";
  return "";
#else
  return "AVX512-BF16 is used on x86-64 only";
#endif
}

const std::string& reason() {
  static const std::string r = probe();
  return r;
}

#if LINATTN_AVX512_BF16
#define LINATTN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Lanes below `count` (at most 16) of a 16-lane vector.
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

// 16 bfloat16 pairs (lo[t], hi[t]) as 32-bit lanes t, from 16 floats of each of two rows (lanes
// past `count` read as 0).
LINATTN_TARGET inline __m512i interleaved_pairs(const float* lo, const float* hi, __mmask16 lanes) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512 l = lo ? _mm512_maskz_loadu_ps(lanes, lo) : _mm512_setzero_ps();
  const __m512 h = hi ? _mm512_maskz_loadu_ps(lanes, hi) : _mm512_setzero_ps();
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), (__m512i)_mm512_cvtne2ps_pbh(h, l));
}

// 32 consecutive floats (lanes past `count` of 32 read as 0) as 16 bfloat16 pairs in order.
LINATTN_TARGET inline __m512i consecutive_pairs(const float* x, int64_t count) {
  const __m512 l = _mm512_maskz_loadu_ps(first_lanes(std::max<int64_t>(count, 0)), x);
  const __m512 h = _mm512_maskz_loadu_ps(first_lanes(std::max<int64_t>(count - 16, 0)), x + 16);
  return (__m512i)_mm512_cvtne2ps_pbh(h, l);
}

// Pairs p < pair_count of rows (2p, 2p+1) of x (zero past `rows`), `cols` columns in blocks of
// 16 (the last masked, zero past `cols`), into the packed layout with chunks of
// ceil(cols / 16)·512 elements: pack_pairs and pack_matrix's untransposed operands.
LINATTN_TARGET inline void pack_row_pairs(const float* x, int64_t ld, int64_t rows, int64_t cols, int64_t pair_count,
                                          bfloat16* out) {
  const int64_t blocks = (cols + 15) / 16;
  for (int64_t p = 0; p < pair_count; ++p) {
    const float* lo = 2 * p < rows ? x + 2 * p * ld : nullptr;
    const float* hi = 2 * p + 1 < rows ? x + (2 * p + 1) * ld : nullptr;
    bfloat16* dst = out + (p / 16) * blocks * 512 + (p % 16) * 32;
    for (int64_t j = 0; j < blocks; ++j)
      _mm512_storeu_si512(dst + j * 512, interleaved_pairs(lo ? lo + 16 * j : nullptr, hi ? hi + 16 * j : nullptr,
                                                           first_lanes(cols - 16 * j)));
  }
}

// v[i] lane j ↔ v[j] lane i (a 16×16 transpose of 32-bit lanes). GCC 12 warns that the
// unpack intrinsics' internal pass-through operand (an undefined vector, fully overwritten
// under an all-ones mask) may be, or is, uninitialised (the sanitizer build says "is"): a false
// positive of its headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
LINATTN_TARGET inline void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // 128-bit group g of v[4k + i] now holds column 4g + i of rows 4k..4k+3: gather the groups.
  for (int i = 0; i < 4; ++i) {
    const __m512i a = v[i], b = v[4 + i], c = v[8 + i], d = v[12 + i];
    const __m512i ab_lo = _mm512_shuffle_i32x4(a, b, 0x44), ab_hi = _mm512_shuffle_i32x4(a, b, 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(c, d, 0x44), cd_hi = _mm512_shuffle_i32x4(c, d, 0xEE);
    t[i] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
    t[8 + i] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}
#pragma GCC diagnostic pop


// R rows × C column blocks of accumulators (R·C ≤ 24 of the 32 zmm registers; the rest hold
// B's C vectors and a broadcast pair of A).
// The last column block reads and writes only the lanes in `last`.
template <int R, int C>
LINATTN_TARGET void block(const bfloat16* a, int64_t lda, PackedB b, int64_t pairs, float* c, int64_t ldc,
                          bool accumulate, __mmask16 last) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j)
      acc[r][j] = accumulate ? _mm512_maskz_loadu_ps(j == C - 1 ? last : __mmask16(0xFFFF), c + r * ldc + 16 * j)
                             : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bfloat16* bp = b.data + (p >> 4) * b.chunk_stride + (p & 15) * 32;
    __m512bh bv[C];
    for (int j = 0; j < C; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(bp + j * b.column_stride);
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // a[r][2p], a[r][2p+1] (memcpy: no aliasing of bfloat16 as int32)
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < C; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j)
      _mm512_mask_storeu_ps(c + r * ldc + 16 * j, j == C - 1 ? last : __mmask16(0xFFFF), acc[r][j]);
}

using BlockFn = void (*)(const bfloat16*, int64_t, PackedB, int64_t, float*, int64_t, bool, __mmask16);

template <int R>
BlockFn block_for(int64_t columns) {
  switch (columns) {
    case 1: return block<R, 1>;
    case 2: return block<R, 2>;
    case 3: return block<R, 3>;
    default: return block<R, 4>;
  }
}
BlockFn block_for(int64_t rows, int64_t columns) {
  switch (rows) {
    case 1: return block_for<1>(columns);
    case 2: return block_for<2>(columns);
    case 3: return block_for<3>(columns);
    case 4: return block_for<4>(columns);
    case 5: return block_for<5>(columns);
    default: return block_for<6>(columns);
  }
}
#endif

}  // namespace

bool usable() { return reason().empty(); }
const std::string& unavailable_reason() { return reason(); }

void dot(const bfloat16* a, int64_t lda, int64_t rows, PackedB b, int64_t pairs, int64_t column_blocks, float* c,
         int64_t ldc, bool accumulate, int64_t last_block_columns) {
  require(usable(), "avx512_bf16::dot: ", unavailable_reason());
  require(lda % 2 == 0, "avx512_bf16::dot: lda must be even (rows read as pairs), got ", lda);
  require(last_block_columns >= 1 && last_block_columns <= 16, "avx512_bf16::dot: last_block_columns must be 1 to 16, got ",
          last_block_columns);
#if LINATTN_AVX512_BF16
  // Six rows by four column blocks: 24 accumulators, 4 loads of B and 6 broadcasts of A per 24
  // vdpbf16ps (16 lanes × one pair each). Four rows by four measured the same on AMD Zen.
  constexpr int64_t kRowBlock = 6;
  for (int64_t j = 0; j < column_blocks; j += 4) {
    const int64_t cols = std::min<int64_t>(4, column_blocks - j);
    const PackedB bj{b.data + j * b.column_stride, b.column_stride, b.chunk_stride};
    const __mmask16 last = j + cols == column_blocks ? first_lanes(last_block_columns) : __mmask16(0xFFFF);
    for (int64_t r = 0; r < rows; r += kRowBlock) {
      const int64_t rs = std::min<int64_t>(kRowBlock, rows - r);
      block_for(rs, cols)(a + r * lda, lda, bj, pairs, c + r * ldc + 16 * j, ldc, accumulate, last);
    }
  }
#else
  (void)a, (void)rows, (void)b, (void)pairs, (void)column_blocks, (void)c, (void)ldc, (void)accumulate,
      (void)last_block_columns;
#endif
}

#if LINATTN_AVX512_BF16
namespace {
// (_mm512_reduce_add_ps: the same GCC 12 false positive as transpose16's.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
LINATTN_TARGET void dot_columns_avx512(const bfloat16* a, int64_t lda, int64_t rows, const bfloat16* b, int64_t ldb,
                                       int64_t pairs, int64_t columns, float* c, int64_t ldc, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < columns; ++j) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; p += 16) {
        const __mmask16 lanes = first_lanes(pairs - p);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi32(lanes, a + r * lda + 2 * p),
                               (__m512bh)_mm512_maskz_loadu_epi32(lanes, b + j * ldb + 2 * p));
      }
      const float sum = _mm512_reduce_add_ps(acc);
      c[r * ldc + j] = accumulate ? c[r * ldc + j] + sum : sum;
    }
}
#pragma GCC diagnostic pop
}  // namespace
#endif

void dot_columns(const bfloat16* a, int64_t lda, int64_t rows, const bfloat16* b, int64_t ldb, int64_t pairs,
                 int64_t columns, float* c, int64_t ldc, bool accumulate) {
  require(usable(), "avx512_bf16::dot_columns: ", unavailable_reason());
  require(lda % 2 == 0 && ldb % 2 == 0 && ldb >= 2 * pairs && columns >= 0,
          "avx512_bf16::dot_columns: lda and ldb must be even, ldb >= 2·pairs and columns >= 0, got lda = ", lda,
          ", ldb = ", ldb, ", pairs = ", pairs, ", columns = ", columns);
#if LINATTN_AVX512_BF16
  dot_columns_avx512(a, lda, rows, b, ldb, pairs, columns, c, ldc, accumulate);
#else
  (void)a, (void)lda, (void)rows, (void)b, (void)ldb, (void)pairs, (void)columns, (void)c, (void)ldc, (void)accumulate;
#endif
}

#if LINATTN_AVX512_BF16
namespace {
LINATTN_TARGET float dot_loop_avx512(int64_t iterations, float seed) {
  // Distinct starting values, so that the compiler keeps twelve chains.
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(seed + static_cast<float>(i));
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x33d633d6);  // (1e-7, 1e-7) in bfloat16
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // (1, 1)
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, acc[i]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  float total = 0;
  for (float x : lanes) total += x;
  return total;
}
}  // namespace
#endif

float dot_loop(int64_t iterations, float seed) {
  require(usable(), "avx512_bf16::dot_loop: ", unavailable_reason());
#if LINATTN_AVX512_BF16
  return dot_loop_avx512(iterations, seed);
#else
  (void)iterations;
  return seed;
#endif
}



#if LINATTN_AVX512_BF16
namespace {

LINATTN_TARGET void narrow_matrix_avx512(const float* x, int64_t ld, int64_t rows, int64_t cols, bool transposed,
                                         bfloat16* out, int64_t ld_out) {
  if (!transposed) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 lanes = first_lanes(cols - c);
        _mm256_mask_storeu_epi16(out + r * ld_out + c, lanes,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes, x + r * ld + c)));
      }
      if (cols % 2) out[r * ld_out + cols] = bfloat16{};
    }
    return;
  }
  // op(x)[r][c] = x[c·ld + r]: 32 columns of op(x) (32 rows of x) by 16 r at a time make 16
  // vectors of pairs (c, c+1) over r, which a 16×16 transpose turns into 16 output rows of 16
  // pairs each.
  const int64_t pair_cols = (cols + 1) / 2;
  for (int64_t c0 = 0; c0 < pair_cols; c0 += 16) {
    const int64_t pc = std::min<int64_t>(16, pair_cols - c0);
    for (int64_t r = 0; r < rows; r += 16) {
      const __mmask16 lanes = first_lanes(rows - r);
      __m512i v[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t c = 2 * (c0 + i);
        v[i] = i < pc ? interleaved_pairs(x + c * ld + r, c + 1 < cols ? x + (c + 1) * ld + r : nullptr, lanes)
                      : _mm512_setzero_si512();
      }
      transpose16(v);
      for (int64_t t = 0; t < std::min<int64_t>(16, rows - r); ++t)
        _mm512_mask_storeu_epi32(out + (r + t) * ld_out + 2 * c0, first_lanes(pc), v[t]);
    }
  }
}

LINATTN_TARGET void pack_matrix_avx512(const float* x, int64_t ld, int64_t rows, int64_t cols, bool transposed,
                                       bfloat16* out) {
  const int64_t blocks = (cols + 15) / 16, pairs = (rows + 1) / 2, chunk_stride = blocks * 512;
  if (!transposed) return pack_row_pairs(x, ld, rows, cols, (pairs + 15) / 16 * 16, out);  // whole chunks
  // op(x)[i][c] = x[c·ld + i]: the pairs (2p, 2p+1) of column c are adjacent in row c of x. 16
  // columns' 16 pairs of a chunk, transposed, are the chunk's 16 pair slots of that block.
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t ch = 0; ch < (pairs + 15) / 16; ++ch) {
      __m512i v[16];
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t c = 16 * j + t;
        v[t] = c < cols ? consecutive_pairs(x + c * ld + 32 * ch, rows - 32 * ch) : _mm512_setzero_si512();
      }
      transpose16(v);
      for (int64_t sl = 0; sl < 16; ++sl) _mm512_storeu_si512(out + ch * chunk_stride + j * 512 + sl * 32, v[sl]);
    }
}
}  // namespace
#endif

void narrow_matrix(const float* x, int64_t ld, int64_t rows, int64_t cols, bool transposed, bfloat16* out,
                   int64_t ld_out) {
  require(usable(), "avx512_bf16::narrow_matrix: ", unavailable_reason());
  require(ld_out % 2 == 0 && ld_out >= (cols + 1) / 2 * 2, "avx512_bf16::narrow_matrix: ld_out must be even and >= ",
          (cols + 1) / 2 * 2, ", got ", ld_out);
#if LINATTN_AVX512_BF16
  narrow_matrix_avx512(x, ld, rows, cols, transposed, out, ld_out);
#else
  (void)x, (void)ld, (void)rows, (void)transposed, (void)out;
#endif
}

void narrow_rows(const float* x, int64_t ld, int64_t rows, int64_t cols, bfloat16* out, int64_t ld_out) {
  require(usable(), "avx512_bf16::narrow_rows: ", unavailable_reason());
  require(cols % 16 == 0, "avx512_bf16::narrow_rows: cols must be a multiple of 16, got ", cols);
#if LINATTN_AVX512_BF16
  narrow_matrix_avx512(x, ld, rows, cols, false, out, ld_out);
#else
  (void)x, (void)ld, (void)rows, (void)out, (void)ld_out;
#endif
}

void pack_matrix(const float* x, int64_t ld, int64_t rows, int64_t cols, bool transposed, bfloat16* out) {
  require(usable(), "avx512_bf16::pack_matrix: ", unavailable_reason());
#if LINATTN_AVX512_BF16
  pack_matrix_avx512(x, ld, rows, cols, transposed, out);
#else
  (void)x, (void)ld, (void)rows, (void)cols, (void)transposed, (void)out;
#endif
}

void pack_pairs(const float* x, int64_t ld, int64_t rows, int64_t column_blocks, int64_t pairs, bfloat16* out) {
  require(usable(), "avx512_bf16::pack_pairs: ", unavailable_reason());
#if LINATTN_AVX512_BF16
  pack_row_pairs(x, ld, rows, 16 * column_blocks, pairs, out);
#else
  (void)x, (void)ld, (void)rows, (void)column_blocks, (void)pairs, (void)out;
#endif
}

}  // namespace linattn::avx512_bf16
