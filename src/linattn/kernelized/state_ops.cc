// The state-level operations of kernelized attention (include/linattn/kernelized.h: key_state,
// apply_state, causal_from_state and their backwards): argument checks, the feature map from
// RecurrentOptions, and the engine's state entry points (engine.h).
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/range.h"
#include "linattn/core/simd.h"
#include "linattn/kernelized.h"
#include "linattn/kernelized/engine.h"
#include "linattn/core/feature_map.h"

namespace linattn {

template <class T>
FeatureMap<T> feature_map_from_options(const char* fn, RecurrentOptions& opts, int64_t head_dim,
                                       std::optional<TensorView<const T>> projection) {
  if (opts.feature_map == "favor") {
    require(projection.has_value(), fn, ": feature_map=\"favor\" needs a projection [m, ", head_dim, "]");
    opts.eps = 0;  // FAVOR's features estimate exp(q·k): no eps (as favor_attention)
    return FeatureMap<T>::favor(fn, parse_favor_kernel(fn, opts.kernel.value_or("positive")), *projection, head_dim,
                                opts.scale);
  }
  const FeatureMapKind kind = parse_plain_feature_map(fn, opts.feature_map);  // names the accepted values
  require(!projection, fn, ": projection is only used with feature_map=\"favor\"");
  require(!opts.kernel, fn, ": kernel is only used with feature_map=\"favor\"");
  require(!opts.scale, fn, ": scale is only used with feature_map=\"favor\"");
  require(std::isfinite(opts.eps) && opts.eps >= 0, fn, ": eps must be finite and >= 0, got ", opts.eps);
  return FeatureMap<T>::plain(fn, kind, head_dim, opts.focus_power);
}
template FeatureMap<float> feature_map_from_options(const char*, RecurrentOptions&, int64_t,
                                                    std::optional<TensorView<const float>>);
template FeatureMap<double> feature_map_from_options(const char*, RecurrentOptions&, int64_t,
                                                     std::optional<TensorView<const double>>);

namespace {

template <class T>
void check_rank4(const char* fn, const char* name, TensorView<const T> x, const char* layout) {
  require(x.shape.size() == 4, fn, ": ", name, " must be ", layout, ", got shape ", shape_string(x.shape));
}

// One call's sizes, map, mask and engine problem. q, k, v may be empty views where the
// operation has none (their sizes then come from the others).
template <class T>
struct StateCall {
  StateCall(const char* fn, std::optional<TensorView<const T>> q, std::optional<TensorView<const T>> k,
            std::optional<TensorView<const T>> v, int64_t value_dim, const RecurrentOptions& options,
            std::optional<TensorView<const T>> projection, const std::optional<std::vector<int64_t>>& key_lengths,
            bool causal)
      : fn(fn), opts(options) {
    const char* qk = "[batch, heads, n, head_dim]";
    if (q) check_rank4(fn, "q", *q, qk);
    if (k) check_rank4(fn, "k", *k, qk);
    if (v) check_rank4(fn, "v", *v, "[batch, heads, n, value_dim]");
    const TensorView<const T>& first = q ? *q : *k;
    d.batch = first.dim(0), d.heads = first.dim(1), d.head_dim = first.dim(3);
    d.n_q = q ? q->dim(2) : 0;
    d.n_k = k ? k->dim(2) : 0;
    d.value_dim = v ? v->dim(3) : value_dim;
    require(d.head_dim >= 1, fn, ": head_dim must be >= 1, got ", d.head_dim);
    if (q && k)
      require(k->shape == q->shape, fn, ": k must have q's shape ", shape_string(q->shape), ", got ",
              shape_string(k->shape));
    if (k && v)
      require(v->dim(0) == d.batch && v->dim(1) == d.heads && v->dim(2) == d.n_k, fn, ": v must be [",
              d.batch, ", ", d.heads, ", ", d.n_k, ", value_dim] (k's batch, heads and n), got ",
              shape_string(v->shape));
    require(d.value_dim >= 1, fn, ": value_dim must be >= 1, got ", d.value_dim);
    if (key_lengths) {
      require(static_cast<int64_t>(key_lengths->size()) == d.batch, fn, ": key_lengths must hold one length per batch "
              "item (", d.batch, "), got ", key_lengths->size());
      for (int64_t len : *key_lengths)
        require(len >= 0 && len <= d.n_k, fn, ": key_lengths must be in [0, ", d.n_k, "], got ", len);
    }
    if (q) check_finite(fn, "q", *q);
    if (k) check_finite(fn, "k", *k);
    if (v) check_finite(fn, "v", *v);
    fmap = feature_map_from_options<T>(fn, opts, d.head_dim, projection);
    AttentionOptions mo;
    mo.causal = causal;
    mo.key_lengths = key_lengths;
    mask.emplace(d, mo);
    if (q) check_given_features(fn, "q", fmap, *q);
    if (k) check_given_features(fn, "k", fmap, *k, &*mask);
    const TensorView<const T> none{nullptr, {d.batch, d.heads, 0, d.head_dim}};
    problem = {fn, q.value_or(none), k.value_or(none), v.value_or(none), d, &*mask, &fmap, static_cast<T>(opts.eps)};
  }
  Shape state_shape() const { return {d.batch, d.heads, fmap.dim(), d.value_dim + 2}; }

