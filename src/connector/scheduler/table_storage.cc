#include "ecx/connector/scheduler/table_storage.h"

#include <utility>

namespace ecx::scheduler::detail {

void FlatIndex::insert(std::uint64_t hash, std::uint32_t id) {
  if ((size_ + 1) * 2 > slots_.size()) grow();
  place(Slot{static_cast<std::uint32_t>(hash), id});
  ++size_;
}

void FlatIndex::place(Slot slot) {
  std::size_t i = slot.tag & mask_;
  while (slots_[i].id != kNoId) i = (i + 1) & mask_;
  slots_[i] = slot;
}

void FlatIndex::grow() {
  std::vector<Slot> old = std::exchange(slots_, std::vector<Slot>(slots_.empty() ? 16 : slots_.size() * 2));
  mask_ = slots_.size() - 1;
  for (const Slot& slot : old) {
    if (slot.id != kNoId) place(slot);
  }
}

bool FlatIndex::erase(std::uint64_t hash, std::uint32_t id) {
  if (slots_.empty()) return false;
  const auto tag = static_cast<std::uint32_t>(hash);
  std::size_t hole = tag & mask_;
  while (slots_[hole].id != id) {
    if (slots_[hole].id == kNoId) return false;
    hole = (hole + 1) & mask_;
  }
  // Backward shift: pull each later entry of the run into the hole unless that
  // would move it before its home slot.
  for (std::size_t next = (hole + 1) & mask_; slots_[next].id != kNoId; next = (next + 1) & mask_) {
    const std::size_t home = slots_[next].tag & mask_;
    if (((next - home) & mask_) >= ((next - hole) & mask_)) {
      slots_[hole] = slots_[next];
      hole = next;
    }
  }
  slots_[hole] = Slot{};
  --size_;
  return true;
}

}  // namespace ecx::scheduler::detail
