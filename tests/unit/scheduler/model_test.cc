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

std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

#ifdef ECX_SANITIZED
constexpr std::uint64_t kDefaultSequences = 1'000;  // sanitizers are ~10x slower
#else
constexpr std::uint64_t kDefaultSequences = 10'000;
#endif

TEST(SchedulerModel, RandomSequencesKeepEveryInvariant) {
  const std::uint64_t sequences = env_number("ECX_SCHEDULER_MODEL_SEQUENCES", kDefaultSequences);
  const std::uint64_t first = env_number("ECX_SCHEDULER_MODEL_SEED", 0);
  const std::uint64_t count = std::getenv("ECX_SCHEDULER_MODEL_SEED") ? 1 : sequences;
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

}  // namespace
}  // namespace ecx::scheduler
