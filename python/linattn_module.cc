// Python bindings: NumPy arrays in and out, [batch, heads, seq, head_dim], float32 or float64.
// The attention methods are bound once, generically, from the registry (_methods, _forward,
// _backward; linattn/__init__.py gives each its own function with a real signature); the rest
// (random features, projections, the decoding state, threads) by hand. linattn::Error becomes
// ValueError, OutOfMemory MemoryError, Interrupted the KeyboardInterrupt that caused it; a
// wrong type or dtype is a TypeError. The GIL is released while kernels run (call_guard.h:
// calls on daemon threads at exit).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "call_guard.h"
#include "linattn/conv1d.h"
#include "linattn/delta.h"
#include "linattn/gated.h"
#include "linattn/linattn.h"

namespace py = pybind11;
using linattn::Tensor;
using linattn::TensorView;
using linattn_python::run_without_gil;

// Typed Python arguments whose checks need more than a type test, so the argument is taken as
// it comes and checked where it is used (as_array, dtype_arg) with messages that name it; the
// type is what signatures and the .pyi stubs show. ArrayArg: a numpy.ndarray or any CPU array
// with __dlpack__ (a torch tensor); DTypeArg: anything numpy.dtype() takes.
struct ArrayArg {
  py::object obj;
};
struct DTypeArg {
  py::object obj;
};

namespace pybind11::detail {
template <class Arg>
struct pass_through_caster {
  bool load(handle src, bool) {
    value.obj = reinterpret_borrow<object>(src);
    return true;
  }
  static handle cast(const Arg& a, return_value_policy, handle) { return a.obj.inc_ref(); }
  Arg value;
  operator Arg&() { return value; }
  template <class U>
  using cast_op_type = Arg&;
};
template <>
struct type_caster<ArrayArg> : pass_through_caster<ArrayArg> {
  static constexpr auto name = const_name("numpy.ndarray");
};
template <>
struct type_caster<DTypeArg> : pass_through_caster<DTypeArg> {
  static constexpr auto name = const_name("numpy.typing.DTypeLike");
};
}  // namespace pybind11::detail

namespace {

enum class DType { F32, F64, BF16, F16 };

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "float32";
    case DType::F64: return "float64";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
  }
  return "?";
}

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::F32;
  else if constexpr (std::is_same_v<T, double>) return DType::F64;
  else if constexpr (std::is_same_v<T, linattn::bfloat16>) return DType::BF16;
  else return DType::F16;
}

// The NumPy dtype of T: bfloat16 is ml_dtypes' (NumPy has none of its own).
template <class T>
py::dtype numpy_dtype() {
  if constexpr (std::is_same_v<T, linattn::bfloat16>)
    return py::dtype::from_args(py::module_::import("ml_dtypes").attr("bfloat16"));
  else if constexpr (std::is_same_v<T, linattn::float16>)
    return py::dtype("float16");
  else
    return py::dtype::of<T>();
}

// A C-contiguous float array taken from a Python argument (copied only if not contiguous).
struct Array {
  py::array arr;
  DType dtype;
  template <class T>
  TensorView<const T> view() const {
    linattn::Shape shape(arr.shape(), arr.shape() + arr.ndim());
    return {static_cast<const T*>(arr.data()), shape};
  }
};

// The dtype as linattn sees it, compared by value: an unpickled float32 dtype (or one from
// np.load, a memmap, another process) is equal to np.dtype(np.float32) but not the same object.
std::optional<DType> float_dtype(const py::dtype& dt) {
  if (dt.itemsize() == 2 && py::str(dt.attr("name")).cast<std::string>() == "bfloat16") return DType::BF16;
  if (dt.kind() != 'f') return std::nullopt;
  if (dt.itemsize() == 2) return DType::F16;
  if (dt.itemsize() == 4) return DType::F32;
  if (dt.itemsize() == 8) return DType::F64;
  return std::nullopt;
}

// Float data in the other byte order is refused, not converted behind the caller's back.
[[noreturn]] void foreign_byte_order(const char* fn, const char* name, const py::dtype& dt) {
  const std::string order = dt.byteorder() == '>' ? "big-endian" : "little-endian";
  const DType d = *float_dtype(dt);
  const std::string type = d == DType::BF16 ? "ml_dtypes.bfloat16" : "numpy." + std::string(dtype_name(d));
  throw py::type_error(std::string(fn) + ": " + name + " has dtype " + order + " " + dtype_name(d) + " ('" +
                       std::string(py::str(dt.attr("str"))) + "'); linattn takes the machine's byte order: convert with " +
                       name + ".astype(" + type + ")");
}

// Any CPU array that speaks DLPack (a torch tensor, say) as a NumPy array viewing its memory.
// One that requires grad is refused (its gradient would be lost without a word): linattn.torch
// has the differentiable functions.
py::array from_dlpack(const char* fn, const char* name, const py::handle& obj) {
  const std::string what = std::string(fn) + ": " + name;
  if (py::hasattr(obj, "requires_grad") && py::bool_(obj.attr("requires_grad")))
    throw py::type_error(what + " requires grad; pass " + name + ".detach(), or use linattn.torch, whose "
                         "functions are differentiable");
  const py::tuple device = obj.attr("__dlpack_device__")();
  if (device[0].cast<int>() != 1)  // kDLCPU
    throw py::type_error(what + " is not in CPU memory (DLPack device " + std::string(py::repr(device)) +
                         "); linattn runs on the CPU only");
  try {
    return py::module_::import("numpy").attr("from_dlpack")(obj);
  } catch (const py::error_already_set& e) {
    // NumPy has no bfloat16 (a torch.bfloat16 tensor): say what to do instead.
    throw py::type_error(what + " cannot be read through DLPack (" + std::string(e.what()) +
                         "); pass a NumPy array (ml_dtypes.bfloat16 for bfloat16) or use linattn.torch");
  }
}

Array as_array(const char* fn, const char* name, const py::handle& obj) {
  py::array a;
  if (py::isinstance<py::array>(obj)) {
    a = py::reinterpret_borrow<py::array>(obj);
  } else if (py::hasattr(obj, "__dlpack__") && py::hasattr(obj, "__dlpack_device__")) {
    a = from_dlpack(fn, name, obj);
  } else {
    throw py::type_error(std::string(fn) + ": " + name + " must be a numpy.ndarray or a CPU array with "
                         "__dlpack__, got " + std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  const std::optional<DType> dt = float_dtype(a.dtype());
  if (!dt)
    throw py::type_error(std::string(fn) + ": " + name + " must have dtype float32, float64, bfloat16 "
                         "(ml_dtypes.bfloat16) or float16, got " + std::string(py::str(a.dtype())));
  if (!a.dtype().attr("isnative").cast<bool>()) foreign_byte_order(fn, name, a.dtype());
  if (!(a.flags() & py::array::c_style)) a = py::array::ensure(a, py::array::c_style);
  return {a, *dt};
}

Array as_array(const char* fn, const char* name, const ArrayArg& a) { return as_array(fn, name, a.obj); }

// All tensor arguments share one dtype.
DType common_dtype(const char* fn, const std::vector<std::pair<const char*, const Array*>>& args) {
  const DType dt = args.front().second->dtype;
  for (const auto& [name, a] : args)
    if (a->dtype != dt)
      throw py::type_error(std::string(fn) + ": " + name + " has dtype " +
                           std::string(py::str(a->arr.dtype())) + " but " + args.front().first +
                           " has " + std::string(py::str(args.front().second->arr.dtype())) +
                           "; all inputs must share one dtype");
  return dt;
}

std::optional<std::vector<int64_t>> as_lengths(const char* fn, const py::object& obj) {
  if (obj.is_none()) return std::nullopt;
  py::array a = py::array::ensure(obj);
  if (!a) throw py::type_error(std::string(fn) + ": key_lengths must be a sequence of integers");
  if (a.ndim() != 1)
    throw py::value_error(std::string(fn) + ": key_lengths must be one-dimensional, got " +
                          std::to_string(a.ndim()) + " dimensions");
  const char kind = a.dtype().kind();
  if (a.size() > 0 && kind != 'i' && kind != 'u')
    throw py::type_error(std::string(fn) + ": key_lengths must hold integers, got dtype " +
                         std::string(py::str(a.dtype())));
  auto ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  return std::vector<int64_t>(ints.data(), ints.data() + ints.size());
}

// Runs fn(float{}) or fn(double{}) by dtype; the helpers outside the registered methods
// (random features, projections, decoding states) are float32/float64 only.
template <class Fn>
auto by_dtype(DType dt, Fn&& fn) {
  if (dt != DType::F32 && dt != DType::F64) throw std::logic_error("by_dtype: a 16-bit dtype");
  return dt == DType::F32 ? fn(float{}) : fn(double{});
}

// The registered methods take every dtype: fn(float{}), fn(double{}), fn(bfloat16{}), fn(float16{}).
template <class Fn>
auto by_any_dtype(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::F32: return fn(float{});
    case DType::F64: return fn(double{});
    case DType::BF16: return fn(linattn::bfloat16{});
    case DType::F16: break;
  }
  return fn(linattn::float16{});
}

void full_precision_only(const char* fn, const char* name, DType dt) {
  if (dt == DType::BF16 || dt == DType::F16)
    throw py::type_error(std::string(fn) + ": " + name + " must have dtype float32 or float64, got " + dtype_name(dt) +
                         " (the attention functions take " + dtype_name(dt) + "; this helper does not)");
}

std::optional<double> as_scale(const char* fn, const py::object& scale) {
  if (scale.is_none()) return std::nullopt;
  if (!py::isinstance<py::float_>(scale) && !py::isinstance<py::int_>(scale))
    throw py::type_error(std::string(fn) + ": scale must be a float or None");
  return scale.cast<double>();
}


// Hands a tensor's memory to NumPy without a copy.
template <class T>
py::array to_numpy(Tensor<T>&& t) {
  auto* owned = new Tensor<T>(std::move(t));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<Tensor<T>*>(p); });
  return py::array(numpy_dtype<T>(), owned->shape(), owned->data(), free_when_done);
}

DType dtype_arg(const char* fn, const DTypeArg& dtype) {
  const py::dtype dt = py::dtype::from_args(dtype.obj);
  const std::optional<DType> f = float_dtype(dt);
  if (!f || *f == DType::BF16 || *f == DType::F16)
    throw py::type_error(std::string(fn) + ": dtype must be float32 or float64, got " +
                         std::string(py::str(py::object(dt))));
  if (!dt.attr("isnative").cast<bool>())
    throw py::type_error(std::string(fn) + ": dtype must be float32 or float64 in the machine's byte order, got '" +
                         std::string(py::str(dt.attr("str"))) + "'");
  return *f;
}

