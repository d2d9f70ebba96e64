// Scheduler hot paths at 100, 10,000 and 100,000 live records. Per-call cost must
// stay flat in table size: compare each figure with the 100-record one of the
// same run. The workloads (scheduler_fixtures.h) use realistic key lengths and
// touch 1,024 distinct keys at every size, so the larger tables pay their real
// cache misses; the same workloads run under callgrind in scheduler_opcount
// (callgrind_opcount.sh).

#include <benchmark/benchmark.h>

#include "core/logging.h"
#include "sim/scheduler_fixtures.h"

namespace ecx::scheduler::bench {
namespace {

void BM_HasCacheItem(benchmark::State& state) {
  HasCacheItemLoop loop(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(loop.step());
  state.counters["live"] = static_cast<double>(loop.fixture.coordinator->table().live_count());
}

// A deferred request re-checked every step: each item waits for its push.
void BM_EnsureCacheAvailable(benchmark::State& state) {
  EnsureLoop loop(state.range(0), state.range(1));
  for (auto _ : state) benchmark::DoNotOptimize(loop.step());
  state.counters["live"] = static_cast<double>(loop.fixture.coordinator->table().live_count());
}

// One readiness for a new transfer among `live` others; the transfer is then
// cancelled so the table keeps its size (the figure is for the pair).
void BM_ObserveReady(benchmark::State& state) {
  ObserveReadyLoop loop(state.range(0));
  for (auto _ : state) loop.step();
  state.counters["live"] = static_cast<double>(loop.table->live_count());
}

void BM_ExpireNothingDue(benchmark::State& state) {
  ExpireLoop loop(state.range(0));
  for (auto _ : state) loop.nothing_due();
  state.counters["live"] = static_cast<double>(loop.table->live_count());
}

void BM_ExpireOneDue(benchmark::State& state) {
  ExpireLoop loop(state.range(0));
  for (auto _ : state) loop.one_due();
  state.counters["live"] = static_cast<double>(loop.table->live_count());
}

// A request's ec_transfer_params as a proxy forwards them to the prefill instance:
// `items` entries, and the encoder's handle under each item's hash (its indices, its
// transfer id, some metadata). RequestView reads them once per request.
std::string forwarded_params(std::int64_t items) {
  nlohmann::json params = nlohmann::json::object();
  nlohmann::json list = nlohmann::json::array();
  for (std::int64_t i = 0; i < items; ++i) {
    const std::string hash = fresh_mm_hash(static_cast<std::uint64_t>(i));
    const std::string transfer_id = fresh_transfer_id(static_cast<std::uint64_t>(i));
    list.push_back({{"mm_hash", hash}, {"transfer_id", transfer_id}});
    params[hash] = {{"item_indices", {i}},
                    {"transfer_id", transfer_id},
                    {"metadata", {{"image_grid_thw", {1, 36, 52}}, {"modality", "image"}, {"num_embeds", 1872}}}};
  }
  params["ec_items"] = std::move(list);
  params["consumer_zmq"] = "tcp://10.0.0.2:14579";
  return params.dump();
}

// Read from the text (what RequestView does).
void BM_ParamsFromText(benchmark::State& state) {
  const std::string text = forwarded_params(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(parse_ec_transfer_params_text(text));
}

// The baseline: the whole document parsed into a JSON value first, then read.
void BM_ParamsViaJsonValue(benchmark::State& state) {
  const std::string text = forwarded_params(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(parse_ec_transfer_params(nlohmann::json::parse(text)));
}

BENCHMARK(BM_HasCacheItem)->Arg(100)->Arg(10'000)->Arg(100'000);
BENCHMARK(BM_ParamsFromText)->Arg(1)->Arg(8);
BENCHMARK(BM_ParamsViaJsonValue)->Arg(1)->Arg(8);
BENCHMARK(BM_EnsureCacheAvailable)
    ->Args({100, 1})
    ->Args({10'000, 1})
    ->Args({100'000, 1})
    ->Args({100, 8})
    ->Args({10'000, 8})
    ->Args({100'000, 8});
BENCHMARK(BM_ObserveReady)->Arg(100)->Arg(10'000)->Arg(100'000);
BENCHMARK(BM_ExpireNothingDue)->Arg(100)->Arg(10'000)->Arg(100'000);
BENCHMARK(BM_ExpireOneDue)->Arg(100)->Arg(10'000)->Arg(100'000);

}  // namespace
}  // namespace ecx::scheduler::bench

int main(int argc, char** argv) {
  // The expire benchmark fails a waiting record per iteration; its warning would
  // measure the terminal, not the table.
  ecx::log::set_level(spdlog::level::off);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
