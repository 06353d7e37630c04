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
// Backward, from the forward's saved D_i and out_i (as exact attention keeps its log-sum-exp)
// (dnum_i = dout_i/D_i, dden_i = −dout_i·out_i/D_i, P_ij = dnum_i·v_j + dden_i):
//   dQ_i = dnum_i·Sᵀ + dden_i·z + Σ_{j<=i} P_ij K_j
//   dK_j = Σ_{i>=j} P_ij Q_i + R·v_j + ρ,   dv_j = Σ_{i>=j} W_ij dnum_i + K_j·R
// with R = Σ_{later i} Q_iᵀ dnum_i, ρ = Σ_{later i} Q_i dden_i the suffix state of a reverse
// pass over the chunks, carried in the scale of the chunk at hand: going back one chunk
// multiplies it by exp(c_prev − c') <= 1, so it never overflows. The feature maps' backward
// turns dQ, dK into dq, dk (via dL = dK∘K and, trig, ds = dK∘exp(L − c)). Every sum with z,
// ρ or dden is a product with an augmented operand ([S | z], [R | ρ], [v_j, 1], [dnum_i |
// dden_i]), so no rank-one loops remain: P = [dnum | dden]·[V | 1]ᵀ, dQ = [dnum | dden]·[S |
// z]ᵀ + P·K, dK = [V | 1]·[R | ρ]ᵀ + Pᵀ·Q.
// Non-causal, S and z come saved from the forward (state), so the backward computes each
// feature once: queries (dQ, and dS = Σ Q_iᵀ dnum_i, dz = Σ Q_i dden_i), then keys
// (dK_j = dS·v_j + dz, dv_j = K_j·dS). Causal, the forward pass (dq) keeps its chunks'
// features and P for the reverse pass (dk, dv) as far as feature_cache_bytes() allows.
// FLOPs (products only): the causal backward's are 2.5× the forward's for any chunk length
// (state products 5 against 2, intra-chunk products 5 against 2), as for exact attention.
// A row with D_i = 0 (no key in sight, eps = 0) gets out_i = 0 and no gradient.
#include "linattn/core/error.h"
#include "linattn/kernelized/engine.h"

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

#include "linattn/core/blas.h"
#include "linattn/core/simd.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"

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

// Features of one block of rows, as views. Plain maps: f = φ(x). FAVOR: e = exp(L − shift)
// (first the logits L), s = the trig factors, and f = s∘e for trig (else the features are e
// itself); t = the query rows' exponent shifts t_i. The memory is the scratch's own or, in the
// causal backward, a slot of the feature cache.
template <class T>
struct Features {
  T* f = nullptr;
  T* e = nullptr;
  T* s = nullptr;
  T* t = nullptr;
  const T* values(const FeatureMap<T>& fm) const { return fm.log_form() && !fm.has_factor() ? e : f; }
  T* values(const FeatureMap<T>& fm) { return fm.log_form() && !fm.has_factor() ? e : f; }
};

// Values per row that a block of features holds on `side`.
template <class T>
int64_t feature_values_per_row(const FeatureMap<T>& fm, Side side) {
  const int64_t m = fm.dim();
  const bool f = !(fm.log_form() && !fm.has_factor()), e = fm.log_form(), s = fm.has_factor();
  return m * (int64_t{f} + int64_t{e} + int64_t{s}) + (fm.log_form() && side == Side::Query ? 1 : 0);
}

// A block of `rows` rows laid out at mem (feature_values_per_row(side)·rows values).
template <class T>
Features<T> features_at(const FeatureMap<T>& fm, Side side, int64_t rows, T* mem) {
  const int64_t m = fm.dim();
  Features<T> x;
  if (!(fm.log_form() && !fm.has_factor())) x.f = mem, mem += rows * m;
  if (fm.log_form()) x.e = mem, mem += rows * m;
  if (fm.has_factor()) x.s = mem, mem += rows * m;
  if (fm.log_form() && side == Side::Query) x.t = mem;
  return x;
}

// Rows of a block (non-causal) or chunk (causal), no more than the problem has.
template <class T, class S>
int64_t block_rows(const Problem<T, S>& p, bool causal) {
  return std::max<int64_t>(1, std::min(causal ? kChunk : kBlockRows, std::max(p.dims.n_q, p.dims.n_k)));
}

// Per-worker buffers, allocated before the loop; each mode gets only what it uses. Every one is
// written before it is read (a product with beta = 0 writes its result without reading it).
template <class T>
struct Scratch {
  template <class S>
  Scratch(const Problem<T, S>& p, bool causal) {
    const FeatureMap<T>& fm = *p.fmap;
    const int64_t rows = block_rows(p, causal), m = fm.dim(), dv = p.dims.value_dim;
    auto buffer = [](int64_t n) { return Buffer<T>(n, true, Init::Uninitialized); };
    const int64_t q_values = feature_values_per_row(fm, Side::Query) * rows;
    features = buffer(q_values + feature_values_per_row(fm, Side::Key) * rows);
    qf = features_at(fm, Side::Query, rows, features.data());
    kf = features_at(fm, Side::Key, rows, features.data() + q_values);
    dphi = buffer(rows * m);
    dlog = buffer(fm.has_factor() ? rows * m : 0);
    fs = buffer(fm.scratch_size(rows));
    num = buffer(rows * dv);
    inv = buffer(rows);
    c = buffer(m);
    c_new = buffer(m);
    kvz = buffer(m * (dv + 1));
    dkvz = buffer(m * (dv + 1));
    vaug = buffer(rows * (dv + 1));
    nd = buffer(rows * (dv + 1));
    dnd = buffer(rows * (dv + 1));
    if (causal) {
      D = buffer(rows);
      run_max = buffer(m);
      W = buffer(rows * kChunk);  // leading dimension kChunk
      P = buffer(rows * kChunk);
    }
    if constexpr (!std::is_same_v<S, T>) {
      const int64_t d = p.dims.head_dim;
      rows_in = buffer(rows * d);
      grads_in = buffer(rows * dv);
      outputs_in = buffer(rows * dv);
      staged = buffer(rows * std::max(d, dv));
    }
  }
  Buffer<T> features;
  Features<T> qf, kf;  // the scratch's own blocks of query and key features
  // Gradients of a block's features (dphi), and for trig the gradient of its logits (dlog);
  // the feature map's backward scratch; outputs (recomputed).
  Buffer<T> dphi, dlog, fs, num;
  Buffer<T> inv;  // a block's 1 / D_i (0 where D_i = 0), for simd::scale_rows
  Buffer<T> c, c_new;  // per-feature log-shifts of the keys (FAVOR), and scratch for raising them
  // Augmented so that one product gives both sums (and no rank-one loops are left): the state
  // [KV | z] (m'×(d_v+1); causal: S and z so far), its gradient [dKV | dz] (causal: the suffix
  // state [R | ρ]), [V | 1], [num | den] and [dnum | dden] (rows×(d_v+1)).
  Buffer<T> kvz, dkvz, vaug, nd, dnd;
  // Causal: a chunk's denominators; its running maxima while finding where it ends; its W and P.
  Buffer<T> D, run_max, W, P;
  // Inputs stored as bfloat16 (S ≠ T): a block's q or k rows, its dout rows and (the backward's
  // saved out as returned) its out rows widened, and the block's results before they are rounded
  // to the output (storage below).
  Buffer<T> rows_in, grads_in, outputs_in, staged;
  // Backward: whether every gradient value this worker wrote is finite (range.h). Forward:
  // whether every output value it wrote is (divide_rows; a backward's recomputed outputs set it
  // too, unread there).
  WrittenFinite written;
  bool outputs_finite = true;
};

