#include "ecx/core/stages.h"

#include <time.h>

namespace ecx::stages {
namespace {

constexpr std::array<std::string_view, kStageCount> kNames = {
    "reserve", "source_wait", "staging_copy", "wire", "landing", "event_delivery", "load_dispatch", "load_copy"};

// Looked up once: the registry's references stay valid for its lifetime, and the
// global registry lives as long as the process.
const std::array<metrics::Histogram*, kStageCount>& histograms() {
  static const std::array<metrics::Histogram*, kStageCount> all = [] {
    std::array<metrics::Histogram*, kStageCount> out{};
    for (std::size_t i = 0; i < kStageCount; ++i) {
      out[i] = &metrics::Registry::global().histogram(
          "transfer_stage_seconds", "Time a transfer spends in each stage of its path (see docs/operations.md)",
          {{"stage", std::string(kNames[i])}}, stage_buckets_seconds());
    }
    return out;
  }();
  return all;
}

}  // namespace

std::string_view stage_name(Stage stage) noexcept { return kNames[static_cast<std::size_t>(stage)]; }

std::vector<double> stage_buckets_seconds() {
  // Literals, not products: the bounds are Prometheus `le` labels and must print exactly.
  // Four per decade: with 1, 2.5 and 5 a lone 9 MiB item's wire (2.5-3.5 ms) fell in one
  // 2.5-5 ms bucket, and the p50 read from it was off by up to a millisecond.
  return {1e-6, 2e-6, 3e-6, 5e-6, 1e-5, 2e-5, 3e-5, 5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3,
          1e-2, 2e-2, 3e-2, 5e-2, 0.1,  0.2,  0.3,  0.5,  1.0,  2.0,  3.0,  5.0,  10.0, 30.0, 60.0};
}

void record(Stage stage, Duration elapsed) noexcept {
  if (elapsed < Duration::zero()) return;
  histograms()[static_cast<std::size_t>(stage)]->observe(std::chrono::duration<double>(elapsed).count());
}

std::uint64_t monotonic_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ULL + static_cast<std::uint64_t>(ts.tv_nsec);
}

std::array<metrics::Histogram::Snapshot, kStageCount> snapshot() {
  std::array<metrics::Histogram::Snapshot, kStageCount> out;
  for (std::size_t i = 0; i < kStageCount; ++i) out[i] = histograms()[i]->snapshot();
  return out;
}

}  // namespace ecx::stages
