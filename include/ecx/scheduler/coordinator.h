#pragma once
// SchedulerCoordinator: the EC connector's scheduler-side logic, for the producer
// role (plans one push per transfer) and the consumer role (tracks inbound
// transfers, gates requests until their items landed, dispatches loads, cancels
// reservations nobody will use). The engine calls it from its single scheduler
// thread, in vLLM's hook order; it never blocks on the network: readiness events
// come from a non-blocking EventSource, and remote cancels run on an owned,
// bounded executor whose outcome is polled on a later step.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/dtype.h"
#include "ecx/scheduler/collaborators.h"
#include "ecx/scheduler/transfer_table.h"
#include "ecx/scheduler/types.h"

namespace ecx::scheduler {

class BoundedExecutor;

struct CoordinatorOptions {
  bool is_producer = false;
  bool is_consumer = true;
  // Consumer: the control address of this instance's first TP shard; remote
  // cancels discover the other shards from it.
  std::string control_address;
  Duration push_wait_timeout = std::chrono::seconds(60);  // waiting_event and loading deadline
  TableLimits table;                                      // reservation TTL, tombstones, resident capacity
  bool cross_encoder_cache = false;
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
  std::uint64_t cancels_local_only = 0;  // names no consumer knows, or no control client
  std::uint64_t cancels_abandoned = 0;   // still in flight at close; their leases expire them
  std::uint64_t alloc_loads = 0;         // loads dispatched by update_state_after_alloc
  std::uint64_t alloc_load_misses = 0;   // allocated as external, but nothing left to load
  // Items whose push can no longer arrive, on an engine that never fails requests
  // through take_unavailable_requests: released to be encoded locally, or (no media)
  // held and reported.
  std::uint64_t local_fallbacks = 0;
  std::uint64_t stranded_items = 0;
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
  // Drops queued cancels, closes the control collaborator (calls in flight end at
  // once as cancelled), joins the executor, then closes the event source. Bounded by
  // the executor's threads noticing the closed client, not by control deadlines.
  // Logs what it abandoned. Idempotent.
  void close();

  // --- observation
  const TransferTable& table() const noexcept { return table_; }
  const CoordinatorStats& stats() const noexcept { return stats_; }
  std::size_t pending_remote_cancels() const noexcept { return pending_cancels_.size(); }
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
  };
  Bookkeeping bookkeeping() const noexcept {
    return Bookkeeping{copies_counted_on_.size(),     copy_counts_.size(), unowned_loads_.size(),
                       substitute_for_lender_.size(), local_cache_.size(), malformed_pending_.size(),
                       push_bindings_.size()};
  }

 private:
  struct StringHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  using StringSet = std::unordered_set<std::string, StringHash, std::equal_to<>>;
  template <typename V>
  using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;
  // Ids remembered up to a bound, the oldest forgotten first.
  class RecentIds {
   public:
    // False when `id` is remembered already.
    bool insert(const std::string& id, std::size_t bound) {
      if (!ids_.insert(id).second) return false;
      order_.push_back(id);
      while (order_.size() > bound) {
        ids_.erase(order_.front());
        order_.pop_front();
      }
      return true;
    }
    bool contains(std::string_view id) const { return ids_.contains(id); }

   private:
    StringSet ids_;
    std::deque<std::string> order_;
  };

  struct CancelTicket;
  struct PendingShards {
    std::string transfer_id;
    std::vector<int> shards;
    TensorSpec spec;
  };
  struct PushBinding {
    std::string mm_hash;
    std::string consumer_zmq;
    std::size_t requests = 0;
  };

  void drain(TimePoint now);
  void poll_pending_cancels();
  void accept_event(const TransferEvent& event, TimePoint now);
  bool note_shard_ready(const TransferEvent& event, TimePoint now);
  void forget_shard_readiness(std::string_view transfer_id);
  void queue_cancel(std::string_view transfer_id, TimePoint now, std::string_view mm_hash = {},
                    std::string_view request_id = {});
  void note_awaiting_push(std::string_view mm_hash, std::string_view waiting_id, bool invented,
                          std::string_view request_id, TimePoint now);
  void prepare_push(const RequestView& request, std::size_t index);
  void load_at_alloc(const RequestView& request, std::size_t index);
  // Unavailable channel absent: whether item `index`, waiting for `waiting_id`, is
  // let through to be encoded locally because its push cannot arrive any more.
  bool release_unreachable(const RequestView& request, std::size_t index, std::string_view waiting_id);
  // Unavailable channel absent: whether a request with malformed params is let
  // through to be encoded locally (every item carries its media).
  bool release_malformed(const RequestView& request);
  void warn_unresolved(const RequestView& request, std::size_t index, std::string_view where);
  bool report_malformed(const RequestView& request);
  void mark_request_unavailable(std::string_view request_id);
  void note_borrow(const TransferRecord& used, std::string_view own_transfer_id, TimePoint now);
  void count_on_copy(const std::string& request_id, const std::string& mm_hash);
  void stop_counting_on_copy(const std::string& mm_hash);
  void forget_substitute(std::string_view lender_id);
  // The request that named `transfer_id` is done with it: cancel it, or settle the
  // substitute roles it has.
  void release_own_transfer(const std::string& transfer_id, TimePoint now, std::string_view mm_hash,
                            std::string_view request_id);
  // One side of a substitute finished: the second to finish cancels it.
  void finish_substitute_side(std::string_view lender_id, bool lender, TimePoint now, std::string_view mm_hash);
  Result<TensorSpec> output_spec(const MmFeature& feature) const;
  static std::string fallback_id(const RequestView& request, std::size_t index);

