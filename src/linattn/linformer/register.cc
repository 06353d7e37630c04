// linformer_attention in the method registry.
#include "linattn/core/method_support.h"
#include "linattn/linformer.h"
#include "linattn/linformer/args.h"
#include "linattn/linformer/internal.h"

namespace linattn {
namespace {

using namespace registry_support;

template <class T>
MethodOutput<T> forward(const MethodArgs<T>& a) {
  const auto c = linformer::call_from(a);
  return {linformer_attention<T>(a.q, a.k, a.v, c.e, c.f, c.opts), {}};
}

template <class T>
AttentionGrads<T> backward(const MethodArgs<T>& a, TensorView<const T> dout,
                           const std::map<std::string, TensorView<const T>, std::less<>>&) {
  const auto c = linformer::call_from(a);
  return linformer_attention_backward<T>(a.q, a.k, a.v, c.e, c.f, dout, c.opts);
}

constexpr int64_t kDefaultProjection = 256;

template <class T>
std::vector<std::pair<std::string, Tensor<T>>> example(int64_t, int64_t, int64_t n_k, int64_t size, uint64_t seed) {
  auto [e, f] = linformer_projections<T>(size > 0 ? size : kDefaultProjection, std::max<int64_t>(n_k, 1), 0, seed);
  std::vector<std::pair<std::string, Tensor<T>>> t;
  t.emplace_back("e", std::move(e));
  t.emplace_back("f", std::move(f));
  return t;
}

}  // namespace

MethodInfo describe_linformer() {
  MethodInfo m;
  m.name = "linformer";
  m.function = "linformer_attention";
  m.label = "linformer";
  m.summary = "Linformer: keys and values projected along the sequence by E, F [s_proj, n_max], O(n·s)";
  m.docs = "docs/methods/linformer.md";
  m.no_causal = "Linformer projects keys and values over the whole sequence, so every output would see future positions";
  m.options = {
      tensor_input("e", true, true, "[s_proj, n_max] shared by heads, or [heads, s_proj, n_max]; n_k <= n_max"),
      tensor_input("f", true, true, "the shape of e"),
      key_lengths_option(),
      scale_option(),
      causal_option(m.no_causal),
  };
  m.size_name = "s_proj";
  m.size_symbol = std::string("s");  // a temporary: GCC 12 warns (-Wrestrict, a false positive) on assign("s") here
  m.default_size = kDefaultProjection;
  m.block_rows = std::max(linformer::kRowBlock, linformer::kColBlock);
  // Per head: K' = E·K, V' = F·V, Q·K'ᵀ and P·V': 4·n·s·(d + d_v); backward (linformer.cc):
  // n·s·(12d + 10d_v).
  m.flops = [](const AttentionShape& s, const MethodArgs<float>& a, bool backward) {
    const auto e = a.tensors.find("e");
    const double sp = e != a.tensors.end() ? static_cast<double>(e->second.dim(-2)) : kDefaultProjection;
    const double n = static_cast<double>(s.n_q), d = static_cast<double>(s.head_dim),
                 dv = static_cast<double>(s.value_dim);
    return (backward ? n * sp * (12 * d + 10 * dv) : 4 * n * sp * (d + dv)) * s.bh();
  };
  m.f32 = LINATTN_METHOD_FUNCTIONS(float, forward, backward, example);
  m.f64 = LINATTN_METHOD_FUNCTIONS(double, forward, backward, example);
  return m;
}

}  // namespace linattn
