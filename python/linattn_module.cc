// Python bindings: NumPy arrays in and out, [batch, heads, seq, head_dim], float32 or float64.
// linattn::Error becomes ValueError; a wrong type or dtype is a TypeError. The GIL is released
// while kernels run.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "linattn/linattn.h"

namespace py = pybind11;
using linattn::AttentionOptions;
using linattn::Tensor;
using linattn::TensorView;

namespace {

enum class DType { F32, F64 };

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
  if (dt.kind() != 'f') return std::nullopt;
  if (dt.itemsize() == 4) return DType::F32;
  if (dt.itemsize() == 8) return DType::F64;
  return std::nullopt;
}

// Float data in the other byte order is refused, not converted behind the caller's back.
[[noreturn]] void foreign_byte_order(const char* fn, const char* name, const py::dtype& dt) {
  const std::string order = dt.byteorder() == '>' ? "big-endian" : "little-endian";
  const std::string type = dt.itemsize() == 4 ? "float32" : "float64";
  throw py::type_error(std::string(fn) + ": " + name + " has dtype " + order + " " + type + " ('" +
                       std::string(py::str(dt.attr("str"))) + "'); linattn takes the machine's byte order: convert with " +
                       name + ".astype(numpy." + type + ")");
}

Array as_array(const char* fn, const char* name, const py::handle& obj) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(std::string(fn) + ": " + name + " must be a numpy.ndarray, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  auto a = py::reinterpret_borrow<py::array>(obj);
  const std::optional<DType> dt = float_dtype(a.dtype());
  if (!dt)
    throw py::type_error(std::string(fn) + ": " + name + " must have dtype float32 or float64, got " +
                         std::string(py::str(a.dtype())));
  if (!a.dtype().attr("isnative").cast<bool>()) foreign_byte_order(fn, name, a.dtype());
  if (!(a.flags() & py::array::c_style)) a = py::array::ensure(a, py::array::c_style);
  return {a, *dt};
}

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

// Runs fn(float{}) or fn(double{}) by dtype.
template <class Fn>
auto by_dtype(DType dt, Fn&& fn) {
  return dt == DType::F32 ? fn(float{}) : fn(double{});
}

std::optional<double> as_scale(const char* fn, const py::object& scale) {
  if (scale.is_none()) return std::nullopt;
  if (!py::isinstance<py::float_>(scale) && !py::isinstance<py::int_>(scale))
    throw py::type_error(std::string(fn) + ": scale must be a float or None");
  return scale.cast<double>();
}

AttentionOptions make_options(const char* fn, bool causal, const py::object& scale,
                              const py::object& key_lengths) {
  AttentionOptions o;
  o.causal = causal;
  o.scale = as_scale(fn, scale);
  o.key_lengths = as_lengths(fn, key_lengths);
  return o;
}

// Hands a tensor's memory to NumPy without a copy.
template <class T>
py::array to_numpy(Tensor<T>&& t) {
  auto* owned = new Tensor<T>(std::move(t));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<Tensor<T>*>(p); });
  return py::array_t<T>(owned->shape(), owned->data(), free_when_done);
}

py::object softmax_attention(const py::object& q, const py::object& k, const py::object& v,
                             bool causal, const py::object& scale, const py::object& key_lengths,
                             bool return_lse) {
  const char* fn = "softmax_attention";
  const Array Q = as_array(fn, "q", q), K = as_array(fn, "k", k), V = as_array(fn, "v", v);
  const AttentionOptions o = make_options(fn, causal, scale, key_lengths);
  auto run = [&](auto tag) -> py::object {
    using T = decltype(tag);
    linattn::SoftmaxAttentionResult<T> r;
    {
      py::gil_scoped_release nogil;
      r = linattn::softmax_attention<T>(Q.view<T>(), K.view<T>(), V.view<T>(), o);
    }
    if (return_lse) return py::make_tuple(to_numpy(std::move(r.out)), to_numpy(std::move(r.lse)));
    return to_numpy(std::move(r.out));
  };
  return common_dtype(fn, {{"q", &Q}, {"k", &K}, {"v", &V}}) == DType::F32 ? run(float{})
                                                                           : run(double{});
}