// Whether every worker's gradient values were finite (Scratch::written).
template <class T>
bool all_gradients_finite(PerWorker<Scratch<T>>& scratch) {
  for (int w = 0; w < scratch.size(); ++w)
    if (!scratch[w].written.ok) return false;
  return true;
}

// ---- storage -------------------------------------------------------------------------------
// The engine computes in T and reads its inputs and writes its results as S: T itself, or
// bfloat16 with T = float, widened a block at a time into the worker's scratch and rounded back
// from it, so that no widened copy of a whole tensor is made (the block is still in cache).

// count values at src as T: src itself, or widened into buf.
template <class T, class S>
const T* compute_values(const S* src, int64_t count, Buffer<T>& buf) {
  if constexpr (std::is_same_v<S, T>) {
    return src;
  } else {
    simd::widen(src, buf.data(), static_cast<size_t>(count));
    return buf.data();
  }
}

// Where results bound for dst are computed: dst itself, or s.staged (store_results moves them).
template <class T, class S>
T* result_values(S* dst, Scratch<T>& s) {
  if constexpr (std::is_same_v<S, T>) {
    return dst;
  } else {
    return s.staged.data();
  }
}

// count results from result_values(dst, s) into dst, rounded to nearest even when S is narrower;
// whether each value stored is finite goes into s.written (a rounding can overflow), checked as
// it is rounded or, for T itself, while in cache.
template <class T, class S>
void store_results(S* dst, const T* src, int64_t count, Scratch<T>& s) {
  if constexpr (!std::is_same_v<S, T>) {
    if (!simd::narrow_finite(src, dst, static_cast<size_t>(count))) s.written.ok = false;
  } else {
    s.written.check(dst, count);
  }
}

// ---- features --------------------------------------------------------------------------------

// Key logits (FAVOR, into kf.e and kf.s) or features (plain, into kf.f) of `rows` key rows
// from j0. Returns those rows as T (widened into s.rows_in for bfloat16 storage, where they stay
// until the next widening: the backward's feature_backward reads them there).
template <class T, class S>
const T* key_logits(const Problem<T, S>& p, int64_t bh, int64_t j0, int64_t rows, Scratch<T>& s, Features<T>& kf) {
  const T* x = compute_values(p.k.row(bh, j0), rows * p.dims.head_dim, s.rows_in);
  if (p.fmap->log_form()) {
    p.fmap->logits(p.fn, x, rows, Side::Key, kf.e, kf.s, p.products);
  } else {
    p.fmap->features(x, rows, kf.f);
  }
  return x;
}

// FAVOR: kf.e holds key logits; make them the features exp(L − c) (times s for trig).
template <class T, class S>
void finish_key_features(const Problem<T, S>& p, int64_t rows, const T* c, Features<T>& kf) {
  if (!p.fmap->log_form() || rows == 0) return;
  const int64_t m = p.fmap->dim();
  simd::exp_minus_columns(kf.e, static_cast<size_t>(rows), static_cast<size_t>(m), static_cast<size_t>(m), c);
  if (p.fmap->has_factor())
    simd::product_difference(kf.s, kf.e, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr), kf.f,
                             static_cast<size_t>(rows * m));
}

// Query features of `rows` rows from i0 against the key shifts c: FAVOR Q_ir =
// s_ir·exp(Lq_ir + c_r − t_i) with t_i (into qf.t) the row's largest exponent. Returns the rows
// as T, as key_logits does.
template <class T, class S>
const T* query_features(const Problem<T, S>& p, int64_t bh, int64_t i0, int64_t rows, const T* c, Scratch<T>& s,
                        Features<T>& qf) {
  const T* x = compute_values(p.q.row(bh, i0), rows * p.dims.head_dim, s.rows_in);
  if (!p.fmap->log_form()) {
    p.fmap->features(x, rows, qf.f);
    return x;
  }
  const int64_t m = p.fmap->dim();
  p.fmap->logits(p.fn, x, rows, Side::Query, qf.e, qf.s, p.products);
  for (int64_t i = 0; i < rows; ++i) qf.t[i] = simd::exp_row_offset(qf.e + i * m, static_cast<size_t>(m), c);
  if (p.fmap->has_factor())
    simd::product_difference(qf.s, qf.e, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr), qf.f,
                             static_cast<size_t>(rows * m));
  return x;
}

// c_new = max(c, column maxima of `rows` key logits L (rows × m')).
template <class T>
void column_maxima(const T* L, int64_t rows, int64_t m, const T* c, T* c_new) {
  std::copy(c, c + m, c_new);
  simd::column_max(L, static_cast<size_t>(rows), static_cast<size_t>(m), static_cast<size_t>(m), c_new);
}

// Raises the shifts c to c_new (>= c); the state rows whose shift grew (S: m' rows of s_cols
// values) are multiplied by exp(c_old − c_new) <= 1.
template <class T>
void raise_shifts(int64_t m, const T* c_new, T* c, T* S, int64_t s_cols) {
  for (int64_t r = 0; r < m; ++r) {
    if (!(c_new[r] > c[r])) continue;
    if (c[r] != neg_inf<T>()) {
      const T f = std::exp(c[r] - c_new[r]);
      simd::scale(S + r * s_cols, static_cast<size_t>(s_cols), f);
    }
    c[r] = c_new[r];
  }
}

// dx [rows × d] from dφ (in s.dphi) for a block whose features are f: plain maps through their
// Jacobian; FAVOR, φ = s∘exp(L − shift), through dL = dφ∘φ and (trig) ds = dφ∘exp(L − shift).
template <class T, class S>
void feature_backward(const Problem<T, S>& p, const T* x, int64_t rows, Side side, const Features<T>& f,
                      Scratch<T>& s, T* dx) {
  T* dphi = s.dphi.data();
  if (!p.fmap->log_form()) {
    p.fmap->features_backward(x, rows, f.f, dphi, dx);
    return;
  }
  const size_t n = static_cast<size_t>(rows * p.fmap->dim());
  const T* none = nullptr;
  T* ds = nullptr;
  if (p.fmap->has_factor()) {
    ds = s.dlog.data();
    simd::product_difference(dphi, f.e, none, none, ds, n);
  }
  simd::product_difference(dphi, f.values(*p.fmap), none, none, dphi, n);
  p.fmap->logits_backward(x, rows, side, dphi, f.s, ds, dx, s.fs.data(), p.products);
}

