// The feature maps on their own (include/linattn/kernelized.h: features, feature_logits and their
// backwards): the FeatureMap the attention kernels use, over blocks of rows on the worker pool,
// so that Python's decoding and context-parallel layers call the one formula instead of their own.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "linattn/core/attention_args.h"
#include "linattn/core/error.h"
#include "linattn/core/feature_map.h"
#include "linattn/core/parallel.h"
#include "linattn/kernelized.h"

namespace linattn {
namespace {

template <class T>
void check_rows(const char* fn, TensorView<const T> x) {
  require(x.rank() == 4, fn, ": x must be [batch, heads, n, head_dim], got shape ", shape_string(x.shape));
  require(x.dim(3) >= 1, fn, ": head_dim (the last dimension of x) must be >= 1, got ", x.dim(3));
  check_finite(fn, "x", x);
}

// fn(first row, rows) over the B·H·n rows of x in blocks of about 2^16 multiply-adds
// (work_per_row each), on the worker pool.
template <class Fn>
void for_row_blocks(int64_t rows, int64_t work_per_row, Fn&& fn) {
  const int64_t block = tasks_per_index(rows, work_per_row);
  parallel_for((rows + block - 1) / block, [&](int64_t task) {
    const int64_t first = task * block;
    fn(first, std::min(block, rows - first));
  });
}

template <class T>
FeatureMap<T> plain_map(const char* fn, const RecurrentOptions& options, int64_t head_dim) {
  require(options.feature_map != "favor", fn, ": feature_map=\"favor\" is in log form: use feature_logits");
  RecurrentOptions opts = options;
  opts.eps = 0;  // not used here: no eps check
  return feature_map_from_options<T>(fn, opts, head_dim, std::nullopt);
}

template <class T>
FeatureMap<T> favor_map(const char* fn, const RecurrentOptions& options, int64_t head_dim,
                        TensorView<const T> projection) {
  require(options.feature_map == "favor", fn, ": feature_map must be \"favor\" (the maps in log form), got \"",
          options.feature_map, "\"; the plain maps are features()");
  RecurrentOptions opts = options;
  return feature_map_from_options<T>(fn, opts, head_dim, projection);
}

Side parse_side(const char* fn, const std::string& side) {
  if (side == "query") return Side::Query;
  if (side == "key") return Side::Key;
  if (side == "query_with_norm") return Side::QueryWithNorm;
  fail(fn, ": side must be \"query\", \"key\" or \"query_with_norm\"; got \"", side, "\"");
}

}  // namespace

template <class T>
Tensor<T> features(TensorView<const T> x, const RecurrentOptions& opts) {
  const char* fn = "features";
  check_rows(fn, x);
  const int64_t d = x.dim(3), rows = x.size() / d;
  const FeatureMap<T> fmap = plain_map<T>(fn, opts, d);
  check_given_features(fn, "x", fmap, x);
  Tensor<T> phi(x.shape);
  for_row_blocks(rows, d, [&](int64_t first, int64_t n) { fmap.features(x.data + first * d, n, phi.data() + first * d); });
  return phi;
}

template <class T>
Tensor<T> features_backward(TensorView<const T> x, TensorView<const T> dphi, const RecurrentOptions& opts) {
  const char* fn = "features_backward";
  check_rows(fn, x);
  check_same_shape_finite(fn, "dphi", dphi, x.shape);
  const int64_t d = x.dim(3), rows = x.size() / d;
  const FeatureMap<T> fmap = plain_map<T>(fn, opts, d);
  check_given_features(fn, "x", fmap, x);
  Tensor<T> dx(x.shape);
  for_row_blocks(rows, 4 * d, [&](int64_t first, int64_t n) {
    std::vector<T> phi(static_cast<size_t>(n * d));  // the forward's features, which the elu slope reads
    fmap.features(x.data + first * d, n, phi.data());
    fmap.features_backward(x.data + first * d, n, phi.data(), dphi.data + first * d, dx.data() + first * d);
  });
  return dx;
}

template <class T>
FeatureLogits<T> feature_logits(TensorView<const T> x, TensorView<const T> projection, const std::string& side,
                                const RecurrentOptions& opts) {
  const char* fn = "feature_logits";
  check_rows(fn, x);
  const Side s = parse_side(fn, side);
  const int64_t d = x.dim(3), rows = x.size() / d;
  const FeatureMap<T> fmap = favor_map<T>(fn, opts, d, projection);
  const int64_t m = fmap.dim();
  FeatureLogits<T> out{Tensor<T>({x.dim(0), x.dim(1), x.dim(2), m}),
                       Tensor<T>({x.dim(0), x.dim(1), x.dim(2), fmap.has_factor() ? m : 0})};
  for_row_blocks(rows, m * d, [&](int64_t first, int64_t n) {
    fmap.logits(fn, x.data + first * d, n, s, out.logits.data() + first * m,
                fmap.has_factor() ? out.factors.data() + first * m : nullptr, Products::Native, "x");
  });
  return out;
}

template <class T>
Tensor<T> feature_logits_backward(TensorView<const T> x, TensorView<const T> projection, const std::string& side,
                                  TensorView<const T> dlogits, std::optional<TensorView<const T>> dfactors,
                                  const RecurrentOptions& opts) {
  const char* fn = "feature_logits_backward";
  check_rows(fn, x);
  const Side s = parse_side(fn, side);
  const int64_t d = x.dim(3), rows = x.size() / d;
  const FeatureMap<T> fmap = favor_map<T>(fn, opts, d, projection);
  const int64_t m = fmap.dim();
  const Shape shape{x.dim(0), x.dim(1), x.dim(2), m};
  check_same_shape_finite(fn, "dlogits", dlogits, shape);
  if (dfactors) {
    require(fmap.has_factor(), fn, ": dfactors is only used with kernel=\"trig\" (the other kernels have no factors)");
    check_same_shape_finite(fn, "dfactors", *dfactors, shape);
  }
  Tensor<T> dx(x.shape);
  for_row_blocks(rows, 2 * m * d, [&](int64_t first, int64_t n) {
    const size_t block = static_cast<size_t>(n * m);
    std::vector<T> scratch(static_cast<size_t>(fmap.scratch_size(n)));
    // Trig's ∂U reads the factors s = [sin U, cos U]: made again here; absent dfactors are 0.
    std::vector<T> L, factors, zeros;
    if (fmap.has_factor()) {
      L.resize(block);
      factors.resize(block);
      fmap.logits(fn, x.data + first * d, n, s, L.data(), factors.data(), Products::Native, "x");
      if (!dfactors) zeros.assign(block, T(0));
    }
    const T* ds = !fmap.has_factor() ? nullptr : dfactors ? dfactors->data + first * m : zeros.data();
    fmap.logits_backward(x.data + first * d, n, s, dlogits.data + first * m,
                         fmap.has_factor() ? factors.data() : nullptr, ds, dx.data() + first * d, scratch.data());
  });
  return dx;
}

#define LINATTN_FEATURES(T)                                                                                        \
  template Tensor<T> features(TensorView<const T>, const RecurrentOptions&);                                       \
  template Tensor<T> features_backward(TensorView<const T>, TensorView<const T>, const RecurrentOptions&);         \
  template FeatureLogits<T> feature_logits(TensorView<const T>, TensorView<const T>, const std::string&,          \
                                           const RecurrentOptions&);                                               \
  template Tensor<T> feature_logits_backward(TensorView<const T>, TensorView<const T>, const std::string&,        \
                                             TensorView<const T>, std::optional<TensorView<const T>>,              \
                                             const RecurrentOptions&);
LINATTN_FEATURES(float)
LINATTN_FEATURES(double)
#undef LINATTN_FEATURES

}  // namespace linattn
