#pragma once
// Engine simulators that drive ECX exactly as vLLM's engine steps a connector, for
// the demo, the end-to-end bench and the multi-process tests. They stand in for vLLM
// (which is not here), not for any part of ECX: every control message, event and
// payload goes through the real scheduler and worker coordinators, ZeroMQ and UCX.
//
// ProducerSim (an encoder instance): per request, plans pushes through the
// SchedulerCoordinator, "encodes" each image (deterministic content), binds it with
// the WorkerCoordinator, finishes the request and forwards its ec_transfer_params to
// the consumer over an admit channel, as a proxy would; with skip_encoder_hop, a
// request whose images are all in the shared store goes to the consumer unencoded.
// ConsumerSim (a PD instance, TP = N in one process, one engine thread per rank):
// admits forwarded requests, gates them with ensure_cache_available, loads landed
// payloads into per-rank encoder caches (warm memory, reused), records when each
// request's last item was loaded, verifies every byte after that stamp, and answers
// each resolved request to its producer over the admit channel. Items sent to come
// from the store are loaded from it (cross_encoder_cache), or encoded here.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/connector/worker/worker_coordinator.h"
#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/status.h"
#include "sim/workload.h"

namespace ecx::sim {

// The simulated engines' threads: the one that runs a simulator (ConsumerSim::run,
// run_producer) takes this name, its other TP ranks' threads this name and "-r<rank>".
// The CPU table of `ecx bench e2e` finds them by it, whatever the executable is called.
inline constexpr std::string_view kEngineThreadName = "ecx-engine";
inline bool is_engine_thread(std::string_view name) {
  return name == kEngineThreadName ||
         (name.starts_with(kEngineThreadName) && name.substr(kEngineThreadName.size()).starts_with("-r"));
}

struct Progress {
  std::uint64_t requests_total = 0;  // expected (0 = unknown yet)
  std::uint64_t requests_admitted = 0;
  std::uint64_t requests_ready = 0;
  std::uint64_t requests_failed = 0;
  std::uint64_t bytes_moved = 0;  // payload bytes verified in the consumer's caches (rank 0)
  std::uint64_t in_flight = 0;    // admitted, not yet resolved
  std::uint64_t pool_used_bytes = 0;
  std::uint64_t pool_capacity = 0;
  std::uint64_t resident_bytes = 0;       // of pool_used_bytes: landed copies kept for reuse
  std::uint64_t records_writing = 0;      // reservations not landed yet, all shards
  std::uint64_t records_ready = 0;        // landed, waiting for the engine to load them, all shards
  std::uint64_t tombstones = 0;           // terminal records the reservation managers keep
  std::uint64_t tombstone_bound = 0;      // their cap (tombstone_max per shard), all shards
  std::uint64_t encoder_cache_bytes = 0;  // the simulated engine's encoder caches, all ranks (pages mapped)
  double elapsed_s = 0;
};

struct ConsumerResult {
  Progress progress;
  std::uint64_t items_ready = 0;
  std::uint64_t content_mismatches = 0;   // bytes that differ from what the producer encoded
  std::uint64_t checksum_mismatches = 0;  // payloads the consumer refused on their xxHash64
  std::uint64_t leaked_pool_bytes = 0;    // held by neither a live transfer nor the resident cache
  std::uint64_t live_reservations = 0;
  std::uint64_t loads_as_views = 0;  // zero_copy_loads: landed slots the engine kept instead of a copy
  // Reserves the shards held until space freed (reserve_hold_ms): placed, or answered
  // retry when the hold ended.
  std::uint64_t reserves_held = 0;
  std::uint64_t held_reserves_placed = 0;
  std::uint64_t held_reserves_expired = 0;
  // Releases and cancels the scheduler ran on its shards in this process, without the
  // network (ControlHandler::cancel_runs_anywhere).
  std::uint64_t in_process_cancels = 0;
  // Cancels the shards found no record for, each kept as a tombstone for the TTL (a
  // cancel that overtook its reserve, or one sent for a transfer already taken).
  std::uint64_t cancels_of_unknown = 0;
  std::uint64_t resident_bytes = 0;
  // Readiness events the shards dropped (a full backlog), and shard readiness the
  // scheduler learnt by asking instead (readiness_recheck_s).
  std::uint64_t events_dropped = 0;
  std::uint64_t readiness_recovered = 0;
  std::vector<double> time_to_ready_ms;  // one per ready request
  std::vector<double> ready_at_s;        // when each of those became ready, seconds into run()
  // One per ready request whose producer stamped when it handed the request's last
  // output to ECX (its clock's time, so comparable only on one host): that stamp ->
  // ready, the whole path from the encoder. -1 where the request carried no stamp.
  std::vector<double> encoded_to_ready_ms;
  std::vector<std::string> failed_requests;
  std::string invariant_error;  // empty when every shard's bookkeeping is consistent
  // Items sent to come from the shared store (the encoder hop skipped): loaded from it,
  // or encoded here when it could not give them.
  std::uint64_t store_loads = 0;
  std::uint64_t local_encodes = 0;
  std::uint64_t store_prefetch_failures = 0;  // includes the timeouts below
  std::uint64_t store_prefetch_timeouts = 0;  // prefetches the workers never answered in time
  // CPU time of the simulator's own work on the engine threads (encoder-cache allocation, content
  // checks, the admit channel's messages), all ranks: what the bench costs itself, next to what
  // it measures.
  std::uint64_t sim_engine_ns = 0;
  // CPU time of this process's threads during run(), by thread name (sim/thread_cpu.h):
  // the engine threads (kEngineThreadName, its ranks' "-r<rank>"), ECX's own, and the
  // admit channel's I/O thread.
  std::map<std::string, std::uint64_t> thread_cpu_ns;
  std::map<std::string, std::uint64_t> thread_sleeps;  // the same threads' sleeps (ThreadCpu::sleeps_since)
  // Items ready within that CPU window (it opens at ConsumerSimOptions::
  // warm_up_requests): the divisor of its per-item figures. sim_engine_ns counts the
  // same window.
  std::uint64_t window_items = 0;
  bool producer_done = false;
  double wall_s = 0;
};

// How the simulated engine checks what it loaded (after the ready stamp, on the
// engine's threads). full: every byte of every item. sampled: every block's stamp of
// every item (a foreign, stale, misplaced or truncated payload) and every byte of one
// item in 16 per rank; for benches, whose engine threads share the CPUs with ECX.
enum class ContentCheck : unsigned char { full, sampled };

struct ConsumerSimOptions {
  Config config;  // consumer role; layout.tp_size = ranks run here
  ContentCheck content_check = ContentCheck::full;
  std::string admit_bind = "tcp://127.0.0.1:0";
  int producers = 1;  // encoders feeding this consumer: done once each said so
  // The CPU window (thread_cpu_ns, sim_engine_ns) opens once this many requests are
  // ready, so that a bench's per-item CPU leaves its warm-up out, as the raw data
  // plane's does; 0: at the first request.
  std::uint64_t warm_up_requests = 0;
  // Called once on the engine thread when that window opens after a warm-up (a bench
  // starts its other figures there too).
  std::function<void()> on_warmed_up;
  Duration deadline = std::chrono::minutes(10);  // the whole run
  // Once the producer said it is done: how long to wait for the last requests
  // (their pushes may have failed; the scheduler fails them by push_wait_timeout).
  Duration progress_interval = std::chrono::milliseconds(500);
  std::function<void(const Progress&)> on_progress;
  // Called after every engine step (tests: advance a manual clock, inject faults).
  std::function<void(const Progress&)> on_step;
  std::shared_ptr<const Clock> clock = SteadyClock::shared();
};

class ConsumerSim {
 public:
  static Result<std::unique_ptr<ConsumerSim>> start(ConsumerSimOptions options);
  ~ConsumerSim();
  // Where the producer sends its admit messages.
  std::string admit_endpoint() const;
  // The consumer's base control address (what producers put in consumer_zmq).
  std::string control_address() const;
  // Steps the engine until the producer is done and every admitted request resolved,
  // or the deadline. `stop` ends it early.
  ConsumerResult run(const std::atomic<bool>* stop = nullptr);

