// hybrid_attention in the method registry.
#include "linattn/core/method_support.h"
#include "linattn/hybrid.h"
#include "linattn/hybrid/args.h"

namespace linattn {
namespace {

using namespace registry_support;

template <class T>
MethodOutput<T> forward(const MethodArgs<T>& a) {
  const auto c = hybrid::call_from(a);
  return {hybrid_attention<T>(a.q, a.k, a.v, c.in, c.opts), {}};
}

template <class T>
AttentionGrads<T> backward(const MethodArgs<T>& a, TensorView<const T> dout,
                           const std::map<std::string, TensorView<const T>, std::less<>>&) {
  const auto c = hybrid::call_from(a);
  return hybrid_attention_backward<T>(a.q, a.k, a.v, dout, c.in, c.opts);
}

}  // namespace

MethodInfo describe_hybrid() {
  const HybridAttentionOptions defaults;
  MethodInfo m;
  m.name = "hybrid";
  m.function = "hybrid_attention";
  m.label = "window+linear";
  m.summary = "sliding-window + linear hybrid: exact softmax over a window of keys, a feature map beyond it, one "
              "normaliser; O(n·(w + m')·d)";
  m.docs = "docs/methods/hybrid.md";
  m.options = {
      tensor_input("query_features", false, true,
                   "[batch, heads, n_q, m'] features of the queries, each >= 0 (feature_map='given')"),
      tensor_input("key_features", false, true, "[batch, heads, n_k, m'] features of the keys (feature_map='given')"),
      tensor_input("window_gate", false, true, "[heads]: the window term is scaled by sigmoid(window_gate); None: 1"),
      int_option("window", defaults.window,
                 "causal: the last `window` keys (the query's own included); not causal: |i - j| <= window; 0: none"),
      string_option("feature_map", defaults.feature_map, {"elu", "relu", "given"},
                    "the linear part's map: elu (elu(x)+1) or relu of q and k, or given (query_features, key_features)"),
      causal_option(""),
      key_lengths_option(),
      scale_option("of the window's softmax logits; None: 1/sqrt(head_dim)"),
      float_option("eps", defaults.eps, "added to every denominator (finite, >= 0)"),
  };
  // The tests run sequences longer than a whole non-causal window of the default size, so every
  // part (prefix, window, suffix) is exercised.
  m.block_rows = 2 * defaults.window + 1;
  // Per query: the window's scores and weighted values, 2·W·(d + d_v) (W keys: w causal, 2w+1
  // not), and the linear state's product, 2·m'·(d_v + 1); per key its rank-one update, the same
  // (twice not causal: prefix and suffix). The backward: about 2.5 times that.
  m.flops = [](const AttentionShape& s, const MethodArgs<float>& a, bool backward) {
    const auto c = hybrid::call_from(a);
    const double W = static_cast<double>(c.opts.causal ? c.opts.window : 2 * c.opts.window + 1);
    const auto f = a.tensors.find("query_features");
    const double mf = f != a.tensors.end() ? static_cast<double>(f->second.dim(3)) : static_cast<double>(s.head_dim);
    const double sweeps = c.opts.causal ? 1 : 2;
    const double fwd = (2.0 * s.n_q * std::min<double>(W, s.n_k) * (s.head_dim + s.value_dim) +
                        sweeps * 2.0 * (s.n_q + s.n_k) * mf * (s.value_dim + 1)) * s.bh();
    return backward ? 2.5 * fwd : fwd;
  };
  m.f32 = LINATTN_METHOD_FUNCTIONS(float, forward, backward, no_example_tensors);
  m.f64 = LINATTN_METHOD_FUNCTIONS(double, forward, backward, no_example_tensors);
  return m;
}

}  // namespace linattn
