// Intel AMX (Advanced Matrix Extensions): whether this CPU and OS let a process use the
// AMX-BF16 tiles, and the few tile instructions the bfloat16 kernels use.
//
// The instructions are inline assembly (not compiler intrinsics), so no translation unit needs
// -mamx-* flags and no inline function of a shared header is ever compiled for a CPU that the
// library must not assume. They are only reached after bf16_usable() said yes.
#pragma once

#include <cstdint>
#include <string>

namespace linattn::amx {

// CPUID reports AMX-TILE and AMX-BF16, the OS enables the tile state (XCR0 bits 17 and 18) and
// Linux granted this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM). Asked once.
bool bf16_usable();
// Why not, in words ("" when usable): for build_info() and the benchmarks' header.
const std::string& unavailable_reason();

// Tile registers 0..7, each configured as 16 rows of 64 bytes: 16×16 float32 (accumulators)
// or 16×32 bfloat16 (operands).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
inline TileConfig sixteen_by_sixty_four() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = 16;
  return c;
}

}  // namespace linattn::amx

// The tile instructions exist on x86-64 only, and the probe asks Linux for them: elsewhere the
// kernels that use them are not compiled and bf16_usable() is false.
#if defined(__x86_64__) && defined(__linux__)
#define LINATTN_AMX_ASM 1
#else
#define LINATTN_AMX_ASM 0
#endif

// `stride` is in bytes. Every tile macro clobbers "memory": the compiler must neither sink a
// store below a tile load of the same bytes nor hoist a load above a tile store.
#if LINATTN_AMX_ASM
#define LINATTN_TILE_CONFIGURE(config) __asm__ volatile("ldtilecfg %0" ::"m"(config) : "memory")
#define LINATTN_TILE_RELEASE() __asm__ volatile("tilerelease" ::: "memory")
#define LINATTN_TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::: "memory")
#define LINATTN_TILE_LOAD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define LINATTN_TILE_STORE(t, base, stride) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
// tile c += a·b: a is 16 rows × 32 bfloat16, b 16 rows × 16 pairs (VNNI: row r holds
// b[2r][j], b[2r+1][j] for each column j), c 16×16 float32.
#define LINATTN_TILE_DOT_BF16(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
#endif  // LINATTN_AMX_ASM
