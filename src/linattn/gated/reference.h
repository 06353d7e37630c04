// The float64 definition of gated linear attention (include/linattn/gated.h) as the plain
// recurrence, one position at a time: S_t = diag(exp(g_t))·S_{t−1} + k_t v_tᵀ, o_t = s·S_tᵀ q_t.
#pragma once

#include <cstdint>
#include <vector>

namespace linattn {
namespace reference {

struct GatedOutputs {
  std::vector<double> out;    // [B, H, n, d_v]
  std::vector<double> state;  // [B, H, d_k, d_v]
};

// q, k [B·H, n, d_k], v [B·H, n, d_v], log_gate [B·H, n] (per_channel false) or [B·H, n, d_k];
// initial_state [B·H, d_k, d_v] or null. Absolute values instead (absolute = true: |q|, |k|,
// |v|, |S_0|) give the sums of the terms' magnitudes, the scale of any rounding bound.
GatedOutputs gated_linear_attention(const double* q, const double* k, const double* v, const double* log_gate,
                                    const double* initial_state, int64_t bh, int64_t n, int64_t dk, int64_t dv,
                                    bool per_channel, double scale, bool absolute = false);

// The non-causal form, by its definition (O(n²)): o_t = s·Σ_s Σ_c q_tc k_sc e_ts,c v_s with
// e_ts = Π_{min(s,t) < u <= max(s,t)} exp(g_u) per channel (per head: the same for every c).
std::vector<double> gated_linear_attention_noncausal(const double* q, const double* k, const double* v,
                                                     const double* log_gate, int64_t bh, int64_t n, int64_t dk,
                                                     int64_t dv, bool per_channel, double scale, bool absolute = false);

}  // namespace reference
}  // namespace linattn
