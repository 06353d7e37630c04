// Python bindings: NumPy arrays in and out, [batch, heads, seq, head_dim], float32 or float64.
// linattn::Error becomes ValueError; a wrong type or dtype is a TypeError. The GIL is released
// while kernels run.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
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

Array as_array(const char* fn, const char* name, const py::handle& obj) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(std::string(fn) + ": " + name + " must be a numpy.ndarray, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  auto a = py::reinterpret_borrow<py::array>(obj);
  DType dt;
  if (a.dtype().is(py::dtype::of<float>())) dt = DType::F32;
  else if (a.dtype().is(py::dtype::of<double>())) dt = DType::F64;
  else
    throw py::type_error(std::string(fn) + ": " + name + " must have dtype float32 or float64, got " +
                         std::string(py::str(a.dtype())));
  if (!(a.flags() & py::array::c_style)) a = py::array::ensure(a, py::array::c_style);
  return {a, dt};
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

AttentionOptions make_options(const char* fn, bool causal, const py::object& scale,
                              const py::object& key_lengths) {
  AttentionOptions o;
  o.causal = causal;
  if (!scale.is_none()) {
    if (!py::isinstance<py::float_>(scale) && !py::isinstance<py::int_>(scale))
      throw py::type_error(std::string(fn) + ": scale must be a float or None");
    o.scale = scale.cast<double>();
  }
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

}  // namespace

PYBIND11_MODULE(_linattn, m) {
  m.doc() = "linattn: linear-cost attention and exact softmax attention (NumPy interface)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const linattn::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

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
  m.def("set_num_threads", &linattn::set_num_threads, py::arg("n"),
        "Threads used by every kernel (default: LINATTN_NUM_THREADS, else all cores).");
  m.def("get_num_threads", &linattn::num_threads);
  m.def("workspace_stats", [] {
    const auto s = linattn::workspace_stats();
    return py::dict(py::arg("current_bytes") = s.current_bytes, py::arg("peak_bytes") = s.peak_bytes);
  }, "Scratch memory the library holds now and at its peak since reset_workspace_peak().");
  m.def("reset_workspace_peak", &linattn::reset_workspace_peak);
}
