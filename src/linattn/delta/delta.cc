// The gated delta rule and KDA (include/linattn/delta.h), chunked, per (batch, value head) task.
//
// In a chunk of L <= 64 positions from the state P, with b_j the cumulative log-gates from the
// chunk's start (per channel for KDA), the state is S_t = diag(e^{b_t}) P + Σ_{i<=t} (k_i ⊙
// e^{b_t − b_i}) u_iᵀ: gated linear attention with values u (the corrections), and
//   u_t = β_t (v_t − Pᵀ(k_t ⊙ e^{b_t}) − Σ_{i<t} M[t,i] u_i),  M[t,i] = Σ_c k_tc k_ic e^{b_tc − b_ic}
// so (I + diag(β) M) U = R with R = diag(β)(V − K_B P), K_B = K ⊙ e^{B}: one unit lower
// triangular solve (BLAS trsm; forward substitution is the recurrence in the same order, so its
// rounding errors contract as the recurrence's do). Then, as in gated linear attention,
//   O  = s·[Q ⊙ e^{B} | Sc]·[P ; U],   Sc = (Q Kᵀ ⊙ D) with the diagonal
//   P' = diag(e^{b_L}) P + (K ⊙ e^{b_L − B})ᵀ U.
// The decays and the decayed scores are gated linear attention's (src/linattn/core/chunk_decay.h:
// factors <= 1, or within e^{±10} for a chunk whose gates decay little, with a fallback).
//
// Backward, per chunk from the last (G: the gradient of the state after it):
//   dU  = s·Scᵀ dO + K̂ G (K̂ = K ⊙ e^{b_L − B}),  dSc = s·dO Uᵀ (lower)
//   dR  = (I + A)⁻ᵀ dU (A = diag(β) M),  dA = −dR Uᵀ (strictly lower),  dM = diag(β) dA
//   dβ_t = Σ_i dA[t,i] M[t,i] + (v_t − (K_B P)_t)·dR_t,  dV = diag(β) dR,  E = −diag(β) dR
//   dQ  = s·e^{B} ⊙ (dO Pᵀ) + (dSc ⊙ D) K
//   dK  = (dSc ⊙ D)ᵀ Q + (dM ⊙ D) K + (dM ⊙ D)ᵀ K + e^{B} ⊙ (E Pᵀ) + e^{b_L − B} ⊙ (U Gᵀ)
//   G  ← diag(e^{b_L}) G + s·(Q ⊙ e^{B})ᵀ dO + K_Bᵀ E
// and the log-gates' gradient from the cumulative sums: a factor e^{b_t − b_i} joins a "row"
// vector at t and a "column" vector at i, so db_t = Σ (row vector ⊙ its gradient) − Σ (column
// vector ⊙ its gradient) over their uses, plus for the chunk's last row the state's terms
// e^{b_L} ⊙ rowsum(G ⊙ P) + Σ_i k_i ⊙ (e^{b_L − b_i} ⊙ (U Gᵀ)_i); dg_t = Σ_{j>=t} db_j.
// q and k under use_qk_l2norm_in_kernel: x̂ = x·r, r = (|x|² + ε)^{−1/2}, dx = r·(dx̂ − x̂ (x̂·dx̂))
// (in float64 per row); grouped heads sum their value heads' dq, dk.
//
// Input checks: β is scanned first (small); the log-gates where the chunks read them; q, k, v
// and the state through the results, as in gated linear attention (a non-finite input always
// reaches a result; a non-finite result leads to the scan that names the argument).
#include "linattn/delta.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/blas.h"
#include "linattn/core/chunk_decay.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/core/simd.h"

