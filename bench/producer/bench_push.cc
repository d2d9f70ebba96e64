// The producer's push table at steady state: every push ends and stays as a terminal
// record (for idempotency) until `terminal_limit` newer ones replace it. A run
// therefore measures a push's whole life (start, source bound, payload verdict)
// against a table holding the limit's worth of finished pushes, and the heap those
// records keep. Compare each figure with the limit-64 one of the same run.

#include <malloc.h>

#include <benchmark/benchmark.h>

#include "core/logging.h"
#include "ecx/producer/push_manager.h"
#include "sim/scheduler_fixtures.h"

namespace ecx::producer::bench {
namespace {

std::uint64_t heap_in_use() { return mallinfo2().uordblks; }

// One direct push per item, as the 64 KiB bench makes them: no reserve, one shard.
class PushLoop {
 public:
  explicit PushLoop(std::uint64_t terminal_limit)
      : clock_(std::make_shared<ManualClock>()),
        manager_(options(terminal_limit), clock_),
        spec_(TensorSpec::make({65536}, DType::uint8, 1ULL << 40).value()) {
    const std::uint64_t before = heap_in_use();
    // Fill the table to its limit, then one more round, so every push measured
    // replaces the oldest record.
    for (std::uint64_t i = 0; i < terminal_limit + 1024; ++i) step();
    heap_per_record_ = static_cast<double>(heap_in_use() - before) / static_cast<double>(terminal_limit);
  }

  void step() {
    const std::string tid = scheduler::bench::fresh_transfer_id(next_);
    const std::string hash = scheduler::bench::fresh_mm_hash(next_);
    ++next_;
    (void)manager_.start(PushSpec{tid, hash, "tcp://127.0.0.1:14579", spec_, "request"}, 1);
    auto sent = manager_.bind_source(hash, next_, spec_.nbytes());
    for (const auto& p : sent.payloads)
      benchmark::DoNotOptimize(manager_.on_payload_result(p.transfer_id, p.shard, Status::ok()));
  }

  double heap_per_record() const { return heap_per_record_; }
  const PushManager& manager() const { return manager_; }

 private:
  static PushOptions options(std::uint64_t terminal_limit) {
    PushOptions o;
    o.terminal_limit = terminal_limit;
    o.terminal_ttl = Duration::zero();
    o.direct_max_bytes = 1ULL << 30;
    return o;
  }

  std::shared_ptr<ManualClock> clock_;
  PushManager manager_;
  TensorSpec spec_;
  std::uint64_t next_ = 0;
  double heap_per_record_ = 0;
};

void BM_PushLife(benchmark::State& state) {
  PushLoop loop(static_cast<std::uint64_t>(state.range(0)));
  for (auto _ : state) loop.step();
  state.counters["records"] = static_cast<double>(loop.manager().counters().terminal_records);
  state.counters["heap_bytes_per_record"] = loop.heap_per_record();
}

BENCHMARK(BM_PushLife)->Arg(64)->Arg(4096)->Arg(65'536);

}  // namespace
}  // namespace ecx::producer::bench

int main(int argc, char** argv) {
  ecx::log::set_level(spdlog::level::off);  // the table's warnings would be measured, not the table
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
