// The reservation machine's records (transitions, deadlines, tombstones, events), its
// reserve path with the starvation waiters, expiry, shutdown and what it reports
// (events, counters, invariants). Landing and take are in reservation_landing.cc,
// cancel in reservation_cancel.cc.

#include "consumer/reservation_core.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "ecx/core/node_stash.h"

namespace ecx::consumer::detail {

namespace {

SlotStoreOptions slot_store_options(const ReservationOptions& o) {
  SlotStoreOptions s;
  s.slab_base = o.slab_base;
  s.slab_size = o.slab_size;
  s.alignment = o.alignment;
  s.resident_capacity_bytes = o.resident_capacity_bytes;
  s.reclaimed_max = o.event_queue_max;  // the reclaimed-hash list is bounded like the event queue
  s.space_freed = o.space_freed;
  return s;
}

}  // namespace

ReservationCore::ReservationCore(ReservationOptions options, std::shared_ptr<const Clock> clock)
    : options_(std::move(options)),
      clock_(std::move(clock)),
      log_(log::get("consumer")),
      store_(slot_store_options(options_)) {
  if (options_.max_tensor_bytes == 0) options_.max_tensor_bytes = store_.capacity();
  if (options_.resident_capacity_bytes == 0) options_.resident_capacity_bytes = store_.capacity();
  if (options_.tombstone_max == 0) options_.tombstone_max = 1;
  if (options_.event_queue_max == 0) options_.event_queue_max = 1;
  counters_.pool_capacity = store_.capacity();
}

// ---------------------------------------------------------------- records

bool ReservationCore::transition(Record& r, S to) {
  const S from = r.state;
  if (reservation_transition_allowed(from, to)) {
    count_state(r, -1);
    r.state = to;
    count_state(r, +1);
    return true;
  }
  ++counters_.invalid_transitions;
  log_->error("invalid reservation transition {} -> {} for transfer_id={} (mm_hash={}); failing this transfer",
              reservation_state_name(from), reservation_state_name(to), r.transfer_id, r.mm_hash);
  if (!is_terminal(from)) {
    // Fail only this transfer. entomb() drops the record's hold on the slot; a write
    // still open keeps the slot alive (leaked, never reused) rather than corrupted.
    count_state(r, -1);
    r.state = S::failed;
    count_state(r, +1);
    publish(FailedEvent{r.transfer_id, r.mm_hash,
                        fmt::format("internal: invalid transition {} -> {}", reservation_state_name(from),
                                    reservation_state_name(to))});
    if (r.writer && store_.filled_by(r.entry, r.transfer_id)) lose_filling(r.entry, S::failed, true);
    if (!r.writer) detach_follower(r);
    entomb(r);
  }
  return false;
}

Record& ReservationCore::new_record(const ReserveRequest& req, bool writer, SlotId entry_id, S state) {
  Record r;
  r.transfer_id = req.transfer_id;
  r.mm_hash = req.mm_hash;
  r.spec = req.spec;
  r.reservation_id = ReservationId::random();
  r.generation = next_generation_++;
  r.state = state;
  r.writer = writer;
  r.entry = entry_id;
  auto [it, inserted] = records_.insert_or_assign(req.transfer_id, std::move(r));
  (void)inserted;
  count_state(it->second, +1);
  arm_deadline(it->second, now() + options_.ttl);
  return it->second;
}

void ReservationCore::arm_deadline(Record& r, TimePoint when) {
  r.deadline = r.deadline ? rekey(deadlines_, *r.deadline, deadlines_, when) : deadlines_.emplace(when, r.transfer_id);
}

void ReservationCore::disarm_deadline(Record& r) {
  if (r.deadline) {
    deadlines_.erase(*r.deadline);
    r.deadline.reset();
  }
}

// A terminal record becomes a tombstone: it lets go of its slot and is kept for the
// TTL (bounded in count) so late and repeated requests stay idempotent.
void ReservationCore::entomb(Record& r) {
  release_slot(r);
  drop_tombstone(r);
  const TimePoint until = now() + options_.ttl;
  // The deadline's index entry, when there is one, moves over with its copy of the id.
  r.tombstone = r.deadline ? rekey(deadlines_, *std::exchange(r.deadline, std::nullopt), tombstones_, until)
                           : tombstones_.emplace(until, r.transfer_id);
  enforce_tombstone_cap();
}

void ReservationCore::drop_tombstone(Record& r) {
  if (r.tombstone) {
    tombstones_.erase(*r.tombstone);
    r.tombstone.reset();
  }
}

void ReservationCore::enforce_tombstone_cap() {
  while (tombstones_.size() > options_.tombstone_max) {
    const std::string tid = tombstones_.begin()->second;
    ++counters_.tombstones_dropped;
    erase_record(tid);
  }
}

void ReservationCore::erase_record(const std::string& tid) {
  auto it = records_.find(tid);
  if (it == records_.end()) return;
  Record& r = it->second;
  disarm_deadline(r);
  drop_tombstone(r);
  release_slot(r);
  count_state(r, -1);
  records_.erase(it);
}

void ReservationCore::release_slot(Record& r) {
  if (r.entry == kNoSlot) return;
  const SlotId id = r.entry;
  r.entry = kNoSlot;  // before the release, which may free the slot
  store_.release(id);
}

void ReservationCore::close_write(SlotId id) {
  if (store_.close_write(id)) writers_cv_.notify_all();
}

void ReservationCore::detach_follower(Record& f) {
  if (f.entry != kNoSlot) store_.remove_follower(f.entry, f.transfer_id);
}

// The landing a filling slot waited for will never happen: its followers end in
// `follower_state` (with an abandoned or failed event when notify) and the slot
// stops accepting followers.
void ReservationCore::lose_filling(SlotId id, S follower_state, bool notify) {
  for (const std::string& tid : store_.lose(id)) {
    Record* f = find(tid);
    if (f == nullptr || is_terminal(f->state)) continue;
    if (!transition(*f, follower_state)) continue;
    if (notify) {
      if (follower_state == S::failed) {
        publish(FailedEvent{f->transfer_id, f->mm_hash, "the landing this transfer shared failed"});
      } else {
        publish(AbandonedEvent{f->transfer_id, f->mm_hash});
      }
    }
    entomb(*f);
  }
}

// A writer that has not landed goes terminal: its followers lose their landing.
void ReservationCore::terminate_writer(Record& r, S to, bool notify_followers) {
  if (store_.filled_by(r.entry, r.transfer_id)) {
    lose_filling(r.entry, to == S::expired ? S::expired : S::cancelled, notify_followers);
  }
  if (transition(r, to)) entomb(r);
}

void ReservationCore::publish(ReservationEvent event) {
  if (events_.size() >= options_.event_queue_max) {
    events_.pop_front();
    ++counters_.events_dropped;
  }
  events_.push_back(std::move(event));
}

void ReservationCore::publish_ready(const Record& r) {
  publish(ReadyEvent{r.transfer_id, r.mm_hash, r.spec->nbytes(), *r.spec, r.reservation_id});
}

// ---------------------------------------------------------------- reserve

void ReservationCore::note_waiter(const std::string& tid, std::uint64_t nbytes, TimePoint t) {
  if (options_.starvation_after <= Duration::zero()) return;
  if (auto it = waiters_.find(tid); it != waiters_.end()) {
    it->second.last_seen = t;
    return;
  }
  if (waiters_.size() >= kMaxWaiters) return;
  waiters_.emplace(tid, Waiter{nbytes, t, t});
  waiter_order_.push_back(tid);
}

// The oldest reserve still being retried, once it has waited starvation_after; not
// `asking` itself. One that stopped retrying (its producer gave up or died) is dropped.
const ReservationCore::Waiter* ReservationCore::starving_waiter(TimePoint t, std::string_view asking) {
  if (options_.starvation_after <= Duration::zero()) return nullptr;
  const Duration gone_after =
      std::max<Duration>({std::chrono::seconds(1), options_.retry_after * 20, options_.reserve_hold * 2});
  while (!waiter_order_.empty()) {
    auto it = waiters_.find(waiter_order_.front());
    if (it == waiters_.end()) {
      waiter_order_.pop_front();  // served since
    } else if (t - it->second.last_seen > gone_after) {
      waiters_.erase(it);
      waiter_order_.pop_front();
    } else {
      if (it->first == asking || t - it->second.first_refused < options_.starvation_after) return nullptr;
      return &it->second;
    }
  }
  return nullptr;
}

ReserveOutcome ReservationCore::reserve(const ReserveRequest& req) {
  std::lock_guard lock(mu_);
  return reserve_and_settle_waiter(req);
}

ReserveOutcome ReservationCore::reserve_and_settle_waiter(const ReserveRequest& req) {
  ReserveOutcome result = reserve_locked(req);
  // Served (or refused for good) one way or another: no longer waiting for space.
  if (!waiters_.empty() && !std::holds_alternative<outcome::RetryAfter>(result)) waiters_.erase(req.transfer_id);
  return result;
}

ReserveOutcome ReservationCore::refuse_reserve(Status status) {
  ++counters_.reserve_refused;
  return ReserveOutcome{outcome::Refused{std::move(status)}};
}

ReserveOutcome ReservationCore::reserve_locked(const ReserveRequest& req) {
  expire_locked();
  if (shutting_down_) return refuse_reserve(unavailable("consumer reservation manager is shutting down"));
  if (Status st = validate_transfer_id(req.transfer_id); !st.is_ok()) return refuse_reserve(st);
  if (Status st = validate_mm_hash(req.mm_hash); !st.is_ok()) return refuse_reserve(st);
  const std::uint64_t nbytes = req.spec.nbytes();
  if (nbytes > options_.max_tensor_bytes) {
    return refuse_reserve(invalid_argument(fmt::format("transfer_id={} needs {} bytes; at most {} fit this pool",
                                                       req.transfer_id, nbytes, options_.max_tensor_bytes)));
  }
  if (Record* r = find(req.transfer_id)) {
    if (std::optional<ReserveOutcome> again = reserve_again(*r, req)) return *std::move(again);
  }
  return reserve_new(req);
}

// A reserve for a transfer that already has a record: idempotent for a live one,
// refused or told it is cancelled for a terminal one. nullopt: an expired record was
// dropped and a fresh reservation replaces it.
std::optional<ReserveOutcome> ReservationCore::reserve_again(Record& r, const ReserveRequest& req) {
  switch (r.state) {
    case S::cancelled:
    case S::cancel_pending:
      ++counters_.reserve_cancelled;
      return outcome::Cancelled{};
    case S::failed:
      return refuse_reserve(unavailable(fmt::format("transfer_id={} failed on this consumer", req.transfer_id)));
    case S::expire_pending:
      return refuse_reserve(
          conflict(fmt::format("transfer_id={} still has an active writer; abandon it first", req.transfer_id)));
    case S::expired:
      erase_record(req.transfer_id);
      return std::nullopt;
    case S::writing:
    case S::landing:
    case S::ready:
      break;
  }
  if (r.mm_hash != req.mm_hash || !r.spec || *r.spec != req.spec) {
    return refuse_reserve(conflict(fmt::format("conflicting reservation for transfer_id={}: it holds mm_hash={} {}",
                                               req.transfer_id, r.mm_hash, r.spec ? r.spec->to_string() : "")));
  }
  if (r.state == S::ready) {
    ++counters_.ready_repeat;
    return outcome::Ready{r.reservation_id, r.generation, false};
  }
  ++counters_.reserved_repeat;
  if (r.state == S::writing) arm_deadline(r, now() + options_.ttl);
  return outcome::Reserved{r.reservation_id, r.generation, store_.at(r.entry).slot.offset, req.spec.nbytes(),
                           r.writer && r.state == S::writing};
}

// A first reserve: a resident copy serves it, or it follows the landing of the same
// content already on its way, or it becomes the writer of a new slot.
ReserveOutcome ReservationCore::reserve_new(const ReserveRequest& req) {
  const std::uint64_t nbytes = req.spec.nbytes();
  if (const SlotId id = store_.resident(req.mm_hash); id != kNoSlot) {
    const SlotEntry& e = store_.at(id);
    if (e.spec != req.spec) {
      return refuse_reserve(conflict(fmt::format("conflicting cached tensor for mm_hash={}: resident {} , requested {}",
                                                 req.mm_hash, e.spec.to_string(), req.spec.to_string())));
    }
    store_.hold(id);
    Record& r = new_record(req, false, id, S::ready);
    ++counters_.resident_hits;
    publish_ready(r);
    return outcome::Ready{r.reservation_id, r.generation, true};
  }

  if (const SlotId id = store_.filling(req.mm_hash); id != kNoSlot) {
    const SlotEntry& e = store_.at(id);
    if (e.spec != req.spec) {
      return refuse_reserve(
          conflict(fmt::format("conflicting in-flight tensor for mm_hash={}: writing {}, requested {}", req.mm_hash,
                               e.spec.to_string(), req.spec.to_string())));
    }
    store_.hold(id);
    store_.add_follower(id, req.transfer_id);
    Record& r = new_record(req, false, id, S::writing);
    ++counters_.reserved_follower;
    return outcome::Reserved{r.reservation_id, r.generation, e.slot.offset, nbytes, false};
  }

  const TimePoint t = now();
  if (const Waiter* older = starving_waiter(t, req.transfer_id);
      older != nullptr && store_.largest_free_block() < older->nbytes + nbytes) {
    // What frees up goes to the reserve that has waited longest.
    ++counters_.retry_afters;
    ++counters_.retry_afters_for_older;
    note_waiter(req.transfer_id, nbytes, t);
    return outcome::RetryAfter{options_.retry_after};
  }
  // One-sided: the producer may write from the moment it knows the slot.
  Result<SlotId> id = store_.allocate_filling(req.mm_hash, req.spec, req.transfer_id, req.checksum,
                                              options_.mode == LandingMode::one_sided);
  if (!id.is_ok()) {
    if (id.status().code() == StatusCode::resource_exhausted) {
      ++counters_.retry_afters;
      note_waiter(req.transfer_id, nbytes, t);
      return outcome::RetryAfter{options_.retry_after};
    }
    return refuse_reserve(id.status());
  }
  Record& r = new_record(req, true, *id, S::writing);
  ++counters_.reserved_writer;
  counters_.bytes_reserved += nbytes;
  return outcome::Reserved{r.reservation_id, r.generation, store_.at(*id).slot.offset, nbytes, true};
}

// ---------------------------------------------------------------- expiry, shutdown

void ReservationCore::expire() {
  std::lock_guard lock(mu_);
  expire_locked();
}

void ReservationCore::expire_locked() {
  const TimePoint t = now();
  while (!tombstones_.empty() && tombstones_.begin()->first <= t) {
    const std::string tid = tombstones_.begin()->second;
    erase_record(tid);
  }
  while (!deadlines_.empty() && deadlines_.begin()->first <= t) {
    const std::string tid = deadlines_.begin()->second;
    Record* r = find(tid);
    if (r == nullptr) {  // defensive: the index never outlives its record
      deadlines_.erase(deadlines_.begin());
      continue;
    }
    disarm_deadline(*r);
    ++counters_.expired;
    const bool write_open = writer_may_write(*r);
    switch (r->state) {
      case S::ready:
        if (transition(*r, S::expired)) entomb(*r);
        break;
      case S::writing:
        if (!r->writer) {
          detach_follower(*r);
          if (transition(*r, S::expired)) entomb(*r);
        } else if (write_open) {
          // A timeout cannot prove a one-sided writer stopped: keep the slot.
          transition(*r, S::expire_pending);
        } else {
          terminate_writer(*r, S::expired, true);
        }
        break;
      case S::cancel_pending:
        if (write_open) break;
        terminate_writer(*r, S::cancelled, true);
        break;
      default:
        log_->error("transfer_id={} in state {} had a deadline", r->transfer_id, reservation_state_name(r->state));
        break;
    }
  }
}

void ReservationCore::begin_shutdown() {
  std::lock_guard lock(mu_);
  shutting_down_ = true;
  std::vector<std::string> followers_and_ready;
  std::vector<std::string> writers;
  for (const auto& [tid, r] : records_) {
    if (is_terminal(r.state)) continue;
    (r.writer && r.state != S::ready ? writers : followers_and_ready).push_back(tid);
  }
  for (const std::string& tid : followers_and_ready) {
    Record* r = find(tid);
    if (r == nullptr || is_terminal(r->state)) continue;
    if (r->state == S::writing) {
      detach_follower(*r);
      publish(AbandonedEvent{r->transfer_id, r->mm_hash});
    }
    if (transition(*r, S::cancelled)) entomb(*r);
  }
  for (const std::string& tid : writers) {
    Record* r = find(tid);
    if (r == nullptr || is_terminal(r->state)) continue;
    if (writer_may_write(*r)) {
      if (r->state == S::writing || r->state == S::landing) transition(*r, S::cancel_pending);
      disarm_deadline(*r);
    } else {
      terminate_writer(*r, S::cancelled, true);
    }
  }
  writers_cv_.notify_all();
}

DrainReport ReservationCore::wait_for_writers(Duration timeout) {
  std::unique_lock lock(mu_);
  writers_cv_.wait_for(lock, timeout, [this] { return store_.open_writes() == 0; });
  DrainReport report;
  report.writers_remaining = store_.open_writes();
  report.writers_finished = report.writers_remaining == 0;
  report.leases_outstanding = store_.leases();
  if (!report.writers_finished) {
    log_->error("timed out waiting for {} writer(s); keeping the consumer receive pool registered",
                report.writers_remaining);
  }
  return report;
}

// ---------------------------------------------------------------- events, reports

std::vector<ReservationEvent> ReservationCore::drain_events(std::size_t max) {
  std::lock_guard lock(mu_);
  std::vector<ReservationEvent> out;
  while (!events_.empty() && out.size() < max) {
    out.push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return out;
}

std::vector<std::string> ReservationCore::drain_reclaimed() {
  std::lock_guard lock(mu_);
  return store_.drain_reclaimed();
}

ReservationCounters ReservationCore::counters() const {
  std::lock_guard lock(mu_);
  ReservationCounters c = counters_;
  auto count = [this](S s, int writer) { return state_counts_[static_cast<std::size_t>(s)][writer]; };
  c.pool_used_bytes = store_.used_bytes();
  c.writers = count(S::writing, 1) + count(S::landing, 1) + count(S::cancel_pending, 1) + count(S::expire_pending, 1);
  c.followers = count(S::writing, 0);
  c.ready = count(S::ready, 0) + count(S::ready, 1);
  c.deferred = count(S::cancel_pending, 1) + count(S::expire_pending, 1);
  c.tombstones = tombstones_.size();
  c.live_records = records_.size() - tombstones_.size();
  c.residents_reclaimed = store_.residents_reclaimed();
  c.resident_entries = store_.resident_entries();
  c.resident_bytes = store_.resident_bytes();
  c.leases = store_.leases();
  c.pending_events = events_.size();
  return c;
}

std::optional<ReservationState> ReservationCore::state_of(std::string_view tid) const {
  std::lock_guard lock(mu_);
  auto it = records_.find(tid);
  if (it == records_.end()) return std::nullopt;
  return it->second.state;
}

std::optional<ReservationManager::RecordView> ReservationCore::describe(std::string_view tid) const {
  std::lock_guard lock(mu_);
  auto it = records_.find(tid);
  if (it == records_.end()) return std::nullopt;
  const Record& r = it->second;
  return ReservationManager::RecordView{r.state, r.mm_hash, r.reservation_id, r.generation, r.spec};
}

Status ReservationCore::check_invariants() const {
  std::lock_guard lock(mu_);
  auto fail = [](std::string what) { return internal_error(std::move(what)); };
  if (Status st = store_.check_slots(); !st.is_ok()) return st;
  std::unordered_map<SlotId, std::uint64_t> record_refs;
  std::uint64_t tombstones = 0;
  std::uint64_t with_deadline = 0;
  for (const auto& [tid, r] : records_) {
    if (is_terminal(r.state)) {
      ++tombstones;
      if (!r.tombstone || r.entry != kNoSlot || r.deadline) return fail(fmt::format("tombstone {} is malformed", tid));
      continue;
    }
    if (r.tombstone) return fail(fmt::format("live record {} is in the tombstone index", tid));
    if (r.deadline) ++with_deadline;
    if (r.entry == kNoSlot || !store_.contains(r.entry)) return fail(fmt::format("live record {} holds no slot", tid));
    ++record_refs[r.entry];
    const bool deferred_write = r.writer && store_.at(r.entry).write_open;
    if (!r.deadline && !deferred_write)
      return fail(fmt::format("record {} ({}) can never expire", tid, reservation_state_name(r.state)));
  }
  if (tombstones != tombstones_.size()) return fail("tombstone index out of step");
  if (tombstones_.size() > options_.tombstone_max) return fail("more tombstones than tombstone_max");
  if (with_deadline != deadlines_.size()) return fail("deadline index out of step");
  return store_.check_holders(record_refs);
}

}  // namespace ecx::consumer::detail
