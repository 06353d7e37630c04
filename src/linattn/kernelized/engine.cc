// Kernelized attention in O(n). Per (batch·head), with key features K_j = φ(k_j) and query
// features Q_i = φ(q_i) (up to factors that cancel):
//   num_i = Q_i·Σ_j K_jᵀ v_j,  den_i = Q_i·Σ_j K_j + eps,  out_i = num_i / den_i.
//
// FAVOR maps come in log form, φ_r = s_r·exp(L_r) (feature_map.h), and at large input norms
// the L_r span thousands of units: no single scale keeps every exp(L) in range, and scaling by
// row (the usual max-subtraction) lets a query's features and the keys' features live on
// disjoint sets of r, so that every product underflows and 0/0 comes out. So the keys are
// scaled per feature r: K_jr = s_jr·exp(L_jr − c_r) with c_r the largest L_jr over the keys so
// far, and the query takes the shifts back: Q_ir = s_ir·exp(Lq_ir + c_r − t_i), t_i the row's
// largest exponent. Then every feature reached by a key has Σ_j K_jr >= 1, the query's largest
// weight is 1, and den_i >= 1 (non-causal). The shifts cancel exactly in Q_i·K_j, so they are
// constants for the gradients.
//
// Causal, in chunks: the state S = Σ K_jᵀv_j, z = Σ K_j over earlier chunks (scale c), and
// within a chunk the masked matrix W_ij = Q_i·K_j (j <= i). A chunk's keys move c to c'; a key
// that query i sees must not be crushed by a later key of the same chunk, so a chunk ends where
// some feature's running maximum has grown by more than kGrowth over its value at the chunk's
// start (down to chunks of one row, which are exact). That keeps each query's visible mass at
// >= e^−kGrowth of its largest feature, so den_i >= e^−kGrowth > 0 when the row sees any key.
//
// Backward (D_i = den_i, dnum_i = dout_i/D_i, dden_i = −dout_i·out_i/D_i, P_ij = dnum_i·v_j + dden_i):
//   dQ_i = dnum_i·Sᵀ + dden_i·z + Σ_{j<=i} P_ij K_j
//   dK_j = Σ_{i>=j} P_ij Q_i + R·v_j + ρ,   dv_j = Σ_{i>=j} W_ij dnum_i + K_j·R
// with R = Σ_{later i} Q_iᵀ dnum_i, ρ = Σ_{later i} Q_i dden_i the suffix state of a reverse
// pass over the chunks, carried in the scale of the chunk at hand: going back one chunk
// multiplies it by exp(c_prev − c') <= 1, so it never overflows. The feature maps' backward
// turns dQ, dK into dq, dk (via dL = dK∘K and, trig, ds = dK∘exp(L − c)).
// A row with D_i = 0 (no key in sight, eps = 0) gets out_i = 0 and no gradient.
#include "linattn/core/error.h"
#include "linattn/kernelized/engine.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "linattn/core/blas.h"
#include "linattn/core/simd.h"
#include "linattn/core/parallel.h"

