#include "linattn/kernelized/recurrent_state.h"

#include <cmath>
#include <limits>

#include "linattn/core/attention_args.h"
#include "linattn/core/simd.h"
#include "linattn/kernelized/engine.h"

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
RecurrentState<T>::RecurrentState(int64_t batch, int64_t heads, int64_t head_dim,
                                  int64_t value_dim, const RecurrentOptions& opts,
                                  std::optional<TensorView<const T>> projection)
    : batch_(batch), heads_(heads), head_dim_(head_dim), value_dim_(value_dim), opts_(opts) {
  const char* fn = "recurrent_state";
  require(batch >= 0 && heads >= 0, fn, ": batch and heads must be >= 0, got ", batch, ", ", heads);
  require(head_dim >= 1 && value_dim >= 1, fn, ": head_dim and value_dim must be >= 1, got ",
          head_dim, ", ", value_dim);
  const bool favor = opts.feature_map == "favor";
  if (favor) {
    require(projection.has_value(), fn, ": feature_map=\"favor\" needs a projection [m, ", head_dim, "]");
    projection_ = Tensor<T>(projection->shape);  // checked by FeatureMap::favor in rebuild_map()
    std::copy(projection->data, projection->data + projection->size(), projection_.data());
    opts_.eps = 0;
  } else {
    parse_plain_feature_map(fn, opts.feature_map);  // names the accepted values on error
    require(!projection, fn, ": projection is only used with feature_map=\"favor\"");
    require(!opts.kernel, fn, ": kernel is only used with feature_map=\"favor\"");
    require(!opts.scale, fn, ": scale is only used with feature_map=\"favor\"");
    require(std::isfinite(opts.eps) && opts.eps >= 0, fn, ": eps must be finite and >= 0, got ", opts.eps);
  }
  rebuild_map();
  const int64_t m = fmap_.dim();
  if (batch > 0 && heads > 0)  // S [B,H,m',d_v], z, c: the state's size, checked before allocating
    sized_by_arguments(fn, "the state S", {{"batch", batch}, {"heads", heads}, {"feature dim", m}, {"value_dim", value_dim}},
                       sizeof(T));
  S_ = Tensor<T>({batch, heads, m, value_dim});
  z_ = Tensor<T>({batch, heads, m});
  c_ = Tensor<T>({batch, heads, m});
  const T c0 = favor ? -std::numeric_limits<T>::infinity() : T(0);  // per feature: no key yet
  for (int64_t i = 0; i < c_.size(); ++i) c_[i] = c0;
}

template <class T>
void RecurrentState<T>::rebuild_map() {
  if (opts_.feature_map == "favor") {
    const char* fn = "recurrent_state";
    fmap_ = FeatureMap<T>::favor(fn, parse_favor_kernel(fn, opts_.kernel.value_or("positive")),
                                 projection_.view(), head_dim_, opts_.scale);
  } else {
    const char* fn = "recurrent_state";
    fmap_ = FeatureMap<T>::plain(fn, parse_plain_feature_map(fn, opts_.feature_map), head_dim_,
                                 opts_.focus_power);
  }
}

template <class T>
RecurrentState<T> RecurrentState<T>::copy() const {
  const SingleUser::Scope in_use(user_, "RecurrentState.copy", "this state");
  RecurrentState r;
  r.batch_ = batch_, r.heads_ = heads_, r.head_dim_ = head_dim_, r.value_dim_ = value_dim_;
  r.tokens_ = tokens_;
  r.opts_ = opts_;
  r.projection_ = clone(projection_);
  r.rebuild_map();  // points at the copy's own projection
  r.S_ = clone(S_), r.z_ = clone(z_), r.c_ = clone(c_);
  return r;
}

template <class T>
Tensor<T> RecurrentState<T>::prefill(TensorView<const T> q, TensorView<const T> k,
                                     TensorView<const T> v) {
  const char* fn = "RecurrentState.prefill";
  const SingleUser::Scope in_use(user_, fn, "this state");
  AttentionOptions mo;
  mo.causal = true;
  const AttentionDims d = check_attention_args(fn, q, k, v, mo);
  require(d.batch == batch_ && d.heads == heads_ && d.head_dim == head_dim_ && d.value_dim == value_dim_,
          fn, ": q, k, v have batch, heads, head_dim, value_dim = ", d.batch, ", ", d.heads, ", ",
          d.head_dim, ", ", d.value_dim, "; the state was made for ", batch_, ", ", heads_, ", ",
          head_dim_, ", ", value_dim_);
  require(d.n_q == d.n_k, fn, ": q and k must have the same length (got ", d.n_q, " and ", d.n_k, ")");
  const KeyMask mask(d, mo);
  Tensor<T> out({d.batch, d.heads, d.n_q, d.value_dim});
  kernelized::forward_causal_from_state<T>({fn, q, k, v, d, &mask, &fmap_, static_cast<T>(opts_.eps)},
                                           out.data(), S_.data(), z_.data(), c_.data());
  tokens_ += d.n_q;
  return out;
}

template <class T>
Tensor<T> RecurrentState<T>::step(TensorView<const T> q_t, TensorView<const T> k_t,
                                  TensorView<const T> v_t) {
  const char* fn = "RecurrentState.step";
  const SingleUser::Scope in_use(user_, fn, "this state");
  const Shape qk{batch_, heads_, head_dim_}, vs{batch_, heads_, value_dim_};
  check_same_shape_finite(fn, "q_t", q_t, qk);
  check_same_shape_finite(fn, "k_t", k_t, qk);
  check_same_shape_finite(fn, "v_t", v_t, vs);
  // One token is a causal chunk of one row: the engine's prefill path, so a step gives exactly
  // what prefill gives for the same token.
  const Shape one_qk{batch_, heads_, 1, head_dim_}, one_v{batch_, heads_, 1, value_dim_};
  const TensorView<const T> q{q_t.data, one_qk}, k{k_t.data, one_qk}, v{v_t.data, one_v};
  AttentionOptions mo;
  mo.causal = true;
  const AttentionDims d{batch_, heads_, 1, 1, head_dim_, value_dim_};
  const KeyMask mask(d, mo);
  Tensor<T> out({batch_, heads_, value_dim_}, false, Init::Uninitialized);
  kernelized::forward_causal_from_state<T>({fn, q, k, v, d, &mask, &fmap_, static_cast<T>(opts_.eps)},
                                           out.data(), S_.data(), z_.data(), c_.data());
  ++tokens_;
  return out;
}

template class RecurrentState<float>;
template class RecurrentState<double>;

}  // namespace linattn