py::tuple softmax_attention_backward(const py::object& q, const py::object& k,
                                     const py::object& v, const py::object& dout, bool causal,
                                     const py::object& scale, const py::object& key_lengths,
                                     const py::object& out, const py::object& lse) {
  const char* fn = "softmax_attention_backward";
  const Array Q = as_array(fn, "q", q), K = as_array(fn, "k", k), V = as_array(fn, "v", v),
              G = as_array(fn, "dout", dout);
  const AttentionOptions o = make_options(fn, causal, scale, key_lengths);
  if (out.is_none() != lse.is_none())
    throw py::value_error(std::string(fn) + ": pass both out and lse (from the forward), or neither");
  std::optional<Array> O, L;
  std::vector<std::pair<const char*, const Array*>> all{{"q", &Q}, {"k", &K}, {"v", &V}, {"dout", &G}};
  if (!out.is_none()) {
    O = as_array(fn, "out", out);
    L = as_array(fn, "lse", lse);
    all.push_back({"out", &*O});
    all.push_back({"lse", &*L});
  }
  auto run = [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    linattn::AttentionGrads<T> g;
    {
      py::gil_scoped_release nogil;
      g = O ? linattn::softmax_attention_backward<T>(Q.view<T>(), K.view<T>(), V.view<T>(),
                                                     G.view<T>(), O->view<T>(), L->view<T>(), o)
            : linattn::softmax_attention_backward<T>(Q.view<T>(), K.view<T>(), V.view<T>(),
                                                     G.view<T>(), o);
    }
    return py::make_tuple(to_numpy(std::move(g.dq)), to_numpy(std::move(g.dk)),
                          to_numpy(std::move(g.dv)));
  };
  return common_dtype(fn, all) == DType::F32 ? run(float{}) : run(double{});
}

// ---- kernelized --------------------------------------------------------------------------

DType dtype_arg(const char* fn, const py::object& dtype) {
  const py::dtype dt = py::dtype::from_args(dtype);
  const std::optional<DType> f = float_dtype(dt);
  if (!f)
    throw py::type_error(std::string(fn) + ": dtype must be float32 or float64, got " +
                         std::string(py::str(py::object(dt))));
  if (!dt.attr("isnative").cast<bool>())
    throw py::type_error(std::string(fn) + ": dtype must be float32 or float64 in the machine's byte order, got '" +
                         std::string(py::str(dt.attr("str"))) + "'");
  return *f;
}

py::array random_features(int64_t num_features, int64_t head_dim, const std::string& kind,
                          uint64_t seed, const py::object& dtype) {
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

linattn::LinearAttentionOptions linear_options(const char* fn, const std::string& feature_map,
                                               bool causal, const py::object& key_lengths,
                                               double eps, double focus_power) {
  linattn::LinearAttentionOptions o;
  o.feature_map = feature_map;
  o.causal = causal;
  o.key_lengths = as_lengths(fn, key_lengths);
  o.eps = eps;
  o.focus_power = focus_power;
  return o;
}

py::object linear_attention(const py::object& q, const py::object& k, const py::object& v,
                            const std::string& feature_map, bool causal,
                            const py::object& key_lengths, double eps, double focus_power,
                            const py::object& dwc_weight) {
  const char* fn = "linear_attention";
  const Array Q = as_array(fn, "q", q), K = as_array(fn, "k", k), V = as_array(fn, "v", v);
  std::vector<std::pair<const char*, const Array*>> all{{"q", &Q}, {"k", &K}, {"v", &V}};
  std::optional<Array> W;
  if (!dwc_weight.is_none()) {
    W = as_array(fn, "dwc_weight", dwc_weight);
    all.push_back({"dwc_weight", &*W});
  }
  const auto o = linear_options(fn, feature_map, causal, key_lengths, eps, focus_power);
  return by_dtype(common_dtype(fn, all), [&](auto tag) -> py::object {
    using T = decltype(tag);
    std::optional<TensorView<const T>> w;
    if (W) w = W->view<T>();
    Tensor<T> out;
    {
      py::gil_scoped_release nogil;
      out = linattn::linear_attention<T>(Q.view<T>(), K.view<T>(), V.view<T>(), o, w);
    }
    return to_numpy(std::move(out));
  });
}

py::tuple linear_attention_backward(const py::object& q, const py::object& k, const py::object& v,
                                    const py::object& dout, const std::string& feature_map,
                                    bool causal, const py::object& key_lengths, double eps,
                                    double focus_power, const py::object& dwc_weight) {
  const char* fn = "linear_attention_backward";
  const Array Q = as_array(fn, "q", q), K = as_array(fn, "k", k), V = as_array(fn, "v", v),
              G = as_array(fn, "dout", dout);
  std::vector<std::pair<const char*, const Array*>> all{{"q", &Q}, {"k", &K}, {"v", &V}, {"dout", &G}};
  std::optional<Array> W;
  if (!dwc_weight.is_none()) {
    W = as_array(fn, "dwc_weight", dwc_weight);
    all.push_back({"dwc_weight", &*W});
  }
  const auto o = linear_options(fn, feature_map, causal, key_lengths, eps, focus_power);
  return by_dtype(common_dtype(fn, all), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    std::optional<TensorView<const T>> w;
    if (W) w = W->view<T>();
    linattn::AttentionGrads<T> g;
    {
      py::gil_scoped_release nogil;
      g = linattn::linear_attention_backward<T>(Q.view<T>(), K.view<T>(), V.view<T>(), G.view<T>(), o, w);
    }
    if (W)
      return py::make_tuple(to_numpy(std::move(g.dq)), to_numpy(std::move(g.dk)),
                            to_numpy(std::move(g.dv)), to_numpy(std::move(g.params[0].second)));
    return py::make_tuple(to_numpy(std::move(g.dq)), to_numpy(std::move(g.dk)), to_numpy(std::move(g.dv)));
  });
}

