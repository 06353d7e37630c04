// float32 products of attention tiles with linattn's own Highway kernels, dispatched at run
// time (AVX-512, AVX2, SSE4, ...). Why not the BLAS: OpenBLAS picks its kernels from
// OPENBLAS_CORETYPE, so the same binary ran exact attention at 61% of the FMA peak as users
// run it and at 40% under the Haswell override these machines set; it also packs both
// operands again on every call, and attention makes thousands of small calls with the same
// keys. These kernels read B as it is laid out once per call (docs/design.md, "Own float32 kernels, by measurement").
#pragma once

#include <cstdint>

namespace linattn::tile_matmul {

// c[r][0 : cols) (+)= Σ_{p < inner} a[r·lda + p] · b[p·ldb + 0 : cols) for r < rows, float32:
// each c element is one chain in p order, starting from the old c with accumulate (else from 0),
// of fused multiply-adds on AVX2 and AVX-512, of a multiply and an add on SSE4 and below. Either
// way the error is within γ_inner·(|c| + Σ|a||b|) (Higham §3.1), γ_{inner+1} without FMA when
// accumulating. accumulate = false overwrites c.
// cols must be a multiple of 16 (Error otherwise); B's rows are read whole (cols values each).
void multiply(const float* a, int64_t lda, int64_t rows, const float* b, int64_t ldb, int64_t inner, int64_t cols,
              float* c, int64_t ldc, bool accumulate);

// The instruction set the kernels run on ("AVX3" is AVX-512), and the block of c one kernel
// call holds in registers (rows × columns), for build_info() and the benchmarks.
const char* target_name();
inline constexpr int kBlockRows = 6;  // rows of c per register block, on every target
int64_t block_rows();
int64_t block_columns();

}  // namespace linattn::tile_matmul
