// Gated linear attention (include/linattn/gated.h), chunked, per (batch, head) task:
//
// In a chunk of L <= 64 positions starting from the state P (the state before it), with the
// cumulative log-gates b_j = Σ_{i<=j} g_i per channel (in float64, from the chunk's start):
//   o_j = s·(q_j ⊙ e^{b_j})ᵀ P + s·Σ_{i<=j} A[j,i] v_i,   A[j,i] = Σ_c q_jc k_ic e^{b_jc − b_ic}
//   P'  = diag(e^{b_L})·P + Σ_i (k_i ⊙ e^{b_L − b_i}) v_iᵀ
// so the outputs are one product [Q ⊙ e^{B} | A]·[P ; V]. The decays (src/linattn/core/chunk_decay.h)
// never turn a finite result into an overflow:
// - per head, A = (Q Kᵀ) ⊙ D with D[j,i] = e^{b_j − b_i} below the diagonal, 0 above;
// - per channel, a chunk whose gates sum to at least −20 (the wide form): A = (Q ⊙ U)(K ⊙ U⁻¹)ᵀ,
//   U = e^{B − b_L/2} within e^{±10}, falling back to the blocked form where that overflows;
// - any other per channel (GLA's secondary chunking), blocks of 16 rows: for block J after block I,
//   e^{b_j − b_i} = e^{b_j − b_{r_J}} · e^{b_{r_J} − b_{e_I}} · e^{b_{e_I} − b_i} (r_J: J's first
//   row, e_I: I's last), so A_JI is a product of Q_J and K_I scaled by these three factors; a
//   diagonal block is summed term by term with its pairs' factors e^{b_j − b_i} = Π_{i<t<=j} e^{g_t}
//   (products of at most 15 per-step factors, simd::decay_pairs), which also give the blocks'
//   row factors to their first and last rows.
//
// Backward (G: the gradient of the state after the chunk, dS_n for the last):
//   dA = s·dO Vᵀ (lower), dV = s·Aᵀ dO + K̂ G, K̂ = K ⊙ e^{b_L − B}
//   dq_j = s·e^{b_j} ⊙ (P dO_j) + Σ_{i<=j} dA[j,i] k_i ⊙ e^{b_j − b_i}
//   dk_i = Σ_{j>=i} dA[j,i] q_j ⊙ e^{b_j − b_i} + (G v_i) ⊙ e^{b_L − b_i}
//   db_j = q_j ⊙ dq_j − k_j ⊙ dk_j, and for j = L: + Σ_i k_i ⊙ (G v_i) ⊙ e^{b_L − b_i}
//          + e^{b_L} ⊙ rowsum(G ⊙ P);  dg_t = Σ_{j>=t} db_j (in the chunk)
//   G ← diag(e^{b_L}) G + s·(Q ⊙ e^{B})ᵀ dO, and dS_0 = G after the first chunk.
// The states at the chunks' starts are kept from a forward pass over the task's chunks.
//
// Input checks ride on the computation (a separate pass over q, k, v cost 9% of the forward):
// the log-gates are checked where the chunks read them, and every result block is checked
// finite while in cache. A non-finite input always reaches a result (x·0 = NaN for x = ±inf or
// NaN, and every input is multiplied into some output, state or gradient), so a non-finite
// result leads to a scan of the inputs for the error that names the argument; finite inputs
// with a non-finite result are an overflow, said so. With scale = 0 no q reaches a result:
// then the inputs are scanned first.
#include "linattn/gated.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/chunk_decay.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/core/simd.h"