namespace linattn::kernelized {
namespace {

template <class T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// The largest growth (in e-folds) of a feature's running maximum within one causal chunk:
// about half the exponent range, so e^−kGrowth is far above the smallest normal number.
template <class T>
constexpr T kGrowth = sizeof(T) == 4 ? T(40) : T(300);

// Features of one block of rows. Plain maps: f = φ(x). FAVOR: e = exp(L − shift) (first the
// logits L), s = the trig factors, and f = s∘e for trig (else the features are e itself).
template <class T>
struct Features {
  Features(const FeatureMap<T>& fm, int64_t rows, Side side)
      : f(fm.log_form() && !fm.has_factor() ? 0 : rows * fm.dim()),
        e(fm.log_form() ? rows * fm.dim() : 0),
        s(fm.has_factor() ? rows * fm.dim() : 0),
        t(fm.log_form() && side == Side::Query ? rows : 0) {}
  Buffer<T> f, e, s;
  Buffer<T> t;  // query rows: the exponent shift t_i (FAVOR)
  const T* values(const FeatureMap<T>& fm) const { return fm.log_form() && !fm.has_factor() ? e.data() : f.data(); }
  T* values(const FeatureMap<T>& fm) { return fm.log_form() && !fm.has_factor() ? e.data() : f.data(); }
};

// Rows of a block (non-causal) or chunk (causal), no more than the problem has.
template <class T>
int64_t block_rows(const Problem<T>& p, bool causal) {
  return std::max<int64_t>(1, std::min(causal ? kChunk : kBlockRows, std::max(p.dims.n_q, p.dims.n_k)));
}

// Per-worker buffers, allocated before the loop; each mode gets only what it uses.
template <class T>
struct Scratch {
  Scratch(const Problem<T>& p, bool causal)
      : qf(*p.fmap, block_rows(p, causal), Side::Query), kf(*p.fmap, block_rows(p, causal), Side::Key) {
    const int64_t rows = block_rows(p, causal), m = p.fmap->dim(), dv = p.dims.value_dim;
    dphi = Buffer<T>(rows * m);
    dlog = Buffer<T>(p.fmap->has_factor() ? rows * m : 0);
    fs = Buffer<T>(p.fmap->scratch_size(rows));
    D = Buffer<T>(rows);
    num = Buffer<T>(rows * dv);
    dnum = Buffer<T>(rows * dv);
    dden = Buffer<T>(rows);
    c = Buffer<T>(m);
    c_new = Buffer<T>(m);
    if (causal) {
      run_max = Buffer<T>(m);
      S = Buffer<T>(m * dv);
      z = Buffer<T>(m);
      R = Buffer<T>(m * dv);
      rho = Buffer<T>(m);
      W = Buffer<T>(rows * kChunk);  // leading dimension kChunk
      P = Buffer<T>(rows * kChunk);
    } else {
      kvz = Buffer<T>(m * (dv + 1));
      dkvz = Buffer<T>(m * (dv + 1));
      vaug = Buffer<T>(rows * (dv + 1));
      nd = Buffer<T>(rows * (dv + 1));
      dnd = Buffer<T>(rows * (dv + 1));
    }
  }
  Features<T> qf, kf;
  // Gradients of a block's features (dphi), and for trig the gradient of its logits (dlog);
  // the feature map's backward scratch; denominators, outputs and their gradients.
  Buffer<T> dphi, dlog, fs, D, num, dnum, dden;
  Buffer<T> c, c_new;  // per-feature log-shifts of the keys (FAVOR), and scratch for raising them
  Buffer<T> run_max;   // causal: a chunk's running maxima while finding where it ends
  // Causal: state S, z; suffix state R, ρ; a chunk's W and P.
  Buffer<T> S, z, R, rho, W, P;
  // Non-causal, augmented so one product gives both sums: [KV | z] (m'×(d_v+1)), [V | 1]
  // (rows×(d_v+1)), [num | den] and [dnum | dden] (rows×(d_v+1)).
  Buffer<T> kvz, dkvz, vaug, nd, dnd;
};

// ---- features --------------------------------------------------------------------------------

// Key logits (FAVOR, into kf.e and kf.s) or features (plain, into kf.f) of `rows` key rows
// from j0.
template <class T>
void key_logits(const Problem<T>& p, int64_t bh, int64_t j0, int64_t rows, Features<T>& kf) {
  if (p.fmap->log_form()) {
    p.fmap->logits(p.fn, p.k.row(bh, j0), rows, Side::Key, kf.e.data(), kf.s.data());
  } else {
    p.fmap->features(p.k.row(bh, j0), rows, kf.f.data());
  }
}

// FAVOR: kf.e holds key logits; make them the features exp(L − c) (times s for trig).
template <class T>
void finish_key_features(const Problem<T>& p, int64_t rows, const T* c, Features<T>& kf) {
  if (!p.fmap->log_form() || rows == 0) return;
  const int64_t m = p.fmap->dim();
  simd::exp_minus_columns(kf.e.data(), static_cast<size_t>(rows), static_cast<size_t>(m),
                          static_cast<size_t>(m), c);
  if (p.fmap->has_factor())
    for (int64_t i = 0; i < rows * m; ++i) kf.f[i] = kf.s[i] * kf.e[i];
}

// Query features of `rows` rows from i0 against the key shifts c: FAVOR Q_ir =
// s_ir·exp(Lq_ir + c_r − t_i) with t_i (into qf.t) the row's largest exponent.
template <class T>
void query_features(const Problem<T>& p, int64_t bh, int64_t i0, int64_t rows, const T* c,
                    Features<T>& qf) {
  if (!p.fmap->log_form()) {
    p.fmap->features(p.q.row(bh, i0), rows, qf.f.data());
    return;
  }
  const int64_t m = p.fmap->dim();
  p.fmap->logits(p.fn, p.q.row(bh, i0), rows, Side::Query, qf.e.data(), qf.s.data());
  for (int64_t i = 0; i < rows; ++i) qf.t[i] = simd::exp_row_offset(qf.e.data() + i * m, static_cast<size_t>(m), c);
  if (p.fmap->has_factor())
    for (int64_t i = 0; i < rows * m; ++i) qf.f[i] = qf.s[i] * qf.e[i];
}

// c_new = max(c, column maxima of `rows` key logits L (rows × m')).
template <class T>
void column_maxima(const T* L, int64_t rows, int64_t m, const T* c, T* c_new) {
  std::copy(c, c + m, c_new);
  simd::column_max(L, static_cast<size_t>(rows), static_cast<size_t>(m), static_cast<size_t>(m), c_new);
}

// Raises the shifts c to c_new (>= c); the state rows whose shift grew (S: m' rows of s_cols
// values; z: m' values, may be null) are multiplied by exp(c_old − c_new) <= 1.
template <class T>
void raise_shifts(int64_t m, const T* c_new, T* c, T* S, int64_t s_cols, T* z) {
  for (int64_t r = 0; r < m; ++r) {
    if (!(c_new[r] > c[r])) continue;
    if (c[r] != neg_inf<T>()) {
      const T f = std::exp(c[r] - c_new[r]);
      simd::scale(S + r * s_cols, static_cast<size_t>(s_cols), f);
      if (z) z[r] *= f;
    }
    c[r] = c_new[r];
  }
}

// dx [rows × d] from dφ (in s.dphi) for a block whose features are f: plain maps through their
// Jacobian; FAVOR, φ = s∘exp(L − shift), through dL = dφ∘φ and (trig) ds = dφ∘exp(L − shift).
template <class T>
void feature_backward(const Problem<T>& p, const T* x, int64_t rows, Side side, const Features<T>& f,
                      Scratch<T>& s, T* dx) {
  T* dphi = s.dphi.data();
  if (!p.fmap->log_form()) {
    p.fmap->features_backward(x, rows, f.f.data(), dphi, dx);
    return;
  }
  const int64_t n = rows * p.fmap->dim();
  T* ds = nullptr;
  if (p.fmap->has_factor()) {
    ds = s.dlog.data();
    for (int64_t i = 0; i < n; ++i) ds[i] = dphi[i] * f.e[i];
  }
  const T* phi = f.values(*p.fmap);
  for (int64_t i = 0; i < n; ++i) dphi[i] *= phi[i];
  p.fmap->logits_backward(x, rows, side, dphi, f.s.data(), ds, dx, s.fs.data());
}

// out_i = num_i / D_i in place on the num rows (0 where D_i = 0).
template <class T>
void divide_rows(T* num, const T* D, int64_t rows, int64_t dv) {
  for (int64_t i = 0; i < rows; ++i) {
    if (D[i] != 0) {
      simd::scale(num + i * dv, static_cast<size_t>(dv), T(1) / D[i]);
    } else {
      std::fill(num + i * dv, num + (i + 1) * dv, T(0));
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

// ---- non-causal ----------------------------------------------------------------------------

// s.vaug rows = [v_j, 1].
template <class T>
void augmented_values(const Problem<T>& p, int64_t bh, int64_t j0, int64_t rows, Scratch<T>& s) {
  const int64_t dv = p.dims.value_dim, da = dv + 1;
  for (int64_t j = 0; j < rows; ++j) {
    std::copy(p.v.row(bh, j0 + j), p.v.row(bh, j0 + j) + dv, s.vaug.data() + j * da);
    s.vaug[j * da + dv] = 1;
  }
}

// Values per key row the backward's cache keeps: the logits (and trig factors) or features.
template <class T>
int64_t cache_values_per_key(const FeatureMap<T>& fm) {
  return fm.dim() * (fm.has_factor() ? 2 : 1);
}

// [KV | z] = Σ_j K_jᵀ·[v_j, 1] over the valid keys of bh, with the shifts c (FAVOR) raised
// block by block. cache (optional, n_k rows): keeps each key row's logits (and trig factors) or
// features for the backward's key pass.
template <class T>
void accumulate_kv(const Problem<T>& p, int64_t bh, int64_t key_len, Scratch<T>& s, T* cache) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, da = dv + 1;
  std::fill(s.kvz.data(), s.kvz.data() + m * da, T(0));
  std::fill(s.c.data(), s.c.data() + m, p.fmap->log_form() ? neg_inf<T>() : T(0));
  for (int64_t j0 = 0; j0 < key_len; j0 += kBlockRows) {
    interruption_point();
    const int64_t rows = std::min(kBlockRows, key_len - j0);
    Features<T>& kf = s.kf;
    key_logits(p, bh, j0, rows, kf);
    if (cache) {
      T* dst = cache + j0 * cache_values_per_key(*p.fmap);
      const T* src = p.fmap->log_form() ? kf.e.data() : kf.f.data();
      std::copy(src, src + rows * m, dst);
      if (p.fmap->has_factor()) std::copy(kf.s.data(), kf.s.data() + rows * m, dst + rows * m);
    }
    if (p.fmap->log_form()) {
      column_maxima(kf.e.data(), rows, m, s.c.data(), s.c_new.data());
      raise_shifts(m, s.c_new.data(), s.c.data(), s.kvz.data(), da, static_cast<T*>(nullptr));
    }
    finish_key_features(p, rows, s.c.data(), kf);
    augmented_values(p, bh, j0, rows, s);
    matmul<T>(mat(s.kvz.data(), m, da), mat(kf.values(*p.fmap), rows, m).t(),
              mat(s.vaug.data(), rows, da), T(1), T(1));
  }
}

// [num | den] for query rows [i0, i0+rows) into s.nd, D_i = den_i + eps into s.D, and
// out_i = num_i / D_i into out (stride d_v); the query features stay in s.qf.
template <class T>
void query_rows(const Problem<T>& p, int64_t bh, int64_t i0, int64_t rows, Scratch<T>& s, T* out) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, da = dv + 1;
  query_features(p, bh, i0, rows, s.c.data(), s.qf);
  matmul<T>(mat(s.nd.data(), rows, da), mat(s.qf.values(*p.fmap), rows, m),
            mat(s.kvz.data(), m, da));
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
  accumulate_kv(p, bh, p.mask->key_length(bh / p.dims.heads), s, static_cast<T*>(nullptr));
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
  accumulate_kv(p, bh, key_len, s, cache);
  std::fill(s.dkvz.data(), s.dkvz.data() + m * da, T(0));
  // Queries: [dnum | dden]; dQ = [dnum | dden]·[KV | z]ᵀ; [dKV | dz] += Qᵀ·[dnum | dden].
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
    matmul<T>(mat(s.dphi.data(), rows, m), mat(s.dnd.data(), rows, da),
              mat(s.kvz.data(), m, da).t());
    matmul<T>(mat(s.dkvz.data(), m, da), mat(s.qf.values(*p.fmap), rows, m).t(),
              mat(s.dnd.data(), rows, da), T(1), T(1));
    feature_backward(p, p.q.row(bh, i0), rows, Side::Query, s.qf, s, dq + (bh * p.dims.n_q + i0) * d);
  }
  // Keys entered as K_jᵀ[v_j, 1]: dK_j = [v_j, 1]·[dKV | dz]ᵀ and dv_j = K_j·dKV.
  for (int64_t j0 = 0; j0 < key_len; j0 += kBlockRows) {
    interruption_point();
    const int64_t rows = std::min(kBlockRows, key_len - j0);
    Features<T>& kf = s.kf;
    if (cache) {
      const T* src = cache + j0 * cache_values_per_key(*p.fmap);
      std::copy(src, src + rows * m, p.fmap->log_form() ? kf.e.data() : kf.f.data());
      if (p.fmap->has_factor()) std::copy(src + rows * m, src + 2 * rows * m, kf.s.data());
    } else {
      key_logits(p, bh, j0, rows, kf);
    }
    finish_key_features(p, rows, s.c.data(), kf);  // against the final shifts
    augmented_values(p, bh, j0, rows, s);
    matmul<T>(mat(s.dphi.data(), rows, m), mat(s.vaug.data(), rows, da),
              mat(s.dkvz.data(), m, da).t());
    matmul<T>(mat(dv_out + (bh * p.dims.n_k + j0) * dv, rows, dv), mat(kf.values(*p.fmap), rows, m),
              mat(s.dkvz.data(), m, dv, da));
    feature_backward(p, p.k.row(bh, j0), rows, Side::Key, kf, s, dk + (bh * p.dims.n_k + j0) * d);
  }
}

// ---- causal --------------------------------------------------------------------------------

// Where a chunk whose kr valid key logits are in L (rows × m') must end so that no feature's
// running maximum grows by more than kGrowth over its value at the chunk's start, max(c_r,
// L_0r): the first row that would, or `rows` (the chunk's length) if none. >= 1. Called only
// when the whole chunk's growth exceeds kGrowth (never for ordinary inputs).
template <class T>
int64_t chunk_length(const T* L, int64_t kr, int64_t rows, int64_t m, const T* c, T* base, T* run) {
  for (int64_t r = 0; r < m; ++r) base[r] = run[r] = std::max(c[r], L[r]);
  for (int64_t j = 1; j < kr; ++j) {
    T growth = 0;
    for (int64_t r = 0; r < m; ++r) {
      run[r] = std::max(run[r], L[j * m + r]);
      growth = std::max(growth, run[r] - base[r]);
    }
    if (growth > kGrowth<T>) return j;
  }
  return rows;
}

// One chunk from t0: its length (rows, cut where the shifts would grow too fast), its valid
// keys (kr), their features K (raising the shifts c and rescaling the state), and the query
// features Q. rows and kr come in as the longest chunk and its valid keys.
template <class T>
void chunk_features(const Problem<T>& p, int64_t bh, int64_t t0, int64_t& rows, int64_t& kr,
                    Scratch<T>& s) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  if (kr > 0) key_logits(p, bh, t0, kr, s.kf);
  if (p.fmap->log_form() && kr > 0) {
    const T* L = s.kf.e.data();
    T* c = s.c.data();
    T* c_new = s.c_new.data();
    column_maxima(L, kr, m, c, c_new);
    T growth = 0;  // of each feature's maximum over the chunk, from max(c_r, L_0r)
    for (int64_t r = 0; r < m; ++r) growth = std::max(growth, c_new[r] - std::max(c[r], L[r]));
    if (growth > kGrowth<T>) {
      rows = chunk_length(L, kr, rows, m, c, s.run_max.data(), c_new);
      kr = std::min(kr, rows);
      column_maxima(L, kr, m, c, c_new);
    }
    raise_shifts(m, c_new, c, s.S.data(), dv, s.z.data());
    finish_key_features(p, kr, c, s.kf);
  }
  query_features(p, bh, t0, rows, s.c.data(), s.qf);
}

// A chunk's W_ij = Q_i·K_j for j <= i (0 above the diagonal), rows × kr, into s.W.
template <class T>
void chunk_weights(const Problem<T>& p, int64_t rows, int64_t kr, Scratch<T>& s) {
  if (kr == 0) return;
  const int64_t m = p.fmap->dim();
  matmul<T>(mat(s.W.data(), rows, kr, kChunk), mat(s.qf.values(*p.fmap), rows, m),
            mat(s.kf.values(*p.fmap), kr, m).t());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = i + 1; j < kr; ++j) s.W[i * kChunk + j] = 0;
}

