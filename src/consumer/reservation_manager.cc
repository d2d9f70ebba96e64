#include "ecx/consumer/reservation_manager.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>
#include <xxhash.h>

#include "ecx/core/logging.h"
#include "ecx/pool/offset_allocator.h"

namespace ecx::consumer {

using S = ReservationState;

ReservationOptions ReservationOptions::from_config(const Config& config, std::byte* slab_base,
                                                   std::uint64_t slab_size) {
  ReservationOptions o;
  o.slab_base = slab_base;
  o.slab_size = slab_size;
  o.alignment = config.pool_alignment;
  // Only Mooncake lets the producer name the destination. UCX `put` still has the
  // consumer grant each landing from the payload's header (request -> grant -> put ->
  // done), exactly like `am`; only how the bytes move differs.
  o.mode = config.transport == "ucx" ? LandingMode::receiver_chosen : LandingMode::one_sided;
  o.ttl = config.reservation_ttl();
  o.tombstone_max = config.tombstone_max;
  o.event_queue_max = config.event_queue_max;
  o.retry_after = std::chrono::milliseconds(config.retry_after_ms);
  o.checksum = config.checksum;
  o.max_tensor_bytes = config.max_tensor_bytes;
  o.resident_capacity_bytes = config.resident_capacity_bytes;
  o.starvation_after = config.push_wait_timeout() / 4;
  return o;
}

namespace detail {

namespace {

constexpr std::size_t state_index(S s) { return static_cast<std::size_t>(s); }

using DeadlineIndex = std::multimap<TimePoint, std::string>;

// One slot of the slab and what it holds. Several records (a writer and its
// followers, or READY records served from a resident copy) and leases may share it.
struct Entry {
  enum class Content : unsigned char { filling, landed, dead };

  Entry(std::uint64_t entry_id, pool::Slot entry_slot, std::string hash, TensorSpec tensor)
      : id(entry_id), slot(entry_slot), mm_hash(std::move(hash)), spec(std::move(tensor)) {}

  std::uint64_t id = 0;
  pool::Slot slot;
  std::string mm_hash;
  TensorSpec spec;
  Content content = Content::filling;
  std::uint64_t holders = 0;  // records + leases referencing the slot
  std::uint64_t leases = 0;
  // A writer may be writing into the slot right now; nothing frees it meanwhile.
  bool write_open = false;
  bool canonical = false;              // the resident copy of its mm_hash
  std::string writer;                  // while filling: the writer's transfer id
  std::vector<std::string> followers;  // while filling: transfers waiting on this landing
  std::optional<std::uint64_t> expected_checksum;
  bool in_lru = false;
  std::list<std::uint64_t>::iterator lru_it;
};

struct Record {
  std::string transfer_id;
  std::string mm_hash;
  std::optional<TensorSpec> spec;  // absent on pre-reserve tombstones
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  S state = S::writing;
  bool writer = false;
  std::uint64_t entry = 0;  // 0 = holds no slot
  bool finishing = false;   // complete_landing is hashing the slot outside the lock
  std::optional<DeadlineIndex::iterator> deadline;
  std::optional<DeadlineIndex::iterator> tombstone;
};

}  // namespace

class ReservationCore : public std::enable_shared_from_this<ReservationCore> {
 public:
  ReservationCore(ReservationOptions options, std::shared_ptr<const Clock> clock)
      : options_(options),
        clock_(std::move(clock)),
        allocator_(options_.slab_size, options_.alignment),
        log_(log::get("consumer")) {
    if (options_.max_tensor_bytes == 0) options_.max_tensor_bytes = allocator_.capacity();
    if (options_.resident_capacity_bytes == 0) options_.resident_capacity_bytes = allocator_.capacity();
    if (options_.tombstone_max == 0) options_.tombstone_max = 1;
    if (options_.event_queue_max == 0) options_.event_queue_max = 1;
    counters_.pool_capacity = allocator_.capacity();
  }

  ReserveOutcome reserve(const ReserveRequest& req);
  ReserveOutcome reserve_locked(const ReserveRequest& req);
  CancelOutcome cancel(const CancelRequest& req);
  LandingResolution resolve_landing(std::string_view tid, const ReservationId& rid, std::uint64_t nbytes,
                                    std::uint64_t generation);
  CompletionOutcome complete_write(std::string_view tid, const ReservationId& rid, bool ok,
                                   std::optional<std::uint64_t> checksum, bool one_sided_call,
                                   std::optional<std::uint64_t> generation = std::nullopt);
  Result<SlotLease> take(std::string_view tid, std::string_view mm_hash);
  Result<SlotLease> take_resident(std::string_view mm_hash, const TensorSpec& spec);
  void release_lease(std::uint64_t entry_id) noexcept;
  void expire() {
    std::lock_guard lock(mu_);
    expire_locked();
  }
  std::vector<ReservationEvent> drain_events(std::size_t max);
  std::vector<std::string> drain_reclaimed();
  void begin_shutdown();
  DrainReport wait_for_writers(Duration timeout);
  ReservationCounters counters() const;
  std::optional<S> state_of(std::string_view tid) const;
  std::optional<ReservationManager::RecordView> describe(std::string_view tid) const;
  Status check_invariants() const;

 private:
  TimePoint now() const { return clock_->now(); }
  Record* find(std::string_view tid) {
    auto it = records_.find(std::string(tid));
    return it == records_.end() ? nullptr : &it->second;
  }
  Entry& entry(std::uint64_t id) { return entries_.at(id); }

