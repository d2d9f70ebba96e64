#include "ecx/core/clock.h"

namespace ecx {

std::shared_ptr<const Clock> SteadyClock::shared() {
  static const auto instance = std::make_shared<const SteadyClock>();
  return instance;
}

void ManualClock::set(TimePoint to) noexcept {
  const auto target = to.time_since_epoch().count();
  auto current = now_ns_.load(std::memory_order_acquire);
  while (current < target && !now_ns_.compare_exchange_weak(current, target, std::memory_order_acq_rel)) {
  }
}

}  // namespace ecx
