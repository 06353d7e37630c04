// Exact softmax attention in the method registry.
#include "linattn/core/avx512_bf16.h"
#include "linattn/core/method_support.h"
#include "linattn/softmax.h"
#include "linattn/softmax/args.h"
#include "linattn/softmax/forward_internal.h"

namespace linattn {
namespace {

using namespace registry_support;

template <class T>
MethodOutput<T> forward(const MethodArgs<T>& a) {
  const AttentionOptions o = softmax_detail::options_from(a);
  SoftmaxAttentionResult<T> r = softmax_attention<T>(a.q, a.k, a.v, o);
  MethodOutput<T> out{std::move(r.out), {}};
  out.saved.emplace_back("lse", std::move(r.lse));
  return out;
}

template <class T>
AttentionGrads<T> backward(const MethodArgs<T>& a, TensorView<const T> dout,
                           const std::map<std::string, TensorView<const T>, std::less<>>& saved) {
  const AttentionOptions o = softmax_detail::options_from(a);
  if (const auto s = saved_tensors<T, 2>("softmax_attention_backward", saved, {"out", "lse"}))
    return softmax_attention_backward<T>(a.q, a.k, a.v, dout, (*s)[0], (*s)[1], o);
  return softmax_attention_backward<T>(a.q, a.k, a.v, dout, o);
}

// bfloat16 products on AMX tiles or AVX512-BF16 where this CPU has them and the call is in
// their range (forward_bf16.cc); nothing otherwise, and the registry runs the widened float32
// forward.
std::optional<MethodOutput<bfloat16>> forward_bf16(const MethodArgs<bfloat16>& a) {
  const std::optional<softmax_detail::Bf16Engine> engine = softmax_detail::bf16_engine();
  if (!engine) return std::nullopt;
  const char* fn = "softmax_attention";
  const AttentionOptions o = softmax_detail::options_from(a);
  const AttentionDims d = check_attention_args(fn, a.q, a.k, a.v, o);
  const double scale = resolve_scale(fn, o, d.head_dim);
  if (!softmax_detail::bf16_tiles_usable(d, scale, *engine)) return std::nullopt;
  softmax_detail::Bf16TilesResult r = softmax_detail::forward_bf16_tiles(a.q, a.k, a.v, d, o, scale, *engine);
  MethodOutput<bfloat16> out{std::move(r.out), {}};
  out.saved.emplace_back("lse", std::move(r.lse));
  return out;
}

// The backward with bfloat16 products on AVX512-BF16 where the CPU has it and the call is in its
// range (backward_bf16.cc), from the saved out and lse or from the bfloat16 forward run again;
// nothing otherwise, and the registry runs the widened float32 backward.
std::optional<AttentionGrads<bfloat16>> backward_bf16(const MethodArgs<bfloat16>& a, TensorView<const bfloat16> dout,
                                                      const SavedViews<bfloat16>& saved) {
  if (!avx512_bf16::usable()) return std::nullopt;
  const char* fn = "softmax_attention_backward";
  const AttentionOptions o = softmax_detail::options_from(a);
  const AttentionDims d = check_attention_args(fn, a.q, a.k, a.v, o);
  const double scale = resolve_scale(fn, o, d.head_dim);
  const double dout_max = check_same_shape_finite(fn, "dout", dout, {d.batch, d.heads, d.n_q, d.value_dim});
  if (!softmax_detail::bf16_backward_usable(d, scale, dout_max)) return std::nullopt;
  AttentionGrads<float> g;
  Tensor<float> out32;  // D_i = rowsum(dout∘out) reads out in float32
  if (const auto s = saved_tensors<float, 2>(fn, with_float_out(fn, saved, out32), {"out", "lse"})) {
    softmax_detail::check_saved(fn, (*s)[0], (*s)[1], d);
    g = softmax_detail::backward_bf16_products(a.q, a.k, a.v, dout, (*s)[0], (*s)[1], d, o, scale);
  } else {
    // bf16_backward_usable implies that the best forward engine takes the call.
    const softmax_detail::Bf16TilesResult f =
        softmax_detail::forward_bf16_tiles(a.q, a.k, a.v, d, o, scale, *softmax_detail::bf16_engine());
    const Tensor<float> out = widen(f.out.view());
    g = softmax_detail::backward_bf16_products(a.q, a.k, a.v, dout, out, f.lse, d, o, scale);
  }
  return AttentionGrads<bfloat16>{narrow<bfloat16>(g.dq, "softmax_attention_backward: dq"),
                                  narrow<bfloat16>(g.dk, "softmax_attention_backward: dk"),
                                  narrow<bfloat16>(g.dv, "softmax_attention_backward: dv"), {}};
}

}  // namespace

MethodInfo describe_softmax() {
  MethodInfo m;
  m.name = "softmax";
  m.function = "softmax_attention";
  m.label = "exact softmax";
  m.summary = "exact attention softmax(q·kᵀ·scale)·v, tiled with an online softmax: O(n·d) memory";
  m.docs = "docs/methods/softmax.md";
  m.exact = true;
  m.options = {causal_option(""), scale_option(), key_lengths_option()};
  m.saved = {"lse"};
  m.saved_dims = {{"batch", "heads", "n_q"}};
  m.block_rows = std::max(softmax_detail::kForwardBlockK, softmax_detail::kBackwardBlockK);
  // Per visible (query, key) pair: forward q·k and p·v, 2(d + d_v); backward S again, dP, dV,
  // dK, dQ, 6d + 4d_v. 2 FLOPs per multiply-add.
  m.flops = [](const AttentionShape& s, const MethodArgs<float>& a, bool backward) {
    const auto c = a.options.find("causal");
    const bool causal = c != a.options.end() && std::get<bool>(c->second);
    const double pairs = causal ? 0.5 * s.n_q * (s.n_q + 1.0) : 1.0 * s.n_q * s.n_k;
    const double d = static_cast<double>(s.head_dim), dv = static_cast<double>(s.value_dim);
    return (backward ? 6 * d + 4 * dv : 2 * (d + dv)) * pairs * s.bh();
  };
  m.f32 = LINATTN_METHOD_FUNCTIONS(float, forward, backward, no_example_tensors);
  m.f64 = LINATTN_METHOD_FUNCTIONS(double, forward, backward, no_example_tensors);
  m.bf16_kernel = forward_bf16;
  m.bf16_backward_kernel = backward_bf16;
  return m;
}

}  // namespace linattn