namespace linattn {
namespace gated {

using chunk_decay::all_ok;
using chunk_decay::chunk_scores;
using chunk_decay::kChunk;
using chunk_decay::kFloor;
using chunk_decay::weigh;

struct Dims {
  int64_t batch, heads, n, dk, dv;
  bool per_channel;
  bool has_state;
  double scale;
  int64_t bh() const { return batch * heads; }
  int64_t width() const { return per_channel ? dk : 1; }  // log-gates per position
};

// The arguments of a call, for the scan that names a bad one.
template <class T>
struct Inputs {
  TensorView<const T> q, k, v, log_gate, initial_state, dout, dstate;
};

// Every input scanned, in the order of the arguments: the error naming the first bad one.
template <class T>
void check_inputs(const char* fn, const Dims& d, const Inputs<T>& in) {
  check_same_shape_finite(fn, "q", in.q, in.q.shape);
  check_same_shape_finite(fn, "k", in.k, in.q.shape);
  check_same_shape_finite(fn, "v", in.v, in.v.shape);
  chunk_decay::check_log_gates(fn, "log_gate", in.log_gate);
  if (d.has_state) check_same_shape_finite(fn, "initial_state", in.initial_state, in.initial_state.shape);
  if (in.dout.data) check_same_shape_finite(fn, "dout", in.dout, in.dout.shape);
  if (in.dstate.data) check_same_shape_finite(fn, "dstate", in.dstate, in.dstate.shape);
}

// After a computation that found a non-finite result or a bad log-gate: the error naming the
// input, else the overflow.
template <class T>
[[noreturn]] void fail_on_results(const char* fn, const Dims& d, const Inputs<T>& in) {
  check_inputs(fn, d, in);
  fail_overflow<T>(fn);
}

template <class T>
Dims check_args(const char* fn, const Inputs<T>& in, const GatedLinearAttentionOptions& opts) {
  require(opts.causal || in.initial_state.data == nullptr, fn,
          ": initial_state must be None with causal=false: the non-causal form reads the whole sequence and has "
          "no state to continue");
  require(opts.causal || in.dstate.data == nullptr, fn,
          ": dstate must be None with causal=false: the non-causal form returns no state");
  const TensorView<const T>&q = in.q, &v = in.v, &log_gate = in.log_gate;
  require(q.rank() == 4, fn, ": q must be [batch, heads, seq, d_k], got shape ", shape_string(q.shape));
  require(v.rank() == 4, fn, ": v must be [batch, heads, seq, d_v], got shape ", shape_string(v.shape));
  Dims d{q.dim(0), q.dim(1), q.dim(2), q.dim(3), v.dim(3), false, in.initial_state.data != nullptr, 0.0};
  require(d.dk >= 1 && d.dv >= 1, fn, ": head dimensions must be >= 1, got d_k = ", d.dk, ", d_v = ", d.dv);
  check_shape(fn, "k", in.k, q.shape);
  check_shape(fn, "v", v, {d.batch, d.heads, d.n, d.dv});
  if (log_gate.rank() == 4) {
    check_shape(fn, "log_gate", log_gate, q.shape);
    d.per_channel = true;
  } else {
    require(log_gate.rank() == 3 && log_gate.shape == Shape{d.batch, d.heads, d.n}, fn, ": log_gate has shape ",
            shape_string(log_gate.shape), "; expected [batch, heads, seq] = ",
            shape_string({d.batch, d.heads, d.n}), " (per head) or ", shape_string(q.shape), " (per channel)");
  }
  if (d.has_state) check_shape(fn, "initial_state", in.initial_state, {d.batch, d.heads, d.dk, d.dv});
  if (in.dout.data) check_shape(fn, "dout", in.dout, {d.batch, d.heads, d.n, d.dv});
  if (in.dstate.data) check_shape(fn, "dstate", in.dstate, {d.batch, d.heads, d.dk, d.dv});
  if (opts.scale) {
    require(std::isfinite(*opts.scale), fn, ": scale must be finite, got ", *opts.scale);
    d.scale = *opts.scale;
  } else {
    d.scale = 1.0 / std::sqrt(static_cast<double>(d.dk));
  }
  if (static_cast<T>(d.scale) == T(0)) check_inputs(fn, d, in);  // no q reaches a result
  return d;
}

// One worker's scratch: a chunk's decays and the products of the outputs and the gradients.
template <class T>
struct Scratch : chunk_decay::ChunkDecays<T> {
  int64_t lhs_ld;                     // dk + C
  std::vector<T> lhs;                 // [C, dk + C]: [Q ⊙ e^{B} | A], the left operand of the outputs
  std::vector<T> rhs;                 // [dk + C, dv]: [P ; V], the state P on top for the whole task
  std::vector<T> gated_k;             // [C, dk] K ⊙ e^{b_L − B}
  std::vector<T> scores;              // [C, C] A (lower), backward
  std::vector<T> dscores;             // [C, C] dA, backward
  std::vector<T> work;                // [C, dk]
  std::vector<T> dk_state;            // [C, dk]
  Scratch(const Dims& d, bool backward)
      : chunk_decay::ChunkDecays<T>(d.dk, d.per_channel), lhs_ld(d.dk + kChunk), lhs(kChunk * (d.dk + kChunk)),
        rhs((d.dk + kChunk) * d.dv), gated_k(kChunk * d.dk) {
    if (backward) {
      scores.resize(kChunk * kChunk);
      dscores.resize(kChunk * kChunk);
      work.resize(kChunk * std::max(d.dk, d.dv));
      dk_state.resize(kChunk * d.dk);
    }
  }
};

// The state over one chunk (s prepared, P in the top d_k rows of s.rhs):
// P ← diag(e^{b_L}) P + (K ⊙ e^{b_L − B})ᵀ V.
template <class T>
void advance_state(const Dims& d, const T* k, const T* v, Scratch<T>& s) {
  T* state = s.rhs.data();
  s.to_chunk_end(k, s.gated_k.data(), d.dk);
  s.decay_over_chunk(state, d.dv);
  matmul<T>(mat(state, d.dk, d.dv), mat<const T>(s.gated_k.data(), s.L, d.dk).t(), mat(v, s.L, d.dv), T(1), T(1));
}

// One chunk of the forward (s prepared), with the state P in the top d_k rows of s.rhs: out rows
// (written) = s·[Q ⊙ e^{B} | A]·[P ; V] (one product), and P advanced in place.
template <class T>
void forward_chunk(const Dims& d, const T* q, const T* k, const T* v, T* out, Scratch<T>& s) {
  const int64_t dk = d.dk, dv = d.dv, L = s.L, ld = s.lhs_ld;
  T* state = s.rhs.data();
  s.from_chunk_start(q, s.lhs.data(), ld);
  chunk_scores(q, k, s, s.lhs.data() + dk, ld);
  std::copy(v, v + L * dv, state + dk * dv);
  matmul<T>(mat(out, L, dv), mat<const T>(s.lhs.data(), L, dk + L, ld), mat<const T>(state, dk + L, dv),
            static_cast<T>(d.scale));
  s.finite = s.finite && simd::all_finite(out, static_cast<size_t>(L * dv));
  advance_state(d, k, v, s);
}

}  // namespace gated

namespace gated {

// The causal form on `in` (checked: d); a failure is explained on `report` (the caller's
// inputs, of which `in` may be a reversed copy).
template <class T>
GatedLinearAttentionResult<T> causal_forward(const char* fn, const Inputs<T>& in, const Dims& d,
                                             const Inputs<T>& report) {
  const TensorView<const T>&q = in.q, &k = in.k, &v = in.v, &log_gate = in.log_gate, &initial_state = in.initial_state;
  GatedLinearAttentionResult<T> r{Tensor<T>({d.batch, d.heads, d.n, d.dv}, false, Init::Uninitialized),
                                  Tensor<T>({d.batch, d.heads, d.dk, d.dv}, false, Init::Uninitialized)};
  const int64_t dk = d.dk, dv = d.dv;
  const ParallelLoop loop(d.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(d, false); });
  loop.run([&](int64_t bh, int worker) {
    Scratch<T>& s = scratch[worker];
    T* state = s.rhs.data();
    if (d.has_state)
      std::copy(initial_state.data + bh * dk * dv, initial_state.data + (bh + 1) * dk * dv, state);
    else
      std::fill(state, state + dk * dv, T(0));
    for (int64_t t0 = 0; t0 < d.n; t0 += kChunk) {
      interruption_point();
      const int64_t L = std::min(kChunk, d.n - t0);
      s.prepare_rows(log_gate, d.n, bh, t0, L);
      forward_chunk(d, q.data + (bh * d.n + t0) * dk, k.data + (bh * d.n + t0) * dk,
                           v.data + (bh * d.n + t0) * dv, r.out.data() + (bh * d.n + t0) * dv, s);
    }
    s.finite = s.finite && simd::all_finite(state, static_cast<size_t>(dk * dv));
    std::copy(state, state + dk * dv, r.state.data() + bh * dk * dv);
  });
  if (!all_ok(scratch))
    fail_on_results(fn, d, report);
  return r;
}

template <class T>
GatedLinearAttentionGrads<T> causal_backward(const char* fn, const Inputs<T>& in, const Dims& d,
                                             const Inputs<T>& report) {
  const TensorView<const T>&q = in.q, &k = in.k, &v = in.v, &log_gate = in.log_gate, &initial_state = in.initial_state,
                          &dout = in.dout, &dstate = in.dstate;
  const bool has_dstate = dstate.data != nullptr;
  const int64_t dk = d.dk, dv = d.dv, width = d.width();
  const int64_t chunks = (d.n + kChunk - 1) / kChunk;
  GatedLinearAttentionGrads<T> g{Tensor<T>(q.shape, false, Init::Uninitialized),
                                 Tensor<T>(k.shape, false, Init::Uninitialized),
                                 Tensor<T>(v.shape, false, Init::Uninitialized),
                                 Tensor<T>(log_gate.shape, false, Init::Zero),
                                 Tensor<T>({d.batch, d.heads, dk, dv}, false, Init::Uninitialized)};
  const ParallelLoop loop(d.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(d, true); });
  // The states at every chunk's start, per worker (a task's chunks, one task at a time).
  PerWorker<std::vector<T>> starts(loop, [&] { return std::vector<T>(static_cast<size_t>(chunks * dk * dv)); });
  const T sc = static_cast<T>(d.scale);
  loop.run([&](int64_t bh, int worker) {
    Scratch<T>& s = scratch[worker];
    std::vector<T>& start = starts[worker];
    const T* qb = q.data + bh * d.n * dk;
    const T* kb = k.data + bh * d.n * dk;
    const T* vb = v.data + bh * d.n * dv;
    const T* gob = dout.data + bh * d.n * dv;
    T* dqb = g.dq.data() + bh * d.n * dk;
    T* dkb = g.dk.data() + bh * d.n * dk;
    T* dvb = g.dv.data() + bh * d.n * dv;
    // The states at the chunks' starts (the state's recurrence alone, not the outputs).
    T* state = s.rhs.data();
    if (d.has_state)
      std::copy(initial_state.data + bh * dk * dv, initial_state.data + (bh + 1) * dk * dv, state);
    else
      std::fill(state, state + dk * dv, T(0));
    for (int64_t c = 0; c < chunks; ++c) {
      interruption_point();
      const int64_t t0 = c * kChunk, L = std::min(kChunk, d.n - t0);
      std::copy(state, state + dk * dv, start.begin() + c * dk * dv);
      s.prepare_rows(log_gate, d.n, bh, t0, L, /*state_only=*/true);
      advance_state(d, kb + t0 * dk, vb + t0 * dv, s);
    }
    // G: the gradient of the state after the chunk being processed.
    std::vector<T> G(static_cast<size_t>(dk * dv), T(0));
    if (has_dstate) std::copy(dstate.data + bh * dk * dv, dstate.data + (bh + 1) * dk * dv, G.begin());
    std::vector<double> db(static_cast<size_t>(kChunk * dk));
    for (int64_t c = chunks - 1; c >= 0; --c) {
      interruption_point();
      const int64_t t0 = c * kChunk, L = std::min(kChunk, d.n - t0);
      const T *qc = qb + t0 * dk, *kc = kb + t0 * dk, *vc = vb + t0 * dv, *goc = gob + t0 * dv;
      T *dqc = dqb + t0 * dk, *dkc = dkb + t0 * dk, *dvc = dvb + t0 * dv;
      const T* P = start.data() + c * dk * dv;
      s.prepare_rows(log_gate, d.n, bh, t0, L);
      chunk_scores(qc, kc, s, s.scores.data(), kChunk);
      // dA = s·dO Vᵀ, lower
      matmul<T>(mat(s.dscores.data(), L, L, kChunk), mat(goc, L, dv), mat(vc, L, dv).t(), sc);
      for (int64_t j = 0; j < L; ++j) std::fill(s.dscores.data() + j * kChunk + j + 1,
                                                s.dscores.data() + j * kChunk + L, T(0));
      // dV = s·Aᵀ dO + K̂ G
      s.to_chunk_end(kc, s.gated_k.data(), dk);
      matmul<T>(mat(dvc, L, dv), mat<const T>(s.scores.data(), L, L, kChunk).t(), mat(goc, L, dv), sc);
      matmul<T>(mat(dvc, L, dv), mat<const T>(s.gated_k.data(), L, dk), mat<const T>(G.data(), dk, dv), T(1), T(1));
      // dq = s·e^{B} ⊙ (dO Pᵀ) + intra
      matmul<T>(mat(s.work.data(), L, dk), mat(goc, L, dv), mat(P, dk, dv).t(), sc);
      s.from_chunk_start(s.work.data(), dqc, dk);
      weigh(s.dscores.data(), kc, s, dqc, false);
      // dk = intra + (V Gᵀ) ⊙ e^{b_L − B}
      matmul<T>(mat(s.work.data(), L, dk), mat(vc, L, dv), mat<const T>(G.data(), dk, dv).t());
      s.to_chunk_end(s.work.data(), s.dk_state.data(), dk);
      std::copy(s.dk_state.begin(), s.dk_state.begin() + L * dk, dkc);
      weigh(s.dscores.data(), qc, s, dkc, true);
      s.finite = s.finite && simd::all_finite(dqc, static_cast<size_t>(L * dk)) &&
                 simd::all_finite(dkc, static_cast<size_t>(L * dk)) && simd::all_finite(dvc, static_cast<size_t>(L * dv));
      // db, then dg = the reverse cumulative sum of db (log-gates at the floor get none)
      for (int64_t j = 0; j < L; ++j)
        for (int64_t e = 0; e < dk; ++e)
          db[j * dk + e] = static_cast<double>(qc[j * dk + e]) * static_cast<double>(dqc[j * dk + e]) -
                           static_cast<double>(kc[j * dk + e]) * static_cast<double>(dkc[j * dk + e]);
      T* dgc = g.dlog_gate.data() + (bh * d.n + t0) * width;
      s.gate_gradients(db, kc, s.dk_state.data(), G.data(), P, dv, log_gate.data + (bh * d.n + t0) * width, dgc);
      s.finite = s.finite && simd::all_finite(dgc, static_cast<size_t>(L * width));
      // G ← diag(e^{b_L}) G + s·(Q ⊙ e^{B})ᵀ dO
      s.from_chunk_start(qc, s.scaled.data(), dk);
      s.decay_over_chunk(G.data(), dv);
      matmul<T>(mat(G.data(), dk, dv), mat<const T>(s.scaled.data(), L, dk).t(), mat(goc, L, dv), sc, T(1));
    }
    s.finite = s.finite && simd::all_finite(G.data(), G.size());
    std::copy(G.begin(), G.end(), g.dinitial_state.data() + bh * dk * dv);
  });
  if (!all_ok(scratch))
    fail_on_results(fn, d, report);
  return g;
}

