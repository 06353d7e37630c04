#include "linattn/core/error.h"

#include <unistd.h>

#include <cstdio>
#include <limits>

namespace linattn {

std::string human_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
  int u = 0;
  while (bytes >= 1024 && u < 8) {
    bytes /= 1024;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

int64_t sized_by_arguments(const char* fn, const char* what,
                           std::initializer_list<std::pair<const char*, int64_t>> factors,
                           int64_t elem_bytes, int64_t copies) {
  std::string names, values;
  double exact = static_cast<double>(elem_bytes) * static_cast<double>(copies);
  int64_t count = 1;
  bool overflow = false;
  for (const auto& [name, v] : factors) {
    require(v >= 1, fn, ": ", name, " must be >= 1, got ", v);
    names += (names.empty() ? "" : " × ") + std::string(name);
    values += (values.empty() ? "" : " × ") + std::to_string(v);
    exact *= static_cast<double>(v);
    overflow = overflow || __builtin_mul_overflow(count, v, &count);
  }
  int64_t bytes = 0;
  overflow = overflow || __builtin_mul_overflow(count, elem_bytes * copies, &bytes);
  const std::string desc = std::string(fn) + ": " + what + " of " + names + " = " + values + " values" +
                           (copies > 1 ? " (" + std::to_string(copies) + " arrays)" : std::string());
  require(!overflow, desc, " would take ", human_bytes(exact), ", beyond any address space; make ",
          names, " smaller");
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0 && static_cast<double>(bytes) > static_cast<double>(pages) * static_cast<double>(page))
    throw OutOfMemory(desc + " would take " + human_bytes(static_cast<double>(bytes)) +
                      ", more than this machine's memory (" +
                      human_bytes(static_cast<double>(pages) * static_cast<double>(page)) + "); make " + names +
                      " smaller");
  return count;
}

}  // namespace linattn
