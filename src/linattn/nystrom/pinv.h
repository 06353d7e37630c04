// The pseudo-inverse of Nyström's m×m landmark kernel A = softmax(Q̃K̃ᵀ·s), and its backward.
#pragma once

#include <cstdint>
#include <string>

namespace linattn::nystrom {

enum class PinvMethod { Iterative, Exact };
PinvMethod parse_pinv(const char* fn, const std::string& name);

// Elements of T the functions below need as scratch, for m×m matrices.
inline int64_t pinv_scratch_size(int64_t m) { return 10 * m * m; }

// Z = pinv(A) for row-major m×m A.
// Iterative (Razavi et al. 2014, as Nyströmformer uses it): V₀ = Aᵀ/(‖A‖₁‖A‖∞), then
//   V_{k+1} = ¼·V_k(13I − AV_k(15I − AV_k(7I − AV_k))), `iterations` times; Z = V_iterations.
//   `iterates`, if not null, receives V₀..V_iterations ((iterations+1)·m² values) for the backward.
// Exact: SVD in float64 by LAPACK (dgesdd); singular values below m·ε·σ_max (ε of T) count as
//   zero, as in torch.linalg.pinv; the result is rounded to T.
template <class T>
void pinv_forward(PinvMethod method, const T* A, int64_t m, int64_t iterations, T* Z, T* iterates,
                  T* scratch);

// dA = the gradient of Σ Z∘dZ with respect to A, through the computation above (the iterations
// as computed from `iterates`, including the norms of V₀; or the derivative of the
// pseudo-inverse at constant rank, −ZᵀdZZᵀ + (I−AZ)dZᵀZZᵀ + ZᵀZdZᵀ(I−ZA)). Overwrites dA.
template <class T>
void pinv_backward(PinvMethod method, const T* A, const T* Z, int64_t m, int64_t iterations,
                   const T* iterates, const T* dZ, T* dA, T* scratch);

}  // namespace linattn::nystrom
