#pragma once
// Carves slots out of one registered slab by offset. Exhaustion is a normal result
// (StatusCode::resource_exhausted), not an exception. Not thread-safe: the owner of
// the pool (e.g. the reservation manager) serialises calls under its own lock.

#include <cstdint>
#include <map>
#include <set>
#include <utility>

#include "ecx/core/node_stash.h"
#include "ecx/core/status.h"

namespace ecx::pool {

struct Slot {
  std::uint64_t offset = 0;  // from the start of the slab, a multiple of the alignment
  std::uint64_t size = 0;    // bytes reserved: the request rounded up to the alignment
  friend bool operator==(const Slot&, const Slot&) = default;
};

struct AllocatorStats {
  std::uint64_t capacity = 0;
  std::uint64_t used_bytes = 0;
  std::uint64_t free_bytes = 0;
  std::uint64_t largest_free_block = 0;
  std::uint64_t free_block_count = 0;
  std::uint64_t live_slots = 0;
  // 1 - largest_free_block / free_bytes (0 when free space is one block or none).
  double fragmentation = 0.0;
};

class OffsetAllocator {
 public:
  // alignment: a power of two; capacity is rounded down to it.
  OffsetAllocator(std::uint64_t capacity, std::uint64_t alignment);

  // O(log n). nbytes > 0. resource_exhausted when no free block fits,
  // invalid_argument for 0 or more than the capacity.
  Result<Slot> allocate(std::uint64_t nbytes);
  // O(log n); coalesces with both neighbours. Freeing a slot that is not live is a
  // logged internal error that changes nothing (returns that Status).
  Status free(const Slot& slot);

  std::uint64_t capacity() const noexcept { return capacity_; }
  std::uint64_t alignment() const noexcept { return alignment_; }
  std::uint64_t used_bytes() const noexcept { return used_; }
  AllocatorStats stats() const;

 private:
  using OffsetMap = std::map<std::uint64_t, std::uint64_t>;
  using SizeSet = std::set<std::pair<std::uint64_t, std::uint64_t>>;

  std::uint64_t capacity_;
  std::uint64_t alignment_;
  std::uint64_t used_ = 0;
  void insert_free(std::uint64_t offset, std::uint64_t size);
  void erase_free(OffsetMap::iterator block);

  OffsetMap free_by_offset_;  // offset -> size
  // (size, offset): best fit is the first entry not smaller than the request, and
  // removing one exact block stays O(log n) however many blocks share a size.
  SizeSet free_by_size_;
  OffsetMap live_;  // offset -> size
  // Each allocate/free pair made and dropped three or four tree nodes, and pools are
  // carved once or twice per transfer: the nodes are reused.
  NodeStash<OffsetMap> map_nodes_;  // free_by_offset_ and live_
  NodeStash<SizeSet> size_nodes_;
};

}  // namespace ecx::pool
