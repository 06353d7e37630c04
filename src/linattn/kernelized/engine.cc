// Kernelized attention in O(n). Notation per (batch·head): φ̃ are the (stabilised) features
// and ls their log-scales, φ = φ̃·exp(ls) (ls = 0 for unstabilised maps). Query log-scales
// cancel in the ratio and are dropped. Key log-scales are carried as a running maximum c:
// key j enters sums with weight exp(ls_j − c) <= 1, and sums are rescaled when c grows, so
// nothing overflows and the dominant keys never underflow.
//
// Non-causal:  KV = Σ_j w_j φ̃k_j v_jᵀ,  z = Σ_j w_j φ̃k_j   (w_j = exp(ls_j − c))
//              num_i = φ̃q_i·KV,  den_i = φ̃q_i·z,  out_i = num_i / (den_i + eps)
// Causal (chunks of kChunk rows, carried prefix state S, z with log-scale c):
//              M_i = max(c, max_{j<=i in chunk} ls_j),  α_i = exp(c − M_i)
//              W_ij = (φ̃q_i·φ̃k_j)·exp(ls_j − M_i) for j <= i in the chunk
//              num_i = α_i φ̃q_i·S + Σ_j W_ij v_j,  den_i = α_i φ̃q_i·z + Σ_j W_ij
// Backward, with D_i = den_i + eps, dnum_i = dout_i/D_i, dden_i = −dout_i·out_i/D_i:
//              dφ̃q_i = α_i(S·dnum_i + z·dden_i) + Σ_j P_ij φ̃k_j,  P_ij = (dnum_i·v_j + dden_i)·exp(ls_j − M_i)
//              dφ̃k_j = exp(ls_j + ρ)(R·v_j + r) + Σ_i P_ij φ̃q_i
//              dv_j  = exp(ls_j + ρ) Rᵀφ̃k_j + Σ_i W_ij dnum_i
// where R = Σ_{later i} exp(−M_i − ρ) φ̃q_i dnum_iᵀ, r likewise with dden_i, is the suffix
// state of a reverse pass with its own running log-scale ρ = max(−M_i).
// A row with D_i = 0 (possible only with eps = 0) gets out_i = 0 and no gradient.
#include "linattn/kernelized/engine.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "linattn/core/blas.h"
#include "linattn/core/simd.h"
#include "linattn/core/threading.h"

namespace linattn::kernelized {
namespace {

template <class T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// exp(a − b) with exp(−inf − x) = 0 for any x, including −inf.
template <class T>
T exp_diff(T a, T b) {
  return a == neg_inf<T>() ? T(0) : std::exp(a - b);
}

template <class T>
void add_column_sums(const T* a, int64_t rows, int64_t cols, T* z) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) z[c] += a[i * cols + c];
}

// out_i = num_i / D_i (0 where D_i = 0), in place on the num rows.
template <class T>
void divide_rows(T* num, const T* D, int64_t rows, int64_t dv) {
  for (int64_t i = 0; i < rows; ++i) {
    if (D[i] != 0) {
      simd::scale(num + i * dv, static_cast<size_t>(dv), T(1) / D[i]);
    } else {
      for (int64_t c = 0; c < dv; ++c) num[i * dv + c] = 0;
    }
  }
}

// dnum_i = dout_i / D_i, dden_i = −dout_i·out_i / D_i (both 0 where D_i = 0).
template <class T>
void output_grads(const T* dout, const T* out, const T* D, int64_t rows, int64_t dv, T* dnum,
                  T* dden) {
  for (int64_t i = 0; i < rows; ++i) {
    const T inv = D[i] != 0 ? T(1) / D[i] : T(0);
    for (int64_t c = 0; c < dv; ++c) dnum[i * dv + c] = dout[i * dv + c] * inv;
    dden[i] = -simd::dot(dout + i * dv, out + i * dv, static_cast<size_t>(dv)) * inv;
  }
}

