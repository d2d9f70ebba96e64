#pragma once
// SchedulerCoordinator: the EC connector's scheduler-side logic, for the producer
// role (plans one push per transfer) and the consumer role (tracks inbound
// transfers, gates requests until their items landed, dispatches loads, cancels
// reservations nobody will use). The engine calls it from its single scheduler
// thread, in vLLM's hook order; it never blocks on the network: readiness events
// come from a non-blocking EventSource, and remote cancels run on an owned,
// bounded executor whose outcome is polled on a later step.
//
// It composes two halves, each with its own state: the producer's PushPlanner and
// the consumer's ConsumerGate (which owns the transfer table), and the requests both
// fail through RequestFailures (src/scheduler/).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/connector/scheduler/collaborators.h"
#include "ecx/connector/scheduler/transfer_table.h"
#include "ecx/connector/scheduler/types.h"
#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/dtype.h"
#include "ecx/core/metrics.h"

namespace ecx::scheduler {

class ConsumerGate;
class PushPlanner;
class RequestFailures;
class StoreGate;

struct CoordinatorOptions {
  bool is_producer = false;
  bool is_consumer = true;
  // Consumer: the control address of this instance's first TP shard; remote
  // cancels discover the other shards from it.
  std::string control_address;
  Duration push_wait_timeout = std::chrono::seconds(60);  // waiting_event and loading deadline
  TableLimits table;                                      // reservation TTL, tombstones, resident capacity
  bool cross_encoder_cache = false;
  // Cross-encoder cache: how long a request waits for its items' prefetch from the store
  // before they are encoded instead.
  Duration store_prefetch_timeout = std::chrono::seconds(2);
  // Producer: shape [num_encoder_embeds, encoder_output_width] in encoder_dtype
  // for items whose output spec the caller did not give.
  std::int64_t encoder_output_width = 0;
  DType encoder_dtype = DType::bfloat16;
  std::uint64_t max_tensor_bytes = 1'000'000'000;
  std::size_t control_threads = 4;
  std::size_t control_queue_max = 4'096;
  std::size_t max_pending_shard_events = 4'096;  // transfers some but not all shards reported
  std::size_t max_events_per_drain = 4'096;
  std::size_t max_notified_remembered = 65'536;  // requests remembered as already failed
  Duration drain_min_interval = std::chrono::milliseconds(5);
  int cancel_attempts = 2;  // topology confirmations, and cancel rounds
  // A transfer still waiting for its readiness event this long is asked about on
  // every shard (off the scheduler thread): a shard that holds it ready counts as its
  // event. Recovers readiness events lost on the way (a full event backlog drops the
  // oldest; nothing resends it), which would otherwise fail the request at
  // push_wait_timeout. Asked again every interval while it waits; at most
  // max_rechecks_in_flight at once.
  Duration readiness_recheck = std::chrono::seconds(5);
  std::size_t max_rechecks_in_flight = 32;
  // Asynchronous loads: the load gate (ensure_cache_available) starts a load as soon
  // as an item landed and defers the request until the workers report it in their
  // encoder caches. That needs an engine whose workers run the connector on steps
  // with no scheduled tokens and report back every step. Synchronous loads: an item
  // passes the gate once it landed in the consumer pool; its load is dispatched in
  // the step that allocates it (update_state_after_alloc) and completes in that
  // step's start_load_caches. The connector starts synchronous and switches once
  // the engine shows it can do asynchronous loads (set_asynchronous_loads).
  bool asynchronous_loads = true;
  // Whether the engine polls take_unavailable_requests and fails what it returns.
  // When it does not, an item whose push can no longer arrive is released to the
  // engine to encode locally (when the request carries its media) instead of
  // holding the request for good.
  bool unavailable_reaches_engine = true;
  // The engine re-checks every waiting request every step. A request the load gate
  // found waiting is remembered, and re-checked with one lookup while nothing it
  // waits on changed. Off: every re-check decides afresh (the tests compare both).
  bool remember_waiting = true;

