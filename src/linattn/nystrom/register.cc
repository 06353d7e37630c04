// nystrom_attention in the method registry.
#include "linattn/core/method_support.h"
#include "linattn/nystrom.h"
#include "linattn/nystrom/args.h"
#include "linattn/nystrom/internal.h"

namespace linattn {
namespace {

using namespace registry_support;

template <class T>
MethodOutput<T> forward(const MethodArgs<T>& a) {
  const auto c = nystrom::call_from(a);
  return {nystrom_attention<T>(a.q, a.k, a.v, c.opts, c.conv_weight), {}};
}

template <class T>
AttentionGrads<T> backward(const MethodArgs<T>& a, TensorView<const T> dout,
                           const std::map<std::string, TensorView<const T>, std::less<>>&) {
  const auto c = nystrom::call_from(a);
  return nystrom_attention_backward<T>(a.q, a.k, a.v, dout, c.opts, c.conv_weight);
}

}  // namespace

MethodInfo describe_nystrom() {
  const NystromOptions defaults;
  MethodInfo m;
  m.name = "nystrom";
  m.function = "nystrom_attention";
  m.label = "nystrom";
  m.summary = "Nyströmformer: softmax attention through segment-mean landmarks and an iterative pseudo-inverse, O(n·m)";
  m.docs = "docs/methods/nystrom.md";
  m.no_causal = "Nyström landmarks are means over segments of the whole sequence, so every output would see future positions";
  m.options = {
      int_option("num_landmarks", defaults.num_landmarks, "landmarks m (>= 1); a sequence of n < m positions uses n"),
      int_option("pinv_iterations", defaults.pinv_iterations, "steps of the iterative pseudo-inverse (>= 0)"),
      string_option("pinv", defaults.pinv, {"iterative", "exact"}, "iterative (Newton–Schulz-type) or exact (SVD by LAPACK)"),
      tensor_input("conv_weight", false, true, "[heads, K], K odd: adds a depthwise convolution of v"),
      key_lengths_option(),
      scale_option(),
      causal_option(m.no_causal),
  };
  m.size_name = "num_landmarks";
  m.size_symbol = "m";
  m.default_size = defaults.num_landmarks;
  m.block_rows = nystrom::kRowBlock;
  // Per head, with m landmarks and T pinv iterations: softmax(QK̃ᵀ)·Y and softmax(Q̃Kᵀ)·V
  // (2·n·m·(d + d_v) each), the m×m kernel and Y = Z·W (2m²(d + d_v)), four m×m products
  // (2m³ each) per iteration. Backward (backward.cc): n·m·(12d + 10d_v), 22 m×m products per
  // iteration, 8m²(d + d_v).
  m.flops = [](const AttentionShape& s, const MethodArgs<float>& a, bool backward) {
    const NystromOptions o = nystrom::call_from(a).opts;
    const double n = static_cast<double>(s.n_q), mm = static_cast<double>(std::min(o.num_landmarks, s.n_q));
    const double d = static_cast<double>(s.head_dim), dv = static_cast<double>(s.value_dim);
    const double T = static_cast<double>(o.pinv_iterations);
    const double f = backward ? n * mm * (12 * d + 10 * dv) + 8 * mm * mm * (d + dv) + 22 * T * mm * mm * mm
                              : 4 * n * mm * (d + dv) + 2 * mm * mm * (d + dv) + 8 * T * mm * mm * mm;
    return f * s.bh();
  };
  m.f32 = LINATTN_METHOD_FUNCTIONS(float, forward, backward, no_example_tensors);
  m.f64 = LINATTN_METHOD_FUNCTIONS(double, forward, backward, no_example_tensors);
  return m;
}

}  // namespace linattn