// Per-worker buffers, allocated before the parallel loop; each mode gets only what it uses.
template <class T>
struct Scratch {
  Scratch(const Problem<T>& p, bool causal) {
    const int64_t rows = causal ? kChunk : kBlockRows, m = p.fmap->dim(), dv = p.dims.value_dim;
    phi = Buffer<T>(rows * m);
    dphi = Buffer<T>(rows * m);
    fs = Buffer<T>(p.fmap->scratch_size(rows));
    ls = Buffer<T>(rows);
    D = Buffer<T>(rows);
    num = Buffer<T>(rows * dv);
    dnum = Buffer<T>(rows * dv);
    dden = Buffer<T>(rows);
    if (causal) {
      phi2 = Buffer<T>(rows * m);
      psi = Buffer<T>(rows * m);
      M = Buffer<T>(rows);
      kv = Buffer<T>(m * dv);
      dkv = Buffer<T>(m * dv);
      z = Buffer<T>(m);
      dz = Buffer<T>(m);
      a = Buffer<T>(kChunk * kChunk);
      b = Buffer<T>(kChunk * kChunk);
    } else {
      kvz = Buffer<T>(m * (dv + 1));
      dkvz = Buffer<T>(m * (dv + 1));
      vaug = Buffer<T>(rows * (dv + 1));
      nd = Buffer<T>(rows * (dv + 1));
      dnd = Buffer<T>(rows * (dv + 1));
    }
  }
  // Both modes: features φ̃ (queries, or keys non-causal), their gradient, the feature map's
  // scratch, key log-scales, denominators, outputs and output gradients of a block.
  Buffer<T> phi, dphi, fs, ls, D, num, dnum, dden;
  // Causal: key features φ̃k and scaled copies of a chunk, running maxima M, the carried state
  // S = kv, z (and the backward's suffix state in dkv, dz), the chunk's W and P tiles.
  Buffer<T> phi2, psi, M, kv, z, dkv, dz, a, b;
  // Non-causal, augmented so one product gives both sums: [KV | z] (m'×(d_v+1)), [w∘V | w]
  // (rows×(d_v+1)), [num | den] and [dnum | dden] (rows×(d_v+1)).
  Buffer<T> kvz, dkvz, vaug, nd, dnd;
};

// Key features of rows [j0, j0+rows) with log-scales (0 for unstabilised maps).
template <class T>
void key_features(const Problem<T>& p, int64_t bh, int64_t j0, int64_t rows, T* phi, T* ls) {
  p.fmap->forward(p.k.row(bh, j0), rows, phi, p.fmap->stabilized() ? ls : nullptr);
  if (!p.fmap->stabilized())
    for (int64_t j = 0; j < rows; ++j) ls[j] = 0;
}

// ---- non-causal ----------------------------------------------------------------------------

// s.vaug rows = [w_j v_j, w_j], w_j = exp(ls_j − c) (1 for unstabilised maps).
template <class T>
void augmented_values(const Problem<T>& p, int64_t bh, int64_t j0, int64_t rows, T c,
                      const T* ls, Scratch<T>& s) {
  const int64_t dv = p.dims.value_dim, da = dv + 1;
  for (int64_t j = 0; j < rows; ++j) {
    const T w = p.fmap->stabilized() ? std::exp(ls[j] - c) : T(1);
    const T* vr = p.v.row(bh, j0 + j);
    T* a = s.vaug.data() + j * da;
    for (int64_t cc = 0; cc < dv; ++cc) a[cc] = w * vr[cc];
    a[dv] = w;
  }
}

