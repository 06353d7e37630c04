#include "linattn/gated/reference.h"

#include <algorithm>
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

std::vector<double> gated_linear_attention_noncausal(const double* q, const double* k, const double* v,
                                                     const double* log_gate, int64_t bh, int64_t n, int64_t dk,
                                                     int64_t dv, bool per_channel, double scale, bool absolute) {
  auto val = [absolute](double x) { return absolute ? std::fabs(x) : x; };
  auto gate = [&](int64_t h, int64_t u, int64_t c) {
    return std::exp(per_channel ? log_gate[(h * n + u) * dk + c] : log_gate[h * n + u]);
  };
  std::vector<double> out(static_cast<size_t>(bh * n * dv), 0.0), decay(static_cast<size_t>(dk));
  for (int64_t h = 0; h < bh; ++h)
    for (int64_t t = 0; t < n; ++t) {
      double* o = out.data() + (h * n + t) * dv;
      auto add = [&](int64_t s) {  // the term of key s, decay holding e_ts
        double w = 0.0;
        for (int64_t c = 0; c < dk; ++c) w += val(q[(h * n + t) * dk + c]) * val(k[(h * n + s) * dk + c]) * decay[c];
        for (int64_t e = 0; e < dv; ++e) o[e] += scale * w * val(v[(h * n + s) * dv + e]);
      };
      std::fill(decay.begin(), decay.end(), 1.0);
      for (int64_t s = t; s >= 0; --s) {  // s <= t: e_ts gains exp(g_{s+1}) at each step down
        if (s < t)
          for (int64_t c = 0; c < dk; ++c) decay[c] *= gate(h, s + 1, c);
        add(s);
      }
      std::fill(decay.begin(), decay.end(), 1.0);
      for (int64_t s = t + 1; s < n; ++s) {  // s > t: e_ts gains exp(g_s)
        for (int64_t c = 0; c < dk; ++c) decay[c] *= gate(h, s, c);
        add(s);
      }
    }
  return out;
}

}  // namespace reference
}  // namespace linattn
