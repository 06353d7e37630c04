// The peers' column of `linattn bench`: the same inputs (and the same random features and
// projections) through what a PyTorch user would otherwise call — torch's
// scaled_dot_product_attention, performer-pytorch, nystrom-attention, linformer and each method's
// plain-PyTorch formula — run by bench/torch_bench.py with the venv's Python. One helper process
// per sequence length.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "methods.h"

namespace linattn::bench {

struct PeerResult {
  std::string peer;    // "torch sdpa", "performer-pytorch", "torch plain", ...
  std::string status;  // ok, skipped (would not fit), unavailable (cannot import), failed
  double median_s = 0;
  int runs = 0;
  int64_t rss_growth_bytes = -1;
  std::string note;
};

// Whether `python` can import torch: its torch.__version__, or (version empty) why not. One
// interpreter start, which imports torch (seconds).
struct TorchCheck {
  std::string version, why_not;
};
TorchCheck check_torch(const std::string& python);

// Each method's peers, in bench/torch_bench.py's order, keyed by (method name, pass "fwd" or
// "fwd+bwd").
std::map<std::pair<std::string, std::string>, std::vector<PeerResult>> run_peers(
    const Problem& p, const Inputs& in, const std::vector<const Method*>& methods,
    bool forward_only, int threads, const std::string& python, const std::string& script);

}  // namespace linattn::bench
