#include <string>

#include "linattn/core/amx.h"
#include "linattn/core/avx512_bf16.h"
#include "linattn/core/blas.h"
#include "linattn/core/simd.h"
#include "linattn/linattn.h"

namespace linattn {

const char* version() { return LINATTN_VERSION; }

std::string build_info() {
  // The 16-bit path is named so that a benchmark says which one it measured.
  const std::string exact_bf16 =
      amx::bf16_usable()          ? std::string("AMX-BF16 tiles for exact attention's forward")
      : avx512_bf16::usable() ? "AVX512-BF16 (vdpbf16ps) for exact attention's forward; no AMX-BF16 tiles (" +
                                    amx::unavailable_reason() + ")"
                              : "no bfloat16 products (" + amx::unavailable_reason() + "; " +
                                    avx512_bf16::unavailable_reason() + ")";
  return std::string("BLAS ") + blas_name() + ", SIMD " + simd::target_name() +
         ", bfloat16/float16: widened to float32 (float32 kernels, one rounding of the results); " + exact_bf16;
}

}  // namespace linattn