namespace linattn {
namespace delta {

using chunk_decay::all_ok;
using chunk_decay::chunk_scores;
using chunk_decay::kChunk;
using chunk_decay::kFloor;
using chunk_decay::weigh;

constexpr double kNormEpsilon = 1e-6;  // fla's and transformers' l2norm
constexpr double kMaxBeta = 2.0;

struct Dims {
  int64_t batch, heads, key_heads, n, dk, dv;
  bool per_channel, has_state, l2norm;
  double scale;
  int64_t bh() const { return batch * heads; }
  int64_t group() const { return heads / key_heads; }
  int64_t width() const { return per_channel ? dk : 1; }
  int64_t key_task(int64_t task) const { return task / heads * key_heads + task % heads / group(); }
};

template <class T>
struct Inputs {
  TensorView<const T> q, k, v, g, beta, initial_state, dout, dstate;
};

template <class T>
void check_beta(const char* fn, TensorView<const T> beta) {
  for (int64_t i = 0; i < beta.size(); ++i) {
    const double b = static_cast<double>(beta.data[i]);
    require(b >= 0.0 && b <= kMaxBeta, fn, ": beta must be in [0, 2] everywhere, got ", b, " at flat index ", i);
  }
}

// Every input scanned in the order of the arguments: the error naming the first bad one.
template <class T>
void check_inputs(const char* fn, const Dims& d, const Inputs<T>& in) {
  check_same_shape_finite(fn, "q", in.q, in.q.shape);
  check_same_shape_finite(fn, "k", in.k, in.k.shape);
  check_same_shape_finite(fn, "v", in.v, in.v.shape);
  chunk_decay::check_log_gates(fn, "g", in.g);
  check_beta(fn, in.beta);
  if (d.has_state) check_same_shape_finite(fn, "initial_state", in.initial_state, in.initial_state.shape);
  if (in.dout.data) check_same_shape_finite(fn, "dout", in.dout, in.dout.shape);
  if (in.dstate.data) check_same_shape_finite(fn, "dstate", in.dstate, in.dstate.shape);
}

template <class T>
[[noreturn]] void fail_on_results(const char* fn, const Dims& d, const Inputs<T>& in) {
  check_inputs(fn, d, in);
  fail_overflow<T>(fn);
}

template <class T>
Dims check_args(const char* fn, const Inputs<T>& in, const GatedDeltaRuleOptions& opts) {
  const TensorView<const T>&q = in.q, &v = in.v, &g = in.g;
  require(q.rank() == 4, fn, ": q must be [batch, key_heads, seq, d_k], got shape ", shape_string(q.shape));
  require(v.rank() == 4, fn, ": v must be [batch, heads, seq, d_v], got shape ", shape_string(v.shape));
  Dims d{q.dim(0), v.dim(1), q.dim(1), q.dim(2), q.dim(3), v.dim(3), false, in.initial_state.data != nullptr,
         opts.use_qk_l2norm_in_kernel, 0.0};
  require(d.dk >= 1 && d.dv >= 1, fn, ": head dimensions must be >= 1, got d_k = ", d.dk, ", d_v = ", d.dv);
  check_shape(fn, "k", in.k, q.shape);
  require(v.dim(0) == d.batch && v.dim(2) == d.n, fn, ": v has shape ", shape_string(v.shape),
          "; expected [batch, heads, seq, d_v] with batch = ", d.batch, " and seq = ", d.n, " as q");
  require(d.key_heads >= 1 && d.heads % d.key_heads == 0, fn, ": v's heads (", d.heads,
          ") must be a multiple of q's and k's heads (", d.key_heads, ")");
  if (g.rank() == 4) {
    check_shape(fn, "g", g, {d.batch, d.heads, d.n, d.dk});
    d.per_channel = true;
  } else {
    require(g.rank() == 3 && g.shape == Shape{d.batch, d.heads, d.n}, fn, ": g has shape ", shape_string(g.shape),
            "; expected [batch, heads, seq] = ", shape_string({d.batch, d.heads, d.n}), " (per head) or ",
            shape_string({d.batch, d.heads, d.n, d.dk}), " (per channel, KDA)");
  }
  check_shape(fn, "beta", in.beta, {d.batch, d.heads, d.n});
  if (d.has_state) check_shape(fn, "initial_state", in.initial_state, {d.batch, d.heads, d.dk, d.dv});
  if (in.dout.data) check_shape(fn, "dout", in.dout, {d.batch, d.heads, d.n, d.dv});
  if (in.dstate.data) check_shape(fn, "dstate", in.dstate, {d.batch, d.heads, d.dk, d.dv});
  if (opts.scale) {
    require(std::isfinite(*opts.scale), fn, ": scale must be finite, got ", *opts.scale);
    d.scale = *opts.scale;
  } else {
    d.scale = 1.0 / std::sqrt(static_cast<double>(d.dk));
  }
  check_beta(fn, in.beta);
  if (static_cast<T>(d.scale) == T(0)) check_inputs(fn, d, in);  // no q reaches a result
  return d;
}

// q and k as the kernel reads them: the inputs, or with use_qk_l2norm_in_kernel their rows
// divided by sqrt(|x|² + ε) (and the factors r kept for the backward).
template <class T>
struct KernelQK {
  Tensor<T> q_norm, k_norm;
  std::vector<double> q_factor, k_factor;  // r per row
  TensorView<const T> q, k;
  KernelQK(const Dims& d, TensorView<const T> q_in, TensorView<const T> k_in) : q(q_in), k(k_in) {
    if (!d.l2norm) return;
    const int64_t rows = d.batch * d.key_heads * d.n;
    q_norm = Tensor<T>(q_in.shape, false, Init::Uninitialized);
    k_norm = Tensor<T>(k_in.shape, false, Init::Uninitialized);
    q_factor.resize(static_cast<size_t>(rows));
    k_factor.resize(static_cast<size_t>(rows));
    // rows of a task in a row: a decoding step's few rows wake no helper thread
    const int64_t tasks = d.batch * d.key_heads, group = tasks_per_index(tasks, 2 * d.n * d.dk);
    parallel_for((tasks + group - 1) / group, [&](int64_t index) {
      for (int64_t t = index * group * d.n; t < std::min(tasks, (index + 1) * group) * d.n; ++t) {
        normalise(q_in.data + t * d.dk, d.dk, q_norm.data() + t * d.dk, q_factor[t]);
        normalise(k_in.data + t * d.dk, d.dk, k_norm.data() + t * d.dk, k_factor[t]);
      }
    });
    q = q_norm.view();
    k = k_norm.view();
  }
  // |x|² in T (Highway's dot: within d_k·u of exact, which the kernel's bound counts), the
  // factor in float64.
  static void normalise(const T* x, int64_t dk, T* y, double& factor) {
    const double sq = static_cast<double>(simd::dot(x, x, static_cast<size_t>(dk)));
    factor = 1.0 / std::sqrt(sq + kNormEpsilon);
    std::copy(x, x + dk, y);
    simd::scale(y, static_cast<size_t>(dk), static_cast<T>(factor));
  }
  // dx = r·(dx̂ − x̂ (x̂·dx̂)) in place of dx̂, rows of x̂ (normalised) with factors r.
  static void chain(const T* normalised, const std::vector<double>& factor, int64_t row, int64_t dk, T* grad) {
    const T* y = normalised + row * dk;
    T* dy = grad + row * dk;
    double dot = 0;
    for (int64_t c = 0; c < dk; ++c) dot += static_cast<double>(y[c]) * static_cast<double>(dy[c]);
    for (int64_t c = 0; c < dk; ++c)
      dy[c] = static_cast<T>(factor[row] * (static_cast<double>(dy[c]) - static_cast<double>(y[c]) * dot));
  }
};

// One worker's scratch: a chunk's decays and the chunk's products.
template <class T>
struct Scratch : chunk_decay::ChunkDecays<T> {
  int64_t lhs_ld;          // dk + C
  std::vector<T> lhs;      // [C, dk + C]: [Q ⊙ e^{B} | Sc]
  std::vector<T> rhs;      // [dk + C, dv]: [P ; U], the state P on top for the whole task
  std::vector<T> system;   // [C, C]: A = diag(β) M, strictly lower (the solve reads nothing else)
  std::vector<T> k_start;  // [C, dk] K ⊙ e^{B}
  std::vector<T> k_end;    // [C, dk] K ⊙ e^{b_L − B}
  std::vector<T> m;        // [C, C]: M, strictly lower (the forward's; the backward keeps one per chunk)
  // backward
  std::vector<T> scores, dscores, dm;         // [C, C]: Sc, dSc, dA then dM
  std::vector<T> du, dr, work;                // [C, max(dk, dv)]
  std::vector<T> k_row, k_col, k_state;       // [C, dk]: dK's row-side, column-side and state parts
  Scratch(const Dims& d, bool backward)
      : chunk_decay::ChunkDecays<T>(d.dk, d.per_channel), lhs_ld(d.dk + kChunk), lhs(kChunk * (d.dk + kChunk)),
        rhs((d.dk + kChunk) * d.dv), system(kChunk * kChunk), k_start(kChunk * d.dk), k_end(kChunk * d.dk),
        m(kChunk * kChunk), corrections_at(d.dk * d.dv) {
    if (backward) {
      for (auto* x : {&scores, &dscores, &dm}) x->resize(kChunk * kChunk);
      for (auto* x : {&du, &dr, &work}) x->resize(kChunk * std::max(d.dk, d.dv));
      for (auto* x : {&k_row, &k_col, &k_state}) x->resize(kChunk * d.dk);
    }
  }
  T* state() { return rhs.data(); }
  T* corrections() { return rhs.data() + corrections_at; }  // U [L, dv], below P
  int64_t corrections_at;
};

// M [L, L] (ld C) = the decayed K Kᵀ strictly below the diagonal, zero on and above it.
template <class T>
void key_scores(const T* k, Scratch<T>& s, T* m) {
  chunk_scores(k, k, s, m, kChunk);
  for (int64_t t = 0; t < s.L; ++t) std::fill(m + t * kChunk + t, m + t * kChunk + s.L, T(0));
}

// s.system = diag(β) M below the diagonal (M [L, L], ld C): the unit lower triangular system's
// off-diagonal part, which the forward solves and the backward solves transposed.
template <class T>
void build_system(Scratch<T>& s, const T* m, const T* beta) {
  for (int64_t t = 1; t < s.L; ++t)
    simd::scale(std::copy(m + t * kChunk, m + t * kChunk + t, s.system.data() + t * kChunk) - t,
                static_cast<size_t>(t), beta[t]);
}

// The corrections U of one chunk (s prepared, P the state on top of s.rhs) into s.corrections()
// [L, dv], M into m [L, C], and `residual` (if not null) = V − K_B P, kept for the backward.
template <class T>
void corrections(const Dims& d, const T* k, const T* v, const T* beta, Scratch<T>& s, T* m, T* residual) {
  const int64_t L = s.L, dk = d.dk, dv = d.dv;
  T* u = s.corrections();
  s.from_chunk_start(k, s.k_start.data(), dk);
  std::copy(v, v + L * dv, u);
  matmul<T>(mat(u, L, dv), mat<const T>(s.k_start.data(), L, dk), mat<const T>(s.state(), dk, dv), T(-1), T(1));
  if (residual) std::copy(u, u + L * dv, residual);
  simd::scale_rows(u, static_cast<size_t>(dv), static_cast<size_t>(L), static_cast<size_t>(dv), beta, u,
                   static_cast<size_t>(dv));
  key_scores(k, s, m);
  build_system(s, m, beta);
  solve_unit_lower<T>(mat<const T>(s.system.data(), L, L, kChunk), mat(u, L, dv));
}

// P ← diag(e^{b_L}) P + (K ⊙ e^{b_L − B})ᵀ U.
template <class T>
void advance_state(const Dims& d, const T* k, Scratch<T>& s) {
  s.to_chunk_end(k, s.k_end.data(), d.dk);
  s.decay_over_chunk(s.state(), d.dv);
  matmul<T>(mat(s.state(), d.dk, d.dv), mat<const T>(s.k_end.data(), s.L, d.dk).t(),
            mat<const T>(s.corrections(), s.L, d.dv), T(1), T(1));
}

template <class T>
void start_state(const Dims& d, TensorView<const T> initial_state, int64_t bh, T* state) {
  const int64_t size = d.dk * d.dv;
  if (d.has_state)
    std::copy(initial_state.data + bh * size, initial_state.data + (bh + 1) * size, state);
  else
    std::fill(state, state + size, T(0));
}

template <class T>
GatedDeltaRuleResult<T> forward(const char* fn, const Inputs<T>& in, const Dims& d) {
  const KernelQK<T> qk(d, in.q, in.k);
  GatedDeltaRuleResult<T> r{Tensor<T>({d.batch, d.heads, d.n, d.dv}, false, Init::Uninitialized),
                            Tensor<T>({d.batch, d.heads, d.dk, d.dv}, false, Init::Uninitialized)};
  const int64_t dk = d.dk, dv = d.dv;
  const ParallelLoop loop(d.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(d, false); });
  loop.run([&](int64_t bh, int worker) {
    Scratch<T>& s = scratch[worker];
    const int64_t kt = d.key_task(bh);
    start_state(d, in.initial_state, bh, s.state());
    for (int64_t t0 = 0; t0 < d.n; t0 += kChunk) {
      interruption_point();
      const int64_t L = std::min(kChunk, d.n - t0);
      const T* q = qk.q.data + (kt * d.n + t0) * dk;
      const T* k = qk.k.data + (kt * d.n + t0) * dk;
      s.prepare_rows(in.g, d.n, bh, t0, L);
      corrections(d, k, in.v.data + (bh * d.n + t0) * dv, in.beta.data + bh * d.n + t0, s, s.m.data(),
                  static_cast<T*>(nullptr));
      // O = s·[Q ⊙ e^{B} | Sc]·[P ; U]
      s.from_chunk_start(q, s.lhs.data(), s.lhs_ld);
      chunk_scores(q, k, s, s.lhs.data() + dk, s.lhs_ld);
      T* out = r.out.data() + (bh * d.n + t0) * dv;
      matmul<T>(mat(out, L, dv), mat<const T>(s.lhs.data(), L, dk + L, s.lhs_ld), mat<const T>(s.state(), dk + L, dv),
                static_cast<T>(d.scale));
      s.finite = s.finite && simd::all_finite(out, static_cast<size_t>(L * dv));
      advance_state(d, k, s);
    }
    s.finite = s.finite && simd::all_finite(s.state(), static_cast<size_t>(dk * dv));
    std::copy(s.state(), s.state() + dk * dv, r.state.data() + bh * dk * dv);
  });
  if (!all_ok(scratch)) fail_on_results(fn, d, in);
  return r;
}

// Up to this many positions (decoding: one new token, or a few speculative ones) the forward
// runs the recurrence itself, position by position: a chunk's small products would cost more
// in BLAS calls and scratch than the arithmetic of a step (4·d_k·d_v per position and head).
constexpr int64_t kRecurrentUpTo = 16;

// With f = e^{g_t} (per channel, or the head's for every channel), one position in two passes
// over the state (simd::state_dots, simd::decay_rank_one):
//   w = Sᵀ(f ⊙ k_t), y = Sᵀ(f ⊙ q_t);  u = β_t (v_t − w);  S ← diag(f) S + k_t uᵀ;
//   o_t = s·(y + (k_t·q_t) u)
// the recurrence S ← (I − β k kᵀ) diag(f) S + β k vᵀ, o = s·Sᵀq, as S's new value need not be
// read again for the output (Sᵀq = Sᵀ diag(f) q + u kᵀq).
template <class T>
GatedDeltaRuleResult<T> recurrent_forward(const char* fn, const Inputs<T>& in, const Dims& d) {
  const KernelQK<T> qk(d, in.q, in.k);
  GatedDeltaRuleResult<T> r{Tensor<T>({d.batch, d.heads, d.n, d.dv}, false, Init::Uninitialized),
                            Tensor<T>({d.batch, d.heads, d.dk, d.dv}, false, Init::Uninitialized)};
  const int64_t dk = d.dk, dv = d.dv, w = d.width();
  const int64_t group = tasks_per_index(d.bh(), d.n * dk * dv);
  const ParallelLoop loop((d.bh() + group - 1) / group);
  struct Worker {
    std::vector<T> decay, fk, fq;  // [dk]: f, f ⊙ k, f ⊙ q
    std::vector<T> u, y;           // [dv]
    bool ok = true;
  };
  PerWorker<Worker> workers(loop, [&] {
    const auto n_k = static_cast<size_t>(dk), n_v = static_cast<size_t>(dv);
    return Worker{std::vector<T>(n_k), std::vector<T>(n_k), std::vector<T>(n_k), std::vector<T>(n_v),
                  std::vector<T>(n_v), true};
  });
  const T sc = static_cast<T>(d.scale);
  const auto rows = static_cast<size_t>(dk), cols = static_cast<size_t>(dv);
  // One task: the recurrence over its n positions.
  auto recur = [&](int64_t bh, Worker& wk) {
    T* S = r.state.data() + bh * dk * dv;
    // The first step reads the initial state where it is (one pass over the state fewer).
    const T* from = d.has_state ? in.initial_state.data + bh * dk * dv : S;
    if (!d.has_state || d.n == 0) start_state(d, in.initial_state, bh, S);
    const int64_t kt = d.key_task(bh);
    for (int64_t t = 0; t < d.n; ++t) {
      const T* q = qk.q.data + (kt * d.n + t) * dk;
      const T* k = qk.k.data + (kt * d.n + t) * dk;
      const T* v = in.v.data + (bh * d.n + t) * dv;
      const T* g = in.g.data + (bh * d.n + t) * w;
      const T beta = in.beta.data[bh * d.n + t];
      // f = exp(g) of each gate this position has (one per head, or one per channel)
      int bad = 0;
      for (int64_t c = 0; c < w; ++c) {
        bad += !(g[c] <= T(0));  // NaN fails too
        wk.decay[c] = static_cast<T>(std::exp(std::max(static_cast<double>(g[c]), kFloor)));
      }
      wk.ok = wk.ok && bad == 0;
      if (!d.per_channel) std::fill(wk.decay.begin() + 1, wk.decay.end(), wk.decay[0]);
      for (int64_t c = 0; c < dk; ++c) {
        wk.fk[c] = wk.decay[c] * k[c];
        wk.fq[c] = wk.decay[c] * q[c];
      }
      T* u = wk.u.data();
      simd::state_dots(from, rows, cols, wk.fk.data(), wk.fq.data(), u, wk.y.data());
      for (int64_t e = 0; e < dv; ++e) u[e] = beta * (v[e] - u[e]);
      wk.ok = simd::decay_rank_one(from, rows, cols, wk.decay.data(), k, u, S) && wk.ok;
      from = S;
      const T kq = simd::dot(k, q, rows);
      T* o = r.out.data() + (bh * d.n + t) * dv;
      for (int64_t e = 0; e < dv; ++e) o[e] = sc * (wk.y[e] + kq * u[e]);
      wk.ok = wk.ok && simd::all_finite(o, cols);
    }
  };
  loop.run([&](int64_t index, int worker) {
    for (int64_t bh = index * group; bh < std::min(d.bh(), (index + 1) * group); ++bh) recur(bh, workers[worker]);
  });
  for (int i = 0; i < workers.size(); ++i)
    if (!workers[i].ok) fail_on_results(fn, d, in);
  return r;
}

template <class T>
GatedDeltaRuleGrads<T> backward(const char* fn, const Inputs<T>& in, const Dims& d) {
  const KernelQK<T> qk(d, in.q, in.k);
  const int64_t dk = d.dk, dv = d.dv, width = d.width();
  const int64_t chunks = (d.n + kChunk - 1) / kChunk;
  const bool own_key_grads = d.group() == 1;  // else per value head, summed over the group after
  GatedDeltaRuleGrads<T> g{Tensor<T>(in.q.shape, false, Init::Uninitialized),
                           Tensor<T>(in.k.shape, false, Init::Uninitialized),
                           Tensor<T>(in.v.shape, false, Init::Uninitialized),
                           Tensor<T>(in.g.shape, false, Init::Zero),
                           Tensor<T>(in.beta.shape, false, Init::Uninitialized),
                           Tensor<T>({d.batch, d.heads, dk, dv}, false, Init::Uninitialized)};
  Tensor<T> dq_heads, dk_heads;  // [B, H, n, d_k] when heads are grouped
  if (!own_key_grads) {
    dq_heads = Tensor<T>({d.batch, d.heads, d.n, dk}, false, Init::Uninitialized);
    dk_heads = Tensor<T>({d.batch, d.heads, d.n, dk}, false, Init::Uninitialized);
  }
  const ParallelLoop loop(d.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(d, true); });
  // Per worker, a task's states at the chunks' starts, its corrections U, residuals V − K_B P and
  // each chunk's M (the backward needs them all; M kept is a decayed product not made again).
  struct Saved {
    std::vector<T> starts, u, residual, keys;
  };
  PerWorker<Saved> saved(loop, [&] {
    return Saved{std::vector<T>(static_cast<size_t>(chunks * dk * dv)), std::vector<T>(static_cast<size_t>(d.n * dv)),
                 std::vector<T>(static_cast<size_t>(d.n * dv)),
                 std::vector<T>(static_cast<size_t>(chunks * kChunk * kChunk))};
  });
  const T sc = static_cast<T>(d.scale);
  loop.run([&](int64_t bh, int worker) {
    Scratch<T>& s = scratch[worker];
    Saved& keep = saved[worker];
    const int64_t kt = d.key_task(bh);
    const T* qb = qk.q.data + kt * d.n * dk;
    const T* kb = qk.k.data + kt * d.n * dk;
    const T* vb = in.v.data + bh * d.n * dv;
    const T* betab = in.beta.data + bh * d.n;
    const T* gob = in.dout.data + bh * d.n * dv;
    T* dqb = (own_key_grads ? g.dq.data() + kt * d.n * dk : dq_heads.data() + bh * d.n * dk);
    T* dkb = (own_key_grads ? g.dk.data() + kt * d.n * dk : dk_heads.data() + bh * d.n * dk);
    T* dvb = g.dv.data() + bh * d.n * dv;
    T* dbetab = g.dbeta.data() + bh * d.n;
    // The forward's states and corrections, chunk by chunk.
    start_state(d, in.initial_state, bh, s.state());
    for (int64_t c = 0; c < chunks; ++c) {
      interruption_point();
      const int64_t t0 = c * kChunk, L = std::min(kChunk, d.n - t0);
      std::copy(s.state(), s.state() + dk * dv, keep.starts.begin() + c * dk * dv);
      s.prepare_rows(in.g, d.n, bh, t0, L);
      corrections(d, kb + t0 * dk, vb + t0 * dv, betab + t0, s, keep.keys.data() + c * kChunk * kChunk,
                  keep.residual.data() + t0 * dv);
      std::copy(s.corrections(), s.corrections() + L * dv, keep.u.begin() + t0 * dv);
      advance_state(d, kb + t0 * dk, s);
    }
    std::vector<T> G(static_cast<size_t>(dk * dv), T(0));  // the gradient of the state after the chunk
    if (in.dstate.data) std::copy(in.dstate.data + bh * dk * dv, in.dstate.data + (bh + 1) * dk * dv, G.begin());
    std::vector<double> db(static_cast<size_t>(kChunk * dk));
    for (int64_t c = chunks - 1; c >= 0; --c) {
      interruption_point();
      const int64_t t0 = c * kChunk, L = std::min(kChunk, d.n - t0);
      const T *q = qb + t0 * dk, *k = kb + t0 * dk, *beta = betab + t0, *go = gob + t0 * dv;
      const T* P = keep.starts.data() + c * dk * dv;
      const T* U = keep.u.data() + t0 * dv;
      const T* W = keep.residual.data() + t0 * dv;
      const T* M = keep.keys.data() + c * kChunk * kChunk;
      T *dq = dqb + t0 * dk, *dkc = dkb + t0 * dk, *dvc = dvb + t0 * dv;
      s.prepare_rows(in.g, d.n, bh, t0, L);
      chunk_scores(q, k, s, s.scores.data(), kChunk);
      s.from_chunk_start(k, s.k_start.data(), dk);
      s.to_chunk_end(k, s.k_end.data(), dk);
      // dU = s·Scᵀ dO + K̂ G;  dSc = s·dO Uᵀ (lower)
      matmul<T>(mat(s.du.data(), L, dv), mat<const T>(s.scores.data(), L, L, kChunk).t(), mat(go, L, dv), sc);
      matmul<T>(mat(s.du.data(), L, dv), mat<const T>(s.k_end.data(), L, dk), mat<const T>(G.data(), dk, dv), T(1),
                T(1));
      matmul<T>(mat(s.dscores.data(), L, L, kChunk), mat(go, L, dv), mat(U, L, dv).t(), sc);
      for (int64_t j = 0; j < L; ++j)
        std::fill(s.dscores.data() + j * kChunk + j + 1, s.dscores.data() + j * kChunk + L, T(0));
      // dQ = s·e^{B} ⊙ (dO Pᵀ) + (dSc ⊙ D) K;  column side (dSc ⊙ D)ᵀ Q
      matmul<T>(mat(s.work.data(), L, dk), mat(go, L, dv), mat(P, dk, dv).t(), sc);
      s.from_chunk_start(s.work.data(), dq, dk);
      weigh(s.dscores.data(), k, s, dq, false);
      std::fill(s.k_col.begin(), s.k_col.begin() + L * dk, T(0));
      weigh(s.dscores.data(), q, s, s.k_col.data(), true);
      // The state's part: e^{b_L − B} ⊙ (U Gᵀ)
      matmul<T>(mat(s.work.data(), L, dk), mat(U, L, dv), mat<const T>(G.data(), dk, dv).t());
      s.to_chunk_end(s.work.data(), s.k_state.data(), dk);
      // dR = (I + A)⁻ᵀ dU (A as the forward made it);  dA = −dR Uᵀ strictly lower
      build_system(s, M, beta);
      std::copy(s.du.begin(), s.du.begin() + L * dv, s.dr.begin());
      solve_unit_lower<T>(mat<const T>(s.system.data(), L, L, kChunk).t(), mat(s.dr.data(), L, dv));
      matmul<T>(mat(s.dm.data(), L, L, kChunk), mat<const T>(s.dr.data(), L, dv), mat(U, L, dv).t(), T(-1));
      for (int64_t t = 0; t < L; ++t) {
        T* row = s.dm.data() + t * kChunk;
        std::fill(row + t, row + L, T(0));
        double dbeta = 0;
        for (int64_t i = 0; i < t; ++i) dbeta += static_cast<double>(row[i]) * static_cast<double>(M[t * kChunk + i]);
        for (int64_t e = 0; e < dv; ++e)
          dbeta += static_cast<double>(W[t * dv + e]) * static_cast<double>(s.dr[t * dv + e]);
        dbetab[t0 + t] = static_cast<T>(dbeta);
        simd::scale(row, static_cast<size_t>(t), beta[t]);  // dM = β_t dA[t, ·]
      }
      // dV = β ⊙ dR;  E = −β ⊙ dR (in dr)
      simd::scale_rows(s.dr.data(), static_cast<size_t>(dv), static_cast<size_t>(L), static_cast<size_t>(dv), beta, dvc,
                       static_cast<size_t>(dv));
      for (int64_t i = 0; i < L * dv; ++i) s.dr[i] = -dvc[i];
      // Row side of K: (dM ⊙ D) K + e^{B} ⊙ (E Pᵀ);  column side += (dM ⊙ D)ᵀ K
      matmul<T>(mat(s.work.data(), L, dk), mat<const T>(s.dr.data(), L, dv), mat(P, dk, dv).t());
      s.from_chunk_start(s.work.data(), s.k_row.data(), dk);
      weigh(s.dm.data(), k, s, s.k_row.data(), false);
      weigh(s.dm.data(), k, s, s.k_col.data(), true);
      for (int64_t i = 0; i < L * dk; ++i) dkc[i] = s.k_row[i] + s.k_col[i] + s.k_state[i];
      s.finite = s.finite && simd::all_finite(dq, static_cast<size_t>(L * dk)) &&
                 simd::all_finite(dkc, static_cast<size_t>(L * dk)) &&
                 simd::all_finite(dvc, static_cast<size_t>(L * dv)) && simd::all_finite(dbetab + t0, static_cast<size_t>(L));
      // db, then dg = its reverse cumulative sum in the chunk (log-gates at the floor get none)
      for (int64_t j = 0; j < L; ++j)
        for (int64_t e = 0; e < dk; ++e) {
          const int64_t x = j * dk + e;
          db[x] = static_cast<double>(q[x]) * static_cast<double>(dq[x]) +
                  static_cast<double>(k[x]) * (static_cast<double>(s.k_row[x]) - static_cast<double>(s.k_col[x]) -
                                               static_cast<double>(s.k_state[x]));
        }
      T* dgc = g.dg.data() + (bh * d.n + t0) * width;
      s.gate_gradients(db, k, s.k_state.data(), G.data(), P, dv, in.g.data + (bh * d.n + t0) * width, dgc);
      s.finite = s.finite && simd::all_finite(dgc, static_cast<size_t>(L * width));
      // G ← diag(e^{b_L}) G + s·(Q ⊙ e^{B})ᵀ dO + K_Bᵀ E
      s.from_chunk_start(q, s.work.data(), dk);
      s.decay_over_chunk(G.data(), dv);
      matmul<T>(mat(G.data(), dk, dv), mat<const T>(s.work.data(), L, dk).t(), mat(go, L, dv), sc, T(1));
      matmul<T>(mat(G.data(), dk, dv), mat<const T>(s.k_start.data(), L, dk).t(), mat<const T>(s.dr.data(), L, dv),
                T(1), T(1));
    }
    s.finite = s.finite && simd::all_finite(G.data(), G.size());
    std::copy(G.begin(), G.end(), g.dinitial_state.data() + bh * dk * dv);
  });
  if (!all_ok(scratch)) fail_on_results(fn, d, in);
  // Grouped heads: a key head's gradients are its value heads' sums; then the l2norm's chain.
  parallel_for(d.batch * d.key_heads, [&](int64_t task) {
    const int64_t rows = d.n * dk;
    if (!own_key_grads) {
      const int64_t first = task / d.key_heads * d.heads + task % d.key_heads * d.group();
      for (auto [sum, parts] : {std::pair{g.dq.data(), dq_heads.data()}, std::pair{g.dk.data(), dk_heads.data()}}) {
        T* out = sum + task * rows;
        std::copy(parts + first * rows, parts + (first + 1) * rows, out);
        for (int64_t h = 1; h < d.group(); ++h)
          for (int64_t i = 0; i < rows; ++i) out[i] += parts[(first + h) * rows + i];
      }
    }
    if (d.l2norm)
      for (int64_t t = task * d.n; t < (task + 1) * d.n; ++t) {
        KernelQK<T>::chain(qk.q.data, qk.q_factor, t, dk, g.dq.data());
        KernelQK<T>::chain(qk.k.data, qk.k_factor, t, dk, g.dk.data());
      }
  });
  check_result_finite(fn, "dq", g.dq);
  check_result_finite(fn, "dk", g.dk);
  return g;
}

}  // namespace delta