// [KV | z] = Σ_j φ̃k_jᵀ·[w_j v_j, w_j] over the valid keys of bh, w_j = exp(ls_j − c) with the
// running key log-scale c (rescaled as it grows); returns the final c. On return s.phi and
// s.vaug hold the last block (the backward's key pass rebuilds them).
// cache (optional, n_k·(m'+1) values): keeps φ̃k and ls of every key for the backward.
template <class T>
T accumulate_kv(const Problem<T>& p, int64_t bh, int64_t key_len, Scratch<T>& s,
                T* cache = nullptr) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, da = dv + 1;
  std::fill(s.kvz.data(), s.kvz.data() + m * da, T(0));
  T c = neg_inf<T>();
  for (int64_t j0 = 0; j0 < key_len; j0 += kBlockRows) {
    interruption_point();
    const int64_t rows = std::min(kBlockRows, key_len - j0);
    key_features(p, bh, j0, rows, s.phi.data(), s.ls.data());
    if (p.fmap->stabilized()) {
      const T c_new = std::max(c, simd::max_value(s.ls.data(), static_cast<size_t>(rows)));
      if (c_new > c && c != neg_inf<T>()) simd::scale(s.kvz.data(), static_cast<size_t>(m * da), std::exp(c - c_new));
      c = c_new;
    }
    augmented_values(p, bh, j0, rows, c, s.ls.data(), s);
    gemm<T>(Trans::Yes, Trans::No, m, da, rows, T(1), s.phi.data(), m, s.vaug.data(), da, T(1),
            s.kvz.data(), da);
    if (cache) {
      std::copy(s.phi.data(), s.phi.data() + rows * m, cache + j0 * m);
      std::copy(s.ls.data(), s.ls.data() + rows, cache + p.dims.n_k * m + j0);
    }
  }
  return c;
}

// [num | den] for query rows [i0, i0+rows) into s.nd, D_i = den_i + eps into s.D, and
// out_i = num_i / D_i into out (stride d_v); φ̃q left in s.phi.
template <class T>
void query_rows(const Problem<T>& p, int64_t bh, int64_t i0, int64_t rows, Scratch<T>& s, T* out) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, da = dv + 1;
  p.fmap->forward(p.q.row(bh, i0), rows, s.phi.data(), nullptr);
  gemm<T>(Trans::No, Trans::No, rows, da, m, T(1), s.phi.data(), m, s.kvz.data(), da, T(0),
          s.nd.data(), da);
  for (int64_t i = 0; i < rows; ++i) {
    const T* nd = s.nd.data() + i * da;
    const T D = nd[dv] + p.eps;
    s.D[i] = D;
    const T inv = D != 0 ? T(1) / D : T(0);
    for (int64_t c = 0; c < dv; ++c) out[i * dv + c] = nd[c] * inv;
  }
}

template <class T>
void forward_noncausal(const Problem<T>& p, int64_t bh, Scratch<T>& s, T* out) {
  const int64_t dv = p.dims.value_dim;
  const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
  accumulate_kv(p, bh, key_len, s);
  for (int64_t i0 = 0; i0 < p.dims.n_q; i0 += kBlockRows) {
    interruption_point();
    const int64_t rows = std::min(kBlockRows, p.dims.n_q - i0);
    query_rows(p, bh, i0, rows, s, out + (bh * p.dims.n_q + i0) * dv);
  }
}

