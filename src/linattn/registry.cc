#include "linattn/registry.h"

#include "linattn/core/error.h"

namespace linattn {

#define LINATTN_METHOD(id) MethodInfo describe_##id();
#include "linattn/methods.def"
#undef LINATTN_METHOD

const std::vector<MethodInfo>& methods() {
  static const std::vector<MethodInfo> all = {
#define LINATTN_METHOD(id) describe_##id(),
#include "linattn/methods.def"
#undef LINATTN_METHOD
  };
  return all;
}

const MethodInfo& method(std::string_view name) {
  std::string known;
  for (const MethodInfo& m : methods()) {
    if (m.name == name) return m;
    known += (known.empty() ? "" : ", ") + m.name;
  }
  fail("no method named \"", name, "\"; the methods are ", known);
}

const OptionInfo* MethodInfo::option(std::string_view option_name) const {
  for (const OptionInfo& o : options)
    if (o.name == option_name) return &o;
  return nullptr;
}

}  // namespace linattn
