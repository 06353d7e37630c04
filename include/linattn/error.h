// What linattn throws. Every bad argument is an Error whose message names the function, the
// argument and what was expected (ValueError in Python); memory that cannot be had is an
// OutOfMemory saying how much and, where arguments sized it, which (MemoryError in Python).
#pragma once

#include <new>
#include <stdexcept>
#include <string>
#include <utility>

namespace linattn {

class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument(what) {}
};

class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(std::string what) : what_(std::move(what)) {}
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

}  // namespace linattn
