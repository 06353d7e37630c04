// The methods `linattn demo` and `linattn bench` measure, each with its FLOP count.
// A method folder adds itself here; the CLI only loops over this list.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "linattn/tensor.h"

namespace linattn::bench {

struct Problem {
  int64_t batch = 1, heads = 8, n = 4096, head_dim = 64;
  uint64_t seed = 1;
};

struct Inputs {
  Tensor<float> q, k, v, dout;  // [B,H,n,d], standard normal
};
Inputs make_inputs(const Problem& p);

struct Method {
  std::string name;
  bool causal = false;
  std::function<double(const Problem&)> forward_flops;
  std::function<double(const Problem&)> backward_flops;  // the backward alone
  std::function<Tensor<float>(const Inputs&)> forward;   // returns the output
  std::function<void(const Inputs&)> forward_backward;   // forward, then backward from its saves
  // Largest |out − own float64 reference| / max|reference| over sampled rows (the method's
  // own definition, not softmax): how exactly the kernel computes what it claims.
  std::function<double(const Inputs&, const Tensor<float>&, int64_t sample_rows)> own_error;
  // Writes the method's parameters (random features, projections) as raw float32 into `dir`,
  // for the PyTorch comparison to use the same ones; empty when it has none.
  std::function<void(const Problem&, const std::string& dir)> write_parameters;
};

// Sizes of the approximations: FAVOR+ random features m, Nyström landmarks, Linformer s_proj.
struct MethodSizes {
  int64_t favor_features = 256, landmarks = 64, linformer_proj = 256;
};
std::vector<Method> all_methods(const MethodSizes& sizes = {});

// Largest |out − exact| / max|exact| over `sample_rows` evenly spaced query rows of every
// (batch, head), the exact rows computed by the float64 reference.
double error_vs_exact(const Method& m, const Inputs& in, const Tensor<float>& out,
                      int64_t sample_rows);

}  // namespace linattn::bench
