// Shared between the forward and the backward (which may recompute the forward).
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>

#include "linattn/core/attention_args.h"
#include "linattn/low_precision.h"
#include "linattn/softmax.h"

namespace linattn::softmax_detail {

// Query and key rows per tile: the float64 forward's (one kBlockQ×kBlockK score tile per worker,
// forward.cc) and both backwards' (backward.cc, backward_f32.cc).
inline constexpr int64_t kForwardBlockQ = 128, kForwardBlockK = 512;
inline constexpr int64_t kBackwardBlockQ = 128, kBackwardBlockK = 128;

// The forward after its arguments are checked. `as_workspace`: the outputs are temporaries
// of a backward call and count as its workspace.
template <class T>
SoftmaxAttentionResult<T> forward(TensorView<const T> q, TensorView<const T> k,
                                  TensorView<const T> v, const AttentionDims& dims,
                                  const AttentionOptions& opts, double scale, bool as_workspace);

// The float32 forward on linattn's own product kernels (forward_f32.cc), which forward<float>
// runs; the BLAS-tiled forward (forward.cc) serves float64.
SoftmaxAttentionResult<float> forward_f32(TensorView<const float> q, TensorView<const float> k,
                                          TensorView<const float> v, const AttentionDims& dims,
                                          const AttentionOptions& opts, double scale, bool as_workspace);

// The float32 backward on linattn's own product kernels (backward_f32.cc), which the float32
// backward runs from the forward's out and lse; the BLAS-tiled backward (backward.cc) serves
// float64.
AttentionGrads<float> backward_f32(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                                   TensorView<const float> dout, TensorView<const float> out,
                                   TensorView<const float> lse, const AttentionDims& dims, const AttentionOptions& opts,
                                   double scale);

// The backwards on own kernels sum one block of keys' dK and dV transposed (dkt [d × ld],
// dvt [d_v × ld]); this writes keys [j0, j0 + keys) of batch·head bh into dk (times dk_factor)
// and dv, [B, H, n_k, d] and [B, H, n_k, d_v].
void store_key_gradients(const float* dkt, const float* dvt, int64_t ld, float dk_factor, const AttentionDims& d,
                         int64_t bh, int64_t j0, int64_t keys, float* dk, float* dv);

// The last step of the backwards on own kernels (backward_f32.cc, backward_bf16.cc): dq (zero,
// [B, H, n_q, d]) = scale·Σ_s sums[s], where sums holds one unscaled dQ sum per key split
// (KeySplits), [splits, B·H, n_q, ld] with ld ≥ d.
void add_dq_sums(const float* sums, int64_t splits, int64_t ld, const AttentionDims& d, float scale, float* dq);

// How the float32 kernels apply the scale: scale = pre·post, q multiplied by pre before the
// products and the products by post after. pre = scale, post = 1 (scaling q first keeps q·kᵀ from
// overflowing before a small scale shrinks it), unless pre·q could overflow (|q|·|scale| past
// 2^120, |scale| > 1 with |q| near the float32 limit): then post is a power of two 2^e > 0 (exact,
// and the row maxima keep their rows, which a negative factor after the product would not).
struct ScaleSplit {
  float pre = 1, post = 1;
  ScaleSplit(const AttentionDims& d, double scale) : pre(static_cast<float>(scale)) {
    if (d.q_max * std::abs(scale) > 0x1p120) {
      // e ≤ 127 keeps post finite; past |q|·|scale| = 2^247 pre·q may still overflow, and the
      // forward reports the overflow as an error.
      const int e = std::min(127, static_cast<int>(std::ceil(std::log2(d.q_max * std::abs(scale)))) - 120);
      post = std::ldexp(1.0f, e);
      pre = static_cast<float>(std::ldexp(scale, -e));
    }
  }
};

// How a backward spreads one batch·head's keys over workers: one task per batch·head when there
// are at least as many of them as workers, otherwise up to ⌈workers / batch·heads⌉ ranges of
// whole `block`-key blocks each, every range with its own dQ sums, added at the end (no atomics).
struct KeySplits {
  int64_t blocks, splits, block, n_k;
  KeySplits(const AttentionDims& d, int64_t block_keys, int workers)
      : blocks((d.n_k + block_keys - 1) / block_keys), splits(1), block(block_keys), n_k(d.n_k) {
    if (d.bh() < workers) splits = std::max<int64_t>(1, std::min<int64_t>((workers + d.bh() - 1) / d.bh(), blocks));
  }
  int64_t begin(int64_t s) const { return blocks * s / splits * block; }
  int64_t end(int64_t s) const { return std::min(n_k, blocks * (s + 1) / splits * block); }
};

// A backward's saved out [B, H, n_q, d_v] (finite) and lse [B, H, n_q] (finite or −inf), checked.
template <class T>
void check_saved(const char* fn, TensorView<const T> out, TensorView<const T> lse, const AttentionDims& dims);

// x [n × w] (row-major) into rows of ld ≥ w values (the padding left as it is found: callers
// zero it), for products that read whole padded rows.
template <class T>
void pad_rows(const T* x, int64_t n, int64_t w, int64_t ld, T* out) {
  for (int64_t i = 0; i < n; ++i) std::copy_n(x + i * w, w, out + i * ld);
}

// x [n × w] (row-major) into its transpose [w × ld_t], 32 rows at a time: each output row gets
// one run of 32 values while the 32 input rows stay in L1 (row by row, the transposes were 30% of
// a bfloat16 backward at n = 1024). The backwards' operands for products that need rows of xᵀ.
template <class T>
void transpose_rows(const T* x, int64_t n, int64_t w, int64_t ld_t, T* out) {
  for (int64_t i0 = 0; i0 < n; i0 += 32) {
    const int64_t rows = std::min<int64_t>(32, n - i0);
    for (int64_t f = 0; f < w; ++f)
      for (int64_t i = 0; i < rows; ++i) out[f * ld_t + i0 + i] = x[(i0 + i) * w + f];
  }
}

// The operand layout of the bfloat16 products (AMX B tiles, vdpbf16ps B vectors): 16 rows of
// 32 bfloat16 (16 pairs) per tile.
inline constexpr int64_t kTileRows = 16;
inline constexpr int64_t kTileDepth = 32;  // bfloat16 per tile row: the inner dimension of one product
inline constexpr int64_t kTileElems = kTileRows * kTileDepth;
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
// Rows of k [n_k × d] as the columns of a product (S = Q·Kᵀ): per 16 rows and 32 features one
// tile whose row p holds the feature pair p of the 16 rows; tile (t, c) at (t·d_chunks + c)·512.
// Rows of v [n_k × dv] as the inner dimension of a product (O = P·V): per 32 rows and 16
// columns one tile whose row r holds (v[2r][c], v[2r+1][c]); tile (t, cc) at (t·v_chunks + cc)·512.
// Both leave the padding as they find it (callers zero it).
void tile_keys(const bfloat16* k, int64_t n_k, int64_t d, int64_t d_chunks, bfloat16* out);
void tile_values(const bfloat16* v, int64_t n_k, int64_t dv, int64_t v_chunks, bfloat16* out);

// The bfloat16 forward with bfloat16 products (forward_bf16.cc), on AMX tiles or AVX512-BF16.
enum class Bf16Engine { amx, avx512_bf16 };
// The best engine this machine has (AMX, then AVX512-BF16), or none.
std::optional<Bf16Engine> bf16_engine();
bool bf16_engine_usable(Bf16Engine engine);
const char* engine_name(Bf16Engine engine);
// Whether `engine` can take a checked call on this machine (engine usable, scale > 0,
// |v| ≤ 2^64, |q|·|k|·d ≤ 2^120), and the forward itself (Error otherwise).
bool bf16_tiles_usable(const AttentionDims& dims, double scale, Bf16Engine engine);
struct Bf16TilesResult {
  Tensor<bfloat16> out;  // [B, H, n_q, d_v]
  Tensor<float> lse;     // [B, H, n_q], as the float32 forward saves it
};
Bf16TilesResult forward_bf16_tiles(TensorView<const bfloat16> q, TensorView<const bfloat16> k,
                                   TensorView<const bfloat16> v, const AttentionDims& dims,
                                   const AttentionOptions& opts, double scale, Bf16Engine engine);

// The bfloat16 backward with bfloat16 products (backward_bf16.cc, AVX512-BF16): whether it can
// take a checked call (AVX512-BF16 usable, scale > 0, |v| and |dout| ≤ 2^48, every float32 sum
// bounded below 2^120), and the backward
// from the forward's out (float32) and lse, giving float32 gradients for the caller to round.
bool bf16_backward_usable(const AttentionDims& dims, double scale, double dout_max);
AttentionGrads<float> backward_bf16_products(TensorView<const bfloat16> q, TensorView<const bfloat16> k,
                                             TensorView<const bfloat16> v, TensorView<const bfloat16> dout,
                                             TensorView<const float> out, TensorView<const float> lse,
                                             const AttentionDims& dims, const AttentionOptions& opts, double scale);

}  // namespace linattn::softmax_detail
