// The methods `linattn demo` and `linattn bench` measure: every registered method
// (include/linattn/registry.h), causal and not where it has both, at its size knob. The CLI
// only loops over this list.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "linattn/registry.h"
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
  std::string name;  // "favor+ m=256 (causal)"
  const MethodInfo* info = nullptr;
  bool causal = false;
  int64_t size = 0;  // the method's size knob (info->size_name), 0 when it has none
  std::function<double(const Problem&)> forward_flops;
  std::function<double(const Problem&)> backward_flops;  // the backward alone
  std::function<Tensor<float>(const Inputs&)> forward;   // returns the output
  std::function<void(const Inputs&)> forward_backward;   // forward, then backward from its saves
  // Largest |out − own float64 reference| / max|reference| over sampled rows (the method's
  // own definition, not softmax): how exactly the kernel computes what it claims.
  std::function<double(const Inputs&, const Tensor<float>&, int64_t sample_rows)> own_error;
  // Writes the method's extra tensors (random features, projections) as raw float32 into `dir`
  // as <name>_<tensor>_<size>.f32, for the PyTorch comparison to use the same ones.
  std::function<void(const Problem&, const std::string& dir)> write_parameters;
};

// Sizes by the registry's size names ("num_features", "num_landmarks", "s_proj"); a method
// missing here runs at its default size.
using MethodSizes = std::map<std::string, int64_t>;
std::vector<Method> all_methods(const MethodSizes& sizes = {});

// Largest |out − exact| / max|exact| over `sample_rows` evenly spaced query rows of every
// (batch, head), the exact rows computed by the float64 reference.
double error_vs_exact(const Method& m, const Inputs& in, const Tensor<float>& out,
                      int64_t sample_rows);

}  // namespace linattn::bench
