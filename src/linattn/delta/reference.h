// The float64 definition of the gated delta rule and KDA (include/linattn/delta.h) as the plain
// recurrence, one position at a time.
#pragma once

#include <cstdint>
#include <vector>

namespace linattn {
namespace reference {

struct DeltaRuleOutputs {
  std::vector<double> out;    // [B, H, n, d_v]
  std::vector<double> state;  // [B, H, d_k, d_v]
};

// q, k [B, H_k, n, d_k], v [B, H, n, d_v], g [B, H, n] (per_channel false) or [B, H, n, d_k],
// beta [B, H, n], initial_state [B, H, d_k, d_v] or null; value head h reads key head
// h / (H / H_k). l2norm: q and k divided by sqrt(|x|² + 1e−6) first.
DeltaRuleOutputs gated_delta_rule(const double* q, const double* k, const double* v, const double* g,
                                  const double* beta, const double* initial_state, int64_t batch, int64_t heads,
                                  int64_t key_heads, int64_t n, int64_t dk, int64_t dv, bool per_channel,
                                  double scale, bool l2norm);

}  // namespace reference
}  // namespace linattn