  // A state [B,H,m',d_v+2]: S and z finite; c finite or −inf (FAVOR; its row's S and z then
  // 0, as no key reached the feature), 0 for plain maps.
  void check_state(const char* name, TensorView<const T> state) const {
    require(state.shape == state_shape(), fn, ": ", name, " has shape ", shape_string(state.shape), "; expected ",
            shape_string(state_shape()), " [batch, heads, feature dim, value_dim + 2] (a key_state of these options)");
    const int64_t row = d.value_dim + 2;
    for (int64_t at = 0; at < state.size(); at += row) {
      const T* x = state.data + at;
      for (int64_t c = 0; c + 1 < row; ++c)
        require(std::isfinite(x[c]), fn, ": ", name, "[", at + c, "] = ", x[c], "; expected a finite value");
      const T shift = x[row - 1];
      if (!fmap.log_form()) {
        require(shift == 0, fn, ": ", name, "[", at + row - 1, "] = ", shift, " is a shift, which is 0 for feature_map=\"",
                opts.feature_map, "\"");
        continue;
      }
      require(std::isfinite(shift) || shift == -std::numeric_limits<T>::infinity(), fn, ": ", name, "[", at + row - 1,
              "] = ", shift, " is a shift; expected a finite value or -inf");
      if (std::isfinite(shift)) continue;
      for (int64_t c = 0; c + 1 < row; ++c)
        require(x[c] == 0, fn, ": ", name, "[", at + c, "] = ", x[c], " in a row whose shift is -inf (no key); expected 0");
    }
  }
  // A gradient of a state: finite everywhere (its shift column is not read).
  void check_state_grad(const char* name, TensorView<const T> g) const {
    check_same_shape_finite(fn, name, g, state_shape());
  }

