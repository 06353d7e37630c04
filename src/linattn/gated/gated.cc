// Gated linear attention (include/linattn/gated.h), chunked, per (batch, head) task:
//
// In a chunk of L <= 64 positions starting from the state P (the state before it), with the
// cumulative log-gates b_j = Σ_{i<=j} g_i per channel (in float64, from the chunk's start):
//   o_j = s·(q_j ⊙ e^{b_j})ᵀ P + s·Σ_{i<=j} A[j,i] v_i,   A[j,i] = Σ_c q_jc k_ic e^{b_jc − b_ic}
//   P'  = diag(e^{b_L})·P + Σ_i (k_i ⊙ e^{b_L − b_i}) v_iᵀ
// Every exponent used is <= 0, so no factor exceeds 1: A's blocks of 16×16 below the diagonal
// are products Q̂_J K̂_Iᵀ with Q̂_J = Q_J ⊙ e^{B_J − b_r}, K̂_I = K_I ⊙ e^{b_r − B_I} referenced to
// the block's first row r (GLA's secondary chunking); the diagonal blocks are summed term by
// term. A per-head gate is the per-channel one with every channel alike.
//
// Backward (G: the gradient of the state after the chunk, dS_n for the last):
//   dA = s·dO Vᵀ (lower), dV = s·Aᵀ dO + K̂ G, K̂ = K ⊙ e^{b_L − B}
//   dq_j = s·e^{b_j} ⊙ (P dO_j) + Σ_{i<=j} dA[j,i] k_i ⊙ e^{b_j − b_i}
//   dk_i = Σ_{j>=i} dA[j,i] q_j ⊙ e^{b_j − b_i} + (G v_i) ⊙ e^{b_L − b_i}
//   db_j = q_j ⊙ dq_j − k_j ⊙ dk_j, and for j = L: + Σ_i k_i ⊙ (G v_i) ⊙ e^{b_L − b_i}
//          + e^{b_L} ⊙ rowsum(G ⊙ P);  dg_t = Σ_{j>=t} db_j (in the chunk)
//   G ← diag(e^{b_L}) G + s·(Q ⊙ e^{B})ᵀ dO, and dS_0 = G after the first chunk.
// The states at the chunks' starts are kept from a forward pass over the task's chunks.
#include "linattn/gated.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "linattn/core/blas.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/simd.h"

