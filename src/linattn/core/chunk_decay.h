// The decays of one chunk of decayed (gated) linear recurrences, shared by the methods whose
// state decays by log-gates g <= 0 per head or per head and channel (gated linear attention,
// the gated delta rule): cumulative log-gates in float64, the factors e^{b_j − b_i} of a
// chunk's pairs, and the two products every chunk form needs, the decayed scores (Q Kᵀ ⊙ D) and
// the weighing of rows by them. Per channel a chunk is one product when its gates decay little
// (the wide form below), else GLA's secondary chunking in blocks of 16 with no factor above 1.
// docs/methods/gated.md derives them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "linattn/core/blas.h"
#include "linattn/core/error.h"
#include "linattn/core/simd.h"
#include "linattn/tensor.h"

namespace linattn::chunk_decay {

constexpr int64_t kChunk = 64;
constexpr int64_t kBlock = 16;
constexpr int64_t kBlocks = kChunk / kBlock;
constexpr int64_t kPairs = kBlock * (kBlock + 1) / 2;
// Log-gates below this act as it: e^{−1000} is 0 in float64, and chunk sums of at most 64 such
// values keep their differences exact to ~1e−11.
constexpr double kFloor = -1000.0;
// Per channel, a chunk whose log-gates sum to at least −kWideRange in every channel (R_c =
// −b_{L−1,c} <= kWideRange) takes the wide form: with the reference ref_c = b_{L−1,c}/2,
// e^{b_j − b_i} = e^{b_j − ref}·e^{ref − b_i}, each factor within e^{±R/2} ⊆ [e^{−10}, e^{10}],
// so the scores are one product (Q ⊙ U)(K ⊙ W)ᵀ, U = e^{B − ref}, W = e^{ref − B}, and a
// weighing one product and a scaling; a factor product U_j·W_i has a few roundings, as the
// blocked form's (in float32 also the exponent b − ref, |b − ref| <= 10, rounded before exp).
// In float32, operands scaled up by at most e^{10} can overflow only where |x| > 2^113 (float64:
// 2^1009); a non-finite operand or result sends the chunk to the blocked form, so this never
// turns a finite result into an overflow. Scaled down by at most e^{10}, an operand is
// subnormal only where |x| < 2^-111 (float64: 2^-1007), which loses digits of terms below
// ~2^-126 rather than failing (the blocked form's factors reach e^{−20} too). (GLA's gates,
// log σ(x)/16, sum to about −3 over 64 steps: the wide form.) Per head, the same factors in
// float64 give the decay matrix D_ji = U_j·W_i from 2L exponentials instead of L², rounded once.
constexpr double kWideRange = 20.0;

// Every log-gate <= 0 (−inf allowed), never NaN or positive; the first bad one named.
template <class T>
void check_log_gates(const char* fn, const char* name, TensorView<const T> g) {
  for (int64_t i = 0; i < g.size(); ++i) {
    const double x = static_cast<double>(g.data[i]);
    require(!std::isnan(x) && x <= 0.0, fn, ": ", name, " must be <= 0 (or -inf) everywhere, got ", x,
            " at flat index ", i);
  }
}

// A chunk's decays (made once per chunk, used by the scores, the outputs and both weighings),
// with the scratch that uses them:
// - b: the cumulative log-gates (float64; [L, w], w = d_k per channel, 1 per head);
// - from_start [L, w] = e^{b_j} and to_end [L, w] = e^{b_{L−1} − b_j};
// - per head: D [L, L] (ld C);
// - per channel, the wide form (kWideRange): U and W = 1/U [L, d_k];
// - per channel, the blocked form (prepared only for a chunk that takes it: ensure_blocks()):
//   the per-step factors a = e^{g} [L, d_k], each block's pairs (simd::decay_pairs), its rows'
//   factors to the block's first row, and between[J][I] = e^{b_{r_J} − b_{e_I}} for blocks J > I.
//   In a wide chunk, steps holds the floored log-gates and the rest the previous chunk's.
template <class T>
struct ChunkDecays {
  int64_t dk, w;
  bool per_channel;
  int64_t L = 0;
  bool gates_ok = true;   // every log-gate read so far was <= 0
  bool finite = true;     // every result the worker wrote so far was finite (its caller's to set)
  std::vector<double> b;  // [C, w]
  std::vector<T> from_start, to_end;  // [C, w]
  std::vector<T> diag;                // per head: D [C, C]
  std::vector<T> steps;               // per channel, blocked: a [C, dk] (wide: the floored g)
  std::vector<T> pairs;               // per channel, blocked: [kBlocks][kPairs][dk]
  std::vector<T> to_first;            // per channel, blocked: [C, dk], e^{b_j − b_{r_J}}
  std::vector<T> between;             // per channel, blocked: [kBlocks][kBlocks][dk]
  std::vector<T> zeros;               // exp_minus_columns' shift
  std::vector<T> kt;                  // Kᵀ [dk, C], per head or (K ⊙ W)ᵀ wide (a plain product is faster than one with Bᵀ)
  std::vector<T> scaled;              // [C, dk] a chunk's rows scaled to a reference row
  std::vector<T> block_a, block_b;    // [16, dk]
  std::vector<T> weights;             // [C, C] (per head: w ⊙ D; wide: w's lower triangle)
  bool wide = false;                  // per channel: this chunk takes the wide form
  bool blocks_ready = false;          // per channel: steps, pairs, to_first and between are made
  std::vector<T> up, down;            // per channel, wide: U = e^{B − ref}, W = e^{ref − B} [C, dk]
  std::vector<double> head_up, head_down, zeros64;  // per head: U, W [C] in float64; exp's shift
  std::vector<T> ref_factor;          // wide: e^{ref_c} = e^{−R_c/2} [dk]
  std::vector<T> wide_rows;           // wide: [C, dk] Q ⊙ U, or a weighing's product
  ChunkDecays(int64_t head_dim, bool gate_per_channel)
      : dk(head_dim), w(gate_per_channel ? head_dim : 1), per_channel(gate_per_channel), b(kChunk * w),
        from_start(kChunk * w), to_end(kChunk * w), zeros(kChunk * std::max(kChunk, head_dim), T(0)),
        kt(dk * kChunk), scaled(kChunk * head_dim), block_a(std::max(kBlock, 2 * kBlocks) * head_dim),
        block_b(kBlock * head_dim), weights(kChunk * kChunk) {
    if (per_channel) {
      steps.resize(kChunk * dk);
      pairs.resize(kBlocks * kPairs * dk);
      to_first.resize(kChunk * dk);
      between.resize(kBlocks * kBlocks * dk);
      up.resize(kChunk * dk);
      down.resize(kChunk * dk);
      ref_factor.resize(dk);
      wide_rows.resize(kChunk * dk);
    } else {
      diag.resize(kChunk * kChunk);
      head_up.resize(kChunk);
      head_down.resize(kChunk);
      zeros64.resize(kChunk, 0.0);
    }
  }