// num_i = Q_i·S + Σ_j W_ij v_j into num (rows × d_v) and D_i = Q_i·z + Σ_j W_ij + eps.
template <class T>
void chunk_outputs(const Problem<T>& p, int64_t bh, int64_t t0, int64_t rows, int64_t kr,
                   Scratch<T>& s, T* num, T* D) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  const T* Q = s.qf.values(*p.fmap);
  matmul<T>(mat(num, rows, dv), mat(Q, rows, m), mat(s.S.data(), m, dv));
  for (int64_t i = 0; i < rows; ++i) {
    T den = simd::dot(Q + i * m, s.z.data(), static_cast<size_t>(m));
    for (int64_t j = 0; j < std::min(i + 1, kr); ++j) den += s.W[i * kChunk + j];
    D[i] = den + p.eps;
  }
  if (kr > 0)
    matmul<T>(mat(num, rows, dv), mat(s.W.data(), rows, kr, kChunk), mat(p.v.row(bh, t0), kr, dv),
              T(1), T(1));
}

// S += Kᵀ·V, z += Σ_j K_j over the chunk's kr valid keys.
template <class T>
void add_chunk_to_state(const Problem<T>& p, int64_t bh, int64_t t0, int64_t kr, Scratch<T>& s) {
  if (kr == 0) return;
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  const T* K = s.kf.values(*p.fmap);
  matmul<T>(mat(s.S.data(), m, dv), mat(K, kr, m).t(), mat(p.v.row(bh, t0), kr, dv), T(1), T(1));
  for (int64_t j = 0; j < kr; ++j)
    for (int64_t r = 0; r < m; ++r) s.z[r] += K[j * m + r];
}

