// efficient_attention in the method registry.
#include "linattn/core/method_support.h"
#include "linattn/efficient.h"
#include "linattn/efficient/args.h"
#include "linattn/efficient/internal.h"

namespace linattn {
namespace {

using namespace registry_support;

template <class T>
MethodOutput<T> forward(const MethodArgs<T>& a) {
  return {efficient_attention<T>(a.q, a.k, a.v, efficient::options_from(a)), {}};
}

template <class T>
AttentionGrads<T> backward(const MethodArgs<T>& a, TensorView<const T> dout,
                           const std::map<std::string, TensorView<const T>, std::less<>>&) {
  return efficient_attention_backward<T>(a.q, a.k, a.v, dout, efficient::options_from(a));
}

}  // namespace

MethodInfo describe_efficient() {
  MethodInfo m;
  m.name = "efficient";
  m.function = "efficient_attention";
  m.label = "efficient attention";
  m.summary = "Efficient Attention: softmax over features of q times (softmax over positions of k)ᵀv, O(n·d·d_v)";
  m.docs = "docs/methods/efficient.md";
  m.no_causal = "Efficient Attention normalises keys over all positions, so every output would see future positions";
  m.options = {key_lengths_option(), scale_option(), causal_option(m.no_causal)};
  m.block_rows = efficient::kRowBlock;
  // Per head: G = ρ_kᵀV and ρ_q·G, 2·n·d·d_v each; backward (efficient.cc): five such products.
  m.flops = [](const AttentionShape& s, const MethodArgs<float>&, bool backward) {
    return (backward ? 10.0 : 4.0) * s.n_q * s.head_dim * s.value_dim * s.bh();
  };
  m.f32 = LINATTN_METHOD_FUNCTIONS(float, forward, backward, no_example_tensors);
  m.f64 = LINATTN_METHOD_FUNCTIONS(double, forward, backward, no_example_tensors);
  return m;
}

}  // namespace linattn
