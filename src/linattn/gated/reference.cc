#include "linattn/gated/reference.h"

#include <cmath>

namespace linattn {
namespace reference {

GatedOutputs gated_linear_attention(const double* q, const double* k, const double* v, const double* log_gate,
                                    const double* initial_state, int64_t bh, int64_t n, int64_t dk, int64_t dv,
                                    bool per_channel, double scale, bool absolute) {
  auto val = [absolute](double x) { return absolute ? std::fabs(x) : x; };
  GatedOutputs r{std::vector<double>(static_cast<size_t>(bh * n * dv)),
                 std::vector<double>(static_cast<size_t>(bh * dk * dv))};
  for (int64_t h = 0; h < bh; ++h) {
    double* S = r.state.data() + h * dk * dv;
    for (int64_t i = 0; i < dk * dv; ++i) S[i] = initial_state ? val(initial_state[h * dk * dv + i]) : 0.0;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < dk; ++c) {
        const double g = per_channel ? log_gate[(h * n + t) * dk + c] : log_gate[h * n + t];
        const double a = std::exp(g);  // exp(−inf) = 0: a reset
        const double kc = val(k[(h * n + t) * dk + c]);
        for (int64_t e = 0; e < dv; ++e) S[c * dv + e] = a * S[c * dv + e] + kc * val(v[(h * n + t) * dv + e]);
      }
      for (int64_t e = 0; e < dv; ++e) {
        double acc = 0.0;
        for (int64_t c = 0; c < dk; ++c) acc += S[c * dv + e] * val(q[(h * n + t) * dk + c]);
        r.out[(h * n + t) * dv + e] = scale * acc;
      }
    }
  }
  return r;
}

}  // namespace reference
}  // namespace linattn
