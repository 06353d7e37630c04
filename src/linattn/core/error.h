// linattn::Error and the argument checks every public function runs at its boundary.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <new>
#include <utility>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace linattn {

// Thrown for every bad argument. The message names the function, the argument and what was
// expected. The Python module turns it into ValueError.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument(what) {}
};

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

// Thrown when memory cannot be had: a std::bad_alloc whose message says what was asked for
// and, where a public function sized it from its arguments, which ones (MemoryError in Python).
class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(std::string what) : what_(std::move(what)) {}
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

// "16.0 GiB" and the like.
std::string human_bytes(double bytes);

// The element count of an array sized by a public function's integer arguments, named in
// `factors` ({"s_proj", s}, {"n_max", n}, ...): each must be >= 1 (else Error), their product
// times elem_bytes must fit in 64 bits (else Error) and in this machine's memory (else
// OutOfMemory), all messages naming `fn` and the arguments. `what` names the array(s).
int64_t sized_by_arguments(const char* fn, const char* what,
                           std::initializer_list<std::pair<const char*, int64_t>> factors,
                           int64_t elem_bytes, int64_t copies = 1);

std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace linattn
