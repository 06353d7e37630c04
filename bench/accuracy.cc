#include "accuracy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <vector>

#include "linattn/core/blas.h"
#include "linattn/linattn.h"
#include "linattn/core/random.h"
#include "linattn/softmax/reference.h"
#include "linattn/kernelized/reference.h"
#include "linattn/nystrom/reference.h"
#include "linattn/linformer/reference.h"
#include "linattn/efficient/reference.h"

namespace linattn::bench {
namespace {

using T = double;  // every method in float64: the errors below are approximation, not rounding

struct Data {
  Tensor<T> q, k, v, dout;
};

// "gaussian": q, k ~ N(0, σ²), v, dout ~ N(0, 1).
// "clustered": the structure of a trained model's attention inputs: positions in 16 contiguous
// runs sharing a centre c ~ N(0, I) per head (the same centres for queries and keys, as a
// token's query and key are correlated), q_i = σ(c + 0.5ε), k_i = σ(c + 0.5ε').
Data make_data(const std::string& kind, int64_t H, int64_t n, int64_t d, double sigma, uint64_t seed) {
  const Shape s{1, H, n, d};
  Data x{Tensor<T>(s), Tensor<T>(s), Tensor<T>(s), Tensor<T>(s)};
  fill_normal(x.v.data(), x.v.size(), seed * 7 + 3);
  fill_normal(x.dout.data(), x.dout.size(), seed * 7 + 4);
  if (kind == "gaussian") {
    fill_normal(x.q.data(), x.q.size(), seed * 7 + 1, sigma);
    fill_normal(x.k.data(), x.k.size(), seed * 7 + 2, sigma);
    return x;
  }
  const int64_t clusters = 16;
  Tensor<T> c({H, clusters, d});
  fill_normal(c.data(), c.size(), seed * 7 + 5);
  fill_normal(x.q.data(), x.q.size(), seed * 7 + 1, 0.5);
  fill_normal(x.k.data(), x.k.size(), seed * 7 + 2, 0.5);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < d; ++j) {
        const T cj = c[(h * clusters + i * clusters / n) * d + j];
        x.q[(h * n + i) * d + j] = sigma * (cj + x.q[(h * n + i) * d + j]);
        x.k[(h * n + i) * d + j] = sigma * (cj + x.k[(h * n + i) * d + j]);
      }
  return x;
}

// One method at one size: its forward and backward on the data (v may be the identity, for the
// attention matrix).
struct Approx {
  std::string name;
  int64_t size;  // features, landmarks or projection rows; 0 when the method has none
  std::function<Tensor<T>(const Data&, TensorView<const T> v)> forward;
  std::function<AttentionGrads<T>(const Data&)> backward;
};

// A registered method with the given extra tensors (projection, E and F) at `size`.
Approx registered(const MethodInfo& info, const std::string& name, int64_t size,
                  std::vector<std::pair<std::string, Tensor<T>>> tensors) {
  auto owned = std::make_shared<std::vector<std::pair<std::string, Tensor<T>>>>(std::move(tensors));
  auto args = [&info, owned, size](const Data& x, TensorView<const T> v) {
    MethodArgs<T> a;
    a.q = x.q, a.k = x.k, a.v = v;
    if (info.option(info.size_name) && size > 0) a.options[info.size_name] = size;
    for (const auto& [n, t] : *owned) a.tensors[n] = t.view();
    return a;
  };
  return {name, size, [&info, args](const Data& x, TensorView<const T> v) { return info.f64.forward(args(x, v)).out; },
          [&info, args](const Data& x) { return info.f64.backward(args(x, x.v), x.dout, {}); }};
}

// Segment-mean pooling as Linformer projections, E = F (Nyström's landmark segments): a
// structured projection, showing what E and F can achieve when they are not random; trained
// projections are what the method relies on.
Tensor<T> pooling(int64_t s, int64_t n) {
  Tensor<T> e({s, n});
  for (int64_t j = 0; j < s; ++j) {
    const int64_t lo = segment_begin(j, n, s), hi = segment_end(j, n, s);
    for (int64_t i = lo; i < hi; ++i) e[j * n + i] = T(1) / T(hi - lo);
  }
  return e;
}

double rel_err(const std::vector<const Tensor<T>*>& got, const std::vector<const Tensor<T>*>& want) {
  double num = 0, den = 0;
  for (size_t t = 0; t < got.size(); ++t)
    for (int64_t i = 0; i < got[t]->size(); ++i) {
      num += ((*got[t])[i] - (*want[t])[i]) * ((*got[t])[i] - (*want[t])[i]);
      den += (*want[t])[i] * (*want[t])[i];
    }
  return std::sqrt(num / den);
}

// Every registered approximation at the sizes of a study (`sizes` false: its default size only).
// Methods that take a random-feature projection are studied with each kind of projection,
// methods that take sequence projections E, F also with pooling ones.
std::vector<Approx> methods(bool sizes, int64_t H, int64_t n, int64_t d, uint64_t seed) {
  std::vector<Approx> out;
  for (const MethodInfo& info : linattn::methods()) {
    if (info.exact) continue;
    std::vector<int64_t> size_list{info.default_size};
    if (sizes && !info.size_name.empty())
      size_list = info.option(info.size_name) ? std::vector<int64_t>{8, 16, 32, 64, 128, 256}
                                              : std::vector<int64_t>{16, 32, 64, 128, 256, 512};
    for (const int64_t size : size_list) {
      auto tensors = info.f64.example_tensors(H, d, n, size, seed);
      const auto has = [&](const char* name) {
        return std::any_of(tensors.begin(), tensors.end(), [&](const auto& t) { return t.first == name; });
      };
      if (has("projection")) {
        for (const char* kind : {"orthogonal", "iid", "quantile"}) {
          std::vector<std::pair<std::string, Tensor<T>>> t;
          t.emplace_back("projection", random_features<T>(size, d, kind, seed));
          out.push_back(registered(info, info.label + " " + kind, size, std::move(t)));
        }
        continue;
      }
      out.push_back(registered(info, info.label, size, std::move(tensors)));
      if (has("e")) {
        std::vector<std::pair<std::string, Tensor<T>>> t;
        t.emplace_back("e", pooling(size, n));
        t.emplace_back("f", pooling(size, n));
        out.push_back(registered(info, info.label + " pooled", size, std::move(t)));
      }
    }
  }
  return out;
}

void progress(const std::string& what) { std::fprintf(stderr, "\r[accuracy] %-60s", what.c_str()); }

// Output and gradient errors against exact attention for every method, for each configuration.
void error_study(const AccuracyOptions& o, const std::string& file, const std::string& varying) {
  std::ofstream csv(o.out_dir + "/" + file);
  csv << "input,method,size,n,sigma,seed,out_rel_err,grad_rel_err\n";
  std::vector<int64_t> ns{o.n};
  std::vector<double> sigmas{1.0};
  if (varying == "n") ns = {256, 512, 1024, 2048, 4096};
  if (varying == "sigma") sigmas = {0.25, 0.5, 0.75, 1.0, 1.25, 1.5};
  // At σ = 1 FAVOR+'s features are too heavy-tailed for m to matter (see kernel_mse.csv), so the
  // size study also runs at σ = 0.5, where the error falls with m.
  if (varying == "size") sigmas = {0.5, 1.0};
  for (const char* input : {"gaussian", "clustered"})
    for (int64_t n : ns)
      for (double sigma : sigmas)
        for (int seed = 0; seed < o.seeds; ++seed) {
          progress(varying + ": " + input + " n=" + std::to_string(n) + " sigma=" + std::to_string(sigma) +
                   " seed=" + std::to_string(seed));
          const Data x = make_data(input, o.heads, n, o.head_dim, sigma, static_cast<uint64_t>(seed));
          const auto exact = softmax_attention<T>(x.q, x.k, x.v);
          const auto exact_g = softmax_attention_backward<T>(x.q, x.k, x.v, x.dout, exact.out, exact.lse);
          for (const Approx& a : methods(varying == "size", o.heads, n, o.head_dim, static_cast<uint64_t>(seed))) {
            const auto out = a.forward(x, x.v);
            const auto g = a.backward(x);
            csv << input << ",\"" << a.name << "\"," << a.size << ',' << n << ',' << sigma << ',' << seed << ','
                << rel_err({&out}, {&exact.out}) << ','
                << rel_err({&g.dq, &g.dk, &g.dv}, {&exact_g.dq, &exact_g.dk, &exact_g.dv}) << '\n';
          }
        }
}

// MSE of φ(q)·φ(k) as an estimate of exp(q·k), relative to exp(q·k)², over pairs with ‖q‖ = ‖k‖
// = r and uniformly random directions, for `seeds` independent projections each.
void kernel_study(const AccuracyOptions& o) {
  std::ofstream csv(o.out_dir + "/kernel_mse.csv");
  csv << "features,kind,m,norm_product,pairs,seeds,rel_mse,rel_mse_stderr\n";
  const int64_t d = 16, pairs = 64, seeds = 200;
  struct Config {
    const char* name;  // the feature map
    const char* kind;  // the projection's rows
  };
  const Config configs[] = {{"positive", "iid"}, {"positive", "orthogonal"}, {"positive", "quantile"},
                            {"hyperbolic", "orthogonal"}, {"trig", "orthogonal"}, {"trig", "iid"}};
  auto run = [&](const Config& c, int64_t m, double r) {
    Tensor<T> q({pairs, d}), k({pairs, d});
    fill_normal(q.data(), q.size(), 11);
    fill_normal(k.data(), k.size(), 12);
    for (Tensor<T>* x : {&q, &k})
      for (int64_t i = 0; i < pairs; ++i) {
        double nrm = 0;
        for (int64_t j = 0; j < d; ++j) nrm += (*x)[i * d + j] * (*x)[i * d + j];
        for (int64_t j = 0; j < d; ++j) (*x)[i * d + j] *= std::sqrt(r) / std::sqrt(nrm);
      }
    std::vector<double> per_seed;
    for (int64_t s = 0; s < seeds; ++s) {
      const auto w = random_features<T>(m, d, c.kind, static_cast<uint64_t>(1000 + s));
      const auto fq = reference::features(q, c.name, w.view(), 1.0);
      const auto fk = reference::features(k, c.name, w.view(), 1.0);
      const int64_t f = fq.dim(1);
      double mse = 0;
      for (int64_t i = 0; i < pairs; ++i) {
        double est = 0, dot = 0;
        for (int64_t j = 0; j < f; ++j) est += fq[i * f + j] * fk[i * f + j];
        for (int64_t j = 0; j < d; ++j) dot += q[i * d + j] * k[i * d + j];
        const double want = std::exp(dot);
        mse += (est - want) * (est - want) / (want * want);
      }
      per_seed.push_back(mse / pairs);
    }
    const double mean = std::accumulate(per_seed.begin(), per_seed.end(), 0.0) / seeds;
    double var = 0;
    for (double v : per_seed) var += (v - mean) * (v - mean);
    const double se = std::sqrt(var / (seeds - 1) / seeds);
    csv << c.name << ',' << c.kind << ',' << m << ',' << r << ',' << pairs << ',' << seeds << ',' << mean << ','
        << se << '\n';
  };
  for (const Config& c : configs) {
    progress(std::string("kernel: ") + c.name + " " + c.kind);
    for (int64_t m : {16, 32, 64, 128, 256}) run(c, m, 1.0);
    for (double r : {0.25, 0.5, 1.0, 2.0, 4.0, 8.0}) run(c, 64, r);
  }
}

// Singular values of an n×n matrix (LAPACK dgesdd, values only; the transpose has the same).
std::vector<double> singular_values(const T* a, int64_t n) {
  std::vector<double> A(a, a + n * n), s(static_cast<size_t>(n));
  svd("linattn accuracy (rank study)", n, A.data(), s.data());
  return s;
}

// Each method's n×n attention matrix, as method(q, k, v = I): numerical rank (singular values
// above n·ε·σ₁, numpy's rule), effective rank exp(entropy of σ/Σσ), and concentration: the mean
// over rows of the fraction of entries holding 90% of the row's absolute mass.
void rank_study(const AccuracyOptions& o) {
  std::ofstream csv(o.out_dir + "/rank.csv");
  csv << "input,method,size,n,numerical_rank,effective_rank,mass90_fraction\n";
  const int64_t n = 512, d = o.head_dim;
  Tensor<T> eye({1, 1, n, n});
  for (int64_t i = 0; i < n; ++i) eye[i * n + i] = 1;
  for (const char* input : {"gaussian", "clustered"}) {
    progress(std::string("rank: ") + input);
    const Data x = make_data(input, 1, n, d, 1.0, 0);
    std::vector<Approx> all;
    for (const MethodInfo& info : linattn::methods())
      if (info.exact) all.push_back(registered(info, info.label, 0, {}));
    for (const Approx& a : methods(false, 1, n, d, 0)) all.push_back(a);
    for (const Approx& a : all) {
      const auto A = a.forward(x, eye.view());
      const auto s = singular_values(A.data(), n);
      const double tol = n * 2.220446049250313e-16 * s[0];
      int64_t rank = 0;
      double total = 0, entropy = 0;
      for (double v : s) rank += v > tol, total += v;
      for (double v : s)
        if (v > 0) entropy -= v / total * std::log(v / total);
      double frac = 0;
      std::vector<double> row(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        double mass = 0;
        for (int64_t j = 0; j < n; ++j) mass += row[j] = std::abs(A[i * n + j]);
        std::sort(row.begin(), row.end(), std::greater<>());
        double acc = 0;
        int64_t cnt = 0;
        while (acc < 0.9 * mass) acc += row[cnt++];
        frac += double(cnt) / n;
      }
      csv << input << ",\"" << a.name << "\"," << a.size << ',' << n << ',' << rank << ',' << std::exp(entropy)
          << ',' << frac / n << '\n';
    }
  }
}

}  // namespace

void run_accuracy(const AccuracyOptions& o) {
  std::filesystem::create_directories(o.out_dir);
  error_study(o, "accuracy_size.csv", "size");
  error_study(o, "accuracy_scale.csv", "sigma");
  error_study(o, "accuracy_n.csv", "n");
  kernel_study(o);
  rank_study(o);
  std::fprintf(stderr, "\r%80s\r", "");
}

}  // namespace linattn::bench