py::array random_features(int64_t num_features, int64_t head_dim, const std::string& kind,
                          uint64_t seed, const DTypeArg& dtype) {
  const linattn::FeatureKind k = linattn::parse_feature_kind(kind);
  return by_dtype(dtype_arg("random_features", dtype), [&](auto tag) -> py::array {
    using T = decltype(tag);
    return to_numpy(linattn::random_features<T>(num_features, head_dim, k, seed));
  });
}

py::array chi_quantile_radii(int64_t num_features, int64_t head_dim) {
  const auto r = linattn::chi_quantile_radii(num_features, head_dim);
  Tensor<double> t({num_features});
  std::copy(r.begin(), r.end(), t.data());
  return to_numpy(std::move(t));
}

// RecurrentState of either dtype behind one Python class.
class PyRecurrentState {
 public:
  using Variant = std::variant<linattn::RecurrentState<float>, linattn::RecurrentState<double>>;
  explicit PyRecurrentState(Variant s) : s_(std::move(s)) {}

  py::array prefill(const ArrayArg& q, const ArrayArg& k, const ArrayArg& v) {
    const char* fn = "RecurrentState.prefill";
    const Array Q = as_array(fn, "q", q), K = as_array(fn, "k", k), V = as_array(fn, "v", v);
    check_dtype(fn, common_dtype(fn, {{"q", &Q}, {"k", &K}, {"v", &V}}));
    return std::visit([&](auto& st) -> py::array { return run_prefill(st, Q, K, V); }, s_);
  }
  py::array step(const ArrayArg& q, const ArrayArg& k, const ArrayArg& v) {
    const char* fn = "RecurrentState.step";
    const Array Q = as_array(fn, "q_t", q), K = as_array(fn, "k_t", k), V = as_array(fn, "v_t", v);
    check_dtype(fn, common_dtype(fn, {{"q_t", &Q}, {"k_t", &K}, {"v_t", &V}}));
    return std::visit([&](auto& st) -> py::array { return run_step(st, Q, K, V); }, s_);
  }
  PyRecurrentState copy() const {
    return std::visit([](const auto& st) { return PyRecurrentState(Variant(st.copy())); }, s_);
  }
  int64_t tokens() const {
    return std::visit([](const auto& st) { return st.tokens(); }, s_);
  }
  py::dtype dtype() const {
    return s_.index() == 0 ? py::dtype::of<float>() : py::dtype::of<double>();
  }

 private:
  void check_dtype(const char* fn, DType dt) const {
    if ((dt == DType::F32) != (s_.index() == 0) || (dt != DType::F32 && dt != DType::F64))
      throw py::type_error(std::string(fn) + ": inputs have dtype " + dtype_name(dt) + " but the state is " +
                           (s_.index() == 0 ? "float32" : "float64"));
  }
  template <class T>
  static py::array run_prefill(linattn::RecurrentState<T>& st, const Array& Q, const Array& K,
                               const Array& V) {
    return to_numpy(run_without_gil([&] { return st.prefill(Q.view<T>(), K.view<T>(), V.view<T>()); }));
  }
  template <class T>
  static py::array run_step(linattn::RecurrentState<T>& st, const Array& Q, const Array& K,
                            const Array& V) {
    return to_numpy(run_without_gil([&] { return st.step(Q.view<T>(), K.view<T>(), V.view<T>()); }));
  }
  Variant s_;
};

// feature_map as the C++ functions name it now: "identity" (before 0.2) is "given", with a
// DeprecationWarning (the generated functions warn through OptionInfo::former_choices).
std::string current_feature_map(const char* fn, const std::string& name) {
  if (name != linattn::kFormerGivenName) return name;
  if (PyErr_WarnFormat(PyExc_DeprecationWarning, 1,
                       "%s: feature_map='identity' is now called 'given'; the old name is accepted until the "
                       "next release", fn) < 0)
    throw py::error_already_set();
  return "given";
}

PyRecurrentState recurrent_state(int64_t batch, int64_t heads, int64_t head_dim, int64_t value_dim,
                                 const std::string& feature_map, const std::optional<ArrayArg>& projection,
                                 const std::string& kernel, const py::typing::Optional<py::float_>& scale,
                                 double eps, double focus_power, const std::optional<DTypeArg>& dtype) {
  const char* fn = "recurrent_state";
  linattn::RecurrentOptions o;
  o.feature_map = current_feature_map(fn, feature_map);
  o.eps = eps;
  o.focus_power = focus_power;
  o.scale = as_scale(fn, scale);
  // kernel's default "positive" is the FAVOR+ choice; any other value needs feature_map="favor".
  if (feature_map == "favor" || kernel != "positive") o.kernel = kernel;
  std::optional<Array> W;
  if (projection) {
    W = as_array(fn, "projection", *projection);
    full_precision_only(fn, "projection", W->dtype);
  }
  DType dt = DType::F32;
  if (dtype) dt = dtype_arg(fn, *dtype);
  else if (W) dt = W->dtype;
  if (W && W->dtype != dt)
    throw py::type_error(std::string(fn) + ": projection has dtype " + std::string(py::str(W->arr.dtype())) +
                         " but dtype is " + dtype_name(dt));
  return by_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    std::optional<TensorView<const T>> w;
    if (W) w = W->view<T>();
    return PyRecurrentState(PyRecurrentState::Variant(
        linattn::RecurrentState<T>(batch, heads, head_dim, value_dim, o, w)));
  });
}

// The tensor arguments of one call, by name; optional ones may be None. One dtype for all.
class Inputs {
 public:
  explicit Inputs(const char* fn) : fn_(fn) {}
  Inputs& add(const char* name, const py::object& obj) {
    if (!obj.is_none()) arrays_.push_back({name, as_array(fn_, name, obj)});
    return *this;
  }
  DType dtype() const {
    std::vector<std::pair<const char*, const Array*>> all;
    for (const auto& [name, a] : arrays_) all.push_back({name, &a});
    if (all.empty()) throw py::type_error(std::string(fn_) + ": every tensor argument is None");
    return common_dtype(fn_, all);
  }
  template <class T>
  std::optional<TensorView<const T>> optional(const char* name) const {
    for (const auto& [n, a] : arrays_)
      if (std::strcmp(n, name) == 0) return a.template view<T>();
    return std::nullopt;
  }
  // A required tensor: one that was None is a TypeError naming it.
  template <class T>
  TensorView<const T> tensor(const char* name) const {
    const auto t = optional<T>(name);
    if (!t) throw py::type_error(std::string(fn_) + ": " + name + " must be an array, got None");
    return *t;
  }

 private:
  const char* fn_;
  std::vector<std::pair<const char*, Array>> arrays_;
};

template <class... Ts>
py::tuple numpy_tuple(Ts&&... ts) {
  return py::make_tuple(to_numpy(std::move(ts))...);
}

py::tuple linformer_projections(int64_t s_proj, int64_t n_max, const py::typing::Optional<py::int_>& heads,
                                uint64_t seed, const DTypeArg& dtype) {
  const char* fn = "linformer_projections";
  int64_t h = 0;
  if (!heads.is_none()) {
    if (!py::isinstance<py::int_>(heads)) throw py::type_error(std::string(fn) + ": heads must be an int or None");
    h = heads.cast<int64_t>();
    if (h < 1) throw py::value_error(std::string(fn) + ": heads must be >= 1 or None (shared), got " + std::to_string(h));
  }
  return by_dtype(dtype_arg(fn, dtype), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    auto [e, f] = linattn::linformer_projections<T>(s_proj, n_max, h, seed);
    return numpy_tuple(std::move(e), std::move(f));
  });
}


// ---- the state-level operations (linattn.torch.state) -----------------------------------------

// A state-level operation's options, tensors and dtype (float32 or float64). Every tensor
// argument may be None where optional.
template <class Options>
struct FullPrecisionArgs {
  explicit FullPrecisionArgs(const char* fn) : fn(fn), inputs(fn) {}
  FullPrecisionArgs& add(const char* name, const py::object& obj) {
    inputs.add(name, obj);
    return *this;
  }
  DType dtype() const {
    const DType dt = inputs.dtype();
    full_precision_only(fn, "the inputs", dt);
    return dt;
  }
  const char* fn;
  Options opts;
  Inputs inputs;
};

// The kernelized state operations'.
struct StateArgs : FullPrecisionArgs<linattn::StateOptions> {
  StateArgs(const char* fn, const std::string& feature_map, const py::object& kernel, const py::object& scale,
            double eps, double focus_power, const py::object& projection)
      : FullPrecisionArgs(fn) {
    opts.feature_map = current_feature_map(fn, feature_map);
    if (!kernel.is_none()) opts.kernel = kernel.cast<std::string>();
    opts.scale = as_scale(fn, scale);
    opts.eps = eps;
    opts.focus_power = focus_power;
    inputs.add("projection", projection);
  }
};

#define LINATTN_STATE_ARGS(fn_name)                                                                      \
  StateArgs a(fn_name, feature_map, kernel, scale, eps, focus_power, projection)
#define LINATTN_STATE_PARAMS                                                                              \
  const std::string &feature_map, const py::object &kernel, const py::object &scale, double eps,         \
      double focus_power, const py::object &projection

// ---- the feature maps on their own (include/linattn/kernelized.h) ---------------------------------

struct FeatureArgs : FullPrecisionArgs<linattn::RecurrentOptions> {
  // A plain map.
  FeatureArgs(const char* fn, const std::string& feature_map, double focus_power) : FullPrecisionArgs(fn) {
    opts.feature_map = current_feature_map(fn, feature_map);
    opts.focus_power = focus_power;
  }
  // FAVOR's, in log form.
  FeatureArgs(const char* fn, const std::string& kernel, const py::object& scale) : FullPrecisionArgs(fn) {
    opts.feature_map = "favor";
    opts.kernel = kernel;
    opts.scale = as_scale(fn, scale);
  }
};

py::array features_py(const py::object& x, const std::string& feature_map, double focus_power) {
  FeatureArgs a("features", feature_map, focus_power);
  a.add("x", x);
  return by_dtype(a.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    return to_numpy(run_without_gil([&] { return linattn::features<T>(a.inputs.tensor<T>("x"), a.opts); }));
  });
}

py::array features_backward_py(const py::object& x, const py::object& dphi, const std::string& feature_map,
                               double focus_power) {
  FeatureArgs a("features_backward", feature_map, focus_power);
  a.add("x", x).add("dphi", dphi);
  return by_dtype(a.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    return to_numpy(run_without_gil([&] {
      return linattn::features_backward<T>(in.tensor<T>("x"), in.tensor<T>("dphi"), a.opts);
    }));
  });
}

py::tuple feature_logits_py(const py::object& x, const py::object& projection, const std::string& kernel,
                            const py::object& scale, const std::string& side) {
  FeatureArgs a("feature_logits", kernel, scale);
  a.add("x", x).add("projection", projection);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto r = run_without_gil([&] {
      return linattn::feature_logits<T>(in.tensor<T>("x"), in.tensor<T>("projection"), side, a.opts);
    });
    const bool factors = r.factors.dim(3) > 0;  // trig only
    py::object s = factors ? py::object(to_numpy(std::move(r.factors))) : py::none();
    return py::make_tuple(to_numpy(std::move(r.logits)), s);
  });
}