// The non-causal form is the causal one plus its mirror, the diagonal counted once:
//   o_t = s·Σ_s (q_t ⊙ e_ts)ᵀ k_s v_s,  e_ts = Π_{min(s,t) < u <= max(s,t)} e^{g_u}
// (the decay between two positions is the product of the gates after the earlier one up to the
// later one, both ways: RetNet's bidirectional γ^{|t−s|} for a constant gate). The mirror is
// the causal form on the sequence reversed with the gates g'_i = g_{n−i} (g'_0 = 0, unused):
// between reversed positions s' < t' it decays by Π_{s' < u' <= t'} e^{g_{n−u'}}, the gates of
// the original positions t .. s−1 shifted by one, i.e. t+1 .. s.
template <class T>
struct Mirror {
  Tensor<T> q, k, v, log_gate, dout;
  Inputs<T> inputs() const { return {q.view(), k.view(), v.view(), log_gate.view(), {}, dout.view(), {}}; }
};

// rows reversed in each of `tasks` runs of n rows of `width` values; shift: row i of the result
// is row n − i of x (row 0 zero), else row n − 1 − i.
template <class T>
Tensor<T> reversed(TensorView<const T> x, int64_t tasks, int64_t n, int64_t width, bool shift) {
  Tensor<T> r(x.shape, false, Init::Uninitialized);
  parallel_for(tasks, [&](int64_t t) {
    const T* src = x.data + t * n * width;
    T* dst = r.data() + t * n * width;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t from = shift ? n - i : n - 1 - i;
      if (from >= n)
        std::fill(dst + i * width, dst + (i + 1) * width, T(0));
      else
        std::copy(src + from * width, src + (from + 1) * width, dst + i * width);
    }
  });
  return r;
}

