#pragma once
// Every deadline in ECX reads an injected Clock, so tests advance a ManualClock
// instead of sleeping.

#include <atomic>
#include <chrono>
#include <memory>

namespace ecx {

using Duration = std::chrono::nanoseconds;
using TimePoint = std::chrono::steady_clock::time_point;

// Monotonic time source. Implementations are thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual TimePoint now() const noexcept = 0;
};

class SteadyClock final : public Clock {
 public:
  TimePoint now() const noexcept override { return std::chrono::steady_clock::now(); }
  // A process-wide instance for production wiring.
  static std::shared_ptr<const Clock> shared();
};

// Time moves only when a test says so.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(TimePoint start = TimePoint{} + std::chrono::hours(1))
      : now_ns_(start.time_since_epoch().count()) {}

  TimePoint now() const noexcept override { return TimePoint{Duration{now_ns_.load(std::memory_order_acquire)}}; }
  void advance(Duration by) noexcept { now_ns_.fetch_add(by.count(), std::memory_order_acq_rel); }
  // Moves time to `to`; refuses to go backwards (a monotonic clock never does).
  void set(TimePoint to) noexcept;

 private:
  std::atomic<Duration::rep> now_ns_;
};

// Seconds as a Duration, for config values given in (fractional) seconds.
inline Duration seconds_to_duration(double seconds) {
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(seconds));
}

inline double duration_to_seconds(Duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace ecx
