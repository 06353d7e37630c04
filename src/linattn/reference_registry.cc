#include "linattn/reference_registry.h"

#include <map>
#include <string>

#include "linattn/core/error.h"

namespace linattn::reference {

#define LINATTN_METHOD(id) ReferenceInfo reference_##id();
#include "linattn/methods.def"
#undef LINATTN_METHOD

const ReferenceInfo& reference_of(std::string_view method_name) {
  static const std::map<std::string, ReferenceInfo, std::less<>> all = {
#define LINATTN_METHOD(id) {#id, reference_##id()},
#include "linattn/methods.def"
#undef LINATTN_METHOD
  };
  const auto it = all.find(method_name);
  require(it != all.end(), "reference_of: no reference for a method named \"", method_name, "\"");
  return it->second;
}

}  // namespace linattn::reference
