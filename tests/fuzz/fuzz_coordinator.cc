// State-machine fuzzer for the scheduler coordinator: the input's bytes are the
// decisions of the engine model in tests/unit/scheduler/coordinator_model.h
// (requests arriving with shared or colliding transfer ids, gates, allocations,
// frees and evictions, readiness events from one or two shards, worker reports,
// time passing, engine steps). After every operation the coordinator's invariants
// must hold (the transfer table's, deadlines honoured, each unavailable request
// told once); at the end of the life, once every request finished and every
// deadline passed, no live record but resident copies and no per-request or
// per-copy bookkeeping may be left.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "coordinator_model.h"
#include "core/logging.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ecx::log::set_level(spdlog::level::off);  // the model's hostile requests are logged; keep the fuzzer quiet
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // Every operation reads at least one byte: an input runs as many operations as
  // it has bytes, up to a bound that keeps each run short.
  constexpr std::size_t kMaxOperations = 400;
  ecx::scheduler::testing::ByteChoices choices(data, size);
  ecx::scheduler::testing::CoordinatorModel model(choices);
  std::string problem = model.run(static_cast<int>(std::min(size, kMaxOperations)));
  if (problem.empty()) problem = model.settle();
  if (!problem.empty()) {
    std::fprintf(stderr, "coordinator invariant broken: %s\n", problem.c_str());
    std::abort();
  }
  return 0;
}