template <class T>
Mirror<T> mirror(const Inputs<T>& in, const Dims& d) {
  const int64_t tasks = d.bh();
  Mirror<T> m{reversed(in.q, tasks, d.n, d.dk, false), reversed(in.k, tasks, d.n, d.dk, false),
              reversed(in.v, tasks, d.n, d.dv, false), reversed(in.log_gate, tasks, d.n, d.width(), true), {}};
  if (in.dout.data) m.dout = reversed(in.dout, tasks, d.n, d.dv, false);
  return m;
}

// x[t] += y[n − 1 − t] for every task's rows.
template <class T>
void add_reversed(Tensor<T>& x, const Tensor<T>& y, int64_t tasks, int64_t n, int64_t width) {
  parallel_for(tasks, [&](int64_t t) {
    T* dst = x.data() + t * n * width;
    const T* src = y.data() + t * n * width;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < width; ++c) dst[i * width + c] += src[(n - 1 - i) * width + c];
  });
}

template <class T>
GatedLinearAttentionResult<T> noncausal_forward(const char* fn, const Inputs<T>& in, const Dims& d) {
  GatedLinearAttentionResult<T> r = causal_forward(fn, in, d, in);
  const Mirror<T> m = mirror(in, d);
  const GatedLinearAttentionResult<T> back = causal_forward(fn, m.inputs(), d, in);
  add_reversed(r.out, back.out, d.bh(), d.n, d.dv);
  parallel_for(d.bh(), [&](int64_t bh) {  // − s·(q_t·k_t) v_t: the diagonal, in both
    for (int64_t t = 0; t < d.n; ++t) {
      const T* qt = in.q.data + (bh * d.n + t) * d.dk;
      const T* kt = in.k.data + (bh * d.n + t) * d.dk;
      double dot = 0;
      for (int64_t c = 0; c < d.dk; ++c) dot += static_cast<double>(qt[c]) * static_cast<double>(kt[c]);
      const T w = static_cast<T>(d.scale * dot);
      const T* vt = in.v.data + (bh * d.n + t) * d.dv;
      T* ot = r.out.data() + (bh * d.n + t) * d.dv;
      for (int64_t e = 0; e < d.dv; ++e) ot[e] -= w * vt[e];
    }
  });
  check_result_finite(fn, "out", r.out);
  r.state = Tensor<T>(Shape{0}, false, Init::Zero);  // no state: the form reads the whole sequence
  return r;
}

