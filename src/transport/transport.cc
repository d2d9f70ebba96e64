#include "ecx/transport/transport.h"

#include <fmt/format.h>

namespace ecx::transport {

std::string_view landing_choice_name(LandingChoice choice) noexcept {
  return choice == LandingChoice::receiver ? "receiver-chosen" : "sender-chosen";
}

Capabilities Transport::capabilities() const noexcept { return Capabilities{}; }

// The interface takes its callbacks by value (an implementation keeps them until the
// transfer ends); these defaults refuse at once and never hold them.
// NOLINTBEGIN(performance-unnecessary-value-param)
Status Transport::write(EndpointHandle, RegionHandle, std::uint64_t, std::uint64_t, std::uint64_t, TimePoint,
                        WriteCallback, OverdueCallback) {
  return invalid_argument(
      fmt::format("{}: the receiver chooses where a payload lands; one-sided write() is not available", name()));
}

Status Transport::send_confirmed(EndpointHandle, std::span<const std::byte>, RegionHandle, std::uint64_t, std::uint64_t,
                                 TimePoint, SendCallback) {
  return invalid_argument(fmt::format("{}: confirmed sends are not available on this data plane", name()));
}
// NOLINTEND(performance-unnecessary-value-param)

std::string Transport::segment_name() const { return {}; }

}  // namespace ecx::transport