  // e^{x} in place for `rows` rows of `cols` values x <= 10, ld apart (Highway's vectorised exp).
  void exp_in_place(T* x, int64_t rows, int64_t cols, int64_t ld) {
    simd::exp_minus_columns(x, static_cast<size_t>(rows), static_cast<size_t>(cols), static_cast<size_t>(ld),
                            zeros.data());
  }
  const T* block_pairs(int64_t J) const { return pairs.data() + J * kPairs * dk; }
  // Rows of block J scaled to its last row, e^{b_{e_J} − b_i}: the last row of its pairs.
  const T* to_last(int64_t J, int64_t rows) const { return block_pairs(J) + (rows - 1) * rows / 2 * dk; }
  const T* between_blocks(int64_t J, int64_t I) const { return between.data() + (J * kBlocks + I) * dk; }

  // The decays of a chunk of `rows` positions from its log-gates g [rows, w]; with state_only just
  // b, from_start and to_end (what a pass over the states alone needs).
  void prepare(const T* g, int64_t rows, bool state_only = false) {
    L = rows;
    int bad = 0;  // an integer count, which the compiler vectorises
    for (int64_t i = 0; i < L * w; ++i) bad += !(g[i] <= T(0));  // NaN fails too
    gates_ok = gates_ok && bad == 0;
    simd::floored_cumsum(g, static_cast<size_t>(L), static_cast<size_t>(w), kFloor, b.data(),
                         per_channel ? steps.data() : nullptr);
    wide = false;
    blocks_ready = false;
    if (per_channel) {
      double range = 0.0;  // max_c R_c (a NaN gate is gates_ok's to report, whichever form runs)
      for (int64_t c = 0; c < dk; ++c) range = std::max(range, -b[(L - 1) * dk + c]);
      wide = !state_only && range <= kWideRange;
      if (wide) {
        // One exponential per value: U = e^{B − ref} (exponents within ±R/2), W = 1/U, and
        // e^{B} = U·e^{ref}, e^{b_{L−1} − B} = W·e^{ref} (e^{ref} = e^{b_{L−1}/2} <= 1).
        for (int64_t j = 0; j < L; ++j)
          for (int64_t c = 0; c < dk; ++c) up[j * dk + c] = static_cast<T>(b[j * dk + c] - 0.5 * b[(L - 1) * dk + c]);
        exp_in_place(up.data(), 1, L * dk, L * dk);
        for (int64_t i = 0; i < L * dk; ++i) down[i] = T(1) / up[i];
        for (int64_t c = 0; c < dk; ++c) ref_factor[c] = static_cast<T>(std::exp(0.5 * b[(L - 1) * dk + c]));
        simd::scale_columns(up.data(), static_cast<size_t>(L), static_cast<size_t>(dk), ref_factor.data(),
                            from_start.data(), false);
        simd::scale_columns(down.data(), static_cast<size_t>(L), static_cast<size_t>(dk), ref_factor.data(),
                            to_end.data(), false);
        return;
      }
      if (state_only) {
        for (int64_t j = 0; j < L; ++j)
          for (int64_t c = 0; c < dk; ++c) {
            from_start[j * dk + c] = static_cast<T>(b[j * dk + c]);
            to_end[j * dk + c] = static_cast<T>(b[(L - 1) * dk + c] - b[j * dk + c]);
          }
        exp_in_place(from_start.data(), 1, L * dk, L * dk);
        exp_in_place(to_end.data(), 1, L * dk, L * dk);
        return;
      }
      prepare_blocks(/*rows=*/true);
      return;
    }
    for (int64_t j = 0; j < L; ++j) {
      from_start[j] = static_cast<T>(b[j]);
      to_end[j] = static_cast<T>(b[L - 1] - b[j]);
    }
    exp_in_place(from_start.data(), 1, L, L);
    exp_in_place(to_end.data(), 1, L, L);
    if (state_only) return;
    if (-b[L - 1] <= kWideRange) {  // D_ji = U_j·W_i (float64, rounded once): 2L exponentials, not L²
      for (int64_t j = 0; j < L; ++j) {
        head_up[j] = b[j] - 0.5 * b[L - 1];
        head_down[j] = -head_up[j];
      }
      simd::exp_minus_columns(head_up.data(), 1, static_cast<size_t>(L), static_cast<size_t>(L), zeros64.data());
      simd::exp_minus_columns(head_down.data(), 1, static_cast<size_t>(L), static_cast<size_t>(L), zeros64.data());
      for (int64_t j = 0; j < L; ++j) {
        T* row = diag.data() + j * kChunk;
        for (int64_t i = 0; i <= j; ++i) row[i] = static_cast<T>(head_up[j] * head_down[i]);
        std::fill(row + j + 1, row + L, T(0));
      }
      return;
    }
    // D: e^{b_j − b_i} on and below the diagonal, e^{−inf} = 0 above
    const T above = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < L; ++j) {
      T* row = diag.data() + j * kChunk;
      for (int64_t i = 0; i < L; ++i) row[i] = i <= j ? static_cast<T>(b[j] - b[i]) : above;
    }
    exp_in_place(diag.data(), L, L, kChunk);
  }

