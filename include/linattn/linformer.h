// Linformer (Wang et al., 2020): keys and values projected along the sequence,
//   out = softmax(Q (E K)ᵀ·s) (F V),  E, F [s_proj, n_max] (shared by heads) or [heads, s_proj, n_max].
// O(n·s_proj·d) time. Never causal: each projected key mixes every position.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "linattn/attention.h"
#include "linattn/tensor.h"

namespace linattn {

// key_lengths: padded keys' columns of E, F count as 0. causal = true is an error: there is no
// causal Linformer.
struct LinformerOptions : AttentionOptions {};

// q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v], e and f of one shape, [s,n_max] or
// [H,s,n_max] with n_k <= n_max (the first n_k columns are used) -> out [B,H,n_q,d_v].
template <class T>
Tensor<T> linformer_attention(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                              TensorView<const T> e, TensorView<const T> f,
                              const LinformerOptions& opts = {});

// dq, dk, dv and params {"e", "f"} (the shapes of e, f).
template <class T>
AttentionGrads<T> linformer_attention_backward(TensorView<const T> q, TensorView<const T> k,
                                               TensorView<const T> v, TensorView<const T> e,
                                               TensorView<const T> f, TensorView<const T> dout,
                                               const LinformerOptions& opts = {});

// ---- state-level operation -------------------------------------------------------------------
// Linformer over a sequence split into blocks (linattn.torch.distributed): a block's share of
// the projected keys and values. Each key j of the block is column offset + j of e and f, so
// the projections of the blocks add up to the whole sequence's, and softmax attention of the
// queries over them is linformer_attention.
// k [B,H,n,d], v [B,H,n,d_v], e and f as linformer_attention takes them (offset + n <= n_max)
// -> [B,H,s,d+d_v] = [E_L·K_L | F_L·V_L], with E_L the columns offset + j, j < key_lengths[b]
// (default all), of e (of head h for [H,s,n_max] projections).
template <class T>
Tensor<T> linformer_project(TensorView<const T> k, TensorView<const T> v, TensorView<const T> e, TensorView<const T> f,
                            int64_t offset = 0, const LinformerOptions& opts = {});
// dk, dv (padded keys 0) and params {"e", "f"} (e's shape: 0 outside the block's valid columns)
// from dprojected [B,H,s,d+d_v]; with param_grads false, no params (frozen projections: dE and
// dF are as much work as dk and dv).
template <class T>
AttentionGrads<T> linformer_project_backward(TensorView<const T> k, TensorView<const T> v, TensorView<const T> e,
                                             TensorView<const T> f, TensorView<const T> dprojected, int64_t offset = 0,
                                             const LinformerOptions& opts = {}, bool param_grads = true);

// E and F as fairseq's Linformer initialises its compression layers: Xavier-uniform with gain
// 1/√2, i.e. uniform on (−a, a) with a = sqrt(3 / (n_max + s_proj)). heads = 0 gives shared
// [s_proj, n_max] matrices, heads > 0 one per head. E from Rng(seed), F from Rng(seed + 1).
template <class T>
std::pair<Tensor<T>, Tensor<T>> linformer_projections(int64_t s_proj, int64_t n_max,
                                                      int64_t heads = 0, uint64_t seed = 0);

}  // namespace linattn
