#include "ecx/pool/offset_allocator.h"

#include <bit>
#include <string>

#include <fmt/format.h>

#include "core/logging.h"

namespace ecx::pool {
namespace {

std::uint64_t normalised_alignment(std::uint64_t alignment) {
  if (std::has_single_bit(alignment)) return alignment;
  // A precondition violation (config validation rejects it first): keep the
  // allocator usable with the next power of two rather than corrupting offsets.
  const std::uint64_t fixed = alignment == 0 ? 1 : std::bit_ceil(alignment);
  log::get("pool")->error("offset allocator: alignment {} is not a power of two; using {}", alignment, fixed);
  return fixed;
}

}  // namespace

OffsetAllocator::OffsetAllocator(std::uint64_t capacity, std::uint64_t alignment)
    : capacity_(0), alignment_(normalised_alignment(alignment)) {
  capacity_ = capacity - capacity % alignment_;
  if (capacity_ > 0) insert_free(0, capacity_);
}

void OffsetAllocator::insert_free(std::uint64_t offset, std::uint64_t size) {
  map_nodes_.insert(free_by_offset_, offset, size);
  size_nodes_.insert(free_by_size_, std::pair{size, offset});
}

void OffsetAllocator::erase_free(OffsetMap::iterator block) {
  size_nodes_.erase_key(free_by_size_, std::pair{block->second, block->first});
  map_nodes_.erase(free_by_offset_, block);
}

Result<Slot> OffsetAllocator::allocate(std::uint64_t nbytes) {
  if (nbytes == 0) return invalid_argument("cannot allocate 0 bytes");
  if (nbytes > capacity_) {
    return invalid_argument(fmt::format("{} bytes exceed the pool capacity of {} bytes", nbytes, capacity_));
  }
  // nbytes <= capacity_ and capacity_ is a multiple of the alignment, so this cannot overflow.
  const std::uint64_t size = (nbytes + alignment_ - 1) & ~(alignment_ - 1);
  auto best = free_by_size_.lower_bound({size, 0});
  if (best == free_by_size_.end()) {
    return resource_exhausted(fmt::format("no free block of {} bytes (free {} bytes, largest block {} bytes)", size,
                                          capacity_ - used_,
                                          free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first));
  }
  const auto [block_size, offset] = *best;
  size_nodes_.erase(free_by_size_, best);
  map_nodes_.erase_key(free_by_offset_, offset);
  if (block_size > size) insert_free(offset + size, block_size - size);
  map_nodes_.insert(live_, offset, size);
  used_ += size;
  return Slot{offset, size};
}

Status OffsetAllocator::free(const Slot& slot) {
  const auto live = live_.find(slot.offset);
  if (live == live_.end() || live->second != slot.size) {
    auto status =
        internal_error(fmt::format("free of a slot that is not live (offset {}, size {})", slot.offset, slot.size));
    log::get("pool")->error("offset allocator: {}", status.message());
    return status;
  }
  map_nodes_.erase(live_, live);
  used_ -= slot.size;

  std::uint64_t offset = slot.offset;
  std::uint64_t size = slot.size;
  auto next = free_by_offset_.lower_bound(offset);
  if (next != free_by_offset_.end() && next->first == offset + size) {
    size += next->second;
    erase_free(next);
  }
  auto after = free_by_offset_.lower_bound(offset);
  if (after != free_by_offset_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      erase_free(prev);
    }
  }
  insert_free(offset, size);
  return Status::ok();
}

AllocatorStats OffsetAllocator::stats() const {
  AllocatorStats s;
  s.capacity = capacity_;
  s.used_bytes = used_;
  s.free_bytes = capacity_ - used_;
  s.largest_free_block = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  s.free_block_count = free_by_offset_.size();
  s.live_slots = live_.size();
  s.fragmentation =
      s.free_bytes == 0 ? 0.0 : 1.0 - static_cast<double>(s.largest_free_block) / static_cast<double>(s.free_bytes);
  return s;
}

}  // namespace ecx::pool
