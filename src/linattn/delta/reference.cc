#include "linattn/delta/reference.h"

#include <cmath>

namespace linattn {
namespace reference {

DeltaRuleOutputs gated_delta_rule(const double* q, const double* k, const double* v, const double* g,
                                  const double* beta, const double* initial_state, int64_t batch, int64_t heads,
                                  int64_t key_heads, int64_t n, int64_t dk, int64_t dv, bool per_channel,
                                  double scale, bool l2norm) {
  DeltaRuleOutputs r{std::vector<double>(static_cast<size_t>(batch * heads * n * dv)),
                     std::vector<double>(static_cast<size_t>(batch * heads * dk * dv))};
  const int64_t group = heads / key_heads, w = per_channel ? dk : 1;
  std::vector<double> qt(dk), kt(dk), read(dv);
  auto normalised = [&](const double* x, std::vector<double>& y) {
    double sq = 0;
    for (int64_t c = 0; c < dk; ++c) sq += x[c] * x[c];
    const double f = l2norm ? 1.0 / std::sqrt(sq + 1e-6) : 1.0;
    for (int64_t c = 0; c < dk; ++c) y[c] = x[c] * f;
  };
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t task = b * heads + h, key_task = b * key_heads + h / group;
      double* S = r.state.data() + task * dk * dv;
      for (int64_t i = 0; i < dk * dv; ++i) S[i] = initial_state ? initial_state[task * dk * dv + i] : 0.0;
      for (int64_t t = 0; t < n; ++t) {
        normalised(q + (key_task * n + t) * dk, qt);
        normalised(k + (key_task * n + t) * dk, kt);
        const double* gt = g + (task * n + t) * w;
        const double bt = beta[task * n + t];
        const double* vt = v + (task * n + t) * dv;
        for (int64_t c = 0; c < dk; ++c)  // S ← diag(exp(g_t))·S
          for (int64_t e = 0; e < dv; ++e) S[c * dv + e] *= std::exp(gt[per_channel ? c : 0]);
        for (int64_t e = 0; e < dv; ++e) {  // u = β (v − Sᵀ k)
          double dot = 0;
          for (int64_t c = 0; c < dk; ++c) dot += S[c * dv + e] * kt[c];
          read[e] = bt * (vt[e] - dot);
        }
        for (int64_t c = 0; c < dk; ++c)  // S ← S + k uᵀ
          for (int64_t e = 0; e < dv; ++e) S[c * dv + e] += kt[c] * read[e];
        double* ot = r.out.data() + (task * n + t) * dv;
        for (int64_t e = 0; e < dv; ++e) {
          double dot = 0;
          for (int64_t c = 0; c < dk; ++c) dot += S[c * dv + e] * qt[c];
          ot[e] = scale * dot;
        }
      }
    }
  return r;
}

}  // namespace reference
}  // namespace linattn
