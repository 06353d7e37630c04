#include "methods.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <stdexcept>

#include "linattn/core/random.h"
#include "linattn/reference_registry.h"
#include "linattn/softmax/reference.h"

namespace linattn::bench {

Inputs make_inputs(const Problem& p) {
  const Shape shape{p.batch, p.heads, p.n, p.head_dim};
  Inputs in{Tensor<float>(shape), Tensor<float>(shape), Tensor<float>(shape), Tensor<float>(shape)};
  fill_normal(in.q.data(), in.q.size(), p.seed);
  fill_normal(in.k.data(), in.k.size(), p.seed + 1);
  fill_normal(in.v.data(), in.v.size(), p.seed + 2);
  fill_normal(in.dout.data(), in.dout.size(), p.seed + 3);
  return in;
}

namespace {

void write_raw(const std::string& path, const Tensor<float>& t) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(sizeof(float) * t.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

Tensor<double> to_double(TensorView<const float> x) {
  Tensor<double> y(x.shape);
  for (int64_t i = 0; i < x.size(); ++i) y[i] = x.data[i];
  return y;
}

AttentionShape shape_of(const Problem& p) {
  return {p.batch, p.heads, p.n, p.n, p.head_dim, p.head_dim};
}

// Rows [0, rows) of a [B,H,n,D] tensor.
Tensor<double> first_rows(const Tensor<double>& x, int64_t rows) {
  const int64_t BH = x.dim(0) * x.dim(1), n = x.dim(2), D = x.dim(3);
  Tensor<double> y({x.dim(0), x.dim(1), rows, D});
  for (int64_t bh = 0; bh < BH; ++bh)
    std::copy(x.data() + bh * n * D, x.data() + (bh * n + rows) * D, y.data() + bh * rows * D);
  return y;
}

// Largest |out − ref| / max|ref| over `rows` of every (b, h): out row rows_out[s] against ref
// row s of a [B,H,S,d_v] reference.
double compare_rows(const Tensor<float>& out, const Tensor<double>& ref, const std::vector<int64_t>& rows) {
  const int64_t BH = out.dim(0) * out.dim(1), n = out.dim(2), dv = out.dim(3), S = ref.dim(2);
  double max_err = 0, max_ref = 0;
  for (int64_t bh = 0; bh < BH; ++bh)
    for (size_t s = 0; s < rows.size(); ++s)
      for (int64_t c = 0; c < dv; ++c) {
        const double r = ref[(bh * S + static_cast<int64_t>(s)) * dv + c];
        max_err = std::max(max_err, std::abs(out[(bh * n + rows[s]) * dv + c] - r));
        max_ref = std::max(max_ref, std::abs(r));
      }
  return max_ref > 0 ? max_err / max_ref : max_err;
}

// Rows `rows` of every (b, h) of a [B,H,n,D] tensor, as [B,H,rows.size(),D].
Tensor<double> pick_rows(const Tensor<double>& x, const std::vector<int64_t>& rows) {
  const int64_t BH = x.dim(0) * x.dim(1), D = x.dim(3), S = static_cast<int64_t>(rows.size());
  Tensor<double> y({x.dim(0), x.dim(1), S, D});
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t s = 0; s < S; ++s)
      std::copy(x.view().row(bh, rows[s]), x.view().row(bh, rows[s]) + D, y.view().row(bh, s));
  return y;
}

std::vector<int64_t> sample_rows(int64_t n, int64_t count) {
  std::vector<int64_t> rows;
  const int64_t c = std::min(count, n);
  for (int64_t s = 0; s < c; ++s) rows.push_back(s * n / c);
  return rows;
}

// The registry method at one size, causal or not, on the bench's inputs.
Method make_method(const MethodInfo& info, int64_t size, bool causal) {
  Method m;
  m.info = &info;
  m.causal = causal;
  m.size = info.size_name.empty() ? 0 : size;
  m.name = info.label + (m.size ? " " + info.size_symbol + "=" + std::to_string(m.size) : "") +
           (causal ? " (causal)" : "");
  const bool size_is_option = info.option(info.size_name) != nullptr;
  // The extra tensors (projection, E and F) depend on the problem's heads, head_dim and n: made
  // once per problem, float32 for the kernels and float64 for the reference.
  struct Extra {
    int64_t heads = -1, head_dim = -1, n = -1;
    std::vector<std::pair<std::string, Tensor<float>>> f32;
    std::vector<std::pair<std::string, Tensor<double>>> f64;
  };
  auto extra = std::make_shared<Extra>();
  auto args = [&info, extra, causal, size = m.size, size_is_option](const Problem& p, const Inputs* in) {
    if (extra->heads != p.heads || extra->head_dim != p.head_dim || extra->n != p.n) {
      extra->f32 = info.f32.example_tensors(p.heads, p.head_dim, p.n, size, 42);
      extra->f64.clear();
      for (const auto& [name, t] : extra->f32) extra->f64.emplace_back(name, to_double(t.view()));
      extra->heads = p.heads, extra->head_dim = p.head_dim, extra->n = p.n;
    }
    MethodArgs<float> a;
    if (in) a.q = in->q, a.k = in->k, a.v = in->v;
    a.options["causal"] = causal;
    if (size_is_option && size > 0) a.options[info.size_name] = size;
    for (const auto& [name, t] : extra->f32) a.tensors[name] = t.view();
    return a;
  };
  m.forward_flops = [&info, args](const Problem& p) { return info.flops(shape_of(p), args(p, nullptr), false); };
  m.backward_flops = [&info, args](const Problem& p) { return info.flops(shape_of(p), args(p, nullptr), true); };
  auto problem_of = [](const Inputs& in) {
    return Problem{in.q.dim(0), in.q.dim(1), in.q.dim(2), in.q.dim(3), 0};
  };
  m.forward = [&info, args, problem_of](const Inputs& in) { return info.f32.forward(args(problem_of(in), &in)).out; };
  m.forward_backward = [&info, args, problem_of](const Inputs& in) {
    const MethodArgs<float> a = args(problem_of(in), &in);
    MethodOutput<float> f = info.f32.forward(a);
    std::map<std::string, TensorView<const float>, std::less<>> saved{{"out", f.out.view()}};
    for (const auto& [name, t] : f.saved) saved[name] = t.view();
    (void)info.f32.backward(a, in.dout, saved);
  };
  // The float64 reference is O(n²): for sampled rows, as one-row problems where rows are
  // independent (non-causal), on the first 512 positions (causal: they do not see later ones),
  // or whole (Nyström, whose landmarks pool every query).
  m.own_error = [&info, args, problem_of, causal, extra](const Inputs& in, const Tensor<float>& out, int64_t count) {
    const auto& ref = reference::reference_of(info.name);
    const Problem p = problem_of(in);
    args(p, &in);  // makes the extra tensors
    MethodArgs<double> a;
    a.options["causal"] = causal;
    for (const auto& [name, value] : args(p, nullptr).options) a.options[name] = value;
    for (const auto& [name, t] : extra->f64) a.tensors[name] = t.view();
    Tensor<double> q = to_double(in.q), k = to_double(in.k), v = to_double(in.v);
    a.k = k, a.v = v;
    if (!ref.rows_independent) {
      a.q = q;
      return compare_rows(out, pick_rows(ref.forward(a), sample_rows(p.n, count)), sample_rows(p.n, count));
    }
    if (causal) {
      const int64_t n = std::min<int64_t>(p.n, 512);
      Tensor<double> qn = first_rows(q, n), kn = first_rows(k, n), vn = first_rows(v, n);
      a.q = qn, a.k = kn, a.v = vn;
      return compare_rows(out, pick_rows(ref.forward(a), sample_rows(n, count)), sample_rows(n, count));
    }
    const std::vector<int64_t> rows = sample_rows(p.n, count);
    Tensor<double> qs({p.batch, p.heads, static_cast<int64_t>(rows.size()), p.head_dim});
    for (int64_t bh = 0; bh < p.batch * p.heads; ++bh)
      for (size_t s = 0; s < rows.size(); ++s)
        std::copy(q.view().row(bh, rows[s]), q.view().row(bh, rows[s]) + p.head_dim,
                  qs.view().row(bh, static_cast<int64_t>(s)));
    a.q = qs;
    return compare_rows(out, ref.forward(a), rows);
  };
  if (!info.f32.example_tensors(1, 1, 1, m.size, 42).empty())
    m.write_parameters = [&info, args, extra, size = m.size](const Problem& p, const std::string& dir) {
      args(p, nullptr);
      for (const auto& [name, t] : extra->f32)
        write_raw(dir + "/" + info.name + "_" + name + "_" + std::to_string(size) + ".f32", t);
    };
  return m;
}

}  // namespace

std::vector<Method> all_methods(const MethodSizes& sizes) {
  std::vector<Method> out;
  for (const MethodInfo& info : methods()) {
    const auto it = sizes.find(info.size_name);
    const int64_t size = it != sizes.end() ? it->second : info.default_size;
    out.push_back(make_method(info, size, false));
    if (info.no_causal.empty()) out.push_back(make_method(info, size, true));
  }
  return out;
}

double error_vs_exact(const Method& m, const Inputs& in, const Tensor<float>& out,
                      int64_t sample_rows) {
  const int64_t B = in.q.dim(0), H = in.q.dim(1), n = in.q.dim(2), d = in.q.dim(3);
  const int64_t dv = in.v.dim(3);
  const Tensor<double> k = to_double(in.k), v = to_double(in.v);
  double max_err = 0, max_ref = 0;
  for (int64_t s = 0; s < std::min(sample_rows, n); ++s) {
    const int64_t i = s * n / std::min(sample_rows, n);
    // Row i alone over its visible keys: n_q = 1 against keys [0, i] (causal) or all.
    Tensor<double> qi({B, H, 1, d});
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t c = 0; c < d; ++c) qi[bh * d + c] = in.q.view().row(bh, i)[c];
    AttentionOptions opts;
    if (m.causal) opts.key_lengths = std::vector<int64_t>(static_cast<size_t>(B), i + 1);
    const auto ref = reference::softmax_attention(qi, k, v, opts);
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t c = 0; c < dv; ++c) {
        const double r = ref.out[bh * dv + c];
        max_err = std::max(max_err, std::abs(out.view().row(bh, i)[c] - r));
        max_ref = std::max(max_ref, std::abs(r));
      }
  }
  return max_ref > 0 ? max_err / max_ref : max_err;
}

}  // namespace linattn::bench
