// A registry call's arguments as hybrid_attention's typed options and inputs (used by
// register.cc and by the reference's registration).
#pragma once

#include "linattn/core/method_support.h"
#include "linattn/hybrid.h"

namespace linattn::hybrid {

template <class T>
struct Call {
  HybridAttentionOptions opts;
  HybridInputs<T> in;
};

template <class T>
Call<T> call_from(const MethodArgs<T>& a) {
  const registry_support::ArgReader<T> r(method("hybrid"), a);
  Call<T> c;
  r.read_common(c.opts);
  r.read("window", c.opts.window);
  r.read("sinks", c.opts.sinks);
  r.read("feature_map", c.opts.feature_map);
  r.read("kernel", c.opts.kernel);
  r.read("focus_power", c.opts.focus_power);
  r.read("eps", c.opts.eps);
  c.in.query_features = r.tensor("query_features");
  c.in.key_features = r.tensor("key_features");
  c.in.window_gate = r.tensor("window_gate");
  c.in.projection = r.tensor("projection");
  c.in.log_decay = r.tensor("log_decay");
  return c;
}

}  // namespace linattn::hybrid
