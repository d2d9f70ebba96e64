#pragma once
// The consumer scheduler's record of every inbound transfer: a validated state
// machine plus the indexes the per-step hooks need, each kept so that every
// operation costs O(1) or O(records it touches) (amortised). Single-threaded: the
// SchedulerCoordinator owns it and calls it from the engine's scheduler thread.
//
// The cost is also flat in the table's size (bench/scheduler): records and
// per-hash entries live in pools that reuse dropped ones (no allocation per
// record at steady state), and both lookups (transfer id, mm_hash) go through
// open-addressing indexes with each key hashed once per operation
// (table_storage.h), so a lookup in 100,000 records touches the same few cache
// lines as in 100.
//
// States (terminal: unavailable, expired, failed, cancelled):
//   waiting_event → {available, unavailable, cancelled}
//   available     → {loading, expired, cancelled}
//   loading       → {ready, failed, cancelled, unavailable}   (unavailable: load deadline)
//   ready         → {resident, expired}
//   resident      → {loading, expired}
//   unavailable   → {cancelled}
//   expired       → {cancelled}
// `cancel` refuses loading records although the table allows the edge: an
// in-flight load may satisfy another request for the same hash; its completion or
// its load deadline owns it. Any other change is an invalid transition: logged,
// counted, and the record alone is failed.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "ecx/connector/scheduler/table_storage.h"
#include "ecx/connector/scheduler/types.h"
#include "ecx/core/clock.h"
#include "ecx/core/status.h"

namespace ecx::scheduler {

enum class TransferState : unsigned char {
  waiting_event,
  available,
  loading,
  ready,
  resident,
  unavailable,
  expired,
  failed,
  cancelled,
};
inline constexpr std::size_t kTransferStateCount = 9;
inline constexpr std::size_t kLiveStateCount = 5;  // waiting_event .. resident

std::string_view transfer_state_name(TransferState state) noexcept;
bool is_terminal(TransferState state) noexcept;
// The validated transition table (documented above).
bool transition_allowed(TransferState from, TransferState to) noexcept;

// A set of states, for has_state().
class StateMask {
 public:
  constexpr StateMask() = default;
  constexpr StateMask(std::initializer_list<TransferState> states) {
    for (auto s : states) bits_ |= bit(s);
  }
  constexpr bool contains(TransferState s) const noexcept { return (bits_ & bit(s)) != 0; }

 private:
  static constexpr std::uint16_t bit(TransferState s) {
    return static_cast<std::uint16_t>(1u << static_cast<unsigned>(s));
  }
  std::uint16_t bits_ = 0;
};

class TransferRecord;

namespace detail {
struct ListHook {
  TransferRecord* prev = nullptr;
  TransferRecord* next = nullptr;
};
struct RecordList {
  TransferRecord* head = nullptr;
  TransferRecord* tail = nullptr;
  std::size_t size = 0;
};
}  // namespace detail

class TransferRecord {
 public:
  const std::string& transfer_id() const noexcept { return transfer_id_; }
  const std::string& request_id() const noexcept { return request_id_; }  // first request that named it
  const std::string& mm_hash() const noexcept { return mm_hash_; }        // "" = unknown (cancel of an unknown id)
  TransferState state() const noexcept { return state_; }
  const std::optional<LoadSpec>& spec() const noexcept { return spec_; }
  const std::optional<TimePoint>& deadline() const noexcept { return deadline_; }
  // Requests waiting for this transfer's readiness event (waiting_event only).
  const std::vector<std::string>& waiters() const noexcept { return waiters_; }
  // Requests already told that this transfer is unavailable.
  const std::vector<std::string>& notified() const noexcept { return notified_; }
  // The request a loading record was started for (told if the load times out).
  const std::string& load_owner() const noexcept { return load_owner_; }
  // The scheduler invented this name ("<request_id>:<index>"); no consumer knows it.
  bool invented_name() const noexcept { return invented_name_; }
  // Every rank's worker took its landed slot (a load reported done): the consumers
  // erased their records of it at the take, so a cancel would only leave them a tombstone.
  bool taken() const noexcept { return taken_; }
  std::uint64_t sequence() const noexcept { return sequence_; }  // creation order