// The state at the start: S, z and shifts from the caller (RecurrentState), or empty.
template <class T>
void start_state(const Problem<T>& p, Scratch<T>& s, const T* S0, const T* z0, const T* c0) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  if (S0) {
    std::copy(S0, S0 + m * dv, s.S.data());
    std::copy(z0, z0 + m, s.z.data());
    std::copy(c0, c0 + m, s.c.data());
    return;
  }
  std::fill(s.S.data(), s.S.data() + m * dv, T(0));
  std::fill(s.z.data(), s.z.data() + m, T(0));
  std::fill(s.c.data(), s.c.data() + m, p.fmap->log_form() ? neg_inf<T>() : T(0));
}

// state: S, z, c of this batch·head to start from and to leave the final state in, or null
// to start empty.
template <class T>
void forward_causal(const Problem<T>& p, int64_t bh, Scratch<T>& s, T* out, T* S0 = nullptr,
                    T* z0 = nullptr, T* c0 = nullptr) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, n = p.dims.n_q;
  const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
  start_state(p, s, S0, z0, c0);
  for (int64_t t0 = 0; t0 < n;) {
    interruption_point();
    int64_t rows = std::min(kChunk, n - t0), kr = std::clamp<int64_t>(key_len - t0, 0, rows);
    chunk_features(p, bh, t0, rows, kr, s);
    chunk_weights(p, rows, kr, s);
    T* o = out + (bh * n + t0) * dv;
    chunk_outputs(p, bh, t0, rows, kr, s, o, s.D.data());
    divide_rows(o, s.D.data(), rows, dv);
    add_chunk_to_state(p, bh, t0, kr, s);
    t0 += rows;
  }
  if (S0) {
    std::copy(s.S.data(), s.S.data() + m * dv, S0);
    std::copy(s.z.data(), s.z.data() + m, z0);
    std::copy(s.c.data(), s.c.data() + m, c0);
  }
}