linattn::FavorOptions favor_options(const char* fn, const std::string& kernel, bool causal,
                                    const py::object& key_lengths, const py::object& scale) {
  linattn::FavorOptions o;
  o.kernel = kernel;
  o.causal = causal;
  o.key_lengths = as_lengths(fn, key_lengths);
  o.scale = as_scale(fn, scale);
  return o;
}

py::array favor_attention(const py::object& q, const py::object& k, const py::object& v,
                          const py::object& projection, const std::string& kernel, bool causal,
                          const py::object& key_lengths, const py::object& scale) {
  const char* fn = "favor_attention";
  const Array Q = as_array(fn, "q", q), K = as_array(fn, "k", k), V = as_array(fn, "v", v),
              W = as_array(fn, "projection", projection);
  const auto o = favor_options(fn, kernel, causal, key_lengths, scale);
  return by_dtype(common_dtype(fn, {{"q", &Q}, {"k", &K}, {"v", &V}, {"projection", &W}}),
                  [&](auto tag) -> py::array {
                    using T = decltype(tag);
                    Tensor<T> out;
                    {
                      py::gil_scoped_release nogil;
                      out = linattn::favor_attention<T>(Q.view<T>(), K.view<T>(), V.view<T>(), W.view<T>(), o);
                    }
                    return to_numpy(std::move(out));
                  });
}

py::tuple favor_attention_backward(const py::object& q, const py::object& k, const py::object& v,
                                   const py::object& projection, const py::object& dout,
                                   const std::string& kernel, bool causal,
                                   const py::object& key_lengths, const py::object& scale) {
  const char* fn = "favor_attention_backward";
  const Array Q = as_array(fn, "q", q), K = as_array(fn, "k", k), V = as_array(fn, "v", v),
              W = as_array(fn, "projection", projection), G = as_array(fn, "dout", dout);
  const auto o = favor_options(fn, kernel, causal, key_lengths, scale);
  return by_dtype(
      common_dtype(fn, {{"q", &Q}, {"k", &K}, {"v", &V}, {"projection", &W}, {"dout", &G}}),
      [&](auto tag) -> py::tuple {
        using T = decltype(tag);
        linattn::AttentionGrads<T> g;
        {
          py::gil_scoped_release nogil;
          g = linattn::favor_attention_backward<T>(Q.view<T>(), K.view<T>(), V.view<T>(), W.view<T>(),
                                                   G.view<T>(), o);
        }
        return py::make_tuple(to_numpy(std::move(g.dq)), to_numpy(std::move(g.dk)),
                              to_numpy(std::move(g.dv)));
      });
}

// RecurrentState of either dtype behind one Python class.
class PyRecurrentState {
 public:
  using Variant = std::variant<linattn::RecurrentState<float>, linattn::RecurrentState<double>>;
  explicit PyRecurrentState(Variant s) : s_(std::move(s)) {}