template <class T>
GatedDeltaRuleResult<T> gated_delta_rule(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                         TensorView<const T> g, TensorView<const T> beta,
                                         TensorView<const T> initial_state, const GatedDeltaRuleOptions& opts) {
  const char* fn = "gated_delta_rule";
  const delta::Inputs<T> in{q, k, v, g, beta, initial_state, {}, {}};
  const delta::Dims d = delta::check_args(fn, in, opts);
  return d.n <= delta::kRecurrentUpTo ? delta::recurrent_forward(fn, in, d) : delta::forward(fn, in, d);
}

template <class T>
GatedDeltaRuleGrads<T> gated_delta_rule_backward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                                 TensorView<const T> g, TensorView<const T> beta,
                                                 TensorView<const T> initial_state, TensorView<const T> dout,
                                                 TensorView<const T> dstate, const GatedDeltaRuleOptions& opts) {
  const char* fn = "gated_delta_rule_backward";
  const delta::Inputs<T> in{q, k, v, g, beta, initial_state, dout, dstate};
  const delta::Dims d = delta::check_args(fn, in, opts);
  check_shape(fn, "dout", dout, {d.batch, d.heads, d.n, d.dv});
  return delta::backward(fn, in, d);
}

#define LINATTN_INSTANTIATE(T)                                                                                     \
  template GatedDeltaRuleResult<T> gated_delta_rule(TensorView<const T>, TensorView<const T>, TensorView<const T>,  \
                                                    TensorView<const T>, TensorView<const T>, TensorView<const T>,  \
                                                    const GatedDeltaRuleOptions&);                                 \
  template GatedDeltaRuleGrads<T> gated_delta_rule_backward(                                                       \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,      \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, const GatedDeltaRuleOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