py::array hedgehog_features_py(const py::object& x, const py::object& weight, const py::object& bias) {
  FullPrecisionArgs<linattn::RecurrentOptions> a("hedgehog_features");
  a.add("x", x).add("weight", weight).add("bias", bias);
  return by_dtype(a.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    return to_numpy(run_without_gil([&] {
      return linattn::hedgehog_features<T>(in.tensor<T>("x"), in.tensor<T>("weight"), in.tensor<T>("bias"));
    }));
  });
}

py::tuple hedgehog_features_backward_py(const py::object& x, const py::object& weight, const py::object& bias,
                                        const py::object& dphi, const py::object& phi) {
  FullPrecisionArgs<linattn::RecurrentOptions> a("hedgehog_features_backward");
  a.add("x", x).add("weight", weight).add("bias", bias).add("dphi", dphi).add("phi", phi);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto g = run_without_gil([&] {
      return linattn::hedgehog_features_backward<T>(in.tensor<T>("x"), in.tensor<T>("weight"), in.tensor<T>("bias"),
                                                    in.tensor<T>("dphi"), in.optional<T>("phi"));
    });
    return numpy_tuple(std::move(g.dx), std::move(g.dweight), std::move(g.dbias));
  });
}

py::array feature_logits_backward_py(const py::object& x, const py::object& projection, const py::object& dlogits,
                                     const py::object& dfactors, const std::string& kernel, const py::object& scale,
                                     const std::string& side) {
  FeatureArgs a("feature_logits_backward", kernel, scale);
  a.add("x", x).add("projection", projection).add("dlogits", dlogits).add("dfactors", dfactors);
  return by_dtype(a.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    return to_numpy(run_without_gil([&] {
      return linattn::feature_logits_backward<T>(in.tensor<T>("x"), in.tensor<T>("projection"), side,
                                                 in.tensor<T>("dlogits"), in.optional<T>("dfactors"), a.opts);
    }));
  });
}

py::array key_state_py(const py::object& k, const py::object& v, const py::object& key_lengths,
                       LINATTN_STATE_PARAMS) {
  LINATTN_STATE_ARGS("key_state");
  a.add("k", k).add("v", v);
  const auto lengths = as_lengths(a.fn, key_lengths);
  return by_dtype(a.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    return to_numpy(run_without_gil([&] {
      return linattn::key_state<T>(in.tensor<T>("k"), in.tensor<T>("v"), a.opts, in.optional<T>("projection"), lengths);
    }));
  });
}

py::tuple key_state_backward_py(const py::object& k, const py::object& v, const py::object& state,
                                const py::object& dstate, const py::object& key_lengths, LINATTN_STATE_PARAMS) {
  LINATTN_STATE_ARGS("key_state_backward");
  a.add("k", k).add("v", v).add("state", state).add("dstate", dstate);
  const auto lengths = as_lengths(a.fn, key_lengths);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto g = run_without_gil([&] {
      return linattn::key_state_backward<T>(in.tensor<T>("k"), in.tensor<T>("v"), in.tensor<T>("state"),
                                            in.tensor<T>("dstate"), a.opts, in.optional<T>("projection"), lengths);
    });
    return numpy_tuple(std::move(g.dk), std::move(g.dv));
  });
}

py::tuple apply_state_py(const py::object& q, const py::object& state, LINATTN_STATE_PARAMS) {
  LINATTN_STATE_ARGS("apply_state");
  a.add("q", q).add("state", state);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto r = run_without_gil([&] {
      return linattn::apply_state<T>(in.tensor<T>("q"), in.tensor<T>("state"), a.opts, in.optional<T>("projection"));
    });
    return numpy_tuple(std::move(r.out), std::move(r.den));
  });
}

py::tuple apply_state_backward_py(const py::object& q, const py::object& state, const py::object& dout,
                                  const py::object& out, const py::object& den, LINATTN_STATE_PARAMS) {
  LINATTN_STATE_ARGS("apply_state_backward");
  a.add("q", q).add("state", state).add("dout", dout).add("out", out).add("den", den);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto g = run_without_gil([&] {
      return linattn::apply_state_backward<T>(in.tensor<T>("q"), in.tensor<T>("state"), in.tensor<T>("dout"),
                                              in.tensor<T>("out"), in.tensor<T>("den"), a.opts,
                                              in.optional<T>("projection"));
    });
    return numpy_tuple(std::move(g.dq), std::move(g.dstate));
  });
}

py::tuple causal_from_state_py(const py::object& q, const py::object& k, const py::object& v,
                               const py::object& prefix, const py::object& key_lengths, LINATTN_STATE_PARAMS) {
  LINATTN_STATE_ARGS("causal_from_state");
  a.add("q", q).add("k", k).add("v", v).add("prefix", prefix);
  const auto lengths = as_lengths(a.fn, key_lengths);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto r = run_without_gil([&] {
      return linattn::causal_from_state<T>(in.tensor<T>("q"), in.tensor<T>("k"), in.tensor<T>("v"),
                                           in.tensor<T>("prefix"), a.opts, in.optional<T>("projection"), lengths);
    });
    return numpy_tuple(std::move(r.out), std::move(r.den), std::move(r.state));
  });
}

py::tuple causal_from_state_backward_py(const py::object& q, const py::object& k, const py::object& v,
                                        const py::object& prefix, const py::object& dout, const py::object& out,
                                        const py::object& den, const py::object& dstate_after,
                                        const py::object& key_lengths, LINATTN_STATE_PARAMS) {
  LINATTN_STATE_ARGS("causal_from_state_backward");
  a.add("q", q).add("k", k).add("v", v).add("prefix", prefix).add("dout", dout).add("out", out).add("den", den);
  a.add("dstate_after", dstate_after);
  const auto lengths = as_lengths(a.fn, key_lengths);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto g = run_without_gil([&] {
      return linattn::causal_from_state_backward<T>(
          in.tensor<T>("q"), in.tensor<T>("k"), in.tensor<T>("v"), in.tensor<T>("prefix"), in.tensor<T>("dout"),
          in.tensor<T>("out"), in.tensor<T>("den"), in.optional<T>("dstate_after"), a.opts,
          in.optional<T>("projection"), lengths);
    });
    return numpy_tuple(std::move(g.dq), std::move(g.dk), std::move(g.dv), std::move(g.dstate));
  });
}

#undef LINATTN_STATE_ARGS
#undef LINATTN_STATE_PARAMS

// Efficient Attention's state-level operations (efficient.h) and Linformer's projection of a
// block (linformer.h): scale and key_lengths as their methods take them.
struct BlockStateArgs : FullPrecisionArgs<linattn::EfficientAttentionOptions> {
  BlockStateArgs(const char* fn, const py::object& scale, const py::object& key_lengths) : FullPrecisionArgs(fn) {
    opts.scale = as_scale(fn, scale);
    opts.key_lengths = as_lengths(fn, key_lengths);
  }
};

py::array efficient_key_state_py(const py::object& k, const py::object& v, const py::object& key_lengths,
                                 const py::object& scale) {
  BlockStateArgs a("efficient_key_state", scale, key_lengths);
  a.add("k", k).add("v", v);
  return by_dtype(a.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    return to_numpy(run_without_gil([&] { return linattn::efficient_key_state<T>(in.tensor<T>("k"), in.tensor<T>("v"), a.opts); }));
  });
}

py::tuple efficient_key_state_backward_py(const py::object& k, const py::object& v, const py::object& state,
                                          const py::object& dstate, const py::object& key_lengths, const py::object& scale) {
  BlockStateArgs a("efficient_key_state_backward", scale, key_lengths);
  a.add("k", k).add("v", v).add("state", state).add("dstate", dstate);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto g = run_without_gil([&] {
      return linattn::efficient_key_state_backward<T>(in.tensor<T>("k"), in.tensor<T>("v"), in.tensor<T>("state"),
                                                      in.tensor<T>("dstate"), a.opts);
    });
    return numpy_tuple(std::move(g.dk), std::move(g.dv));
  });
}

py::array efficient_apply_state_py(const py::object& q, const py::object& state, const py::object& scale) {
  BlockStateArgs a("efficient_apply_state", scale, py::none());
  a.add("q", q).add("state", state);
  return by_dtype(a.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    return to_numpy(
        run_without_gil([&] { return linattn::efficient_apply_state<T>(in.tensor<T>("q"), in.tensor<T>("state"), a.opts); }));
  });
}

py::array linformer_project_py(const py::object& k, const py::object& v, const py::object& e, const py::object& f,
                               int64_t offset, const py::object& key_lengths) {
  BlockStateArgs a("linformer_project", py::none(), key_lengths);
  a.add("k", k).add("v", v).add("e", e).add("f", f);
  linattn::LinformerOptions o;
  o.key_lengths = a.opts.key_lengths;
  return by_dtype(a.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    return to_numpy(run_without_gil([&] {
      return linattn::linformer_project<T>(in.tensor<T>("k"), in.tensor<T>("v"), in.tensor<T>("e"), in.tensor<T>("f"),
                                           offset, o);
    }));
  });
}

py::tuple linformer_project_backward_py(const py::object& k, const py::object& v, const py::object& e,
                                        const py::object& f, const py::object& dprojected, int64_t offset,
                                        const py::object& key_lengths, bool param_grads) {
  BlockStateArgs a("linformer_project_backward", py::none(), key_lengths);
  a.add("k", k).add("v", v).add("e", e).add("f", f).add("dprojected", dprojected);
  linattn::LinformerOptions o;
  o.key_lengths = a.opts.key_lengths;
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto g = run_without_gil([&] {
      return linattn::linformer_project_backward<T>(in.tensor<T>("k"), in.tensor<T>("v"), in.tensor<T>("e"),
                                                    in.tensor<T>("f"), in.tensor<T>("dprojected"), offset, o, param_grads);
    });
    if (!param_grads) return py::make_tuple(to_numpy(std::move(g.dk)), to_numpy(std::move(g.dv)), py::none(), py::none());
    return numpy_tuple(std::move(g.dk), std::move(g.dv), std::move(g.params[0].second), std::move(g.params[1].second));
  });
}

// Gated linear attention (include/linattn/gated.h): float32 and float64.
struct GatedArgs : FullPrecisionArgs<linattn::GatedLinearAttentionOptions> {
  GatedArgs(const char* fn, const py::object& scale, bool causal) : FullPrecisionArgs(fn) {
    opts.scale = as_scale(fn, scale);
    opts.causal = causal;
  }
};

