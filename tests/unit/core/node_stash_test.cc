#include "ecx/core/node_stash.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>

namespace ecx {
namespace {

TEST(NodeStash, AnErasedNodeServesTheNextInsert) {
  std::set<std::string> ids;
  NodeStash<std::set<std::string>> stash;
  stash.insert(ids, std::string(64, 'a'));
  const std::string* first = &*ids.begin();
  stash.erase(ids, ids.begin());
  EXPECT_TRUE(ids.empty());
  EXPECT_EQ(stash.kept(), 1U);
  const std::string next(64, 'b');
  auto [at, inserted] = stash.insert(ids, std::string_view(next));  // assigned into the kept string
  EXPECT_TRUE(inserted);
  EXPECT_EQ(stash.kept(), 0U);
  EXPECT_EQ(*at, next);
  EXPECT_EQ(&*at, first) << "the kept node was not the one reused";
}

TEST(NodeStash, ADuplicateInUniqueContainerLeavesItAndKeepsTheNode) {
  std::set<int> values{1, 2};
  NodeStash<std::set<int>> stash;
  EXPECT_TRUE(stash.erase_key(values, 2));
  EXPECT_FALSE(stash.erase_key(values, 7));
  auto [at, inserted] = stash.insert(values, 1);  // already there
  EXPECT_FALSE(inserted);
  EXPECT_EQ(*at, 1);
  EXPECT_EQ(values.size(), 1U);
  EXPECT_EQ(stash.kept(), 1U) << "the node the duplicate came in was not kept";
}

TEST(NodeStash, AKeptMapNodeLetsGoOfItsValueAtOnce) {
  std::unordered_map<int, std::shared_ptr<int>> owners;
  NodeStash<std::unordered_map<int, std::shared_ptr<int>>> stash;
  auto value = std::make_shared<int>(5);
  stash.insert(owners, 1, value);
  EXPECT_EQ(value.use_count(), 2);
  stash.erase(owners, owners.find(1));
  EXPECT_EQ(value.use_count(), 1) << "a kept node still owned its value";
  auto at = stash.insert(owners, 2, std::make_shared<int>(6)).first;
  EXPECT_EQ(at->first, 2);
  EXPECT_EQ(*at->second, 6);
  EXPECT_EQ(owners.size(), 1U);
}

TEST(NodeStash, MultiContainersTakeEqualKeysAndTheStashIsBounded) {
  std::multimap<int, int> deadlines;
  NodeStash<std::multimap<int, int>, 2> stash;
  for (int i = 0; i < 4; ++i) stash.insert(deadlines, 10, i);
  EXPECT_EQ(deadlines.count(10), 4U);
  while (!deadlines.empty()) stash.erase(deadlines, deadlines.begin());
  EXPECT_EQ(stash.kept(), 2U);
  stash.insert(deadlines, 3, 30);
  stash.insert(deadlines, 1, 10);
  stash.insert(deadlines, 2, 20);  // past what was kept: a fresh node
  EXPECT_EQ(stash.kept(), 0U);
  std::multimap<int, int> expected{{1, 10}, {2, 20}, {3, 30}};
  EXPECT_EQ(deadlines, expected);
}

TEST(NodeStash, FindOrInsertAndInsertOrAssignBehaveAsTheMapsOwnAndReuseAKeptNode) {
  std::unordered_map<std::string, int> counts;
  NodeStash<std::unordered_map<std::string, int>> stash;
  ++stash.find_or_insert(counts, std::string(40, 'a'));
  ++stash.find_or_insert(counts, std::string(40, 'a'));  // found: the same value
  EXPECT_EQ(counts.at(std::string(40, 'a')), 2);
  const std::string* key = &counts.begin()->first;
  stash.erase(counts, counts.begin());
  EXPECT_EQ(stash.find_or_insert(counts, std::string(40, 'b')), 0) << "a kept node's value was not reset";
  EXPECT_EQ(&counts.begin()->first, key) << "the kept node was not the one reused";

  auto at = stash.insert_or_assign(counts, std::string(40, 'b'), 7);  // present: assigned
  EXPECT_EQ(at->second, 7);
  EXPECT_EQ(stash.insert_or_assign(counts, std::string("c"), 3)->second, 3);  // absent: inserted
  const std::unordered_map<std::string, int> expected{{std::string(40, 'b'), 7}, {"c", 3}};
  EXPECT_EQ(counts, expected);
  EXPECT_EQ(stash.kept(), 0U);
}

TEST(Rekey, MovesAnEntryUnderANewKeyWithinAndAcrossIndexes) {
  std::multimap<int, std::string> deadlines{{5, std::string(40, 'a')}, {9, "b"}};
  std::multimap<int, std::string> tombstones;
  const std::string* id = &deadlines.begin()->second;
  auto later = rekey(deadlines, deadlines.begin(), deadlines, 12);
  EXPECT_EQ(later->first, 12);
  EXPECT_EQ(&later->second, id) << "re-armed in another node";
  EXPECT_EQ(deadlines.begin()->second, "b");
  auto moved = rekey(deadlines, later, tombstones, 30);
  EXPECT_EQ(&moved->second, id);
  EXPECT_EQ(deadlines.size(), 1U);
  std::multimap<int, std::string> expected{{30, std::string(40, 'a')}};
  EXPECT_EQ(tombstones, expected);
}

}  // namespace
}  // namespace ecx
