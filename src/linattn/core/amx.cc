#include "linattn/core/amx.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "linattn/core/xcr0.h"
#endif

namespace linattn::amx {
namespace {

std::string probe() {
#if defined(__x86_64__) && defined(__linux__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "CPUID leaf 7 is missing";
  const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
  if (!tile || !bf16) return "the CPU has no AMX-BF16";
  const uint64_t xcr0 = cpu::os_saved_state();
  if (xcr0 == 0) return "the OS does not enable XSAVE";
  if (((xcr0 >> 17) & 3u) != 3u) return "the OS does not enable the AMX tile state";
  // Linux 5.16+: tile data is off until the process asks for it (once, for all its threads).
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0)
    return "Linux refused the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)";
  return "";
#else
  return "AMX is used on x86-64 Linux only";
#endif
}

const std::string& reason() {
  static const std::string r = probe();
  return r;
}

}  // namespace

bool bf16_usable() { return reason().empty(); }
const std::string& unavailable_reason() { return reason(); }

}  // namespace linattn::amx