  py::array prefill(const py::object& q, const py::object& k, const py::object& v) {
    const char* fn = "RecurrentState.prefill";
    const Array Q = as_array(fn, "q", q), K = as_array(fn, "k", k), V = as_array(fn, "v", v);
    check_dtype(fn, common_dtype(fn, {{"q", &Q}, {"k", &K}, {"v", &V}}));
    return std::visit([&](auto& st) -> py::array { return run_prefill(st, Q, K, V); }, s_);
  }
  py::array step(const py::object& q, const py::object& k, const py::object& v) {
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
    if ((dt == DType::F32) != (s_.index() == 0))
      throw py::type_error(std::string(fn) + ": inputs have dtype " +
                           (dt == DType::F32 ? "float32" : "float64") + " but the state is " +
                           (s_.index() == 0 ? "float32" : "float64"));
  }
  template <class T>
  static py::array run_prefill(linattn::RecurrentState<T>& st, const Array& Q, const Array& K,
                               const Array& V) {
    Tensor<T> out;
    {
      py::gil_scoped_release nogil;
      out = st.prefill(Q.view<T>(), K.view<T>(), V.view<T>());
    }
    return to_numpy(std::move(out));
  }
  template <class T>
  static py::array run_step(linattn::RecurrentState<T>& st, const Array& Q, const Array& K,
                            const Array& V) {
    Tensor<T> out;
    {
      py::gil_scoped_release nogil;
      out = st.step(Q.view<T>(), K.view<T>(), V.view<T>());
    }
    return to_numpy(std::move(out));
  }
  Variant s_;
};

PyRecurrentState recurrent_state(int64_t batch, int64_t heads, int64_t head_dim, int64_t value_dim,
                                 const std::string& feature_map, const py::object& projection,
                                 const std::string& kernel, const py::object& scale, double eps,
                                 double focus_power, const py::object& dtype) {
  const char* fn = "recurrent_state";
  linattn::RecurrentOptions o;
  o.feature_map = feature_map;
  o.eps = eps;
  o.focus_power = focus_power;
  o.scale = as_scale(fn, scale);
  // kernel's default "positive" is the FAVOR+ choice; any other value needs feature_map="favor".
  if (feature_map == "favor" || kernel != "positive") o.kernel = kernel;
  std::optional<Array> W;
  if (!projection.is_none()) W = as_array(fn, "projection", projection);
  DType dt = DType::F32;
  if (!dtype.is_none()) dt = dtype_arg(fn, dtype);
  else if (W) dt = W->dtype;
  if (W && W->dtype != dt)
    throw py::type_error(std::string(fn) + ": projection has dtype " + std::string(py::str(W->arr.dtype())) +
                         " but dtype is " + (dt == DType::F32 ? "float32" : "float64"));
  return by_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    std::optional<TensorView<const T>> w;
    if (W) w = W->view<T>();
    return PyRecurrentState(PyRecurrentState::Variant(
        linattn::RecurrentState<T>(batch, heads, head_dim, value_dim, o, w)));
  });
}

// ---- Nyström, Linformer, Efficient Attention ----------------------------------------------

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
    return common_dtype(fn_, all);
  }
  template <class T>
  std::optional<TensorView<const T>> optional(const char* name) const {
    for (const auto& [n, a] : arrays_)
      if (std::string(n) == name) return a.template view<T>();
    return std::nullopt;
  }
  template <class T>
  TensorView<const T> tensor(const char* name) const { return *optional<T>(name); }

 private:
  const char* fn_;
  std::vector<std::pair<const char*, Array>> arrays_;
};

template <class... Ts>
py::tuple numpy_tuple(Ts&&... ts) {
  return py::make_tuple(to_numpy(std::move(ts))...);
}

linattn::NystromOptions nystrom_options(const char* fn, int64_t num_landmarks, int64_t pinv_iterations,
                                        const std::string& pinv, const py::object& key_lengths,
                                        const py::object& scale, bool causal) {
  linattn::NystromOptions o;
  o.num_landmarks = num_landmarks;
  o.pinv_iterations = pinv_iterations;
  o.pinv = pinv;
  o.key_lengths = as_lengths(fn, key_lengths);
  o.scale = as_scale(fn, scale);
  o.causal = causal;
  return o;
}