// [dnum_i | dden_i] into dnd (rows × (d_v+1)): dnum_i = dout_i / D_i and dden_i =
// −dout_i·out_i / D_i (both 0 where D_i = 0), or, with out null, the dden_i given (the causal
// backward's second pass has them from its first).
template <class T>
void output_grads(const T* dout, const T* out, const T* D, const T* dden, int64_t rows, int64_t dv, T* dnd) {
  const int64_t da = dv + 1;
  for (int64_t i = 0; i < rows; ++i) {
    const T inv = D[i] != 0 ? T(1) / D[i] : T(0);
    for (int64_t c = 0; c < dv; ++c) dnd[i * da + c] = dout[i * dv + c] * inv;
    dnd[i * da + dv] = out ? -simd::dot(dout + i * dv, out + i * dv, static_cast<size_t>(dv)) * inv : dden[i];
  }
}

// out_i = num_i / D_i for `rows` rows of [num | den] (s.nd), into out (stride d_v: T, or the
// result's own S, rounded there), with D_i from D_in (the saved values) when given, else den_i +
// eps (then also written to D_out when given); 0 where D_i = 0. Whether every value written is
// finite goes into s.outputs_finite.
template <class T, class S, class O>
void divide_rows(const Problem<T, S>& p, int64_t rows, Scratch<T>& s, O* out, const T* D_in, T* D_out) {
  const int64_t dv = p.dims.value_dim, da = dv + 1;
  for (int64_t i = 0; i < rows; ++i) {
    const T D = D_in ? D_in[i] : s.nd[i * da + dv] + p.eps;
    if (D_out) D_out[i] = D;
    s.inv[i] = D != 0 ? T(1) / D : T(0);
  }
  if (!simd::scale_rows(s.nd.data(), static_cast<size_t>(da), static_cast<size_t>(rows), static_cast<size_t>(dv),
                        s.inv.data(), out, static_cast<size_t>(dv)))
    s.outputs_finite = false;
}

// ---- non-causal ----------------------------------------------------------------------------

// s.vaug rows = [v_j, 1].
template <class T, class S>
void augmented_values(const Problem<T, S>& p, int64_t bh, int64_t j0, int64_t rows, Scratch<T>& s) {
  const int64_t dv = p.dims.value_dim, da = dv + 1;
  if constexpr (!std::is_same_v<S, T>)
    if (rows > 0)
      simd::widen_rows(p.v.row(bh, j0), static_cast<size_t>(rows), static_cast<size_t>(dv), s.vaug.data(),
                       static_cast<size_t>(da));
  for (int64_t j = 0; j < rows; ++j) {
    if constexpr (std::is_same_v<S, T>) std::copy(p.v.row(bh, j0 + j), p.v.row(bh, j0 + j) + dv, s.vaug.data() + j * da);
    s.vaug[j * da + dv] = 1;
  }
}

// [KV | z] = Σ_j K_jᵀ·[v_j, 1] over the valid keys of bh, with the shifts c (FAVOR) raised
// block by block.
template <class T, class S>
void accumulate_kv(const Problem<T, S>& p, int64_t bh, int64_t key_len, Scratch<T>& s) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, da = dv + 1;
  std::fill(s.kvz.data(), s.kvz.data() + m * da, T(0));
  std::fill(s.c.data(), s.c.data() + m, p.fmap->log_form() ? neg_inf<T>() : T(0));
  for (int64_t j0 = 0; j0 < key_len; j0 += kBlockRows) {
    interruption_point();
    const int64_t rows = std::min(kBlockRows, key_len - j0);
    Features<T>& kf = s.kf;
    key_logits(p, bh, j0, rows, s, kf);
    if (p.fmap->log_form()) {
      column_maxima(kf.e, rows, m, s.c.data(), s.c_new.data());
      raise_shifts(m, s.c_new.data(), s.c.data(), s.kvz.data(), da);
    }
    finish_key_features(p, rows, s.c.data(), kf);
    augmented_values(p, bh, j0, rows, s);
    matmul<T>(p.products, mat(s.kvz.data(), m, da), mat(kf.values(*p.fmap), rows, m).t(),
              mat(s.vaug.data(), rows, da), T(1), T(1));
  }
}

// [num | den] for query rows [i0, i0+rows) into s.nd (their features into s.qf), and
// out_i = num_i / D_i into out (divide_rows). Returns the query rows as T (query_features).
template <class T, class S, class O>
const T* query_rows(const Problem<T, S>& p, int64_t bh, int64_t i0, int64_t rows, Scratch<T>& s, O* out,
                    const T* D_in, T* D_out) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, da = dv + 1;
  const T* x = query_features(p, bh, i0, rows, s.c.data(), s, s.qf);
  matmul<T>(p.products, mat(s.nd.data(), rows, da), mat(s.qf.values(*p.fmap), rows, m),
            mat(s.kvz.data(), m, da));
  divide_rows(p, rows, s, out, D_in, D_out);
  return x;
}

// state rows [S_r | z_r | c_r] from s.kvz and s.c.
template <class T, class S>
void store_state(const Problem<T, S>& p, const Scratch<T>& s, T* state) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  for (int64_t r = 0; r < m; ++r) {
    std::copy(s.kvz.data() + r * (dv + 1), s.kvz.data() + (r + 1) * (dv + 1), state + r * (dv + 2));
    state[r * (dv + 2) + dv + 1] = s.c[r];
  }
}

template <class T, class S>
void forward_noncausal(const Problem<T, S>& p, int64_t bh, Scratch<T>& s, S* out, const Saved<T>& save) {
  const int64_t dv = p.dims.value_dim, m = p.fmap->dim();
  accumulate_kv(p, bh, p.mask->key_length(bh / p.dims.heads), s);
  for (int64_t i0 = 0; i0 < p.dims.n_q; i0 += kBlockRows) {
    interruption_point();
    const int64_t rows = std::min(kBlockRows, p.dims.n_q - i0);
    S* o = out ? out + (bh * p.dims.n_q + i0) * dv : nullptr;
    T* den = save.den ? save.den + bh * p.dims.n_q + i0 : nullptr;
    // divide_rows checks what it writes into out (forward() returns it).
    if (o) query_rows(p, bh, i0, rows, s, o, static_cast<const T*>(nullptr), den);
    else query_rows(p, bh, i0, rows, s, s.num.data(), static_cast<const T*>(nullptr), den);
  }
  if (save.state) store_state(p, s, save.state + bh * m * (dv + 2));
}