// What the causal backward's forward pass keeps for its reverse pass, per batch·head: D_i and
// dden_i per row, and per chunk its extent and the shifts its features were made with.
template <class T>
struct CausalSaved {
  struct Chunk {
    int64_t t0, rows, kr;
  };
  std::vector<T> D, dden, shifts;  // shifts: m' per chunk
  std::vector<Chunk> chunks;
};

// P_ij = (dnum_i·v_j + dden_i) on the chunk's causal triangle (0 elsewhere), rows × kr, into s.P.
template <class T>
void chunk_output_grads(const Problem<T>& p, int64_t bh, int64_t t0, int64_t rows, int64_t kr,
                        const T* dden, Scratch<T>& s) {
  if (kr == 0) return;
  const int64_t dv = p.dims.value_dim;
  matmul<T>(mat(s.P.data(), rows, kr, kChunk), mat(s.dnum.data(), rows, dv),
            mat(p.v.row(bh, t0), kr, dv).t());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < kr; ++j) s.P[i * kChunk + j] = j <= i ? s.P[i * kChunk + j] + dden[i] : T(0);
}

// Pass A, forward in time: the outputs again, D and dden per row, each chunk's extent and
// shifts, and dq: dQ_i = dnum_i·Sᵀ + dden_i·z + Σ_{j<=i} P_ij K_j.
template <class T>
void causal_forward_pass(const Problem<T>& p, int64_t bh, Scratch<T>& s, CausalSaved<T>& saved,
                         const T* dout, T* dq) {
  const int64_t m = p.fmap->dim(), d = p.dims.head_dim, dv = p.dims.value_dim, n = p.dims.n_q;
  const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
  start_state(p, s, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr), static_cast<const T*>(nullptr));
  saved.D.resize(static_cast<size_t>(n));
  saved.dden.resize(static_cast<size_t>(n));
  saved.chunks.clear();
  saved.shifts.clear();
  for (int64_t t0 = 0; t0 < n;) {
    interruption_point();
    int64_t rows = std::min(kChunk, n - t0), kr = std::clamp<int64_t>(key_len - t0, 0, rows);
    chunk_features(p, bh, t0, rows, kr, s);
    chunk_weights(p, rows, kr, s);
    T* D = saved.D.data() + t0;
    T* dden = saved.dden.data() + t0;
    chunk_outputs(p, bh, t0, rows, kr, s, s.num.data(), D);
    divide_rows(s.num.data(), D, rows, dv);
    output_grads(dout + (bh * n + t0) * dv, s.num.data(), D, rows, dv, s.dnum.data(), dden);
    chunk_output_grads(p, bh, t0, rows, kr, dden, s);
    matmul<T>(mat(s.dphi.data(), rows, m), mat(s.dnum.data(), rows, dv),
              mat(s.S.data(), m, dv).t());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t r = 0; r < m; ++r) s.dphi[i * m + r] += dden[i] * s.z[r];
    if (kr > 0)
      matmul<T>(mat(s.dphi.data(), rows, m), mat(s.P.data(), rows, kr, kChunk),
                mat(s.kf.values(*p.fmap), kr, m), T(1), T(1));
    feature_backward(p, p.q.row(bh, t0), rows, Side::Query, s.qf, s, dq + (bh * n + t0) * d);
    saved.chunks.push_back({t0, rows, kr});
    saved.shifts.insert(saved.shifts.end(), s.c.data(), s.c.data() + m);
    add_chunk_to_state(p, bh, t0, kr, s);
    t0 += rows;
  }
}

