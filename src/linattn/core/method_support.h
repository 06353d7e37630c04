// What a method folder uses to describe itself to the registry (include/linattn/registry.h):
// option descriptions built from the options struct's own defaults (one source for both), and
// a reader that turns a generic MethodArgs into the typed options, refusing names the method
// does not take and values of the wrong kind.
#pragma once

#include <array>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "linattn/core/error.h"
#include "linattn/low_precision.h"
#include "linattn/registry.h"

namespace linattn::registry_support {

// Python's spelling of a default.
inline std::string python_literal(bool v) { return v ? "True" : "False"; }
inline std::string python_literal(int64_t v) { return std::to_string(v); }
inline std::string python_literal(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  std::string s = buf;
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}
inline std::string python_literal(const std::string& v) { return "'" + v + "'"; }

inline OptionInfo bool_option(std::string name, bool def, std::string doc) {
  return {std::move(name), OptionInfo::Kind::Bool, false, python_literal(def), std::move(doc), {}, false, false, {}, {}};
}
inline OptionInfo int_option(std::string name, int64_t def, std::string doc) {
  return {std::move(name), OptionInfo::Kind::Int, false, python_literal(def), std::move(doc), {}, false, false, {}, {}};
}
inline OptionInfo float_option(std::string name, double def, std::string doc) {
  return {std::move(name), OptionInfo::Kind::Float, false, python_literal(def), std::move(doc), {}, false, false, {}, {}};
}
inline OptionInfo string_option(std::string name, const std::string& def, std::vector<std::string> choices,
                                std::string doc) {
  return {std::move(name), OptionInfo::Kind::String, false, python_literal(def), std::move(doc),
          std::move(choices), false, false, {}, {}};
}
// A String option one of whose values was `old` before; `now` is its name now
// (OptionInfo::former_choices).
inline OptionInfo formerly_choice(std::string old, std::string now, OptionInfo option) {
  option.former_choices.emplace_back(std::move(old), std::move(now));
  return option;
}
// An option that was named `old` before (OptionInfo::formerly).
inline OptionInfo formerly(std::string old, OptionInfo option) {
  option.formerly = std::move(old);
  return option;
}

// A tensor input: positional (required) or keyword (optional, None by default).
inline OptionInfo tensor_input(std::string name, bool positional, bool has_gradient, std::string doc) {
  return {std::move(name), OptionInfo::Kind::Tensor, !positional, positional ? "" : "None",
          std::move(doc), {}, positional, has_gradient, {}, {}};
}

// The options of AttentionOptions, as every method lists them.
inline OptionInfo causal_option(const std::string& no_causal) {
  return bool_option("causal", false,
                     no_causal.empty() ? "query i sees keys j <= i + n_k - n_q"
                                       : "must be False: " + no_causal);
}
inline OptionInfo scale_option(const std::string& doc = "logit scale; None: 1/sqrt(head_dim)") {
  OptionInfo o{"scale", OptionInfo::Kind::Float, true, "None", doc, {}, false, false, {}, {}};
  return o;
}
inline OptionInfo key_lengths_option() {
  return {"key_lengths", OptionInfo::Kind::Lengths, true, "None",
          "one length per batch item; keys at positions >= key_lengths[b] are ignored", {}, false, false, {}, {}};
}

// Reads a call's options into typed fields. Every option the call names must be one the method
// lists (checked on construction), of the right kind (checked when read).
template <class T>
class ArgReader {
 public:
  ArgReader(const MethodInfo& info, const MethodArgs<T>& args) : info_(info), args_(args) {
    fn_ = info.function;
    for (const auto& [name, value] : args.options) {
      const OptionInfo* o = info.option(name);
      require(o && o->kind != OptionInfo::Kind::Tensor, fn_, ": unknown option \"", name, "\"; ",
              fn_, " takes ", names());
    }
    for (const auto& [name, view] : args.tensors) {
      const OptionInfo* o = info.option(name);
      require(o && o->kind == OptionInfo::Kind::Tensor, fn_, ": unknown tensor input \"", name, "\"; ",
              fn_, " takes ", names());
    }
  }

  void read(const char* name, bool& out) const {
    if (const OptionValue* v = find(name)) {
      require(std::holds_alternative<bool>(*v), fn_, ": ", name, " must be True or False");
      out = std::get<bool>(*v);
    }
  }
  void read(const char* name, int64_t& out) const {
    if (const OptionValue* v = find(name)) {
      require(std::holds_alternative<int64_t>(*v), fn_, ": ", name, " must be an integer");
      out = std::get<int64_t>(*v);
    }
  }
  void read(const char* name, double& out) const {
    if (const OptionValue* v = find(name)) out = number(name, *v);
  }
  void read(const char* name, std::optional<double>& out) const {
    if (const OptionValue* v = find(name)) out = number(name, *v);
  }
  void read(const char* name, std::string& out) const {
    if (const OptionValue* v = find(name)) {
      require(std::holds_alternative<std::string>(*v), fn_, ": ", name, " must be a string");
      out = std::get<std::string>(*v);
    }
  }
  void read(const char* name, std::optional<std::vector<int64_t>>& out) const {
    if (const OptionValue* v = find(name)) {
      require(std::holds_alternative<std::vector<int64_t>>(*v), fn_, ": ", name,
              " must be a sequence of integers");
      out = std::get<std::vector<int64_t>>(*v);
    }
  }
  // The options every method shares (those this method lists).
  void read_common(AttentionOptions& o) const {
    read("causal", o.causal);
    read("scale", o.scale);
    read("key_lengths", o.key_lengths);
  }
  std::optional<TensorView<const T>> tensor(const char* name) const {
    const auto it = args_.tensors.find(name);
    if (it == args_.tensors.end()) return std::nullopt;
    return it->second;
  }
  TensorView<const T> required_tensor(const char* name) const {
    const auto t = tensor(name);
    require(t.has_value(), fn_, ": the tensor input ", name, " is required");
    return *t;
  }

