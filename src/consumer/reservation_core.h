#pragma once
// The reservation machine behind ReservationManager: one record per transfer moving
// through the validated transition table, the tombstones terminal records leave, the
// deadline index that expires live records, the reserves waiting for space
// (starvation), and the event queue. The slots the records hold live in a SlotStore.
//
// One mutex (mu_) guards everything here, the SlotStore included: every public member
// takes it, every private one runs with it held. complete_write() alone drops it, to
// hash a landed payload; the slot's open write and the record's `finishing` flag keep
// that slot and that record untouched meanwhile.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "consumer/slot_store.h"
#include "core/id_map.h"
#include "core/logging.h"
#include "ecx/consumer/reservation_manager.h"
#include "ecx/consumer/reservation_types.h"
#include "ecx/core/clock.h"
#include "ecx/core/status.h"

namespace ecx::consumer::detail {

using DeadlineIndex = std::multimap<TimePoint, std::string>;

struct Record {
  std::string transfer_id;
  std::string mm_hash;
  std::optional<TensorSpec> spec;  // absent on pre-reserve tombstones
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  ReservationState state = ReservationState::writing;
  bool writer = false;
  SlotId entry = kNoSlot;  // the slot it holds, in the SlotStore
  bool finishing = false;  // complete_write is hashing the slot outside the lock
  std::optional<DeadlineIndex::iterator> deadline;
  std::optional<DeadlineIndex::iterator> tombstone;
};

class ReservationCore : public std::enable_shared_from_this<ReservationCore> {
 public:
  ReservationCore(ReservationOptions options, std::shared_ptr<const Clock> clock);

  ReserveOutcome reserve(const ReserveRequest& req);
  CancelOutcome cancel(const CancelRequest& req);
  LandingResolution resolve_landing(std::string_view tid, const ReservationId& rid, std::uint64_t nbytes,
                                    std::uint64_t generation);
  DirectLandingResolution resolve_direct_landing(const ReserveRequest& req);
  CompletionOutcome complete_write(std::string_view tid, const ReservationId& rid, bool ok,
                                   std::optional<std::uint64_t> checksum, bool one_sided_call,
                                   std::optional<std::uint64_t> generation = std::nullopt);
  Result<SlotLease> take(std::string_view tid, std::string_view mm_hash);
  Result<SlotLease> take_resident(std::string_view mm_hash, const TensorSpec& spec);
  void release_lease(SlotId entry_id) noexcept;
  void expire();
  std::vector<ReservationEvent> drain_events(std::size_t max);
  std::vector<std::string> drain_reclaimed();
  void begin_shutdown();
  DrainReport wait_for_writers(Duration timeout);
  ReservationCounters counters() const;
  std::optional<ReservationState> state_of(std::string_view tid) const;
  std::optional<ReservationManager::RecordView> describe(std::string_view tid) const;
  Status check_invariants() const;

 private:
  using S = ReservationState;

  TimePoint now() const { return clock_->now(); }
  Record* find(std::string_view tid) {
    auto it = records_.find(tid);
    return it == records_.end() ? nullptr : &it->second;
  }
  // Whether the writer's slot has a write open (someone may be writing it right now).
  bool writer_may_write(const Record& r) const {
    return r.writer && r.entry != kNoSlot && store_.at(r.entry).write_open;
  }

  // --- records (reservation_core.cc)
  bool transition(Record& r, S to);
  void count_state(const Record& r, int delta) {
    state_counts_[static_cast<std::size_t>(r.state)][r.writer ? 1 : 0] += static_cast<std::uint64_t>(delta);
  }
  Record& new_record(const ReserveRequest& req, bool writer, SlotId entry_id, S state);
  void arm_deadline(Record& r, TimePoint when);
  void disarm_deadline(Record& r);
  void entomb(Record& r);
  void drop_tombstone(Record& r);
  void enforce_tombstone_cap();
  void erase_record(const std::string& tid);
  void release_slot(Record& r);
  void close_write(SlotId id);
  void detach_follower(Record& follower);
  void lose_filling(SlotId id, S follower_state, bool notify);
  void terminate_writer(Record& r, S to, bool notify_followers);
  void publish(ReservationEvent event);
  void publish_ready(const Record& r);
  void expire_locked();

  // --- reserve (reservation_core.cc)
  ReserveOutcome reserve_locked(const ReserveRequest& req);
  ReserveOutcome reserve_and_settle_waiter(const ReserveRequest& req);
  std::optional<ReserveOutcome> reserve_again(Record& r, const ReserveRequest& req);
  ReserveOutcome reserve_new(const ReserveRequest& req);
  ReserveOutcome refuse_reserve(Status status);
  struct Waiter {
    std::uint64_t nbytes = 0;
    TimePoint first_refused;
    TimePoint last_seen;
  };
  void note_waiter(const std::string& tid, std::uint64_t nbytes, TimePoint t);
  const Waiter* starving_waiter(TimePoint t, std::string_view asking);

  // --- landing and take (reservation_landing.cc)
  LandingResolution open_landing(Record& r, std::uint64_t nbytes);
  void finish_write(Record& r, bool ok, const std::string& reason, bool* became_ready);
  SlotLease make_lease(SlotId id);

  // --- cancel, one step per case (reservation_cancel.cc)
  CancelOutcome cancel_locked(const CancelRequest& req);
  CancelOutcome count_cancel(CancelOutcome outcome);
  CancelOutcome cancel_unknown(const CancelRequest& req);
  CancelOutcome cancel_terminal(Record& r, bool refresh);
  CancelOutcome refresh(Record& r);
  CancelOutcome refresh_writer(Record& r);
  CancelOutcome cancel_now(Record& r, bool abandon);
  CancelOutcome cancel_writing(Record& r);
  CancelOutcome cancel_landing(Record& r, bool abandon);
  CancelOutcome cancel_deferred(Record& r, bool abandon);
  CancelOutcome abandon_writer(Record& r, S to);
  bool writer_can_stop(const Record& r) const;
  void close_own_write(Record& r);

  ReservationOptions options_;
  std::shared_ptr<const Clock> clock_;
  std::shared_ptr<spdlog::logger> log_;

  mutable std::mutex mu_;
  std::condition_variable writers_cv_;  // signalled when a write closes or shutdown begins
  SlotStore store_;                     // guarded by mu_
  IdMap<Record> records_;
  DeadlineIndex deadlines_;   // live records with a deadline
  DeadlineIndex tombstones_;  // terminal records
  std::deque<ReservationEvent> events_;
  std::uint64_t next_generation_ = 1;
  std::uint64_t state_counts_[kReservationStateCount][2] = {};
  bool shutting_down_ = false;
  ReservationCounters counters_;

  // Reserves the full pool turned away, by transfer id, oldest first (the order may
  // hold ids since served; they are skipped). See ReservationOptions::starvation_after.
  static constexpr std::size_t kMaxWaiters = 4'096;
  IdMap<Waiter> waiters_;
  std::deque<std::string> waiter_order_;
};

}  // namespace ecx::consumer::detail