// s.kvz and s.c from a state's rows [S_r | z_r | c_r] (this batch·head's).
template <class T, class S>
void load_state(const Problem<T, S>& p, const T* st, Scratch<T>& s) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, da = dv + 1;
  for (int64_t r = 0; r < m; ++r) {
    std::copy(st + r * (dv + 2), st + r * (dv + 2) + da, s.kvz.data() + r * da);
    s.c[r] = st[r * (dv + 2) + dv + 1];
  }
}

// Queries against the state in s.kvz, s.c: dq, and [dKV | dz] += Σ_i Q_iᵀ[dnum_i, dden_i] into
// s.dkvz (which the caller zeroes).
template <class T, class S, class O>
void noncausal_query_grads(const Problem<T, S>& p, int64_t bh, Scratch<T>& s, const S* dout, const O* out,
                           const T* den, S* dq) {
  const int64_t m = p.fmap->dim(), d = p.dims.head_dim, dv = p.dims.value_dim, da = dv + 1;
  const int64_t n_q = p.dims.n_q;
  for (int64_t i0 = 0; i0 < n_q; i0 += kBlockRows) {
    interruption_point();
    const int64_t rows = std::min(kBlockRows, n_q - i0);
    const T* D = den + bh * n_q + i0;
    const T* o = out ? compute_values(out + (bh * n_q + i0) * dv, rows * dv, s.outputs_in) : nullptr;
    const T* x = nullptr;  // the query rows as T
    if (o) {
      x = query_features(p, bh, i0, rows, s.c.data(), s, s.qf);
    } else {  // the attention output again (the caller's output holds more than attention)
      x = query_rows(p, bh, i0, rows, s, s.num.data(), D, static_cast<T*>(nullptr));
      o = s.num.data();
    }
    output_grads(compute_values(dout + (bh * n_q + i0) * dv, rows * dv, s.grads_in), o, D, static_cast<const T*>(nullptr),
                 rows, dv, s.dnd.data());
    matmul<T>(p.products, mat(s.dphi.data(), rows, m), mat(s.dnd.data(), rows, da), mat(s.kvz.data(), m, da).t());
    matmul<T>(p.products, mat(s.dkvz.data(), m, da), mat(s.qf.values(*p.fmap), rows, m).t(), mat(s.dnd.data(), rows, da),
              T(1), T(1));
    S* g = dq + (bh * n_q + i0) * d;
    T* r = result_values(g, s);
    feature_backward(p, x, rows, Side::Query, s.qf, s, r);
    store_results(g, r, rows * d, s);
  }
}

// Keys, which entered the state as K_jᵀ[v_j, 1] (shifts s.c): from its gradient [dKV | dz] in
// s.dkvz, dK_j = [v_j, 1]·[dKV | dz]ᵀ and dv_j = K_j·dKV.
template <class T, class S>
void noncausal_key_grads(const Problem<T, S>& p, int64_t bh, Scratch<T>& s, S* dk, S* dv_out) {
  const int64_t m = p.fmap->dim(), d = p.dims.head_dim, dv = p.dims.value_dim, da = dv + 1;
  const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
  for (int64_t j0 = 0; j0 < key_len; j0 += kBlockRows) {
    interruption_point();
    const int64_t rows = std::min(kBlockRows, key_len - j0);
    Features<T>& kf = s.kf;
    const T* x = key_logits(p, bh, j0, rows, s, kf);
    finish_key_features(p, rows, s.c.data(), kf);  // against the final shifts
    augmented_values(p, bh, j0, rows, s);
    matmul<T>(p.products, mat(s.dphi.data(), rows, m), mat(s.vaug.data(), rows, da), mat(s.dkvz.data(), m, da).t());
    S* gv = dv_out + (bh * p.dims.n_k + j0) * dv;
    T* rv = result_values(gv, s);
    matmul<T>(p.products, mat(rv, rows, dv), mat(kf.values(*p.fmap), rows, m), mat(s.dkvz.data(), m, dv, da));
    store_results(gv, rv, rows * dv, s);
    S* gk = dk + (bh * p.dims.n_k + j0) * d;
    T* rk = result_values(gk, s);
    feature_backward(p, x, rows, Side::Key, kf, s, rk);
    store_results(gk, rk, rows * d, s);
  }
}

// From the saved state: queries give dq and [dKV | dz], then keys give dk and dv.
template <class T, class S, class O>
void backward_noncausal(const Problem<T, S>& p, int64_t bh, Scratch<T>& s, const S* dout, const O* out,
                        const T* den, const T* state, S* dq, S* dk, S* dv_out) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  load_state(p, state + bh * m * (dv + 2), s);
  std::fill(s.dkvz.data(), s.dkvz.data() + m * (dv + 1), T(0));
  noncausal_query_grads(p, bh, s, dout, out, den, dq);
  noncausal_key_grads(p, bh, s, dk, dv_out);
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
// keys (kr), their features K into kf (raising the shifts c and rescaling the state), and the
// query features Q into qf. rows and kr come in as the longest chunk and its valid keys. Returns
// the query rows as T (query_features).
template <class T, class S>
const T* chunk_features(const Problem<T, S>& p, int64_t bh, int64_t t0, int64_t& rows, int64_t& kr, Scratch<T>& s,
                        Features<T>& qf, Features<T>& kf) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  if (kr > 0) key_logits(p, bh, t0, kr, s, kf);
  if (p.fmap->log_form() && kr > 0) {
    const T* L = kf.e;
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
    raise_shifts(m, c_new, c, s.kvz.data(), dv + 1);
    finish_key_features(p, kr, c, kf);
  }
  return query_features(p, bh, t0, rows, s.c.data(), s, qf);
}

// A chunk's matrix (rows × kr, leading dimension kChunk) with 0 where j > i.
template <class T>
void zero_above_diagonal(T* M, int64_t rows, int64_t kr) {
  for (int64_t i = 0; i < std::min(rows, kr); ++i) std::fill(M + i * kChunk + i + 1, M + i * kChunk + kr, T(0));
}

// A chunk's W_ij = Q_i·K_j for j <= i (0 above the diagonal), rows × kr, into s.W.
template <class T, class S>
void chunk_weights(const Problem<T, S>& p, int64_t rows, int64_t kr, const Features<T>& qf, const Features<T>& kf,
                   Scratch<T>& s) {
  if (kr == 0) return;
  const int64_t m = p.fmap->dim();
  matmul<T>(p.products, mat(s.W.data(), rows, kr, kChunk), mat(qf.values(*p.fmap), rows, m),
            mat(kf.values(*p.fmap), kr, m).t());
  zero_above_diagonal(s.W.data(), rows, kr);
}

