// The processor state the OS saves on a context switch (XCR0), which decides whether a vector
// or tile extension that CPUID reports may be used. Shared by the AMX and AVX512-BF16 probes.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>

namespace linattn::cpu {

// XCR0, or 0 when the OS has not enabled XSAVE (CPUID.1:ECX.OSXSAVE clear; then xgetbv faults).
inline uint64_t os_saved_state() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return 0;
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

}  // namespace linattn::cpu
#endif
