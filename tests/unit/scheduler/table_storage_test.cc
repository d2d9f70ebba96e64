#include "ecx/connector/scheduler/table_storage.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

namespace ecx::scheduler::detail {
namespace {

// Keys owned by the test, indexed by their position in `keys`.
struct KeyedIndex {
  std::uint32_t find(const std::string& key, std::uint64_t hash) const {
    return index.find(hash, [&](std::uint32_t id) { return keys[id] == key; });
  }
  std::uint32_t find(const std::string& key) const { return find(key, key_hash(key)); }
  std::uint32_t add(std::string key, std::uint64_t hash) {
    keys.push_back(std::move(key));
    const auto id = static_cast<std::uint32_t>(keys.size() - 1);
    index.insert(hash, id);
    return id;
  }
  std::uint32_t add(const std::string& key) { return add(key, key_hash(key)); }
  FlatIndex index;
  std::vector<std::string> keys;
};

TEST(FlatIndex, AnEmptyIndexFindsNothing) {
  KeyedIndex k;
  EXPECT_EQ(k.find("a"), kNoId);
  EXPECT_FALSE(k.index.erase(key_hash("a"), 0));
  EXPECT_EQ(k.index.size(), 0u);
}

TEST(FlatIndex, FindsWhatWasInsertedAcrossGrowthAndKeepsTheLoadAtMostHalf) {
  KeyedIndex k;
  for (int i = 0; i < 5000; ++i) {
    k.add("key-" + std::to_string(i));
    ASSERT_LE(k.index.size() * 2, k.index.capacity());
  }
  EXPECT_EQ(k.index.size(), 5000u);
  for (std::uint32_t i = 0; i < 5000; ++i) ASSERT_EQ(k.find(k.keys[i]), i);
  EXPECT_EQ(k.find("key-5000"), kNoId);
  EXPECT_EQ(k.find("key-"), kNoId);
}

TEST(FlatIndex, ErasingFromTheMiddleOfACollidingRunKeepsTheRestReachable) {
  // Every key has the same hash: one run of entries, each found by its key.
  KeyedIndex k;
  for (int i = 0; i < 6; ++i) k.add("c" + std::to_string(i), 7);
  ASSERT_TRUE(k.index.erase(7, 2));
  ASSERT_TRUE(k.index.erase(7, 0));
  EXPECT_FALSE(k.index.erase(7, 2));  // already gone
  for (std::uint32_t i : {1u, 3u, 4u, 5u}) EXPECT_EQ(k.find(k.keys[i], 7), i) << i;
  for (std::uint32_t i : {0u, 2u}) EXPECT_EQ(k.find(k.keys[i], 7), kNoId) << i;
  EXPECT_EQ(k.index.size(), 4u);
}

TEST(FlatIndex, RunsThatWrapAroundTheEndShiftBackCorrectly) {
  // Capacity 16 (the first growth): home slots 14 and 15 make runs that wrap
  // to slot 0 and beyond.
  KeyedIndex k;
  const std::vector<std::uint64_t> hashes = {15, 14, 15, 0, 14, 1, 15};
  for (std::size_t i = 0; i < hashes.size(); ++i) k.add("w" + std::to_string(i), hashes[i]);
  ASSERT_EQ(k.index.capacity(), 16u);
  std::vector<bool> erased(hashes.size(), false);
  for (std::uint32_t victim : {1u, 0u, 4u, 6u}) {
    ASSERT_TRUE(k.index.erase(hashes[victim], victim));
    erased[victim] = true;
    for (std::uint32_t i = 0; i < hashes.size(); ++i) {
      EXPECT_EQ(k.find(k.keys[i], hashes[i]), erased[i] ? kNoId : i) << "after erasing " << victim << ", key " << i;
    }
  }
}

TEST(FlatIndex, AgreesWithAMapOverRandomChurnWithManyCollisions) {
  for (std::uint32_t seed = 1; seed <= 200; ++seed) {
    std::mt19937 rng(seed);
    KeyedIndex k;
    std::unordered_map<std::string, std::uint32_t> model;
    // A weak hash (64 values) so that runs are long and erasures shift a lot.
    auto weak = [](const std::string& key) { return key_hash(key) & 63u; };
    for (int step = 0; step < 400; ++step) {
      const std::string key = "k" + std::to_string(rng() % 120);
      auto it = model.find(key);
      if (it == model.end()) {
        model.emplace(key, k.add(key, weak(key)));
      } else {
        ASSERT_TRUE(k.index.erase(weak(key), it->second)) << "seed " << seed;
        model.erase(it);
      }
      ASSERT_EQ(k.index.size(), model.size()) << "seed " << seed;
      for (int probe = 0; probe < 120; ++probe) {
        const std::string p = "k" + std::to_string(probe);
        auto m = model.find(p);
        ASSERT_EQ(k.find(p, weak(p)), m == model.end() ? kNoId : m->second) << "seed " << seed << " key " << p;
      }
    }
  }
}

TEST(Pool, ReusesTheMostRecentlyReleasedObjectAsItWasLeft) {
  Pool<std::string, 2> pool;  // chunks of 4
  const std::uint32_t a = pool.acquire();
  const std::uint32_t b = pool.acquire();
  EXPECT_NE(a, b);
  pool[b] = "kept";
  pool.release(a);
  pool.release(b);
  EXPECT_EQ(pool.in_use(), 0u);
  EXPECT_EQ(pool.acquire(), b);
  EXPECT_EQ(pool[b], "kept");  // not destroyed: the caller resets what it reuses
  EXPECT_EQ(pool.acquire(), a);
  EXPECT_EQ(pool.in_use(), 2u);
}

TEST(Pool, AddressesStayStableAsItGrowsAndForEachVisitsEveryObjectHandedOut) {
  Pool<int, 2> pool;
  std::vector<std::uint32_t> ids;
  std::vector<const int*> addresses;
  for (int i = 0; i < 11; ++i) {
    ids.push_back(pool.acquire());
    pool[ids.back()] = i;
    addresses.push_back(&pool[ids.back()]);
  }
  std::vector<std::uint32_t> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_TRUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
  for (int i = 0; i < 11; ++i) {
    EXPECT_EQ(&pool[ids[static_cast<std::size_t>(i)]], addresses[static_cast<std::size_t>(i)]);
    EXPECT_EQ(pool[ids[static_cast<std::size_t>(i)]], i);
  }
  int visited = 0;
  int sum = 0;
  pool.for_each([&](const int& v) {
    ++visited;
    sum += v;
  });
  EXPECT_EQ(visited, 11);
  EXPECT_EQ(sum, 55);
}

}  // namespace
}  // namespace ecx::scheduler::detail