// [num_i | den_i] = Q_i·[S | z] + Σ_j W_ij·[v_j, 1] into s.nd, with s.vaug = the chunk's [V | 1];
// out_i = num_i / D_i into out (divide_rows; D_out written when D_in is null).
template <class T, class S, class O>
void chunk_outputs(const Problem<T, S>& p, int64_t rows, int64_t kr, const Features<T>& qf, Scratch<T>& s, O* out,
                   const T* D_in, T* D_out) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, da = dv + 1;
  matmul<T>(p.products, mat(s.nd.data(), rows, da), mat(qf.values(*p.fmap), rows, m), mat(s.kvz.data(), m, da));
  if (kr > 0)
    matmul<T>(p.products, mat(s.nd.data(), rows, da), mat(s.W.data(), rows, kr, kChunk), mat(s.vaug.data(), kr, da), T(1),
              T(1));
  divide_rows(p, rows, s, out, D_in, D_in ? nullptr : D_out);
}

// [S | z] += Kᵀ·[V | 1] over the chunk's kr valid keys (s.vaug).
template <class T, class S>
void add_chunk_to_state(const Problem<T, S>& p, int64_t kr, const Features<T>& kf, Scratch<T>& s) {
  if (kr == 0) return;
  const int64_t m = p.fmap->dim(), da = p.dims.value_dim + 1;
  matmul<T>(p.products, mat(s.kvz.data(), m, da), mat(kf.values(*p.fmap), kr, m).t(), mat(s.vaug.data(), kr, da), T(1), T(1));
}

// The state at the start: a prefix state's rows [S_r | z_r | c_r] (causal_from_state), S, z
// and shifts from the caller (RecurrentState), or empty.
template <class T, class S>
void start_state(const Problem<T, S>& p, Scratch<T>& s, const T* prefix, const T* S0, const T* z0, const T* c0) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, da = dv + 1;
  if (prefix) {
    load_state(p, prefix, s);
    return;
  }
  if (S0) {
    for (int64_t r = 0; r < m; ++r) {
      std::copy(S0 + r * dv, S0 + (r + 1) * dv, s.kvz.data() + r * da);
      s.kvz[r * da + dv] = z0[r];
    }
    std::copy(c0, c0 + m, s.c.data());
    return;
  }
  std::fill(s.kvz.data(), s.kvz.data() + m * da, T(0));
  std::fill(s.c.data(), s.c.data() + m, p.fmap->log_form() ? neg_inf<T>() : T(0));
}

// carried: S, z, c of this batch·head to start from and to leave the final state in, or null;
// prefix: the state rows to start from (this batch·head's), or null; neither: start empty.
// save: den and the final state, or null.
template <class T, class S>
void forward_causal(const Problem<T, S>& p, int64_t bh, Scratch<T>& s, S* out, const Saved<T>& save,
                    T* S0 = nullptr, T* z0 = nullptr, T* c0 = nullptr, const T* prefix = nullptr) {
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim, n = p.dims.n_q;
  const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
  start_state(p, s, prefix, S0, z0, c0);
  for (int64_t t0 = 0; t0 < n;) {
    interruption_point();
    int64_t rows = std::min(kChunk, n - t0), kr = std::clamp<int64_t>(key_len - t0, 0, rows);
    chunk_features(p, bh, t0, rows, kr, s, s.qf, s.kf);
    chunk_weights(p, rows, kr, s.qf, s.kf, s);
    augmented_values(p, bh, t0, kr, s);
    S* o = out ? out + (bh * n + t0) * dv : nullptr;
    T* den = save.den ? save.den + bh * n + t0 : s.D.data();
    // divide_rows checks what it writes into out (forward() returns it).
    if (o) chunk_outputs(p, rows, kr, s.qf, s, o, static_cast<const T*>(nullptr), den);
    else chunk_outputs(p, rows, kr, s.qf, s, s.num.data(), static_cast<const T*>(nullptr), den);
    add_chunk_to_state(p, kr, s.kf, s);
    t0 += rows;
  }
  if (S0) {
    for (int64_t r = 0; r < m; ++r) {
      std::copy(s.kvz.data() + r * (dv + 1), s.kvz.data() + r * (dv + 1) + dv, S0 + r * dv);
      z0[r] = s.kvz[r * (dv + 1) + dv];
    }
    std::copy(s.c.data(), s.c.data() + m, c0);
  }
  if (save.state) store_state(p, s, save.state + bh * m * (dv + 2));
}

// What the causal backward's forward pass keeps for its reverse pass, per batch·head: dden_i
// per row, and per chunk its extent, the shifts its features were made with, and where its
// features are in the cache (if they are).
template <class T>
struct CausalSaved {
  struct Chunk {
    int64_t t0, rows, kr;
    bool cached;
    Features<T> qf, kf;  // in the cache, when cached
    T* P;                // the chunk's P (rows × kr, leading dimension kChunk), when cached
  };
  std::vector<T> dden, shifts;  // shifts: m' per chunk
  std::vector<Chunk> chunks;
};

// Values per row that the causal backward keeps of a chunk between its passes: the query and
// key features and the row's P (kChunk values).
template <class T>
int64_t cached_values_per_row(const FeatureMap<T>& fm) {
  return feature_values_per_row(fm, Side::Query) + feature_values_per_row(fm, Side::Key) + kChunk;
}

// The chunks' features and P kept between the causal backward's passes: a per-worker buffer of
// feature_cache_bytes(), filled from its start by the forward pass.
template <class T>
struct FeatureCache {
  Buffer<T> mem;
  int64_t used = 0;
  // Room for a chunk of `rows` rows (queries, keys, P), or false.
  bool take(const FeatureMap<T>& fm, int64_t rows, Features<T>& qf, Features<T>& kf, T*& P) {
    const int64_t q = feature_values_per_row(fm, Side::Query) * rows, k = feature_values_per_row(fm, Side::Key) * rows;
    if (used + cached_values_per_row(fm) * rows > mem.size()) return false;
    qf = features_at(fm, Side::Query, rows, mem.data() + used);
    kf = features_at(fm, Side::Key, rows, mem.data() + used + q);
    P = mem.data() + used + q + k;
    used += cached_values_per_row(fm) * rows;
    return true;
  }
};

// P_ij = [dnum_i | dden_i]·[v_j, 1] on the chunk's causal triangle (0 elsewhere), rows × kr
// (leading dimension kChunk), into P, from s.dnd and s.vaug.
template <class T, class S>
void chunk_output_grads(const Problem<T, S>& p, int64_t rows, int64_t kr, const Scratch<T>& s, T* P) {
  if (kr == 0) return;
  const int64_t da = p.dims.value_dim + 1;
  matmul<T>(p.products, mat(P, rows, kr, kChunk), mat(s.dnd.data(), rows, da), mat(s.vaug.data(), kr, da).t());
  zero_above_diagonal(P, rows, kr);
}