  const char* fn;
  RecurrentOptions opts;
  AttentionDims d;
  FeatureMap<T> fmap;
  std::optional<KeyMask> mask;
  kernelized::Problem<T> problem;
};

// The value_dim a state [B,H,m',d_v+2] holds (its full shape is checked against the call's).
template <class T>
int64_t value_dim_of(const char* fn, TensorView<const T> state) {
  require(state.shape.size() == 4, fn, ": state must be [batch, heads, feature dim, value_dim + 2], got shape ",
          shape_string(state.shape));
  return state.dim(3) - 2;
}

template <class T>
void check_saved_out(const StateCall<T>& c, TensorView<const T> dout, TensorView<const T> out,
                     TensorView<const T> den) {
  const Shape o{c.d.batch, c.d.heads, c.d.n_q, c.d.value_dim};
  check_same_shape_finite(c.fn, "dout", dout, o);
  check_same_shape_finite(c.fn, "out", out, o);
  check_same_shape_finite(c.fn, "den", den, {c.d.batch, c.d.heads, c.d.n_q});
}

// A state a kernel wrote: S and z finite (its shifts may be −inf: no key reached the feature).
template <class T>
void check_state_result(const char* fn, const Tensor<T>& state) {
  const int64_t row = state.dim(3);
  for (int64_t at = 0; at < state.size(); at += row)
    if (!simd::all_finite(state.data() + at, static_cast<size_t>(row - 1)))
      fail(fn, ": the state overflows ", dtype_name<T>(),
           ": the inputs are finite but too large for this dtype; scale them down or use float64");
}

template <class T>
Tensor<T> output(const Shape& shape) {
  return Tensor<T>(shape, false, Init::Uninitialized);
}

}  // namespace

template <class T>
Tensor<T> key_state(TensorView<const T> k, TensorView<const T> v, const StateOptions& opts,
                    std::optional<TensorView<const T>> projection, std::optional<std::vector<int64_t>> key_lengths) {
  const StateCall<T> c("key_state", std::nullopt, k, v, 0, opts, projection, key_lengths, false);
  Tensor<T> state = output<T>(c.state_shape());
  kernelized::key_state<T>(c.problem, state.data());
  check_state_result(c.fn, state);
  return state;
}

template <class T>
StateGrads<T> key_state_backward(TensorView<const T> k, TensorView<const T> v, TensorView<const T> state,
                                 TensorView<const T> dstate, const StateOptions& opts,
                                 std::optional<TensorView<const T>> projection,
                                 std::optional<std::vector<int64_t>> key_lengths) {
  const StateCall<T> c("key_state_backward", std::nullopt, k, v, 0, opts, projection, key_lengths, false);
  c.check_state("state", state);
  c.check_state_grad("dstate", dstate);
  StateGrads<T> g;
  g.dk = output<T>(k.shape);
  g.dv = output<T>(v.shape);
  if (!kernelized::key_state_backward<T>(c.problem, state.data, dstate.data, g.dk.data(), g.dv.data())) {
    check_result_finite(c.fn, "dk", g.dk);  // the kernel found a value that is not: name it
    check_result_finite(c.fn, "dv", g.dv);
  }
  return g;
}

template <class T>
StateAttentionResult<T> apply_state(TensorView<const T> q, TensorView<const T> state, const StateOptions& opts,
                                    std::optional<TensorView<const T>> projection) {
  const StateCall<T> c("apply_state", q, std::nullopt, std::nullopt, value_dim_of("apply_state", state), opts,
                       projection, std::nullopt, false);
  c.check_state("state", state);
  StateAttentionResult<T> r;
  r.out = output<T>({c.d.batch, c.d.heads, c.d.n_q, c.d.value_dim});
  r.den = output<T>({c.d.batch, c.d.heads, c.d.n_q});
  kernelized::apply_state<T>(c.problem, state.data, r.out.data(), r.den.data());
  check_result_finite(c.fn, "the output", r.out);
  check_result_finite(c.fn, "a normaliser", r.den);  // inf there would make out 0, not an error
  return r;
}

template <class T>
StateGrads<T> apply_state_backward(TensorView<const T> q, TensorView<const T> state, TensorView<const T> dout,
                                   TensorView<const T> out, TensorView<const T> den, const StateOptions& opts,
                                   std::optional<TensorView<const T>> projection) {
  const StateCall<T> c("apply_state_backward", q, std::nullopt, std::nullopt,
                       value_dim_of("apply_state_backward", state), opts, projection, std::nullopt, false);
  c.check_state("state", state);
  check_saved_out(c, dout, out, den);
  StateGrads<T> g;
  g.dq = output<T>(q.shape);
  g.dstate = output<T>(state.shape);
  if (!kernelized::apply_state_backward<T>(c.problem, state.data, dout.data, out.data, den.data, g.dq.data(),
                                           g.dstate.data())) {
    check_result_finite(c.fn, "dq", g.dq);
    check_result_finite(c.fn, "dstate", g.dstate);
  }
  return g;
}

template <class T>
StateAttentionResult<T> causal_from_state(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                          TensorView<const T> prefix, const StateOptions& opts,
                                          std::optional<TensorView<const T>> projection,
                                          std::optional<std::vector<int64_t>> key_lengths) {
  const StateCall<T> c("causal_from_state", q, k, v, 0, opts, projection, key_lengths, true);
  c.check_state("prefix", prefix);
  StateAttentionResult<T> r;
  r.out = output<T>({c.d.batch, c.d.heads, c.d.n_q, c.d.value_dim});
  r.den = output<T>({c.d.batch, c.d.heads, c.d.n_q});
  r.state = output<T>(c.state_shape());
  kernelized::causal_from_state<T>(c.problem, prefix.data, r.out.data(), r.den.data(), r.state.data());
  check_result_finite(c.fn, "the output", r.out);
  check_result_finite(c.fn, "a normaliser", r.den);
  check_state_result(c.fn, r.state);
  return r;
}

template <class T>
StateGrads<T> causal_from_state_backward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                                         TensorView<const T> prefix, TensorView<const T> dout,
                                         TensorView<const T> out, TensorView<const T> den,
                                         std::optional<TensorView<const T>> dstate_after, const StateOptions& opts,
                                         std::optional<TensorView<const T>> projection,
                                         std::optional<std::vector<int64_t>> key_lengths) {
  const StateCall<T> c("causal_from_state_backward", q, k, v, 0, opts, projection, key_lengths, true);
  c.check_state("prefix", prefix);
  check_saved_out(c, dout, out, den);
  if (dstate_after) c.check_state_grad("dstate_after", *dstate_after);
  StateGrads<T> g;
  g.dq = output<T>(q.shape);
  g.dk = output<T>(k.shape);
  g.dv = output<T>(v.shape);
  g.dstate = output<T>(prefix.shape);
  if (!kernelized::causal_from_state_backward<T>(c.problem, prefix.data, dout.data, out.data, den.data,
                                                 dstate_after ? dstate_after->data : nullptr, g.dq.data(),
                                                 g.dk.data(), g.dv.data(), g.dstate.data())) {
    check_result_finite(c.fn, "dq", g.dq);
    check_result_finite(c.fn, "dk", g.dk);
    check_result_finite(c.fn, "dv", g.dv);
    check_result_finite(c.fn, "dprefix", g.dstate);
  }
  return g;
}