 private:
  friend class TransferTable;
  // What a lookup by transfer id reads comes first: the key's hash and the key.
  std::uint64_t id_hash_ = 0;
  std::string transfer_id_;
  std::string request_id_;
  std::string mm_hash_;
  std::uint64_t mm_hash_hash_ = 0;
  std::uint32_t pool_id_ = detail::kNoId;
  std::uint32_t hash_entry_ = detail::kNoId;  // its hash's index entry while live
  bool in_use_ = false;                       // false: a free slot of the record pool
  TransferState state_ = TransferState::waiting_event;
  std::optional<LoadSpec> spec_;
  std::optional<TimePoint> deadline_;
  TimePoint available_since_{};  // when its readiness made it loadable (load_dispatch stage)
  std::vector<std::string> waiters_;
  std::vector<std::string> notified_;
  std::string load_owner_;
  std::uint64_t sequence_ = 0;
  std::uint64_t changed_ = 0;  // the table's change count at its creation or last change of state
  bool invented_name_ = false;
  bool taken_ = false;
  bool queued_for_dispatch_ = false;
  // Which ordering list holds the record (deadline lists, resident LRU,
  // tombstones) and its links there; and its links in its hash's per-state list.
  unsigned char order_list_ = 0;
  detail::ListHook order_hook_;
  detail::ListHook hash_hook_;
};

struct TableLimits {
  Duration reservation_ttl = std::chrono::seconds(300);  // available deadline and tombstone TTL
  std::uint64_t tombstone_max = 65'536;                  // terminal records kept (>= 1)
  std::uint64_t resident_capacity_bytes = 1'000'000'000;
};

struct TableStats {
  std::uint64_t invalid_transitions = 0;
  std::uint64_t collisions_refused = 0;    // a transfer id reused for another mm_hash
  std::uint64_t ready_ignored = 0;         // readiness for a record not waiting for it
  std::uint64_t tombstones_evicted = 0;    // dropped by the count bound before their TTL
  std::uint64_t resident_evictions = 0;    // resident records expired by the capacity bound
  std::uint64_t pushes_never_arrived = 0;  // waiting records that reached their deadline
  std::uint64_t load_deadlines = 0;        // loading records that reached their deadline
};

class TransferTable {
 public:
  explicit TransferTable(TableLimits limits);
  ~TransferTable();
  TransferTable(const TransferTable&) = delete;
  TransferTable& operator=(const TransferTable&) = delete;

  // --- queries
  // The record stays at this address until it is dropped (a tombstone past its
  // TTL or beyond the bound); its storage then serves a later record.
  const TransferRecord* find(std::string_view transfer_id) const;
  // Whether any record of `mm_hash` is in one of `states` (live states only). O(1).
  bool has_state(std::string_view mm_hash, StateMask states) const;
  // The oldest record of `mm_hash` in a live `state`, or nullptr. O(1).
  const TransferRecord* oldest_in_state(std::string_view mm_hash, TransferState state) const;
  std::size_t size() const noexcept { return records_.in_use(); }
  std::size_t live_count() const noexcept { return records_.in_use() - tombstones_.size; }
  std::size_t tombstone_count() const noexcept { return tombstones_.size; }
  std::size_t resident_count() const noexcept { return resident_.size; }
  std::uint64_t resident_bytes() const noexcept { return resident_bytes_; }
  const TableLimits& limits() const noexcept { return limits_; }
  const TableStats& stats() const noexcept { return stats_; }

  // What a caller keeps of an mm_hash's live records to tell later, without hashing
  // the key again, whether any of them changed since: a record of the hash entered
  // or left a state, one was created, its spec was dropped, or touch_hash was called
  // (the load gate's re-checks of waiting requests).
  struct HashStamp {
    std::uint32_t entry = detail::kNoId;  // kNoId: the hash had no live record
    std::uint64_t changed = 0;
  };
  HashStamp stamp(std::string_view mm_hash) const;
  // The hash still has live records and none changed since `stamp` was taken (false
  // for a stamp of no live record).
  bool unchanged(const HashStamp& stamp) const noexcept;
  // The same for one transfer id's record (terminal ones too).
  struct RecordStamp {
    std::uint32_t record = detail::kNoId;  // kNoId: no record
    std::uint64_t changed = 0;
  };
  RecordStamp record_stamp(const TransferRecord* record) const noexcept;  // nullptr: no record
  // No record was created, changed state or dropped since: for kNoId, `transfer_id`
  // still names no record (a lookup); otherwise a comparison.
  bool unchanged(const RecordStamp& stamp, std::string_view transfer_id) const;
  // Something a caller decides by beside these records changed for `mm_hash`: its
  // stamps stop matching. No effect for a hash without live records.
  void touch_hash(std::string_view mm_hash);
  // Counts the changes a second call could not find already made: waiters withdrawn,
  // records ended. Equal before and after a call that only creates records, adds
  // waiters and starts loads: the same call again would find them and change nothing.
  std::uint64_t undoings() const noexcept { return undoings_; }

  // --- operations (`now` is the caller's one timestamp for its whole decision)