// Pass A, forward in time through the same chunks as the forward (same shifts): dnum and dden
// from the saved out and D, each chunk's extent and shifts, and dq:
// dQ_i = dnum_i·Sᵀ + dden_i·z + Σ_{j<=i} P_ij K_j.
template <class T, class S, class O>
void causal_forward_pass(const Problem<T, S>& p, int64_t bh, Scratch<T>& s, CausalSaved<T>& saved,
                         FeatureCache<T>& cache, const S* dout, const O* out, const T* den, S* dq,
                         const T* prefix = nullptr) {
  const int64_t m = p.fmap->dim(), d = p.dims.head_dim, dv = p.dims.value_dim, da = dv + 1, n = p.dims.n_q;
  const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
  const T* none = nullptr;
  start_state(p, s, prefix, none, none, none);
  saved.dden.resize(static_cast<size_t>(n));
  saved.chunks.clear();
  saved.shifts.clear();
  cache.used = 0;
  for (int64_t t0 = 0; t0 < n;) {
    interruption_point();
    int64_t rows = std::min(kChunk, n - t0), kr = std::clamp<int64_t>(key_len - t0, 0, rows);
    typename CausalSaved<T>::Chunk chunk{t0, rows, kr, false, s.qf, s.kf, s.P.data()};
    // Into the cache when it has room for the longest chunk (the chunk may come out shorter).
    chunk.cached = cache.take(*p.fmap, rows, chunk.qf, chunk.kf, chunk.P);
    const T* x = chunk_features(p, bh, t0, rows, kr, s, chunk.qf, chunk.kf);  // the query rows as T
    chunk.rows = rows, chunk.kr = kr;
    const T* D = den + bh * n + t0;
    T* dden = saved.dden.data() + t0;
    augmented_values(p, bh, t0, kr, s);
    const T* o = out ? compute_values(out + (bh * n + t0) * dv, rows * dv, s.outputs_in) : nullptr;
    if (!o) {  // the attention output again (the caller's output holds more than attention)
      chunk_weights(p, rows, kr, chunk.qf, chunk.kf, s);
      chunk_outputs(p, rows, kr, chunk.qf, s, s.num.data(), D, static_cast<T*>(nullptr));
      o = s.num.data();
    }
    output_grads(compute_values(dout + (bh * n + t0) * dv, rows * dv, s.grads_in), o, D, static_cast<const T*>(nullptr), rows,
                 dv, s.dnd.data());
    for (int64_t i = 0; i < rows; ++i) dden[i] = s.dnd[i * da + dv];  // for the reverse pass
    chunk_output_grads(p, rows, kr, s, chunk.P);
    // dQ = [dnum | dden]·[S | z]ᵀ + P·K
    matmul<T>(p.products, mat(s.dphi.data(), rows, m), mat(s.dnd.data(), rows, da), mat(s.kvz.data(), m, da).t());
    if (kr > 0)
      matmul<T>(p.products, mat(s.dphi.data(), rows, m), mat(chunk.P, rows, kr, kChunk), mat(chunk.kf.values(*p.fmap), kr, m),
                T(1), T(1));
    S* g = dq + (bh * n + t0) * d;
    T* r = result_values(g, s);
    feature_backward(p, x, rows, Side::Query, chunk.qf, s, r);
    store_results(g, r, rows * d, s);
    saved.chunks.push_back(chunk);
    saved.shifts.insert(saved.shifts.end(), s.c.data(), s.c.data() + m);
    add_chunk_to_state(p, kr, chunk.kf, s);
    t0 += rows;
  }
}

// Pass B, backward in time over the saved chunks, with the suffix state [R | ρ] (s.dkvz) in the
// scale of the chunk at hand: dk and dv. The final state's gradient (dstate_after, this
// batch·head's rows [dS | dz | ·], or null) is where R starts, as a query after every chunk
// would: it is in the last chunk's scale. With a prefix, R at the start is the prefix's
// gradient, in chunk 0's scale: the prefix entered as [S | z]·exp(c_P − c_0) (raise_shifts),
// so dprefix = R·exp(c_P − c_0), 0 for a row at c_P = −inf (no key: S and z are 0).
template <class T, class S>
void causal_reverse_pass(const Problem<T, S>& p, int64_t bh, Scratch<T>& s, const CausalSaved<T>& saved,
                         const S* dout, const T* den, S* dk, S* dv_out, const T* dstate_after = nullptr,
                         const T* prefix = nullptr, T* dprefix = nullptr) {
  const int64_t m = p.fmap->dim(), d = p.dims.head_dim, dv = p.dims.value_dim, da = dv + 1, n = p.dims.n_q;
  T* R = s.dkvz.data();  // [R | ρ], m' × (d_v + 1)
  std::fill(R, R + m * da, T(0));
  if (dstate_after)
    for (int64_t r = 0; r < m; ++r) std::copy(dstate_after + r * (dv + 2), dstate_after + r * (dv + 2) + da, R + r * da);
  const int64_t chunks = static_cast<int64_t>(saved.chunks.size());
  for (int64_t k = chunks - 1; k >= 0; --k) {
    interruption_point();
    const auto& chunk = saved.chunks[static_cast<size_t>(k)];
    const int64_t t0 = chunk.t0, rows = chunk.rows, kr = chunk.kr;
    const T* c = saved.shifts.data() + k * m;
    if (k + 1 < chunks && p.fmap->log_form()) {  // from the next chunk's scale to this one's
      const T* c_next = saved.shifts.data() + (k + 1) * m;
      for (int64_t r = 0; r < m; ++r) {
        if (c_next[r] == neg_inf<T>() || c[r] == c_next[r]) continue;
        const T f = c[r] == neg_inf<T>() ? T(0) : std::exp(c[r] - c_next[r]);
        simd::scale(R + r * da, static_cast<size_t>(da), f);
      }
    }
    // The chunk's features: from the cache, or again with the shifts it had.
    Features<T> qf = chunk.qf, kf = chunk.kf;
    if (!chunk.cached) {
      qf = s.qf, kf = s.kf;
      if (kr > 0) {
        key_logits(p, bh, t0, kr, s, kf);
        finish_key_features(p, kr, c, kf);
      }
      query_features(p, bh, t0, rows, c, s, qf);
    }
    chunk_weights(p, rows, kr, qf, kf, s);
    output_grads(compute_values(dout + (bh * n + t0) * dv, rows * dv, s.grads_in), static_cast<const T*>(nullptr),
                 den + bh * n + t0, saved.dden.data() + t0, rows, dv, s.dnd.data());
    augmented_values(p, bh, t0, kr, s);
    const T* P = chunk.P;
    if (!chunk.cached) {
      chunk_output_grads(p, rows, kr, s, s.P.data());
      P = s.P.data();
    }
    const T* Q = qf.values(*p.fmap);
    if (kr > 0) {
      const T* K = kf.values(*p.fmap);
      // dK = [V | 1]·[R | ρ]ᵀ + Pᵀ·Q
      matmul<T>(p.products, mat(s.dphi.data(), kr, m), mat(s.vaug.data(), kr, da), mat(static_cast<const T*>(R), m, da).t());
      matmul<T>(p.products, mat(s.dphi.data(), kr, m), mat(P, rows, kr, kChunk).t(), mat(Q, rows, m), T(1), T(1));
      // dv = K·R + Wᵀ·dnum
      S* gv = dv_out + (bh * n + t0) * dv;
      T* dvc = result_values(gv, s);
      matmul<T>(p.products, mat(dvc, kr, dv), mat(K, kr, m), mat(static_cast<const T*>(R), m, dv, da));
      matmul<T>(p.products, mat(dvc, kr, dv), mat(s.W.data(), rows, kr, kChunk).t(), mat(s.dnd.data(), rows, dv, da), T(1),
                T(1));
      store_results(gv, dvc, kr * dv, s);
      S* gk = dk + (bh * n + t0) * d;
      T* rk = result_values(gk, s);
      feature_backward(p, compute_values(p.k.row(bh, t0), kr * d, s.rows_in), kr, Side::Key, kf, s, rk);
      store_results(gk, rk, kr * d, s);
    }
    // This chunk's queries join the suffix state: [R | ρ] += Qᵀ·[dnum | dden].
    matmul<T>(p.products, mat(R, m, da), mat(Q, rows, m).t(), mat(s.dnd.data(), rows, da), T(1), T(1));
  }
  if (!dprefix) return;
  for (int64_t r = 0; r < m; ++r) {
    const T c_p = prefix[r * (dv + 2) + dv + 1];
    const T c_0 = chunks > 0 ? saved.shifts[static_cast<size_t>(r)] : c_p;
    // A prefix row at −inf holds no key (its S and z are 0, checked): it takes no gradient.
    const T f = c_p == neg_inf<T>() ? T(0) : c_p == c_0 ? T(1) : std::exp(c_p - c_0);
    for (int64_t c = 0; c < da; ++c) dprefix[r * (dv + 2) + c] = R[r * da + c] * f;
    dprefix[r * (dv + 2) + dv + 1] = 0;  // the shifts take no gradient
  }
}