  struct State;

 private:
  explicit ConsumerSim(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

struct ProducerResult {
  std::uint64_t requests = 0;
  std::uint64_t items = 0;
  std::uint64_t bytes = 0;
  std::uint64_t failed_saves = 0;
  std::uint64_t retry_afters = 0;
  std::uint64_t yields = 0;              // reserved slots given back while a sibling shard of the push waited for space
  std::uint64_t pushes_done = 0;         // pushes that reached every shard
  std::uint64_t direct_sent = 0;         // payloads sent without a reservation first
  std::uint64_t direct_turned_away = 0;  // of those, turned away by the shard (then reserved)
  std::uint64_t rounds = 0;
  // The most pushes submitted and not yet ended (done, failed or cancelled), seen at the
  // start of any step: what max_active_pushes bounds. Counted from the engine's
  // counters, not from what the window reads, so that a window that leaks shows here.
  // A submit merged into a push already under way (a repeated transfer id) never ends
  // on its own, so with repeats this over-counts; the bench's workload has none.
  std::uint64_t max_in_flight = 0;
  std::uint64_t sim_ns = 0;        // CPU time of the simulator's own work: the outputs' content, admit messages
  std::uint64_t encoder_runs = 0;  // images this encoder actually encoded
  // zero_copy_saves: outputs sent from the encoder's own memory, and of those, any ECX
  // had not given back by the end (a leak).
  std::uint64_t outputs_lent = 0;
  std::uint64_t outputs_not_given_back = 0;
  // Requests sent straight to the consumer, every image in the store (skip_encoder_hop).
  std::uint64_t encoder_hops_skipped = 0;
  // Cross-encoder cache.
  std::uint64_t store_lookups = 0;            // has_cache_item asked the store's presence index
  std::uint64_t store_hits = 0;               // answered present: loaded from the store, not encoded
  std::uint64_t store_prefetch_timeouts = 0;  // prefetches the worker never answered in time (encoded)
  worker::StoreWorkerCounters store;
  // CPU time of this process's threads from the first request (or the end of the
  // warm-up, ProducerSimOptions::warm_up_requests) to the end, by thread name (as
  // ConsumerResult's), and their sleeps; sim_ns counts the same window.
  std::map<std::string, std::uint64_t> thread_cpu_ns;
  std::map<std::string, std::uint64_t> thread_sleeps;
  std::uint64_t window_items = 0;  // items handed over within that window: the per-item divisor
  double wall_s = 0;
};

struct ProducerSimOptions {
  Config config;                 // producer role
  std::string consumer_address;  // the consumer's base control address
  std::string admit_connect;     // the consumer's admit endpoint
  WorkloadOptions workload;
  // Of the workload, this encoder serves requests index, index + count, ... (a proxy's
  // round robin over `count` encoders).
  int encoder_index = 0;
  int encoder_count = 1;
  // > 0: after the workload, start another round of it (seed + round, fresh ids) until
  // this much time has passed, in the same producer (a soak of one long-lived encoder).
  Duration run_for{0};
  // Decide as `ecx proxy --store-url` does: a request whose images the store's
  // presence index all knows goes straight to the consumer, its ec_items marking them
  // {"mm_hash", "store": true}, and this encoder does not run it (needs
  // cross_encoder_cache; the consumer needs it too). That index starts warm: the
  // workload's images are looked up before the first request.
  bool skip_encoder_hop = false;
  int max_active_pushes = 64;  // pacing: new requests wait while more pushes are in flight
  // > 0: new requests also wait while this many were forwarded to the consumer and not
  // yet answered as resolved there (1: one request at a time, end to end).
  int max_unresolved = 0;
  // The CPU window (thread_cpu_ns, sim_ns) opens once this many requests were handed
  // to the consumer (see ConsumerSimOptions::warm_up_requests).
  std::uint64_t warm_up_requests = 0;
  std::function<void()> on_warmed_up;  // as ConsumerSimOptions'
  // Called once the producer has set up (ECX's engine, the encoder's memory, the admit
  // connection), before its first request; an error ends the run with it. `ecx bench
  // e2e` holds there for its go. The deadline counts from its return.
  std::function<Status()> before_first_request;
  Duration deadline = std::chrono::minutes(10);
  std::shared_ptr<const Clock> clock = SteadyClock::shared();
};

// Runs the whole workload, then waits for every push to finish (or fail).
Result<ProducerResult> run_producer(const ProducerSimOptions& options, const std::atomic<bool>* stop = nullptr);

// Percentile (0..100) of unsorted samples; 0 when empty.
double percentile(std::vector<double> samples, double pct);

}  // namespace ecx::sim