template <class T>
void backward_noncausal(const Problem<T>& p, int64_t bh, Scratch<T>& s, T* cache, const T* dout,
                        T* dq, T* dk, T* dv_out) {
  const int64_t m = p.fmap->dim(), d = p.dims.head_dim, dv = p.dims.value_dim, da = dv + 1;
  const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
  const T c = accumulate_kv(p, bh, key_len, s, cache);
  std::fill(s.dkvz.data(), s.dkvz.data() + m * da, T(0));
  // Queries: [dnum | dden]; dφ̃q = [dnum | dden]·[KV | z]ᵀ; [dKV | dz] += φ̃qᵀ·[dnum | dden].
  for (int64_t i0 = 0; i0 < p.dims.n_q; i0 += kBlockRows) {
    interruption_point();
    const int64_t rows = std::min(kBlockRows, p.dims.n_q - i0);
    query_rows(p, bh, i0, rows, s, s.num.data());
    output_grads(dout + (bh * p.dims.n_q + i0) * dv, s.num.data(), s.D.data(), rows, dv,
                 s.dnum.data(), s.dden.data());
    for (int64_t i = 0; i < rows; ++i) {
      std::copy(s.dnum.data() + i * dv, s.dnum.data() + (i + 1) * dv, s.dnd.data() + i * da);
      s.dnd[i * da + dv] = s.dden[i];
    }
    gemm<T>(Trans::No, Trans::Yes, rows, m, da, T(1), s.dnd.data(), da, s.kvz.data(), da, T(0),
            s.dphi.data(), m);
    gemm<T>(Trans::Yes, Trans::No, m, da, rows, T(1), s.phi.data(), m, s.dnd.data(), da, T(1),
            s.dkvz.data(), da);
    p.fmap->backward(p.q.row(bh, i0), rows, s.phi.data(), s.dphi.data(),
                     dq + (bh * p.dims.n_q + i0) * d, s.fs.data());
  }
  // Keys entered as φ̃k_jᵀ[w_j v_j, w_j]: dφ̃k_j = [w_j v_j, w_j]·[dKV | dz]ᵀ and
  // dv_j = w_j·(φ̃k_j·dKV).
  for (int64_t j0 = 0; j0 < key_len; j0 += kBlockRows) {
    interruption_point();
    const int64_t rows = std::min(kBlockRows, key_len - j0);
    const T* phi = s.phi.data();
    const T* ls = s.ls.data();
    if (cache) {
      phi = cache + j0 * m;
      ls = cache + p.dims.n_k * m + j0;
    } else {
      key_features(p, bh, j0, rows, s.phi.data(), s.ls.data());
    }
    augmented_values(p, bh, j0, rows, c, ls, s);
    gemm<T>(Trans::No, Trans::Yes, rows, m, da, T(1), s.vaug.data(), da, s.dkvz.data(), da, T(0),
            s.dphi.data(), m);
    T* dvb = dv_out + (bh * p.dims.n_k + j0) * dv;
    gemm<T>(Trans::No, Trans::No, rows, dv, m, T(1), phi, m, s.dkvz.data(), da, T(0), dvb, dv);
    if (p.fmap->stabilized())
      for (int64_t j = 0; j < rows; ++j) simd::scale(dvb + j * dv, static_cast<size_t>(dv), s.vaug[j * da + dv]);
    p.fmap->backward(p.k.row(bh, j0), rows, phi, s.dphi.data(), dk + (bh * p.dims.n_k + j0) * d,
                     s.fs.data());
  }
}

// ---- causal --------------------------------------------------------------------------------

// One chunk's intra-chunk weights. With φ̃q in s.phi, φ̃k in s.phi2, key log-scales in s.ls
// (−inf for padded keys) and the carried log-scale c: fills M_i (into M), α_i (into alpha),
// and W (C×C, row-major, zero above the diagonal and for padded keys) into s.a.
template <class T>
void chunk_weights(const Problem<T>& p, int64_t rows, int64_t kr, T c, Scratch<T>& s, T* M,
                   T* alpha) {
  const int64_t m = p.fmap->dim();
  gemm<T>(Trans::No, Trans::Yes, rows, kr, m, T(1), s.phi.data(), m, s.phi2.data(), m, T(0),
          s.a.data(), kChunk);
  T run = c;
  for (int64_t i = 0; i < rows; ++i) {
    run = std::max(run, s.ls[i]);
    M[i] = run;
    alpha[i] = exp_diff(c, run);
    T* w = s.a.data() + i * kChunk;
    const int64_t jend = std::min(i + 1, kr);
    for (int64_t j = 0; j < jend; ++j) w[j] *= exp_diff(s.ls[j], run);
    for (int64_t j = jend; j < rows; ++j) w[j] = 0;
  }
}

