#include <fmt/format.h>

#include "ecx/store/embedding_store.h"

namespace ecx::store {
namespace {

// ':' separates the fields, so it may not appear inside one (else "a" + "b:c" and
// "a:b" + "c" would name the same key); no spaces or control bytes either.
Status check_field(std::string_view name, std::string_view value, bool may_be_empty) {
  if (value.empty()) {
    return may_be_empty ? Status::ok() : invalid_argument(fmt::format("store {} is empty", name));
  }
  if (value.size() > 512) return invalid_argument(fmt::format("store {} is longer than 512 bytes", name));
  for (char ch : value) {
    const auto c = static_cast<unsigned char>(ch);
    if (c <= 0x20 || c == 0x7f || c == ':') {
      return invalid_argument(
          fmt::format("store {} '{}' may not contain ':', spaces or control characters", name, value));
    }
  }
  return Status::ok();
}

}  // namespace

Status KeySpace::validate() const {
  if (Status s = check_field("key prefix", prefix, true); !s) return s;
  return check_field("model identity", model, false);
}

Result<std::string> KeySpace::key(std::string_view mm_hash) const {
  if (Status s = check_field("mm_hash", mm_hash, false); !s) return s;
  return fmt::format("{}:{}:{}", prefix, model, mm_hash);
}

}  // namespace ecx::store
