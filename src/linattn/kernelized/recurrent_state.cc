// RecurrentState (include/linattn/kernelized.h): the causal engine run from a carried state.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "linattn/core/error.h"
#include "linattn/core/attention_args.h"
#include "linattn/core/parallel.h"
#include "linattn/core/range.h"
#include "linattn/kernelized.h"
#include "linattn/kernelized/engine.h"
#include "linattn/core/feature_map.h"

namespace linattn {
namespace {

template <class T>
Tensor<T> clone(const Tensor<T>& x) {
  Tensor<T> y(x.shape());
  std::copy(x.data(), x.data() + x.size(), y.data());
  return y;
}

}  // namespace

template <class T>
struct RecurrentState<T>::Impl {
  int64_t batch = 0, heads = 0, head_dim = 0, value_dim = 0, tokens = 0;
  RecurrentOptions opts;
  Tensor<T> projection;  // owned copy (favor)
  FeatureMap<T> fmap;    // points into projection
  Tensor<T> S, z, c;     // [B,H,m',d_v], [B,H,m'], [B,H,m']
  SingleUser user;       // prefill, step and copy from two threads at once are refused

  void rebuild_map() {
    std::optional<TensorView<const T>> w;
    if (opts.feature_map == "favor") w = projection.view();
    fmap = feature_map_from_options<T>("recurrent_state", opts, head_dim, w);
  }

  // The engine's causal path from the carried state over q, k, v [B,H,n,·] (checked).
  void run(const char* fn, const AttentionDims& d, TensorView<const T> q, TensorView<const T> k,
           TensorView<const T> v, T* out) {
    check_given_features(fn, "q", fmap, q);
    check_given_features(fn, "k", fmap, k);
    AttentionOptions mo;
    mo.causal = true;
    const KeyMask mask(d, mo);
    kernelized::forward_causal_from_state<T>({fn, q, k, v, d, &mask, &fmap, static_cast<T>(opts.eps)},
                                             out, S.data(), z.data(), c.data());
    tokens += d.n_q;
  }
};

template <class T>
RecurrentState<T>::RecurrentState(int64_t batch, int64_t heads, int64_t head_dim,
                                  int64_t value_dim, const RecurrentOptions& opts,
                                  std::optional<TensorView<const T>> projection)
    : impl_(std::make_unique<Impl>()) {
  const char* fn = "recurrent_state";
  Impl& s = *impl_;
  s.batch = batch, s.heads = heads, s.head_dim = head_dim, s.value_dim = value_dim, s.opts = opts;
  require(batch >= 0 && heads >= 0, fn, ": batch and heads must be >= 0, got ", batch, ", ", heads);
  require(head_dim >= 1 && value_dim >= 1, fn, ": head_dim and value_dim must be >= 1, got ",
          head_dim, ", ", value_dim);
  feature_map_from_options<T>(fn, s.opts, head_dim, projection);  // checks the options
  const bool favor = opts.feature_map == "favor";
  if (favor) {  // an owned copy, which the map points into
    s.projection = Tensor<T>(projection->shape);
    std::copy(projection->data, projection->data + projection->size(), s.projection.data());
  }
  s.rebuild_map();
  const int64_t m = s.fmap.dim();
  if (batch > 0 && heads > 0)  // S [B,H,m',d_v], z, c: the state's size, checked before allocating
    sized_by_arguments(fn, "the state S",
                       {{"batch", batch}, {"heads", heads}, {"feature dim", m}, {"value_dim", value_dim}},
                       sizeof(T));
  s.S = Tensor<T>({batch, heads, m, value_dim});
  s.z = Tensor<T>({batch, heads, m});
  s.c = Tensor<T>({batch, heads, m});
  const T c0 = favor ? -std::numeric_limits<T>::infinity() : T(0);  // per feature: no key yet
  for (int64_t i = 0; i < s.c.size(); ++i) s.c[i] = c0;
}

template <class T>
RecurrentState<T>::RecurrentState(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
template <class T>
RecurrentState<T>::RecurrentState(RecurrentState&&) noexcept = default;
template <class T>
RecurrentState<T>& RecurrentState<T>::operator=(RecurrentState&&) noexcept = default;
template <class T>
RecurrentState<T>::~RecurrentState() = default;

template <class T>
int64_t RecurrentState<T>::tokens() const { return impl_->tokens; }
template <class T>
int64_t RecurrentState<T>::feature_dim() const { return impl_->fmap.dim(); }

template <class T>
RecurrentState<T> RecurrentState<T>::copy() const {
  const Impl& s = *impl_;
  const SingleUser::Scope in_use(s.user, "RecurrentState.copy", "this state");
  auto r = std::make_unique<Impl>();
  r->batch = s.batch, r->heads = s.heads, r->head_dim = s.head_dim, r->value_dim = s.value_dim;
  r->tokens = s.tokens;
  r->opts = s.opts;
  r->projection = clone(s.projection);
  r->rebuild_map();  // points at the copy's own projection
  r->S = clone(s.S), r->z = clone(s.z), r->c = clone(s.c);
  return RecurrentState(std::move(r));
}

template <class T>
Tensor<T> RecurrentState<T>::prefill(TensorView<const T> q, TensorView<const T> k,
                                     TensorView<const T> v) {
  const char* fn = "RecurrentState.prefill";
  Impl& s = *impl_;
  const SingleUser::Scope in_use(s.user, fn, "this state");
  AttentionOptions mo;
  mo.causal = true;
  const AttentionDims d = check_attention_args(fn, q, k, v, mo);
  require(d.batch == s.batch && d.heads == s.heads && d.head_dim == s.head_dim && d.value_dim == s.value_dim,
          fn, ": q, k, v have batch, heads, head_dim, value_dim = ", d.batch, ", ", d.heads, ", ",
          d.head_dim, ", ", d.value_dim, "; the state was made for ", s.batch, ", ", s.heads, ", ",
          s.head_dim, ", ", s.value_dim);
  require(d.n_q == d.n_k, fn, ": q and k must have the same length (got ", d.n_q, " and ", d.n_k, ")");
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim}, false, Init::Uninitialized);
  s.run(fn, d, q, k, v, out.data());
  check_result_finite(fn, "the output", out);
  return out;
}

template <class T>
Tensor<T> RecurrentState<T>::step(TensorView<const T> q_t, TensorView<const T> k_t,
                                  TensorView<const T> v_t) {
  const char* fn = "RecurrentState.step";
  Impl& s = *impl_;
  const SingleUser::Scope in_use(s.user, fn, "this state");
  const Shape qk{s.batch, s.heads, s.head_dim}, vs{s.batch, s.heads, s.value_dim};
  check_same_shape_finite(fn, "q_t", q_t, qk);
  check_same_shape_finite(fn, "k_t", k_t, qk);
  check_same_shape_finite(fn, "v_t", v_t, vs);
  // One token is a causal chunk of one row: the engine's prefill path, so a step gives exactly
  // what prefill gives for the same token.
  const Shape one_qk{s.batch, s.heads, 1, s.head_dim}, one_v{s.batch, s.heads, 1, s.value_dim};
  const TensorView<const T> q{q_t.data, one_qk}, k{k_t.data, one_qk}, v{v_t.data, one_v};
  const AttentionDims d{{s.batch, s.heads, 1, 1, s.head_dim, s.value_dim}};
  Tensor<T> out({s.batch, s.heads, s.value_dim}, false, Init::Uninitialized);
  s.run(fn, d, q, k, v, out.data());
  check_result_finite(fn, "the output", out);
  return out;
}

template class RecurrentState<float>;
template class RecurrentState<double>;

}  // namespace linattn
