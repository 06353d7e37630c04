// The PyTorch column of `linattn bench`: the same inputs (and the same random features and
// projections) through plain-PyTorch versions of each method, run by bench/torch_bench.py in a
// Debian python3 with python3-torch. One helper process per sequence length.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "methods.h"

namespace linattn::bench {

struct TorchResult {
  std::string status;  // ok, skipped (would not fit), unavailable, failed
  double median_s = 0;
  int runs = 0;
  int64_t rss_growth_bytes = -1;
  std::string note;
};

// Empty when PyTorch can be used from `python`; else why not.
std::string torch_unavailable_reason(const std::string& python);

// Results keyed by (method name, pass "fwd" or "fwd+bwd").
std::map<std::pair<std::string, std::string>, TorchResult> run_torch(
    const Problem& p, const Inputs& in, const std::vector<const Method*>& methods,
    bool forward_only, int threads, const std::string& python, const std::string& script);

}  // namespace linattn::bench
