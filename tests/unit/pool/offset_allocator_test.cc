#include "ecx/pool/offset_allocator.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

namespace ecx::pool {
namespace {

TEST(OffsetAllocator, RoundsCapacityDownAndSizesUpToTheAlignment) {
  OffsetAllocator allocator(1000, 256);
  EXPECT_EQ(allocator.capacity(), 768u);
  auto slot = allocator.allocate(1);
  ASSERT_TRUE(slot);
  EXPECT_EQ(slot->offset, 0u);
  EXPECT_EQ(slot->size, 256u);
  EXPECT_EQ(allocator.used_bytes(), 256u);
}

TEST(OffsetAllocator, RejectsZeroAndOversizedRequests) {
  OffsetAllocator allocator(4096, 64);
  EXPECT_EQ(allocator.allocate(0).status().code(), StatusCode::invalid_argument);
  EXPECT_EQ(allocator.allocate(4097).status().code(), StatusCode::invalid_argument);
  EXPECT_EQ(allocator.allocate(UINT64_MAX).status().code(), StatusCode::invalid_argument);
  EXPECT_TRUE(allocator.allocate(4096));
}

TEST(OffsetAllocator, ExhaustionIsANormalResult) {
  OffsetAllocator allocator(1024, 256);
  std::vector<Slot> slots;
  slots.reserve(4);
  for (int i = 0; i < 4; ++i) slots.push_back(*allocator.allocate(200));
  auto more = allocator.allocate(1);
  EXPECT_EQ(more.status().code(), StatusCode::resource_exhausted);
  EXPECT_TRUE(allocator.free(slots[2]));
  EXPECT_EQ(allocator.allocate(256)->offset, 512u);
}

TEST(OffsetAllocator, FreeOfASlotThatIsNotLiveChangesNothing) {
  OffsetAllocator allocator(4096, 256);
  auto slot = *allocator.allocate(300);
  const auto before = allocator.stats();
  EXPECT_EQ(allocator.free(Slot{slot.offset, 256}).code(), StatusCode::internal);  // wrong size
  EXPECT_EQ(allocator.free(Slot{1024, 256}).code(), StatusCode::internal);         // never allocated
  EXPECT_EQ(allocator.stats().used_bytes, before.used_bytes);
  EXPECT_TRUE(allocator.free(slot));
  EXPECT_EQ(allocator.free(slot).code(), StatusCode::internal);  // double free
  EXPECT_EQ(allocator.used_bytes(), 0u);
}

TEST(OffsetAllocator, CoalescesWithBothNeighbours) {
  OffsetAllocator allocator(std::uint64_t{4} * 256, 256);
  auto a = *allocator.allocate(256);
  auto b = *allocator.allocate(256);
  auto c = *allocator.allocate(256);
  auto d = *allocator.allocate(256);
  ASSERT_TRUE(allocator.free(a));
  ASSERT_TRUE(allocator.free(c));
  EXPECT_EQ(allocator.stats().free_block_count, 2u);
  EXPECT_DOUBLE_EQ(allocator.stats().fragmentation, 0.5);
  ASSERT_TRUE(allocator.free(b));  // joins a and c
  EXPECT_EQ(allocator.stats().free_block_count, 1u);
  EXPECT_EQ(allocator.stats().largest_free_block, 768u);
  EXPECT_DOUBLE_EQ(allocator.stats().fragmentation, 0.0);
  ASSERT_TRUE(allocator.free(d));
  EXPECT_EQ(allocator.stats().largest_free_block, 1024u);
}

TEST(OffsetAllocator, PicksTheBestFittingBlock) {
  OffsetAllocator allocator(std::uint64_t{10} * 256, 256);
  std::vector<Slot> slots;
  slots.reserve(10);
  for (int i = 0; i < 10; ++i) slots.push_back(*allocator.allocate(256));
  // Free blocks of 3, 1 and 2 slots (with live slots between them).
  ASSERT_TRUE(allocator.free(slots[0]));
  ASSERT_TRUE(allocator.free(slots[1]));
  ASSERT_TRUE(allocator.free(slots[2]));
  ASSERT_TRUE(allocator.free(slots[4]));
  ASSERT_TRUE(allocator.free(slots[6]));
  ASSERT_TRUE(allocator.free(slots[7]));
  EXPECT_EQ(allocator.allocate(256)->offset, slots[4].offset);
  EXPECT_EQ(allocator.allocate(512)->offset, slots[6].offset);
  EXPECT_EQ(allocator.allocate(700)->offset, slots[0].offset);
}

// Random allocate/free against a reference model of which bytes are taken.
TEST(OffsetAllocator, MatchesAReferenceModelUnderRandomTraffic) {
  for (const std::uint64_t alignment : {8ULL, 256ULL, 4096ULL}) {
    const std::uint64_t capacity = 1 << 20;
    OffsetAllocator allocator(capacity, alignment);
    std::mt19937_64 rng(alignment);
    std::map<std::uint64_t, std::uint64_t> live;  // model: offset -> size
    std::uint64_t model_used = 0;
    auto model_fits = [&](std::uint64_t size) {
      // Is there any gap of `size` bytes between live slots?
      std::uint64_t cursor = 0;
      for (const auto& [offset, slot_size] : live) {
        if (offset - cursor >= size) return true;
        cursor = offset + slot_size;
      }
      return capacity - cursor >= size;
    };
    for (int step = 0; step < 20000; ++step) {
      const bool do_alloc = live.empty() || (rng() % 100) < 55;
      if (do_alloc) {
        const std::uint64_t request = 1 + rng() % (std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? 200000 : 9000);
        const std::uint64_t rounded = (request + alignment - 1) / alignment * alignment;
        auto slot = allocator.allocate(request);
        if (!slot) {
          ASSERT_EQ(slot.status().code(), StatusCode::resource_exhausted);
          ASSERT_FALSE(model_fits(rounded)) << "allocator refused " << rounded << " bytes that fit";
          continue;
        }
        ASSERT_EQ(slot->size, rounded);
        ASSERT_EQ(slot->offset % alignment, 0u);
        ASSERT_LE(slot->offset + slot->size, capacity);
        auto next = live.lower_bound(slot->offset);
        if (next != live.end()) {
          ASSERT_LE(slot->offset + slot->size, next->first) << "overlaps the next slot";
        }
        if (next != live.begin()) {
          auto prev = std::prev(next);
          ASSERT_LE(prev->first + prev->second, slot->offset) << "overlaps the previous slot";
        }
        live.emplace(slot->offset, slot->size);
        model_used += slot->size;
      } else {
        auto victim = live.begin();
        std::advance(victim, static_cast<long>(rng() % live.size()));
        ASSERT_TRUE(allocator.free(Slot{victim->first, victim->second}));
        model_used -= victim->second;
        live.erase(victim);
      }
      const auto stats = allocator.stats();
      ASSERT_EQ(stats.used_bytes, model_used);
      ASSERT_EQ(stats.live_slots, live.size());
      ASSERT_EQ(stats.free_bytes, capacity - model_used);
      ASSERT_GE(stats.fragmentation, 0.0);
      ASSERT_LT(stats.fragmentation, 1.0);
    }
    for (const auto& [offset, size] : live) ASSERT_TRUE(allocator.free(Slot{offset, size}));
    const auto empty = allocator.stats();
    EXPECT_EQ(empty.free_block_count, 1u) << "free space did not coalesce fully";
    EXPECT_EQ(empty.largest_free_block, capacity);
    EXPECT_EQ(empty.used_bytes, 0u);
    EXPECT_DOUBLE_EQ(empty.fragmentation, 0.0);
    EXPECT_EQ(allocator.allocate(capacity)->offset, 0u);
  }
}

}  // namespace
}  // namespace ecx::pool