  // A wide chunk whose operands or results left the float range: the blocked form after all.
  void ensure_blocks() {
    if (!blocks_ready) prepare_blocks(/*rows=*/false);
  }

  // The blocked form's factors of the prepared chunk (per channel); with rows, also from_start
  // and to_end as their products (a wide chunk that falls back has them already, from exp).
  // The exponentials are the per-step factors e^{g} and, per block, e^{b_{r_J}} (to the block's
  // first row from the chunk's start), e^{b_{L−1} − b_{e_J}} (from its last row to the chunk's
  // end) and between[J][I]; every other factor is a product of these.
  void prepare_blocks(bool rows) {
    blocks_ready = true;
    exp_in_place(steps.data(), 1, L * dk, L * dk);
    const int64_t blocks = (L + kBlock - 1) / kBlock;
    T* edges = block_a.data();  // [2 · blocks, dk]: e^{b_{r_J}}, then e^{b_{L−1} − b_{e_J}}
    for (int64_t J = 0; J < blocks; ++J) {
      const int64_t r = J * kBlock, e = std::min(L, r + kBlock) - 1;
      for (int64_t c = 0; c < dk; ++c) {
        edges[J * dk + c] = static_cast<T>(b[r * dk + c]);
        edges[(blocks + J) * dk + c] = static_cast<T>(b[(L - 1) * dk + c] - b[e * dk + c]);
      }
      for (int64_t I = 0; I < J; ++I) {
        T* f = between.data() + (J * kBlocks + I) * dk;
        const int64_t last = I * kBlock + kBlock - 1;
        for (int64_t c = 0; c < dk; ++c) f[c] = static_cast<T>(b[r * dk + c] - b[last * dk + c]);
      }
    }
    if (rows) exp_in_place(edges, 1, 2 * blocks * dk, 2 * blocks * dk);
    exp_in_place(between.data(), 1, kBlocks * kBlocks * dk, kBlocks * kBlocks * dk);
    for (int64_t J = 0; J < blocks; ++J) {
      const int64_t r = J * kBlock, n = std::min(kBlock, L - r);
      simd::decay_pairs(steps.data() + r * dk, static_cast<size_t>(n), static_cast<size_t>(dk), pairs.data() + J * kPairs * dk);
      for (int64_t j = 0; j < n; ++j)  // e^{b_j − b_r}: the pair (j, 0)
        std::copy(block_pairs(J) + j * (j + 1) / 2 * dk, block_pairs(J) + (j * (j + 1) / 2 + 1) * dk,
                  to_first.data() + (r + j) * dk);
      if (!rows) continue;
      // e^{b_j} = e^{b_r}·e^{b_j − b_r}, e^{b_{L−1} − b_j} = e^{b_{L−1} − b_e}·e^{b_e − b_j}
      for (int64_t j = 0; j < n; ++j) {
        simd::multiply(to_first.data() + (r + j) * dk, edges + J * dk, 1, static_cast<size_t>(dk),
                       from_start.data() + (r + j) * dk, static_cast<size_t>(dk), false);
        simd::multiply(to_last(J, n) + j * dk, edges + (blocks + J) * dk, 1, static_cast<size_t>(dk),
                       to_end.data() + (r + j) * dk, static_cast<size_t>(dk), false);
      }
    }
  }