 private:
  const OptionValue* find(const char* name) const {
    const auto it = args_.options.find(name);
    return it == args_.options.end() ? nullptr : &it->second;
  }
  double number(const char* name, const OptionValue& v) const {
    if (std::holds_alternative<int64_t>(v)) return static_cast<double>(std::get<int64_t>(v));
    require(std::holds_alternative<double>(v), fn_, ": ", name, " must be a number");
    return std::get<double>(v);
  }
  std::string names() const {
    std::string s;
    for (const auto& o : info_.options) s += (s.empty() ? "" : ", ") + o.name;
    return s.empty() ? "no options" : s;
  }

  const MethodInfo& info_;
  const MethodArgs<T>& args_;
  std::string fn_;
};

// A backward's saved tensors (the forward's "out" and what it saved) in the order of `names`:
// all of them, or none (the backward then computes the forward again); some but not all is an
// error naming them.
template <class T, size_t N>
std::optional<std::array<TensorView<const T>, N>> saved_tensors(
    const char* fn, const std::map<std::string, TensorView<const T>, std::less<>>& saved,
    const std::array<const char*, N>& names) {
  std::array<TensorView<const T>, N> views{};
  size_t given = 0;
  std::string list;
  for (size_t i = 0; i < N; ++i) {
    const auto it = saved.find(names[i]);
    if (it != saved.end()) views[i] = it->second, ++given;
    list += (i == 0 ? "" : i + 1 == N ? " and " : ", ") + std::string(names[i]);
  }
  require(given == 0 || given == N, fn, ": pass ", list, " (from the forward), or none of them");
  if (given == 0) return std::nullopt;
  return views;
}

// The MethodFunctions of a method whose typed entry points are forward_fn<T>(args) and
// backward_fn<T>(args, dout, saved), and whose example tensors come from example_fn<T>.
#define LINATTN_METHOD_FUNCTIONS(T, forward_fn, backward_fn, example_fn)                           \
  MethodFunctions<T> {                                                                              \
    [](const MethodArgs<T>& a) { return forward_fn<T>(a); },                                       \
        [](const MethodArgs<T>& a, TensorView<const T> dout,                                        \
           const std::map<std::string, TensorView<const T>, std::less<>>& saved) {                  \
          return backward_fn<T>(a, dout, saved);                                                    \
        },                                                                                          \
        [](int64_t heads, int64_t head_dim, int64_t n_k, int64_t size, uint64_t seed) {             \
          return example_fn<T>(heads, head_dim, n_k, size, seed);                                   \
        }                                                                                           \
  }

// For methods that need no extra tensors.
template <class T>
std::vector<std::pair<std::string, Tensor<T>>> no_example_tensors(int64_t, int64_t, int64_t, int64_t,
                                                                  uint64_t) {
  return {};
}

// A bfloat16/float16 call's tensors widened to float32 (exact), and the float32 MethodArgs viewing
// them: the registry's widened functions, and methods' own 16-bit kernels that run float32 code.
template <class Low>
struct WidenedArgs {
  std::vector<Tensor<float>> storage;
  MethodArgs<float> args;

  explicit WidenedArgs(const MethodArgs<Low>& a) {
    storage.reserve(3 + a.tensors.size());
    args.q = keep(a.q), args.k = keep(a.k), args.v = keep(a.v);
    args.options = a.options;
    for (const auto& [name, t] : a.tensors) args.tensors[name] = keep(t);
  }
  TensorView<const float> keep(TensorView<const Low> t) {
    storage.push_back(widen(t));
    return storage.back().view();
  }
};

// A float32 backward's gradients rounded to a 16-bit type; errors name fn and the tensor
// ("favor_attention_backward: dv has a value ...").
template <class Low>
AttentionGrads<Low> narrow_grads(const AttentionGrads<float>& g, const std::string& fn) {
  AttentionGrads<Low> out{narrow<Low>(g.dq, (fn + ": dq").c_str()), narrow<Low>(g.dk, (fn + ": dk").c_str()),
                          narrow<Low>(g.dv, (fn + ": dv").c_str()), {}};
  for (const auto& [name, t] : g.params) out.params.emplace_back(name, narrow<Low>(t, (fn + ": d_" + name).c_str()));
  return out;
}

}  // namespace linattn::registry_support