template <class T>
GatedLinearAttentionGrads<T> noncausal_backward(const char* fn, const Inputs<T>& in, const Dims& d) {
  GatedLinearAttentionGrads<T> g = causal_backward(fn, in, d, in);
  const Mirror<T> m = mirror(in, d);
  const GatedLinearAttentionGrads<T> back = causal_backward(fn, m.inputs(), d, in);
  const int64_t tasks = d.bh(), n = d.n, w = d.width();
  add_reversed(g.dq, back.dq, tasks, n, d.dk);
  add_reversed(g.dk, back.dk, tasks, n, d.dk);
  add_reversed(g.dv, back.dv, tasks, n, d.dv);
  parallel_for(tasks, [&](int64_t bh) {
    // g'_i = g_{n−i}: dg_j += dg'_{n−j} for j >= 1
    T* dg = g.dlog_gate.data() + bh * n * w;
    const T* dgm = back.dlog_gate.data() + bh * n * w;
    for (int64_t j = 1; j < n; ++j)
      for (int64_t c = 0; c < w; ++c) dg[j * w + c] += dgm[(n - j) * w + c];
    // the diagonal's − s·(q_t·k_t)(v_t·do_t)
    for (int64_t t = 0; t < n; ++t) {
      const int64_t qi = (bh * n + t) * d.dk, vi = (bh * n + t) * d.dv;
      double qk = 0, vo = 0;
      for (int64_t c = 0; c < d.dk; ++c) qk += static_cast<double>(in.q.data[qi + c]) * static_cast<double>(in.k.data[qi + c]);
      for (int64_t e = 0; e < d.dv; ++e) vo += static_cast<double>(in.v.data[vi + e]) * static_cast<double>(in.dout.data[vi + e]);
      const T a = static_cast<T>(d.scale * vo), b = static_cast<T>(d.scale * qk);
      for (int64_t c = 0; c < d.dk; ++c) {
        g.dq.data()[qi + c] -= a * in.k.data[qi + c];
        g.dk.data()[qi + c] -= a * in.q.data[qi + c];
      }
      for (int64_t e = 0; e < d.dv; ++e) g.dv.data()[vi + e] -= b * in.dout.data[vi + e];
    }
  });
  check_result_finite(fn, "dq", g.dq);
  check_result_finite(fn, "dk", g.dk);
  check_result_finite(fn, "dv", g.dv);
  check_result_finite(fn, "dlog_gate", g.dlog_gate);
  return g;
}

}  // namespace gated