  bool transition(Record& r, S to);
  void count_state(const Record& r, int delta) {
    state_counts_[state_index(r.state)][r.writer ? 1 : 0] += static_cast<std::uint64_t>(delta);
  }
  void arm_deadline(Record& r, TimePoint when);
  void disarm_deadline(Record& r);
  void entomb(Record& r);
  void drop_tombstone(Record& r);
  void enforce_tombstone_cap();
  void erase_record(const std::string& tid);
  void release_ref(std::uint64_t entry_id);
  void maybe_release(Entry& e);
  void free_entry(Entry& e);
  void make_canonical(Entry& e);
  void enforce_resident_cap();
  bool evict_one_resident();
  void close_write(Entry& e);
  void detach_follower(Record& follower);
  void lose_filling(Entry& e, S follower_state, bool notify);
  void finish_write(Record& r, bool ok, const std::string& reason, bool* became_ready);
  void publish(ReservationEvent event);
  void publish_ready(const Record& r);
  void terminate_writer(Record& r, S to, bool notify_followers);
  Record& new_record(const ReserveRequest& req, bool writer, std::uint64_t entry_id, S state);
  void expire_locked();
  SlotLease make_lease(Entry& e);

  ReservationOptions options_;
  std::shared_ptr<const Clock> clock_;
  pool::OffsetAllocator allocator_;
  std::shared_ptr<spdlog::logger> log_;

  mutable std::mutex mu_;
  std::condition_variable writers_cv_;
  std::unordered_map<std::string, Record> records_;
  std::unordered_map<std::uint64_t, Entry> entries_;
  std::unordered_map<std::string, std::uint64_t> filling_by_hash_;   // mm_hash -> entry being filled
  std::unordered_map<std::string, std::uint64_t> resident_by_hash_;  // mm_hash -> canonical landed entry
  std::list<std::uint64_t> lru_;                                     // idle canonical entries, oldest first
  DeadlineIndex deadlines_;                                          // live records with a deadline
  DeadlineIndex tombstones_;                                         // terminal records
  std::deque<ReservationEvent> events_;
  std::deque<std::string> reclaimed_;
  std::uint64_t next_entry_id_ = 1;
  std::uint64_t next_generation_ = 1;
  std::uint64_t open_writes_ = 0;
  std::uint64_t resident_bytes_ = 0;
  std::uint64_t leases_ = 0;
  std::uint64_t state_counts_[kReservationStateCount][2] = {};
  bool shutting_down_ = false;
  ReservationCounters counters_;

  // Reserves the full pool turned away, by transfer id, oldest first (the order may
  // hold ids since served; they are skipped). See ReservationOptions::starvation_after.
  struct Waiter {
    std::uint64_t nbytes = 0;
    TimePoint first_refused;
    TimePoint last_seen;
  };
  static constexpr std::size_t kMaxWaiters = 4'096;
  std::unordered_map<std::string, Waiter> waiters_;
  std::deque<std::string> waiter_order_;
  void note_waiter(const std::string& tid, std::uint64_t nbytes, TimePoint t);
  const Waiter* starving_waiter(TimePoint t, std::string_view asking);
};

// ---------------------------------------------------------------- bookkeeping

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
    if (r.writer && r.entry != 0) {
      Entry& e = entry(r.entry);
      if (e.content == Entry::Content::filling && e.writer == r.transfer_id) lose_filling(e, S::failed, true);
    }
    if (r.entry != 0 && !r.writer) {
      Entry& e = entry(r.entry);
      if (e.content == Entry::Content::filling) std::erase(e.followers, r.transfer_id);
    }
    entomb(r);
  }
  return false;
}

void ReservationCore::arm_deadline(Record& r, TimePoint when) {
  disarm_deadline(r);
  r.deadline = deadlines_.emplace(when, r.transfer_id);
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
  disarm_deadline(r);
  if (r.entry != 0) {
    const std::uint64_t id = r.entry;
    r.entry = 0;
    release_ref(id);
  }
  drop_tombstone(r);
  r.tombstone = tombstones_.emplace(now() + options_.ttl, r.transfer_id);
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
  if (r.entry != 0) {
    const std::uint64_t id = r.entry;
    r.entry = 0;
    release_ref(id);
  }
  count_state(r, -1);
  records_.erase(it);
}

void ReservationCore::release_ref(std::uint64_t entry_id) {
  Entry& e = entry(entry_id);
  --e.holders;
  maybe_release(e);
}

void ReservationCore::maybe_release(Entry& e) {
  if (e.holders != 0 || e.write_open) return;
  if (e.content == Entry::Content::landed && e.canonical) {
    if (!e.in_lru) {
      e.lru_it = lru_.insert(lru_.end(), e.id);
      e.in_lru = true;
    }
    enforce_resident_cap();
    return;
  }
  free_entry(e);
}

void ReservationCore::free_entry(Entry& e) {
  if (e.in_lru) {
    lru_.erase(e.lru_it);
    e.in_lru = false;
  }
  if (e.canonical) {
    resident_bytes_ -= e.slot.size;
    resident_by_hash_.erase(e.mm_hash);
    e.canonical = false;
  }
  if (auto it = filling_by_hash_.find(e.mm_hash); it != filling_by_hash_.end() && it->second == e.id) {
    filling_by_hash_.erase(it);
  }
  if (Status st = allocator_.free(e.slot); !st.is_ok()) {
    log_->error("freeing slot offset={} size={} failed: {}", e.slot.offset, e.slot.size, st.to_string());
  }
  const std::uint64_t id = e.id;
  entries_.erase(id);
}