py::array nystrom_attention(const py::object& q, const py::object& k, const py::object& v,
                            int64_t num_landmarks, int64_t pinv_iterations, const std::string& pinv,
                            const py::object& conv_weight, const py::object& key_lengths,
                            const py::object& scale, bool causal) {
  const char* fn = "nystrom_attention";
  Inputs in(fn);
  in.add("q", q).add("k", k).add("v", v).add("conv_weight", conv_weight);
  const auto o = nystrom_options(fn, num_landmarks, pinv_iterations, pinv, key_lengths, scale, causal);
  return by_dtype(in.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    Tensor<T> out;
    {
      py::gil_scoped_release nogil;
      out = linattn::nystrom_attention<T>(in.tensor<T>("q"), in.tensor<T>("k"),
                                          in.tensor<T>("v"), o, in.optional<T>("conv_weight"));
    }
    return to_numpy(std::move(out));
  });
}

py::tuple nystrom_attention_backward(const py::object& q, const py::object& k, const py::object& v,
                                     const py::object& dout, int64_t num_landmarks,
                                     int64_t pinv_iterations, const std::string& pinv,
                                     const py::object& conv_weight, const py::object& key_lengths,
                                     const py::object& scale, bool causal) {
  const char* fn = "nystrom_attention_backward";
  Inputs in(fn);
  in.add("q", q).add("k", k).add("v", v).add("dout", dout).add("conv_weight", conv_weight);
  const auto o = nystrom_options(fn, num_landmarks, pinv_iterations, pinv, key_lengths, scale, causal);
  return by_dtype(in.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    linattn::AttentionGrads<T> g;
    {
      py::gil_scoped_release nogil;
      g = linattn::nystrom_attention_backward<T>(
          in.tensor<T>("q"), in.tensor<T>("k"), in.tensor<T>("v"),
          in.tensor<T>("dout"), o, in.optional<T>("conv_weight"));
    }
    if (conv_weight.is_none()) return numpy_tuple(std::move(g.dq), std::move(g.dk), std::move(g.dv));
    return numpy_tuple(std::move(g.dq), std::move(g.dk), std::move(g.dv), std::move(g.params[0].second));
  });
}

linattn::LinformerOptions linformer_options(const char* fn, const py::object& key_lengths,
                                            const py::object& scale, bool causal) {
  linattn::LinformerOptions o;
  o.key_lengths = as_lengths(fn, key_lengths);
  o.scale = as_scale(fn, scale);
  o.causal = causal;
  return o;
}

py::array linformer_attention(const py::object& q, const py::object& k, const py::object& v,
                              const py::object& e, const py::object& f, const py::object& key_lengths,
                              const py::object& scale, bool causal) {
  const char* fn = "linformer_attention";
  Inputs in(fn);
  in.add("q", q).add("k", k).add("v", v).add("e", e).add("f", f);
  const auto o = linformer_options(fn, key_lengths, scale, causal);
  return by_dtype(in.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    Tensor<T> out;
    {
      py::gil_scoped_release nogil;
      out = linattn::linformer_attention<T>(in.tensor<T>("q"), in.tensor<T>("k"),
                                            in.tensor<T>("v"), in.tensor<T>("e"),
                                            in.tensor<T>("f"), o);
    }
    return to_numpy(std::move(out));
  });
}

py::tuple linformer_attention_backward(const py::object& q, const py::object& k, const py::object& v,
                                       const py::object& e, const py::object& f, const py::object& dout,
                                       const py::object& key_lengths, const py::object& scale,
                                       bool causal) {
  const char* fn = "linformer_attention_backward";
  Inputs in(fn);
  in.add("q", q).add("k", k).add("v", v).add("e", e).add("f", f).add("dout", dout);
  const auto o = linformer_options(fn, key_lengths, scale, causal);
  return by_dtype(in.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    linattn::AttentionGrads<T> g;
    {
      py::gil_scoped_release nogil;
      g = linattn::linformer_attention_backward<T>(
          in.tensor<T>("q"), in.tensor<T>("k"), in.tensor<T>("v"),
          in.tensor<T>("e"), in.tensor<T>("f"), in.tensor<T>("dout"), o);
    }
    return numpy_tuple(std::move(g.dq), std::move(g.dk), std::move(g.dv), std::move(g.params[0].second),
                       std::move(g.params[1].second));
  });
}

