// Control-plane round trips on loopback: one client, reserve_batch of one item
// against a real server with a trivial handler. Reports p50 / p99 latency and
// requests per second, and the same figures for a bare ZeroMQ DEALER/ROUTER echo of
// a frame of the same size measured in the same run (the baseline; `*_vs_raw` are
// the ratios). Targets: p50 <= 50 us, >= 20,000 requests/s. The loops are those of
// `ecx bench control` (tools/sim/control_loops.h).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

#include <benchmark/benchmark.h>

#include "ecx/wire/codec.h"
#include "sim/control_loops.h"
#include "sim/engine_sim.h"

namespace {

using Clock = std::chrono::steady_clock;

// Same-run baseline figures, filled by the raw benchmarks (registered first).
std::atomic<double> g_raw_p50_us{0};
std::atomic<double> g_raw_rate{0};

double us_since(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

void set_latency_counters(benchmark::State& state, const std::vector<double>& samples_us) {
  state.counters["p50_us"] = ecx::sim::percentile(samples_us, 50);
  state.counters["p99_us"] = ecx::sim::percentile(samples_us, 99);
  state.counters["req_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_RawZmqEcho(benchmark::State& state) {
  ecx::sim::RawEchoLoop loop;
  std::vector<double> samples;
  samples.reserve(200'000);
  for (auto _ : state) {
    const auto start = Clock::now();
    loop.round_trip();
    samples.push_back(us_since(start));
  }
  set_latency_counters(state, samples);
  g_raw_p50_us.store(ecx::sim::percentile(samples, 50));
  state.counters["frame_bytes"] = static_cast<double>(loop.frame_bytes());
}
BENCHMARK(BM_RawZmqEcho)->UseRealTime()->MinTime(2.0);

void BM_RawZmqEchoPipelined(benchmark::State& state) {
  const int window = static_cast<int>(state.range(0));
  ecx::sim::RawEchoLoop loop;
  const auto start = Clock::now();
  for (auto _ : state) loop.pipelined(window);
  const double total = static_cast<double>(state.iterations()) * window;
  g_raw_rate.store(total / (us_since(start) / 1e6));
  state.counters["req_per_s"] = benchmark::Counter(total, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_RawZmqEchoPipelined)->Arg(64)->UseRealTime()->MinTime(2.0);

void BM_ReserveBatchRoundTrip(benchmark::State& state) {
  auto loop = ecx::sim::ReserveLoop::start();
  if (!loop) {
    state.SkipWithError(loop.status().to_string().c_str());
    return;
  }
  std::vector<double> samples;
  samples.reserve(200'000);
  std::size_t failures = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    failures += (*loop)->round_trip() ? 0 : 1;
    samples.push_back(us_since(start));
  }
  set_latency_counters(state, samples);
  state.counters["failures"] = static_cast<double>(failures);
  if (g_raw_p50_us.load() > 0) state.counters["p50_vs_raw"] = ecx::sim::percentile(samples, 50) / g_raw_p50_us.load();
}
BENCHMARK(BM_ReserveBatchRoundTrip)->UseRealTime()->MinTime(2.0);

void BM_ReserveBatchPipelined(benchmark::State& state) {
  const int window = static_cast<int>(state.range(0));
  auto loop = ecx::sim::ReserveLoop::start();
  if (!loop) {
    state.SkipWithError(loop.status().to_string().c_str());
    return;
  }
  std::size_t failures = 0;
  const auto start = Clock::now();
  for (auto _ : state) failures += (*loop)->pipelined(window);
  const double total = static_cast<double>(state.iterations()) * window;
  const double rate = total / (us_since(start) / 1e6);
  state.counters["req_per_s"] = benchmark::Counter(total, benchmark::Counter::kIsRate);
  state.counters["failures"] = static_cast<double>(failures);
  if (g_raw_rate.load() > 0) state.counters["rate_vs_raw"] = rate / g_raw_rate.load();
}
BENCHMARK(BM_ReserveBatchPipelined)->Arg(64)->UseRealTime()->MinTime(2.0);

// Encoding and decoding alone, to see where the time goes.
void BM_CodecReserveOneItem(benchmark::State& state) {
  const std::string frame = ecx::sim::reserve_request_frame();
  std::string encoded;
  for (auto _ : state) {
    auto decoded = ecx::wire::decode_request(frame, ecx::wire::Limits{});
    if (decoded) ecx::wire::encode_request(decoded->request, nullptr, encoded);
    benchmark::DoNotOptimize(encoded);
  }
}
BENCHMARK(BM_CodecReserveOneItem);

}  // namespace

BENCHMARK_MAIN();
