// The float64 definition of the causal depthwise convolution (include/linattn/conv1d.h).
#pragma once

#include <cstdint>
#include <vector>

namespace linattn {
namespace reference {

struct CausalConv1dOutputs {
  std::vector<double> out;    // [B, C, T]
  std::vector<double> state;  // [B, C, W−1]
};

// x [B, C, T], weight [C, W], bias [C] or null, initial_state [B, C, W−1] or null.
CausalConv1dOutputs causal_conv1d(const double* x, const double* weight, const double* bias,
                                  const double* initial_state, int64_t batch, int64_t channels, int64_t n,
                                  int64_t width, bool silu);

}  // namespace reference
}  // namespace linattn
