#include <string>

#include "linattn/core/amx.h"
#include "linattn/core/avx512_bf16.h"
#include "linattn/core/blas.h"
#include "linattn/core/simd.h"
#include "linattn/core/tile_matmul.h"
#include "linattn/linattn.h"
#include "linattn/threading.h"

namespace linattn {

const char* version() { return LINATTN_VERSION; }

std::string build_info() {
  // The 16-bit paths are named so that a benchmark says which one it measured.
  const bool amx = amx::bf16_usable(), dp = avx512_bf16::usable();
  std::string exact_bf16;
  if (amx && dp) exact_bf16 = "exact attention's forward on AMX-BF16 tiles and backward on AVX512-BF16 (vdpbf16ps)";
  else if (amx) exact_bf16 = "exact attention's forward on AMX-BF16 tiles; no AVX512-BF16 (" + avx512_bf16::unavailable_reason() + ")";
  else if (dp)
    exact_bf16 = "exact attention's forward and backward on AVX512-BF16 (vdpbf16ps); no AMX-BF16 tiles (" +
                 amx::unavailable_reason() + ")";
  else exact_bf16 = "no bfloat16 products (" + amx::unavailable_reason() + "; " + avx512_bf16::unavailable_reason() + ")";
  // The kernelized methods' bfloat16 calls run the float32 engine with bfloat16 products.
  if (dp)
    exact_bf16 += "; linear_attention and FAVOR+ (positive, hyperbolic) products in bfloat16 (vdpbf16ps, float32 sums)";
  // Exact attention in float32 does not run on the BLAS, so OPENBLAS_CORETYPE does not move it.
  const std::string exact_f32 = std::string("exact attention's float32 forward and backward on linattn's own kernels (") +
                                tile_matmul::target_name() + ", " + std::to_string(tile_matmul::block_rows()) + "×" +
                                std::to_string(tile_matmul::block_columns()) + " register blocks)";
  return std::string("BLAS ") + blas_name() + ", SIMD " + simd::target_name() + ", " + exact_f32 +
         ", bfloat16/float16: float32 kernels, one rounding of the results (linear_attention and favor_attention "
         "widen bfloat16 a block at a time, the other methods widen their inputs whole); " +
         exact_bf16 +
         "; parallel loops on " + thread_pool();
}

}  // namespace linattn
