#pragma once
// ConsumerGate: the consumer half of the SchedulerCoordinator. It owns the transfer
// table (one record per inbound transfer) and decides which requests wait for their
// transfers (the load gate), what has_cache_item claims, which loads each step
// dispatches, and which copies stay in or leave the workers' encoder caches. Its
// traffic with the consumer shards goes through the ConsumerChannel it owns.
//
// Some of it runs for every role: the engine-cache mirror and the step's frees are
// kept for a pure producer too (the workers drop what the engine freed).

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "connector/scheduler/consumer_channel.h"
#include "connector/scheduler/coordinator_common.h"
#include "connector/scheduler/request_failures.h"
#include "ecx/connector/scheduler/collaborators.h"
#include "ecx/connector/scheduler/coordinator.h"
#include "ecx/connector/scheduler/transfer_table.h"
#include "ecx/connector/scheduler/types.h"
#include "ecx/core/clock.h"
#include "ecx/core/node_stash.h"

namespace ecx::scheduler {

class ConsumerGate {
 public:
  struct Stats {
    std::uint64_t alloc_loads = 0;          // loads dispatched by after_alloc
    std::uint64_t alloc_load_misses = 0;    // allocated as external, but nothing left to load
    std::uint64_t local_fallbacks = 0;      // unreachable items released to be encoded locally
    std::uint64_t stranded_items = 0;       // unreachable items held (no media) and reported
    std::uint64_t rechecks_remembered = 0;  // re-checks answered "still waiting" by the memo
  };

  // `options` and `failures` must outlive the gate; options.cancel_attempts >= 1.
  ConsumerGate(const CoordinatorOptions& options, std::shared_ptr<const Clock> clock,
               std::shared_ptr<EventSource> events, std::shared_ptr<ConsumerControl> control,
               RequestFailures& failures);
  ConsumerGate(const ConsumerGate&) = delete;
  ConsumerGate& operator=(const ConsumerGate&) = delete;

  // SchedulerCoordinator::has_cache_item.
  bool has_cache_item(std::string_view identifier);
  // The consumer's part of ensure_cache_available (params well formed): true when
  // every item not yet computed is in the engine's cache or loaded; starts loads.
  bool admit(const RequestView& request, std::int64_t num_computed_tokens);
  // Unavailable channel absent: whether a request with malformed params is let
  // through to be encoded locally (every item carries its media).
  bool release_malformed(const RequestView& request);
  // The engine allocated item `index` (in range): mirrors its cache, and loads a
  // claimed item whose copy is not in the workers' caches.
  void after_alloc(const RequestView& request, std::size_t index);
  // SchedulerCoordinator::update_state_after_free.
  void after_free(const RequestView& request, std::size_t index);
  // The consumer's part of the step's plan: frees, retained copies, orphan cancels
  // and loads; re-arms draining.
  void build_step(const StepView& step, ConnectorMeta& meta);
  // The workers' report of loads and reclaimed resident copies.
  void take_output(const WorkerOutput& output);
  // The request finished: releases its transfers and the copies it counted on.
  void finish(const RequestView& request);
  // Requests the table failed since the last call.
  std::vector<std::string> take_unavailable_requests() { return table_.take_unavailable_requests(); }
  // Asynchronous loads the gate started that the workers have not reported yet.
  bool loads_in_flight() const noexcept;
  void close() { channel_.close(); }
  bool wait_for_events(Duration max_wait, std::span<const WakeSource> also) const {
    return channel_.wait_for_events(max_wait, also);
  }

  bool closed() const noexcept { return channel_.closed(); }
  const TransferTable& table() const noexcept { return table_; }
  const ConsumerChannel& channel() const noexcept { return channel_; }
  const Stats& stats() const noexcept { return stats_; }
  // Its part of SchedulerCoordinator::bookkeeping() (the rest stays zero).
  SchedulerCoordinator::Bookkeeping bookkeeping() const noexcept;

 private:
  struct Substitute {
    std::string transfer_id;
    TimePoint since;
    bool lender_done = false;
    bool borrower_done = false;
  };

