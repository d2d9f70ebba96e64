// The slot store on its own: allocation, holders, open writes, followers, the
// resident LRU with its cap, leases and the checksum, each checked against the
// store's own invariants.

#include "consumer/slot_store.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <unordered_map>
#include <vector>

#include <xxhash.h>

#include "ecx/core/tensor_spec.h"

namespace ecx::consumer::detail {
namespace {

TensorSpec bytes_spec(std::int64_t n) { return TensorSpec::make({n}, DType::uint8, 1ULL << 40).value(); }

class SlotStoreTest : public ::testing::Test {
 protected:
  static constexpr std::uint64_t kSlab = 4096;
  static constexpr std::uint64_t kAlign = 256;

  explicit SlotStoreTest(std::uint64_t resident_capacity = 0) : slab_(kSlab), store_(options(resident_capacity)) {}

  SlotStoreOptions options(std::uint64_t resident_capacity) {
    SlotStoreOptions o;
    o.slab_base = slab_.data();
    o.slab_size = kSlab;
    o.alignment = kAlign;
    o.resident_capacity_bytes = resident_capacity;
    o.reclaimed_max = 2;
    return o;
  }

  SlotId fill(const std::string& hash, std::int64_t nbytes, bool write_open = false,
              std::optional<std::uint64_t> checksum = std::nullopt) {
    Result<SlotId> id = store_.allocate_filling(hash, bytes_spec(nbytes), "writer-" + hash, checksum, write_open);
    EXPECT_TRUE(id.is_ok()) << id.status().to_string();
    return id.is_ok() ? *id : kNoSlot;
  }

  // `records`: slot id -> how many records the test pretends hold it.
  void expect_consistent(const std::unordered_map<SlotId, std::uint64_t>& records) {
    const Status slots = store_.check_slots();
    EXPECT_TRUE(slots.is_ok()) << slots.to_string();
    const Status holders = store_.check_holders(records);
    EXPECT_TRUE(holders.is_ok()) << holders.to_string();
  }

