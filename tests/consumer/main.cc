// Uses the installed linattn through its public headers only: exact attention against a plain
// loop, a kernelized method through the registry, and an error.
#include <cmath>
#include <cstdio>
#include <linattn/linattn.h>

int main() {
  using namespace linattn;
  const int64_t n = 5, d = 3;
  Tensor<double> q({1, 1, n, d}), k({1, 1, n, d}), v({1, 1, n, d});
  for (int64_t i = 0; i < q.size(); ++i) q[i] = std::sin(i), k[i] = std::cos(i), v[i] = 0.1 * i;
  const auto r = softmax_attention<double>(q, k, v);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    double w[n], sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t c = 0; c < d; ++c) s += q[i * d + c] * k[j * d + c];
      sum += w[j] = std::exp(s / std::sqrt(double(d)));
    }
    for (int64_t c = 0; c < d; ++c) {
      double o = 0;
      for (int64_t j = 0; j < n; ++j) o += w[j] / sum * v[j * d + c];
      worst = std::fmax(worst, std::fabs(o - r.out[i * d + c]));
    }
  }
  MethodArgs<double> a;
  a.q = q, a.k = k, a.v = v;
  a.options["feature_map"] = std::string("relu");
  const Tensor<double> lin = method("linear").f64.forward(a).out;
  bool refused = false;
  try {
    NystromOptions o;
    o.causal = true;
    nystrom_attention<double>(q, k, v, o);
  } catch (const Error& e) {
    refused = true;
  }
  std::printf("linattn %s: softmax error %.3g, linear out[0] %.6f, causal Nystrom refused: %s\n", version(),
              worst, lin[0], refused ? "yes" : "no");
  return worst < 1e-12 && std::isfinite(lin[0]) && refused ? 0 : 1;
}