  CoordinatorOptions options_;
  std::shared_ptr<const Clock> clock_;
  std::shared_ptr<EventSource> events_;
  std::shared_ptr<ConsumerControl> control_;
  std::unique_ptr<BoundedExecutor> executor_;
  TransferTable table_;
  CoordinatorStats stats_;
  bool closed_ = false;

  // Draining happens at most once per step boundary (re-armed by
  // build_connector_meta) or after drain_min_interval.
  bool drain_pending_ = true;
  TimePoint drained_at_{};
  std::vector<TransferEvent> event_buffer_;
  std::vector<std::string> cancel_buffer_;

  // Partial multi-shard readiness, oldest first, bounded.
  std::list<PendingShards> pending_shards_;
  StringMap<std::list<PendingShards>::iterator> pending_shards_index_;

  std::vector<std::shared_ptr<CancelTicket>> pending_cancels_;

  // Mirror of the engine's encoder cache (alloc adds, free_encoder_mm_hashes removes).
  StringSet local_cache_;
  // Copies in the workers' caches (loading or loaded) that a request counted on at
  // its gate and has not allocated yet: it started the load, or found another
  // request's. request id -> hashes, and hash -> how many requests count on it.
  StringMap<std::vector<std::string>> copies_counted_on_;
  StringMap<std::size_t> copy_counts_;
  // Hashes the engine allocated since the last step boundary, with the request that
  // allocated each: one the engine also evicted in this step must be loaded again,
  // because the workers drop evicted entries before they load.
  StringMap<std::string> allocated_this_step_;
  std::vector<std::string> extra_freed_;
  // Loads still in flight whose request finished without allocating them: freed
  // once they complete, unless a request allocated them meanwhile.
  StringSet unowned_loads_;
  // A request served by another request's delivery of the same content (it loaded
  // that transfer, or used the copy that transfer's load brought in) leaves its own
  // transfer to that request as a substitute, in case the shared copy is gone before
  // the lender runs: the lender's transfer id -> the borrower's, and back. The
  // substitute is cancelled by whichever of the two requests finishes last, or used
  // by the lender. Bounded in number, and forgotten after the reservation TTL (its
  // reservation's lease has run out by then; a lender whose request never arrives
  // would otherwise keep it until the bound).
  struct Substitute {
    std::string transfer_id;
    TimePoint since;
    bool lender_done = false;
    bool borrower_done = false;
  };
  StringMap<Substitute> substitute_for_lender_;
  StringMap<std::string> lender_of_substitute_;
  std::deque<std::pair<TimePoint, std::string>> substitute_order_;  // (since, lender id), oldest first
  void expire_substitutes(TimePoint now);
  void forget_oldest_substitute();
  // Transfers whose naming request is done with them (bounded, oldest forgotten): a
  // request served by one of these owes nothing to a request that has finished.
  RecentIds released_own_;

  // Producer: planned pushes of this step, bindings planned so far, and which
  // request planned which binding.
  std::vector<PushSpec> pushes_;
  StringMap<PushBinding> push_bindings_;
  StringMap<std::vector<std::string>> bindings_by_request_;
  std::vector<std::pair<std::string, StoreCandidate>> store_candidates_;  // (request id, candidate)

  StringSet failed_saves_;
  StringSet malformed_pending_;
  // Requests already returned by take_unavailable_requests (bounded, oldest forgotten).
  RecentIds notified_;

  std::uint64_t unresolved_warnings_ = 0;
  bool pending_saves_ = false;
  // Hashes has_cache_item answered true for since the last step boundary: the
  // engine allocates them as external loads.
  StringSet claimed_this_step_;
  // Hashes whose load the gate started (asynchronous loads), until reported.
  StringSet gate_loads_;
  // "<request id>\n<index>" of items released to local encoding (or reported
  // stranded), so each is counted and logged once.
  RecentIds fallen_back_;
};

}  // namespace ecx::scheduler