std::atomic<int64_t> g_feature_cache_bytes{int64_t{32} << 20};

}  // namespace

int64_t feature_cache_bytes() { return g_feature_cache_bytes.load(); }
void set_feature_cache_bytes(int64_t bytes) { g_feature_cache_bytes.store(bytes); }

template <class T, class S>
bool forward(const Problem<T, S>& p, S* out, Saved<T> save) {
  const bool causal = p.mask->causal();
  const ParallelLoop loop(p.dims.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(p, causal); });
  loop.run([&](int64_t bh, int worker) {
    Scratch<T>& s = scratch[worker];
    if (causal) {
      forward_causal(p, bh, s, out, save);
    } else {
      forward_noncausal(p, bh, s, out, save);
    }
  });
  for (int w = 0; w < scratch.size(); ++w)
    if (!scratch[w].outputs_finite) return false;
  return true;
}

template <class T>
void forward_causal_from_state(const Problem<T>& p, T* out, T* S, T* z, T* c) {
  require(p.mask->causal(), "forward_causal_from_state: the problem must be causal");
  const int64_t m = p.fmap->dim(), dv = p.dims.value_dim;
  const ParallelLoop loop(p.dims.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(p, true); });
  loop.run([&](int64_t bh, int worker) {
    forward_causal(p, bh, scratch[worker], out, Saved<T>{}, S + bh * m * dv, z + bh * m, c + bh * m);
  });
}

template <class T, class S, class O>
bool backward(const Problem<T, S>& p, const S* dout, const O* out, const T* den, const T* state, S* dq, S* dk,
              S* dv) {
  const bool causal = p.mask->causal();
  require(causal || state, "kernelized::backward: the non-causal backward needs the saved state");
  const ParallelLoop loop(p.dims.bh());
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(p, causal); });
  // Causal: as many of the chunks' features as fit in feature_cache_bytes(), for all of them
  // when the sequence is short enough.
  const int64_t cache_values =
      causal ? std::min(p.dims.n_q * cached_values_per_row(*p.fmap), feature_cache_bytes() / static_cast<int64_t>(sizeof(T)))
             : 0;
  PerWorker<FeatureCache<T>> cache(loop, [&] { return FeatureCache<T>{Buffer<T>(cache_values, true, Init::Uninitialized), 0}; });
  PerWorker<CausalSaved<T>> saved(loop);
  const int64_t d = p.dims.head_dim, dvd = p.dims.value_dim;
  loop.run([&](int64_t bh, int worker) {
    // The passes write every query row and the valid key rows; padded keys get 0.
    const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
    std::fill(dk + (bh * p.dims.n_k + key_len) * d, dk + (bh + 1) * p.dims.n_k * d, S{});
    std::fill(dv + (bh * p.dims.n_k + key_len) * dvd, dv + (bh + 1) * p.dims.n_k * dvd, S{});
    Scratch<T>& s = scratch[worker];
    if (causal) {
      causal_forward_pass(p, bh, s, saved[worker], cache[worker], dout, out, den, dq);
      causal_reverse_pass(p, bh, s, saved[worker], dout, den, dk, dv);
    } else {
      backward_noncausal(p, bh, s, dout, out, den, state, dq, dk, dv);
    }
  });
  return all_gradients_finite(scratch);
}

// ---- state-level operations (engine.h) ------------------------------------------------------

namespace {

// Runs body(bh, scratch, worker) over every batch·head of `loop` with per-worker scratch;
// returns whether every gradient value the workers checked was finite.
template <class T, class Body>
bool each_head(const ParallelLoop& loop, const Problem<T>& p, bool causal, Body body) {
  PerWorker<Scratch<T>> scratch(loop, [&] { return Scratch<T>(p, causal); });
  loop.run([&](int64_t bh, int worker) { body(bh, scratch[worker], worker); });
  return all_gradients_finite(scratch);
}

template <class T>
int64_t state_rows(const Problem<T>& p) {
  return p.fmap->dim() * (p.dims.value_dim + 2);
}

}  // namespace

template <class T>
void key_state(const Problem<T>& p, T* state) {
  each_head(ParallelLoop(p.dims.bh()), p, false, [&](int64_t bh, Scratch<T>& s, int) {
    accumulate_kv(p, bh, p.mask->key_length(bh / p.dims.heads), s);
    store_state(p, s, state + bh * state_rows(p));
  });
}