namespace linattn {
namespace gated {

constexpr int64_t kChunk = 64;
constexpr int64_t kBlock = 16;
// Log-gates below this act as it: e^{−1000} is 0 in float64, and chunk sums of at most 64 such
// values keep their differences exact to ~1e−11.
constexpr double kFloor = -1000.0;

struct Dims {
  int64_t batch, heads, n, dk, dv;
  bool per_channel;
  bool has_state;
  double scale;
  int64_t bh() const { return batch * heads; }
};

template <class T>
void check_finite(const char* fn, const char* name, TensorView<const T> x) {
  const int64_t size = x.size();
  if (simd::all_finite(x.data, static_cast<size_t>(size))) return;  // vectorised; the index only when needed
  for (int64_t i = 0; i < size; ++i)
    require(std::isfinite(static_cast<double>(x.data[i])), fn, ": ", name, " holds a non-finite value at flat index ",
            i, " (", static_cast<double>(x.data[i]), ")");
}

template <class T>
void check_shape(const char* fn, const char* name, TensorView<const T> x, const Shape& want) {
  require(x.shape == want, fn, ": ", name, " has shape ", shape_string(x.shape), "; expected ", shape_string(want));
}

template <class T>
Dims check_args(const char* fn, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                TensorView<const T> log_gate, TensorView<const T> initial_state,
                const GatedLinearAttentionOptions& opts) {
  require(opts.causal, fn, ": causal=false is not supported: the gates decay the state along the sequence, so "
          "each output reads the state at its own position");
  require(q.rank() == 4, fn, ": q must be [batch, heads, seq, d_k], got shape ", shape_string(q.shape));
  require(v.rank() == 4, fn, ": v must be [batch, heads, seq, d_v], got shape ", shape_string(v.shape));
  Dims d{q.dim(0), q.dim(1), q.dim(2), q.dim(3), v.dim(3), false, initial_state.data != nullptr, 0.0};
  require(d.dk >= 1 && d.dv >= 1, fn, ": head dimensions must be >= 1, got d_k = ", d.dk, ", d_v = ", d.dv);
  check_shape(fn, "k", k, q.shape);
  check_shape(fn, "v", v, {d.batch, d.heads, d.n, d.dv});
  if (log_gate.rank() == 4) {
    check_shape(fn, "log_gate", log_gate, q.shape);
    d.per_channel = true;
  } else {
    require(log_gate.rank() == 3 && log_gate.shape == Shape{d.batch, d.heads, d.n}, fn, ": log_gate has shape ",
            shape_string(log_gate.shape), "; expected [batch, heads, seq] = ",
            shape_string({d.batch, d.heads, d.n}), " (per head) or ", shape_string(q.shape), " (per channel)");
  }
  check_finite(fn, "q", q);
  check_finite(fn, "k", k);
  check_finite(fn, "v", v);
  const int64_t gates = log_gate.size();
  bool gates_ok = true;  // a branch-free pass first (NaN fails <=), the index only when needed
  for (int64_t i = 0; i < gates; ++i) gates_ok &= log_gate.data[i] <= T(0);
  for (int64_t i = 0; i < gates && !gates_ok; ++i) {
    const double g = static_cast<double>(log_gate.data[i]);
    require(!std::isnan(g) && g <= 0.0, fn, ": log_gate must be <= 0 (or -inf) everywhere, got ", g,
            " at flat index ", i);
  }
  if (d.has_state) {
    check_shape(fn, "initial_state", initial_state, {d.batch, d.heads, d.dk, d.dv});
    check_finite(fn, "initial_state", initial_state);
  }
  if (opts.scale) {
    require(std::isfinite(*opts.scale), fn, ": scale must be finite, got ", *opts.scale);
    d.scale = *opts.scale;
  } else {
    d.scale = 1.0 / std::sqrt(static_cast<double>(d.dk));
  }
  return d;
}

// One worker's scratch for one chunk, and the chunk's decays: the cumulative log-gates b
// (float64; [L, w], w = d_k per channel, 1 per head) and the factors e^{b_j − b_i} of the
// diagonal blocks (per channel: [L/16][136 pairs j >= i][d_k]; per head: the lower triangle of
// [C, C]), made once per chunk and used by the scores and both weighings.
template <class T>
struct Scratch {
  int64_t dk, w;
  bool per_channel;
  int64_t L = 0;
  std::vector<double> b;            // [C, w]
  std::vector<T> diag;              // the diagonal blocks' (per channel) or the chunk's (per head) decays
  std::vector<T> factors;           // [C, dk] row factors
  std::vector<T> zeros;             // exp_minus_columns' shift
  std::vector<T> gated_q;           // [C, dk] Q ⊙ e^{B}
  std::vector<T> gated_k;           // [C, dk] K ⊙ e^{b_L − B}
  std::vector<T> scores;            // [C, C] A (lower)
  std::vector<T> block_a, block_b;  // [16, dk]
  std::vector<T> work;              // [C, dk]
  std::vector<T> weights;           // [C, C] (per head: dA ⊙ D)
  std::vector<T> dscores;           // [C, C]
  std::vector<T> dk_state;          // [C, dk]
  Scratch(const Dims& d, bool backward)
      : dk(d.dk), w(d.per_channel ? d.dk : 1), per_channel(d.per_channel), b(kChunk * w),
        diag(per_channel ? (kChunk / kBlock) * kPairs * d.dk : kChunk * kChunk), factors(kChunk * d.dk),
        zeros(std::max<int64_t>(kChunk * kChunk, (kChunk / kBlock) * kPairs * d.dk)), gated_q(kChunk * d.dk),
        gated_k(kChunk * d.dk), scores(kChunk * kChunk), block_a(kBlock * d.dk), block_b(kBlock * d.dk),
        work(kChunk * d.dk), weights(kChunk * kChunk) {
    if (backward) {
      dscores.resize(kChunk * kChunk);
      dk_state.resize(kChunk * d.dk);
    }
  }
  static constexpr int64_t kPairs = kBlock * (kBlock + 1) / 2;
  static int64_t pair(int64_t j, int64_t i) { return j * (j + 1) / 2 + i; }  // in-block j >= i

  // e^{x} in place for n values x <= 0 (Highway's vectorised exp).
  void exp_in_place(T* x, int64_t n) {
    simd::exp_minus_columns(x, 1, static_cast<size_t>(n), static_cast<size_t>(n), zeros.data());
  }