void ReservationCore::make_canonical(Entry& e) {
  if (auto it = resident_by_hash_.find(e.mm_hash); it != resident_by_hash_.end() && it->second != e.id) {
    // A newer landing of the same content replaces the resident copy; the old one is
    // freed once nothing holds it.
    Entry& old = entry(it->second);
    old.canonical = false;
    resident_bytes_ -= old.slot.size;
    resident_by_hash_.erase(it);
    if (old.in_lru) {
      lru_.erase(old.lru_it);
      old.in_lru = false;
    }
    maybe_release(old);
  }
  if (!e.canonical) {
    e.canonical = true;
    resident_bytes_ += e.slot.size;
    resident_by_hash_[e.mm_hash] = e.id;
  }
}

void ReservationCore::enforce_resident_cap() {
  while (resident_bytes_ > options_.resident_capacity_bytes && evict_one_resident()) {
  }
}

bool ReservationCore::evict_one_resident() {
  if (lru_.empty()) return false;
  Entry& e = entry(lru_.front());
  ++counters_.residents_reclaimed;
  if (reclaimed_.size() >= options_.event_queue_max) reclaimed_.pop_front();
  reclaimed_.push_back(e.mm_hash);
  free_entry(e);
  return true;
}

void ReservationCore::close_write(Entry& e) {
  if (!e.write_open) return;
  e.write_open = false;
  --open_writes_;
  writers_cv_.notify_all();
}

void ReservationCore::detach_follower(Record& f) {
  if (f.entry == 0) return;
  Entry& e = entry(f.entry);
  if (e.content == Entry::Content::filling) std::erase(e.followers, f.transfer_id);
}

