#include "transport/ucx/common.h"

#include <fmt/format.h>

namespace ecx::transport::ucx {

std::shared_ptr<spdlog::logger> logger() {
  static const auto instance = log::get("transport");
  return instance;
}

std::string printable(std::string_view peer) {
  return peer.size() <= 40 ? std::string(peer) : fmt::format("{}...({} chars)", peer.substr(0, 24), peer.size());
}

Status ucx_error(std::string_view what, ucs_status_t status) {
  const std::string message = fmt::format("{}: {}", what, ucs_status_string(status));
  switch (status) {
    case UCS_ERR_CANCELED:
      return cancelled(message);
    case UCS_ERR_TIMED_OUT:
      return timeout_error(message);
    case UCS_ERR_REJECTED:
      return resource_exhausted(message);
    case UCS_ERR_MESSAGE_TRUNCATED:
    case UCS_ERR_INVALID_PARAM:
      return invalid_argument(message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return resource_exhausted(message);
    default:
      return unavailable(message);
  }
}

std::string_view transport_name(UcxMode mode) noexcept { return mode == UcxMode::am ? "ucx-am" : "ucx-put"; }

}  // namespace ecx::transport::ucx
