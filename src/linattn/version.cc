#include <string>

#include "linattn/core/blas.h"
#include "linattn/core/simd.h"
#include "linattn/linattn.h"

namespace linattn {

const char* version() { return LINATTN_VERSION; }

std::string build_info() {
  // The 16-bit path is named so that a benchmark says which one it measured.
  return std::string("BLAS ") + blas_name() + ", SIMD " + simd::target_name() +
         ", bfloat16/float16: widened to float32 (float32 kernels, one rounding of the results)";
}

}  // namespace linattn
