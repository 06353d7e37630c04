#include "linattn/registry.h"

#include "linattn/core/error.h"
#include "linattn/core/method_support.h"

namespace linattn {

#define LINATTN_METHOD(id) MethodInfo describe_##id();
#include "linattn/methods.def"
#undef LINATTN_METHOD

namespace {

using registry_support::WidenedArgs;

template <class Low>
std::vector<std::pair<std::string, Tensor<Low>>> narrow_all(std::vector<std::pair<std::string, Tensor<float>>>&& ts,
                                                             const std::string& fn) {
  std::vector<std::pair<std::string, Tensor<Low>>> out;
  for (auto& [name, t] : ts) out.emplace_back(name, narrow<Low>(t, (fn + ": " + name).c_str()));
  return out;
}

// The bfloat16/float16 functions of a method, from its float32 ones.
// Errors name the function and the tensor: "softmax_attention_backward: dv has a value ...".
template <class Low>
MethodFunctions<Low> widening(const MethodFunctions<float>& f32, const std::string& function) {
  MethodFunctions<Low> f;
  f.forward = [forward = f32.forward, function](const MethodArgs<Low>& a) {
    const WidenedArgs<Low> w(a);
    MethodOutput<float> r = forward(w.args);
    return MethodOutput<Low>{narrow<Low>(r.out, (function + ": out").c_str()), std::move(r.saved)};
  };
  f.backward = [backward = f32.backward, fn = function + "_backward"](const MethodArgs<Low>& a, TensorView<const Low> dout,
                                                                   const SavedViews<Low>& saved) {
    WidenedArgs<Low> w(a);
    const TensorView<const float> dout32 = w.keep(dout);
    Tensor<float> out32;
    return registry_support::narrow_grads<Low>(backward(w.args, dout32, with_float_out(fn.c_str(), saved, out32)), fn);
  };
  if (f32.example_tensors)
    f.example_tensors = [example = f32.example_tensors, function](int64_t heads, int64_t head_dim, int64_t n_k,
                                                                  int64_t size, uint64_t seed) {
      return narrow_all<Low>(example(heads, head_dim, n_k, size, seed), function);
    };
  return f;
}

MethodInfo with_low_precision(MethodInfo m) {
  m.bf16 = widening<bfloat16>(m.f32, m.function);
  if (m.bf16_kernel)
    m.bf16.forward = [kernel = m.bf16_kernel, widened = m.bf16.forward](const MethodArgs<bfloat16>& a) {
      if (std::optional<MethodOutput<bfloat16>> r = kernel(a)) return std::move(*r);
      return widened(a);
    };
  if (m.bf16_backward_kernel)
    m.bf16.backward = [kernel = m.bf16_backward_kernel, widened = m.bf16.backward](
                          const MethodArgs<bfloat16>& a, TensorView<const bfloat16> dout, const SavedViews<bfloat16>& saved) {
      if (std::optional<AttentionGrads<bfloat16>> r = kernel(a, dout, saved)) return std::move(*r);
      return widened(a, dout, saved);
    };
  m.f16 = widening<float16>(m.f32, m.function);
  return m;
}

}  // namespace

const std::vector<MethodInfo>& methods() {
  static const std::vector<MethodInfo> all = {
#define LINATTN_METHOD(id) with_low_precision(describe_##id()),
#include "linattn/methods.def"
#undef LINATTN_METHOD
  };
  return all;
}

const MethodInfo& method(std::string_view name) {
  std::string known;
  for (const MethodInfo& m : methods()) {
    if (m.name == name) return m;
    known += (known.empty() ? "" : ", ") + m.name;
  }
  fail("no method named \"", name, "\"; the methods are ", known);
}

const OptionInfo* MethodInfo::option(std::string_view option_name) const {
  for (const OptionInfo& o : options)
    if (o.name == option_name) return &o;
  return nullptr;
}

}  // namespace linattn