  // The decays of rows t0 .. t0+rows−1 of task `task` of log-gates g [tasks, n, w].
  void prepare_rows(TensorView<const T> g, int64_t n, int64_t task, int64_t t0, int64_t rows, bool state_only = false) {
    prepare(g.data + (task * n + t0) * w, rows, state_only);
  }

  // out [L, dk] (ld ld_out) = x ⊙ e^{B} (from the chunk's start) or x ⊙ e^{b_L − B} (to its end).
  void from_chunk_start(const T* x, T* out, int64_t ld_out) const { scale(x, from_start.data(), out, ld_out); }
  void to_chunk_end(const T* x, T* out, int64_t ld_out) const { scale(x, to_end.data(), out, ld_out); }
  void scale(const T* x, const T* factors, T* out, int64_t ld_out) const {
    if (per_channel)
      simd::multiply(x, factors, static_cast<size_t>(L), static_cast<size_t>(dk), out, static_cast<size_t>(ld_out), false);
    else
      simd::scale_rows(x, static_cast<size_t>(dk), static_cast<size_t>(L), static_cast<size_t>(dk), factors, out,
                       static_cast<size_t>(ld_out));
  }
  // The log-gates' gradient of the chunk: db [L, dk] holds each row's terms (Σ row vectors ⊙
  // their gradients − Σ column vectors ⊙ theirs, float64); the state's terms are added to the
  // last row: Σ_i k_i ⊙ k_state_i (k_state: the gradient through K ⊙ e^{b_L − B}, scaled) and
  // e^{b_L} ⊙ rowsum(G ⊙ P) (G: the gradient of the state after the chunk, P: the state before
  // it, [dk, dv]). Per head the channels are summed first (one reverse sum, one rounding). dg
  // [L, w] = the reverse cumulative sum; a log-gate g at or below the floor acts as −1000,
  // e^{−1000}·(…) = 0, so it gets none.
  void gate_gradients(std::vector<double>& db, const T* k, const T* k_state, const T* G, const T* P, int64_t dv,
                      const T* g, T* dg) const {
    for (int64_t e = 0; e < dk; ++e) {
      double extra = 0.0;
      for (int64_t i = 0; i < L; ++i) extra += static_cast<double>(k[i * dk + e]) * static_cast<double>(k_state[i * dk + e]);
      double gp = 0.0;
      for (int64_t f = 0; f < dv; ++f) gp += static_cast<double>(G[e * dv + f]) * static_cast<double>(P[e * dv + f]);
      db[(L - 1) * dk + e] += extra + std::exp(b[(L - 1) * w + (per_channel ? e : 0)]) * gp;
    }
    if (!per_channel)
      for (int64_t j = 0; j < L; ++j) {
        double row = 0.0;
        for (int64_t e = 0; e < dk; ++e) row += db[j * dk + e];
        db[j] = row;
      }
    for (int64_t e = 0; e < w; ++e) {
      double acc = 0.0;
      for (int64_t j = L - 1; j >= 0; --j) {
        acc += db[j * w + e];
        dg[j * w + e] = static_cast<double>(g[j * w + e]) <= kFloor ? T(0) : static_cast<T>(acc);
      }
    }
  }