// The landing a filling entry waited for will never happen: its followers end in
// `follower_state` (with an abandoned or failed event when notify) and the entry
// stops accepting followers.
void ReservationCore::lose_filling(Entry& e, S follower_state, bool notify) {
  if (auto it = filling_by_hash_.find(e.mm_hash); it != filling_by_hash_.end() && it->second == e.id) {
    filling_by_hash_.erase(it);
  }
  e.content = Entry::Content::dead;
  std::vector<std::string> followers = std::move(e.followers);
  e.followers.clear();
  for (const std::string& tid : followers) {
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

// A writer that has not landed goes terminal: its followers lose their landing.
void ReservationCore::terminate_writer(Record& r, S to, bool notify_followers) {
  if (r.entry != 0) {
    Entry& e = entry(r.entry);
    if (e.content == Entry::Content::filling && e.writer == r.transfer_id) {
      lose_filling(e, to == S::expired ? S::expired : S::cancelled, notify_followers);
    }
  }
  if (transition(r, to)) entomb(r);
}

Record& ReservationCore::new_record(const ReserveRequest& req, bool writer, std::uint64_t entry_id, S state) {
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
  const Duration gone_after = std::max<Duration>(std::chrono::seconds(1), options_.retry_after * 20);
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
  ReserveOutcome result = reserve_locked(req);
  // Served (or refused for good) one way or another: no longer waiting for space.
  if (!waiters_.empty() && !std::holds_alternative<outcome::RetryAfter>(result)) waiters_.erase(req.transfer_id);
  return result;
}

ReserveOutcome ReservationCore::reserve_locked(const ReserveRequest& req) {
  expire_locked();
  auto refuse = [this](Status st) {
    ++counters_.reserve_refused;
    return ReserveOutcome{outcome::Refused{std::move(st)}};
  };
  if (shutting_down_) return refuse(unavailable("consumer reservation manager is shutting down"));
  if (Status st = validate_transfer_id(req.transfer_id); !st.is_ok()) return refuse(st);
  if (Status st = validate_mm_hash(req.mm_hash); !st.is_ok()) return refuse(st);
  const std::uint64_t nbytes = req.spec.nbytes();
  if (nbytes > options_.max_tensor_bytes) {
    return refuse(invalid_argument(fmt::format("transfer_id={} needs {} bytes; at most {} fit this pool",
                                               req.transfer_id, nbytes, options_.max_tensor_bytes)));
  }

  if (Record* r = find(req.transfer_id)) {
    switch (r->state) {
      case S::cancelled:
      case S::cancel_pending:
        ++counters_.reserve_cancelled;
        return outcome::Cancelled{};
      case S::failed:
        return refuse(unavailable(fmt::format("transfer_id={} failed on this consumer", req.transfer_id)));
      case S::expire_pending:
        return refuse(
            conflict(fmt::format("transfer_id={} still has an active writer; abandon it first", req.transfer_id)));
      case S::expired:
        erase_record(req.transfer_id);  // a fresh reservation replaces the expired one
        break;
      case S::writing:
      case S::landing:
      case S::ready: {
        if (r->mm_hash != req.mm_hash || !r->spec || *r->spec != req.spec) {
          return refuse(conflict(fmt::format("conflicting reservation for transfer_id={}: it holds mm_hash={} {}",
                                             req.transfer_id, r->mm_hash, r->spec ? r->spec->to_string() : "")));
        }
        if (r->state == S::ready) {
          ++counters_.ready_repeat;
          return outcome::Ready{r->reservation_id, r->generation, false};
        }
        ++counters_.reserved_repeat;
        if (r->state == S::writing) arm_deadline(*r, now() + options_.ttl);
        const Entry& e = entry(r->entry);
        return outcome::Reserved{r->reservation_id, r->generation, e.slot.offset, nbytes,
                                 r->writer && r->state == S::writing};
      }
    }
  }

  // Content already resident: lease it, no write.
  if (auto it = resident_by_hash_.find(req.mm_hash); it != resident_by_hash_.end()) {
    Entry& e = entry(it->second);
    if (e.spec != req.spec) {
      return refuse(conflict(fmt::format("conflicting cached tensor for mm_hash={}: resident {} , requested {}",
                                         req.mm_hash, e.spec.to_string(), req.spec.to_string())));
    }
    if (e.in_lru) {
      lru_.erase(e.lru_it);
      e.in_lru = false;
    }
    ++e.holders;
    Record& r = new_record(req, false, e.id, S::ready);
    ++counters_.resident_hits;
    publish_ready(r);
    return outcome::Ready{r.reservation_id, r.generation, true};
  }

  // The same content is already on its way: follow that landing.
  if (auto it = filling_by_hash_.find(req.mm_hash); it != filling_by_hash_.end()) {
    Entry& e = entry(it->second);
    if (e.spec != req.spec) {
      return refuse(conflict(fmt::format("conflicting in-flight tensor for mm_hash={}: writing {}, requested {}",
                                         req.mm_hash, e.spec.to_string(), req.spec.to_string())));
    }
    ++e.holders;
    e.followers.push_back(req.transfer_id);
    Record& r = new_record(req, false, e.id, S::writing);
    ++counters_.reserved_follower;
    return outcome::Reserved{r.reservation_id, r.generation, e.slot.offset, nbytes, false};
  }

  const TimePoint t = now();
  if (const Waiter* older = starving_waiter(t, req.transfer_id);
      older != nullptr && allocator_.stats().largest_free_block < older->nbytes + nbytes) {
    // What frees up goes to the reserve that has waited longest.
    ++counters_.retry_afters;
    ++counters_.retry_afters_for_older;
    note_waiter(req.transfer_id, nbytes, t);
    return outcome::RetryAfter{options_.retry_after};
  }
  Result<pool::Slot> slot = allocator_.allocate(nbytes);
  while (!slot.is_ok() && slot.status().code() == StatusCode::resource_exhausted && evict_one_resident()) {
    slot = allocator_.allocate(nbytes);
  }
  if (!slot.is_ok()) {
    if (slot.status().code() == StatusCode::resource_exhausted) {
      ++counters_.retry_afters;
      note_waiter(req.transfer_id, nbytes, t);
      return outcome::RetryAfter{options_.retry_after};
    }
    return refuse(slot.status());
  }

  const std::uint64_t id = next_entry_id_++;
  Entry& e = entries_.try_emplace(id, id, *slot, req.mm_hash, req.spec).first->second;
  e.holders = 1;
  e.writer = req.transfer_id;
  e.expected_checksum = req.checksum;
  if (options_.mode == LandingMode::one_sided) {
    e.write_open = true;  // the producer may write from the moment it knows the slot
    ++open_writes_;
  }
  filling_by_hash_[req.mm_hash] = id;
  Record& r = new_record(req, true, id, S::writing);
  ++counters_.reserved_writer;
  counters_.bytes_reserved += nbytes;
  return outcome::Reserved{r.reservation_id, r.generation, e.slot.offset, nbytes, true};
}

// ---------------------------------------------------------------- cancel

CancelOutcome ReservationCore::cancel(const CancelRequest& req) {
  std::lock_guard lock(mu_);
  expire_locked();
  const bool one_sided = options_.mode == LandingMode::one_sided;
  auto result = [this](CancelOutcome o) {
    if (o == CancelOutcome::rejected) {
      ++counters_.cancels_rejected;
    } else {
      ++counters_.cancels_accepted;
      if (o == CancelOutcome::deferred) ++counters_.cancels_deferred;
      if (o == CancelOutcome::pre_reserved) ++counters_.pre_reserved_tombstones;
    }
    return o;
  };

  Record* r = find(req.transfer_id);
  if (r == nullptr) {
    // A refresh of something unknown has nothing to release; a tombstone would refuse
    // the re-reserve that follows it.
    if (req.refresh) return result(req.abandon ? CancelOutcome::refreshed : CancelOutcome::rejected);
    if (!validate_transfer_id(req.transfer_id).is_ok()) return result(CancelOutcome::rejected);
    Record t;
    t.transfer_id = req.transfer_id;
    t.state = S::cancelled;
    auto [it, inserted] = records_.emplace(req.transfer_id, std::move(t));
    (void)inserted;
    count_state(it->second, +1);
    entomb(it->second);
    return result(CancelOutcome::pre_reserved);
  }
  if (!req.reservation_id.is_none() && !r->reservation_id.is_none() && req.reservation_id != r->reservation_id) {
    return result(CancelOutcome::rejected);  // a stale cancel must not touch a newer reservation
  }

  switch (r->state) {
    case S::cancelled:
      entomb(*r);  // refresh the tombstone's deadline
      return result(CancelOutcome::already_cancelled);
    case S::failed:
      return result(CancelOutcome::already_terminal);
    case S::expired:
      if (req.refresh) return result(CancelOutcome::refreshed);
      if (transition(*r, S::cancelled)) entomb(*r);
      return result(CancelOutcome::already_terminal);
    default:
      break;
  }

  Entry* e = r->entry != 0 ? &entry(r->entry) : nullptr;
  const bool write_open = r->writer && e != nullptr && e->write_open;

  if (req.refresh) {
    if (!req.abandon) return result(CancelOutcome::rejected);
    if (!r->writer) {
      if (r->state != S::writing) return result(CancelOutcome::rejected);
      detach_follower(*r);
      if (transition(*r, S::expired)) entomb(*r);
      return result(CancelOutcome::refreshed);
    }
    if (r->state == S::writing || r->state == S::expire_pending) {
      if (write_open && !one_sided) {
        return result(CancelOutcome::deferred);  // the payload is landing right now
      }
      if (write_open) close_write(*e);  // the one-sided writer says it stopped
      terminate_writer(*r, S::expired, true);
      return result(CancelOutcome::refreshed);
    }
    if (r->state == S::landing) {
      transition(*r, S::expire_pending);
      return result(CancelOutcome::deferred);
    }
    if (r->state == S::cancel_pending && (one_sided || !write_open)) {
      // The consumer cancelled while the writer still held the slot. The writer's
      // refresh is its abandon: refusing it would leave the slot deferred for good
      // (the re-reserve that follows is told the transfer is cancelled, so nothing
      // else would ever settle it).
      if (write_open) close_write(*e);
      publish(AbandonedEvent{r->transfer_id, r->mm_hash});
      terminate_writer(*r, S::cancelled, true);
      return result(CancelOutcome::cancelled);
    }
    return result(CancelOutcome::rejected);
  }

  if (!r->writer) {
    // A follower or a READY record: nothing writes on its behalf, release now.
    if (r->state == S::writing) {
      detach_follower(*r);
      if (req.abandon) publish(AbandonedEvent{r->transfer_id, r->mm_hash});
    }
    if (transition(*r, S::cancelled)) entomb(*r);
    return result(CancelOutcome::cancelled);
  }

  switch (r->state) {
    case S::ready:
      if (transition(*r, S::cancelled)) entomb(*r);
      return result(CancelOutcome::cancelled);
    case S::writing:
      if (req.abandon) {
        if (write_open) close_write(*e);  // one-sided writer stopped
        publish(AbandonedEvent{r->transfer_id, r->mm_hash});
        terminate_writer(*r, S::cancelled, true);
        return result(CancelOutcome::cancelled);
      }
      // Consumer-side cancel. Defer while the producer may write (one-sided), or
      // while followers still wait for this landing (receiver-chosen).
      if (write_open || !e->followers.empty()) {
        transition(*r, S::cancel_pending);
        if (write_open) disarm_deadline(*r);
        return result(CancelOutcome::deferred);
      }
      terminate_writer(*r, S::cancelled, false);
      return result(CancelOutcome::cancelled);
    case S::landing:
      if (req.abandon) publish(AbandonedEvent{r->transfer_id, r->mm_hash});
      transition(*r, S::cancel_pending);
      return result(CancelOutcome::deferred);
    case S::cancel_pending:
    case S::expire_pending:
      if (req.abandon && (one_sided || !write_open)) {
        if (write_open) close_write(*e);
        publish(AbandonedEvent{r->transfer_id, r->mm_hash});
        terminate_writer(*r, r->state == S::expire_pending ? S::expired : S::cancelled, true);
        return result(CancelOutcome::cancelled);
      }
      if (r->state == S::expire_pending && !req.abandon) transition(*r, S::cancel_pending);
      return result(CancelOutcome::deferred);
    default:
      return result(CancelOutcome::rejected);
  }
}

// ---------------------------------------------------------------- landing

LandingResolution ReservationCore::resolve_landing(std::string_view tid, const ReservationId& rid, std::uint64_t nbytes,
                                                   std::uint64_t generation) {
  std::lock_guard lock(mu_);
  auto refuse = [this](LandingRefusal why) {
    ++counters_.landings_refused;
    return LandingResolution{std::nullopt, why};
  };
  Record* r = find(tid);
  if (r == nullptr) return refuse(LandingRefusal::unknown_transfer);
  if (is_terminal(r->state)) return refuse(LandingRefusal::not_awaiting_payload);
  if (r->reservation_id != rid || (generation != 0 && generation != r->generation)) {
    return refuse(LandingRefusal::stale_reservation);
  }
  if (!r->writer) return refuse(LandingRefusal::not_writer);
  Entry& e = entry(r->entry);
  if (options_.mode != LandingMode::receiver_chosen || e.write_open || r->finishing ||
      (r->state != S::writing && r->state != S::cancel_pending)) {
    return refuse(LandingRefusal::not_awaiting_payload);
  }
  if (nbytes != r->spec->nbytes()) return refuse(LandingRefusal::size_mismatch);
  e.write_open = true;
  ++open_writes_;
  if (r->state == S::writing) transition(*r, S::landing);
  disarm_deadline(*r);  // a landing cannot be timed out from here: only its completion ends it
  ++counters_.landings_accepted;
  return LandingResolution{LandingTarget{options_.slab_base + e.slot.offset, nbytes, r->generation},
                           LandingRefusal::none};
}

CompletionOutcome ReservationCore::complete_write(std::string_view tid, const ReservationId& rid, bool ok,
                                                  std::optional<std::uint64_t> checksum, bool one_sided_call,
                                                  std::optional<std::uint64_t> generation) {
  std::unique_lock lock(mu_);
  auto reject = [this] {
    ++counters_.completions_rejected;
    return CompletionOutcome::rejected;
  };
  auto accepts = [&](const Record& rec) {
    if (rec.reservation_id != rid || !rec.writer || rec.entry == 0 || rec.finishing) return false;
    if (generation && *generation != rec.generation) return false;
    if (!entry(rec.entry).write_open) return false;
    const bool mode_ok = one_sided_call == (options_.mode == LandingMode::one_sided);
    const S first = one_sided_call ? S::writing : S::landing;
    return mode_ok && (rec.state == first || rec.state == S::cancel_pending || rec.state == S::expire_pending);
  };
  Record* r = find(tid);
  // A one-sided producer repeating its completion, or completing a follower it never
  // wrote, must not fail its whole batch: both are accepted no-ops.
  if (one_sided_call && r != nullptr && r->reservation_id == rid && (!generation || *generation == r->generation) &&
      (r->state == S::ready || !r->writer) && !is_terminal(r->state)) {
    return CompletionOutcome::repeated;
  }
  if (r == nullptr || !accepts(*r)) return reject();

  std::string reason = ok ? "" : "the payload did not arrive completely";
  if (ok && options_.checksum) {
    const Entry& e = entry(r->entry);
    const std::optional<std::uint64_t> expected = checksum ? checksum : e.expected_checksum;
    if (!expected) {
      ok = false;
      reason = "checksums are on but the producer sent none";
    } else {
      // Hash outside the lock: the slot cannot be freed or reused while its write is
      // open, and `finishing` keeps a second completion out.
      r->finishing = true;
      const std::byte* data = options_.slab_base + e.slot.offset;
      const std::uint64_t length = r->spec->nbytes();
      const std::string key(tid);
      lock.unlock();
      const std::uint64_t actual = XXH64(data, length, 0);
      lock.lock();
      r = find(key);
      if (r == nullptr) return reject();  // unreachable: records with an open write are never erased
      r->finishing = false;
      if (actual != *expected) {
        ok = false;
        ++counters_.checksum_mismatches;
        reason = fmt::format("checksum mismatch: landed xxh64={:016x}, producer sent {:016x}", actual, *expected);
        log_->warn("transfer_id={} mm_hash={}: {}", r->transfer_id, r->mm_hash, reason);
      }
    }
  }
  bool became_ready = false;
  const bool landed = ok;
  finish_write(*r, ok, reason, &became_ready);
  if (!landed) return CompletionOutcome::failed;
  return became_ready ? CompletionOutcome::became_ready : CompletionOutcome::released;
}

void ReservationCore::finish_write(Record& r, bool ok, const std::string& reason, bool* became_ready) {
  const std::uint64_t entry_id = r.entry;
  Entry& e = entry(entry_id);
  close_write(e);
  if (ok) {
    counters_.bytes_landed += r.spec->nbytes();
    ++counters_.landings_ready;
    if (auto it = filling_by_hash_.find(e.mm_hash); it != filling_by_hash_.end() && it->second == e.id) {
      filling_by_hash_.erase(it);
    }
    e.content = Entry::Content::landed;
    make_canonical(e);
    std::vector<std::string> followers = std::move(e.followers);
    e.followers.clear();
    for (const std::string& tid : followers) {
      Record* f = find(tid);
      if (f == nullptr || f->state != S::writing) continue;
      if (transition(*f, S::ready)) {
        arm_deadline(*f, now() + options_.ttl);
        publish_ready(*f);
      }
    }
    if (r.state == S::landing || r.state == S::writing) {
      if (transition(r, S::ready)) {
        arm_deadline(r, now() + options_.ttl);
        publish_ready(r);
        *became_ready = true;
      }
    } else {
      // Cancelled or expired while the payload was landing: the transfer ends now,
      // the landed content stays resident for its followers and later reserves.
      if (transition(r, r.state == S::expire_pending ? S::expired : S::cancelled)) entomb(r);
    }
    // entomb() above may already have released (or even reclaimed) the entry.
    if (auto it = entries_.find(entry_id); it != entries_.end()) maybe_release(it->second);
    return;
  }
  ++counters_.landings_failed;
  lose_filling(e, S::failed, true);
  if (r.state == S::landing || r.state == S::writing) {
    if (transition(r, S::failed)) {
      publish(FailedEvent{r.transfer_id, r.mm_hash, reason});
      entomb(r);
    }
  } else if (transition(r, r.state == S::expire_pending ? S::expired : S::cancelled)) {
    entomb(r);
  }
}

// ---------------------------------------------------------------- take

SlotLease ReservationCore::make_lease(Entry& e) {
  ++e.leases;
  ++leases_;
  ++counters_.taken;
  return SlotLease(shared_from_this(), e.id, options_.slab_base + e.slot.offset, e.slot.offset, e.spec, e.mm_hash);
}

Result<SlotLease> ReservationCore::take(std::string_view tid, std::string_view mm_hash) {
  std::lock_guard lock(mu_);
  Record* r = find(tid);
  if (r == nullptr || r->state != S::ready || r->mm_hash != mm_hash || r->entry == 0) {
    ++counters_.takes_refused;
    return not_found(fmt::format("pushed tensor is not ready for transfer_id={} mm_hash={} ({})", tid, mm_hash,
                                 r == nullptr ? "unknown" : reservation_state_name(r->state)));
  }
  Entry& e = entry(r->entry);
  ++e.holders;  // the lease's hold, before the record lets go of its own
  SlotLease lease = make_lease(e);
  const std::string key(tid);
  erase_record(key);
  return lease;
}

Result<SlotLease> ReservationCore::take_resident(std::string_view mm_hash, const TensorSpec& spec) {
  std::lock_guard lock(mu_);
  auto it = resident_by_hash_.find(std::string(mm_hash));
  if (it == resident_by_hash_.end()) {
    ++counters_.takes_refused;
    return not_found(fmt::format("no resident copy of mm_hash={}", mm_hash));
  }
  Entry& e = entry(it->second);
  if (e.spec != spec) {
    ++counters_.takes_refused;
    return conflict(fmt::format("resident mm_hash={} is {}, not {}", mm_hash, e.spec.to_string(), spec.to_string()));
  }
  if (e.in_lru) {
    lru_.erase(e.lru_it);
    e.in_lru = false;
  }
  ++e.holders;
  return make_lease(e);
}

void ReservationCore::release_lease(std::uint64_t entry_id) noexcept {
  std::lock_guard lock(mu_);
  auto it = entries_.find(entry_id);
  if (it == entries_.end()) return;
  --it->second.leases;
  --leases_;
  release_ref(entry_id);
}

// ---------------------------------------------------------------- expiry

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
    const bool write_open = r->writer && r->entry != 0 && entry(r->entry).write_open;
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

// ---------------------------------------------------------------- events, shutdown

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
  std::vector<std::string> out(std::make_move_iterator(reclaimed_.begin()), std::make_move_iterator(reclaimed_.end()));
  reclaimed_.clear();
  return out;
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
    const bool write_open = r->entry != 0 && entry(r->entry).write_open;
    if (write_open) {
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
  writers_cv_.wait_for(lock, timeout, [this] { return open_writes_ == 0; });
  DrainReport report;
  report.writers_remaining = open_writes_;
  report.writers_finished = open_writes_ == 0;
  report.leases_outstanding = leases_;
  if (!report.writers_finished) {
    log_->error("timed out waiting for {} writer(s); keeping the consumer receive pool registered", open_writes_);
  }
  return report;
}

ReservationCounters ReservationCore::counters() const {
  std::lock_guard lock(mu_);
  ReservationCounters c = counters_;
  auto count = [this](S s, int writer) { return state_counts_[state_index(s)][writer]; };
  c.pool_used_bytes = allocator_.used_bytes();
  c.writers = count(S::writing, 1) + count(S::landing, 1) + count(S::cancel_pending, 1) + count(S::expire_pending, 1);
  c.followers = count(S::writing, 0);
  c.ready = count(S::ready, 0) + count(S::ready, 1);
  c.deferred = count(S::cancel_pending, 1) + count(S::expire_pending, 1);
  c.tombstones = tombstones_.size();
  c.live_records = records_.size() - tombstones_.size();
  c.resident_entries = resident_by_hash_.size();
  c.resident_bytes = resident_bytes_;
  c.leases = leases_;
  c.pending_events = events_.size();
  return c;
}

std::optional<S> ReservationCore::state_of(std::string_view tid) const {
  std::lock_guard lock(mu_);
  auto it = records_.find(std::string(tid));
  if (it == records_.end()) return std::nullopt;
  return it->second.state;
}

std::optional<ReservationManager::RecordView> ReservationCore::describe(std::string_view tid) const {
  std::lock_guard lock(mu_);
  auto it = records_.find(std::string(tid));
  if (it == records_.end()) return std::nullopt;
  const Record& r = it->second;
  return ReservationManager::RecordView{r.state, r.mm_hash, r.reservation_id, r.generation, r.spec};
}

Status ReservationCore::check_invariants() const {
  std::lock_guard lock(mu_);
  auto fail = [](std::string what) { return internal_error(std::move(what)); };
  std::uint64_t slot_bytes = 0;
  std::vector<pool::Slot> slots;
  std::unordered_map<std::uint64_t, std::uint64_t> record_refs;
  std::uint64_t open = 0;
  for (const auto& [id, e] : entries_) {
    slot_bytes += e.slot.size;
    slots.push_back(e.slot);
    if (e.write_open) ++open;
    if (e.holders == 0 && !e.write_open && !(e.canonical && e.content == Entry::Content::landed && e.in_lru)) {
      return fail(fmt::format("entry {} (mm_hash={}) is held by nothing yet not resident", id, e.mm_hash));
    }
    if (e.in_lru && e.holders != 0) return fail(fmt::format("entry {} is in the LRU while held", id));
  }
  if (slot_bytes != allocator_.used_bytes()) {
    return fail(fmt::format("pool used {} bytes, slots account for {}", allocator_.used_bytes(), slot_bytes));
  }
  if (open != open_writes_) return fail(fmt::format("{} open writes counted, {} found", open_writes_, open));
  std::sort(slots.begin(), slots.end(), [](const pool::Slot& a, const pool::Slot& b) { return a.offset < b.offset; });
  for (std::size_t i = 1; i < slots.size(); ++i) {
    if (slots[i - 1].offset + slots[i - 1].size > slots[i].offset) {
      return fail(fmt::format("slots at {} and {} overlap", slots[i - 1].offset, slots[i].offset));
    }
  }
  std::uint64_t tombstones = 0;
  std::uint64_t with_deadline = 0;
  for (const auto& [tid, r] : records_) {
    if (is_terminal(r.state)) {
      ++tombstones;
      if (!r.tombstone || r.entry != 0 || r.deadline) return fail(fmt::format("tombstone {} is malformed", tid));
      continue;
    }
    if (r.tombstone) return fail(fmt::format("live record {} is in the tombstone index", tid));
    if (r.deadline) ++with_deadline;
    if (r.entry == 0 || !entries_.contains(r.entry)) return fail(fmt::format("live record {} holds no slot", tid));
    ++record_refs[r.entry];
    const Entry& e = entries_.at(r.entry);
    const bool deferred_write = e.write_open && r.writer;
    if (!r.deadline && !deferred_write)
      return fail(fmt::format("record {} ({}) can never expire", tid, reservation_state_name(r.state)));
  }
  if (tombstones != tombstones_.size()) return fail("tombstone index out of step");
  if (tombstones_.size() > options_.tombstone_max) return fail("more tombstones than tombstone_max");
  if (with_deadline != deadlines_.size()) return fail("deadline index out of step");
  std::uint64_t leases = 0;
  for (const auto& [id, e] : entries_) {
    const std::uint64_t refs = record_refs.contains(id) ? record_refs.at(id) : 0;
    if (e.holders != refs + e.leases) {
      return fail(fmt::format("entry {} has {} holders; {} records and {} leases", id, e.holders, refs, e.leases));
    }
    leases += e.leases;
  }
  if (leases != leases_) return fail("lease count out of step");
  return Status::ok();
}

}  // namespace detail

// ---------------------------------------------------------------- SlotLease

SlotLease::SlotLease(std::shared_ptr<detail::ReservationCore> core, std::uint64_t entry_id, std::byte* data,
                     std::uint64_t offset, TensorSpec spec, std::string mm_hash)
    : core_(std::move(core)),
      entry_id_(entry_id),
      data_(data),
      offset_(offset),
      spec_(std::move(spec)),
      mm_hash_(std::move(mm_hash)) {}

SlotLease::SlotLease(SlotLease&& other) noexcept
    : core_(std::move(other.core_)),
      entry_id_(other.entry_id_),
      data_(other.data_),
      offset_(other.offset_),
      spec_(std::move(other.spec_)),
      mm_hash_(std::move(other.mm_hash_)) {
  other.core_.reset();
  other.data_ = nullptr;
}

SlotLease& SlotLease::operator=(SlotLease&& other) noexcept {
  if (this != &other) {
    release();
    core_ = std::move(other.core_);
    entry_id_ = other.entry_id_;
    data_ = other.data_;
    offset_ = other.offset_;
    spec_ = std::move(other.spec_);
    mm_hash_ = std::move(other.mm_hash_);
    other.core_.reset();
    other.data_ = nullptr;
  }
  return *this;
}

SlotLease::~SlotLease() { release(); }

void SlotLease::release() noexcept {
  if (!core_) return;
  core_->release_lease(entry_id_);
  core_.reset();
  data_ = nullptr;
}

// ---------------------------------------------------------------- ReservationManager

ReservationManager::ReservationManager(ReservationOptions options, std::shared_ptr<const Clock> clock)
    : core_(std::make_shared<detail::ReservationCore>(options, std::move(clock))) {}

ReservationManager::~ReservationManager() = default;

ReserveOutcome ReservationManager::reserve(const ReserveRequest& request) { return core_->reserve(request); }
CancelOutcome ReservationManager::cancel(const CancelRequest& request) { return core_->cancel(request); }

LandingResolution ReservationManager::resolve_landing(std::string_view transfer_id, const ReservationId& reservation_id,
                                                      std::uint64_t nbytes, std::uint64_t generation) {
  return core_->resolve_landing(transfer_id, reservation_id, nbytes, generation);
}

CompletionOutcome ReservationManager::complete_landing(std::string_view transfer_id,
                                                       const ReservationId& reservation_id, bool ok,
                                                       std::optional<std::uint64_t> checksum) {
  return core_->complete_write(transfer_id, reservation_id, ok, checksum, false);
}

CompletionOutcome ReservationManager::writer_completed(std::string_view transfer_id,
                                                       const ReservationId& reservation_id,
                                                       std::optional<std::uint64_t> checksum,
                                                       std::optional<std::uint64_t> generation) {
  return core_->complete_write(transfer_id, reservation_id, true, checksum, true, generation);
}

CancelOutcome ReservationManager::writer_abandoned(std::string_view transfer_id, const ReservationId& reservation_id) {
  return core_->cancel(CancelRequest{std::string(transfer_id), reservation_id, true, false});
}

Result<SlotLease> ReservationManager::take(std::string_view transfer_id, std::string_view mm_hash) {
  return core_->take(transfer_id, mm_hash);
}

Result<SlotLease> ReservationManager::take_resident(std::string_view mm_hash, const TensorSpec& spec) {
  return core_->take_resident(mm_hash, spec);
}

void ReservationManager::expire() { core_->expire(); }
std::vector<ReservationEvent> ReservationManager::drain_events(std::size_t max) { return core_->drain_events(max); }
std::vector<std::string> ReservationManager::drain_reclaimed() { return core_->drain_reclaimed(); }
void ReservationManager::begin_shutdown() { core_->begin_shutdown(); }
DrainReport ReservationManager::wait_for_writers(Duration timeout) { return core_->wait_for_writers(timeout); }
ReservationCounters ReservationManager::counters() const { return core_->counters(); }
std::optional<ReservationState> ReservationManager::state_of(std::string_view transfer_id) const {
  return core_->state_of(transfer_id);
}
std::optional<ReservationManager::RecordView> ReservationManager::describe(std::string_view transfer_id) const {
  return core_->describe(transfer_id);
}
Status ReservationManager::check_invariants() const { return core_->check_invariants(); }

}  // namespace ecx::consumer
