#include <string>

#include "linattn/core/blas.h"
#include "linattn/core/simd.h"
#include "linattn/linattn.h"

namespace linattn {

const char* version() { return LINATTN_VERSION; }

std::string build_info() {
  return std::string("BLAS ") + blas_name() + ", SIMD " + simd::target_name();
}

}  // namespace linattn
