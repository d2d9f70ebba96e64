#pragma once
// The producer worker's data path, assembled: the push state machine (PushManager),
// the control client that reserves on every shard of a consumer, the staging pool
// (one slab, registered once) that holds each encoder output while it is sent, and
// the data-plane transport. A dispatcher thread owns all I/O decisions, so a push
// whose reservations resolve late goes out without waiting for another engine step,
// and no engine-facing call ever blocks on the network.
//
// Threads: public methods may be called from any thread. bind_source copies on the
// caller's thread (the engine may reuse its tensor as soon as the call returns);
// lend_source registers the engine's memory instead and sends from it in place;
// everything else is queued to the dispatcher.

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/metrics.h"
#include "ecx/core/status.h"
#include "ecx/producer/push_manager.h"

namespace ecx::producer {

// Where the engine's encoder output lives.
enum class SourceMemory : unsigned char { host, cuda };

struct EngineCounters {
  PushCounters pushes;
  std::uint64_t submitted = 0;
  std::uint64_t sources_bound = 0;
  std::uint64_t sources_unused = 0;     // bound, but no push wanted that content
  std::uint64_t sources_lent = 0;       // of those bound, sent from the engine's memory (lend_source)
  std::uint64_t staging_failures = 0;   // the staging pool was full or the copy failed
  std::uint64_t topology_failures = 0;  // pushes failed because the consumer could not be discovered
  std::uint64_t bytes_staged = 0;
  std::uint64_t staging_used_bytes = 0;  // gauge
  std::uint64_t staging_capacity = 0;    // gauge
  std::uint64_t inbox_dropped = 0;       // commands refused because the dispatcher's queue was full
  // gauge: submitted, not started yet (queued for the dispatcher, or waiting for the
  // consumer's topology); with pushes.active, what wait_active_below bounds
  std::uint64_t unstarted = 0;
};

class PushEngine {
 public:
  static Result<std::unique_ptr<PushEngine>> start(const Config& config,
                                                   std::shared_ptr<const Clock> clock = SteadyClock::shared());
  // shutdown(shutdown_drain_timeout_s).
  ~PushEngine();
  PushEngine(const PushEngine&) = delete;
  PushEngine& operator=(const PushEngine&) = delete;

  // Plans a push; the same transfer id twice (another request sharing the encoding)
  // is one push. Never blocks. By value: the spec travels on to the dispatcher.
  void submit(PushSpec spec);
  // The encoder output of mm_hash: copied once into the staging pool (with its
  // xxHash64 when checksums are on), then sent to every shard of every push waiting
  // for that content. An error (staging pool full, CUDA copy failed) fails the pushes
  // of that content; they appear in drain_failures().
  Status bind_source(std::string_view mm_hash, const void* data, std::uint64_t nbytes,
                     SourceMemory memory = SourceMemory::host);
  // Zero-copy binding of a host output: ECX registers the engine's memory and sends
  // from it in place; the engine keeps the bytes alive and unchanged until `release`
  // runs (on ECX's dispatcher thread, or in shutdown), once no push needs them. Where
  // the memory cannot be registered, a copy is staged and `release` runs at once.
  Status lend_source(std::string_view mm_hash, const void* data, std::uint64_t nbytes, std::function<void()> release);
  // The engine finished these requests: their pushes that never got a source are
  // cancelled on the consumer (abandon), the others continue.
  void requests_finished(std::span<const std::string> request_ids);

  // Failed pushes since the last call (each names its requests).
  std::vector<FailedSave> drain_failures();
  // Any push not finished, I/O still in flight, or a lent output not given back yet.
  bool pending() const;
  // Waits (real time, at most `timeout`) until nothing is pending. True when idle.
  bool wait_idle(Duration timeout) const;
  // Waits (real time, at most `timeout`) until fewer than `limit` pushes are in
  // flight: submitted and not finished (EngineCounters::pushes.active plus
  // EngineCounters::unstarted, those still queued for the dispatcher or waiting for
  // their consumer's discovery): for an encoder that admits new work only below a
  // bound, instead of polling the counters. True when they are.
  bool wait_active_below(std::uint64_t limit, Duration timeout) const;
  EngineCounters counters() const;
  std::uint64_t export_metrics(metrics::Registry& registry) const;

  // Refuses new pushes, waits up to `timeout` for the pushes in flight, abandons the
  // rest, stops the dispatcher, the client and the transport. Idempotent.
  void shutdown(Duration timeout);

  struct State;

 private:
  explicit PushEngine(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace ecx::producer
