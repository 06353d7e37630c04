// `linattn accuracy`: how far each method lands from exact softmax attention, in float64 so that
// only the approximation is measured, over seeds; the random-feature kernel study; and the rank
// and concentration of each method's attention matrix. Writes CSV files into a folder.
#pragma once

#include <cstdint>
#include <string>

namespace linattn::bench {

struct AccuracyOptions {
  int seeds = 5;
  int64_t heads = 4, head_dim = 64, n = 1024;
  std::string out_dir = "out/accuracy";
};

// Writes accuracy_size.csv, accuracy_scale.csv, accuracy_n.csv, kernel_mse.csv and rank.csv into
// opts.out_dir, printing a progress line and a short summary.
void run_accuracy(const AccuracyOptions& opts);

}  // namespace linattn::bench
