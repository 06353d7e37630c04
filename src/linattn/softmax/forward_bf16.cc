// Exact attention forward for bfloat16 inputs with bfloat16 products summed in float32,
// FlashAttention-style, on one of two engines: AMX tiles (Intel AMX-BF16) or AVX512-BF16's
// vdpbf16ps (AMD Zen 4, Intel Cooper Lake). Per (batch·head, block of kRows = 32 queries), over
// blocks of kKeys keys:
//   S = Q·Kᵀ                          (bfloat16 products, float32 sums)
//   m' = max(m, scale·rowmax S); P = bf16(exp(scale·S − m')); l = l·exp(m − m') + Σ exp(...)
//   O = O·exp(m − m') + P·V           (bfloat16 products, into a float32 accumulator per worker)
// then out = bf16(O / l) and lse = m + log l, in float32 as the float32 forward saves it.
//
// What it costs against the widened float32 forward (docs/precision.md): P is rounded to
// bfloat16 before P·V, a relative error ≤ u = 2⁻⁸ per weight, so |out − exact| ≤ u·max|v| beside
// the float32 sums and the final rounding; AMX reads bfloat16 subnormals (|x| < 2⁻¹²⁶) as 0.
// The probabilities' sum l is taken before that rounding, as the float32 forward takes it.
//
// Keys and values are packed once per call into the pair layout both engines read (AMX's
// B-tile rows are vdpbf16ps's B vectors; tile_keys, tile_values below); queries a block at a
// time. Extra memory: the packed k and v (as large as k and v, padded) and
// kRows·(2·d + 6·kKeys + 4·d_v) bytes per worker (d, d_v padded).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "linattn/core/amx.h"
#include "linattn/core/attention_args.h"
#include "linattn/core/avx512_bf16.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/simd.h"
#include "linattn/softmax/forward_internal.h"

