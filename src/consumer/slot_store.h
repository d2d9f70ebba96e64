#pragma once
// The receive slab's slots and what each one holds: allocation over the pool's offset
// allocator, who holds a slot (records and leases), the followers waiting for the
// landing a slot is being filled with, the resident copies (indexed by content; idle
// ones in LRU order, reclaimed oldest first past a byte cap) and the payload checksum.
// It knows nothing of records' states: the reservation machine (ReservationCore)
// decides, the store keeps the slots consistent with those decisions.
//
// Not thread-safe. The reservation machine owns one SlotStore and calls it only under
// its own mutex. SlotBytes::xxh64() alone may run without that lock: it reads slab
// bytes, touches no bookkeeping, and is only used on a slot whose write is open (an
// open write keeps the slot from being freed or reused).
//
// Central invariant (the reservation manager's): a slot with an open write is never
// freed or reused, whoever lets go of it; only close_write() followed by the last
// release (or settle()) ends it.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/id_map.h"
#include "core/logging.h"
#include "ecx/core/node_stash.h"
#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"
#include "ecx/pool/offset_allocator.h"

namespace ecx::consumer::detail {

using SlotId = std::uint64_t;
inline constexpr SlotId kNoSlot = 0;  // a record that holds no slot

struct SlotStoreOptions {
  std::byte* slab_base = nullptr;  // the registered receive slab (not owned)
  std::uint64_t slab_size = 0;
  std::uint64_t alignment = 256;
  std::uint64_t resident_capacity_bytes = 0;  // 0 = the pool's capacity
  std::uint64_t reclaimed_max = 1;            // bound on the undrained reclaimed-hash list
  // Called (under the caller's lock: it must be quick and must not call back) when a
  // slot becomes free or reclaimable: a reserve turned away may fit now.
  std::function<void()> space_freed;
};

// What a slot holds: a payload on its way, a landed payload, or a payload that will
// never land (its slot lives on only while something still holds it).
enum class SlotContent : unsigned char { filling, landed, dead };

// One slot of the slab. Several records (a writer and its followers, or READY records
// served from a resident copy) and leases may share it. Read-only outside the store.
struct SlotEntry {
  SlotEntry(SlotId entry_id, pool::Slot entry_slot, std::string hash, TensorSpec tensor)
      : id(entry_id), slot(entry_slot), mm_hash(std::move(hash)), spec(tensor) {}

  SlotId id = kNoSlot;
  pool::Slot slot;
  std::string mm_hash;
  TensorSpec spec;
  SlotContent content = SlotContent::filling;
  std::uint64_t holders = 0;  // records + leases referencing the slot
  std::uint64_t leases = 0;
  // A writer may be writing into the slot right now; nothing frees it meanwhile.
  bool write_open = false;
  bool canonical = false;              // the resident copy of its mm_hash
  std::string writer;                  // while filling: the writer's transfer id
  std::vector<std::string> followers;  // while filling: transfers waiting on this landing
  std::optional<std::uint64_t> expected_checksum;
  bool in_lru = false;
  std::list<SlotId>::iterator lru_it;
};

// A slot's payload bytes, taken under the lock and hashed outside it.
struct SlotBytes {
  const std::byte* data = nullptr;
  std::uint64_t length = 0;
  // xxHash64 (seed 0) of the bytes: what producers send as the payload's checksum.
  std::uint64_t xxh64() const noexcept;
};

class SlotStore {
 public:
  explicit SlotStore(const SlotStoreOptions& options);
  SlotStore(const SlotStore&) = delete;
  SlotStore& operator=(const SlotStore&) = delete;

  // --- the pool
  std::uint64_t capacity() const noexcept { return allocator_.capacity(); }
  std::uint64_t used_bytes() const noexcept { return allocator_.used_bytes(); }
  std::uint64_t largest_free_block() const { return allocator_.stats().largest_free_block; }

  // A new slot for `spec`, held once (by the writer's record) and indexed as the
  // filling of `mm_hash`. Idle resident copies are reclaimed, oldest first, while the
  // pool is too full. write_open: the writer may write from now on (one-sided).
  // Errors are the allocator's: resource_exhausted when nothing fits even then.
  Result<SlotId> allocate_filling(const std::string& mm_hash, const TensorSpec& spec, std::string writer,
                                  std::optional<std::uint64_t> expected_checksum, bool write_open);