py::object gated_linear_attention_py(const py::object& q, const py::object& k, const py::object& v,
                                     const py::object& log_gate, const py::object& scale, bool causal,
                                     const py::object& initial_state, bool return_state) {
  GatedArgs a("gated_linear_attention", scale, causal);
  if (return_state && !causal)
    throw py::value_error(
        "gated_linear_attention: return_state=True needs causal=True: the non-causal form reads the whole "
        "sequence and has no final state");
  a.add("q", q).add("k", k).add("v", v).add("log_gate", log_gate).add("initial_state", initial_state);
  return by_dtype(a.dtype(), [&](auto tag) -> py::object {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto r = run_without_gil([&] {
      return linattn::gated_linear_attention<T>(in.tensor<T>("q"), in.tensor<T>("k"), in.tensor<T>("v"),
                                                in.tensor<T>("log_gate"),
                                                in.optional<T>("initial_state").value_or(TensorView<const T>{}),
                                                a.opts);
    });
    if (return_state) return numpy_tuple(std::move(r.out), std::move(r.state));
    return to_numpy(std::move(r.out));
  });
}

py::tuple gated_linear_attention_backward_py(const py::object& q, const py::object& k, const py::object& v,
                                             const py::object& log_gate, const py::object& dout,
                                             const py::object& scale, bool causal, const py::object& initial_state,
                                             const py::object& dstate) {
  GatedArgs a("gated_linear_attention_backward", scale, causal);
  a.add("q", q).add("k", k).add("v", v).add("log_gate", log_gate).add("dout", dout);
  a.add("initial_state", initial_state).add("dstate", dstate);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto g = run_without_gil([&] {
      return linattn::gated_linear_attention_backward<T>(
          in.tensor<T>("q"), in.tensor<T>("k"), in.tensor<T>("v"), in.tensor<T>("log_gate"),
          in.optional<T>("initial_state").value_or(TensorView<const T>{}), in.tensor<T>("dout"),
          in.optional<T>("dstate").value_or(TensorView<const T>{}), a.opts);
    });
    return numpy_tuple(std::move(g.dq), std::move(g.dk), std::move(g.dv), std::move(g.dlog_gate),
                       std::move(g.dinitial_state));
  });
}

// The gated delta rule and KDA (include/linattn/delta.h): float32 and float64.
struct DeltaArgs : FullPrecisionArgs<linattn::GatedDeltaRuleOptions> {
  DeltaArgs(const char* fn, const py::object& scale, bool use_qk_l2norm_in_kernel) : FullPrecisionArgs(fn) {
    opts.scale = as_scale(fn, scale);
    opts.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel;
  }
};

py::object gated_delta_rule_py(const py::object& q, const py::object& k, const py::object& v, const py::object& g,
                               const py::object& beta, const py::object& scale, const py::object& initial_state,
                               bool return_state, bool use_qk_l2norm_in_kernel) {
  DeltaArgs a("gated_delta_rule", scale, use_qk_l2norm_in_kernel);
  a.add("q", q).add("k", k).add("v", v).add("g", g).add("beta", beta).add("initial_state", initial_state);
  return by_dtype(a.dtype(), [&](auto tag) -> py::object {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto r = run_without_gil([&] {
      return linattn::gated_delta_rule<T>(in.tensor<T>("q"), in.tensor<T>("k"), in.tensor<T>("v"), in.tensor<T>("g"),
                                          in.tensor<T>("beta"),
                                          in.optional<T>("initial_state").value_or(TensorView<const T>{}), a.opts);
    });
    if (return_state) return numpy_tuple(std::move(r.out), std::move(r.state));
    return to_numpy(std::move(r.out));
  });
}

py::tuple gated_delta_rule_backward_py(const py::object& q, const py::object& k, const py::object& v,
                                       const py::object& g, const py::object& beta, const py::object& dout,
                                       const py::object& scale, const py::object& initial_state,
                                       const py::object& dstate, bool use_qk_l2norm_in_kernel) {
  DeltaArgs a("gated_delta_rule_backward", scale, use_qk_l2norm_in_kernel);
  a.add("q", q).add("k", k).add("v", v).add("g", g).add("beta", beta).add("dout", dout);
  a.add("initial_state", initial_state).add("dstate", dstate);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto gr = run_without_gil([&] {
      return linattn::gated_delta_rule_backward<T>(
          in.tensor<T>("q"), in.tensor<T>("k"), in.tensor<T>("v"), in.tensor<T>("g"), in.tensor<T>("beta"),
          in.optional<T>("initial_state").value_or(TensorView<const T>{}), in.tensor<T>("dout"),
          in.optional<T>("dstate").value_or(TensorView<const T>{}), a.opts);
    });
    return numpy_tuple(std::move(gr.dq), std::move(gr.dk), std::move(gr.dv), std::move(gr.dg), std::move(gr.dbeta),
                       std::move(gr.dinitial_state));
  });
}

// The causal depthwise convolution (include/linattn/conv1d.h): float32 and float64.
linattn::CausalConv1dOptions conv1d_options(const char* fn, const py::object& activation) {
  linattn::CausalConv1dOptions o;
  if (activation.is_none()) {
    o.silu = false;
    return o;
  }
  const std::string a = py::str(activation);
  if (a != "silu" && a != "swish")
    throw py::value_error(std::string(fn) + ": activation must be None, \"silu\" or \"swish\", got " +
                          std::string(py::repr(activation)));
  return o;
}

py::object causal_conv1d_py(const py::object& x, const py::object& weight, const py::object& bias,
                            const py::object& initial_state, bool return_state, const py::object& activation) {
  FullPrecisionArgs<linattn::CausalConv1dOptions> a("causal_conv1d");
  a.opts = conv1d_options(a.fn, activation);
  a.add("x", x).add("weight", weight).add("bias", bias).add("initial_state", initial_state);
  return by_dtype(a.dtype(), [&](auto tag) -> py::object {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto r = run_without_gil([&] {
      return linattn::causal_conv1d<T>(in.tensor<T>("x"), in.tensor<T>("weight"),
                                       in.optional<T>("bias").value_or(TensorView<const T>{}),
                                       in.optional<T>("initial_state").value_or(TensorView<const T>{}), a.opts);
    });
    if (return_state) return numpy_tuple(std::move(r.out), std::move(r.state));
    return to_numpy(std::move(r.out));
  });
}

// An array a call changes in place: exactly dtype T, C-contiguous and writable, or a TypeError
// naming it (a converted copy would take the changes instead of the caller's array).
template <class T>
TensorView<T> in_place_array(const char* fn, const char* name, const py::object& x, bool writes = true) {
  if (!py::isinstance<py::array>(x))
    throw py::type_error(std::string(fn) + ": " + name + " must be a NumPy array, got " +
                         py::str(py::type::of(x)).cast<std::string>());
  auto a = py::reinterpret_borrow<py::array>(x);
  if (!a.dtype().is(py::dtype::of<T>()))
    throw py::type_error(std::string(fn) + ": " + name + " must have dtype " +
                         py::str(py::dtype::of<T>()).cast<std::string>() + (writes ? " (it is changed in place)" : "") +
                         ", got " + py::str(a.dtype()).cast<std::string>());
  if (!(a.flags() & py::array::c_style))
    throw py::type_error(std::string(fn) + ": " + name + " must be C-contiguous");
  if (writes && !a.writeable()) throw py::type_error(std::string(fn) + ": " + name + " must be writable (it is changed in place)");
  linattn::Shape shape(a.shape(), a.shape() + a.ndim());
  return {static_cast<T*>(writes ? a.mutable_data() : const_cast<void*>(a.data())), std::move(shape)};
}

// The hybrid's decoding state on the caller's arrays (which the call changes in place), with
// FAVOR's shifts when given.
template <class T>
linattn::HybridDecodeState<T> hybrid_state_arrays(const char* fn, const py::object& sums, const py::object& normaliser,
                                                  const py::object& exact_keys, const py::object& exact_values,
                                                  const py::object& exact_valid, const py::object& counts,
                                                  const py::object& shift) {
  return {in_place_array<T>(fn, "sums", sums),
          in_place_array<T>(fn, "normaliser", normaliser),
          in_place_array<T>(fn, "exact_keys", exact_keys),
          in_place_array<T>(fn, "exact_values", exact_values),
          in_place_array<bool>(fn, "exact_valid", exact_valid),
          in_place_array<int64_t>(fn, "counts", counts),
          shift.is_none() ? TensorView<T>{} : in_place_array<T>(fn, "shift", shift)};
}

// Where a step's or a prefill's features come from: given, Hedgehog's maps (all of `maps`), a
// fixed map by name, or FAVOR's projection: exactly one, or a ValueError naming what clashes.
enum class DecodeFeatures { Given, Hedgehog, Fixed, Favor };
DecodeFeatures decode_features(const char* fn, const std::string& feature_map, bool features_given,
                               const char* features_names, std::initializer_list<const py::object*> maps,
                               const char* maps_names, const py::object& projection) {
  const std::string f = fn;
  const auto given_maps = std::count_if(maps.begin(), maps.end(), [](const py::object* t) { return !t->is_none(); });
  const bool hedgehog = given_maps > 0, favor = feature_map == "favor";
  if (hedgehog && given_maps < static_cast<std::ptrdiff_t>(maps.size()))
    throw py::value_error(f + ": " + maps_names + " go together (Hedgehog's maps); " + std::to_string(given_maps) +
                          " of them were given");
  if (hedgehog && features_given)
    throw py::value_error(f + ": " + features_names + " must be None when Hedgehog's maps (" + maps_names +
                          ") are given: the call makes the features from them");
  if (hedgehog && feature_map != "given")
    throw py::value_error(f + ": feature_map=\"" + feature_map + "\" and Hedgehog's maps (" + maps_names +
                          ") were both given; pass one");
  if (favor != !projection.is_none())
    throw py::value_error(f + (favor ? ": feature_map=\"favor\" needs projection ω [num_features, head_dim]"
                                     : ": projection is FAVOR's: pass feature_map=\"favor\" with it"));
  if (feature_map != "given" && features_given)
    throw py::value_error(f + ": " + features_names + " must be None with feature_map=\"" + feature_map +
                          "\": the call makes the features itself");
  if (!hedgehog && feature_map == "given" && !features_given)
    throw py::value_error(f + ": " + features_names + " required unless Hedgehog's maps (" + maps_names +
                          "), a fixed feature_map or FAVOR's projection are given");
  return hedgehog ? DecodeFeatures::Hedgehog
         : favor  ? DecodeFeatures::Favor
         : feature_map != "given" ? DecodeFeatures::Fixed
                                  : DecodeFeatures::Given;
}