  std::vector<std::byte> slab_;
  SlotStore store_;
};

TEST_F(SlotStoreTest, AllocatesAlignedFillingSlotHeldByItsWriter) {
  const SlotId id = fill("a", 300);
  ASSERT_NE(id, kNoSlot);
  const SlotEntry& e = store_.at(id);
  EXPECT_EQ(e.slot.offset % kAlign, 0u);
  EXPECT_EQ(e.slot.size, 512u);  // rounded up to the alignment
  EXPECT_EQ(e.holders, 1u);
  EXPECT_EQ(e.content, SlotContent::filling);
  EXPECT_TRUE(store_.filled_by(id, "writer-a"));
  EXPECT_FALSE(store_.filled_by(id, "someone-else"));
  EXPECT_EQ(store_.filling("a"), id);
  EXPECT_EQ(store_.resident("a"), kNoSlot);
  EXPECT_EQ(store_.used_bytes(), 512u);
  EXPECT_EQ(store_.data(id), slab_.data() + e.slot.offset);
  expect_consistent({{id, 1}});
}

TEST_F(SlotStoreTest, ReleasingAnUnlandedSlotFreesIt) {
  const SlotId id = fill("a", 256);
  store_.release(id);
  EXPECT_FALSE(store_.contains(id));
  EXPECT_EQ(store_.filling("a"), kNoSlot);
  EXPECT_EQ(store_.used_bytes(), 0u);
  expect_consistent({});
}

TEST_F(SlotStoreTest, AnOpenWriteKeepsTheSlotUntilItCloses) {
  const SlotId id = fill("a", 256, /*write_open=*/true);
  EXPECT_EQ(store_.open_writes(), 1u);
  store_.release(id);  // the record let go; the writer may still be writing
  ASSERT_TRUE(store_.contains(id));
  expect_consistent({});
  EXPECT_TRUE(store_.close_write(id));
  EXPECT_FALSE(store_.close_write(id));
  EXPECT_EQ(store_.open_writes(), 0u);
  ASSERT_TRUE(store_.contains(id));  // closing frees nothing by itself
  store_.settle(id);
  EXPECT_FALSE(store_.contains(id));
  store_.settle(id);  // a slot already gone is ignored
  expect_consistent({});
}

TEST_F(SlotStoreTest, LandingMakesTheResidentCopyAndHandsBackFollowers) {
  const SlotId id = fill("a", 256);
  store_.hold(id);
  store_.add_follower(id, "f1");
  store_.hold(id);
  store_.add_follower(id, "f2");
  store_.remove_follower(id, "f1");
  EXPECT_EQ(store_.at(id).followers, std::vector<std::string>{"f2"});
  EXPECT_EQ(store_.land(id), std::vector<std::string>{"f2"});
  EXPECT_EQ(store_.at(id).content, SlotContent::landed);
  EXPECT_EQ(store_.filling("a"), kNoSlot);
  EXPECT_EQ(store_.resident("a"), id);
  EXPECT_EQ(store_.resident_entries(), 1u);
  EXPECT_EQ(store_.resident_bytes(), 256u);
  store_.remove_follower(id, "f2");  // landed: no follower list any more, a no-op
  expect_consistent({{id, 3}});

  for (int i = 0; i < 3; ++i) store_.release(id);
  ASSERT_TRUE(store_.contains(id));  // idle resident copy, in the LRU
  EXPECT_TRUE(store_.at(id).in_lru);
  store_.hold(id);
  EXPECT_FALSE(store_.at(id).in_lru);
  expect_consistent({{id, 1}});
}

TEST_F(SlotStoreTest, LosingAFillingReturnsFollowersAndFreesOnLastRelease) {
  const SlotId id = fill("a", 256);
  store_.hold(id);
  store_.add_follower(id, "f1");
  EXPECT_EQ(store_.lose(id), std::vector<std::string>{"f1"});
  EXPECT_EQ(store_.at(id).content, SlotContent::dead);
  EXPECT_EQ(store_.filling("a"), kNoSlot);
  EXPECT_EQ(store_.resident("a"), kNoSlot);
  store_.release(id);
  store_.release(id);
  EXPECT_FALSE(store_.contains(id));
  expect_consistent({});
}

TEST_F(SlotStoreTest, ANewerLandingReplacesTheResidentCopy) {
  const SlotId old_id = fill("a", 256);
  store_.land(old_id);
  store_.lease(old_id);  // a worker still reads the old copy
  store_.release(old_id);
  const SlotId new_id = fill("a", 256);
  store_.land(new_id);
  EXPECT_EQ(store_.resident("a"), new_id);
  EXPECT_EQ(store_.resident_entries(), 1u);
  EXPECT_EQ(store_.resident_bytes(), 256u);
  ASSERT_TRUE(store_.contains(old_id));
  store_.release_lease(old_id);
  EXPECT_FALSE(store_.contains(old_id));  // no longer canonical: freed, not kept
  store_.release(new_id);
  EXPECT_TRUE(store_.contains(new_id));
  expect_consistent({});
}

TEST_F(SlotStoreTest, AFullPoolReclaimsIdleResidentsOldestFirst) {
  // 4096 bytes: four idle residents of 1024 fill the pool.
  std::vector<SlotId> ids;
  for (const char* hash : {"a", "b", "c", "d"}) {
    const SlotId id = fill(hash, 1024);
    store_.land(id);
    store_.release(id);
    ids.push_back(id);
  }
  store_.hold(ids[0]);  // "a" is in use again (and now the newest when released)
  store_.release(ids[0]);
  const SlotId e = fill("e", 2048);  // reclaims b, then c
  EXPECT_NE(e, kNoSlot);
  EXPECT_FALSE(store_.contains(ids[1]));
  EXPECT_FALSE(store_.contains(ids[2]));
  EXPECT_TRUE(store_.contains(ids[0]));
  EXPECT_TRUE(store_.contains(ids[3]));
  EXPECT_EQ(store_.residents_reclaimed(), 2u);
  EXPECT_EQ(store_.drain_reclaimed(), (std::vector<std::string>{"b", "c"}));
  EXPECT_TRUE(store_.drain_reclaimed().empty());
  expect_consistent({{e, 1}});
}

TEST_F(SlotStoreTest, ExhaustionIsReportedWhenNothingIdleIsLeft) {
  const SlotId a = fill("a", 4096);
  Result<SlotId> b = store_.allocate_filling("b", bytes_spec(256), "w", std::nullopt, false);
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), StatusCode::resource_exhausted);
  EXPECT_EQ(store_.largest_free_block(), 0u);
  expect_consistent({{a, 1}});
}

