// linattn: attention whose cost grows linearly with sequence length, and exact attention.
// Shapes are [batch, heads, seq, head_dim], row-major, float32 or float64.
#pragma once

#include "linattn/attention.h"
#include "linattn/efficient.h"
#include "linattn/hybrid.h"
#include "linattn/error.h"
#include "linattn/kernelized.h"
#include "linattn/linformer.h"
#include "linattn/low_precision.h"
#include "linattn/memory.h"
#include "linattn/nystrom.h"
#include "linattn/random_features.h"
#include "linattn/registry.h"
#include "linattn/softmax.h"
#include "linattn/tensor.h"
#include "linattn/threading.h"

namespace linattn {

// "0.2.0".
const char* version();
// What this build runs on: the BLAS and its kernel choice, the SIMD target, e.g.
// "OpenBLAS 0.3.34 ... (core Haswell), SIMD AVX2".
std::string build_info();

// The measured arithmetic peak of `threads` threads (1 to kMaxThreads), in GFLOP/s: register-only
// loops of float32 fused multiply-adds, and of bfloat16 dot products (vdpbf16ps; 0 where the CPU
// has no AVX512-BF16), each calibrated to about 0.2 s, the best of 3 runs, on threads of its own
// (the library's thread count is left alone). What the benchmarks' "% of peak" divides by
// (linattn bench, bench/bf16.py). Takes about 1.5 s.
struct PeakRates {
  double float32_fma_gflops = 0, bfloat16_dot_gflops = 0;
};
PeakRates measure_peak_rates(int threads);

}  // namespace linattn