  // x [dk, cols] (rows = channels) ⊙= e^{b_L} per channel: the state's (or G's) decay over the chunk.
  void decay_over_chunk(T* x, int64_t cols) const {
    const T* last = from_start.data() + (L - 1) * w;
    if (per_channel)
      simd::scale_rows(x, static_cast<size_t>(cols), static_cast<size_t>(dk), static_cast<size_t>(cols), last, x,
                       static_cast<size_t>(cols));
    else
      simd::scale(x, static_cast<size_t>(dk * cols), last[0]);
  }
};

// The wide form of chunk_scores (s.wide): A = (Q ⊙ U)(K ⊙ W)ᵀ, lower. False, with A unspecified,
// when an operand or a score is not finite.
template <class T>
bool wide_scores(const T* q, const T* k, ChunkDecays<T>& s, T* a, int64_t lda) {
  const int64_t L = s.L, dk = s.dk;
  T* qu = s.wide_rows.data();
  simd::multiply(q, s.up.data(), static_cast<size_t>(L), static_cast<size_t>(dk), qu, static_cast<size_t>(dk), false);
  for (int64_t i = 0; i < L; ++i)  // (K ⊙ W)ᵀ: a plain product is faster than one with Bᵀ
    for (int64_t c = 0; c < dk; ++c) s.kt[c * kChunk + i] = k[i * dk + c] * s.down[i * dk + c];
  if (!simd::all_finite(qu, static_cast<size_t>(L * dk))) return false;
  for (int64_t c = 0; c < dk; ++c)
    if (!simd::all_finite(s.kt.data() + c * kChunk, static_cast<size_t>(L))) return false;
  matmul<T>(mat(a, L, L, lda), mat<const T>(qu, L, dk), mat<const T>(s.kt.data(), dk, L, kChunk));
  bool finite = true;
  for (int64_t j = 0; j < L; ++j) {
    std::fill(a + j * lda + j + 1, a + j * lda + L, T(0));
    finite = finite && simd::all_finite(a + j * lda, static_cast<size_t>(j + 1));
  }
  return finite;
}