  // b of rows t0 .. t0+L−1 of task bh, and the diagonal decays.
  void prepare(const Dims& d, TensorView<const T> log_gate, int64_t bh, int64_t t0, int64_t rows) {
    L = rows;
    for (int64_t j = 0; j < L; ++j)
      for (int64_t c = 0; c < w; ++c) {
        const double g = static_cast<double>(log_gate.data[(bh * d.n + t0 + j) * w + c]);
        b[j * w + c] = (j ? b[(j - 1) * w + c] : 0.0) + std::max(g, kFloor);
      }
    if (per_channel) {
      for (int64_t j0 = 0; j0 < L; j0 += kBlock) {
        T* e = diag.data() + (j0 / kBlock) * kPairs * dk;
        const int64_t rows_in = std::min(kBlock, L - j0);
        for (int64_t j = 0; j < rows_in; ++j)
          for (int64_t i = 0; i <= j; ++i)
            for (int64_t c = 0; c < dk; ++c)
              e[pair(j, i) * dk + c] = static_cast<T>(b[(j0 + j) * dk + c] - b[(j0 + i) * dk + c]);
        exp_in_place(e, pair(rows_in - 1, rows_in - 1) * dk + dk);
      }
    } else {
      for (int64_t j = 0; j < L; ++j) {
        T* row = diag.data() + j * kChunk;
        for (int64_t i = 0; i <= j; ++i) row[i] = static_cast<T>(b[j] - b[i]);
        exp_in_place(row, j + 1);
      }
    }
  }

  // out[j, :] = x[j, :] ⊙ e^{sign·(b_{j0+j} − b_r)} for `rows` rows (r < 0: b_r = 0).
  void scale_rows(const T* x, int64_t j0, int64_t rows, int64_t r, double sign, T* out) {
    if (!per_channel) {
      for (int64_t j = 0; j < rows; ++j) {
        const T f = static_cast<T>(std::exp(sign * (b[j0 + j] - (r < 0 ? 0.0 : b[r]))));
        for (int64_t c = 0; c < dk; ++c) out[j * dk + c] = x[j * dk + c] * f;
      }
      return;
    }
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t c = 0; c < dk; ++c)
        factors[j * dk + c] = static_cast<T>(sign * (b[(j0 + j) * dk + c] - (r < 0 ? 0.0 : b[r * dk + c])));
    exp_in_place(factors.data(), rows * dk);
    for (int64_t i = 0; i < rows * dk; ++i) out[i] = x[i] * factors[i];
  }

