#include "linattn/nystrom/pinv.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "linattn/core/blas.h"
#include "linattn/core/error.h"
#include "linattn/memory.h"

namespace linattn::nystrom {
namespace {

template <class T>
void identity_minus(T c, const T* x, T* out, int64_t m) {  // out = c·I − x
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j) out[i * m + j] = (i == j ? c : T(0)) - x[i * m + j];
}

// C = alpha·op(A)·op(B) + beta·C for m×m row-major matrices, op the transpose where asked.
enum class Op { Plain, Transposed };
template <class T>
void mm(Op ta, Op tb, int64_t m, T alpha, const T* A, const T* B, T beta, T* C) {
  const Mat<const T> a = mat(A, m, m), b = mat(B, m, m);
  matmul<T>(mat(C, m, m), ta == Op::Transposed ? a.t() : a, tb == Op::Transposed ? b.t() : b, alpha,
            beta);
}

// ‖A‖₁ (largest column sum of |A|) and ‖A‖∞ (largest row sum), with where they are attained.
template <class T>
void norms(const T* A, int64_t m, T& n1, int64_t& col, T& ninf, int64_t& row, T* colsum) {
  std::fill(colsum, colsum + m, T(0));
  ninf = -1;
  for (int64_t i = 0; i < m; ++i) {
    T r = 0;
    for (int64_t j = 0; j < m; ++j) {
      r += std::abs(A[i * m + j]);
      colsum[j] += std::abs(A[i * m + j]);
    }
    if (r > ninf) ninf = r, row = i;
  }
  n1 = -1;
  for (int64_t j = 0; j < m; ++j)
    if (colsum[j] > n1) n1 = colsum[j], col = j;
}

// One step's intermediates from V: P = AV, T1 = 7I − P, T3 = 15I − P·T1, T5 = 13I − P·T3.
template <class T>
void step_terms(const T* A, const T* V, int64_t m, T* P, T* T1, T* T3, T* T5, T* tmp) {
  mm<T>(Op::Plain, Op::Plain, m, 1, A, V, 0, P);
  identity_minus<T>(7, P, T1, m);
  mm<T>(Op::Plain, Op::Plain, m, 1, P, T1, 0, tmp);
  identity_minus<T>(15, tmp, T3, m);
  mm<T>(Op::Plain, Op::Plain, m, 1, P, T3, 0, tmp);
  identity_minus<T>(13, tmp, T5, m);
}

template <class T>
void iterative_forward(const T* A, int64_t m, int64_t iterations, T* Z, T* iterates, T* s) {
  const int64_t mm2 = m * m;
  T *P = s, *T1 = s + mm2, *T3 = s + 2 * mm2, *T5 = s + 3 * mm2, *tmp = s + 4 * mm2,
    *cur = s + 5 * mm2, *next = s + 6 * mm2, *colsum = s + 7 * mm2;
  T n1, ninf;
  int64_t col = 0, row = 0;
  norms(A, m, n1, col, ninf, row, colsum);
  const T c = T(1) / (n1 * ninf);
  T* v = iterates ? iterates : cur;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j) v[i * m + j] = c * A[j * m + i];
  for (int64_t k = 0; k < iterations; ++k) {
    step_terms(A, v, m, P, T1, T3, T5, tmp);
    T* out = iterates ? iterates + (k + 1) * mm2 : (v == cur ? next : cur);
    mm<T>(Op::Plain, Op::Plain, m, T(0.25), v, T5, 0, out);
    v = out;
  }
  std::copy(v, v + mm2, Z);
}

template <class T>
void iterative_backward(const T* A, int64_t m, int64_t iterations, const T* iterates, const T* dZ,
                        T* dA, T* s) {
  const int64_t mm2 = m * m;
  T *P = s, *T1 = s + mm2, *T3 = s + 2 * mm2, *T5 = s + 3 * mm2, *tmp = s + 4 * mm2,
    *G = s + 5 * mm2, *dV = s + 6 * mm2, *dT = s + 7 * mm2, *dP = s + 8 * mm2, *colsum = s + 9 * mm2;
  std::fill(dA, dA + mm2, T(0));
  std::copy(dZ, dZ + mm2, G);
  for (int64_t k = iterations - 1; k >= 0; --k) {
    const T* V = iterates + k * mm2;
    step_terms(A, V, m, P, T1, T3, T5, tmp);
    // V' = ¼·V·T5
    mm<T>(Op::Plain, Op::Transposed, m, T(0.25), G, T5, 0, dV);  // dV = ¼ G T5ᵀ
    mm<T>(Op::Transposed, Op::Plain, m, T(0.25), V, G, 0, dT);   // dT5 = ¼ Vᵀ G
    // T5 = 13I − P·T3: d(P·T3) = −dT5
    mm<T>(Op::Plain, Op::Transposed, m, T(-1), dT, T3, 0, dP);   // dP = −dT5 T3ᵀ
    mm<T>(Op::Transposed, Op::Plain, m, T(1), P, dT, 0, tmp);    // −dT3 = Pᵀ dT5 = dT2 (T3 = 15I − T2)
    // T2 = P·T1
    mm<T>(Op::Plain, Op::Transposed, m, T(1), tmp, T1, 1, dP);   // dP += dT2 T1ᵀ
    mm<T>(Op::Transposed, Op::Plain, m, T(1), P, tmp, 0, dT);    // dT1 = Pᵀ dT2
    for (int64_t i = 0; i < mm2; ++i) dP[i] -= dT[i];        // T1 = 7I − P
    // P = A·V
    mm<T>(Op::Plain, Op::Transposed, m, T(1), dP, V, 1, dA);     // dA += dP Vᵀ
    mm<T>(Op::Transposed, Op::Plain, m, T(1), A, dP, 1, dV);     // dV += Aᵀ dP
    std::swap(G, dV);
  }
  // V₀ = c·Aᵀ with c = 1/(‖A‖₁‖A‖∞).
  T n1, ninf;
  int64_t col = 0, row = 0;
  norms(A, m, n1, col, ninf, row, colsum);
  const T c = T(1) / (n1 * ninf);
  T dc = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j) {
      dA[i * m + j] += c * G[j * m + i];
      dc += G[j * m + i] * A[i * m + j];
    }
  const T dn1 = -c / n1 * dc, dninf = -c / ninf * dc;
  for (int64_t i = 0; i < m; ++i) {
    const T a = A[i * m + col];
    dA[i * m + col] += dn1 * T(a > 0 ? 1 : (a < 0 ? -1 : 0));
  }
  for (int64_t j = 0; j < m; ++j) {
    const T a = A[row * m + j];
    dA[row * m + j] += dninf * T(a > 0 ? 1 : (a < 0 ? -1 : 0));
  }
}