  bool contains(SlotId id) const { return entries_.contains(id); }
  // The entry of a live slot id (one a record or lease holds); throws on any other.
  const SlotEntry& at(SlotId id) const { return entries_.at(id); }
  std::byte* data(SlotId id) const { return slab_base_ + at(id).slot.offset; }
  SlotBytes bytes(SlotId id, std::uint64_t length) const { return SlotBytes{data(id), length}; }
  // The slot being filled with / the resident copy of this content; kNoSlot if none.
  SlotId filling(const std::string& mm_hash) const;
  SlotId resident(const std::string& mm_hash) const;
  // Whether `writer` is filling this slot (its landing has not happened yet).
  bool filled_by(SlotId id, std::string_view writer) const;

  // --- holders
  // A record or lease starts holding the slot; an idle resident copy leaves the LRU.
  void hold(SlotId id);
  // One holder lets go. Held by nothing and no write open: a resident copy goes idle
  // (into the LRU, which may reclaim past the cap), anything else is freed.
  void release(SlotId id);
  // Applies release()'s rule without dropping a holder, if the slot is still there
  // (after a write closed while something else may have let go meanwhile).
  void settle(SlotId id);
  // A lease is a holder the worker keeps until it releases the lease.
  void lease(SlotId id);
  // Ends one lease; unknown ids are ignored (the lease outlived the slot's bookkeeping).
  void release_lease(SlotId id);

  // --- writes
  void open_write(SlotId id);
  // Whether a write was open (and is now closed). Frees nothing by itself.
  bool close_write(SlotId id);
  std::uint64_t open_writes() const noexcept { return open_writes_; }

  // --- followers (the hold of a follower's record is separate: hold()/release())
  void add_follower(SlotId id, std::string transfer_id);
  // Only while filling: a landed or dead slot has no followers left to remove.
  void remove_follower(SlotId id, std::string_view transfer_id);

  // --- how a filling ends; both return the followers that were waiting on it
  // Landed: the slot becomes the resident copy of its content (replacing an older copy,
  // freed once nothing holds it).
  std::vector<std::string> land(SlotId id);
  // Will never land: the slot is dead and no longer takes followers.
  std::vector<std::string> lose(SlotId id);

  // --- resident copies and leases
  std::uint64_t resident_entries() const noexcept { return resident_by_hash_.size(); }
  std::uint64_t resident_bytes() const noexcept { return resident_bytes_; }
  std::uint64_t leases() const noexcept { return leases_; }
  std::uint64_t residents_reclaimed() const noexcept { return residents_reclaimed_; }
  // mm_hashes whose resident copy was reclaimed since the last call, oldest first.
  std::vector<std::string> drain_reclaimed();

  // --- invariants; an error names the first inconsistency
  // Every slot is held, written or idle-resident; the pool's bytes are the slots';
  // open writes are counted; no two slots overlap.
  Status check_slots() const;
  // Each slot's holders are its records (`record_refs`: slot id -> records holding
  // it) plus its leases, and the leases add up.
  Status check_holders(const std::unordered_map<SlotId, std::uint64_t>& record_refs) const;

 private:
  SlotEntry& entry(SlotId id) { return entries_.at(id); }
  void maybe_release(SlotEntry& e);
  void free_entry(SlotEntry& e);
  void unlink_lru(SlotEntry& e);
  void unindex_filling(const SlotEntry& e);
  void make_canonical(SlotEntry& e);
  void enforce_resident_cap();
  bool evict_one_resident();

  std::byte* slab_base_;
  pool::OffsetAllocator allocator_;
  std::shared_ptr<spdlog::logger> log_;
  std::uint64_t resident_capacity_bytes_;
  std::uint64_t reclaimed_max_;
  std::function<void()> space_freed_;
  std::unordered_map<SlotId, SlotEntry> entries_;
  IdMap<SlotId> filling_by_hash_;   // mm_hash -> entry being filled
  IdMap<SlotId> resident_by_hash_;  // mm_hash -> canonical landed entry
  // Every landing enters both indexes and leaves them (filling at once, resident when
  // evicted): their nodes and key strings are reused.
  NodeStash<IdMap<SlotId>> filling_nodes_;
  NodeStash<IdMap<SlotId>> resident_nodes_;
  std::list<SlotId> lru_;              // idle canonical entries, oldest first
  std::deque<std::string> reclaimed_;  // bounded by reclaimed_max_
  SlotId next_id_ = 1;
  std::uint64_t open_writes_ = 0;
  std::uint64_t resident_bytes_ = 0;
  std::uint64_t leases_ = 0;
  std::uint64_t residents_reclaimed_ = 0;
};

}  // namespace ecx::consumer::detail