#define LINATTN_INSTANTIATE(T)                                                                                    \
  template Tensor<T> key_state(TensorView<const T>, TensorView<const T>, const StateOptions&,                    \
                               std::optional<TensorView<const T>>, std::optional<std::vector<int64_t>>);        \
  template StateGrads<T> key_state_backward(TensorView<const T>, TensorView<const T>, TensorView<const T>,       \
                                            TensorView<const T>, const StateOptions&,                           \
                                            std::optional<TensorView<const T>>, std::optional<std::vector<int64_t>>); \
  template StateAttentionResult<T> apply_state(TensorView<const T>, TensorView<const T>, const StateOptions&,     \
                                               std::optional<TensorView<const T>>);                             \
  template StateGrads<T> apply_state_backward(TensorView<const T>, TensorView<const T>, TensorView<const T>,     \
                                              TensorView<const T>, TensorView<const T>, const StateOptions&,    \
                                              std::optional<TensorView<const T>>);                              \
  template StateAttentionResult<T> causal_from_state(TensorView<const T>, TensorView<const T>,                  \
                                                     TensorView<const T>, TensorView<const T>,                  \
                                                     const StateOptions&, std::optional<TensorView<const T>>,   \
                                                     std::optional<std::vector<int64_t>>);                      \
  template StateGrads<T> causal_from_state_backward(                                                             \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>, TensorView<const T>,   \
      TensorView<const T>, TensorView<const T>, std::optional<TensorView<const T>>, const StateOptions&,         \
      std::optional<TensorView<const T>>, std::optional<std::vector<int64_t>>);
LINATTN_INSTANTIATE(float)
LINATTN_INSTANTIATE(double)
#undef LINATTN_INSTANTIATE

}  // namespace linattn