py::object hybrid_decode_step_py(const py::object& q, const py::object& k, const py::object& v,
                                 const py::object& query_features, const py::object& leaving_features,
                                 const py::object& advance, const py::object& window_weight,
                                 const py::object& log_decay, const py::object& sums, const py::object& normaliser,
                                 const py::object& exact_keys, const py::object& exact_values,
                                 const py::object& exact_valid, const py::object& counts, int64_t window,
                                 int64_t sinks, double scale, double eps, const py::object& query_weight,
                                 const py::object& query_bias, const py::object& key_weight,
                                 const py::object& key_bias, const std::string& feature_map, double focus_power,
                                 const py::object& projection, const std::string& kernel, const py::object& shift) {
  FullPrecisionArgs<linattn::HybridDecodeOptions> a("hybrid_decode_step");
  a.opts = {window, sinks, scale, eps, feature_map, focus_power, kernel};
  const DecodeFeatures source = decode_features(
      a.fn, feature_map, !query_features.is_none() || !leaving_features.is_none(), "query_features and leaving_features",
      {&query_weight, &query_bias, &key_weight, &key_bias}, "query_weight, query_bias, key_weight, key_bias", projection);
  if (source == DecodeFeatures::Given && (query_features.is_none() || leaving_features.is_none()))
    throw py::value_error("hybrid_decode_step: query_features and leaving_features go together");
  a.add("q", q).add("k", k).add("v", v);
  if (source == DecodeFeatures::Hedgehog)
    a.add("query_weight", query_weight).add("query_bias", query_bias).add("key_weight", key_weight).add(
        "key_bias", key_bias);
  else if (source == DecodeFeatures::Given)
    a.add("query_features", query_features).add("leaving_features", leaving_features);
  else if (source == DecodeFeatures::Favor)
    a.add("projection", projection);
  a.add("window_weight", window_weight).add("log_decay", log_decay);
  return by_dtype(a.dtype(), [&](auto tag) -> py::object {
    using T = decltype(tag);
    const char* fn = a.fn;
    const auto state = hybrid_state_arrays<T>(fn, sums, normaliser, exact_keys, exact_values, exact_valid, counts, shift);
    const TensorView<bool> adv = in_place_array<bool>(fn, "advance", advance, false);
    const Inputs& in = a.inputs;
    const TensorView<const T> log_decay_view = in.optional<T>("log_decay").value_or(TensorView<const T>{});
    return to_numpy(run_without_gil([&] {
      const TensorView<const T> q_view = in.tensor<T>("q"), k_view = in.tensor<T>("k"), v_view = in.tensor<T>("v");
      const TensorView<const T> gamma = in.tensor<T>("window_weight"), none{};
      switch (source) {
        case DecodeFeatures::Hedgehog:
          return linattn::hybrid_decode_step<T>(
              q_view, k_view, v_view,
              linattn::HedgehogMaps<T>{in.tensor<T>("query_weight"), in.tensor<T>("query_bias"),
                                       in.tensor<T>("key_weight"), in.tensor<T>("key_bias")},
              adv, gamma, log_decay_view, state, a.opts);
        case DecodeFeatures::Favor:
          return linattn::hybrid_decode_step<T>(q_view, k_view, v_view,
                                                linattn::FavorFeatures<T>{in.tensor<T>("projection")}, adv, gamma,
                                                log_decay_view, state, a.opts);
        case DecodeFeatures::Fixed:
          return linattn::hybrid_decode_step<T>(q_view, k_view, v_view, none, none, adv, gamma, log_decay_view, state,
                                                a.opts);
        case DecodeFeatures::Given:
          break;
      }
      return linattn::hybrid_decode_step<T>(q_view, k_view, v_view, in.tensor<T>("query_features"),
                                            in.tensor<T>("leaving_features"), adv, gamma, log_decay_view, state,
                                            a.opts);
    }));
  });
}

py::object hybrid_prefill_py(const py::object& k, const py::object& v, const py::object& key_features,
                             const py::object& valid, const py::object& log_decay, const py::object& sums,
                             const py::object& normaliser, const py::object& exact_keys,
                             const py::object& exact_values, const py::object& exact_valid, const py::object& counts,
                             int64_t window, int64_t sinks, const py::object& key_weight, const py::object& key_bias,
                             const std::string& feature_map, double focus_power, const py::object& projection,
                             const std::string& kernel, double scale, const py::object& shift) {
  FullPrecisionArgs<linattn::HybridDecodeOptions> a("hybrid_prefill");
  a.opts.window = window, a.opts.sinks = sinks, a.opts.feature_map = feature_map, a.opts.focus_power = focus_power;
  a.opts.kernel = kernel, a.opts.scale = scale;
  const DecodeFeatures source = decode_features(a.fn, feature_map, !key_features.is_none(), "key_features",
                                                {&key_weight, &key_bias}, "key_weight, key_bias", projection);
  a.add("k", k).add("v", v);
  if (source == DecodeFeatures::Hedgehog)
    a.add("key_weight", key_weight).add("key_bias", key_bias);
  else if (source == DecodeFeatures::Given)
    a.add("key_features", key_features);
  else if (source == DecodeFeatures::Favor)
    a.add("projection", projection);
  a.add("log_decay", log_decay);
  return by_dtype(a.dtype(), [&](auto tag) -> py::object {
    using T = decltype(tag);
    const char* fn = a.fn;
    const auto state = hybrid_state_arrays<T>(fn, sums, normaliser, exact_keys, exact_values, exact_valid, counts, shift);
    const TensorView<bool> marks = valid.is_none() ? TensorView<bool>{} : in_place_array<bool>(fn, "valid", valid, false);
    const Inputs& in = a.inputs;
    const TensorView<const T> log_decay_view = in.optional<T>("log_decay").value_or(TensorView<const T>{});
    run_without_gil([&] {
      const TensorView<const T> k_view = in.tensor<T>("k"), v_view = in.tensor<T>("v");
      switch (source) {
        case DecodeFeatures::Hedgehog:
          linattn::hybrid_prefill<T>(k_view, v_view, in.tensor<T>("key_weight"), in.tensor<T>("key_bias"), marks,
                                     log_decay_view, state, a.opts);
          break;
        case DecodeFeatures::Favor:
          linattn::hybrid_prefill<T>(k_view, v_view, linattn::FavorFeatures<T>{in.tensor<T>("projection")}, marks,
                                     log_decay_view, state, a.opts);
          break;
        case DecodeFeatures::Fixed:
          linattn::hybrid_prefill<T>(k_view, v_view, TensorView<const T>{}, marks, log_decay_view, state, a.opts);
          break;
        case DecodeFeatures::Given:
          linattn::hybrid_prefill<T>(k_view, v_view, in.tensor<T>("key_features"), marks, log_decay_view, state,
                                     a.opts);
          break;
      }
      return 0;
    });
    return py::none();
  });
}

py::tuple causal_conv1d_backward_py(const py::object& x, const py::object& weight, const py::object& dout,
                                    const py::object& bias, const py::object& initial_state, const py::object& dstate,
                                    const py::object& activation) {
  FullPrecisionArgs<linattn::CausalConv1dOptions> a("causal_conv1d_backward");
  a.opts = conv1d_options(a.fn, activation);
  a.add("x", x).add("weight", weight).add("dout", dout).add("bias", bias).add("initial_state", initial_state);
  a.add("dstate", dstate);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto g = run_without_gil([&] {
      return linattn::causal_conv1d_backward<T>(
          in.tensor<T>("x"), in.tensor<T>("weight"), in.optional<T>("bias").value_or(TensorView<const T>{}),
          in.optional<T>("initial_state").value_or(TensorView<const T>{}), in.tensor<T>("dout"),
          in.optional<T>("dstate").value_or(TensorView<const T>{}), a.opts);
    });
    py::object dbias = bias.is_none() ? py::object(py::none()) : py::object(to_numpy(std::move(g.dbias)));
    return py::make_tuple(to_numpy(std::move(g.dx)), to_numpy(std::move(g.dweight)), dbias,
                          to_numpy(std::move(g.dinitial_state)));
  });
}

py::tuple efficient_apply_state_backward_py(const py::object& q, const py::object& state, const py::object& dout,
                                            const py::object& scale) {
  BlockStateArgs a("efficient_apply_state_backward", scale, py::none());
  a.add("q", q).add("state", state).add("dout", dout);
  return by_dtype(a.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    const Inputs& in = a.inputs;
    auto g = run_without_gil([&] {
      return linattn::efficient_apply_state_backward<T>(in.tensor<T>("q"), in.tensor<T>("state"), in.tensor<T>("dout"),
                                                        a.opts);
    });
    return numpy_tuple(std::move(g.dq), std::move(g.dstate));
  });
}

// ---- the registered methods -------------------------------------------------------------------

// One option's Python value as the registry's OptionValue, by the kind the method declares.
// Types that do not fit are TypeErrors naming the function and the option.
linattn::OptionValue option_value(const std::string& fn, const linattn::OptionInfo& o, const py::handle& x) {
  using Kind = linattn::OptionInfo::Kind;
  const std::string what = fn + ": " + o.name;
  const bool is_bool = py::isinstance<py::bool_>(x) || py::str(py::type::of(x).attr("__name__")).cast<std::string>() == "bool_";
  switch (o.kind) {
    case Kind::Bool:
      if (!is_bool) throw py::type_error(what + " must be True or False, got " + std::string(py::repr(x)));
      return x.cast<bool>();
    case Kind::Int: {
      if (is_bool || !py::hasattr(x, "__index__"))  // int and numpy integers; not bool, not float
        throw py::type_error(what + " must be an integer, got " + std::string(py::repr(x)));
      const py::object i = x.attr("__index__")();
      try {
        return i.cast<int64_t>();
      } catch (const py::cast_error&) {
        throw py::value_error(what + " = " + std::string(py::repr(x)) + " does not fit in 64 bits");
      }
    }
    case Kind::Float:
      if (is_bool || py::isinstance<py::str>(x) || !py::hasattr(x, "__float__"))
        throw py::type_error(what + (o.optional ? " must be a float or None" : " must be a float") + ", got " +
                             std::string(py::repr(x)));
      return x.attr("__float__")().cast<double>();
    case Kind::String:
      if (!py::isinstance<py::str>(x)) throw py::type_error(what + " must be a string, got " + std::string(py::repr(x)));
      return x.cast<std::string>();
    case Kind::Lengths: {
      const auto lengths = as_lengths(fn.c_str(), py::reinterpret_borrow<py::object>(x));
      return lengths ? *lengths : std::vector<int64_t>{};
    }
    case Kind::Tensor: break;
  }
  throw py::type_error(what + " is a tensor input");
}

// The options of a call by name (TypeError for a name the method does not take or a None it
// does not allow; None for an optional option means "not given").
std::map<std::string, linattn::OptionValue, std::less<>> option_values(const linattn::MethodInfo& m,
                                                                       const std::string& fn, const py::dict& opts) {
  std::map<std::string, linattn::OptionValue, std::less<>> options;
  for (const auto& [key, value] : opts) {
    const std::string name = py::str(key);
    const linattn::OptionInfo* o = m.option(name);
    if (!o || o->kind == linattn::OptionInfo::Kind::Tensor)
      throw py::type_error(fn + ": unexpected keyword argument '" + name + "'");
    if (value.is_none()) {
      if (!o->optional) throw py::type_error(fn + ": " + name + " must not be None");
      continue;
    }
    options[name] = option_value(fn, *o, value);
  }
  return options;
}

