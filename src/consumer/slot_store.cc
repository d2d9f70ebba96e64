#include "consumer/slot_store.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>
#include <xxhash.h>

namespace ecx::consumer::detail {

std::uint64_t SlotBytes::xxh64() const noexcept { return XXH64(data, length, 0); }

SlotStore::SlotStore(const SlotStoreOptions& options)
    : slab_base_(options.slab_base),
      allocator_(options.slab_size, options.alignment),
      log_(log::get("consumer")),
      resident_capacity_bytes_(options.resident_capacity_bytes == 0 ? allocator_.capacity()
                                                                    : options.resident_capacity_bytes),
      reclaimed_max_(std::max<std::uint64_t>(options.reclaimed_max, 1)),
      space_freed_(options.space_freed) {}

// ---------------------------------------------------------------- allocation, lookup

Result<SlotId> SlotStore::allocate_filling(const std::string& mm_hash, const TensorSpec& spec, std::string writer,
                                           std::optional<std::uint64_t> expected_checksum, bool write_open) {
  Result<pool::Slot> slot = allocator_.allocate(spec.nbytes());
  while (!slot.is_ok() && slot.status().code() == StatusCode::resource_exhausted && evict_one_resident()) {
    slot = allocator_.allocate(spec.nbytes());
  }
  if (!slot.is_ok()) return slot.status();

  const SlotId id = next_id_++;
  SlotEntry& e = entries_.try_emplace(id, id, *slot, mm_hash, spec).first->second;
  e.holders = 1;
  e.writer = std::move(writer);
  e.expected_checksum = expected_checksum;
  if (write_open) open_write(id);
  filling_nodes_.insert_or_assign(filling_by_hash_, e.mm_hash, id);
  return id;
}

SlotId SlotStore::filling(const std::string& mm_hash) const {
  auto it = filling_by_hash_.find(mm_hash);
  return it == filling_by_hash_.end() ? kNoSlot : it->second;
}

SlotId SlotStore::resident(const std::string& mm_hash) const {
  auto it = resident_by_hash_.find(mm_hash);
  return it == resident_by_hash_.end() ? kNoSlot : it->second;
}

bool SlotStore::filled_by(SlotId id, std::string_view writer) const {
  if (id == kNoSlot) return false;
  const SlotEntry& e = at(id);
  return e.content == SlotContent::filling && e.writer == writer;
}

// ---------------------------------------------------------------- holders

void SlotStore::hold(SlotId id) {
  SlotEntry& e = entry(id);
  unlink_lru(e);
  ++e.holders;
}

void SlotStore::release(SlotId id) {
  SlotEntry& e = entry(id);
  --e.holders;
  maybe_release(e);
}

void SlotStore::settle(SlotId id) {
  if (auto it = entries_.find(id); it != entries_.end()) maybe_release(it->second);
}

void SlotStore::lease(SlotId id) {
  hold(id);
  ++entry(id).leases;
  ++leases_;
}

void SlotStore::release_lease(SlotId id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  --it->second.leases;
  --leases_;
  release(id);
}

void SlotStore::maybe_release(SlotEntry& e) {
  if (e.holders != 0 || e.write_open) return;
  if (e.content == SlotContent::landed && e.canonical) {
    if (!e.in_lru) {
      e.lru_it = lru_.insert(lru_.end(), e.id);
      e.in_lru = true;
    }
    enforce_resident_cap();
  } else {
    free_entry(e);
  }
  if (space_freed_) space_freed_();
}

void SlotStore::free_entry(SlotEntry& e) {
  unlink_lru(e);
  if (e.canonical) {
    resident_bytes_ -= e.slot.size;
    resident_nodes_.erase_key(resident_by_hash_, e.mm_hash);
    e.canonical = false;
  }
  unindex_filling(e);
  if (Status st = allocator_.free(e.slot); !st.is_ok()) {
    log_->error("freeing slot offset={} size={} failed: {}", e.slot.offset, e.slot.size, st.to_string());
  }
  const SlotId id = e.id;
  entries_.erase(id);
}

void SlotStore::unlink_lru(SlotEntry& e) {
  if (!e.in_lru) return;
  lru_.erase(e.lru_it);
  e.in_lru = false;
}

void SlotStore::unindex_filling(const SlotEntry& e) {
  if (auto it = filling_by_hash_.find(e.mm_hash); it != filling_by_hash_.end() && it->second == e.id) {
    filling_nodes_.erase(filling_by_hash_, it);
  }
}

// ---------------------------------------------------------------- writes, followers

void SlotStore::open_write(SlotId id) {
  SlotEntry& e = entry(id);
  if (e.write_open) return;
  e.write_open = true;
  ++open_writes_;
}

bool SlotStore::close_write(SlotId id) {
  SlotEntry& e = entry(id);
  if (!e.write_open) return false;
  e.write_open = false;
  --open_writes_;
  return true;
}

void SlotStore::add_follower(SlotId id, std::string transfer_id) {
  entry(id).followers.push_back(std::move(transfer_id));
}

void SlotStore::remove_follower(SlotId id, std::string_view transfer_id) {
  SlotEntry& e = entry(id);
  if (e.content == SlotContent::filling) std::erase(e.followers, transfer_id);
}

std::vector<std::string> SlotStore::land(SlotId id) {
  SlotEntry& e = entry(id);
  unindex_filling(e);
  e.content = SlotContent::landed;
  make_canonical(e);
  std::vector<std::string> followers = std::move(e.followers);
  e.followers.clear();
  return followers;
}

std::vector<std::string> SlotStore::lose(SlotId id) {
  SlotEntry& e = entry(id);
  unindex_filling(e);
  e.content = SlotContent::dead;
  std::vector<std::string> followers = std::move(e.followers);
  e.followers.clear();
  return followers;
}

// ---------------------------------------------------------------- resident copies

void SlotStore::make_canonical(SlotEntry& e) {
  if (auto it = resident_by_hash_.find(e.mm_hash); it != resident_by_hash_.end() && it->second != e.id) {
    // A newer landing of the same content replaces the resident copy; the old one is
    // freed once nothing holds it.
    SlotEntry& old = entry(it->second);
    old.canonical = false;
    resident_bytes_ -= old.slot.size;
    resident_nodes_.erase(resident_by_hash_, it);
    unlink_lru(old);
    maybe_release(old);
  }
  if (!e.canonical) {
    e.canonical = true;
    resident_bytes_ += e.slot.size;
    resident_nodes_.insert_or_assign(resident_by_hash_, e.mm_hash, e.id);
  }
}

void SlotStore::enforce_resident_cap() {
  while (resident_bytes_ > resident_capacity_bytes_ && evict_one_resident()) {
  }
}

bool SlotStore::evict_one_resident() {
  if (lru_.empty()) return false;
  SlotEntry& e = entry(lru_.front());
  ++residents_reclaimed_;
  if (reclaimed_.size() >= reclaimed_max_) reclaimed_.pop_front();
  reclaimed_.push_back(e.mm_hash);
  free_entry(e);
  return true;
}

std::vector<std::string> SlotStore::drain_reclaimed() {
  std::vector<std::string> out(std::make_move_iterator(reclaimed_.begin()), std::make_move_iterator(reclaimed_.end()));
  reclaimed_.clear();
  return out;
}

// ---------------------------------------------------------------- invariants

Status SlotStore::check_slots() const {
  auto fail = [](std::string what) { return internal_error(std::move(what)); };
  std::uint64_t slot_bytes = 0;
  std::vector<pool::Slot> slots;
  std::uint64_t open = 0;
  for (const auto& [id, e] : entries_) {
    slot_bytes += e.slot.size;
    slots.push_back(e.slot);
    if (e.write_open) ++open;
    if (e.holders == 0 && !e.write_open && !(e.canonical && e.content == SlotContent::landed && e.in_lru)) {
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
  return Status::ok();
}

Status SlotStore::check_holders(const std::unordered_map<SlotId, std::uint64_t>& record_refs) const {
  std::uint64_t leases = 0;
  for (const auto& [id, e] : entries_) {
    auto refs_it = record_refs.find(id);
    const std::uint64_t refs = refs_it == record_refs.end() ? 0 : refs_it->second;
    if (e.holders != refs + e.leases) {
      return internal_error(
          fmt::format("entry {} has {} holders; {} records and {} leases", id, e.holders, refs, e.leases));
    }
    leases += e.leases;
  }
  if (leases != leases_) return internal_error("lease count out of step");
  return Status::ok();
}

}  // namespace ecx::consumer::detail
