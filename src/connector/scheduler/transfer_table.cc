#include "ecx/connector/scheduler/transfer_table.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "core/logging.h"
#include "ecx/core/stages.h"
#include "ecx/core/transition_table.h"

namespace ecx::scheduler {
namespace {

using detail::ListHook;
using detail::RecordList;
using HookPtr = ListHook TransferRecord::*;

// Which ordering list a record sits in (TransferRecord::order_list_).
enum OrderList : unsigned char { kNoList = 0, kWaiting, kAvailable, kLoading, kResident, kTombstones };

const std::shared_ptr<spdlog::logger>& logger() {
  static const auto instance = ecx::log::get("scheduler");
  return instance;
}

constexpr std::array<std::string_view, kTransferStateCount> kStateNames = {
    "WAITING_EVENT", "AVAILABLE", "LOADING", "READY", "RESIDENT", "UNAVAILABLE", "EXPIRED", "FAILED", "CANCELLED"};

constexpr std::size_t idx(TransferState s) { return static_cast<std::size_t>(s); }

std::string_view shorten(std::string_view id) { return id.substr(0, 64); }

}  // namespace

// Intrusive doubly linked lists over TransferRecord hooks: O(1) append and unlink
// without any allocation.
struct ListOps {
  static void push_back(RecordList& list, TransferRecord& r, HookPtr hook) {
    (r.*hook).prev = list.tail;
    (r.*hook).next = nullptr;
    if (list.tail)
      (list.tail->*hook).next = &r;
    else
      list.head = &r;
    list.tail = &r;
    ++list.size;
  }
  static void insert_after(RecordList& list, TransferRecord* after, TransferRecord& r, HookPtr hook) {
    if (after == list.tail) return push_back(list, r, hook);
    TransferRecord* next = after ? (after->*hook).next : list.head;
    (r.*hook).prev = after;
    (r.*hook).next = next;
    (next->*hook).prev = &r;
    if (after)
      (after->*hook).next = &r;
    else
      list.head = &r;
    ++list.size;
  }
  static void unlink(RecordList& list, TransferRecord& r, HookPtr hook) {
    ListHook& h = r.*hook;
    if (h.prev)
      (h.prev->*hook).next = h.next;
    else
      list.head = h.next;
    if (h.next)
      (h.next->*hook).prev = h.prev;
    else
      list.tail = h.prev;
    h = ListHook{};
    --list.size;
  }
};

std::string_view transfer_state_name(TransferState state) noexcept {
  return idx(state) < kStateNames.size() ? kStateNames[idx(state)] : "?";
}

bool is_terminal(TransferState state) noexcept { return idx(state) >= kLiveStateCount; }

namespace {
using TS = TransferState;
constexpr TransitionTable<TS, kTransferStateCount> kTransitions{
    {TS::waiting_event, {TS::available, TS::unavailable, TS::cancelled}},
    {TS::available, {TS::loading, TS::expired, TS::cancelled}},
    {TS::loading, {TS::ready, TS::failed, TS::cancelled, TS::unavailable}},
    {TS::ready, {TS::resident, TS::expired}},
    {TS::resident, {TS::loading, TS::expired}},
    // Tombstones: only a cancel may still rename them; failed and cancelled are final.
    {TS::unavailable, {TS::cancelled}},
    {TS::expired, {TS::cancelled}},
};
}  // namespace

bool transition_allowed(TransferState from, TransferState to) noexcept { return kTransitions.allows(from, to); }

void TransferTable::HashIndex::set_key(std::string_view key) {
  key_size = static_cast<std::uint32_t>(key.size());
  if (key.size() <= kInlineKey) {
    std::copy(key.begin(), key.end(), inline_key.begin());
  } else {
    long_key.assign(key);
  }
}

TransferTable::TransferTable(TableLimits limits) : limits_(limits) {
  if (limits_.tombstone_max == 0) limits_.tombstone_max = 1;
}

TransferTable::~TransferTable() = default;

RecordList* TransferTable::order_list(unsigned char which) {
  switch (which) {
    case kWaiting:
      return &waiting_;
    case kAvailable:
      return &available_;
    case kLoading:
      return &loading_;
    case kResident:
      return &resident_;
    case kTombstones:
      return &tombstones_;
    default:
      return nullptr;
  }
}

const RecordList* TransferTable::order_list(unsigned char which) const {
  return const_cast<TransferTable*>(this)->order_list(which);
}

const TransferRecord* TransferTable::find(std::string_view transfer_id) const {
  return const_cast<TransferTable*>(this)->find_mutable(transfer_id);
}

TransferTable::KeyHashes TransferTable::hash_keys(std::string_view transfer_id, std::string_view mm_hash) const {
  const KeyHashes hashes{detail::key_hash(transfer_id), hash_of(mm_hash)};
  by_id_.prefetch(hashes.id);
  if (!mm_hash.empty()) by_hash_.prefetch(hashes.mm_hash);
  return hashes;
}

TransferRecord* TransferTable::find_mutable(std::string_view transfer_id) {
  return find_mutable(transfer_id, detail::key_hash(transfer_id));
}

TransferRecord* TransferTable::find_mutable(std::string_view transfer_id, std::uint64_t hash) {
  const std::uint32_t id = by_id_.find(hash, [&](std::uint32_t candidate) {
    const TransferRecord& r = records_[candidate];
    return r.id_hash_ == hash && r.transfer_id_ == transfer_id;
  });
  return id == detail::kNoId ? nullptr : &records_[id];
}

std::uint32_t TransferTable::find_hash_id(std::string_view mm_hash, std::uint64_t hash) const {
  return by_hash_.find(hash, [&](std::uint32_t candidate) {
    const HashIndex& entry = hash_entries_[candidate];
    return entry.hash == hash && entry.key() == mm_hash;
  });
}

const TransferTable::HashIndex* TransferTable::find_hash(std::string_view mm_hash) const {
  const std::uint32_t id = find_hash_id(mm_hash, detail::key_hash(mm_hash));
  return id == detail::kNoId ? nullptr : &hash_entries_[id];
}

TransferTable::HashStamp TransferTable::stamp(std::string_view mm_hash) const {
  const std::uint32_t id = find_hash_id(mm_hash, detail::key_hash(mm_hash));
  return id == detail::kNoId ? HashStamp{} : HashStamp{id, hash_entries_[id].changed};
}

bool TransferTable::unchanged(const HashStamp& stamp) const noexcept {
  if (stamp.entry == detail::kNoId) return false;
  // A freed entry keeps its storage (the pool never shrinks); a reused one has a
  // later count.
  const HashIndex& entry = hash_entries_[stamp.entry];
  return entry.in_use && entry.changed == stamp.changed;
}

TransferTable::RecordStamp TransferTable::record_stamp(const TransferRecord* record) const noexcept {
  return record == nullptr ? RecordStamp{} : RecordStamp{record->pool_id_, record->changed_};
}

bool TransferTable::unchanged(const RecordStamp& stamp, std::string_view transfer_id) const {
  if (stamp.record == detail::kNoId) return find(transfer_id) == nullptr;
  // A record dropped and its storage reused has a later count.
  const TransferRecord& r = records_[stamp.record];
  return r.in_use_ && r.changed_ == stamp.changed;
}

void TransferTable::touch_hash(std::string_view mm_hash) {
  const std::uint32_t id = find_hash_id(mm_hash, detail::key_hash(mm_hash));
  if (id != detail::kNoId) hash_entries_[id].changed = ++changes_;
}

const TransferRecord* TransferTable::oldest_in_state(std::string_view mm_hash, TransferState state) const {
  const HashIndex* entry = find_hash(mm_hash);
  return entry == nullptr || is_terminal(state) ? nullptr : entry->by_state[idx(state)].head;
}

bool TransferTable::has_state(std::string_view mm_hash, StateMask states) const {
  const HashIndex* entry = find_hash(mm_hash);
  if (entry == nullptr) return false;
  for (std::size_t s = 0; s < kLiveStateCount; ++s) {
    if ((entry->live_states >> s & 1u) != 0 && states.contains(static_cast<TransferState>(s))) return true;
  }
  return false;
}

TransferRecord& TransferTable::create(std::string_view transfer_id, KeyHashes hashes, std::string_view request_id,
                                      std::string_view mm_hash) {
  const std::uint32_t id = records_.acquire();
  TransferRecord& r = records_[id];
  // A reused record keeps its strings' and vectors' capacity (release reset the rest).
  r.pool_id_ = id;
  r.in_use_ = true;
  r.id_hash_ = hashes.id;
  r.transfer_id_.assign(transfer_id);
  r.request_id_.assign(request_id);
  r.mm_hash_.assign(mm_hash);
  r.mm_hash_hash_ = hashes.mm_hash;
  r.state_ = TransferState::waiting_event;
  r.sequence_ = next_sequence_++;
  r.changed_ = ++changes_;
  by_id_.insert(hashes.id, id);
  return r;
}

void TransferTable::attach_hash(TransferRecord& r) {
  if (r.hash_entry_ != detail::kNoId) return;
  r.hash_entry_ = find_hash_id(r.mm_hash_, r.mm_hash_hash_);
  if (r.hash_entry_ != detail::kNoId) return;
  const std::uint32_t id = hash_entries_.acquire();
  HashIndex& entry = hash_entries_[id];
  entry.hash = r.mm_hash_hash_;
  entry.set_key(r.mm_hash_);
  entry.live_states = 0;
  entry.in_use = true;
  entry.changed = ++changes_;
  by_hash_.insert(entry.hash, id);
  r.hash_entry_ = id;
}

void TransferTable::detach_hash(TransferRecord& r) {
  if (r.hash_entry_ == detail::kNoId) return;
  HashIndex& entry = hash_entries_[r.hash_entry_];
  if (entry.live_states == 0) {
    by_hash_.erase(entry.hash, r.hash_entry_);
    entry.in_use = false;
    hash_entries_.release(r.hash_entry_);
  }
  r.hash_entry_ = detail::kNoId;
}

void TransferTable::leave_state(TransferRecord& r) {
  r.changed_ = ++changes_;  // every change of state and every erasure passes here
  if (RecordList* list = order_list(r.order_list_)) ListOps::unlink(*list, r, &TransferRecord::order_hook_);
  r.order_list_ = kNoList;
  if (r.hash_entry_ != detail::kNoId) {
    HashIndex& entry = hash_entries_[r.hash_entry_];
    entry.changed = changes_;
    RecordList& list = entry.by_state[idx(r.state_)];
    ListOps::unlink(list, r, &TransferRecord::hash_hook_);
    if (list.size == 0) entry.live_states = static_cast<std::uint8_t>(entry.live_states & ~(1u << idx(r.state_)));
  }
  if (r.state_ == TransferState::resident && r.spec_) resident_bytes_ -= r.spec_->spec.nbytes();
}

void TransferTable::enter_state(TransferRecord& r, TimePoint now) {
  using S = TransferState;
  auto place_by_deadline = [&](RecordList& list, unsigned char which) {
    // Deadlines are now + a fixed duration from a monotonic clock, so the new one
    // is nearly always the latest: walk back only past later ones.
    TransferRecord* after = list.tail;
    while (after && after->deadline_ && r.deadline_ && *after->deadline_ > *r.deadline_) {
      after = after->order_hook_.prev;
    }
    ListOps::insert_after(list, after, r, &TransferRecord::order_hook_);
    r.order_list_ = which;
  };
  if (!is_terminal(r.state_) && !r.mm_hash_.empty()) {
    attach_hash(r);
    HashIndex& entry = hash_entries_[r.hash_entry_];
    entry.changed = ++changes_;
    ListOps::push_back(entry.by_state[idx(r.state_)], r, &TransferRecord::hash_hook_);
    entry.live_states = static_cast<std::uint8_t>(entry.live_states | 1u << idx(r.state_));
  } else {
    detach_hash(r);  // terminal: its hash forgets it
  }
  switch (r.state_) {
    case S::waiting_event:
      if (r.deadline_) place_by_deadline(waiting_, kWaiting);
      break;
    case S::available:
      place_by_deadline(available_, kAvailable);
      break;
    case S::loading:
      place_by_deadline(loading_, kLoading);
      break;
    case S::ready:
      r.deadline_.reset();
      break;
    case S::resident:
      r.deadline_.reset();
      ListOps::push_back(resident_, r, &TransferRecord::order_hook_);
      r.order_list_ = kResident;
      if (r.spec_) resident_bytes_ += r.spec_->spec.nbytes();
      break;
    case S::unavailable:
    case S::expired:
    case S::failed:
    case S::cancelled: {
      ++undoings_;
      r.deadline_ = now + limits_.reservation_ttl;
      r.queued_for_dispatch_ = false;
      notify_waiters(r);
      place_by_deadline(tombstones_, kTombstones);
      // The count bound holds at all times, not only after expire().
      while (tombstones_.size > limits_.tombstone_max) {
        TransferRecord* victim = tombstones_.head != &r ? tombstones_.head : r.order_hook_.next;
        ++stats_.tombstones_evicted;
        erase_record(*victim);
      }
      break;
    }
  }
}

bool TransferTable::transition(TransferRecord& r, TransferState to, TimePoint now) {
  if (!transition_allowed(r.state_, to)) {
    fail_invalid(r, to, now);
    return false;
  }
  leave_state(r);
  r.state_ = to;
  enter_state(r, now);
  return true;
}

void TransferTable::fail_invalid(TransferRecord& r, TransferState wanted, TimePoint now) {
  ++stats_.invalid_transitions;
  logger()->error(
      "EC transfer table: invalid transition {} -> {} for transfer_id={} (mm_hash={}); failing that transfer",
      transfer_state_name(r.state_), transfer_state_name(wanted), shorten(r.transfer_id_), shorten(r.mm_hash_));
  if (r.state_ == TransferState::failed) return;
  const std::string owner = r.load_owner_;
  leave_state(r);
  r.state_ = TransferState::failed;
  enter_state(r, now);
  notify(r, owner);
}

void TransferTable::notify(TransferRecord& r, std::string_view request_id) {
  if (request_id.empty()) return;
  if (std::find(r.notified_.begin(), r.notified_.end(), request_id) != r.notified_.end()) return;
  r.notified_.emplace_back(request_id);
  pending_unavailable_.emplace(request_id);
  logger()->info("EC request {} cannot obtain transfer_id={} (mm_hash={}): it is {}", shorten(request_id),
                 shorten(r.transfer_id_), shorten(r.mm_hash_), transfer_state_name(r.state_));
}

void TransferTable::notify_waiters(TransferRecord& r) {
  for (const auto& w : r.waiters_) notify(r, w);
  r.waiters_.clear();
}

void TransferTable::erase_record(TransferRecord& r) {
  leave_state(r);
  detach_hash(r);
  by_id_.erase(r.id_hash_, r.pool_id_);
  // Back to the pool: what a later record would not overwrite is reset here;
  // the strings and vectors keep their capacity for it.
  r.in_use_ = false;
  r.spec_.reset();
  r.deadline_.reset();
  r.waiters_.clear();
  r.notified_.clear();
  r.load_owner_.clear();
  r.invented_name_ = false;
  r.taken_ = false;
  r.queued_for_dispatch_ = false;
  records_.release(r.pool_id_);
}

const TransferRecord* TransferTable::wait_for_event(std::string_view transfer_id, std::string_view request_id,
                                                    std::string_view mm_hash, TimePoint now, TimePoint deadline,
                                                    bool invented_name) {
  // A request re-checked every step finds its record: no second hash for that.
  const std::uint64_t id_hash = detail::key_hash(transfer_id);
  TransferRecord* r = find_mutable(transfer_id, id_hash);
  if (r == nullptr) {
    r = &create(transfer_id, {id_hash, hash_of(mm_hash)}, request_id, mm_hash);
    r->deadline_ = deadline;
    r->invented_name_ = invented_name;
    r->waiters_.emplace_back(request_id);
    enter_state(*r, now);
    return r;
  }
  if (!r->mm_hash_.empty() && r->mm_hash_ != mm_hash) {
    ++stats_.collisions_refused;
    logger()->warn("EC transfer_id={} already names mm_hash={}; refusing mm_hash={} for request {}",
                   shorten(transfer_id), shorten(r->mm_hash_), shorten(mm_hash), shorten(request_id));
    // Only the newcomer fails; the existing transfer is untouched. The
    // notification is not kept on the record (it is not this record's request).
    pending_unavailable_.emplace(request_id);
    return nullptr;
  }
  if (is_terminal(r->state_)) {
    notify(*r, request_id);
    return r;
  }
  if (r->state_ == TransferState::waiting_event &&
      std::find(r->waiters_.begin(), r->waiters_.end(), request_id) == r->waiters_.end()) {
    r->waiters_.emplace_back(request_id);
  }
  return r;
}

bool TransferTable::observe_ready(LoadSpec spec, TimePoint now) {
  const KeyHashes hashes = hash_keys(spec.transfer_id, spec.mm_hash);
  TransferRecord* r = find_mutable(spec.transfer_id, hashes.id);
  if (r == nullptr) {
    r = &create(spec.transfer_id, hashes, {}, spec.mm_hash);
    enter_state(*r, now);
  }
  if (r->state_ != TransferState::waiting_event || r->mm_hash_ != spec.mm_hash) {
    ++stats_.ready_ignored;
    if (r->mm_hash_ != spec.mm_hash) {
      logger()->warn("EC readiness for transfer_id={} names mm_hash={} but the transfer carries mm_hash={}; ignored",
                     shorten(spec.transfer_id), shorten(spec.mm_hash), shorten(r->mm_hash_));
    }
    return false;
  }
  spec.local = false;
  r->spec_ = std::move(spec);
  r->waiters_.clear();  // satisfied: they load it on their next check
  r->deadline_ = now + limits_.reservation_ttl;
  r->available_since_ = now;
  return transition(*r, TransferState::available, now);
}

bool TransferTable::observe_abandoned(std::string_view transfer_id, std::string_view mm_hash, TimePoint now) {
  const KeyHashes hashes = hash_keys(transfer_id, mm_hash);
  TransferRecord* r = find_mutable(transfer_id, hashes.id);
  if (r == nullptr) {
    r = &create(transfer_id, hashes, {}, mm_hash);
    enter_state(*r, now);
  }
  if (r->state_ != TransferState::waiting_event) return false;
  if (!mm_hash.empty() && r->mm_hash_ != mm_hash) return false;
  return transition(*r, TransferState::unavailable, now);
}

void TransferTable::touch_available(std::string_view transfer_id, TimePoint now) {
  TransferRecord* r = find_mutable(transfer_id);
  if (r == nullptr || r->state_ != TransferState::available) return;
  const TimePoint deadline = now + limits_.reservation_ttl;
  if (r->deadline_ && *r->deadline_ >= deadline) return;
  // Same state, later deadline: move it within the deadline order.
  leave_state(*r);
  r->deadline_ = deadline;
  enter_state(*r, now);
}

const TransferRecord* TransferTable::begin_load(std::string_view mm_hash, std::optional<std::string_view> preferred_id,
                                                std::string_view request_id, TimePoint now, TimePoint load_deadline) {
  TransferRecord* chosen = nullptr;
  if (preferred_id) {
    TransferRecord* r = find_mutable(*preferred_id);
    if (r && r->state_ == TransferState::available && r->mm_hash_ == mm_hash && r->spec_) chosen = r;
  }
  if (chosen == nullptr) {
    const HashIndex* entry = find_hash(mm_hash);
    if (entry == nullptr) return nullptr;
    TransferRecord* available = entry->by_state[idx(TransferState::available)].head;
    TransferRecord* resident = entry->by_state[idx(TransferState::resident)].head;
    if (available && resident)
      chosen = available->sequence_ < resident->sequence_ ? available : resident;
    else
      chosen = available ? available : resident;
  }
  if (chosen == nullptr || !chosen->spec_) return nullptr;
  if (chosen->state_ == TransferState::available) {
    stages::record(stages::Stage::load_dispatch, now - chosen->available_since_);
  }
  chosen->deadline_ = load_deadline;
  chosen->load_owner_ = std::string(request_id);
  if (!transition(*chosen, TransferState::loading, now)) return nullptr;
  chosen->queued_for_dispatch_ = true;
  dispatch_queue_.push_back(QueuedLoad{chosen, chosen->sequence_});
  return chosen;
}

std::vector<LoadSpec> TransferTable::take_loads_to_dispatch() {
  std::vector<LoadSpec> loads;
  loads.reserve(dispatch_queue_.size());
  for (const QueuedLoad& queued : dispatch_queue_) {
    // Records live in a pool: one erased since it was queued may hold another
    // transfer now, which its sequence number tells.
    TransferRecord* r = queued.record;
    if (!r->in_use_ || r->sequence_ != queued.sequence || !r->queued_for_dispatch_) continue;
    r->queued_for_dispatch_ = false;
    if (r->state_ == TransferState::loading && r->spec_) loads.push_back(*r->spec_);
  }
  dispatch_queue_.clear();
  return loads;
}

bool TransferTable::complete_load(std::string_view mm_hash) {
  const HashIndex* entry = find_hash(mm_hash);
  if (entry == nullptr) return false;
  if (TransferRecord* r = entry->by_state[idx(TransferState::loading)].head) {
    r->load_owner_.clear();
    // `loaded` holds what every rank loaded (WorkerMeta::aggregate), and a load takes the
    // slot: the consumer record of a transfer load goes then, and a local load's went at
    // its first load.
    r->taken_ = true;
    return transition(*r, TransferState::ready, TimePoint{});
  }
  return entry->by_state[idx(TransferState::ready)].size != 0;
}

bool TransferTable::fail_load(std::string_view mm_hash, TimePoint now) {
  const HashIndex* entry = find_hash(mm_hash);
  if (entry == nullptr) return false;
  TransferRecord* r = entry->by_state[idx(TransferState::loading)].head;
  if (r == nullptr) return false;
  r->load_owner_.clear();
  if (!transition(*r, TransferState::failed, now)) return false;
  orphans_.push_back(r->transfer_id_);
  return true;
}

void TransferTable::expire_as_orphan(TransferRecord& r, TimePoint now) {
  logger()->debug(
      "EC transfer_id={} (mm_hash={}, named by request {}) expires from {}: another copy of the hash "
      "is kept, or the resident capacity is exceeded, or a worker reclaimed it",
      shorten(r.transfer_id_), shorten(r.mm_hash_), shorten(r.request_id_), transfer_state_name(r.state_));
  if (transition(r, TransferState::expired, now)) orphans_.push_back(r.transfer_id_);
}

void TransferTable::release_ready(std::string_view mm_hash, TimePoint now) {
  if (const HashIndex* entry = find_hash(mm_hash)) {
    std::vector<TransferRecord*> ready;
    std::vector<TransferRecord*> resident;
    for (auto* r = entry->by_state[idx(TransferState::ready)].head; r; r = r->hash_hook_.next) ready.push_back(r);
    if (!ready.empty()) {
      for (auto* r = entry->by_state[idx(TransferState::resident)].head; r; r = r->hash_hook_.next) {
        resident.push_back(r);
      }
      TransferRecord* canonical = ready.back();  // the newest to become ready
      ready.pop_back();
      // `entry` may be released below (the hash entry goes when its lists empty).
      for (auto* r : ready) expire_as_orphan(*r, now);
      for (auto* r : resident) expire_as_orphan(*r, now);
      if (canonical->spec_) {
        canonical->spec_->local = true;
        transition(*canonical, TransferState::resident, now);
      } else {
        expire_as_orphan(*canonical, now);
      }
    }
  }
  evict_residents(now);
}

void TransferTable::evict_residents(TimePoint now) {
  while (resident_bytes_ > limits_.resident_capacity_bytes && resident_.head != nullptr) {
    ++stats_.resident_evictions;
    expire_as_orphan(*resident_.head, now);
  }
}

void TransferTable::reclaim(std::string_view mm_hash, TimePoint now) {
  const std::uint32_t id = find_hash_id(mm_hash, detail::key_hash(mm_hash));
  if (id == detail::kNoId) return;
  HashIndex* entry = &hash_entries_[id];
  entry->changed = ++changes_;  // the ready copies lose their spec without a change of state
  for (auto* r = entry->by_state[idx(TransferState::ready)].head; r; r = r->hash_hook_.next) r->spec_.reset();
  std::vector<TransferRecord*> resident;
  for (auto* r = entry->by_state[idx(TransferState::resident)].head; r; r = r->hash_hook_.next) {
    resident.push_back(r);
  }
  for (auto* r : resident) expire_as_orphan(*r, now);
}

bool TransferTable::mark_unavailable(std::string_view transfer_id, TimePoint now) {
  TransferRecord* r = find_mutable(transfer_id);
  if (r == nullptr || is_terminal(r->state_)) return false;
  const std::string owner = r->state_ == TransferState::loading ? r->load_owner_ : std::string();
  if (!transition(*r, TransferState::unavailable, now)) return false;
  notify(*r, owner);
  return true;
}

bool TransferTable::cancel(std::string_view transfer_id, TimePoint now, std::string_view mm_hash,
                           std::string_view request_id) {
  using S = TransferState;
  const std::uint64_t id_hash = detail::key_hash(transfer_id);
  TransferRecord* r = find_mutable(transfer_id, id_hash);
  if (r == nullptr) {
    // A tombstone against a readiness event that may still be on its way.
    r = &create(transfer_id, {id_hash, hash_of(mm_hash)}, request_id, mm_hash);
    enter_state(*r, now);
    return transition(*r, S::cancelled, now);
  }
  if (!mm_hash.empty() && !r->mm_hash_.empty() && r->mm_hash_ != mm_hash) return false;
  if (!request_id.empty()) {
    if (std::erase(r->waiters_, request_id) != 0) ++undoings_;
    if (!r->waiters_.empty()) return false;  // another request still waits for it
  }
  switch (r->state_) {
    case S::cancelled:
    case S::ready:
    case S::resident:
    case S::failed:
    case S::loading:
      return false;
    default:
      break;
  }
  return transition(*r, S::cancelled, now);
}

void TransferTable::withdraw(std::string_view transfer_id, std::string_view request_id) {
  TransferRecord* r = find_mutable(transfer_id);
  if (r != nullptr && std::erase(r->waiters_, request_id) != 0) ++undoings_;
}

void TransferTable::expire(TimePoint now, std::vector<std::string>& remote_cancels) {
  auto due = [now](const RecordList& list) {
    return list.head && list.head->deadline_ && *list.head->deadline_ <= now;
  };
  while (due(waiting_)) {
    TransferRecord& r = *waiting_.head;
    ++stats_.pushes_never_arrived;
    logger()->warn(
        "EC waited for a push of mm_hash={} (transfer_id={}) that never arrived; requests needing it fail with a "
        "retryable error.",
        shorten(r.mm_hash_), shorten(r.transfer_id_));
    transition(r, TransferState::unavailable, now);
    if (!r.invented_name_) remote_cancels.push_back(r.transfer_id_);
  }
  while (due(available_)) {
    TransferRecord& r = *available_.head;
    transition(r, TransferState::expired, now);
    remote_cancels.push_back(r.transfer_id_);
  }
  while (due(loading_)) {
    TransferRecord& r = *loading_.head;
    ++stats_.load_deadlines;
    logger()->warn("EC load of mm_hash={} (transfer_id={}) was not reported within its deadline; failing request {}",
                   shorten(r.mm_hash_), shorten(r.transfer_id_), shorten(r.load_owner_));
    const std::string owner = r.load_owner_;
    r.load_owner_.clear();
    transition(r, TransferState::unavailable, now);
    notify(r, owner);
    remote_cancels.push_back(r.transfer_id_);
  }
  while (due(tombstones_)) erase_record(*tombstones_.head);
}

std::vector<std::string> TransferTable::take_unavailable_requests() {
  std::vector<std::string> out(pending_unavailable_.begin(), pending_unavailable_.end());
  pending_unavailable_.clear();
  std::sort(out.begin(), out.end());
  return out;
}

void TransferTable::forget_pending_request(std::string_view request_id) {
  auto it = pending_unavailable_.find(request_id);
  if (it != pending_unavailable_.end()) pending_unavailable_.erase(it);
}

std::vector<std::string> TransferTable::drain_orphaned() { return std::exchange(orphans_, {}); }

Status TransferTable::check_invariants() const {
  auto fail = [](std::string msg) { return internal_error(std::move(msg)); };
  // Each ordering list: linked consistently, sorted by deadline where it is a
  // deadline list, holding exactly the records that claim membership.
  std::array<std::size_t, 6> claimed{};
  std::uint64_t bytes = 0;
  std::size_t terminal = 0;
  std::array<std::size_t, kLiveStateCount> live_in_state{};
  std::size_t in_use = 0;
  auto check_record = [&](const TransferRecord& r) -> Status {
    const std::string& id = r.transfer_id_;
    if (r.id_hash_ != detail::key_hash(id)) return fail("stale id hash for " + id);
    if (find(id) != &r) return fail("the id index does not lead to " + id);
    if (&records_[r.pool_id_] != &r) return fail("wrong pool id for " + id);
    if (r.order_list_ > kTombstones) return fail("bad order list for " + id);
    ++claimed[r.order_list_];
    const bool term = is_terminal(r.state_);
    if (term) {
      ++terminal;
      if (r.order_list_ != kTombstones) return fail("terminal record outside the tombstones: " + id);
      if (!r.waiters_.empty()) return fail("terminal record with waiters: " + id);
    }
    auto expect_list = [&](unsigned char which) -> Status {
      if (r.order_list_ != which) {
        return fail(fmt::format("{} in {} sits in order list {}", id, transfer_state_name(r.state_), r.order_list_));
      }
      return Status::ok();
    };
    switch (r.state_) {
      case TransferState::waiting_event:
        ECX_RETURN_IF_ERROR(expect_list(r.deadline_ ? kWaiting : kNoList));
        break;
      case TransferState::available:
        ECX_RETURN_IF_ERROR(expect_list(kAvailable));
        if (!r.spec_) return fail("available record without spec: " + id);
        break;
      case TransferState::loading:
        ECX_RETURN_IF_ERROR(expect_list(kLoading));
        break;
      case TransferState::ready:
        ECX_RETURN_IF_ERROR(expect_list(kNoList));
        break;
      case TransferState::resident:
        ECX_RETURN_IF_ERROR(expect_list(kResident));
        if (!r.spec_) return fail("resident record without spec: " + id);
        bytes += r.spec_->spec.nbytes();
        break;
      default:
        break;
    }
    if (r.state_ != TransferState::waiting_event && !r.waiters_.empty()) return fail("waiters outside waiting: " + id);
    const bool indexed_by_hash = !term && !r.mm_hash_.empty();
    if (indexed_by_hash != (r.hash_entry_ != detail::kNoId)) return fail("hash entry link wrong for " + id);
    if (indexed_by_hash) {
      ++live_in_state[idx(r.state_)];
      if (r.mm_hash_hash_ != detail::key_hash(r.mm_hash_)) return fail("stale mm_hash hash for " + id);
      const HashIndex* entry = find_hash(r.mm_hash_);
      if (entry == nullptr) return fail("live record missing from its hash index: " + id);
      if (entry != &hash_entries_[r.hash_entry_]) return fail("record linked to another hash entry: " + id);
      bool found = false;
      for (auto* p = entry->by_state[idx(r.state_)].head; p; p = p->hash_hook_.next) found |= (p == &r);
      if (!found) return fail("record not in its hash's state list: " + id);
    }
    return Status::ok();
  };
  Status status = Status::ok();
  records_.for_each([&](const TransferRecord& r) {
    if (!status.is_ok() || !r.in_use_) return;
    ++in_use;
    status = check_record(r);
  });
  ECX_RETURN_IF_ERROR(status);
  if (in_use != by_id_.size() || in_use != records_.in_use()) {
    return fail(fmt::format("{} records in use, the id index holds {}, the pool counts {}", in_use, by_id_.size(),
                            records_.in_use()));
  }
  for (unsigned char which = kWaiting; which <= kTombstones; ++which) {
    const RecordList* list = order_list(which);
    std::size_t n = 0;
    const TransferRecord* prev = nullptr;
    for (auto* p = list->head; p; p = p->order_hook_.next) {
      if (p->order_hook_.prev != prev) return fail("broken back link in order list");
      if (p->order_list_ != which) return fail("record in the wrong order list: " + p->transfer_id_);
      if (which != kResident && prev && *prev->deadline_ > *p->deadline_) {
        return fail("deadline list out of order at " + p->transfer_id_);
      }
      prev = p;
      ++n;
    }
    if (list->tail != prev || n != list->size || n != claimed[which]) {
      return fail(fmt::format("order list {} holds {} records, size says {}, records claim {}", which, n, list->size,
                              claimed[which]));
    }
  }
  std::array<std::size_t, kLiveStateCount> indexed{};
  std::size_t entries_in_use = 0;
  hash_entries_.for_each([&](const HashIndex& entry) {
    if (!status.is_ok() || !entry.in_use) return;
    ++entries_in_use;
    const std::string hash(entry.key());
    if (entry.live_states == 0) {
      status = fail("empty hash index kept for " + hash);
      return;
    }
    if (entry.hash != detail::key_hash(hash) || find_hash(hash) != &entry) {
      status = fail("the hash index does not lead to the entry of " + hash);
      return;
    }
    for (std::size_t s = 0; s < kLiveStateCount; ++s) {
      std::size_t n = 0;
      for (auto* p = entry.by_state[s].head; p; p = p->hash_hook_.next) {
        if (p->mm_hash_ != hash || idx(p->state_) != s) {
          status = fail("hash index disagrees with " + p->transfer_id_);
          return;
        }
        ++n;
      }
      if (n != entry.by_state[s].size) {
        status = fail("hash index size mismatch for " + hash);
        return;
      }
      if ((n != 0) != ((entry.live_states >> s & 1u) != 0)) {
        status = fail("hash index state bits disagree with its lists for " + hash);
        return;
      }
      indexed[s] += n;
    }
  });
  ECX_RETURN_IF_ERROR(status);
  if (entries_in_use != by_hash_.size() || entries_in_use != hash_entries_.in_use()) {
    return fail(fmt::format("{} hash entries in use, the hash index holds {}, the pool counts {}", entries_in_use,
                            by_hash_.size(), hash_entries_.in_use()));
  }
  if (indexed != live_in_state) return fail("hash index counts differ from live records");
  if (bytes != resident_bytes_)
    return fail(fmt::format("resident bytes {} but records sum to {}", resident_bytes_, bytes));
  if (terminal != tombstones_.size) return fail("tombstone count differs from terminal records");
  if (tombstones_.size > limits_.tombstone_max) return fail("tombstones beyond their bound");
  if (resident_bytes_ > limits_.resident_capacity_bytes) return fail("resident bytes beyond the capacity");
  return Status::ok();
}

}  // namespace ecx::scheduler