// The registered method's MethodArgs from Python arguments: q, k, v, the tensors (by name) and
// the options (by name; None for an optional option means "not given").
struct PyCall {
  const linattn::MethodInfo* info;
  std::string fn;
  Inputs arrays;
  std::map<std::string, linattn::OptionValue, std::less<>> options;
  std::vector<std::string> tensor_names;

  PyCall(const linattn::MethodInfo& m, std::string function, const ArrayArg& q, const ArrayArg& k,
         const ArrayArg& v, const py::dict& tensors, const py::dict& opts)
      : info(&m), fn(std::move(function)), arrays(fn.c_str()) {
    arrays.add("q", q.obj).add("k", k.obj).add("v", v.obj);
    for (const auto& [key, value] : tensors) {
      const std::string name = py::str(key);
      const linattn::OptionInfo* o = m.option(name);
      if (!o || o->kind != linattn::OptionInfo::Kind::Tensor)
        throw py::type_error(fn + ": unexpected tensor argument '" + name + "'");
      if (value.is_none()) continue;
      names_.push_back(name);
      arrays.add(names_.back().c_str(), py::reinterpret_borrow<py::object>(value));
      tensor_names.push_back(name);
    }
    options = option_values(m, fn, opts);
  }
  template <class T>
  linattn::MethodArgs<T> args() const {
    linattn::MethodArgs<T> a;
    a.q = arrays.tensor<T>("q"), a.k = arrays.tensor<T>("k"), a.v = arrays.tensor<T>("v");
    a.options = options;
    for (const auto& name : tensor_names) a.tensors[name] = arrays.tensor<T>(name.c_str());
    return a;
  }

 private:
  std::deque<std::string> names_;  // stable storage for the names Inputs keeps by pointer
};

py::object method_forward(const std::string& name, const ArrayArg& q, const ArrayArg& k, const ArrayArg& v,
                          const py::dict& tensors, const py::dict& options, const std::vector<std::string>& want_saved) {
  const linattn::MethodInfo& m = linattn::method(name);
  const PyCall call(m, m.function, q, k, v, tensors, options);
  return by_any_dtype(call.arrays.dtype(), [&](auto tag) -> py::object {
    using T = decltype(tag);
    const linattn::MethodArgs<T> a = call.args<T>();
    linattn::MethodOutput<T> r = run_without_gil([&] { return m.functions<T>().forward(a); });
    if (want_saved.empty()) return to_numpy(std::move(r.out));
    py::list out;
    out.append(to_numpy(std::move(r.out)));
    for (const std::string& s : want_saved)
      for (auto& [saved_name, t] : r.saved)
        if (saved_name == s) out.append(to_numpy(std::move(t)));
    return py::tuple(out);
  });
}

py::tuple method_backward(const std::string& name, const ArrayArg& q, const ArrayArg& k, const ArrayArg& v,
                          const ArrayArg& dout, const py::dict& tensors, const py::dict& options,
                          const py::dict& saved) {
  const linattn::MethodInfo& m = linattn::method(name);
  const std::string fn = m.function + "_backward";
  PyCall call(m, fn, q, k, v, tensors, options);
  call.arrays.add("dout", dout.obj);
  // What the forward saved is in the accumulation dtype (float32 for bfloat16/float16 calls);
  // "out" may also come in the call's own dtype, as the forward returned it: it goes to the
  // backward as it is (SavedViews::out_as_returned), which widens it only where it must.
  std::vector<std::pair<std::string, Array>> saved_arrays;
  for (const auto& [key, value] : saved) {
    if (value.is_none()) continue;
    const std::string n = py::str(key);
    saved_arrays.emplace_back(n, as_array(fn.c_str(), n.c_str(), value));
  }
  const DType dt = call.arrays.dtype();
  return by_any_dtype(dt, [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    using A = linattn::accumulator_t<T>;
    const linattn::MethodArgs<T> a = call.args<T>();
    linattn::SavedViews<T> s;
    for (const auto& [n, arr] : saved_arrays) {
      if (arr.dtype == dtype_of<A>()) {
        s[n] = arr.template view<A>();
      } else if (dtype_of<A>() != dt && n == "out" && arr.dtype == dt) {
        s.out_as_returned = arr.template view<T>();
      } else {
        throw py::type_error(fn + ": " + n + " has dtype " + dtype_name(arr.dtype) + " but must be " +
                             dtype_name(dtype_of<A>()) + " (what the forward saves for " + dtype_name(dt) + " inputs)");
      }
    }
    linattn::AttentionGrads<T> g =
        run_without_gil([&] { return m.functions<T>().backward(a, call.arrays.tensor<T>("dout"), s); });
    py::list out;
    out.append(to_numpy(std::move(g.dq)));
    out.append(to_numpy(std::move(g.dk)));
    out.append(to_numpy(std::move(g.dv)));
    for (auto& [pname, t] : g.params) out.append(to_numpy(std::move(t)));
    return py::tuple(out);
  });
}

// The saved state's feature dimension m' for a call with these extra tensors' shapes and options
// (for linattn.torch's fake tensors, which have shapes but no data).
int64_t method_feature_dim(const std::string& name, int64_t head_dim, const py::dict& tensor_shapes,
                           const py::dict& options) {
  const linattn::MethodInfo& m = linattn::method(name);
  if (!m.feature_dim) throw py::value_error(m.function + " saves no tensor with a feature dimension");
  std::map<std::string, linattn::Shape, std::less<>> shapes;
  for (const auto& [key, value] : tensor_shapes) shapes[py::str(key)] = value.cast<linattn::Shape>();
  return m.feature_dim(head_dim, shapes, option_values(m, m.function, options));
}

// The registry as Python data, for linattn/__init__.py to build each method's functions.
py::list method_descriptions() {
  static const char* kinds[] = {"bool", "int", "float", "str", "lengths", "tensor"};
  py::list out;
  for (const linattn::MethodInfo& m : linattn::methods()) {
    py::list opts;
    for (const linattn::OptionInfo& o : m.options)
      opts.append(py::dict(py::arg("name") = o.name, py::arg("kind") = kinds[static_cast<int>(o.kind)],
                           py::arg("optional") = o.optional, py::arg("default") = o.default_value,
                           py::arg("doc") = o.doc, py::arg("choices") = o.choices,
                           py::arg("positional") = o.positional, py::arg("has_gradient") = o.has_gradient,
                           py::arg("formerly") = o.formerly, py::arg("former_choices") = o.former_choices));
    out.append(py::dict(py::arg("name") = m.name, py::arg("function") = m.function, py::arg("label") = m.label,
                        py::arg("summary") = m.summary, py::arg("docs") = m.docs,
                        py::arg("no_causal") = m.no_causal, py::arg("options") = opts,
                        py::arg("saved") = m.saved, py::arg("saved_dims") = m.saved_dims,
                        py::arg("size_name") = m.size_name,
                        py::arg("default_size") = m.default_size, py::arg("block_rows") = m.block_rows));
  }
  return out;
}

// ---- Ctrl-C ---------------------------------------------------------------------------------

// Kernels run with the GIL released, so Python cannot raise KeyboardInterrupt until they
// return. The library polls this between blocks (at most every 20 ms, on the calling thread):
// on the main thread it takes the GIL and runs Python's pending signal handlers; if one raised,
// the exception is kept here and the call ends with it (see the translator below).
std::thread::id g_main_thread;
thread_local PyObject* t_pending[3] = {nullptr, nullptr, nullptr};  // type, value, traceback

bool python_interrupt_poll() {
  if (linattn_python::Calls::get().must_park()) return true;  // a daemon thread at exit
  if (std::this_thread::get_id() != g_main_thread || !Py_IsInitialized()) return false;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  PyErr_Fetch(&t_pending[0], &t_pending[1], &t_pending[2]);
  return true;
}

// The distributed layer's agreement check compares, across ranks, a fingerprint of each
// tensor that every rank must pass alike (Linformer's E and F, FAVOR's ω, conv weights): the
// buffer's bytes as 64-bit words w_i (the last one zero-padded), h = Σ w_i + k·Σ (i+1)·w_i
// mod 2^64 (k odd, the golden-ratio constant). Integer sums, so the thread count and the
// summation order do not enter, and one pass with no temporaries: the float64 sums it replaces
// made three copies of the tensor per call, whose page faults made them cost about ten times
// their arithmetic. Returns (bytes, low 32 bits of h, high 32 bits), exact in float64.
py::tuple fingerprint(py::object obj) {
  if (!PyObject_CheckBuffer(obj.ptr()))
    throw py::type_error("_fingerprint: buffer must support the buffer protocol (a numpy.ndarray), got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  const py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
  if (!PyBuffer_IsContiguous(info.view(), 'C'))
    throw py::value_error("_fingerprint: the buffer must be C-contiguous");
  const auto* bytes = static_cast<const unsigned char*>(info.ptr);
  const size_t length = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
  uint64_t h1 = 0, h2 = 0, i = 0;
  {
    py::gil_scoped_release release;
    auto add = [&](uint64_t w) {
      h1 += w;
      h2 += ++i * w;
    };
    uint64_t w;
    size_t at = 0;
    for (; at + 8 <= length; at += 8) {
      std::memcpy(&w, bytes + at, 8);
      add(w);
    }
    if (at < length) {
      w = 0;
      std::memcpy(&w, bytes + at, length - at);
      add(w);
    }
  }
  const uint64_t h = h1 + 0x9E3779B97F4A7C15u * h2;
  return py::make_tuple(static_cast<double>(length), static_cast<double>(h & 0xffffffffu), static_cast<double>(h >> 32));
}

}  // namespace

