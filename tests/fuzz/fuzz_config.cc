// libFuzzer target for the --ec-transfer-config parser. The first bytes choose a
// parallel layout (valid or not), the rest is the JSON document. Any input must
// come back as a Config or an error naming what is wrong (never a crash, an
// exception or undefined behaviour); a parsed Config is deterministic and its
// derived values (addresses, the description) are computable.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ecx/core/config.h"

namespace {

void check(bool condition) {
  if (!condition) std::abort();
}

// auth_secret_file names a file the parser reads: keep the fuzzer off the file system.
bool names_a_file(const nlohmann::json& document) {
  if (!document.is_object()) return false;
  auto extra = document.find("ec_connector_extra_config");
  return extra != document.end() && extra->is_object() && extra->contains("auth_secret_file");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  ecx::ParallelLayout layout;
  layout.tp_size = static_cast<int>(data[0] % 10) - 1;  // -1..8: invalid sizes too
  layout.tp_rank = static_cast<int>(data[1] % 10) - 1;
  layout.dp_size = 1 + data[2] % 4;
  layout.dp_index = static_cast<int>(data[2] / 4 % 5);
  const std::string_view text(reinterpret_cast<const char*>(data + 3), size - 3);
  if (names_a_file(nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false))) return 0;

  auto config = ecx::parse_config(text, layout);
  auto again = ecx::parse_config(text, layout);
  check(config.is_ok() == again.is_ok());
  if (!config) {
    check(!config.status().message().empty());
    check(config.status().to_string() == again.status().to_string());
    return 0;
  }
  const std::string description = ecx::describe_config(*config);
  check(description == ecx::describe_config(*again));
  check(config->layout.tp_rank >= 0 && config->layout.tp_rank < config->layout.tp_size);
  check(!config->control_address(config->layout.tp_rank).empty());
  check(config->buffer_size >= 4096);
  check(config->effective_max_tensor_bytes() > 0 && config->effective_max_tensor_bytes() <= config->buffer_size);
  (void)config->effective_resident_capacity();
  (void)config->effective_data_ip();
  return 0;
}