  // Waits for the push; returns the record waited on (nullptr: refused).
  const TransferRecord* note_awaiting_push(std::string_view mm_hash, std::string_view waiting_id, bool invented,
                                           std::string_view request_id, TimePoint now);
  // A request found waiting by a check that changed nothing, kept so that its next
  // re-check costs a lookup while nothing that check read has changed: the stamps of
  // its items' hashes (the table changes them for any change of their records, the
  // engine cache mirror for a change of membership) and of the records it names, its
  // computed tokens, the substitutes, the load mode, and the earliest deadline it
  // waits under. The same check would change nothing again and answer the same.
  struct Waiting {
    struct Item {
      TransferTable::HashStamp stamp;  // entry kNoId: no live record, decided by local_hit
      bool local_hit = false;
      // The record of the transfer id the request names for it (its lease is touched
      // when available, and it may hold other content than the item's hash).
      TransferTable::RecordStamp named;
    };
    std::int64_t num_computed_tokens = 0;
    std::size_t features = 0;
    std::uint64_t substitutes_changed = 0;
    bool asynchronous_loads = true;
    bool unavailable_reaches_engine = true;
    TimePoint valid_until;
    std::vector<Item> items;  // of the features not computed, in order
  };
  bool still_waiting(const RequestView& request, std::int64_t num_computed_tokens, TimePoint now) const;
  // False (nothing kept) for a request whose next check would not be the same.
  bool remember_waiting(const RequestView& request, std::int64_t num_computed_tokens, TimePoint valid_until);
  // The engine cache mirror changed for `mm_hash`: remembered waits on it end.
  void local_cache_changed(std::string_view mm_hash) { table_.touch_hash(mm_hash); }
  void load_at_alloc(const RequestView& request, std::size_t index);
  // Unavailable channel absent: whether item `index`, waiting for `waiting_id`, is
  // let through to be encoded locally because its push cannot arrive any more.
  bool release_unreachable(const RequestView& request, std::size_t index, std::string_view waiting_id);
  void note_borrow(const TransferRecord& used, std::string_view own_transfer_id, std::string_view request_id,
                   TimePoint now);
  // `request_id` no longer waits for its own transfer, nor for the substitute it
  // would wait for instead: the end of either is not its loss.
  void stop_waiting(std::string_view own_transfer_id, std::string_view request_id);
  void count_on_copy(const std::string& request_id, const std::string& mm_hash);
  void stop_counting_on_copy(const std::string& mm_hash);
  void forget_substitute(std::string_view lender_id);
  // The request that named `transfer_id` is done with it: cancel it, or settle the
  // substitute roles it has.
  void release_own_transfer(const std::string& transfer_id, TimePoint now, std::string_view mm_hash,
                            std::string_view request_id);
  // One side of a substitute finished: the second to finish cancels it.
  void finish_substitute_side(std::string_view lender_id, bool lender, TimePoint now, std::string_view mm_hash);
  void expire_substitutes(TimePoint now);
  void forget_oldest_substitute();

  const CoordinatorOptions& options_;
  std::shared_ptr<const Clock> clock_;
  RequestFailures& failures_;
  TransferTable table_;
  ConsumerChannel channel_;  // after table_: it holds a reference to it
  Stats stats_;

  // Mirror of the engine's encoder cache (alloc adds, free_encoder_mm_hashes removes).
  detail::StringSet local_cache_;
  // Copies in the workers' caches (loading or loaded) that a request counted on at
  // its gate and has not allocated yet: it started the load, or found another
  // request's. request id -> hashes, and hash -> how many requests count on it.
  detail::StringMap<std::vector<std::string>> copies_counted_on_;
  detail::StringMap<std::size_t> copy_counts_;
  // An entry in each per loaded item, gone when its request allocates or finishes:
  // nodes and key strings are reused.
  NodeStash<detail::StringMap<std::vector<std::string>>> counted_on_nodes_;
  NodeStash<detail::StringMap<std::size_t>> copy_count_nodes_;
  // Hashes the engine allocated since the last step boundary, with the request that
  // allocated each: one the engine also evicted in this step must be loaded again,
  // because the workers drop evicted entries before they load.
  detail::StringMap<std::string> allocated_this_step_;
  // Both gain an entry per item the engine allocates and lose it soon after: their
  // nodes (and the strings in them) are reused.
  NodeStash<detail::StringSet> local_cache_nodes_;
  NodeStash<detail::StringMap<std::string>> allocated_nodes_;
  std::vector<std::string> extra_freed_;
  // Loads still in flight whose request finished without allocating them: freed
  // once they complete, unless a request allocated them meanwhile.
  detail::StringSet unowned_loads_;
  // A request served by another request's delivery of the same content (it loaded
  // that transfer, or used the copy that transfer's load brought in) leaves its own
  // transfer to that request as a substitute, in case the shared copy is gone before
  // the lender runs: the lender's transfer id -> the borrower's, and back. The
  // substitute is cancelled by whichever of the two requests finishes last, or used
  // by the lender. Bounded in number, and forgotten after the reservation TTL (its
  // reservation's lease has run out by then; a lender whose request never arrives
  // would otherwise keep it until the bound).
  detail::StringMap<Substitute> substitute_for_lender_;
  detail::StringMap<std::string> lender_of_substitute_;
  std::uint64_t substitutes_changed_ = 0;                           // counts changes of substitute_for_lender_
  std::deque<std::pair<TimePoint, std::string>> substitute_order_;  // (since, lender id), oldest first
  // Transfers whose naming request is done with them (bounded, oldest forgotten): a
  // request served by one of these owes nothing to a request that has finished.
  detail::RecentIds released_own_;
  // Hashes has_cache_item answered true for since the last step boundary: the
  // engine allocates them as external loads.
  detail::StringSet claimed_this_step_;
  // Hashes whose load the gate started (asynchronous loads), until reported.
  detail::StringSet gate_loads_;
  // "<request id>\n<index>" of items released to local encoding (or reported
  // stranded), so each is counted and logged once.
  detail::RecentIds fallen_back_;
  // Requests found waiting (request id ->), forgotten when they pass or finish.
  detail::StringMap<Waiting> waiting_;
};

}  // namespace ecx::scheduler