  // From the ECX configuration; `model_dtype` and `model_hidden_width` come from
  // the engine's model config (encoder_output_width, when set, wins).
  static CoordinatorOptions from_config(const Config& config, DType model_dtype, std::int64_t model_hidden_width);
};

struct CoordinatorStats {
  std::uint64_t drains = 0;
  std::uint64_t events_received = 0;
  std::uint64_t events_malformed = 0;
  std::uint64_t ready_accepted = 0;
  std::uint64_t ready_ignored = 0;    // terminal, redundant or refused by the table
  std::uint64_t awaiting_shards = 0;  // a shard's readiness recorded, others still missing
  std::uint64_t partial_dropped = 0;  // partial readiness dropped by the bound
  std::uint64_t abandoned_events = 0;
  std::uint64_t failed_events = 0;
  std::uint64_t pushes_planned = 0;
  std::uint64_t push_conflicts = 0;  // a transfer id already planned for other content
  std::uint64_t unresolved_transfer_ids = 0;
  std::uint64_t malformed_requests = 0;
  std::uint64_t cancels_queued = 0;
  std::uint64_t cancels_succeeded = 0;
  std::uint64_t cancels_failed = 0;
  std::uint64_t cancels_dropped = 0;     // executor full or closed
  std::uint64_t cancels_local_only = 0;  // names no consumer knows, taken already, or no control client
  std::uint64_t cancels_abandoned = 0;   // still in flight at close; their leases expire them
  std::uint64_t readiness_rechecks = 0;  // waiting transfers asked about on every shard
  std::uint64_t rechecks_failed = 0;     // a shard or the topology could not be asked
  // A shard's readiness learnt by asking before its event was drained: the event was
  // lost (a full backlog drops the oldest) or still queued behind others.
  std::uint64_t readiness_recovered = 0;
  std::uint64_t alloc_loads = 0;        // loads dispatched by update_state_after_alloc
  std::uint64_t alloc_load_misses = 0;  // allocated as external, but nothing left to load
  // Re-checks of a waiting request answered from the load gate's memo (nothing it
  // waits on had changed).
  std::uint64_t rechecks_remembered = 0;
  // Items whose push can no longer arrive, on an engine that never fails requests
  // through take_unavailable_requests: released to be encoded locally, or (no media)
  // held and reported.
  std::uint64_t local_fallbacks = 0;
  std::uint64_t stranded_items = 0;
  // Producer, cross-encoder cache.
  std::uint64_t store_lookups = 0;            // has_cache_item questions a producer put to the store side
  std::uint64_t store_hits = 0;               // has_cache_item answered from the shared store
  std::uint64_t store_prefetches = 0;         // prefetches asked of the workers (asynchronous loads)
  std::uint64_t store_prefetch_failures = 0;  // the store could not give them: encoded instead
  std::uint64_t store_prefetch_timeouts = 0;  // not prefetched in time: encoded instead
  std::uint64_t store_loads = 0;              // items loaded from it instead of encoded
  std::uint64_t store_load_failures = 0;      // of those, reported failed by a worker
  // The event subscription's own counts (see SubscriptionCounters).
  std::uint64_t subscription_malformed = 0;
  std::uint64_t subscription_unknown_kind = 0;
  std::uint64_t subscription_auth_failures = 0;
  std::uint64_t discoveries_started = 0;
  std::uint64_t discoveries_failed = 0;
};

class SchedulerCoordinator {
 public:
  // `events` and `control` may be null (a pure producer needs neither; without a
  // control client remote cancels are skipped and counted).
  SchedulerCoordinator(CoordinatorOptions options, std::shared_ptr<const Clock> clock,
                       std::shared_ptr<EventSource> events, std::shared_ptr<ConsumerControl> control);
  ~SchedulerCoordinator();
  SchedulerCoordinator(const SchedulerCoordinator&) = delete;
  SchedulerCoordinator& operator=(const SchedulerCoordinator&) = delete;