py::tuple linformer_projections(int64_t s_proj, int64_t n_max, const py::object& heads, uint64_t seed,
                                const py::object& dtype) {
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

linattn::EfficientAttentionOptions efficient_options(const char* fn, const py::object& key_lengths,
                                                     const py::object& scale, bool causal) {
  linattn::EfficientAttentionOptions o;
  o.key_lengths = as_lengths(fn, key_lengths);
  o.scale = as_scale(fn, scale);
  o.causal = causal;
  return o;
}

py::array efficient_attention(const py::object& q, const py::object& k, const py::object& v,
                              const py::object& key_lengths, const py::object& scale, bool causal) {
  const char* fn = "efficient_attention";
  Inputs in(fn);
  in.add("q", q).add("k", k).add("v", v);
  const auto o = efficient_options(fn, key_lengths, scale, causal);
  return by_dtype(in.dtype(), [&](auto tag) -> py::array {
    using T = decltype(tag);
    Tensor<T> out;
    {
      py::gil_scoped_release nogil;
      out = linattn::efficient_attention<T>(in.tensor<T>("q"), in.tensor<T>("k"),
                                            in.tensor<T>("v"), o);
    }
    return to_numpy(std::move(out));
  });
}

py::tuple efficient_attention_backward(const py::object& q, const py::object& k, const py::object& v,
                                       const py::object& dout, const py::object& key_lengths,
                                       const py::object& scale, bool causal) {
  const char* fn = "efficient_attention_backward";
  Inputs in(fn);
  in.add("q", q).add("k", k).add("v", v).add("dout", dout);
  const auto o = efficient_options(fn, key_lengths, scale, causal);
  return by_dtype(in.dtype(), [&](auto tag) -> py::tuple {
    using T = decltype(tag);
    linattn::AttentionGrads<T> g;
    {
      py::gil_scoped_release nogil;
      g = linattn::efficient_attention_backward<T>(in.tensor<T>("q"), in.tensor<T>("k"),
                                                   in.tensor<T>("v"),
                                                   in.tensor<T>("dout"), o);
    }
    return numpy_tuple(std::move(g.dq), std::move(g.dk), std::move(g.dv));
  });
}

// ---- Ctrl-C ---------------------------------------------------------------------------------

// Kernels run with the GIL released, so Python cannot raise KeyboardInterrupt until they
// return. The library polls this between blocks (at most every 20 ms, on the calling thread):
// on the main thread it takes the GIL and runs Python's pending signal handlers; if one raised,
// the exception is kept here and the call ends with it (see the translator below).
std::thread::id g_main_thread;
thread_local PyObject* t_pending[3] = {nullptr, nullptr, nullptr};  // type, value, traceback

bool python_interrupt_poll() {
  if (std::this_thread::get_id() != g_main_thread || !Py_IsInitialized()) return false;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  PyErr_Fetch(&t_pending[0], &t_pending[1], &t_pending[2]);
  return true;
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
  linattn::set_interrupt_poll(python_interrupt_poll);

  m.def("softmax_attention", &softmax_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::kw_only(), py::arg("causal") = false, py::arg("scale") = py::none(),
        py::arg("key_lengths") = py::none(), py::arg("return_lse") = false,
        R"doc(Exact attention softmax(q·kᵀ·scale + mask)·v.

q [B,H,n_q,d], k [B,H,n_k,d], v [B,H,n_k,d_v], float32 or float64 (all the same).
causal: query i sees keys j <= i + n_k - n_q. key_lengths: one int per batch item; keys at
positions >= key_lengths[b] are ignored. scale defaults to 1/sqrt(d).
Returns out [B,H,n_q,d_v], or (out, lse [B,H,n_q]) with return_lse=True. Rows that see no key
get zeros (lse = -inf).)doc");
  m.def("softmax_attention_backward", &softmax_attention_backward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("dout"), py::kw_only(), py::arg("causal") = false,
        py::arg("scale") = py::none(), py::arg("key_lengths") = py::none(),
        py::arg("out") = py::none(), py::arg("lse") = py::none(),
        R"doc(Gradients (dq, dk, dv) of sum(dout * softmax_attention(q, k, v, ...)).

Pass out and lse from softmax_attention(..., return_lse=True) to skip recomputing the forward.)doc");
  m.def("random_features", &random_features, py::arg("num_features"), py::arg("head_dim"),
        py::arg("kind") = "orthogonal", py::arg("seed") = 0, py::arg("dtype") = py::dtype::of<float>(),
        R"doc(Random projection ω [num_features, head_dim] for FAVOR attention.

kind: "iid" (rows N(0, I)), "orthogonal" (blocks of head_dim orthogonal rows, norms ~ chi(d)),
"orthogonal_fixed" (norms sqrt(d)), "quantile" (norms the chi(d) quantiles at i/(m+1), in a
seeded order). Same seed, same matrix on every machine and thread count.)doc");
  m.def("chi_quantile_radii", &chi_quantile_radii, py::arg("num_features"), py::arg("head_dim"),
        "The radii R_i, P(r <= R_i) = i/(m+1) for r ~ chi(head_dim), i = 1..m (sorted).");
  m.def("linear_attention", &linear_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::kw_only(), py::arg("feature_map") = "elu", py::arg("causal") = false,
        py::arg("key_lengths") = py::none(), py::arg("eps") = 1e-6, py::arg("focus_power") = 3.0,
        py::arg("dwc_weight") = py::none(),
        R"doc(Kernelized attention φ(q)(φ(k)ᵀv) / (φ(q)·Σφ(k) + eps) in O(n).

feature_map: "elu" (elu+1), "relu", "focused" (relu, then ‖x‖·xᵖ/‖xᵖ‖ with p = focus_power).
causal: query i sees keys j <= i (n_q == n_k). dwc_weight [heads, K]: adds a depthwise
convolution of v along the sequence (K odd unless causal).)doc");
  m.def("linear_attention_backward", &linear_attention_backward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("dout"), py::kw_only(), py::arg("feature_map") = "elu",
        py::arg("causal") = false, py::arg("key_lengths") = py::none(), py::arg("eps") = 1e-6,
        py::arg("focus_power") = 3.0, py::arg("dwc_weight") = py::none(),
        "Gradients (dq, dk, dv[, d_dwc_weight]) of sum(dout * linear_attention(...)).");
  m.def("favor_attention", &favor_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("projection"), py::kw_only(), py::arg("kernel") = "positive",
        py::arg("causal") = false, py::arg("key_lengths") = py::none(), py::arg("scale") = py::none(),
        R"doc(Performer attention approximating softmax(q·kᵀ·scale)·v with random features.

projection [m, head_dim] from random_features. kernel: "positive" (FAVOR+), "hyperbolic",
"trig" (not positive: its denominator can vanish; rows whose denominator is exactly 0 get 0).)doc");
  m.def("favor_attention_backward", &favor_attention_backward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("projection"), py::arg("dout"), py::kw_only(),
        py::arg("kernel") = "positive", py::arg("causal") = false,
        py::arg("key_lengths") = py::none(), py::arg("scale") = py::none(),
        "Gradients (dq, dk, dv) of sum(dout * favor_attention(...)).");
  py::class_<PyRecurrentState>(m, "RecurrentState",
                               "Constant-size decoding state; make one with recurrent_state().")
      .def("prefill", &PyRecurrentState::prefill, py::arg("q"), py::arg("k"), py::arg("v"),
           "[B,H,n,d] in, [B,H,n,d_v] out: causal outputs of n tokens, chunked.")
      .def("step", &PyRecurrentState::step, py::arg("q_t"), py::arg("k_t"), py::arg("v_t"),
           "[B,H,d] in, [B,H,d_v] out: one token.")
      .def("copy", &PyRecurrentState::copy, "An independent copy, to roll back to.")
      .def_property_readonly("tokens", &PyRecurrentState::tokens)
      .def_property_readonly("dtype", &PyRecurrentState::dtype);
  m.def("recurrent_state", &recurrent_state, py::arg("batch"), py::arg("heads"),
        py::arg("head_dim"), py::arg("value_dim"), py::kw_only(), py::arg("feature_map") = "elu",
        py::arg("projection") = py::none(), py::arg("kernel") = "positive",
        py::arg("scale") = py::none(), py::arg("eps") = 1e-6, py::arg("focus_power") = 3.0,
        py::arg("dtype") = py::none(),
        R"doc(A decoding state for feature_map "elu", "relu", "focused" or "favor" (with projection).

dtype: float32 or float64 (default: the projection's, else float32). Step outputs equal the
causal outputs of linear_attention / favor_attention over the same tokens.)doc");
  m.def("nystrom_attention", &nystrom_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::kw_only(), py::arg("num_landmarks") = 64, py::arg("pinv_iterations") = 6,
        py::arg("pinv") = "iterative", py::arg("conv_weight") = py::none(),
        py::arg("key_lengths") = py::none(), py::arg("scale") = py::none(), py::arg("causal") = false,
        R"doc(Nyströmformer: softmax(q·k̃ᵀ·s)·pinv(softmax(q̃·k̃ᵀ·s))·softmax(q̃·kᵀ·s)·v.

Landmarks q̃, k̃ are segment means (min(num_landmarks, n) of them; n_q == n_k). pinv:
"iterative" (pinv_iterations Newton–Schulz-type steps) or "exact" (SVD). conv_weight
[heads, K], K odd, adds a depthwise convolution of v. causal=True raises ValueError.)doc");
  m.def("nystrom_attention_backward", &nystrom_attention_backward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("dout"), py::kw_only(), py::arg("num_landmarks") = 64,
        py::arg("pinv_iterations") = 6, py::arg("pinv") = "iterative",
        py::arg("conv_weight") = py::none(), py::arg("key_lengths") = py::none(),
        py::arg("scale") = py::none(), py::arg("causal") = false,
        "Gradients (dq, dk, dv[, d_conv_weight]) of sum(dout * nystrom_attention(...)).");
  m.def("linformer_attention", &linformer_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("e"), py::arg("f"), py::kw_only(), py::arg("key_lengths") = py::none(),
        py::arg("scale") = py::none(), py::arg("causal") = false,
        R"doc(Linformer: softmax(q·(e·k)ᵀ·scale)·(f·v).

e, f: [s_proj, n_max] (shared by heads) or [heads, s_proj, n_max], n_k <= n_max (the first n_k
columns are used; see linformer_projections). causal=True raises ValueError.)doc");
  m.def("linformer_attention_backward", &linformer_attention_backward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("e"), py::arg("f"), py::arg("dout"), py::kw_only(),
        py::arg("key_lengths") = py::none(), py::arg("scale") = py::none(), py::arg("causal") = false,
        "Gradients (dq, dk, dv, de, df) of sum(dout * linformer_attention(...)).");
  m.def("linformer_projections", &linformer_projections, py::arg("s_proj"), py::arg("n_max"),
        py::kw_only(), py::arg("heads") = py::none(), py::arg("seed") = 0,
        py::arg("dtype") = py::dtype::of<float>(),
        R"doc((e, f) initialised as fairseq's Linformer does: Xavier-uniform, gain 1/sqrt(2),
i.e. uniform on (-a, a), a = sqrt(3 / (n_max + s_proj)). heads=None: shared [s_proj, n_max];
else [heads, s_proj, n_max]. Reproducible by seed.)doc");
  m.def("efficient_attention", &efficient_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::kw_only(), py::arg("key_lengths") = py::none(), py::arg("scale") = py::none(),
        py::arg("causal") = false,
        R"doc(Efficient Attention: softmax over head_dim of q·s times (softmax over positions of
k·s)ᵀ·v, s = scale (default 1/sqrt(head_dim)). causal=True raises ValueError.)doc");
  m.def("efficient_attention_backward", &efficient_attention_backward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("dout"), py::kw_only(), py::arg("key_lengths") = py::none(),
        py::arg("scale") = py::none(), py::arg("causal") = false,
        "Gradients (dq, dk, dv) of sum(dout * efficient_attention(...)).");
  m.def("set_num_threads", &linattn::set_num_threads, py::arg("n"),
        "Threads used by every kernel (default: LINATTN_NUM_THREADS, else all cores).");
  m.def("get_num_threads", &linattn::num_threads);
  m.def("workspace_stats", [] {
    const auto s = linattn::workspace_stats();
    return py::dict(py::arg("current_bytes") = s.current_bytes, py::arg("peak_bytes") = s.peak_bytes);
  }, "Scratch memory the library holds now and at its peak since reset_workspace_peak().");
  m.def("reset_workspace_peak", &linattn::reset_workspace_peak);
}
