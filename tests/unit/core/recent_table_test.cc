#include "ecx/core/recent_table.h"

#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>

namespace ecx {
namespace {

TEST(RecentTable, FindsWhatItHoldsOldestFirst) {
  RecentTable<int> t;
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.find("a"), nullptr);
  t.push_back("a", 1);
  t.push_back("b", 2);
  ASSERT_NE(t.find("a"), nullptr);
  EXPECT_EQ(*t.find("a"), 1);
  EXPECT_EQ(*t.find("b"), 2);
  EXPECT_FALSE(t.contains("c"));
  EXPECT_EQ(t.front_id(), "a");
  EXPECT_EQ(t.front(), 1);
  t.pop_front();
  EXPECT_FALSE(t.contains("a"));
  EXPECT_TRUE(t.contains("b"));
  EXPECT_EQ(t.front_id(), "b");
  EXPECT_EQ(t.size(), 1u);
  EXPECT_FALSE(t.try_push_back("b", 3));  // there already: kept as it was
  EXPECT_EQ(*t.find("b"), 2);
  EXPECT_TRUE(t.try_push_back("a", 4));
  EXPECT_EQ(*t.find("a"), 4);
  EXPECT_EQ(t.size(), 2u);
}

TEST(RecentTable, KeepsEveryEntryAcrossGrowthAndWrapAround) {
  RecentTable<std::uint64_t> t;
  // Fill past several doublings with the head moved off the ring's start, so the
  // growth copies a wrapped ring.
  for (std::uint64_t i = 0; i < 20; ++i) t.push_back("id-" + std::to_string(i), i);
  for (int i = 0; i < 10; ++i) t.pop_front();
  for (std::uint64_t i = 20; i < 3000; ++i) t.push_back("id-" + std::to_string(i), i);
  EXPECT_EQ(t.size(), 2990u);
  for (std::uint64_t i = 0; i < 3000; ++i) {
    const auto* v = t.find("id-" + std::to_string(i));
    if (i < 10) {
      EXPECT_EQ(v, nullptr) << i;
    } else {
      ASSERT_NE(v, nullptr) << i;
      EXPECT_EQ(*v, i);
    }
  }
  EXPECT_EQ(t.front_id(), "id-10");
}

// A bounded window of ids, as the producer and the scheduler use it, against a
// reference: every lookup agrees after each insert and eviction. Small bounds keep
// the index crowded, so evictions shift probe runs back, across the index's end too.
TEST(RecentTable, AgreesWithAReferenceOverRandomWindows) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    const std::size_t bound = 1 + rng() % 200;
    RecentTable<std::uint64_t> t;
    std::deque<std::string> order;
    std::map<std::string, std::uint64_t> reference;
    for (std::uint64_t step = 0; step < 5000; ++step) {
      const std::string id = "t" + std::to_string(rng() % 4000);
      const auto* found = t.find(id);
      const auto expected = reference.find(id);
      ASSERT_EQ(found != nullptr, expected != reference.end()) << "seed " << seed << " step " << step << " " << id;
      if (found != nullptr) {
        ASSERT_EQ(*found, expected->second);
        ASSERT_FALSE(t.try_push_back(id, step));
        continue;
      }
      if (seed % 2 == 0) {
        ASSERT_TRUE(t.try_push_back(id, step));
      } else {
        t.push_back(id, step);
      }
      order.push_back(id);
      reference[id] = step;
      while (order.size() > bound || (rng() % 7 == 0 && !order.empty())) {
        ASSERT_EQ(t.front_id(), order.front());
        ASSERT_EQ(t.front(), reference[order.front()]);
        t.pop_front();
        reference.erase(order.front());
        order.pop_front();
      }
      ASSERT_EQ(t.size(), order.size());
    }
    for (const auto& [id, v] : reference) {
      ASSERT_NE(t.find(id), nullptr) << id;
      EXPECT_EQ(*t.find(id), v);
    }
  }
}

TEST(RecentTable, AnEvictedEntrysValueIsReleased) {
  RecentTable<std::shared_ptr<int>> t;
  auto held = std::make_shared<int>(7);
  t.push_back("a", held);
  EXPECT_EQ(held.use_count(), 2);
  t.pop_front();
  EXPECT_EQ(held.use_count(), 1);
}

}  // namespace
}  // namespace ecx