  // --- vLLM scheduler hooks, in the order the engine calls them
  // Consumer: whether `identifier` can be had without encoding it here (ready,
  // resident or available). Always false for a pure producer.
  bool has_cache_item(std::string_view identifier);
  // False defers the request to a later step. Consumer: true only when every item
  // not yet computed is in the engine's cache or loaded; starts loads; a request
  // whose push cannot arrive is failed through take_unavailable_requests().
  // Producer: plans pushes, never defers (unless its ec_transfer_params are malformed).
  bool ensure_cache_available(const RequestView& request, std::int64_t num_computed_tokens);
  void update_state_after_alloc(const RequestView& request, std::size_t index);
  // Consumer: the item was consumed; release a transfer it no longer needs.
  void update_state_after_free(const RequestView& request, std::size_t index);
  ConnectorMeta build_connector_meta(const StepView& step);
  void update_connector_output(const WorkerOutput& output);
  FinishedResult request_finished(const RequestView& request);
  // Requests whose encoder inputs cannot be had; each request is returned once.
  std::vector<std::string> take_unavailable_requests();
  // True only while a step would do connector work: producer pushes still in
  // flight (as the workers last reported), or asynchronous loads not reported yet.
  bool has_pending_push_work() const noexcept;
  // See CoordinatorOptions::asynchronous_loads / unavailable_reaches_engine.
  void set_asynchronous_loads(bool on) noexcept { options_.asynchronous_loads = on; }
  void set_unavailable_reaches_engine(bool on) noexcept { options_.unavailable_reaches_engine = on; }
  // Producer, cross-encoder cache: has_cache_item also answers for items in the
  // shared store (loaded by the workers, see ConnectorMeta::store_loads).
  void set_store_presence(std::shared_ptr<StorePresence> store);
  // Consumer: blocks up to `max_wait` until a transfer event has arrived (the next
  // step would take it) or one of `also` polls readable (the engine's own request
  // socket, say); true when either may. For engine loops that would otherwise sleep
  // between steps while requests wait for their transfers; never call it inside a step.
  // A scheduler with no event subscription (not a consumer, or closed) returns false
  // at once, without waiting on `also` either.
  bool wait_for_events(Duration max_wait, std::span<const WakeSource> also = {}) const;
  // Drops queued cancels, closes the control collaborator (calls in flight end at
  // once as cancelled), joins the executor, then closes the event source. Bounded by
  // the executor's threads noticing the closed client, not by control deadlines.
  // Logs what it abandoned. Idempotent.
  void close();

  // --- observation
  const TransferTable& table() const noexcept;
  // A snapshot of the halves' counters.
  CoordinatorStats stats() const noexcept;
  // The counters as Prometheus metrics (ecx_scheduler_*), as of the last engine step
  // (build_connector_meta) or close(): the collector runs on the metrics server's
  // thread, the counters change on the engine's. The collector stays valid after the
  // coordinator is gone (it keeps the last snapshot). Returns its id for
  // Registry::remove_collector.
  std::uint64_t export_metrics(metrics::Registry& registry);
  std::size_t pending_remote_cancels() const noexcept;
  const CoordinatorOptions& options() const noexcept { return options_; }
  // How much per-request and per-copy state the coordinator holds. Once every
  // request finished, every load was reported, the engine freed its entries and the
  // reservation TTL passed (substitutes last that long), all of it is zero.
  struct Bookkeeping {
    std::size_t requests_counting_on_copies = 0;
    std::size_t counted_on_copies = 0;
    std::size_t unowned_loads = 0;
    std::size_t substitutes = 0;
    std::size_t engine_cache_entries = 0;
    std::size_t malformed_pending = 0;
    std::size_t push_bindings = 0;
    std::size_t remembered_waits = 0;  // requests the load gate remembers as waiting
  };
  Bookkeeping bookkeeping() const noexcept;

 private:
  // Declared first: the halves keep a reference to it.
  CoordinatorOptions options_;
  std::unique_ptr<RequestFailures> failures_;
  std::unique_ptr<ConsumerGate> gate_;
  std::unique_ptr<PushPlanner> planner_;
  std::unique_ptr<StoreGate> store_;
  struct PublishedStats;
  std::shared_ptr<PublishedStats> published_;  // what export_metrics' collector reads
  void publish_stats();
};

}  // namespace ecx::scheduler