  // The state's decay over the chunk in channel c: e^{b_{L−1,c}}.
  double last_decay(int64_t c) const { return std::exp(b[(L - 1) * w + (per_channel ? c : 0)]); }
};

// A [L, L] (ld kChunk), lower triangle with the diagonal: A[j,i] = Σ_c q_jc k_ic e^{b_jc − b_ic};
// zero above.
template <class T>
void chunk_scores(const T* q, const T* k, Scratch<T>& s, T* a) {
  const int64_t L = s.L, dk = s.dk;
  if (!s.per_channel) {  // A = (Q Kᵀ) ⊙ D
    matmul<T>(mat(a, L, L, kChunk), mat(q, L, dk), mat(k, L, dk).t());
    for (int64_t j = 0; j < L; ++j) {
      for (int64_t i = 0; i <= j; ++i) a[j * kChunk + i] *= s.diag[j * kChunk + i];
      std::fill(a + j * kChunk + j + 1, a + j * kChunk + L, T(0));
    }
    return;
  }
  for (int64_t j0 = 0; j0 < L; j0 += kBlock) {
    const int64_t rows = std::min(kBlock, L - j0);
    if (j0 > 0) s.scale_rows(q + j0 * dk, j0, rows, j0, 1.0, s.block_a.data());  // referenced to row j0
    for (int64_t i0 = 0; i0 < j0; i0 += kBlock) {
      s.scale_rows(k + i0 * dk, i0, kBlock, j0, -1.0, s.block_b.data());
      matmul<T>(mat(a + j0 * kChunk + i0, rows, kBlock, kChunk), mat<const T>(s.block_a.data(), rows, dk),
                mat<const T>(s.block_b.data(), kBlock, dk).t());
    }
    const T* e = s.diag.data() + (j0 / kBlock) * Scratch<T>::kPairs * dk;
    for (int64_t j = 0; j < rows; ++j) {
      for (int64_t i = 0; i <= j; ++i) {
        const T* qj = q + (j0 + j) * dk;
        const T* ki = k + (j0 + i) * dk;
        const T* eji = e + Scratch<T>::pair(j, i) * dk;
        T acc = 0;
        for (int64_t c = 0; c < dk; ++c) acc += qj[c] * ki[c] * eji[c];
        a[(j0 + j) * kChunk + j0 + i] = acc;
      }
      std::fill(a + (j0 + j) * kChunk + j0 + j + 1, a + (j0 + j) * kChunk + L, T(0));
    }
  }
}

// y [L, dk] += Σ_{i<=j} w[j,i] x_i ⊙ e^{b_j − b_i} (w lower, ld kChunk).
template <class T>
void weigh_earlier(const T* w, const T* x, Scratch<T>& s, T* y) {
  const int64_t L = s.L, dk = s.dk;
  if (!s.per_channel) {  // y += (w ⊙ D) X
    for (int64_t j = 0; j < L; ++j)
      for (int64_t i = 0; i < L; ++i) s.weights[j * kChunk + i] = i <= j ? w[j * kChunk + i] * s.diag[j * kChunk + i] : T(0);
    matmul<T>(mat(y, L, dk), mat<const T>(s.weights.data(), L, L, kChunk), mat(x, L, dk), T(1), T(1));
    return;
  }
  for (int64_t j0 = 0; j0 < L; j0 += kBlock) {
    const int64_t rows = std::min(kBlock, L - j0);
    if (j0 > 0) {
      std::fill(s.block_a.begin(), s.block_a.begin() + rows * dk, T(0));
      for (int64_t i0 = 0; i0 < j0; i0 += kBlock) {
        s.scale_rows(x + i0 * dk, i0, kBlock, j0, -1.0, s.block_b.data());
        matmul<T>(mat(s.block_a.data(), rows, dk), mat<const T>(w + j0 * kChunk + i0, rows, kBlock, kChunk),
                  mat<const T>(s.block_b.data(), kBlock, dk), T(1), T(1));
      }
      s.scale_rows(s.block_a.data(), j0, rows, j0, 1.0, s.block_b.data());
      for (int64_t i = 0; i < rows * dk; ++i) y[j0 * dk + i] += s.block_b[i];
    }
    const T* e = s.diag.data() + (j0 / kBlock) * Scratch<T>::kPairs * dk;
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t i = 0; i <= j; ++i) {
        const T wji = w[(j0 + j) * kChunk + j0 + i];
        if (wji == T(0)) continue;
        const T* xi = x + (j0 + i) * dk;
        const T* eji = e + Scratch<T>::pair(j, i) * dk;
        T* yj = y + (j0 + j) * dk;
        for (int64_t c = 0; c < dk; ++c) yj[c] += wji * xi[c] * eji[c];
      }
  }
}

// y [L, dk] += Σ_{j>=i} w[j,i] x_j ⊙ e^{b_j − b_i} (w lower, ld kChunk).
template <class T>
void weigh_later(const T* w, const T* x, Scratch<T>& s, T* y) {
  const int64_t L = s.L, dk = s.dk;
  if (!s.per_channel) {  // y += (w ⊙ D)ᵀ X
    for (int64_t j = 0; j < L; ++j)
      for (int64_t i = 0; i < L; ++i) s.weights[j * kChunk + i] = i <= j ? w[j * kChunk + i] * s.diag[j * kChunk + i] : T(0);
    matmul<T>(mat(y, L, dk), mat<const T>(s.weights.data(), L, L, kChunk).t(), mat(x, L, dk), T(1), T(1));
    return;
  }
  for (int64_t i0 = 0; i0 < L; i0 += kBlock) {
    const int64_t cols = std::min(kBlock, L - i0);
    for (int64_t j0 = i0 + kBlock; j0 < L; j0 += kBlock) {
      const int64_t rows = std::min(kBlock, L - j0);
      s.scale_rows(x + j0 * dk, j0, rows, j0, 1.0, s.block_a.data());
      matmul<T>(mat(s.block_b.data(), cols, dk), mat<const T>(w + j0 * kChunk + i0, rows, cols, kChunk).t(),
                mat<const T>(s.block_a.data(), rows, dk));
      s.scale_rows(s.block_b.data(), i0, cols, j0, -1.0, s.block_a.data());  // ⊙ e^{b_{j0} − b_i}
      for (int64_t i = 0; i < cols * dk; ++i) y[i0 * dk + i] += s.block_a[i];
    }
    const T* e = s.diag.data() + (i0 / kBlock) * Scratch<T>::kPairs * dk;
    for (int64_t i = 0; i < cols; ++i)
      for (int64_t j = i; j < cols; ++j) {
        const T wji = w[(i0 + j) * kChunk + i0 + i];
        if (wji == T(0)) continue;
        const T* xj = x + (i0 + j) * dk;
        const T* eji = e + Scratch<T>::pair(j, i) * dk;
        T* yi = y + (i0 + i) * dk;
        for (int64_t c = 0; c < dk; ++c) yi[c] += wji * xj[c] * eji[c];
      }
  }
}