// Pass B, backward in time over the saved chunks, with the suffix state R (s.R), ρ (s.rho) in
// the scale of the chunk at hand: dk and dv.
template <class T>
void causal_reverse_pass(const Problem<T>& p, int64_t bh, Scratch<T>& s, const CausalSaved<T>& saved,
                         const T* dout, T* dk, T* dv_out) {
  const int64_t m = p.fmap->dim(), d = p.dims.head_dim, dv = p.dims.value_dim, n = p.dims.n_q;
  std::fill(s.R.data(), s.R.data() + m * dv, T(0));
  std::fill(s.rho.data(), s.rho.data() + m, T(0));
  const int64_t chunks = static_cast<int64_t>(saved.chunks.size());
  for (int64_t k = chunks - 1; k >= 0; --k) {
    interruption_point();
    const auto [t0, rows, kr] = saved.chunks[static_cast<size_t>(k)];
    const T* c = saved.shifts.data() + k * m;
    if (k + 1 < chunks && p.fmap->log_form()) {  // from the next chunk's scale to this one's
      const T* c_next = saved.shifts.data() + (k + 1) * m;
      for (int64_t r = 0; r < m; ++r) {
        if (c_next[r] == neg_inf<T>() || c[r] == c_next[r]) continue;
        const T f = c[r] == neg_inf<T>() ? T(0) : std::exp(c[r] - c_next[r]);
        simd::scale(s.R.data() + r * dv, static_cast<size_t>(dv), f);
        s.rho[r] *= f;
      }
    }
    // The chunk's features again, with the shifts it had.
    if (kr > 0) {
      key_logits(p, bh, t0, kr, s.kf);
      finish_key_features(p, kr, c, s.kf);
    }
    query_features(p, bh, t0, rows, c, s.qf);
    chunk_weights(p, rows, kr, s);
    const T* D = saved.D.data() + t0;
    const T* dden = saved.dden.data() + t0;
    for (int64_t i = 0; i < rows; ++i) {
      const T inv = D[i] != 0 ? T(1) / D[i] : T(0);
      for (int64_t cc = 0; cc < dv; ++cc) s.dnum[i * dv + cc] = dout[(bh * n + t0 + i) * dv + cc] * inv;
    }
    chunk_output_grads(p, bh, t0, rows, kr, dden, s);
    const T* Q = s.qf.values(*p.fmap);
    if (kr > 0) {
      const T* K = s.kf.values(*p.fmap);
      // dK = Pᵀ·Q + V·Rᵀ + 1·ρᵀ
      matmul<T>(mat(s.dphi.data(), kr, m), mat(p.v.row(bh, t0), kr, dv),
                mat(s.R.data(), m, dv).t());
      for (int64_t j = 0; j < kr; ++j)
        for (int64_t r = 0; r < m; ++r) s.dphi[j * m + r] += s.rho[r];
      matmul<T>(mat(s.dphi.data(), kr, m), mat(s.P.data(), rows, kr, kChunk).t(), mat(Q, rows, m),
                T(1), T(1));
      // dv = Wᵀ·dnum + K·R
      T* dvc = dv_out + (bh * n + t0) * dv;
      matmul<T>(mat(dvc, kr, dv), mat(K, kr, m), mat(s.R.data(), m, dv));
      matmul<T>(mat(dvc, kr, dv), mat(s.W.data(), rows, kr, kChunk).t(),
                mat(s.dnum.data(), rows, dv), T(1), T(1));
      feature_backward(p, p.k.row(bh, t0), kr, Side::Key, s.kf, s, dk + (bh * n + t0) * d);
    }
    // This chunk's queries join the suffix state: R += Qᵀ·dnum, ρ += Qᵀ·dden.
    matmul<T>(mat(s.R.data(), m, dv), mat(Q, rows, m).t(), mat(s.dnum.data(), rows, dv), T(1),
              T(1));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t r = 0; r < m; ++r) s.rho[r] += Q[i * m + r] * dden[i];
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
    forward_causal(p, bh, scratch[worker], out, S + bh * m * dv, z + bh * m, c + bh * m);
  });
}