// Adds this chunk's keys to the carried state (S = s.kv, z = s.z, log-scale c).
template <class T>
T update_state(const Problem<T>& p, int64_t bh, int64_t t0, int64_t rows, T c, Scratch<T>& s) {
  // rows: the chunk's valid keys only.
  if (rows == 0) return c;
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  const T c_new = std::max(c, simd::max_value(s.ls.data(), static_cast<size_t>(rows)));
  if (c_new == neg_inf<T>()) return c;  // no valid key yet
  if (c != neg_inf<T>() && c_new > c) {
    const T beta = std::exp(c - c_new);
    simd::scale(s.kv.data(), static_cast<size_t>(m * dv), beta);
    simd::scale(s.z.data(), static_cast<size_t>(m), beta);
  }
  for (int64_t j = 0; j < rows; ++j) {
    const T w = exp_diff(s.ls[j], c_new);
    for (int64_t r = 0; r < m; ++r) s.psi[j * m + r] = w * s.phi2[j * m + r];
  }
  gemm<T>(Trans::Yes, Trans::No, m, dv, rows, T(1), s.psi.data(), m, p.v.row(bh, t0), dv, T(1),
          s.kv.data(), dv);
  add_column_sums(s.psi.data(), rows, m, s.z.data());
  return c_new;
}

// Features of chunk [t0, t0+rows): φ̃q → s.phi, φ̃k → s.phi2, ls → s.ls. Keys past key_len
// are never read (they may hold anything): their feature rows are 0 and ls = −inf. Returns
// the number of valid keys in the chunk; key-side products stop there, so no padded value
// (inf or NaN) meets a zero weight.
template <class T>
int64_t chunk_features(const Problem<T>& p, int64_t bh, int64_t t0, int64_t rows,
                       int64_t key_len, Scratch<T>& s) {
  const int64_t m = p.fmap->dim();
  const int64_t kr = std::clamp<int64_t>(key_len - t0, 0, rows);
  p.fmap->forward(p.q.row(bh, t0), rows, s.phi.data(), nullptr);
  if (kr > 0) key_features(p, bh, t0, kr, s.phi2.data(), s.ls.data());
  for (int64_t j = kr; j < rows; ++j) {
    s.ls[j] = neg_inf<T>();
    for (int64_t r = 0; r < m; ++r) s.phi2[j * m + r] = 0;
  }
  return kr;
}

// num_i, D_i of a chunk into num (rows×dv) and D, given chunk_weights' W and alpha.
template <class T>
void chunk_outputs(const Problem<T>& p, int64_t bh, int64_t t0, int64_t rows, int64_t kr,
                   Scratch<T>& s, const T* alpha, T* num, T* D) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  gemm<T>(Trans::No, Trans::No, rows, dv, m, T(1), s.phi.data(), m, s.kv.data(), dv, T(0), num, dv);
  for (int64_t i = 0; i < rows; ++i) {
    simd::scale(num + i * dv, static_cast<size_t>(dv), alpha[i]);
    T den = alpha[i] * simd::dot(s.phi.data() + i * m, s.z.data(), static_cast<size_t>(m));
    for (int64_t j = 0; j < std::min(i + 1, kr); ++j) den += s.a[i * kChunk + j];
    D[i] = den + p.eps;
  }
  gemm<T>(Trans::No, Trans::No, rows, dv, kr, T(1), s.a.data(), kChunk, p.v.row(bh, t0), dv,
          T(1), num, dv);
}

// state: S, z, c of this batch·head to start from and to leave the final state in, or null
// to start empty.
template <class T>
void forward_causal(const Problem<T>& p, int64_t bh, Scratch<T>& s, T* out, T* S0 = nullptr,
                    T* z0 = nullptr, T* c0 = nullptr) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, n = p.dims.n_q;
  const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
  std::fill(s.kv.data(), s.kv.data() + m * dv, T(0));
  std::fill(s.z.data(), s.z.data() + m, T(0));
  T c = p.fmap->stabilized() ? neg_inf<T>() : T(0);
  if (S0) {
    std::copy(S0, S0 + m * dv, s.kv.data());
    std::copy(z0, z0 + m, s.z.data());
    c = *c0;
  }
  T alpha[kChunk];
  for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
    interruption_point();
    const int64_t rows = std::min(kChunk, n - t0);
    const int64_t kr = chunk_features(p, bh, t0, rows, key_len, s);
    chunk_weights(p, rows, kr, c, s, s.M.data(), alpha);
    T* o = out + (bh * n + t0) * dv;
    chunk_outputs(p, bh, t0, rows, kr, s, alpha, o, s.D.data());
    divide_rows(o, s.D.data(), rows, dv);
    c = update_state(p, bh, t0, kr, c, s);
  }
  if (S0) {
    std::copy(s.kv.data(), s.kv.data() + m * dv, S0);
    std::copy(s.z.data(), s.z.data() + m, z0);
    *c0 = c;
  }
}

