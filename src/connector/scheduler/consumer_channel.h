#pragma once
// ConsumerChannel: the consumer half's traffic with its consumer shards. Readiness
// events are drained from the EventSource into the transfer table (at most once per
// step boundary, or after drain_min_interval), multi-shard readiness is collected
// until every shard reported; reservation cancels go to the shards on an owned,
// bounded executor, and their outcome is polled on a later call. Never blocks the
// scheduler thread on the network.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "connector/scheduler/coordinator_common.h"
#include "ecx/connector/scheduler/collaborators.h"
#include "ecx/connector/scheduler/coordinator.h"
#include "ecx/connector/scheduler/transfer_table.h"
#include "ecx/core/clock.h"

namespace ecx::scheduler {

class BoundedExecutor;

class ConsumerChannel {
 public:
  struct Stats {
    std::uint64_t drains = 0;
    std::uint64_t events_received = 0;
    std::uint64_t events_malformed = 0;
    std::uint64_t ready_accepted = 0;
    std::uint64_t ready_ignored = 0;
    std::uint64_t awaiting_shards = 0;
    std::uint64_t partial_dropped = 0;
    std::uint64_t abandoned_events = 0;
    std::uint64_t failed_events = 0;
    std::uint64_t cancels_queued = 0;
    std::uint64_t cancels_succeeded = 0;
    std::uint64_t cancels_failed = 0;
    std::uint64_t cancels_dropped = 0;
    std::uint64_t cancels_local_only = 0;
    std::uint64_t cancels_abandoned = 0;
    std::uint64_t readiness_rechecks = 0;
    std::uint64_t rechecks_failed = 0;
    std::uint64_t readiness_recovered = 0;
  };

  // `options` and `table` must outlive the channel. `events` and `control` may be
  // null (no events; cancels stay local and are counted).
  ConsumerChannel(const CoordinatorOptions& options, TransferTable& table, std::shared_ptr<EventSource> events,
                  std::shared_ptr<ConsumerControl> control);
  ~ConsumerChannel();
  ConsumerChannel(const ConsumerChannel&) = delete;
  ConsumerChannel& operator=(const ConsumerChannel&) = delete;

  // Polls finished cancels, applies queued events, then the table's deadlines
  // (cancelling what expired). Skipped unless re-armed or drain_min_interval passed.
  void drain(TimePoint now);
  // See SchedulerCoordinator::wait_for_events().
  bool wait_for_events(Duration max_wait, std::span<const WakeSource> also) const {
    return events_ && !closed_ && events_->wait(max_wait, also);
  }
  SubscriptionCounters subscription_counters() const {
    return events_ ? events_->subscription_counters() : SubscriptionCounters{};
  }
  // A step boundary: the next drain() runs whatever the interval.
  void rearm_drain() noexcept { drain_pending_ = true; }
  // Cancels `transfer_id` in the table and, where the table says a cancel is due,
  // on the consumer shards (cancel_on_shards).
  void queue_cancel(std::string_view transfer_id, TimePoint now, std::string_view mm_hash = {},
                    std::string_view request_id = {});
  // An orphan (TransferTable::drain_orphaned) has ended in the table: an expired one
  // becomes a cancelled tombstone, a failed one stays failed. Either is cancelled on
  // the shards unless nothing can be left there (see cancel_on_shards).
  void cancel_orphan(std::string_view transfer_id, TimePoint now);
  // Takes the outcome of the remote cancels that finished.
  void poll_pending_cancels();
  // See SchedulerCoordinator::close(). Idempotent.
  void close();

  bool closed() const noexcept { return closed_; }
  std::size_t pending_cancels() const noexcept { return pending_cancels_.size(); }
  const Stats& stats() const noexcept { return stats_; }

 private:
  struct CancelTicket;
  struct CancelQueue;
  struct CancelSender;
  struct RecheckTicket;
  struct PendingShards {
    std::string transfer_id;
    std::vector<int> shards;
    TensorSpec spec;
  };

  void accept_event(const TransferEvent& event, TimePoint now);
  void apply_event(const TransferEvent& event, TimePoint now);
  // Readiness recheck (CoordinatorOptions::readiness_recheck): asks the shards about
  // transfers that waited too long, and applies what they answered.
  void start_rechecks(TimePoint now);
  void queue_recheck(const std::string& transfer_id);
  std::vector<std::shared_ptr<RecheckTicket>> take_answered_rechecks();
  void apply_rechecks(const std::vector<std::shared_ptr<RecheckTicket>>& answered, TimePoint now);
  // Whether every shard has now reported `event`'s transfer ready.
  bool note_shard_ready(const TransferEvent& event, TimePoint now);
  void forget_shard_readiness(std::string_view transfer_id);
  // Queues a cancel of `transfer_id` on every consumer shard, unless no shard can hold
  // anything of it (a name the scheduler invented, a transfer every rank's worker took)
  // or no control client is configured; those end here, counted as local-only.
  void cancel_on_shards(std::string_view transfer_id);

  const CoordinatorOptions& options_;
  TransferTable& table_;
  std::shared_ptr<EventSource> events_;
  std::shared_ptr<ConsumerControl> control_;
  std::unique_ptr<BoundedExecutor> executor_;
  Stats stats_;
  bool closed_ = false;

  bool drain_pending_ = true;
  TimePoint drained_at_{};
  std::vector<TransferEvent> event_buffer_;
  std::vector<std::string> cancel_buffer_;

  // Partial multi-shard readiness, oldest first, bounded.
  std::list<PendingShards> pending_shards_;
  detail::StringMap<std::list<PendingShards>::iterator> pending_shards_index_;

  std::vector<std::shared_ptr<CancelTicket>> pending_cancels_;
  // Cancels not yet taken by the sender task; shared with it (see queue_cancel).
  std::shared_ptr<CancelQueue> cancel_queue_;

  std::vector<std::shared_ptr<RecheckTicket>> pending_rechecks_;
  // When each long-waiting transfer was last asked about; entries go once it stops
  // waiting, so this holds at most the waiting records.
  detail::StringMap<TimePoint> rechecked_at_;
  TimePoint next_recheck_scan_{};
};

}  // namespace ecx::scheduler