namespace linattn::softmax_detail {
namespace {

constexpr int64_t kRows = 32;   // queries per task: two 16-row tiles
constexpr int64_t kKeys = 256;  // keys per online-softmax step: S 32 KiB + P 16 KiB per worker

// Padded sizes: d and n_k to the tile depth (zeros add nothing to a dot product; padded keys are
// masked), d_v to 16 columns.
struct TileDims {
  int64_t d_chunks, v_chunks, n_k_pad;
  explicit TileDims(const AttentionDims& d)
      : d_chunks((d.head_dim + kTileDepth - 1) / kTileDepth),
        v_chunks((d.value_dim + kTileRows - 1) / kTileRows),
        n_k_pad(round_up(d.n_k, kTileDepth)) {}
  int64_t d_pad() const { return d_chunks * kTileDepth; }
  int64_t v_pad() const { return v_chunks * kTileRows; }
  int64_t key_tiles() const { return n_k_pad / kTileRows; }
  int64_t key_chunks() const { return n_k_pad / kTileDepth; }
};

// Kᵀ as the B operand of S = Q·Kᵀ: per 16 keys and 32 features one tile whose row r holds
// (k[j][2r], k[j][2r+1]) for j = 0..15, i.e. the 16×16 matrix of feature pairs transposed.
// Tile (t, c) of one (batch, head) starts at ((t·d_chunks + c)·kTileElems); feature pair p of
// key j lands at 32·p (row p % 16 of chunk p / 16) + 2·(j % 16) from its tile row's start.
}  // namespace

void tile_keys(const bfloat16* k, int64_t n_k, int64_t d, int64_t d_chunks, bfloat16* out) {
  for (int64_t j = 0; j < n_k; ++j) {
    const bfloat16* row = k + j * d;
    bfloat16* base = out + (j / kTileRows) * d_chunks * kTileElems + 2 * (j % kTileRows);
    for (int64_t p = 0; p < d / 2; ++p) std::memcpy(base + kTileDepth * p, row + 2 * p, 2 * sizeof(bfloat16));
    if (d % 2) base[kTileDepth * (d / 2)] = row[d - 1];
  }
}

// V as the B operand of O += P·V: per 32 keys and 16 value columns one tile whose row r holds
// (v[2r][c], v[2r+1][c]) for c = 0..15. Tile (kc, cc) starts at ((kc·v_chunks + cc)·kTileElems);
// column c of keys (2r, 2r+1) lands at cc·kTileElems + 2·(c % 16) from row r's start.
void tile_values(const bfloat16* v, int64_t n_k, int64_t dv, int64_t v_chunks, bfloat16* out) {
  for (int64_t j = 0; j < n_k; ++j) {
    const bfloat16* row = v + j * dv;
    bfloat16* base = out + (j / kTileDepth) * v_chunks * kTileElems + ((j % kTileDepth) / 2) * kTileDepth + j % 2;
    for (int64_t cc = 0; cc * kTileRows < dv; ++cc) {
      bfloat16* dst = base + cc * kTileElems;
      const int64_t c0 = cc * kTileRows, cols = std::min(kTileRows, dv - c0);
      for (int64_t c = 0; c < cols; ++c) dst[2 * c] = row[c0 + c];
    }
  }
}

namespace {

struct Scratch {
  Buffer<bfloat16> q;  // kRows × d_pad, zero past d and past the block's rows
  Buffer<float> s;     // kRows × kKeys scores
  Buffer<bfloat16> p;  // kRows × kKeys probabilities
  Buffer<float> o;     // kRows × v_pad accumulator
  float m[kRows], l[kRows];
  int64_t visible[kRows];
  bool narrow_p = avx512_bf16::usable();  // round P with vcvtneps2bf16 (see forward_rows)
  Scratch(const TileDims& td)
      : q(kRows * td.d_pad()), s(kRows * kKeys), p(kRows * kKeys), o(kRows * td.v_pad()) {}
};

#if LINATTN_AMX_ASM
// The tile registers configured for this thread while in scope (released on an exception too).
struct TileScope {
  TileScope() {
    static const amx::TileConfig config = amx::sixteen_by_sixty_four();
    LINATTN_TILE_CONFIGURE(config);
  }
  ~TileScope() { LINATTN_TILE_RELEASE(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// S[0:32, jj:jj+32] = Q·K[key_tile·16 : +32]ᵀ: four accumulators, each operand tile used twice.
void score_tiles(Scratch& w, const bfloat16* keys, int64_t key_tile, int64_t jj, const TileDims& td) {
  const int64_t q_stride = td.d_pad() * 2;
  LINATTN_TILE_ZERO(0);
  LINATTN_TILE_ZERO(1);
  LINATTN_TILE_ZERO(2);
  LINATTN_TILE_ZERO(3);
  for (int64_t c = 0; c < td.d_chunks; ++c) {
    LINATTN_TILE_LOAD(4, w.q.data() + c * kTileDepth, q_stride);
    LINATTN_TILE_LOAD(5, w.q.data() + kTileRows * td.d_pad() + c * kTileDepth, q_stride);
    LINATTN_TILE_LOAD(6, keys + (key_tile * td.d_chunks + c) * kTileElems, 64);
    LINATTN_TILE_LOAD(7, keys + ((key_tile + 1) * td.d_chunks + c) * kTileElems, 64);
    LINATTN_TILE_DOT_BF16(0, 4, 6);
    LINATTN_TILE_DOT_BF16(1, 4, 7);
    LINATTN_TILE_DOT_BF16(2, 5, 6);
    LINATTN_TILE_DOT_BF16(3, 5, 7);
  }
  const float* s = w.s.data();
  constexpr int64_t stride = kKeys * 4;
  LINATTN_TILE_STORE(0, s + jj, stride);
  LINATTN_TILE_STORE(1, s + jj + kTileRows, stride);
  LINATTN_TILE_STORE(2, s + kTileRows * kKeys + jj, stride);
  LINATTN_TILE_STORE(3, s + kTileRows * kKeys + jj + kTileRows, stride);
}

// O[:, cc·16 : cc·16 + 16·(1 + two)] += P[:, 0:bk32]·V[j0 : j0 + bk32, same columns].
void value_tiles(Scratch& w, const bfloat16* values, int64_t key_chunk0, int64_t bk32, int64_t cc, bool two,
                 const TileDims& td) {
  float* o = w.o.data() + cc * kTileRows;
  const int64_t o_stride = td.v_pad() * 4;
  float* o_low = o + kTileRows * td.v_pad();
  LINATTN_TILE_LOAD(0, o, o_stride);
  LINATTN_TILE_LOAD(2, o_low, o_stride);
  if (two) {
    LINATTN_TILE_LOAD(1, o + kTileRows, o_stride);
    LINATTN_TILE_LOAD(3, o_low + kTileRows, o_stride);
  }
  constexpr int64_t p_stride = kKeys * 2;
  for (int64_t kk = 0; kk < bk32; kk += kTileDepth) {
    const bfloat16* v = values + ((key_chunk0 + kk / kTileDepth) * td.v_chunks + cc) * kTileElems;
    LINATTN_TILE_LOAD(4, w.p.data() + kk, p_stride);
    LINATTN_TILE_LOAD(5, w.p.data() + kTileRows * kKeys + kk, p_stride);
    LINATTN_TILE_LOAD(6, v, 64);
    LINATTN_TILE_DOT_BF16(0, 4, 6);
    LINATTN_TILE_DOT_BF16(2, 5, 6);
    if (two) {
      LINATTN_TILE_LOAD(7, v + kTileElems, 64);
      LINATTN_TILE_DOT_BF16(1, 4, 7);
      LINATTN_TILE_DOT_BF16(3, 5, 7);
    }
  }
  LINATTN_TILE_STORE(0, o, o_stride);
  LINATTN_TILE_STORE(2, o_low, o_stride);
  if (two) {
    LINATTN_TILE_STORE(1, o + kTileRows, o_stride);
    LINATTN_TILE_STORE(3, o_low + kTileRows, o_stride);
  }
}

#endif  // LINATTN_AMX_ASM

// S[0:rows, 0:bk32] = Q·K[j0 : j0 + bk32]ᵀ and O[0:rows] += P[0:rows, 0:bk32]·V[j0 : j0 + bk32] with
// vdpbf16ps, from the same packed operands as the tiles.
void dot_scores(Scratch& w, const bfloat16* keys, int64_t j0, int64_t bk32, int64_t rows, const TileDims& td) {
  const int64_t tile = td.d_chunks * kTileElems;  // one 16-key tile of K
  avx512_bf16::dot(w.q.data(), td.d_pad(), rows, {keys + (j0 / kTileRows) * tile, tile, kTileElems}, td.d_pad() / 2,
                   bk32 / kTileRows, w.s.data(), kKeys, false);
}
void dot_values(Scratch& w, const bfloat16* values, int64_t j0, int64_t bk32, int64_t rows, const TileDims& td) {
  const int64_t chunk = td.v_chunks * kTileElems;  // one 32-key chunk of V
  avx512_bf16::dot(w.p.data(), kKeys, rows, {values + (j0 / kTileDepth) * chunk, kTileElems, chunk}, bk32 / 2,
                   td.v_chunks, w.o.data(), td.v_pad(), true);
}

void forward_rows(Bf16Engine engine, TensorView<const bfloat16> q, const bfloat16* keys, const bfloat16* values,
                  const AttentionDims& d, const TileDims& td, const KeyMask& mask, float scale,
                  int64_t bh, int64_t i0, Scratch& w, bfloat16* out, float* lse) {
  const int64_t b = bh / d.heads;
  const int64_t rows = std::min(kRows, d.n_q - i0);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t kmax = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    w.visible[r] = r < rows ? mask.visible(b, i0 + r) : 0;
    kmax = std::max(kmax, w.visible[r]);
    w.m[r] = neg_inf;
    w.l[r] = 0;
    bfloat16* qr = w.q.data() + r * td.d_pad();
    if (r < rows) std::copy_n(q.row(bh, i0 + r), d.head_dim, qr);
    else std::fill_n(qr, d.head_dim, bfloat16{0});
  }
  std::fill_n(w.o.data(), w.o.size(), 0.0f);

  for (int64_t j0 = 0; j0 < kmax; j0 += kKeys) {
    interruption_point();  // may run Python (signal handlers), which may use AMX itself
    const int64_t bk = std::min(kKeys, kmax - j0);
    const int64_t bk32 = round_up(bk, kTileDepth);
#if LINATTN_AMX_ASM
    std::optional<TileScope> tiles;  // no tile holds data across blocks: S and O live in memory
    if (engine == Bf16Engine::amx) {
      tiles.emplace();
      for (int64_t jj = 0; jj < bk32; jj += kTileDepth) score_tiles(w, keys, (j0 + jj) / kTileRows, jj, td);
    }
#endif
    if (engine == Bf16Engine::avx512_bf16) dot_scores(w, keys, j0, bk32, rows, td);
    int64_t count[kRows];
    for (int64_t r = 0; r < kRows; ++r) count[r] = std::clamp<int64_t>(w.visible[r] - j0, 0, bk);
    // P in float32 in place of S, then rounded with vcvtneps2bf16 (one instruction per 16 values,
    // against ten for the rounding in integer ops where the CPU lacks it; P is 0 or normal, so the
    // conversion's flushing never applies).
    const int64_t bad =
        w.narrow_p ? simd::online_softmax_step(w.s.data(), kKeys, kRows, count, static_cast<size_t>(bk32), scale, w.m,
                                               w.l, w.o.data(), static_cast<size_t>(td.v_pad()),
                                               static_cast<size_t>(d.value_dim), w.s.data(), kKeys)
                   : simd::online_softmax_step(w.s.data(), kKeys, kRows, count, static_cast<size_t>(bk32), scale, w.m,
                                               w.l, w.o.data(), static_cast<size_t>(td.v_pad()),
                                               static_cast<size_t>(d.value_dim), w.p.data(), kKeys);
    if (w.narrow_p && bad < 0) avx512_bf16::narrow_rows(w.s.data(), kKeys, kRows, bk32, w.p.data(), kKeys);
    require(bad < 0, "softmax_attention: q·kᵀ·scale overflows at row ", i0 + bad, " of batch·head ", bh,
            "; scale down q or k");
#if LINATTN_AMX_ASM
    if (engine == Bf16Engine::amx)
      for (int64_t cc = 0; cc < td.v_chunks; cc += 2)
        value_tiles(w, values, j0 / kTileDepth, bk32, cc, cc + 1 < td.v_chunks, td);
#endif
    if (engine == Bf16Engine::avx512_bf16) dot_values(w, values, j0, bk32, rows, td);
  }
  const int64_t bad = simd::finish_rows(w.o.data(), static_cast<size_t>(td.v_pad()), static_cast<size_t>(rows),
                                                    static_cast<size_t>(d.value_dim), w.l,
                                                    out + (bh * d.n_q + i0) * d.value_dim,
                                                    static_cast<size_t>(d.value_dim));
  require(bad < 0, "softmax_attention: the output has a non-finite value at row ", i0 + bad, " of batch·head ", bh,
          " (q·kᵀ overflows float32)");
  for (int64_t r = 0; r < rows; ++r) lse[bh * d.n_q + i0 + r] = w.l[r] > 0 ? w.m[r] + std::log(w.l[r]) : neg_inf;
}

}  // namespace

std::optional<Bf16Engine> bf16_engine() {
  if (amx::bf16_usable()) return Bf16Engine::amx;
  if (avx512_bf16::usable()) return Bf16Engine::avx512_bf16;
  return std::nullopt;
}

bool bf16_engine_usable(Bf16Engine engine) {
  return engine == Bf16Engine::amx ? amx::bf16_usable() : avx512_bf16::usable();
}

const char* engine_name(Bf16Engine engine) { return engine == Bf16Engine::amx ? "AMX-BF16 tiles" : "AVX512-BF16"; }

bool bf16_tiles_usable(const AttentionDims& d, double scale, Bf16Engine engine) {
  // Values past 2^64 could overflow the float32 sum of P·V (the float32 forward rescales v
  // first, range.h); q·kᵀ is summed before the scale is applied, so |q|·|k|·d past 2^120 could
  // overflow where q·kᵀ·scale does not; a scale ≤ 0 turns the row maximum into a minimum. All
  // are left to the widened forward, which handles them.
  return bf16_engine_usable(engine) && scale > 0 && d.v_max <= 0x1p64 &&
         d.q_max * d.k_max * static_cast<double>(d.head_dim) <= 0x1p120;
}

Bf16TilesResult forward_bf16_tiles(TensorView<const bfloat16> q, TensorView<const bfloat16> k,
                                   TensorView<const bfloat16> v, const AttentionDims& d, const AttentionOptions& opts,
                                   double scale, Bf16Engine engine) {
  require(bf16_tiles_usable(d, scale, engine), "softmax_attention: the ", engine_name(engine),
          " bfloat16 forward cannot take this call (",
          bf16_engine_usable(engine) ? "scale ≤ 0, |v| > 2^64 or |q|·|k|·d > 2^120"
          : engine == Bf16Engine::amx ? amx::unavailable_reason()
                                      : avx512_bf16::unavailable_reason(),
          ")");
  const TileDims td(d);
  Buffer<bfloat16> keys(d.bh() * td.key_tiles() * td.d_chunks * kTileElems);
  Buffer<bfloat16> values(d.bh() * td.key_chunks() * td.v_chunks * kTileElems);
  const int64_t keys_per_bh = td.key_tiles() * td.d_chunks * kTileElems;
  const int64_t values_per_bh = td.key_chunks() * td.v_chunks * kTileElems;
  // Keys past a batch item's key_lengths are never read (they may hold anything, NaN
  // included); their packed rows stay zero and their probabilities are 0.
  const KeyMask mask(d, opts);
  parallel_for(d.bh(), [&](int64_t bh) {
    const int64_t n_k = mask.key_length(bh / d.heads);
    tile_keys(k.row(bh, 0), n_k, d.head_dim, td.d_chunks, keys.data() + bh * keys_per_bh);
    tile_values(v.row(bh, 0), n_k, d.value_dim, td.v_chunks, values.data() + bh * values_per_bh);
  });

  Bf16TilesResult r{Tensor<bfloat16>({d.batch, d.heads, d.n_q, d.value_dim}), Tensor<float>({d.batch, d.heads, d.n_q})};
  const int64_t q_blocks = (d.n_q + kRows - 1) / kRows;
  const ParallelLoop loop(d.bh() * q_blocks);
  PerWorker<Scratch> scratch(loop, [&] { return Scratch(td); });
  loop.run([&](int64_t task, int worker) {
    const int64_t bh = task / q_blocks;
    const int64_t blk = q_blocks - 1 - task % q_blocks;  // causal: the longest rows first
    forward_rows(engine, q, keys.data() + bh * keys_per_bh, values.data() + bh * values_per_bh, d, td, mask,
                 static_cast<float>(scale), bh, blk * kRows, scratch[worker], r.out.data(), r.lse.data());
  });
  return r;
}

}  // namespace linattn::softmax_detail
