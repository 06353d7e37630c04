// hybrid_attention in the method registry.
#include "linattn/core/feature_map.h"
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

// The plain maps and FAVOR's.
std::vector<std::string> hybrid_feature_maps() {
  std::vector<std::string> names = plain_feature_map_names();
  names.emplace_back("favor");
  return names;
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
      tensor_input("log_decay", false, false,
                   "[heads] λ_h <= 0 (causal only; not differentiated): the linear part's key j weighed by "
                   "e^{λ_h (i - j)} in row i; None: no decay"),
      int_option("sinks", defaults.sinks,
                 "causal only: the first `sinks` keys are in every query's exact part (attention sinks); 0: none"),
      tensor_input("projection", false, false,
                   "ω [num_features, head_dim] from random_features (feature_map='favor'; not differentiated)"),
      string_option("feature_map", defaults.feature_map, hybrid_feature_maps(),
                    "the linear part's map: " + fixed_feature_maps_help() + " of q and k, given (query_features, key_features), or favor (FAVOR+'s random "
                    "features with projection: the window's weights are then e^{s}, unshifted)"),
      float_option("focus_power", defaults.focus_power, "feature_map='focused': p of the focused map (1 to 1000)"),
      string_option("kernel", defaults.kernel, {"positive", "hyperbolic"},
                    "feature_map='favor': positive (exp(ω·x − ‖x‖²/2)) or hyperbolic (±ω, 2·num_features features)"),
      causal_option(""),
      key_lengths_option(),
      scale_option("of the window's softmax logits (and FAVOR's: x̃ = √scale·x); None: 1/sqrt(head_dim)"),
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
    const double W = static_cast<double>(c.opts.causal ? c.opts.window + c.opts.sinks : 2 * c.opts.window + 1);
    const auto f = a.tensors.find("query_features");
    const auto w = a.tensors.find("projection");
    const double mf = f != a.tensors.end()   ? static_cast<double>(f->second.dim(3))
                      : w != a.tensors.end() ? static_cast<double>(w->second.dim(0)) * (c.opts.kernel == "positive" ? 1 : 2)
                                             : static_cast<double>(s.head_dim);
    const double sweeps = c.opts.causal ? 1 : 2;
    // FAVOR: the logits of q and k, 2·(n_q + n_k)·m·d.
    const double logits = w != a.tensors.end() ? 2.0 * (s.n_q + s.n_k) * static_cast<double>(w->second.dim(0)) * s.head_dim : 0;
    const double fwd = (2.0 * s.n_q * std::min<double>(W, s.n_k) * (s.head_dim + s.value_dim) +
                        sweeps * 2.0 * (s.n_q + s.n_k) * mf * (s.value_dim + 1) + logits) * s.bh();
    return backward ? 2.5 * fwd : fwd;
  };
  m.f32 = LINATTN_METHOD_FUNCTIONS(float, forward, backward, no_example_tensors);
  m.f64 = LINATTN_METHOD_FUNCTIONS(double, forward, backward, no_example_tensors);
  return m;
}

}  // namespace linattn