  // `request_id` needs `transfer_id` (carrying `mm_hash`) and found nothing usable.
  // Creates a waiting_event record with `deadline` when the id is new and adds the
  // request as a waiter. When the id already names another mm_hash the newcomer is
  // refused: it is notified unavailable and nullptr is returned (the existing
  // transfer is untouched). A terminal record notifies the request at once.
  const TransferRecord* wait_for_event(std::string_view transfer_id, std::string_view request_id,
                                       std::string_view mm_hash, TimePoint now, TimePoint deadline,
                                       bool invented_name = false);
  // Every shard reported the payload landed. waiting_event (or unknown) →
  // available with deadline now + reservation_ttl. Returns false (ignored) for any
  // other state or a mismatching mm_hash.
  bool observe_ready(LoadSpec spec, TimePoint now);
  // A shard reported that no producer will write this transfer. waiting_event →
  // unavailable (waiters notified now); an unknown id becomes an unavailable
  // tombstone so a later request fails on arrival; available and later states
  // ignore it (the data landed). Returns whether the record changed.
  bool observe_abandoned(std::string_view transfer_id, std::string_view mm_hash, TimePoint now);
  // A request still names this available transfer: push its deadline to now + ttl.
  void touch_available(std::string_view transfer_id, TimePoint now);
  // Starts loading `mm_hash` for `request_id`: the record named `preferred_id` if it
  // is available for this hash, else the earliest available or resident record of
  // the hash. → loading with `load_deadline`, queued for dispatch. nullptr if none.
  const TransferRecord* begin_load(std::string_view mm_hash, std::optional<std::string_view> preferred_id,
                                   std::string_view request_id, TimePoint now, TimePoint load_deadline);
  // Load specs of the records queued by begin_load since the last call.
  std::vector<LoadSpec> take_loads_to_dispatch();
  // The workers loaded `mm_hash`: the first loading record → ready. True also when
  // the hash is already ready (a repeated report).
  bool complete_load(std::string_view mm_hash);
  // The workers could not load `mm_hash`: the first loading record → failed, and an
  // orphan (a rank that did not take it still holds its consumer record).
  bool fail_load(std::string_view mm_hash, TimePoint now);
  // The engine freed `mm_hash` from its encoder cache: the newest ready record
  // becomes resident (reloadable locally); every other ready or resident record of
  // the hash, and a canonical one whose spec a reclaim cleared, expires as an
  // orphan. Then resident records are expired oldest first until the resident bytes
  // fit the capacity.
  void release_ready(std::string_view mm_hash, TimePoint now);
  // A worker dropped its resident copy of `mm_hash`: ready records lose their spec
  // (they expire at release), resident ones expire as orphans.
  void reclaim(std::string_view mm_hash, TimePoint now);
  // waiting_event or loading → unavailable, notifying who waits. A terminal record
  // is left alone (false); any other state is an invalid transition.
  bool mark_unavailable(std::string_view transfer_id, TimePoint now);
  // Cancels `transfer_id`; true when the caller should cancel it remotely. An
  // unknown id becomes a cancelled tombstone (true). Refused (false) for cancelled,
  // ready, resident, failed and loading records, and when `mm_hash` is given and
  // the record names another hash. When `request_id` is given it stops waiting
  // first, and the cancel is refused while other requests still wait.
  bool cancel(std::string_view transfer_id, TimePoint now, std::string_view mm_hash = {},
              std::string_view request_id = {});
  // `request_id` no longer needs `transfer_id` (e.g. it finished): it stops waiting
  // and will not be notified about it.
  void withdraw(std::string_view transfer_id, std::string_view request_id);
  // Deadlines: waiting_event → unavailable (waiters notified), available →
  // expired, loading → unavailable (load owner notified); tombstones past their
  // TTL are dropped. Appends to `remote_cancels` the ids whose consumer
  // reservation should now be cancelled. Touches only records that are due.
  void expire(TimePoint now, std::vector<std::string>& remote_cancels);
  // Requests told "unavailable" since the last call (each once per record).
  std::vector<std::string> take_unavailable_requests();
  // Drops a request from the pending notifications (it finished meanwhile).
  void forget_pending_request(std::string_view request_id);
  // Records expired out of ready/resident, or failed in their load, since the last
  // call. Nothing else releases what a consumer may still hold of them; one whose
  // load every rank took (TransferRecord::taken) holds nothing there.
  std::vector<std::string> drain_orphaned();

