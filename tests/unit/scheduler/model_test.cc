// Model-based randomized test: seeded random operation sequences against the
// coordinator (fed by fake events and worker reports), checking invariants after
// every operation and at the end of each life (coordinator_model.h). A failure
// names its seed; rerun one with ECX_SCHEDULER_MODEL_SEED=<seed> (and
// ECX_SCHEDULER_MODEL_TRACE=1 for every operation).

#include <gtest/gtest.h>

#include <cstdlib>

#include "coordinator_model.h"

namespace ecx::scheduler {
namespace {

// The seeds to run: ECX_SCHEDULER_MODEL_SEED alone, or `sequences` from 0
// (ECX_SCHEDULER_MODEL_SEQUENCES overrides the count).
struct Seeds {
  std::uint64_t first = 0;
  std::uint64_t count = 0;
};
Seeds seeds(std::uint64_t sequences) {
  // Read before any thread starts.
  const char* seed = std::getenv("ECX_SCHEDULER_MODEL_SEED");        // NOLINT(concurrency-mt-unsafe)
  const char* count = std::getenv("ECX_SCHEDULER_MODEL_SEQUENCES");  // NOLINT(concurrency-mt-unsafe)
  if (seed != nullptr && *seed != '\0') return {std::strtoull(seed, nullptr, 10), 1};
  if (count != nullptr && *count != '\0') sequences = std::strtoull(count, nullptr, 10);
  return {0, sequences};
}

#ifdef ECX_SANITIZED
constexpr std::uint64_t kDefaultSequences = 1'000;  // sanitizers are ~10x slower
#else
constexpr std::uint64_t kDefaultSequences = 10'000;
#endif

TEST(SchedulerModel, RandomSequencesKeepEveryInvariant) {
  const auto [first, count] = seeds(kDefaultSequences);
  for (std::uint64_t seed = first; seed < first + count; ++seed) {
    testing::SeededChoices choices(seed);
    testing::CoordinatorModel model(choices);
    std::string problem = model.run(80);
    if (problem.empty()) problem = model.settle();
    ASSERT_TRUE(problem.empty()) << "seed " << seed << ": " << problem
                                 << "\n(rerun with ECX_SCHEDULER_MODEL_SEED=" << seed << ")";
  }
  RecordProperty("sequences", static_cast<int>(count));
}

// The load gate's memo of waiting requests decides nothing: the same random lives,
// run with it and without it, make the same decisions after every operation (the
// records and their states, the engine's cache, the loads, which requests passed and
// which were told unavailable).
TEST(SchedulerModel, RememberingWaitingRequestsChangesNoDecision) {
  // Each seed runs twice: half as many seeds for about the same time.
  const auto [first, count] = seeds(kDefaultSequences / 2);
  std::uint64_t remembered = 0;
  for (std::uint64_t seed = first; seed < first + count; ++seed) {
    testing::SeededChoices choices_with(seed);
    testing::SeededChoices choices_without(seed);
    testing::CoordinatorModel with(choices_with, /*remember_waiting=*/true);
    testing::CoordinatorModel without(choices_without, /*remember_waiting=*/false);
    std::vector<std::string> decisions_with;
    std::vector<std::string> decisions_without;
    with.record_decisions(&decisions_with);
    without.record_decisions(&decisions_without);
    std::string problem = with.run(80);
    ASSERT_EQ(problem, without.run(80)) << "seed " << seed;
    ASSERT_EQ(decisions_with.size(), decisions_without.size()) << "seed " << seed;
    for (std::size_t k = 0; k < decisions_with.size(); ++k) {
      ASSERT_EQ(decisions_with[k], decisions_without[k])
          << "seed " << seed << ", operation #" << k << " (rerun with ECX_SCHEDULER_MODEL_SEED=" << seed << ")";
    }
    if (problem.empty()) {
      problem = with.settle();
      ASSERT_EQ(problem, without.settle()) << "seed " << seed;
    }
    ASSERT_TRUE(problem.empty()) << "seed " << seed << ": " << problem;
    EXPECT_EQ(without.coordinator().stats().rechecks_remembered, 0u);
    remembered += with.coordinator().stats().rechecks_remembered;
  }
  // The memo answered re-checks (the comparison above would prove nothing otherwise);
  // a single seed rerun may never need it.
  if (count > 1) {
    EXPECT_GT(remembered, count);
  }
  RecordProperty("rechecks_remembered", static_cast<int>(remembered));
}

}  // namespace
}  // namespace ecx::scheduler