template <class T>
GatedLinearAttentionResult<T> gated_linear_attention(TensorView<const T> q, TensorView<const T> k,
                                                     TensorView<const T> v, TensorView<const T> log_gate,
                                                     TensorView<const T> initial_state,
                                                     const GatedLinearAttentionOptions& opts) {
  const char* fn = "gated_linear_attention";
  const gated::Inputs<T> in{q, k, v, log_gate, initial_state, {}, {}};
  const gated::Dims d = gated::check_args(fn, in, opts);
  return opts.causal ? gated::causal_forward(fn, in, d, in) : gated::noncausal_forward(fn, in, d);
}

template <class T>
GatedLinearAttentionGrads<T> gated_linear_attention_backward(
    TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<const T> log_gate,
    TensorView<const T> initial_state, TensorView<const T> dout, TensorView<const T> dstate,
    const GatedLinearAttentionOptions& opts) {
  const char* fn = "gated_linear_attention_backward";
  const gated::Inputs<T> in{q, k, v, log_gate, initial_state, dout, dstate};
  const gated::Dims d = gated::check_args(fn, in, opts);
  check_shape(fn, "dout", dout, {d.batch, d.heads, d.n, d.dv});
  return opts.causal ? gated::causal_backward(fn, in, d, in) : gated::noncausal_backward(fn, in, d);
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