template <class T>
void backward_causal(const Problem<T>& p, int64_t bh, Scratch<T>& s, Buffer<T>& saved,
                     const T* dout, T* dq, T* dk, T* dv_out) {
  const int64_t m = p.fmap->dim(), d = p.dims.head_dim, dv = p.dims.value_dim, n = p.dims.n_q;
  const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
  T* D_all = saved.data();         // [n]
  T* M_all = saved.data() + n;     // [n]
  T* dden_all = saved.data() + 2 * n;
  T alpha[kChunk];
  // Pass A, forward in time: out, D, M; dφ̃q with the prefix state; dq.
  std::fill(s.kv.data(), s.kv.data() + m * dv, T(0));
  std::fill(s.z.data(), s.z.data() + m, T(0));
  T c = p.fmap->stabilized() ? neg_inf<T>() : T(0);
  for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
    interruption_point();
    const int64_t rows = std::min(kChunk, n - t0);
    const int64_t kr = chunk_features(p, bh, t0, rows, key_len, s);
    chunk_weights(p, rows, kr, c, s, M_all + t0, alpha);
    chunk_outputs(p, bh, t0, rows, kr, s, alpha, s.num.data(), D_all + t0);
    divide_rows(s.num.data(), D_all + t0, rows, dv);
    output_grads(dout + (bh * n + t0) * dv, s.num.data(), D_all + t0, rows, dv, s.dnum.data(),
                 dden_all + t0);
    // P_ij = (dnum_i·v_j + dden_i)·exp(ls_j − M_i) on the causal triangle: W_ij/(φ̃q_i·φ̃k_j)
    // is that exponential, so build it from dnum·Vᵀ and the same mask.
    gemm<T>(Trans::No, Trans::Yes, rows, kr, dv, T(1), s.dnum.data(), dv, p.v.row(bh, t0), dv,
            T(0), s.b.data(), kChunk);
    for (int64_t i = 0; i < rows; ++i) {
      T* pr = s.b.data() + i * kChunk;
      const int64_t jend = std::min(i + 1, kr);
      for (int64_t j = 0; j < jend; ++j)
        pr[j] = (pr[j] + dden_all[t0 + i]) * exp_diff(s.ls[j], M_all[t0 + i]);
      for (int64_t j = jend; j < rows; ++j) pr[j] = 0;
    }
    // dφ̃q = α∘(dnum·Sᵀ + dden·zᵀ) + P·φ̃k
    gemm<T>(Trans::No, Trans::Yes, rows, m, dv, T(1), s.dnum.data(), dv, s.kv.data(), dv, T(0),
            s.dphi.data(), m);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t r = 0; r < m; ++r)
        s.dphi[i * m + r] = alpha[i] * (s.dphi[i * m + r] + dden_all[t0 + i] * s.z[r]);
    gemm<T>(Trans::No, Trans::No, rows, m, kr, T(1), s.b.data(), kChunk, s.phi2.data(), m, T(1),
            s.dphi.data(), m);
    p.fmap->backward(p.q.row(bh, t0), rows, s.phi.data(), s.dphi.data(), dq + (bh * n + t0) * d,
                     s.fs.data());
    c = update_state(p, bh, t0, kr, c, s);
  }
  // Pass B, backward in time: suffix state R (in s.dkv), r (in s.dz) with log-scale rho.
  std::fill(s.dkv.data(), s.dkv.data() + m * dv, T(0));
  std::fill(s.dz.data(), s.dz.data() + m, T(0));
  T rho = neg_inf<T>();
  const int64_t last = (n - 1) / kChunk * kChunk;
  for (int64_t t0 = last; t0 >= 0; t0 -= kChunk) {
    interruption_point();
    const int64_t rows = std::min(kChunk, n - t0);
    const int64_t kr = chunk_features(p, bh, t0, rows, key_len, s);
    // W from the saved M (c only enters α, unused here).
    gemm<T>(Trans::No, Trans::Yes, rows, kr, m, T(1), s.phi.data(), m, s.phi2.data(), m, T(0),
            s.a.data(), kChunk);
    for (int64_t i = 0; i < rows; ++i) {
      const T inv = D_all[t0 + i] != 0 ? T(1) / D_all[t0 + i] : T(0);
      for (int64_t cc = 0; cc < dv; ++cc) s.dnum[i * dv + cc] = dout[(bh * n + t0 + i) * dv + cc] * inv;
    }
    gemm<T>(Trans::No, Trans::Yes, rows, kr, dv, T(1), s.dnum.data(), dv, p.v.row(bh, t0), dv,
            T(0), s.b.data(), kChunk);
    for (int64_t i = 0; i < rows; ++i) {
      T* w = s.a.data() + i * kChunk;
      T* pr = s.b.data() + i * kChunk;
      const int64_t jend = std::min(i + 1, kr);
      for (int64_t j = 0; j < jend; ++j) {
        const T e = exp_diff(s.ls[j], M_all[t0 + i]);
        w[j] *= e;
        pr[j] = (pr[j] + dden_all[t0 + i]) * e;
      }
      for (int64_t j = jend; j < rows; ++j) w[j] = pr[j] = 0;
    }
    if (kr > 0) {
      // dφ̃k = γ∘(v·Rᵀ + 1·rᵀ) + Pᵀ·φ̃q, γ_j = exp(ls_j + ρ)
      gemm<T>(Trans::No, Trans::Yes, kr, m, dv, T(1), p.v.row(bh, t0), dv, s.dkv.data(), dv, T(0),
              s.dphi.data(), m);
      T gamma[kChunk];
      for (int64_t j = 0; j < kr; ++j) {
        gamma[j] = rho == neg_inf<T>() ? T(0) : std::exp(s.ls[j] + rho);
        for (int64_t r = 0; r < m; ++r) s.dphi[j * m + r] = gamma[j] * (s.dphi[j * m + r] + s.dz[r]);
      }
      gemm<T>(Trans::Yes, Trans::No, kr, m, rows, T(1), s.b.data(), kChunk, s.phi.data(), m, T(1),
              s.dphi.data(), m);
      // dv = γ∘(φ̃k·R) + Wᵀ·dnum
      T* dvc = dv_out + (bh * n + t0) * dv;
      gemm<T>(Trans::No, Trans::No, kr, dv, m, T(1), s.phi2.data(), m, s.dkv.data(), dv, T(0), dvc, dv);
      for (int64_t j = 0; j < kr; ++j) simd::scale(dvc + j * dv, static_cast<size_t>(dv), gamma[j]);
      gemm<T>(Trans::Yes, Trans::No, kr, dv, rows, T(1), s.a.data(), kChunk, s.dnum.data(), dv,
              T(1), dvc, dv);
      p.fmap->backward(p.k.row(bh, t0), kr, s.phi2.data(), s.dphi.data(), dk + (bh * n + t0) * d,
                       s.fs.data());
    }
    // Add this chunk's queries to the suffix state.
    T rho_new = rho;
    for (int64_t i = 0; i < rows; ++i)
      if (M_all[t0 + i] != neg_inf<T>()) rho_new = std::max(rho_new, -M_all[t0 + i]);
    if (rho_new == neg_inf<T>()) continue;
    if (rho != neg_inf<T>() && rho_new > rho) {
      const T beta = std::exp(rho - rho_new);
      simd::scale(s.dkv.data(), static_cast<size_t>(m * dv), beta);
      simd::scale(s.dz.data(), static_cast<size_t>(m), beta);
    }
    rho = rho_new;
    for (int64_t i = 0; i < rows; ++i) {
      const T w = M_all[t0 + i] == neg_inf<T>() ? T(0) : std::exp(-M_all[t0 + i] - rho);
      for (int64_t r = 0; r < m; ++r) {
        s.psi[i * m + r] = w * s.phi[i * m + r];
        s.dz[r] += s.psi[i * m + r] * dden_all[t0 + i];
      }
    }
    gemm<T>(Trans::Yes, Trans::No, m, dv, rows, T(1), s.psi.data(), m, s.dnum.data(), dv, T(1),
            s.dkv.data(), dv);
  }
}

