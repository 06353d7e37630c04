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

}  // namespace linattn
