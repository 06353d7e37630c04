#include "linattn/conv1d/reference.h"

#include <cmath>

namespace linattn {
namespace reference {

CausalConv1dOutputs causal_conv1d(const double* x, const double* weight, const double* bias,
                                  const double* initial_state, int64_t batch, int64_t channels, int64_t n,
                                  int64_t width, bool silu) {
  const int64_t tail = width - 1;
  CausalConv1dOutputs r{std::vector<double>(static_cast<size_t>(batch * channels * n)),
                        std::vector<double>(static_cast<size_t>(batch * channels * tail))};
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < channels; ++c) {
      const int64_t task = b * channels + c;
      // x̃: the initial state (or zeros), then x
      std::vector<double> ext(static_cast<size_t>(tail + n));
      for (int64_t i = 0; i < tail; ++i) ext[i] = initial_state ? initial_state[task * tail + i] : 0.0;
      for (int64_t t = 0; t < n; ++t) ext[tail + t] = x[task * n + t];
      for (int64_t t = 0; t < n; ++t) {
        double z = bias ? bias[c] : 0.0;
        for (int64_t j = 0; j < width; ++j) z += weight[c * width + j] * ext[t + j];
        r.out[task * n + t] = silu ? z / (1.0 + std::exp(-z)) : z;
      }
      for (int64_t i = 0; i < tail; ++i) r.state[task * tail + i] = ext[n + i];
    }
  return r;
}

}  // namespace reference
}  // namespace linattn