  // Walks every record and index and reports the first disagreement. O(n): for
  // tests and debugging only.
  Status check_invariants() const;
  // Visits the waiting_event records in deadline order, earliest first, until
  // `visit` returns false. Costs the records visited.
  template <typename F>
  void for_each_waiting(F&& visit) const {
    for (const TransferRecord* r = waiting_.head; r != nullptr; r = r->order_hook_.next) {
      if (!visit(*r)) return;
    }
  }
  // Visits every record (any order). O(n): for tests and diagnostics only.
  template <typename F>
  void for_each_record(F&& visit) const {
    records_.for_each([&](const TransferRecord& r) {
      if (r.in_use_) visit(r);
    });
  }

 private:
  // The live records of one mm_hash, by state. Cache-line aligned with the key
  // inline in the first line when it fits (a 64-hex-digit digest does), so a
  // lookup reads the key and the second line in parallel, and no heap line.
  struct alignas(64) HashIndex {
    static constexpr std::size_t kInlineKey = 64;
    std::array<char, kInlineKey> inline_key{};
    std::uint32_t key_size = 0;
    std::uint8_t live_states = 0;  // bit s: by_state[s] is not empty (has_state reads only this)
    bool in_use = false;
    std::uint64_t hash = 0;
    std::uint64_t changed = 0;  // the table's change count when a record of it last changed
    std::array<detail::RecordList, kLiveStateCount> by_state;  // each in order of entry to the state
    std::string long_key;                                      // a key longer than kInlineKey

    std::string_view key() const noexcept {
      return key_size <= kInlineKey ? std::string_view(inline_key.data(), key_size) : std::string_view(long_key);
    }
    void set_key(std::string_view key);
  };
  struct QueuedLoad {
    TransferRecord* record;
    std::uint64_t sequence;  // tells a record reused since it was queued
  };

  struct KeyHashes {
    std::uint64_t id;
    std::uint64_t mm_hash;  // 0 for no mm_hash (never indexed)
  };
  static std::uint64_t hash_of(std::string_view mm_hash) noexcept {
    return mm_hash.empty() ? 0 : detail::key_hash(mm_hash);
  }
  // For operations that mostly create a record (readiness, abandoned events):
  // both hashes up front and both index slots fetched at once, so a new
  // transfer waits for memory once rather than twice.
  KeyHashes hash_keys(std::string_view transfer_id, std::string_view mm_hash) const;
  TransferRecord* find_mutable(std::string_view transfer_id);
  TransferRecord* find_mutable(std::string_view transfer_id, std::uint64_t hash);
  std::uint32_t find_hash_id(std::string_view mm_hash, std::uint64_t hash) const;
  const HashIndex* find_hash(std::string_view mm_hash) const;
  void attach_hash(TransferRecord& record);
  void detach_hash(TransferRecord& record);
  TransferRecord& create(std::string_view transfer_id, KeyHashes hashes, std::string_view request_id,
                         std::string_view mm_hash);
  // Validated state change; false (and the record failed) when not allowed.
  bool transition(TransferRecord& record, TransferState to, TimePoint now);
  void leave_state(TransferRecord& record);
  void enter_state(TransferRecord& record, TimePoint now);
  void fail_invalid(TransferRecord& record, TransferState wanted, TimePoint now);
  void notify(TransferRecord& record, std::string_view request_id);
  void notify_waiters(TransferRecord& record);
  void expire_as_orphan(TransferRecord& record, TimePoint now);
  void evict_residents(TimePoint now);
  void erase_record(TransferRecord& record);
  detail::RecordList* order_list(unsigned char which);
  const detail::RecordList* order_list(unsigned char which) const;

  TableLimits limits_;
  TableStats stats_;
  detail::Pool<TransferRecord> records_;
  detail::FlatIndex by_id_;  // transfer id -> record
  detail::Pool<HashIndex> hash_entries_;
  detail::FlatIndex by_hash_;  // mm_hash -> hash entry
  std::uint64_t next_sequence_ = 1;
  // Counts records created, changes of state, erasures, specs dropped and touch_hash
  // calls: a stamp is its value at the last of these for its entry or record.
  std::uint64_t changes_ = 0;
  std::uint64_t undoings_ = 0;  // see undoings()
  // Deadline-ordered lists (new deadlines are almost always the latest, so
  // insertion is O(1)) and the resident LRU.
  detail::RecordList waiting_;
  detail::RecordList available_;
  detail::RecordList loading_;
  detail::RecordList tombstones_;
  detail::RecordList resident_;
  std::uint64_t resident_bytes_ = 0;
  std::vector<QueuedLoad> dispatch_queue_;
  std::vector<std::string> orphans_;
  struct StringHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return detail::key_hash(s); }
  };
  std::unordered_set<std::string, StringHash, std::equal_to<>> pending_unavailable_;
};

}  // namespace ecx::scheduler