std::atomic<int64_t> g_feature_cache_bytes{int64_t{32} << 20};

}  // namespace

int64_t feature_cache_bytes() { return g_feature_cache_bytes.load(); }
void set_feature_cache_bytes(int64_t bytes) { g_feature_cache_bytes.store(bytes); }

template <class T>
void forward(const Problem<T>& p, T* out) {
  const bool causal = p.mask->causal();
  const ParallelLoop loop(p.dims.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(p, causal); });
  loop.run([&](int64_t bh, int worker) {
    Scratch<T>& s = scratch[worker];
    if (causal) {
      forward_causal(p, bh, s, out);
    } else {
      forward_noncausal(p, bh, s, out);
    }
  });
}

template <class T>
void forward_causal_from_state(const Problem<T>& p, T* out, T* S, T* z, T* c) {
  require(p.mask->causal(), "forward_causal_from_state: the problem must be causal");
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  const ParallelLoop loop(p.dims.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(p, true); });
  loop.run([&](int64_t bh, int worker) {
    forward_causal(p, bh, scratch[worker], out, S + bh * m * dv, z + bh * m, c + bh);
  });
}

template <class T>
void backward(const Problem<T>& p, const T* dout, T* dq, T* dk, T* dv) {
  const bool causal = p.mask->causal();
  // causal: D, M, dden per row of the current batch·head (O(n)). Non-causal: φ̃k and ls of
  // every key, so the key pass need not compute the features again, when that fits in
  // kFeatureCacheBytes per worker (else they are recomputed: same result, more time).
  const int64_t cache_size = p.dims.n_k * (p.fmap->dim() + 1);
  const bool cache = !causal && cache_size * static_cast<int64_t>(sizeof(T)) <= feature_cache_bytes();
  const ParallelLoop loop(p.dims.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(p, causal); });
  PerWorker<Buffer<T>> saved(loop, [&] { return Buffer<T>(causal ? 3 * p.dims.n_q : cache ? cache_size : 0); });
  const int64_t d = p.dims.head_dim, dvd = p.dims.value_dim;
  loop.run([&](int64_t bh, int worker) {
    // Gradients of padded keys stay 0: the passes only write valid rows.
    std::fill(dk + bh * p.dims.n_k * d, dk + (bh + 1) * p.dims.n_k * d, T(0));
    std::fill(dv + bh * p.dims.n_k * dvd, dv + (bh + 1) * p.dims.n_k * dvd, T(0));
    Scratch<T>& s = scratch[worker];
    if (causal) {
      backward_causal(p, bh, s, saved[worker], dout, dq, dk, dv);
    } else {
      backward_noncausal(p, bh, s, cache ? saved[worker].data() : nullptr, dout, dq, dk, dv);
    }
  });
}

template void forward<float>(const Problem<float>&, float*);
template void forward<double>(const Problem<double>&, double*);
template void forward_causal_from_state<float>(const Problem<float>&, float*, float*, float*, float*);
template void forward_causal_from_state<double>(const Problem<double>&, double*, double*, double*,
                                                double*);
template void backward<float>(const Problem<float>&, const float*, float*, float*, float*);
template void backward<double>(const Problem<double>&, const double*, double*, double*, double*);

}  // namespace linattn::kernelized
