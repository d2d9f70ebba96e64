#pragma once
// Storage behind TransferTable, built so that a table of 100,000 records costs
// per operation what a table of 100 does: no node per entry, no pointer chase
// through unrelated entries, no allocation per record once the table has reached
// its size. Internal to the scheduler (namespace detail); tested on its own.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

namespace ecx::scheduler::detail {

inline constexpr std::uint32_t kNoId = UINT32_MAX;

// Every key is hashed once per operation and the hash kept beside the key.
inline std::uint64_t key_hash(std::string_view key) noexcept { return std::hash<std::string_view>{}(key); }

// Open addressing with linear probing from a precomputed 64-bit key hash to a
// 32-bit id. A slot holds the hash's low 32 bits beside the id (8 bytes, eight
// slots per cache line), so a lookup reads one line of slots and the keyed
// object only when the stored hash bits match. The caller owns the keys:
// `matches(id)` says whether `id` holds the key looked up. Erasing shifts the
// following run back instead of leaving a tombstone, so probe lengths depend on
// the load alone, never on past churn. The load stays at or below 1/2; the slot
// array doubles when it would exceed that (amortised O(1)) and never shrinks.
class FlatIndex {
 public:
  template <typename Matches>
  std::uint32_t find(std::uint64_t hash, Matches&& matches) const {
    if (slots_.empty()) return kNoId;
    const auto tag = static_cast<std::uint32_t>(hash);
    for (std::size_t i = tag & mask_;; i = (i + 1) & mask_) {
      const Slot slot = slots_[i];
      if (slot.id == kNoId) return kNoId;
      if (slot.tag == tag && matches(slot.id)) return slot.id;
    }
  }
  // Starts loading the slot a lookup of `hash` reads first, so that independent
  // lookups wait for memory together rather than one after the other.
  void prefetch(std::uint64_t hash) const noexcept {
    if (!slots_.empty()) __builtin_prefetch(&slots_[hash & mask_]);
  }
  // `id` must not be in the index yet.
  void insert(std::uint64_t hash, std::uint32_t id);
  // Removes `id` (stored under `hash`); false when it is not there.
  bool erase(std::uint64_t hash, std::uint32_t id);
  std::size_t size() const noexcept { return size_; }
  std::size_t capacity() const noexcept { return slots_.size(); }

 private:
  struct Slot {
    std::uint32_t tag = 0;
    std::uint32_t id = kNoId;
  };
  void place(Slot slot);
  void grow();

  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

// Objects in fixed-size chunks, addressed by a 32-bit id, at stable addresses.
// A released object is not destroyed: the next acquire hands back the most
// recently released one (still warm in the cache) with its members' capacity
// (strings, vectors) intact, so a steady table allocates nothing per record.
// The caller resets what it reuses.
template <typename T, unsigned kChunkBits = 8>
class Pool {
 public:
  std::uint32_t acquire() {
    if (!free_.empty()) {
      const std::uint32_t id = free_.back();
      free_.pop_back();
      ++in_use_;
      return id;
    }
    if (chunks_.empty() || used_in_last_ == kChunk) {
      chunks_.push_back(std::make_unique<T[]>(kChunk));
      used_in_last_ = 0;
    }
    const std::size_t id = (chunks_.size() - 1) << kChunkBits | used_in_last_;
    ++used_in_last_;
    ++in_use_;
    return static_cast<std::uint32_t>(id);
  }
  void release(std::uint32_t id) {
    free_.push_back(id);
    --in_use_;
  }
  T& operator[](std::uint32_t id) noexcept { return chunks_[id >> kChunkBits][id & (kChunk - 1)]; }
  const T& operator[](std::uint32_t id) const noexcept { return chunks_[id >> kChunkBits][id & (kChunk - 1)]; }
  std::size_t in_use() const noexcept { return in_use_; }
  // Visits every object ever handed out, released ones included (the caller
  // marks which are in use). O(capacity).
  template <typename F>
  void for_each(F&& visit) const {
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      const std::size_t n = c + 1 == chunks_.size() ? used_in_last_ : kChunk;
      for (std::size_t i = 0; i < n; ++i) visit(chunks_[c][i]);
    }
  }

 private:
  static constexpr std::size_t kChunk = std::size_t{1} << kChunkBits;
  std::vector<std::unique_ptr<T[]>> chunks_;
  std::size_t used_in_last_ = 0;
  std::vector<std::uint32_t> free_;
  std::size_t in_use_ = 0;
};

}  // namespace ecx::scheduler::detail
