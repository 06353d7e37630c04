// The kernelized attention engine shared by linear_attention, favor_attention and
// RecurrentState:
//   out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / (Σ_j φ(q_i)·φ(k_j) + eps)
// over the keys query i sees, in O(n) time, never forming the n×n matrix.
#pragma once

#include "linattn/core/attention_args.h"
#include "linattn/kernelized/feature_map.h"

namespace linattn::kernelized {

template <class T>
struct Problem {
  const char* fn;               // the public function, named in errors
  TensorView<const T> q, k, v;  // [B,H,n_q,d], [B,H,n_k,d], [B,H,n_k,d_v]
  AttentionDims dims;
  const KeyMask* mask;          // key_lengths; causal when mask->causal() (then n_q == n_k)
  const FeatureMap<T>* fmap;
  T eps;                        // added to every denominator (0 for FAVOR)
};

// out [B,H,n_q,d_v] (overwritten).
template <class T>
void forward(const Problem<T>& p, T* out);

// Causal forward that starts from a carried state and leaves the final one there (for
// RecurrentState): per batch·head, S [m'×d_v], z [m'] and the per-feature log-shifts c [m']
// (S and z are stored divided by exp(c); c = −inf for a FAVOR feature no key has reached yet,
// 0 for plain maps).
template <class T>
void forward_causal_from_state(const Problem<T>& p, T* out, T* S, T* z, T* c);

// Gradients of Σ dout∘out: dq, dk, dv (overwritten).
template <class T>
void backward(const Problem<T>& p, const T* dout, T* dq, T* dk, T* dv);

// Rows per block (non-causal) and the longest chunk (causal).
inline constexpr int64_t kBlockRows = 1024;
inline constexpr int64_t kChunk = 64;
// The non-causal backward keeps the key logits (or features) between its passes up to this
// many bytes per worker (n_k·m' values, twice for trig; default 32 MiB), and recomputes them
// beyond it. Settable so tests can take both paths.
int64_t feature_cache_bytes();
void set_feature_cache_bytes(int64_t bytes);

}  // namespace linattn::kernelized