template <class T>
void backward(const Problem<T>& p, const T* dout, T* dq, T* dk, T* dv) {
  const bool causal = p.mask->causal();
  // Non-causal: the key logits (or features) of every key, so the key pass need not compute
  // them again, when that fits in feature_cache_bytes() per worker (else they are recomputed:
  // same result, more time).
  const int64_t cache_size = p.dims.n_k * cache_values_per_key(*p.fmap);
  const bool cache = !causal && cache_size * static_cast<int64_t>(sizeof(T)) <= feature_cache_bytes();
  const ParallelLoop loop(p.dims.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(p, causal); });
  PerWorker<Buffer<T>> cached(loop, [&] { return Buffer<T>(cache ? cache_size : 0); });
  PerWorker<CausalSaved<T>> saved(loop);
  const int64_t d = p.dims.head_dim, dvd = p.dims.value_dim;
  loop.run([&](int64_t bh, int worker) {
    // Gradients of padded keys stay 0: the passes only write valid rows.
    std::fill(dk + bh * p.dims.n_k * d, dk + (bh + 1) * p.dims.n_k * d, T(0));
    std::fill(dv + bh * p.dims.n_k * dvd, dv + (bh + 1) * p.dims.n_k * dvd, T(0));
    Scratch<T>& s = scratch[worker];
    if (causal) {
      causal_forward_pass(p, bh, s, saved[worker], dout, dq);
      causal_reverse_pass(p, bh, s, saved[worker], dout, dk, dv);
    } else {
      backward_noncausal(p, bh, s, cache ? cached[worker].data() : nullptr, dout, dq, dk, dv);
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