template <class T>
bool key_state_backward(const Problem<T>& p, const T* state, const T* dstate, T* dk, T* dv) {
  const int64_t m = p.fmap->dim(), da = p.dims.value_dim + 1, d = p.dims.head_dim, dvd = p.dims.value_dim;
  return each_head(ParallelLoop(p.dims.bh()), p, false, [&](int64_t bh, Scratch<T>& s, int) {
    const int64_t key_len = p.mask->key_length(bh / p.dims.heads);
    std::fill(dk + (bh * p.dims.n_k + key_len) * d, dk + (bh + 1) * p.dims.n_k * d, T(0));
    std::fill(dv + (bh * p.dims.n_k + key_len) * dvd, dv + (bh + 1) * p.dims.n_k * dvd, T(0));
    load_state(p, state + bh * state_rows(p), s);
    const T* g = dstate + bh * state_rows(p);
    for (int64_t r = 0; r < m; ++r) std::copy(g + r * (da + 1), g + r * (da + 1) + da, s.dkvz.data() + r * da);
    noncausal_key_grads(p, bh, s, dk, dv);
  });
}

template <class T>
void apply_state(const Problem<T>& p, const T* state, T* out, T* den) {
  const int64_t dv = p.dims.value_dim;
  each_head(ParallelLoop(p.dims.bh()), p, false, [&](int64_t bh, Scratch<T>& s, int) {
    load_state(p, state + bh * state_rows(p), s);
    for (int64_t i0 = 0; i0 < p.dims.n_q; i0 += kBlockRows) {
      interruption_point();
      const int64_t rows = std::min(kBlockRows, p.dims.n_q - i0);
      query_rows(p, bh, i0, rows, s, out + (bh * p.dims.n_q + i0) * dv, static_cast<const T*>(nullptr),
                 den + bh * p.dims.n_q + i0);
    }
  });
}

template <class T>
bool apply_state_backward(const Problem<T>& p, const T* state, const T* dout, const T* out, const T* den, T* dq,
                          T* dstate) {
  const int64_t m = p.fmap->dim(), da = p.dims.value_dim + 1;
  return each_head(ParallelLoop(p.dims.bh()), p, false, [&](int64_t bh, Scratch<T>& s, int) {
    load_state(p, state + bh * state_rows(p), s);
    std::fill(s.dkvz.data(), s.dkvz.data() + m * da, T(0));
    noncausal_query_grads(p, bh, s, dout, out, den, dq);
    T* g = dstate + bh * state_rows(p);
    for (int64_t r = 0; r < m; ++r) {
      std::copy(s.dkvz.data() + r * da, s.dkvz.data() + (r + 1) * da, g + r * (da + 1));
      g[r * (da + 1) + da] = 0;  // the shifts take no gradient
    }
    s.written.check(g, m * (da + 1));
  });
}

template <class T>
void causal_from_state(const Problem<T>& p, const T* prefix, T* out, T* den, T* state_after) {
  require(p.mask->causal(), "kernelized::causal_from_state: the problem must be causal");
  each_head(ParallelLoop(p.dims.bh()), p, true, [&](int64_t bh, Scratch<T>& s, int) {
    forward_causal(p, bh, s, out, Saved<T>{den, state_after}, static_cast<T*>(nullptr), static_cast<T*>(nullptr),
                   static_cast<T*>(nullptr), prefix + bh * state_rows(p));
  });
}

template <class T>
bool causal_from_state_backward(const Problem<T>& p, const T* prefix, const T* dout, const T* out, const T* den,
                                const T* dstate_after, T* dq, T* dk, T* dv, T* dprefix) {
  require(p.mask->causal(), "kernelized::causal_from_state_backward: the problem must be causal");
  const ParallelLoop loop(p.dims.bh());
  const int64_t cache_values =
      std::min(p.dims.n_q * cached_values_per_row(*p.fmap), feature_cache_bytes() / static_cast<int64_t>(sizeof(T)));
  PerWorker<FeatureCache<T>> cache(loop, [&] { return FeatureCache<T>{Buffer<T>(cache_values, true, Init::Uninitialized), 0}; });
  PerWorker<CausalSaved<T>> saved(loop);
  const int64_t d = p.dims.head_dim, dvd = p.dims.value_dim;
  return each_head(loop, p, true, [&](int64_t bh, Scratch<T>& s, int worker) {
    const int64_t key_len = p.mask->key_length(bh / p.dims.heads), rows = state_rows(p);
    std::fill(dk + (bh * p.dims.n_k + key_len) * d, dk + (bh + 1) * p.dims.n_k * d, T(0));
    std::fill(dv + (bh * p.dims.n_k + key_len) * dvd, dv + (bh + 1) * p.dims.n_k * dvd, T(0));
    causal_forward_pass(p, bh, s, saved[worker], cache[worker], dout, out, den, dq, prefix + bh * rows);
    causal_reverse_pass(p, bh, s, saved[worker], dout, den, dk, dv, dstate_after ? dstate_after + bh * rows : nullptr,
                        prefix + bh * rows, dprefix + bh * rows);
    s.written.check(dprefix + bh * rows, rows);
  });
}

#define LINATTN_STATE_OPS(T)                                                                                  \
  template void key_state<T>(const Problem<T>&, T*);                                                          \
  template bool key_state_backward<T>(const Problem<T>&, const T*, const T*, T*, T*);                         \
  template void apply_state<T>(const Problem<T>&, const T*, T*, T*);                                          \
  template bool apply_state_backward<T>(const Problem<T>&, const T*, const T*, const T*, const T*, T*, T*);   \
  template void causal_from_state<T>(const Problem<T>&, const T*, T*, T*, T*);                                \
  template bool causal_from_state_backward<T>(const Problem<T>&, const T*, const T*, const T*, const T*,      \
                                              const T*, T*, T*, T*, T*);
LINATTN_STATE_OPS(float)
LINATTN_STATE_OPS(double)
#undef LINATTN_STATE_OPS

template bool forward<float>(const Problem<float>&, float*, Saved<float>);
template bool forward<float, bfloat16>(const Problem<float, bfloat16>&, bfloat16*, Saved<float>);
template bool forward<double>(const Problem<double>&, double*, Saved<double>);
template void forward_causal_from_state<float>(const Problem<float>&, float*, float*, float*, float*);
template void forward_causal_from_state<double>(const Problem<double>&, double*, double*, double*,
                                                double*);
template bool backward<float>(const Problem<float>&, const float*, const float*, const float*, const float*,
                              float*, float*, float*);
template bool backward<float, bfloat16>(const Problem<float, bfloat16>&, const bfloat16*, const float*, const float*,
                                        const float*, bfloat16*, bfloat16*, bfloat16*);
template bool backward<float, bfloat16, bfloat16>(const Problem<float, bfloat16>&, const bfloat16*, const bfloat16*,
                                                  const float*, const float*, bfloat16*, bfloat16*, bfloat16*);
template bool backward<double>(const Problem<double>&, const double*, const double*, const double*,
                               const double*, double*, double*, double*);

}  // namespace linattn::kernelized
