// The methods linattn implements, each described once, by its own folder: its name, its
// options, its forward and backward (and, in the reference library, its float64 reference).
// The command-line program, the benchmarks, the accuracy study, the Python module and the tests
// take the list from here; adding a method is its folder plus one line in
// src/linattn/methods.def (docs/adding-a-method.md).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "linattn/attention.h"
#include "linattn/error.h"
#include "linattn/low_precision.h"
#include "linattn/tensor.h"

namespace linattn {

// One option's value: a flag, an integer, a number, a text, or a list of integers (key_lengths).
using OptionValue = std::variant<bool, int64_t, double, std::string, std::vector<int64_t>>;

// One input a method takes besides q, k and v.
struct OptionInfo {
  enum class Kind { Bool, Int, Float, String, Lengths, Tensor };
  std::string name;
  Kind kind = Kind::Bool;
  bool optional = false;             // may be absent / None (scale, key_lengths, conv weights)
  std::string default_value;         // as Python writes it: "False", "None", "64", "'elu'"
  std::string doc;                   // one line
  std::vector<std::string> choices;  // the accepted values of a String option
  bool positional = false;           // a Tensor passed by position after q, k, v (projection, e, f)
  bool has_gradient = false;         // a Tensor whose gradient the backward returns
  // The option's name before it took this one (linear_attention's "dwc_weight"), or empty: the
  // Python layers accept it for one release with a DeprecationWarning naming both.
  std::string formerly;
  // A String option's values as they were called before ("identity", now "given"): {old, now}.
  // C++ still takes the old value for one release, as the new; the Python layers warn.
  std::vector<std::pair<std::string, std::string>> former_choices;
};

// A call's inputs by name: options (absent ones take their defaults) and extra tensors.
template <class T>
struct MethodArgs {
  TensorView<const T> q, k, v;
  std::map<std::string, OptionValue, std::less<>> options;
  std::map<std::string, TensorView<const T>, std::less<>> tensors;
};

// What a forward returns: the output and what its backward can reuse instead of recomputing
// (softmax: "lse"), by name. Saved tensors are float32 for bfloat16/float16 calls.
template <class T>
struct MethodOutput {
  Tensor<T> out;
  std::vector<std::pair<std::string, Tensor<accumulator_t<T>>>> saved;
};

// The saved tensors a backward takes by name ("out" and MethodInfo::saved), in the accumulation
// type (float32 for bfloat16/float16 calls). A bfloat16/float16 call's "out" may come instead as
// the forward returned it, in the call's own type (out_as_returned, with no "out" in the map):
// the kernelized methods read it a block at a time, and every other backward widens it
// (with_float_out), so no caller need make a float32 copy of the whole output.
template <class T>
struct SavedViews : std::map<std::string, TensorView<const accumulator_t<T>>, std::less<>> {
  using Map = std::map<std::string, TensorView<const accumulator_t<T>>, std::less<>>;
  using Map::Map;
  SavedViews() = default;
  SavedViews(Map views) : Map(std::move(views)) {}  // a plain map of views, as before
  std::optional<TensorView<const T>> out_as_returned;
};

// Whether saved brings its out as returned; an out given both ways is an Error naming fn.
template <class T>
bool has_out_as_returned(const char* fn, const SavedViews<T>& saved) {
  if (!saved.out_as_returned) return false;
  if (saved.count("out") > 0)
    throw Error(std::string(fn) + ": out was given twice, as returned and widened; pass one of them");
  return true;
}

// saved with its out_as_returned widened into `keep` as the map's "out" (saved itself when it
// has none), as the float32 backward's saved tensors.
template <class T>
SavedViews<accumulator_t<T>> with_float_out(const char* fn, const SavedViews<T>& saved, Tensor<accumulator_t<T>>& keep) {
  SavedViews<accumulator_t<T>> s(saved.begin(), saved.end());
  if constexpr (is_low_precision_v<T>) {
    if (has_out_as_returned(fn, saved)) {
      keep = widen(*saved.out_as_returned);
      s.emplace("out", keep.view());
    }
  }
  return s;
}

template <class T>
struct MethodFunctions {
  std::function<MethodOutput<T>(const MethodArgs<T>&)> forward;
  // saved: the forward's "out" and saved tensors by name, or empty to recompute them.
  std::function<AttentionGrads<T>(const MethodArgs<T>&, TensorView<const T> dout, const SavedViews<T>& saved)>
      backward;
  // The extra tensors a call must have that a demo, benchmark or test does not bring (favor:
  // projection; linformer: e and f), for `heads` heads of head_dim and n_k keys, from a seed;
  // size: the method's size knob (size_name below), 0 for its default.
  std::function<std::vector<std::pair<std::string, Tensor<T>>>(int64_t heads, int64_t head_dim,
                                                               int64_t n_k, int64_t size, uint64_t seed)>
      example_tensors;
};

struct MethodInfo {
  std::string name;      // "favor"
  std::string function;  // "favor_attention"; the backward is function + "_backward"
  std::string label;     // in tables: "favor+" (then " m=256" for its size, " (causal)")
  std::string summary;   // one line
  std::string docs;      // its page: "docs/methods/kernelized.md"
  std::string no_causal; // empty when causal=true is supported, else why it is refused
  bool exact = false;    // computes exact softmax attention: what approximations are compared to
  std::vector<OptionInfo> options;  // in the order the Python function takes them
  std::vector<std::string> saved;   // names of MethodOutput::saved
  // Their shapes, one token per dimension: "batch", "heads", "n_q", "features" (feature_dim
  // below) or "value_dim+2"; what PyTorch's fake tensors need without running the method.
  std::vector<std::vector<std::string>> saved_dims;
  // The "features" dimension m' from head_dim, the extra tensors' shapes and the options (absent
  // ones take their defaults); null when no saved tensor has one.
  std::function<int64_t(int64_t head_dim, const std::map<std::string, Shape, std::less<>>& tensor_shapes,
                        const std::map<std::string, OptionValue, std::less<>>& options)>
      feature_dim;
  // The size knob of the approximation and its default: favor "num_features" (rows of the
  // projection), nystrom "num_landmarks" (an option), linformer "s_proj" (rows of e, f); empty
  // for exact or size-free methods.
  std::string size_name;
  std::string size_symbol;  // in labels: "m", "s"
  int64_t default_size = 0;
  // Rows in the method's largest internal block or chunk: tests run sequences longer than this.
  int64_t block_rows = 0;
  // Multiply-add FLOPs (2 per multiply-add) of one forward, or of the backward alone, for the
  // benchmarks' GFLOP/s.
  std::function<double(const AttentionShape&, const MethodArgs<float>&, bool backward)> flops;
  MethodFunctions<float> f32;
  MethodFunctions<double> f64;
  // Made from f32 by the registry (low_precision.h): inputs widened, float32 kernels, outputs
  // and gradients rounded once.
  MethodFunctions<bfloat16> bf16;
  MethodFunctions<float16> f16;
  // A method's own bfloat16 forward, where it has one (exact attention on AMX tiles or
  // AVX512-BF16; linear_attention and favor_attention on bfloat16 storage, widened a block at a
  // time): bf16.forward calls it first and runs the widened float32 forward only when it
  // returns nothing (this CPU, or this call, is outside what it does). Set by
  // describe_<method>(); null for the other methods.
  std::function<std::optional<MethodOutput<bfloat16>>(const MethodArgs<bfloat16>&)> bf16_kernel;
  // And its own bfloat16 backward, the same way (exact attention on AVX512-BF16; the kernelized
  // methods).
  std::function<std::optional<AttentionGrads<bfloat16>>(const MethodArgs<bfloat16>&, TensorView<const bfloat16> dout,
                                                        const SavedViews<bfloat16>& saved)>
      bf16_backward_kernel;

  template <class T>
  const MethodFunctions<T>& functions() const {
    if constexpr (std::is_same_v<T, float>) return f32;
    else if constexpr (std::is_same_v<T, double>) return f64;
    else if constexpr (std::is_same_v<T, bfloat16>) return bf16;
    else return f16;
  }
  const OptionInfo* option(std::string_view option_name) const;
};

// Every registered method, in the order listings show them.
const std::vector<MethodInfo>& methods();
// One by name; Error naming the registered ones when there is none.
const MethodInfo& method(std::string_view name);

}  // namespace linattn
