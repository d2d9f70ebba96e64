#pragma once
// A first-in first-out table of the most recent ids (ended transfers, finished pushes)
// and a small value for each, looked up by id. Tables like this hold tens of thousands
// of entries, and every item on the per-item paths adds one, drops the oldest and
// looks up a new id that is not there. In a node-based hash map each of those touched
// several cold nodes (an erase walks its bucket from the node before it) and a
// malloc/free pair. Here the entries sit in a ring, in arrival order, and an
// open-addressing index (linear probing) points into it: a miss reads one index slot,
// an insert and an eviction write one ring entry and a few slots, and a ring entry's
// id keeps its buffer for the id that reuses the entry.
//
// One owner, like the containers it stands for (not thread-safe). Ids must be unique:
// insert only what find() did not see. At most 2^31 entries (the callers' bounds are
// configuration limits far below that); more throws std::length_error, as a vector
// that cannot grow does.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ecx {

template <class V>
class RecentTable {
 public:
  std::size_t size() const noexcept { return count_; }
  bool empty() const noexcept { return count_ == 0; }

  // The entry for `id`, or nullptr.
  const V* find(std::string_view id) const { return find(id, hash(id)); }
  bool contains(std::string_view id) const { return find(id) != nullptr; }

  // The oldest entry's id and value (the table must not be empty).
  std::string_view front_id() const { return ring_[head_].id; }
  const V& front() const { return ring_[head_].value; }

  // Adds `id`, which must not be in the table, as the newest entry.
  void push_back(std::string_view id, V value) { append(id, hash(id), std::move(value)); }
  // Adds `id` as the newest entry unless it is there already (false then): one hash
  // of the id for the lookup and the insert.
  bool try_push_back(std::string_view id, V value) {
    const std::uint32_t h = hash(id);
    if (find(id, h) != nullptr) return false;
    append(id, h, std::move(value));
    return true;
  }

  // Drops the oldest entry (the table must not be empty).
  void pop_front() {
    Entry& e = ring_[head_];
    unindex(head_, e.hash);
    e.value = V{};
    head_ = (head_ + 1) & (ring_.size() - 1);
    --count_;
  }

 private:
  static constexpr std::size_t kFirstRing = 32;                  // entries; the ring and the index double together
  static constexpr std::size_t kMaxRing = std::size_t{1} << 31;  // a slot holds a position in 32 bits
  struct Entry {
    std::string id;
    std::uint32_t hash = 0;  // the id's: an eviction and a growth find its slot without hashing it again
    V value{};
  };
  // entry: the ring position + 1 (0: empty). hash: the id's, which places the slot
  // (its low bits) and spares a probe the ids' comparison where they differ.
  struct Slot {
    std::uint32_t entry = 0;
    std::uint32_t hash = 0;
  };

  static std::uint32_t hash(std::string_view id) {
    return static_cast<std::uint32_t>(std::hash<std::string_view>{}(id));
  }
  std::size_t home(std::uint32_t h) const { return h & (slots_.size() - 1); }
  std::size_t next(std::size_t i) const { return (i + 1) & (slots_.size() - 1); }

  const V* find(std::string_view id, std::uint32_t h) const {
    if (count_ == 0) return nullptr;
    for (std::size_t i = home(h);; i = next(i)) {
      const Slot s = slots_[i];
      if (s.entry == 0) return nullptr;
      if (s.hash != h) continue;
      const Entry& e = ring_[s.entry - 1];
      if (e.id == id) return &e.value;
    }
  }

  void append(std::string_view id, std::uint32_t h, V value) {
    if (count_ == ring_.size()) grow();
    const std::size_t at = (head_ + count_) & (ring_.size() - 1);
    Entry& e = ring_[at];
    e.id.assign(id);
    e.hash = h;
    e.value = std::move(value);
    index(at, h);
    ++count_;
  }

  void index(std::size_t at, std::uint32_t h) {
    std::size_t i = home(h);
    while (slots_[i].entry != 0) i = next(i);
    slots_[i] = Slot{static_cast<std::uint32_t>(at + 1), h};
  }

  // Removes ring position `at`'s slot, then shifts back the slots after it that
  // probed past it, so that no probe meets a hole before its entry.
  void unindex(std::size_t at, std::uint32_t h) {
    std::size_t hole = home(h);
    while (slots_[hole].entry != at + 1) hole = next(hole);
    for (std::size_t i = next(hole); slots_[i].entry != 0; i = next(i)) {
      const std::size_t want = home(slots_[i].hash);
      // Movable when its home is not in (hole, i], cyclically.
      const bool home_after_hole = hole <= i ? (want > hole && want <= i) : (want > hole || want <= i);
      if (home_after_hole) continue;
      slots_[hole] = slots_[i];
      hole = i;
    }
    slots_[hole] = Slot{};
  }

  // Full: twice the ring (the oldest entry first) and twice the index, which keeps
  // the index at most half full.
  void grow() {
    if (ring_.size() >= kMaxRing) throw std::length_error("RecentTable holds at most 2^31 entries");
    std::vector<Entry> bigger(ring_.empty() ? kFirstRing : ring_.size() * 2);
    for (std::size_t k = 0; k < count_; ++k) bigger[k] = std::move(ring_[(head_ + k) & (ring_.size() - 1)]);
    ring_ = std::move(bigger);
    head_ = 0;
    slots_.assign(ring_.size() * 2, Slot{});
    for (std::size_t at = 0; at < count_; ++at) index(at, ring_[at].hash);
  }

  std::vector<Entry> ring_;  // a power of two
  std::vector<Slot> slots_;  // twice the ring
  std::size_t head_ = 0;     // the oldest entry's ring position
  std::size_t count_ = 0;
};

}  // namespace ecx