PYBIND11_MODULE(_linattn, m) {
  m.doc() = "linattn: linear-cost attention and exact softmax attention (NumPy interface)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const linattn::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const linattn::Interrupted&) {
      if (t_pending[0]) {  // what the signal handler raised, usually KeyboardInterrupt
        PyErr_Restore(t_pending[0], t_pending[1], t_pending[2]);
        t_pending[0] = t_pending[1] = t_pending[2] = nullptr;
      } else {
        PyErr_SetNone(PyExc_KeyboardInterrupt);
      }
    }
  });
  g_main_thread = std::this_thread::get_id();  // Python imports modules on the main thread
  linattn_python::Calls::get().set_main_thread();
  linattn::set_interrupt_poll(python_interrupt_poll);
  // Before the interpreter finalizes: stop running calls and wait for them (call_guard.h).
  py::module_::import("atexit").attr("register")(
      py::cpp_function([] { linattn_python::Calls::get().exit_begins(); }));
  m.attr("__version__") = linattn::version();

  // Every registered method: linattn/__init__.py makes `<function>` and `<function>_backward`
  // with real signatures and docstrings from these descriptions.
  m.def("_methods", &method_descriptions);
  m.def("_forward", &method_forward, py::arg("name"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("tensors"), py::arg("options"), py::arg("want_saved"));
  m.def("_feature_dim", &method_feature_dim, py::arg("name"), py::arg("head_dim"), py::arg("tensor_shapes"),
        py::arg("options"));
  m.def("_plain_feature_bound", &linattn::plain_feature_bound, py::arg("feature_map"), py::arg("x_max"),
        py::arg("head_dim"));
  m.def("_backward", &method_backward, py::arg("name"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("dout"), py::arg("tensors"), py::arg("options"), py::arg("saved"));

  // The state-level operations; linattn.torch.state gives them signatures and autograd.
#define LINATTN_STATE_OPTS                                                                            \
  py::arg("feature_map"), py::arg("kernel"), py::arg("scale"), py::arg("eps"), py::arg("focus_power"), \
      py::arg("projection")
  m.def("features", &features_py, py::arg("x"), py::arg("feature_map") = "elu", py::kw_only(),
        py::arg("focus_power") = 3.0,
        R"doc(The plain feature maps of linear attention on their own, by the kernels' own code: x [B, H, n, d]
(float32 or float64, finite) -> phi(x) [B, H, n, d]. feature_map "elu" (elu(x) + 1), "relu",
"focused" (|r|·r^p/|r^p|, r = relu(x), p = focus_power in [1, 1000]) or "given" (x itself,
which must be >= 0). FAVOR's maps are in log form: feature_logits.)doc");
  m.def("features_backward", &features_backward_py, py::arg("x"), py::arg("dphi"), py::arg("feature_map") = "elu",
        py::kw_only(), py::arg("focus_power") = 3.0,
        R"doc(dx = (d phi / d x)ᵀ·dphi [B, H, n, d] of features(x, feature_map, focus_power=...).)doc");
  m.def("hedgehog_features", &hedgehog_features_py, py::arg("x"), py::arg("weight"), py::arg("bias"),
        R"doc(Hedgehog's learned feature map by the kernels' code: phi(x) = [softmax(x·W_h + b_h),
softmax(-(x·W_h + b_h))] per head h; x [B, H, n, d], weight [H, d, f], bias [H, f] (float32 or
float64, one dtype, finite) -> [B, H, n, 2f], each half summing to 1.)doc");
  m.def("hedgehog_features_backward", &hedgehog_features_backward_py, py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("dphi"), py::kw_only(), py::arg("phi") = py::none(),
        R"doc((dx, dweight, dbias) of sum(dphi * hedgehog_features(x, weight, bias)), dphi [B, H, n, 2f];
phi: the forward's result, read instead of made again (None: made from x).)doc");
  m.def("feature_logits", &feature_logits_py, py::arg("x"), py::arg("projection"), py::kw_only(),
        py::arg("kernel") = "positive", py::arg("scale") = py::none(), py::arg("side") = "key",
        R"doc(FAVOR's feature maps in log form, by the kernels' own code: (logits, factors), phi = factors·exp(logits)
up to a factor shared by every row and feature. x [B, H, n, d], projection omega [m, d] (float32 or
float64, finite); scale default 1/sqrt(d). With U = x~·omegaᵀ, x~ = sqrt(scale)·x, h = |x~|²/2:
side "key" or "query_with_norm": positive U - h, hyperbolic [U - h, -U - h], trig h; side "query"
(h cancels in a query's row): U, [U, -U], 0. factors: [sin U, cos U] for trig, else None.
"query_with_norm": a query whose weights share a normaliser with exact ones (hybrid_attention).)doc");
  m.def("feature_logits_backward", &feature_logits_backward_py, py::arg("x"), py::arg("projection"),
        py::arg("dlogits"), py::arg("dfactors") = py::none(), py::kw_only(), py::arg("kernel") = "positive",
        py::arg("scale") = py::none(), py::arg("side") = "key",
        R"doc(dx [B, H, n, d] of feature_logits for dlogits and (trig) dfactors (None: 0). The projection takes
no gradient: it is a constant of the method.)doc");
  m.def("_key_state", &key_state_py, py::arg("k"), py::arg("v"), py::arg("key_lengths"), LINATTN_STATE_OPTS);
  m.def("_key_state_backward", &key_state_backward_py, py::arg("k"), py::arg("v"), py::arg("state"), py::arg("dstate"),
        py::arg("key_lengths"), LINATTN_STATE_OPTS);
  m.def("_apply_state", &apply_state_py, py::arg("q"), py::arg("state"), LINATTN_STATE_OPTS);
  m.def("_apply_state_backward", &apply_state_backward_py, py::arg("q"), py::arg("state"), py::arg("dout"),
        py::arg("out"), py::arg("den"), LINATTN_STATE_OPTS);
  m.def("_causal_from_state", &causal_from_state_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("prefix"),
        py::arg("key_lengths"), LINATTN_STATE_OPTS);
  m.def("_causal_from_state_backward", &causal_from_state_backward_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("prefix"), py::arg("dout"), py::arg("out"), py::arg("den"), py::arg("dstate_after"),
        py::arg("key_lengths"), LINATTN_STATE_OPTS);
#undef LINATTN_STATE_OPTS
  m.def("_efficient_key_state", &efficient_key_state_py, py::arg("k"), py::arg("v"), py::arg("key_lengths"),
        py::arg("scale"));
  m.def("_efficient_key_state_backward", &efficient_key_state_backward_py, py::arg("k"), py::arg("v"), py::arg("state"),
        py::arg("dstate"), py::arg("key_lengths"), py::arg("scale"));
  m.def("_linformer_project", &linformer_project_py, py::arg("k"), py::arg("v"), py::arg("e"), py::arg("f"),
        py::arg("offset"), py::arg("key_lengths"));
  m.def("_linformer_project_backward", &linformer_project_backward_py, py::arg("k"), py::arg("v"), py::arg("e"),
        py::arg("f"), py::arg("dprojected"), py::arg("offset"), py::arg("key_lengths"), py::arg("param_grads"));
  m.def("_efficient_apply_state", &efficient_apply_state_py, py::arg("q"), py::arg("state"), py::arg("scale"));
  m.def("_efficient_apply_state_backward", &efficient_apply_state_backward_py, py::arg("q"), py::arg("state"),
        py::arg("dout"), py::arg("scale"));
  m.def("_fingerprint", &fingerprint, py::arg("buffer"),
        "(bytes, low, high 32 bits of the hash) of a C-contiguous buffer: the distributed agreement check's "
        "fingerprint of a tensor (exact integer sums of its 64-bit words, plain and position-weighted).");
  m.def("gated_linear_attention", &gated_linear_attention_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("log_gate"), py::kw_only(), py::arg("scale") = py::none(), py::arg("causal") = true,
        py::arg("initial_state") = py::none(), py::arg("return_state") = false,
        R"doc(Gated (decayed) linear attention: S_t = diag(exp(g_t))·S_{t-1} + k_t v_tᵀ, o_t = scale·S_tᵀ q_t.

q, k [B, H, n, d_k], v [B, H, n, d_v] (float32 or float64); log_gate g [B, H, n] (per head) or
[B, H, n, d_k] (per channel), values <= 0 (-inf: a reset); scale default d_k^-1/2; no
normaliser. initial_state [B, H, d_k, d_v] continues a sequence (two calls over a split equal
one call); return_state=True returns (out, S_n). Chunked (64 positions). causal=False: every
output reads every position, decayed both ways: o_t = scale·Σ_s (q_t ⊙ e_ts)ᵀ k_s v_s with e_ts
= Π exp(g_u) over min(s,t) < u <= max(s,t); no state (initial_state and return_state need
causal=True).)doc");
  m.def("gated_linear_attention_backward", &gated_linear_attention_backward_py, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("log_gate"), py::arg("dout"), py::kw_only(), py::arg("scale") = py::none(),
        py::arg("causal") = true, py::arg("initial_state") = py::none(), py::arg("dstate") = py::none(),
        R"doc((dq, dk, dv, dlog_gate, dinitial_state) of gated_linear_attention for dout [B, H, n, d_v] and
dstate, the gradient of the returned final state (None: 0). dinitial_state is the gradient of
the initial state (of zeros when none was given).)doc");
  m.def("gated_delta_rule", &gated_delta_rule_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"),
        py::arg("beta"), py::kw_only(), py::arg("scale") = py::none(), py::arg("initial_state") = py::none(),
        py::arg("return_state") = false, py::arg("use_qk_l2norm_in_kernel") = false,
        R"doc(The gated delta rule (Gated DeltaNet) and, with per-channel gates, KDA (Kimi Linear):
S_t = (I - beta_t k_t k_tᵀ)·diag(exp(g_t))·S_{t-1} + beta_t k_t v_tᵀ, o_t = scale·S_tᵀ q_t.

q, k [B, H_k, n, d_k], v [B, H, n, d_v] (float32 or float64), H a multiple of H_k (value head h
reads key head h // (H // H_k)); g [B, H, n] (per head) or [B, H, n, d_k] (per channel, KDA),
values <= 0 (-inf: a reset); beta [B, H, n] in [0, 2]; scale default d_k^-1/2.
use_qk_l2norm_in_kernel: q and k divided by sqrt(|x|² + 1e-6) first. initial_state
[B, H, d_k, d_v] continues a sequence (two calls over a split equal one call); return_state=True
returns (out, S_n). Causal, chunked (64 positions, the UT transform).)doc");
  m.def("gated_delta_rule_backward", &gated_delta_rule_backward_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("beta"), py::arg("dout"), py::kw_only(), py::arg("scale") = py::none(),
        py::arg("initial_state") = py::none(), py::arg("dstate") = py::none(),
        py::arg("use_qk_l2norm_in_kernel") = false,
        R"doc((dq, dk, dv, dg, dbeta, dinitial_state) of gated_delta_rule for dout [B, H, n, d_v] and dstate,
the gradient of the returned final state (None: 0). dq and dk have q's and k's shapes (grouped
heads summed); dinitial_state is of zeros' gradient when no initial state was given.)doc");
  m.def("hybrid_decode_step", &hybrid_decode_step_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("query_features"), py::arg("leaving_features"), py::arg("advance"), py::arg("window_weight"),
        py::arg("log_decay"), py::arg("sums"), py::arg("normaliser"), py::arg("exact_keys"), py::arg("exact_values"),
        py::arg("exact_valid"), py::arg("counts"), py::kw_only(), py::arg("window"), py::arg("sinks"), py::arg("scale"),
        py::arg("eps"), py::arg("query_weight") = py::none(), py::arg("query_bias") = py::none(),
        py::arg("key_weight") = py::none(), py::arg("key_bias") = py::none(), py::arg("feature_map") = "given",
        py::arg("focus_power") = 3.0, py::arg("projection") = py::none(), py::arg("kernel") = "positive",
        py::arg("shift") = py::none(),
        R"doc(One decoding step of the causal sliding-window + linear hybrid for every batch row and head,
in place on its state (include/linattn/hybrid.h; linattn.hf's LinattnCache runs it): q [B, H, d],
k [B, H_kv, d], v [B, H_kv, d_v] (grouped queries: H_kv divides H; query head h reads key head
h / (H / H_kv)), query_features φ(q) and leaving_features (φ of the key leaving the window, for each
query head's map) [B, H, m'], advance [B] bool, window_weight γ [H], log_decay λ [H] or None; the
state arrays sums [B, H, m', d_v], normaliser [B, H, m'], exact_keys [B, H_kv, s + w, d],
exact_values [B, H_kv, s + w, d_v] (q's dtype),
exact_valid [B, s + w] bool and counts [B] int64 are changed in place. Returns out [B, H, d_v].
With Hedgehog's maps (query_weight, key_weight [H, d, f], query_bias, key_bias [H, f], all four)
the step makes both features itself (hedgehog_features' formula, m' = 2f): pass None for
query_features and leaving_features. So it does with feature_map "elu", "relu" or "focused"
(focus_power; features()' formula, m' = d); "given" (the default) takes the features passed.
window=0 (sinks 0, exact arrays of 0 slots) is linear attention's step: the new key enters the
sums at once (leaving_features are its features). feature_map="favor" with projection ω
[num_features, d] and kernel ("positive", "hyperbolic"; "trig" with window 0): FAVOR+'s features
made by the step in log form, shift [B, H, m'] the sums' per-feature scales (-inf: no key yet),
changed in place with them.)doc");
  m.def("hybrid_prefill", &hybrid_prefill_py, py::arg("k"), py::arg("v"), py::arg("key_features"), py::arg("valid"),
        py::arg("log_decay"), py::arg("sums"), py::arg("normaliser"), py::arg("exact_keys"), py::arg("exact_values"),
        py::arg("exact_valid"), py::arg("counts"), py::kw_only(), py::arg("window"), py::arg("sinks"),
        py::arg("key_weight") = py::none(), py::arg("key_bias") = py::none(), py::arg("feature_map") = "given",
        py::arg("focus_power") = 3.0, py::arg("projection") = py::none(), py::arg("kernel") = "positive",
        py::arg("scale") = 0.0, py::arg("shift") = py::none(),
        R"doc(The causal sliding-window + linear hybrid's decoding state after a prompt, written over the
state arrays (include/linattn/hybrid.h; linattn.hf's LinattnCache runs it once per layer after
the prompt): what hybrid_decode_step continues from, as if the prompt's tokens had been stepped
through it. k [B, H_kv, n, d], v [B, H_kv, n, d_v]; valid [B, n] bool marks each row's tokens
(None: all of them); key_features φ(k) [B, H, n, m'] of each query head's map on its key head's
keys; log_decay λ [H] or None; sums [B, H, m', d_v], normaliser [B, H, m'], exact_keys
[B, H_kv, s + w, d], exact_values [B, H_kv, s + w, d_v] (k's dtype), exact_valid [B, s + w] bool
and counts [B] int64 are overwritten. Of a row's c tokens, the last w fill the ring (token i at
slot s + i mod w), the first s of the others the sink slots, and the rest enter the sums weighed
by e^{λ_h·(c − 1 − i)}. With Hedgehog's key map (key_weight [H, d, f], key_bias [H, f]) or
feature_map "elu", "relu" or "focused" (focus_power) the prefill makes the features itself: pass
None for key_features. feature_map="favor" with projection, kernel and scale (x̃ = √scale·x): FAVOR+'s
features in log form, shift [B, H, m'] overwritten with the sums' per-feature scales. Returns None.)doc");
  m.def("causal_conv1d", &causal_conv1d_py, py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        py::kw_only(), py::arg("initial_state") = py::none(), py::arg("return_state") = false,
        py::arg("activation") = "silu",
        R"doc(The causal depthwise convolution in front of gated-delta-rule and KDA layers (causal_conv1d_fn):
out[b,c,t] = act(bias[c] + Σ_j weight[c,j]·x̃[b,c,t+j]), x̃ = x [B, C, T] (float32 or float64) with
the W-1 positions before it in front: initial_state [B, C, W-1] (the last inputs of the previous
call), zeros without one. weight [C, W], bias [C] or None; activation "silu" (or "swish") or
None. return_state=True returns (out, final state [B, C, W-1]): two calls over a split equal one
call.)doc");
  m.def("causal_conv1d_backward", &causal_conv1d_backward_py, py::arg("x"), py::arg("weight"), py::arg("dout"),
        py::kw_only(), py::arg("bias") = py::none(), py::arg("initial_state") = py::none(),
        py::arg("dstate") = py::none(), py::arg("activation") = "silu",
        R"doc((dx, dweight, dbias, dinitial_state) of causal_conv1d for dout [B, C, T] and dstate (None: 0);
dbias is None without a bias, dinitial_state of zeros' gradient without an initial state.)doc");
  m.def("random_features", &random_features, py::arg("num_features"), py::arg("head_dim"),
        py::arg("kind") = "orthogonal", py::arg("seed") = 0, py::arg("dtype") = py::dtype::of<float>(),
        R"doc(Random projection ω [num_features, head_dim] for FAVOR attention.

kind: "iid" (rows N(0, I)), "orthogonal" (blocks of head_dim orthogonal rows, norms ~ chi(d)),
"orthogonal_fixed" (norms sqrt(d)), "quantile" (norms the chi(d) quantiles at i/(m+1), in a
seeded order). Same seed, same matrix on every machine and thread count.)doc");
  m.def("chi_quantile_radii", &chi_quantile_radii, py::arg("num_features"), py::arg("head_dim"),
        "The radii R_i, P(r <= R_i) = i/(m+1) for r ~ chi(head_dim), i = 1..m (sorted).");
  py::class_<PyRecurrentState>(m, "RecurrentState",
                               "Constant-size decoding state; make one with recurrent_state().")
      .def("prefill", &PyRecurrentState::prefill, py::arg("q"), py::arg("k"), py::arg("v"),
           "[B,H,n,d] in, [B,H,n,d_v] out: causal outputs of n tokens, chunked.")
      .def("step", &PyRecurrentState::step, py::arg("q_t"), py::arg("k_t"), py::arg("v_t"),
           "[B,H,d] in, [B,H,d_v] out: one token.")
      .def("copy", &PyRecurrentState::copy, "An independent copy, to roll back to (or for another thread).")
      .def_property_readonly("tokens", &PyRecurrentState::tokens)
      .def_property_readonly("dtype", &PyRecurrentState::dtype);
  m.def("recurrent_state", &recurrent_state, py::arg("batch"), py::arg("heads"),
        py::arg("head_dim"), py::arg("value_dim"), py::kw_only(), py::arg("feature_map") = "elu",
        py::arg("projection") = py::none(), py::arg("kernel") = "positive",
        py::arg("scale") = py::none(), py::arg("eps") = 1e-6, py::arg("focus_power") = 3.0,
        py::arg("dtype") = py::none(),
        R"doc(A decoding state for feature_map "elu", "relu", "focused" or "favor" (with projection).

dtype: float32 or float64 (default: the projection's, else float32). Step outputs equal the
causal outputs of linear_attention / favor_attention over the same tokens. A state holds one
batch of sequences: using it from two threads at once raises ValueError (copy() it instead).)doc");
  m.def("linformer_projections", &linformer_projections, py::arg("s_proj"), py::arg("n_max"),
        py::kw_only(), py::arg("heads") = py::none(), py::arg("seed") = 0,
        py::arg("dtype") = py::dtype::of<float>(),
        R"doc((e, f) initialised as fairseq's Linformer does: Xavier-uniform, gain 1/sqrt(2),
i.e. uniform on (-a, a), a = sqrt(3 / (n_max + s_proj)). heads=None: shared [s_proj, n_max];
else [heads, s_proj, n_max]. Reproducible by seed.)doc");
  m.def("set_num_threads", &linattn::set_num_threads, py::arg("n"),
        "Threads used by every kernel, 1..1024 (default: LINATTN_NUM_THREADS; else, under linattn.torch, "
        "torch's thread count, followed as it changes; else all cores).");
  m.def("get_num_threads", &linattn::num_threads);
  m.def("share_openmp_runtime", &linattn::share_openmp_runtime, py::arg("through") = "",
        R"doc(Runs the kernels' loops on the OpenMP runtime already loaded in the process, not on
linattn's own helper threads, and returns its file ('' when none is found: nothing changes).
through: a loaded library whose runtime to share (linattn.torch passes 'libtorch_cpu.so', so that
it is torch's, whatever its file is called); '' looks for libgomp.so.1, then libiomp5.so.
linattn.torch does so at import when torch runs on OpenMP, since OpenMP's idle workers spin for
milliseconds after each torch operation and would take the cores from linattn's helpers. Results
are the same bits either way. A forked child goes back to linattn's own threads.)doc");
  m.def("use_own_threads", &linattn::use_own_threads, "Back to linattn's own helper threads (the default).");
  m.def("thread_pool", &linattn::thread_pool, "Which threads run the kernels' loops: 'own' or 'openmp <file>'.");
  m.def("build_info", &linattn::build_info, "The BLAS (and its kernels) and SIMD target this build runs on.");
  m.def("measure_peak_rates", [](std::optional<int> threads) {
    const int t = threads.value_or(linattn::num_threads());
    linattn::PeakRates r;
    {
      py::gil_scoped_release release;
      r = linattn::measure_peak_rates(t);
    }
    return py::dict(py::arg("float32_fma_gflops") = r.float32_fma_gflops,
                    py::arg("bfloat16_dot_gflops") = r.bfloat16_dot_gflops);
  }, py::arg("threads") = py::none(),
        R"doc(The measured arithmetic peak of `threads` threads (default: get_num_threads()), in GFLOP/s:
{"float32_fma_gflops", "bfloat16_dot_gflops"} from register-only loops of float32 FMAs and of
bfloat16 dot products (vdpbf16ps; 0.0 where the CPU has no AVX512-BF16), the best of 3 runs of
about 0.2 s each. What the benchmarks' "% of peak" divides by. threads outside 1..1024: ValueError.)doc");
  m.def("workspace_stats", [] {
    const auto s = linattn::workspace_stats();
    return py::dict(py::arg("current_bytes") = s.current_bytes, py::arg("peak_bytes") = s.peak_bytes);
  }, "Scratch memory the library holds now and at its peak since reset_workspace_peak().");
  m.def("reset_workspace_peak", &linattn::reset_workspace_peak);
  m.def("release_cached_memory", [] { return linattn::release_cached_memory(); },
        R"doc(Give back to the OS the freed blocks of 1 MiB and more that the library keeps for its next
calls (at most 64 blocks, 256 MiB in all; reusing them skips the page faults and zeroing of fresh
memory). Returns the bytes given back.)doc");
}