// One chunk of the forward (s prepared): out rows (written), and the state P advanced in place.
template <class T>
void forward_chunk(const Dims& d, const T* q, const T* k, const T* v, T* state, T* out, Scratch<T>& s) {
  const int64_t dk = d.dk, dv = d.dv, L = s.L;
  const T sc = static_cast<T>(d.scale);
  s.scale_rows(q, 0, L, -1, 1.0, s.gated_q.data());  // Q ⊙ e^{B}
  matmul<T>(mat(out, L, dv), mat<const T>(s.gated_q.data(), L, dk), mat<const T>(state, dk, dv), sc);
  chunk_scores(q, k, s, s.scores.data());
  matmul<T>(mat(out, L, dv), mat<const T>(s.scores.data(), L, L, kChunk), mat<const T>(v, L, dv), sc, T(1));
  s.scale_rows(k, 0, L, L - 1, -1.0, s.gated_k.data());  // K ⊙ e^{b_L − B}
  for (int64_t c = 0; c < dk; ++c) {
    const T decay = static_cast<T>(s.last_decay(c));
    for (int64_t e = 0; e < dv; ++e) state[c * dv + e] *= decay;
  }
  matmul<T>(mat(state, dk, dv), mat<const T>(s.gated_k.data(), L, dk).t(), mat<const T>(v, L, dv), T(1), T(1));
}

}  // namespace gated

template <class T>
GatedLinearAttentionResult<T> gated_linear_attention(TensorView<const T> q, TensorView<const T> k,
                                                     TensorView<const T> v, TensorView<const T> log_gate,
                                                     TensorView<const T> initial_state,
                                                     const GatedLinearAttentionOptions& opts) {
  const char* fn = "gated_linear_attention";
  const gated::Dims d = gated::check_args(fn, q, k, v, log_gate, initial_state, opts);
  GatedLinearAttentionResult<T> r{Tensor<T>({d.batch, d.heads, d.n, d.dv}, false, Init::Uninitialized),
                                  Tensor<T>({d.batch, d.heads, d.dk, d.dv}, false, Init::Uninitialized)};
  const int64_t dk = d.dk, dv = d.dv;
  const ParallelLoop loop(d.bh());
  PerWorker<gated::Scratch<T>> scratch(loop, [&] { return gated::Scratch<T>(d, false); });
  loop.run([&](int64_t bh, int worker) {
    gated::Scratch<T>& s = scratch[worker];
    T* state = r.state.data() + bh * dk * dv;
    if (d.has_state)
      std::copy(initial_state.data + bh * dk * dv, initial_state.data + (bh + 1) * dk * dv, state);
    else
      std::fill(state, state + dk * dv, T(0));
    for (int64_t t0 = 0; t0 < d.n; t0 += gated::kChunk) {
      interruption_point();
      const int64_t L = std::min(gated::kChunk, d.n - t0);
      s.prepare(d, log_gate, bh, t0, L);
      gated::forward_chunk(d, q.data + (bh * d.n + t0) * dk, k.data + (bh * d.n + t0) * dk,
                           v.data + (bh * d.n + t0) * dv, state, r.out.data() + (bh * d.n + t0) * dv, s);
    }
  });
  return r;
}