template <class T>
void exact_forward(const T* A, int64_t m, T* Z) {
  Buffer<double> a(m * m), u(m * m), vt(m * m), s(m);
  // LAPACK is column-major, so it sees the row-major array of A as M = Aᵀ = U·S·Vᵀ, and
  // pinv(A) = pinv(M)ᵀ = U·S⁺·Vᵀ: Z[i][j] = Σ_r U[i][r]/s_r·Vᵀ[r][j], read column-major below.
  for (int64_t i = 0; i < m * m; ++i) a[i] = static_cast<double>(A[i]);
  svd("nystrom_attention (exact pseudo-inverse of the landmark kernel)", m, a.data(), s.data(),
      u.data(), vt.data());
  const double cutoff = static_cast<double>(m) * std::numeric_limits<T>::epsilon() * s[0];
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j) {
      double acc = 0;
      for (int64_t r = 0; r < m; ++r)
        if (s[r] > cutoff) acc += u[i + r * m] / s[r] * vt[r + j * m];
      Z[i * m + j] = static_cast<T>(acc);
    }
}

template <class T>
void exact_backward(const T* A, const T* Z, int64_t m, const T* G, T* dA, T* s) {
  const int64_t mm2 = m * m;
  T *X = s, *ZZ = s + mm2, *R = s + 2 * mm2;
  mm<T>(Op::Transposed, Op::Plain, m, 1, Z, G, 0, X);     // X = Zᵀ G
  mm<T>(Op::Plain, Op::Transposed, m, -1, X, Z, 0, dA);   // dA = −Zᵀ G Zᵀ
  mm<T>(Op::Plain, Op::Transposed, m, 1, Z, Z, 0, ZZ);    // Z Zᵀ
  mm<T>(Op::Transposed, Op::Plain, m, 1, G, ZZ, 0, X);    // X = Gᵀ Z Zᵀ
  mm<T>(Op::Plain, Op::Plain, m, 1, A, Z, 0, R);      // A Z
  identity_minus<T>(1, R, R, m);                      // R = I − A Z (in place: elementwise)
  mm<T>(Op::Plain, Op::Plain, m, 1, R, X, 1, dA);     // dA += (I − AZ) Gᵀ Z Zᵀ
  mm<T>(Op::Transposed, Op::Plain, m, 1, Z, Z, 0, ZZ);    // Zᵀ Z
  mm<T>(Op::Plain, Op::Transposed, m, 1, ZZ, G, 0, X);    // X = Zᵀ Z Gᵀ
  mm<T>(Op::Plain, Op::Plain, m, 1, Z, A, 0, R);      // Z A
  identity_minus<T>(1, R, R, m);                      // R = I − Z A
  mm<T>(Op::Plain, Op::Plain, m, 1, X, R, 1, dA);     // dA += Zᵀ Z Gᵀ (I − ZA)
}

}  // namespace

PinvMethod parse_pinv(const char* fn, const std::string& name) {
  if (name == "iterative") return PinvMethod::Iterative;
  if (name == "exact") return PinvMethod::Exact;
  fail(fn, ": pinv must be \"iterative\" or \"exact\", got \"", name, "\"");
}

template <class T>
void pinv_forward(PinvMethod method, const T* A, int64_t m, int64_t iterations, T* Z, T* iterates,
                  T* scratch) {
  if (method == PinvMethod::Exact) return exact_forward(A, m, Z);
  iterative_forward(A, m, iterations, Z, iterates, scratch);
}

template <class T>
void pinv_backward(PinvMethod method, const T* A, const T* Z, int64_t m, int64_t iterations,
                   const T* iterates, const T* dZ, T* dA, T* scratch) {
  if (method == PinvMethod::Exact) return exact_backward(A, Z, m, dZ, dA, scratch);
  iterative_backward(A, m, iterations, iterates, dZ, dA, scratch);
}

template void pinv_forward<float>(PinvMethod, const float*, int64_t, int64_t, float*, float*, float*);
template void pinv_forward<double>(PinvMethod, const double*, int64_t, int64_t, double*, double*,
                                   double*);
template void pinv_backward<float>(PinvMethod, const float*, const float*, int64_t, int64_t,
                                   const float*, const float*, float*, float*);
template void pinv_backward<double>(PinvMethod, const double*, const double*, int64_t, int64_t,
                                    const double*, const double*, double*, double*);

}  // namespace linattn::nystrom
