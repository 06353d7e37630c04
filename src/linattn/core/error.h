// Helpers for raising linattn::Error (include/linattn/error.h) with messages built from parts.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "linattn/core/error.h"
#include "linattn/error.h"
#include "linattn/tensor.h"  // shape_string

namespace linattn {

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}
}  // namespace detail

// Throws Error with the parts of the message streamed together.
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw Error(detail::concat(parts...));
}

template <class... Parts>
void require(bool ok, const Parts&... parts) {
  if (!ok) fail(parts...);
}

// "16.0 GiB" and the like.
std::string human_bytes(double bytes);

// The element count of an array sized by a public function's integer arguments, named in
// `factors` ({"s_proj", s}, {"n_max", n}, ...): each must be >= 1 (else Error), their product
// times elem_bytes must fit in 64 bits (else Error) and in this machine's memory (else
// OutOfMemory), all messages naming `fn` and the arguments. `what` names the array(s).
int64_t sized_by_arguments(const char* fn, const char* what,
                           std::initializer_list<std::pair<const char*, int64_t>> factors,
                           int64_t elem_bytes, int64_t copies = 1);


}  // namespace linattn
