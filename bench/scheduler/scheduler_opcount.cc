// Deterministic per-call cost of the scheduler hot paths, for callgrind:
//
//   valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/dev/null
//            scheduler_opcount <operation> <live records> [calls]
//
// Builds the same tables as bench_scheduler, runs the operation until the table
// is in its steady state (tombstone bound reached), then counts only the
// measured calls (callgrind's client requests; outside valgrind they do nothing).
// Divide the "Collected" instruction count by `calls`. Instruction counts are
// free of the noise of a shared machine: a count that grows with the table size
// means algorithmic work, a flat count with a growing time means cache misses.

#include <valgrind/callgrind.h>

#include <charconv>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "core/logging.h"
#include "sim/scheduler_fixtures.h"

namespace ecx::scheduler::bench {
namespace {

template <typename Op>
void measure(std::size_t calls, Op&& op) {
  // Steady state first: more calls than the tombstone bound of the fixtures.
  for (std::size_t i = 0; i < 4 * kTombstoneBound; ++i) op();
  CALLGRIND_ZERO_STATS;
  CALLGRIND_START_INSTRUMENTATION;
  for (std::size_t i = 0; i < calls; ++i) op();
  CALLGRIND_STOP_INSTRUMENTATION;
}

int run(std::string_view operation, std::int64_t live, std::size_t calls) {
  if (operation == "has_cache_item") {
    HasCacheItemLoop loop(live);
    measure(calls, [&] { keep(loop.step()); });
  } else if (operation == "ensure1" || operation == "ensure8") {
    EnsureLoop loop(live, operation == "ensure1" ? 1 : 8);
    measure(calls, [&] { keep(loop.step()); });
  } else if (operation == "observe_ready") {
    ObserveReadyLoop loop(live);
    measure(calls, [&] { loop.step(); });
  } else if (operation == "expire_nothing_due") {
    ExpireLoop loop(live);
    measure(calls, [&] { loop.nothing_due(); });
  } else if (operation == "expire_one_due") {
    ExpireLoop loop(live);
    measure(calls, [&] { loop.one_due(); });
  } else {
    std::fprintf(stderr,
                 "unknown operation; one of: has_cache_item ensure1 ensure8 observe_ready expire_nothing_due "
                 "expire_one_due\n");
    return 2;
  }
  return 0;
}

}  // namespace
}  // namespace ecx::scheduler::bench

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <operation> <live records> [calls]\n", argv[0]);
    return 2;
  }
  auto number = [](const char* text, std::int64_t& out) {
    const char* end = text + std::strlen(text);
    auto [ptr, ec] = std::from_chars(text, end, out);
    return ec == std::errc() && ptr == end && out > 0;
  };
  std::int64_t live = 0;
  std::int64_t calls = 10'000;
  if (!number(argv[2], live) || (argc > 3 && !number(argv[3], calls))) {
    std::fprintf(stderr, "live records and calls must be positive integers\n");
    return 2;
  }
  ecx::log::set_level(spdlog::level::off);
  return ecx::scheduler::bench::run(argv[1], live, static_cast<std::size_t>(calls));
}
