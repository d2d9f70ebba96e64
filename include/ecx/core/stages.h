#pragma once
// Where a transfer's time goes, always on: one latency histogram per stage,
// `ecx_transfer_stage_seconds{stage="..."}` in the process-wide metrics registry.
// Each process records the stages it runs (an encoder the first four, a consumer
// instance the rest), so a deployment's scrape, or `ecx bench e2e`, shows the whole
// path. Recording is a few relaxed atomic adds: cheap enough for every item.

#include <array>
#include <cstdint>
#include <string_view>

#include "ecx/core/clock.h"
#include "ecx/core/metrics.h"

namespace ecx::stages {

enum class Stage : unsigned char {
  reserve,         // producer: reserve_batch sent -> reply received (per shard)
  source_wait,     // producer: push planned -> the encoder output bound to it
  staging_copy,    // producer: encoder output copied (and hashed) into the staging pool
  wire,            // producer: payload send started -> the data plane reported it delivered
  landing,         // consumer shard: payload landed -> verified (checksum) and READY
  event_delivery,  // consumer: READY event published by the shard -> drained by the scheduler
  load_dispatch,   // consumer scheduler: item loadable (every shard reported) -> load dispatched
  load_copy,       // consumer worker: the copy from the pool into the engine's encoder cache
};
inline constexpr std::size_t kStageCount = 8;

std::string_view stage_name(Stage stage) noexcept;
// 1 us .. 60 s, 1-2.5-5 per decade: the stages span five orders of magnitude.
std::vector<double> stage_buckets_seconds();

// Records one observation; negative durations (clocks of different processes that
// disagree) are dropped.
void record(Stage stage, Duration elapsed) noexcept;

// System-wide monotonic time in ns (CLOCK_MONOTONIC): comparable between processes
// of one host, which is where an instance's scheduler and workers run. Used to time
// a stage that starts in one process and ends in another (event_delivery).
std::uint64_t monotonic_ns() noexcept;

// Every stage's histogram, in Stage order (for benches and tests).
std::array<metrics::Histogram::Snapshot, kStageCount> snapshot();

}  // namespace ecx::stages
