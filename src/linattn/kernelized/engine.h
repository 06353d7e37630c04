// The kernelized attention engine shared by linear_attention, favor_attention and
// RecurrentState:
//   out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / (Σ_j φ(q_i)·φ(k_j) + eps)
// over the keys query i sees, in O(n) time, never forming the n×n matrix.
#pragma once

#include "linattn/core/attention_args.h"
#include "linattn/core/products.h"
#include "linattn/low_precision.h"
#include "linattn/core/feature_map.h"

namespace linattn::kernelized {

// S: how q, k, v, dout and the results are stored; T, or bfloat16 with T = float (the engine
// computes in T and widens and rounds a block at a time: engine.cc, "storage").
template <class T, class S = T>
struct Problem {
  const char* fn;               // the public function, named in errors
  TensorView<const S> q, k, v;  // [B,H,n_q,d], [B,H,n_k,d], [B,H,n_k,d_v]
  AttentionDims dims;
  const KeyMask* mask;          // key_lengths; causal when mask->causal() (then n_q == n_k)
  const FeatureMap<T>* fmap;
  T eps;                        // added to every denominator (0 for FAVOR)
  // The matrix products' arithmetic, the feature maps' included (favor_attention's bfloat16
  // calls with the positive or hyperbolic kernel on AVX512-BF16: Products::Bfloat16; the engine
  // itself takes it for any map).
  Products products = Products::Native;
};

// What the forward keeps for the backward, per batch·head (null: not wanted / not there):
//   den [BH, n_q]: D_i = φ(q_i)·Σφ(k) + eps, in the scale the forward computed it (FAVOR: with
//     the row shift t_i and the key shifts c of engine.cc; recomputing the features gives the
//     same shifts, so the backward can use D_i as it is);
//   state [BH, m', d_v + 2]: row r = [S_r (d_v values) | z_r | c_r], the sums over every valid
//     key, S and z divided by exp(c_r) (c_r = −inf for a FAVOR feature that no key reaches;
//     0 for plain maps): what the non-causal backward's queries need without a pass over keys.
template <class T>
struct Saved {
  T* den = nullptr;
  T* state = nullptr;
};
template <class T, class S>
int64_t state_size(const Problem<T, S>& p) {
  return p.dims.bh() * p.fmap->dim() * (p.dims.value_dim + 2);
}

// out [B,H,n_q,d_v] (overwritten; null: only what `save` points at), and what `save` points at.
// Returns whether every value written to out is finite (checked as it was written, so a caller
// whose out is final need not read it again).
template <class T, class S>
bool forward(const Problem<T, S>& p, S* out, Saved<T> save = {});

// Causal forward that starts from a carried state and leaves the final one there (for
// RecurrentState): per batch·head, S [m'×d_v], z [m'] and the per-feature log-shifts c [m']
// (S and z are stored divided by exp(c); c = −inf for a FAVOR feature no key has reached yet,
// 0 for plain maps).
template <class T>
void forward_causal_from_state(const Problem<T>& p, T* out, T* S, T* z, T* c);

// Gradients of Σ dout∘out: dq, dk, dv (overwritten), from the forward's saved den and (non-
// causal) state. out: the forward's attention output (T, or as a bfloat16 forward returned it:
// O = S, widened a block at a time), or null to compute it again (when the caller's output also
// holds a depthwise convolution). Returns whether every value written is finite (checked block
// by block while in cache; restore_gradients then need not read them).
template <class T, class S, class O = T>
bool backward(const Problem<T, S>& p, const S* dout, const O* out, const T* den, const T* state, S* dq,
              S* dk, S* dv);

// ---- state-level operations (state_ops.cc; the distributed path's pieces) --------------------
// A state holds per batch·head the rows [S_r | z_r | c_r] (m' × (d_v + 2)) of Saved::state.
// The shifts c take no gradient: every result is the same function of the inputs whatever
// they are, so the gradients below treat them as constants and write 0 in their column.

// state = the sums over p's valid keys (p.q unused; the mask non-causal).
template <class T>
void key_state(const Problem<T>& p, T* state);
// dk, dv (overwritten; padded keys 0) from dstate = ∂loss/∂state, with `state` the forward's.
template <class T>
bool key_state_backward(const Problem<T>& p, const T* state, const T* dstate, T* dk, T* dv);
// out [B,H,n_q,d_v] and den [B,H,n_q] of p's queries against `state` (p.k, p.v unused).
template <class T>
void apply_state(const Problem<T>& p, const T* state, T* out, T* den);
// dq and dstate (overwritten) from dout and the forward's out and den.
template <class T>
bool apply_state_backward(const Problem<T>& p, const T* state, const T* dout, const T* out, const T* den, T* dq,
                          T* dstate);
// Causal (p.mask causal), starting from `prefix` (the keys before p's): out, den, and the state
// after p's keys (prefix included, on the final shifts).
template <class T>
void causal_from_state(const Problem<T>& p, const T* prefix, T* out, T* den, T* state_after);
// dq, dk, dv and dprefix (overwritten) from dout and dstate_after (null: no gradient reaches
// the final state).
template <class T>
bool causal_from_state_backward(const Problem<T>& p, const T* prefix, const T* dout, const T* out, const T* den,
                                const T* dstate_after, T* dq, T* dk, T* dv, T* dprefix);

// Rows per block (non-causal) and the longest chunk (causal). 32 rows: the causal intra-chunk
// products grow with the chunk and the state products do not; 32 beat 16, 48 and 64 in both
// passes here (docs/methods/kernelized.md).
inline constexpr int64_t kBlockRows = 1024;
inline constexpr int64_t kChunk = 32;
// The causal backward keeps each chunk's features and its P between its two passes, up to
// this many bytes per worker (default 32 MiB: all of them for n up to about 15k at m' = 256,
// 52k at m' = 64, float32), and computes the rest again in its second pass. Settable so
// tests can take both paths.
int64_t feature_cache_bytes();
void set_feature_cache_bytes(int64_t bytes);

}  // namespace linattn::kernelized