// A [L, L] (ld lda), lower triangle with the diagonal: A[j,i] = Σ_c q_jc k_ic e^{b_jc − b_ic};
// zero above.
template <class T>
void chunk_scores(const T* q, const T* k, ChunkDecays<T>& s, T* a, int64_t lda) {
  const int64_t L = s.L, dk = s.dk;
  if (!s.per_channel) {  // A = (Q Kᵀ) ⊙ D, D zero above the diagonal
    for (int64_t i = 0; i < L; ++i)
      for (int64_t c = 0; c < dk; ++c) s.kt[c * kChunk + i] = k[i * dk + c];
    matmul<T>(mat(a, L, L, lda), mat(q, L, dk), mat<const T>(s.kt.data(), dk, L, kChunk));
    for (int64_t j = 0; j < L; ++j)
      simd::multiply(a + j * lda, s.diag.data() + j * kChunk, 1, static_cast<size_t>(L), a + j * lda,
                     static_cast<size_t>(L), false);
    return;
  }
  if (s.wide && wide_scores(q, k, s, a, lda)) return;
  s.ensure_blocks();
  // K̃ = each block's K scaled to the block's last row
  for (int64_t I = 0; I * kBlock < L; ++I) {
    const int64_t r = I * kBlock, n = std::min(kBlock, L - r);
    simd::multiply(k + r * dk, s.to_last(I, n), static_cast<size_t>(n), static_cast<size_t>(dk),
                   s.scaled.data() + r * dk, static_cast<size_t>(dk), false);
  }
  for (int64_t J = 0; J * kBlock < L; ++J) {
    const int64_t r = J * kBlock, n = std::min(kBlock, L - r);
    if (J > 0)  // Q̂_J = Q_J scaled to the block's first row
      simd::multiply(q + r * dk, s.to_first.data() + r * dk, static_cast<size_t>(n), static_cast<size_t>(dk),
                     s.block_a.data(), static_cast<size_t>(dk), false);
    for (int64_t I = 0; I < J; ++I) {  // A_JI = (Q̂_J ⊙ e^{b_{r_J} − b_{e_I}}) K̃_Iᵀ
      simd::scale_columns(s.block_a.data(), static_cast<size_t>(n), static_cast<size_t>(dk), s.between_blocks(J, I),
                          s.block_b.data(), false);
      matmul<T>(mat(a + r * lda + I * kBlock, n, kBlock, lda), mat<const T>(s.block_b.data(), n, dk),
                mat<const T>(s.scaled.data() + I * kBlock * dk, kBlock, dk).t());
    }
    simd::decayed_dots(q + r * dk, k + r * dk, s.block_pairs(J), static_cast<size_t>(n), static_cast<size_t>(dk),
                       a + r * lda + r, static_cast<size_t>(lda));
    for (int64_t j = 0; j < n; ++j) std::fill(a + (r + j) * lda + r + j + 1, a + (r + j) * lda + L, T(0));
  }
}

// The wide form of weigh (s.wide): y_j += U_j ⊙ Σ_{i<=j} w[j,i] (x_i ⊙ W_i), or
// y_i += W_i ⊙ Σ_{j>=i} w[j,i] (x_j ⊙ U_j) (later). False, with y untouched, when the scaled
// operand or the product is not finite.
template <class T>
bool wide_weigh(const T* w, const T* x, ChunkDecays<T>& s, T* y, bool later) {
  const int64_t L = s.L, dk = s.dk;
  simd::multiply(x, later ? s.up.data() : s.down.data(), static_cast<size_t>(L), static_cast<size_t>(dk),
                 s.scaled.data(), static_cast<size_t>(dk), false);
  if (!simd::all_finite(s.scaled.data(), static_cast<size_t>(L * dk))) return false;
  for (int64_t j = 0; j < L; ++j) {  // w's lower triangle (what the blocked form reads)
    std::copy(w + j * kChunk, w + j * kChunk + j + 1, s.weights.data() + j * kChunk);
    std::fill(s.weights.data() + j * kChunk + j + 1, s.weights.data() + j * kChunk + L, T(0));
  }
  const Mat<const T> weights = mat<const T>(s.weights.data(), L, L, kChunk);
  matmul<T>(mat(s.wide_rows.data(), L, dk), later ? weights.t() : weights, mat<const T>(s.scaled.data(), L, dk));
  if (!simd::all_finite(s.wide_rows.data(), static_cast<size_t>(L * dk))) return false;
  simd::multiply(s.wide_rows.data(), later ? s.down.data() : s.up.data(), static_cast<size_t>(L),
                 static_cast<size_t>(dk), y, static_cast<size_t>(dk), true);
  return true;
}

