// The causal depthwise convolution (include/linattn/conv1d.h), per (batch, channel) task.
//
// Plain loops: W is 2–4 in every model, so a position costs W multiply-adds and an exp; the
// loop over positions is what the compiler vectorises (a BLAS call per channel would cost more
// than its arithmetic). Tasks are grouped so that each thread's share is worth waking it for.
//
// Backward, with dz_t = dout_t · silu'(z_t) (silu'(z) = σ(z)(1 + z(1 − σ(z)))) or dout_t:
//   dx̃[i]   = Σ_j dz_{i−j} w[j]  (+ dstate[i − T] for the last W−1 positions of x̃)
//   dw[c,j] = Σ_{b,t} dz_t x̃[t+j],  dbias[c] = Σ_{b,t} dz_t
// dx = dx̃ after the first W−1 positions, dinitial_state = the first W−1. dw and dbias sum over
// the batch, so the backward's tasks are channels (each summing its batch rows, in float64).
//
// Input checks ride on the results: every input reaches an output or the final state (x·0 is
// NaN for x = ±inf or NaN), so a non-finite result leads to the scan that names the argument.
#include "linattn/conv1d.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/parallel.h"
#include "linattn/core/simd.h"

namespace linattn {
namespace conv1d {

struct Dims {
  int64_t batch, channels, n, width;
  bool has_bias, has_state;
  int64_t tail() const { return width - 1; }
  int64_t tasks() const { return batch * channels; }
};

template <class T>
struct Inputs {
  TensorView<const T> x, weight, bias, initial_state, dout, dstate;
};

template <class T>
Dims check_args(const char* fn, const Inputs<T>& in) {
  require(in.x.rank() == 3, fn, ": x must be [batch, channels, seq], got shape ", shape_string(in.x.shape));
  require(in.weight.rank() == 2 && in.weight.dim(1) >= 1, fn, ": weight must be [channels, width >= 1], got shape ",
          shape_string(in.weight.shape));
  Dims d{in.x.dim(0), in.x.dim(1), in.x.dim(2), in.weight.dim(1), in.bias.data != nullptr,
         in.initial_state.data != nullptr};
  check_shape(fn, "weight", in.weight, {d.channels, d.width});
  if (d.has_bias) check_shape(fn, "bias", in.bias, {d.channels});
  if (d.has_state) check_shape(fn, "initial_state", in.initial_state, {d.batch, d.channels, d.tail()});
  if (in.dout.data) check_shape(fn, "dout", in.dout, in.x.shape);
  if (in.dstate.data) check_shape(fn, "dstate", in.dstate, {d.batch, d.channels, d.tail()});
  return d;
}

template <class T>
[[noreturn]] void fail_on_results(const char* fn, const Dims& d, const Inputs<T>& in) {
  check_same_shape_finite(fn, "x", in.x, in.x.shape);
  check_same_shape_finite(fn, "weight", in.weight, in.weight.shape);
  if (d.has_bias) check_same_shape_finite(fn, "bias", in.bias, in.bias.shape);
  if (d.has_state) check_same_shape_finite(fn, "initial_state", in.initial_state, in.initial_state.shape);
  if (in.dout.data) check_same_shape_finite(fn, "dout", in.dout, in.dout.shape);
  if (in.dstate.data) check_same_shape_finite(fn, "dstate", in.dstate, in.dstate.shape);
  fail_overflow<T>(fn);
}

// x̃ of one task into ext [W−1 + n]: the initial state (or zeros), then x.
template <class T>
void extended(const Dims& d, const Inputs<T>& in, int64_t task, T* ext) {
  const int64_t tail = d.tail();
  if (d.has_state)
    std::copy(in.initial_state.data + task * tail, in.initial_state.data + (task + 1) * tail, ext);
  else
    std::fill(ext, ext + tail, T(0));
  std::copy(in.x.data + task * d.n, in.x.data + (task + 1) * d.n, ext + tail);
}

// z [n] = bias + Σ_j w[j] ext[t + j]
template <class T>
void preactivation(const Dims& d, const T* w, T bias, const T* ext, T* z) {
  std::fill(z, z + d.n, bias);
  for (int64_t j = 0; j < d.width; ++j) {
    const T wj = w[j];
    const T* e = ext + j;
    for (int64_t t = 0; t < d.n; ++t) z[t] += wj * e[t];
  }
}

template <class T>
T sigmoid(T z) {
  return T(1) / (T(1) + std::exp(-z));
}

struct Worker {
  bool ok = true;
};

template <class T>
CausalConv1dResult<T> forward(const char* fn, const Inputs<T>& in, const Dims& d, const CausalConv1dOptions& opts) {
  CausalConv1dResult<T> r{Tensor<T>(in.x.shape, false, Init::Uninitialized),
                          Tensor<T>({d.batch, d.channels, d.tail()}, false, Init::Uninitialized)};
  const int64_t group = tasks_per_index(d.tasks(), (d.n + 1) * d.width);
  const ParallelLoop loop((d.tasks() + group - 1) / group);
  PerWorker<Worker> workers(loop);
  PerWorker<std::vector<T>> ext(loop, [&] { return std::vector<T>(static_cast<size_t>(d.tail() + d.n)); });
  loop.run([&](int64_t index, int worker) {
    for (int64_t task = index * group; task < std::min(d.tasks(), (index + 1) * group); ++task) {
      const int64_t c = task % d.channels;
      T* e = ext[worker].data();
      extended(d, in, task, e);
      T* out = r.out.data() + task * d.n;
      preactivation(d, in.weight.data + c * d.width, d.has_bias ? in.bias.data[c] : T(0), e, out);
      if (opts.silu)
        for (int64_t t = 0; t < d.n; ++t) out[t] = out[t] * sigmoid(out[t]);
      std::copy(e + d.n, e + d.n + d.tail(), r.state.data() + task * d.tail());
      Worker& wk = workers[worker];
      wk.ok = wk.ok && simd::all_finite(out, static_cast<size_t>(d.n)) &&
              simd::all_finite(e + d.n, static_cast<size_t>(d.tail()));
    }
  });
  for (int w = 0; w < workers.size(); ++w)
    if (!workers[w].ok) fail_on_results(fn, d, in);
  return r;
}

template <class T>
CausalConv1dGrads<T> backward(const char* fn, const Inputs<T>& in, const Dims& d, const CausalConv1dOptions& opts) {
  const int64_t tail = d.tail(), W = d.width, n = d.n;
  CausalConv1dGrads<T> g{Tensor<T>(in.x.shape, false, Init::Uninitialized),
                         Tensor<T>(in.weight.shape, false, Init::Uninitialized),
                         d.has_bias ? Tensor<T>({d.channels}, false, Init::Uninitialized) : Tensor<T>(Shape{0}),
                         Tensor<T>({d.batch, d.channels, tail}, false, Init::Uninitialized)};
  const int64_t group = tasks_per_index(d.channels, d.batch * (n + 1) * 2 * W);
  const ParallelLoop loop((d.channels + group - 1) / group);
  PerWorker<Worker> workers(loop);
  struct Scratch {
    std::vector<T> ext, dz, dext;
    std::vector<double> dw;  // a channel's dweight, summed over the batch
  };
  PerWorker<Scratch> scratch(loop, [&] {
    return Scratch{std::vector<T>(static_cast<size_t>(tail + n)), std::vector<T>(static_cast<size_t>(n)),
                   std::vector<T>(static_cast<size_t>(tail + n)), std::vector<double>(static_cast<size_t>(W))};
  });
  loop.run([&](int64_t index, int worker) {
    Scratch& s = scratch[worker];
    Worker& wk = workers[worker];
    for (int64_t c = index * group; c < std::min(d.channels, (index + 1) * group); ++c) {
      const T* w = in.weight.data + c * W;
      std::vector<double>& dw = s.dw;
      std::fill(dw.begin(), dw.end(), 0.0);
      double dbias = 0.0;
      for (int64_t b = 0; b < d.batch; ++b) {
        const int64_t task = b * d.channels + c;
        T *e = s.ext.data(), *dz = s.dz.data(), *de = s.dext.data();
        extended(d, in, task, e);
        const T* dout = in.dout.data + task * n;
        preactivation(d, w, d.has_bias ? in.bias.data[c] : T(0), e, dz);
        for (int64_t t = 0; t < n; ++t) {
          if (opts.silu) {
            const T sig = sigmoid(dz[t]);
            dz[t] = dout[t] * sig * (T(1) + dz[t] * (T(1) - sig));
          } else {
            dz[t] = dout[t];
          }
          dbias += static_cast<double>(dz[t]);
        }
        // dx̃: the final state's gradient on the last W−1 positions, then Σ_j dz_{i−j} w[j]
        std::fill(de, de + tail + n, T(0));
        if (in.dstate.data)
          for (int64_t i = 0; i < tail; ++i) de[n + i] += in.dstate.data[task * tail + i];
        for (int64_t j = 0; j < W; ++j) {
          const T wj = w[j];
          T* target = de + j;
          double acc = 0.0;
          for (int64_t t = 0; t < n; ++t) {
            target[t] += dz[t] * wj;
            acc += static_cast<double>(dz[t]) * static_cast<double>(e[t + j]);
          }
          dw[j] += acc;
        }
        std::copy(de + tail, de + tail + n, g.dx.data() + task * n);
        std::copy(de, de + tail, g.dinitial_state.data() + task * tail);
        wk.ok = wk.ok && simd::all_finite(de, static_cast<size_t>(tail + n));
      }
      for (int64_t j = 0; j < W; ++j) g.dweight.data()[c * W + j] = static_cast<T>(dw[j]);
      if (d.has_bias) g.dbias.data()[c] = static_cast<T>(dbias);
      wk.ok = wk.ok && std::isfinite(dbias) && simd::all_finite(g.dweight.data() + c * W, static_cast<size_t>(W));
    }
  });
  for (int w = 0; w < workers.size(); ++w)
    if (!workers[w].ok) fail_on_results(fn, d, in);
  return g;
}

}  // namespace conv1d

template <class T>
CausalConv1dResult<T> causal_conv1d(TensorView<const T> x, TensorView<const T> weight, TensorView<const T> bias,
                                    TensorView<const T> initial_state, const CausalConv1dOptions& opts) {
  const char* fn = "causal_conv1d";
  const conv1d::Inputs<T> in{x, weight, bias, initial_state, {}, {}};
  return conv1d::forward(fn, in, conv1d::check_args(fn, in), opts);
}

template <class T>
CausalConv1dGrads<T> causal_conv1d_backward(TensorView<const T> x, TensorView<const T> weight,
                                            TensorView<const T> bias, TensorView<const T> initial_state,
                                            TensorView<const T> dout, TensorView<const T> dstate,
                                            const CausalConv1dOptions& opts) {
  const char* fn = "causal_conv1d_backward";
  const conv1d::Inputs<T> in{x, weight, bias, initial_state, dout, dstate};
  const conv1d::Dims d = conv1d::check_args(fn, in);
  check_shape(fn, "dout", dout, x.shape);
  return conv1d::backward(fn, in, d, opts);
}

#define LINATTN_INSTANTIATE(T)                                                                                  \
  template CausalConv1dResult<T> causal_conv1d(TensorView<const T>, TensorView<const T>, TensorView<const T>,   \
                                               TensorView<const T>, const CausalConv1dOptions&);               \
  template CausalConv1dGrads<T> causal_conv1d_backward(TensorView<const T>, TensorView<const T>,                \
                                                       TensorView<const T>, TensorView<const T>,                \
                                                       TensorView<const T>, TensorView<const T>,                \
                                                       const CausalConv1dOptions&);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