template <class T>
GatedLinearAttentionGrads<T> gated_linear_attention_backward(
    TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<const T> log_gate,
    TensorView<const T> initial_state, TensorView<const T> dout, TensorView<const T> dstate,
    const GatedLinearAttentionOptions& opts) {
  const char* fn = "gated_linear_attention_backward";
  const gated::Dims d = gated::check_args(fn, q, k, v, log_gate, initial_state, opts);
  gated::check_shape(fn, "dout", dout, {d.batch, d.heads, d.n, d.dv});
  gated::check_finite(fn, "dout", dout);
  const bool has_dstate = dstate.data != nullptr;
  if (has_dstate) {
    gated::check_shape(fn, "dstate", dstate, {d.batch, d.heads, d.dk, d.dv});
    gated::check_finite(fn, "dstate", dstate);
  }
  const int64_t dk = d.dk, dv = d.dv;
  const int64_t chunks = (d.n + gated::kChunk - 1) / gated::kChunk;
  GatedLinearAttentionGrads<T> g{Tensor<T>(q.shape, false, Init::Uninitialized),
                                 Tensor<T>(k.shape, false, Init::Uninitialized),
                                 Tensor<T>(v.shape, false, Init::Uninitialized),
                                 Tensor<T>(log_gate.shape, false, Init::Zero),
                                 Tensor<T>({d.batch, d.heads, dk, dv}, false, Init::Uninitialized)};
  const ParallelLoop loop(d.bh());
  PerWorker<gated::Scratch<T>> scratch(loop, [&] { return gated::Scratch<T>(d, true); });
  // The states at every chunk's start, per worker (a task's chunks, one task at a time).
  PerWorker<std::vector<T>> starts(loop, [&] { return std::vector<T>(static_cast<size_t>(chunks * dk * dv)); });
  const T sc = static_cast<T>(d.scale);
  loop.run([&](int64_t bh, int worker) {
    gated::Scratch<T>& s = scratch[worker];
    std::vector<T>& start = starts[worker];
    const T* qb = q.data + bh * d.n * dk;
    const T* kb = k.data + bh * d.n * dk;
    const T* vb = v.data + bh * d.n * dv;
    const T* gob = dout.data + bh * d.n * dv;
    T* dqb = g.dq.data() + bh * d.n * dk;
    T* dkb = g.dk.data() + bh * d.n * dk;
    T* dvb = g.dv.data() + bh * d.n * dv;
    // Forward over the chunks for their starting states (the outputs are not needed: work).
    std::vector<T> state(static_cast<size_t>(dk * dv));
    if (d.has_state)
      std::copy(initial_state.data + bh * dk * dv, initial_state.data + (bh + 1) * dk * dv, state.begin());
    std::vector<T> out_chunk(static_cast<size_t>(gated::kChunk * dv));
    for (int64_t c = 0; c < chunks; ++c) {
      interruption_point();
      const int64_t t0 = c * gated::kChunk, L = std::min(gated::kChunk, d.n - t0);
      std::copy(state.begin(), state.end(), start.begin() + c * dk * dv);
      s.prepare(d, log_gate, bh, t0, L);
      gated::forward_chunk(d, qb + t0 * dk, kb + t0 * dk, vb + t0 * dv, state.data(), out_chunk.data(), s);
    }
    // G: the gradient of the state after the chunk being processed.
    std::vector<T> G(static_cast<size_t>(dk * dv), T(0));
    if (has_dstate) std::copy(dstate.data + bh * dk * dv, dstate.data + (bh + 1) * dk * dv, G.begin());
    std::vector<double> db(static_cast<size_t>(gated::kChunk * dk));
    for (int64_t c = chunks - 1; c >= 0; --c) {
      interruption_point();
      const int64_t t0 = c * gated::kChunk, L = std::min(gated::kChunk, d.n - t0);
      const T *qc = qb + t0 * dk, *kc = kb + t0 * dk, *vc = vb + t0 * dv, *goc = gob + t0 * dv;
      T *dqc = dqb + t0 * dk, *dkc = dkb + t0 * dk, *dvc = dvb + t0 * dv;
      const T* P = start.data() + c * dk * dv;
      s.prepare(d, log_gate, bh, t0, L);
      gated::chunk_scores(qc, kc, s, s.scores.data());
      // dA = s·dO Vᵀ, lower
      matmul<T>(mat(s.dscores.data(), L, L, gated::kChunk), mat(goc, L, dv), mat(vc, L, dv).t(), sc);
      for (int64_t j = 0; j < L; ++j) std::fill(s.dscores.data() + j * gated::kChunk + j + 1,
                                                s.dscores.data() + j * gated::kChunk + L, T(0));
      // dV = s·Aᵀ dO + K̂ G
      s.scale_rows(kc, 0, L, L - 1, -1.0, s.gated_k.data());
      matmul<T>(mat(dvc, L, dv), mat<const T>(s.scores.data(), L, L, gated::kChunk).t(), mat(goc, L, dv), sc);
      matmul<T>(mat(dvc, L, dv), mat<const T>(s.gated_k.data(), L, dk), mat<const T>(G.data(), dk, dv), T(1), T(1));
      // dq = s·e^{B} ⊙ (dO Pᵀ) + intra
      matmul<T>(mat(s.work.data(), L, dk), mat(goc, L, dv), mat(P, dk, dv).t(), sc);
      s.scale_rows(s.work.data(), 0, L, -1, 1.0, dqc);
      gated::weigh_earlier(s.dscores.data(), kc, s, dqc);
      // dk = intra + (V Gᵀ) ⊙ e^{b_L − B}
      matmul<T>(mat(s.work.data(), L, dk), mat(vc, L, dv), mat<const T>(G.data(), dk, dv).t());
      s.scale_rows(s.work.data(), 0, L, L - 1, -1.0, s.dk_state.data());
      std::copy(s.dk_state.begin(), s.dk_state.begin() + L * dk, dkc);
      gated::weigh_later(s.dscores.data(), qc, s, dkc);
      // db, then dg = the reverse cumulative sum of db (log-gates at the floor get none)
      for (int64_t j = 0; j < L; ++j)
        for (int64_t e = 0; e < dk; ++e)
          db[j * dk + e] = static_cast<double>(qc[j * dk + e]) * static_cast<double>(dqc[j * dk + e]) -
                           static_cast<double>(kc[j * dk + e]) * static_cast<double>(dkc[j * dk + e]);
      for (int64_t e = 0; e < dk; ++e) {
        double extra = 0.0;
        for (int64_t i = 0; i < L; ++i)
          extra += static_cast<double>(kc[i * dk + e]) * static_cast<double>(s.dk_state[i * dk + e]);
        double gp = 0.0;
        for (int64_t f = 0; f < dv; ++f) gp += static_cast<double>(G[e * dv + f]) * static_cast<double>(P[e * dv + f]);
        db[(L - 1) * dk + e] += extra + s.last_decay(e) * gp;
      }
      // Per head: db summed over the channels first (float64), one reverse sum, one rounding.
      const int64_t width = d.per_channel ? dk : 1;
      if (!d.per_channel)
        for (int64_t j = 0; j < L; ++j) {
          double row = 0.0;
          for (int64_t e = 0; e < dk; ++e) row += db[j * dk + e];
          db[j] = row;
        }
      T* dgc = g.dlog_gate.data() + (bh * d.n + t0) * width;
      for (int64_t e = 0; e < width; ++e) {
        double acc = 0.0;
        for (int64_t j = L - 1; j >= 0; --j) {
          acc += db[j * width + e];
          const double gate = static_cast<double>(log_gate.data[(bh * d.n + t0 + j) * width + e]);
          // At or below the floor the log-gate acts as −1000: e^{−1000}·(…) = 0, no gradient.
          dgc[j * width + e] = gate <= gated::kFloor ? T(0) : static_cast<T>(acc);
        }
      }
      // G ← diag(e^{b_L}) G + s·(Q ⊙ e^{B})ᵀ dO
      s.scale_rows(qc, 0, L, -1, 1.0, s.gated_q.data());
      for (int64_t e = 0; e < dk; ++e) {
        const T decay = static_cast<T>(s.last_decay(e));
        for (int64_t f = 0; f < dv; ++f) G[e * dv + f] *= decay;
      }
      matmul<T>(mat(G.data(), dk, dv), mat<const T>(s.gated_q.data(), L, dk).t(), mat(goc, L, dv), sc, T(1));
    }
    std::copy(G.begin(), G.end(), g.dinitial_state.data() + bh * dk * dv);
  });
  return g;
}

#define LINATTN_INSTANTIATE(T)                                                                          \
  template GatedLinearAttentionResult<T> gated_linear_attention(                                        \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,               \
      TensorView<const T>, const GatedLinearAttentionOptions&);                                         \
  template GatedLinearAttentionGrads<T> gated_linear_attention_backward(                                \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,               \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, const GatedLinearAttentionOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