// y [L, dk] += Σ_{i<=j} w[j,i] x_i ⊙ e^{b_j − b_i} (later false), or
// y [L, dk] += Σ_{j>=i} w[j,i] x_j ⊙ e^{b_j − b_i} (later true); w lower, ld kChunk.
template <class T>
void weigh(const T* w, const T* x, ChunkDecays<T>& s, T* y, bool later) {
  const int64_t L = s.L, dk = s.dk;
  if (!s.per_channel) {  // y += (w ⊙ D) X, or (w ⊙ D)ᵀ X
    for (int64_t j = 0; j < L; ++j)
      simd::multiply(w + j * kChunk, s.diag.data() + j * kChunk, 1, static_cast<size_t>(L),
                     s.weights.data() + j * kChunk, static_cast<size_t>(L), false);
    const Mat<const T> weights = mat<const T>(s.weights.data(), L, L, kChunk);
    matmul<T>(mat(y, L, dk), later ? weights.t() : weights, mat(x, L, dk), T(1), T(1));
    return;
  }
  if (s.wide && wide_weigh(w, x, s, y, later)) return;
  s.ensure_blocks();
  // Between blocks J > I: e^{b_j − b_i} = e^{b_j − b_{r_J}}·e^{b_{r_J} − b_{e_I}}·e^{b_{e_I} − b_i}.
  // X scaled to its blocks' last rows (earlier) or first rows (later), once.
  for (int64_t B = 0; B * kBlock < L; ++B) {
    const int64_t r = B * kBlock, n = std::min(kBlock, L - r);
    simd::multiply(x + r * dk, later ? s.to_first.data() + r * dk : s.to_last(B, n), static_cast<size_t>(n),
                   static_cast<size_t>(dk), s.scaled.data() + r * dk, static_cast<size_t>(dk), false);
  }
  for (int64_t R = 0; R * kBlock < L; ++R) {  // the block of rows of y
    const int64_t r = R * kBlock, n = std::min(kBlock, L - r);
    bool any = false;
    const int64_t first = later ? R + 1 : 0, end = later ? (L + kBlock - 1) / kBlock : R;
    for (int64_t O = first; O < end; ++O) {  // the other block
      const int64_t ro = O * kBlock, no = std::min(kBlock, L - ro);
      if (later)  // Σ_j w[j,i] x̂_j: w_ORᵀ X̂_O
        matmul<T>(mat(s.block_b.data(), n, dk), mat<const T>(w + ro * kChunk + r, no, n, kChunk).t(),
                  mat<const T>(s.scaled.data() + ro * dk, no, dk));
      else  // Σ_i w[j,i] x̃_i: w_RO X̃_O
        matmul<T>(mat(s.block_b.data(), n, dk), mat<const T>(w + r * kChunk + ro, n, no, kChunk),
                  mat<const T>(s.scaled.data() + ro * dk, no, dk));
      simd::scale_columns(s.block_b.data(), static_cast<size_t>(n), static_cast<size_t>(dk),
                          later ? s.between_blocks(O, R) : s.between_blocks(R, O), s.block_a.data(), any);
      any = true;
    }
    if (any)  // y_R += acc ⊙ (its rows' factors to the block's last row (later) or from its first)
      simd::multiply(s.block_a.data(), later ? s.to_last(R, n) : s.to_first.data() + r * dk, static_cast<size_t>(n),
                     static_cast<size_t>(dk), y + r * dk, static_cast<size_t>(dk), true);
    simd::decayed_weigh(w + r * kChunk + r, kChunk, x + r * dk, s.block_pairs(R), static_cast<size_t>(n),
                        static_cast<size_t>(dk), y + r * dk, later);
  }
}

// Whether every worker's decays (a PerWorker of ChunkDecays or of a type built on it) read
// good log-gates and wrote finite results.
template <class Workers>
bool all_ok(Workers& workers) {
  for (int w = 0; w < workers.size(); ++w)
    if (!workers[w].gates_ok || !workers[w].finite) return false;
  return true;
}

}  // namespace linattn::chunk_decay