class SmallResidentCapTest : public SlotStoreTest {
 protected:
  SmallResidentCapTest() : SlotStoreTest(/*resident_capacity=*/512) {}
};

TEST_F(SmallResidentCapTest, IdleResidentsBeyondTheCapAreReclaimed) {
  std::vector<SlotId> ids;
  for (const char* hash : {"a", "b", "c"}) {
    const SlotId id = fill(hash, 256);
    store_.land(id);
    ids.push_back(id);
  }
  EXPECT_EQ(store_.resident_bytes(), 768u);  // held copies stay, whatever the cap
  for (SlotId id : ids) store_.release(id);
  EXPECT_EQ(store_.resident_bytes(), 512u);
  EXPECT_FALSE(store_.contains(ids[0]));
  EXPECT_EQ(store_.drain_reclaimed(), std::vector<std::string>{"a"});
  expect_consistent({});
}

TEST_F(SmallResidentCapTest, TheReclaimedListKeepsOnlyTheNewest) {
  for (const char* hash : {"a", "b", "c", "d", "e"}) {
    const SlotId id = fill(hash, 512);
    store_.land(id);
    store_.release(id);
  }
  EXPECT_EQ(store_.residents_reclaimed(), 4u);
  EXPECT_EQ(store_.drain_reclaimed(), (std::vector<std::string>{"c", "d"}));  // reclaimed_max = 2
}

TEST_F(SlotStoreTest, LeasesAreHoldersAndAreCounted) {
  const SlotId id = fill("a", 256);
  store_.land(id);
  store_.lease(id);
  store_.lease(id);
  EXPECT_EQ(store_.leases(), 2u);
  EXPECT_EQ(store_.at(id).holders, 3u);
  expect_consistent({{id, 1}});
  store_.release(id);
  store_.release_lease(id);
  store_.release_lease(id);
  store_.release_lease(12345);  // unknown: ignored
  EXPECT_EQ(store_.leases(), 0u);
  EXPECT_TRUE(store_.at(id).in_lru);
  expect_consistent({});
}

TEST_F(SlotStoreTest, ChecksumIsXxh64OfTheSlotBytes) {
  const SlotId id = fill("a", 300, false, 42);
  EXPECT_EQ(store_.at(id).expected_checksum, std::optional<std::uint64_t>(42));
  std::byte* data = store_.data(id);
  for (std::size_t i = 0; i < 300; ++i) data[i] = static_cast<std::byte>(i * 7);
  const SlotBytes bytes = store_.bytes(id, 300);
  EXPECT_EQ(bytes.data, data);
  EXPECT_EQ(bytes.xxh64(), XXH64(data, 300, 0));
}

TEST_F(SlotStoreTest, InvariantsNameAHolderMismatch) {
  const SlotId id = fill("a", 256);
  const Status wrong = store_.check_holders({{id, 2}});
  EXPECT_FALSE(wrong.is_ok());
  EXPECT_NE(wrong.to_string().find("holders"), std::string::npos) << wrong.to_string();
  EXPECT_FALSE(store_.check_holders({}).is_ok());
  EXPECT_TRUE(store_.check_holders({{id, 1}}).is_ok());
}

}  // namespace
}  // namespace ecx::consumer::detail
