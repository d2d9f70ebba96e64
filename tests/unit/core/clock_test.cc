#include "ecx/core/clock.h"

#include <gtest/gtest.h>

namespace ecx {
namespace {

using namespace std::chrono_literals;

TEST(ManualClock, MovesOnlyWhenTold) {
  ManualClock clock;
  const auto start = clock.now();
  EXPECT_EQ(clock.now(), start);
  clock.advance(1500ms);
  EXPECT_EQ(clock.now() - start, Duration(1500ms));
}

TEST(ManualClock, SetNeverGoesBackwards) {
  ManualClock clock;
  const auto start = clock.now();
  clock.set(start + 10s);
  EXPECT_EQ(clock.now(), start + 10s);
  clock.set(start + 1s);
  EXPECT_EQ(clock.now(), start + 10s);
}

TEST(SteadyClock, IsMonotonic) {
  auto clock = SteadyClock::shared();
  const auto a = clock->now();
  const auto b = clock->now();
  EXPECT_LE(a, b);
}

TEST(Durations, SecondsConvert) {
  EXPECT_EQ(seconds_to_duration(0.25), Duration(250ms));
  EXPECT_DOUBLE_EQ(duration_to_seconds(2500ms), 2.5);
}

}  // namespace
}  // namespace ecx
