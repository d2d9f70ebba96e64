#include "ecx/transport/transport.h"

#include <fmt/format.h>

namespace ecx::transport {

std::string_view landing_choice_name(LandingChoice choice) noexcept {
  return choice == LandingChoice::receiver ? "receiver-chosen" : "sender-chosen";
}

Capabilities Transport::capabilities() const noexcept { return Capabilities{}; }

Status Transport::write(EndpointHandle, RegionHandle, std::uint64_t, std::uint64_t, std::uint64_t, TimePoint,
                        WriteCallback, OverdueCallback) {
  return invalid_argument(
      fmt::format("{}: the receiver chooses where a payload lands; one-sided write() is not available", name()));
}

Status Transport::send_confirmed(EndpointHandle, std::span<const std::byte>, RegionHandle, std::uint64_t, std::uint64_t,
                                 TimePoint, SendCallback) {
  return invalid_argument(fmt::format("{}: confirmed sends are not available on this data plane", name()));
}

std::string Transport::segment_name() const { return {}; }

}  // namespace ecx::transport
