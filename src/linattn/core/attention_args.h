// What every attention function takes besides its tensors (options, masks), and the checks
// run on all of it at the API boundary.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/attention.h"
#include "linattn/core/error.h"
#include "linattn/tensor.h"

namespace linattn {

// Sizes of one attention call: q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v], and the largest
// |value| of each at the positions that matter (filled by check_attention_args, which reads
// every such value anyway; methods use them to keep their sums inside the dtype's range).
struct AttentionDims : AttentionShape {
  double q_max = 0, k_max = 0, v_max = 0;
};

// Which keys query row i of batch item b sees. Every mask we support keeps a prefix of the
// keys, so one number per row says it all: keys [0, visible(b, i)).
class KeyMask {
 public:
  KeyMask(const AttentionShape& dims, const AttentionOptions& opts)
      : causal_(opts.causal), offset_(dims.n_k - dims.n_q), n_k_(dims.n_k) {
    if (opts.key_lengths) lengths_ = *opts.key_lengths;
  }
  int64_t key_length(int64_t b) const { return lengths_.empty() ? n_k_ : lengths_[b]; }
  int64_t visible(int64_t b, int64_t i) const {
    int64_t end = key_length(b);
    if (causal_) end = std::min(end, i + offset_ + 1);
    return std::max<int64_t>(end, 0);
  }
  bool causal() const { return causal_; }

 private:
  bool causal_;
  int64_t offset_, n_k_;
  std::vector<int64_t> lengths_;
};

// Checks ranks, dtypes-by-construction, matching sizes, key_lengths and finiteness of what
// the output depends on (all of q; k and v at unpadded positions). `fn` names the caller in
// messages. Returns the sizes.
template <class T>
AttentionDims check_attention_args(const char* fn, TensorView<const T> q, TensorView<const T> k,
                                   TensorView<const T> v, const AttentionOptions& opts);

// The scale to use: opts.scale if set (must be finite), else 1/sqrt(head_dim).
double resolve_scale(const char* fn, const AttentionOptions& opts, int64_t head_dim);

// Checks that every value of x (any rank, contiguous) is finite, naming the first bad flat
// index; returns its largest |value|.
template <class T>
double check_finite(const char* fn, const char* name, TensorView<const T> x);

// The common start of every method without a causal form: opts.causal must be false, else
// an error "causal=true is not supported: <why>"; then q, k, v and key_lengths as
// check_attention_args checks them, and the scale.
struct NonCausalArgs {
  AttentionDims d;
  AttentionOptions mask_opts;  // key_lengths and scale; causal false
  double scale;
};
template <class T>
NonCausalArgs check_noncausal_args(const char* fn, TensorView<const T> q, TensorView<const T> k,
                                   TensorView<const T> v, const AttentionOptions& opts, const char* why);

// Error "<fn>: <name> has shape [...]; expected [...]" unless x has exactly `expected` shape.
template <class T>
void check_shape(const char* fn, const char* name, TensorView<const T> x, const Shape& expected) {
  // Not require(): its arguments, the shape strings, would be made on every call.
  if (x.shape != expected)
    fail(fn, ": ", name, " has shape ", shape_string(x.shape), "; expected ", shape_string(expected));
}

// After a computation whose inputs were all found finite and whose result was not: the error
// saying the dtype's range was exceeded.
template <class T>
[[noreturn]] void fail_overflow(const char* fn) {
  fail(fn, ": a result overflows ", dtype_name<T>(),
       ": the inputs are finite but their products exceed its range; scale them down or use float64");
}

// Checks a tensor that must have exactly `expected` shape and finite values; returns its
// largest |value|.
template <class T>
double check_same_shape_finite(const char* fn, const char* name, TensorView<const T> x,
                             const Shape& expected);

}  // namespace linattn
