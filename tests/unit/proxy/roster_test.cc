#include "ecx/proxy/roster.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "proxy/roster_json.h"

namespace ecx::proxy {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;

InstanceSpec spec(InstanceRole role, std::string url) {
  InstanceSpec s;
  s.role = role;
  s.url = std::move(url);
  return s;
}

class RosterTest : public ::testing::Test {
 protected:
  std::shared_ptr<ManualClock> clock = std::make_shared<ManualClock>();
  Roster roster{clock, RosterSettings{3, 15min}};
};

TEST_F(RosterTest, RoundRobinPerRoleAndEmptyRole) {
  ASSERT_TRUE(roster.add(spec(InstanceRole::decode, "http://a:1")));
  ASSERT_TRUE(roster.add(spec(InstanceRole::decode, "http://b:1")));
  ASSERT_TRUE(roster.add(spec(InstanceRole::encode, "http://e:1")));
  EXPECT_EQ(roster.pick(InstanceRole::decode), "http://a:1");
  EXPECT_EQ(roster.pick(InstanceRole::decode), "http://b:1");
  EXPECT_EQ(roster.pick(InstanceRole::decode), "http://a:1");
  EXPECT_EQ(roster.pick(InstanceRole::encode), "http://e:1");
  EXPECT_EQ(roster.pick(InstanceRole::prefill), std::nullopt);
  EXPECT_TRUE(roster.pick_many(InstanceRole::prefill, 3).empty());
}

TEST_F(RosterTest, CursorDoesNotResetWhenTheRosterChanges) {
  for (const auto* url : {"http://a:1", "http://b:1", "http://c:1"}) {
    ASSERT_TRUE(roster.add(spec(InstanceRole::encode, url)));
  }
  EXPECT_EQ(roster.pick(InstanceRole::encode), "http://a:1");
  EXPECT_EQ(roster.pick(InstanceRole::encode), "http://b:1");
  ASSERT_TRUE(roster.add(spec(InstanceRole::encode, "http://d:1")));
  // Cursor is 2: the third live instance, not the first.
  EXPECT_EQ(roster.pick(InstanceRole::encode), "http://c:1");
  EXPECT_EQ(roster.pick(InstanceRole::encode), "http://d:1");
}

TEST_F(RosterTest, PickManyIsOneContiguousRotationReusingInstances) {
  ASSERT_TRUE(roster.add(spec(InstanceRole::encode, "http://a:1")));
  ASSERT_TRUE(roster.add(spec(InstanceRole::encode, "http://b:1")));
  EXPECT_EQ(roster.pick_many(InstanceRole::encode, 3),
            (std::vector<std::string>{"http://a:1", "http://b:1", "http://a:1"}));
  EXPECT_EQ(roster.pick_many(InstanceRole::encode, 1), (std::vector<std::string>{"http://b:1"}));
}

TEST_F(RosterTest, RoleConflictAndRefreshKeepsLiveness) {
  ASSERT_TRUE(roster.add(spec(InstanceRole::decode, "http://a:1")));
  const auto conflict = roster.add(spec(InstanceRole::encode, "http://a:1"));
  EXPECT_EQ(conflict.code(), StatusCode::conflict);
  for (int i = 0; i < 3; ++i) roster.record_probe("http://a:1", false);
  EXPECT_EQ(roster.live_count(InstanceRole::decode), 0u);
  // A periodic re-announcement does not re-admit an instance its probes call dead.
  ASSERT_TRUE(roster.add(spec(InstanceRole::decode, "http://a:1")));
  EXPECT_EQ(roster.evicted_count(InstanceRole::decode), 1u);
}

TEST_F(RosterTest, EvictsAfterThresholdReadmitsOnSuccessAndForgetsAfterTtl) {
  ASSERT_TRUE(roster.add(spec(InstanceRole::encode, "http://a:1")));
  EXPECT_FALSE(roster.record_probe("http://a:1", false).evicted);
  EXPECT_FALSE(roster.record_probe("http://a:1", false).evicted);
  EXPECT_TRUE(roster.record_probe("http://a:1", true).readmitted == false);  // a success resets the run
  EXPECT_FALSE(roster.record_probe("http://a:1", false).evicted);
  EXPECT_FALSE(roster.record_probe("http://a:1", false).evicted);
  EXPECT_TRUE(roster.record_probe("http://a:1", false).evicted);
  EXPECT_EQ(roster.pick(InstanceRole::encode), std::nullopt);
  auto snapshot = snapshot_json(roster.snapshot());
  EXPECT_EQ(snapshot["encode"]["evicted"], json::array({"http://a:1"}));
  EXPECT_EQ(snapshot["encode"]["live"], json::array());

  EXPECT_TRUE(roster.record_probe("http://a:1", true).readmitted);
  EXPECT_EQ(roster.pick(InstanceRole::encode), "http://a:1");

  for (int i = 0; i < 3; ++i) roster.record_probe("http://a:1", false);
  clock->advance(15min - 1s);
  EXPECT_TRUE(roster.forget_expired().empty());
  clock->advance(1s);
  EXPECT_EQ(roster.forget_expired(), std::vector<std::string>{"http://a:1"});
  EXPECT_TRUE(roster.probe_targets().empty());
  // A late probe result for a forgotten instance is ignored.
  EXPECT_FALSE(roster.record_probe("http://a:1", true).readmitted);
  EXPECT_EQ(roster.live_count(InstanceRole::encode), 0u);
}

TEST_F(RosterTest, SnapshotListsEachRolesLiveAndEvictedUrlsInUrlOrder) {
  ASSERT_TRUE(roster.add(spec(InstanceRole::encode, "http://b:1")));
  ASSERT_TRUE(roster.add(spec(InstanceRole::encode, "http://a:1")));
  ASSERT_TRUE(roster.add(spec(InstanceRole::decode, "http://c:1")));
  for (int i = 0; i < 3; ++i) roster.record_probe("http://c:1", false);
  const RosterSnapshot snapshot = roster.snapshot();
  EXPECT_EQ(snapshot.of(InstanceRole::encode).live, (std::vector<std::string>{"http://a:1", "http://b:1"}));
  EXPECT_TRUE(snapshot.of(InstanceRole::encode).evicted.empty());
  EXPECT_TRUE(snapshot.of(InstanceRole::prefill).live.empty());
  EXPECT_TRUE(snapshot.of(InstanceRole::prefill).evicted.empty());
  EXPECT_TRUE(snapshot.of(InstanceRole::decode).live.empty());
  EXPECT_EQ(snapshot.of(InstanceRole::decode).evicted, std::vector<std::string>{"http://c:1"});
  // The admin API's rendering: every role present, empty lists included.
  EXPECT_EQ(snapshot_json(snapshot), json::parse(R"({"encode": {"live": ["http://a:1", "http://b:1"], "evicted": []},
                                                     "prefill": {"live": [], "evicted": []},
                                                     "decode": {"live": [], "evicted": ["http://c:1"]}})"));
}

TEST_F(RosterTest, StaticInstancesAreNeverForgotten) {
  auto s = spec(InstanceRole::decode, "http://a:1");
  s.is_static = true;
  ASSERT_TRUE(roster.add(s));
  for (int i = 0; i < 3; ++i) roster.record_probe("http://a:1", false);
  clock->advance(24h);
  EXPECT_TRUE(roster.forget_expired().empty());
  EXPECT_EQ(roster.evicted_count(InstanceRole::decode), 1u);
}

TEST(RosterTtl, ZeroTtlKeepsEvictedInstances) {
  auto clock = std::make_shared<ManualClock>();
  Roster roster(clock, RosterSettings{1, Duration::zero()});
  ASSERT_TRUE(roster.add(spec(InstanceRole::decode, "http://a:1")));
  EXPECT_TRUE(roster.record_probe("http://a:1", false).evicted);
  clock->advance(24h);
  EXPECT_TRUE(roster.forget_expired().empty());
}

TEST_F(RosterTest, ConsumerTargetRotatesReplicasOrPinsTheRegisteredRank) {
  auto pd = spec(InstanceRole::decode, "http://pd:1");
  pd.dp_size = 2;
  pd.ec_zmq_addrs = {"tcp://pd:10", "tcp://pd:11"};
  ASSERT_TRUE(roster.add(pd));
  auto first = roster.consumer_target("http://pd:1");
  auto second = roster.consumer_target("http://pd:1");
  auto third = roster.consumer_target("http://pd:1");
  ASSERT_TRUE(first && second && third);
  EXPECT_EQ(first->zmq_addr, "tcp://pd:10");
  EXPECT_EQ(first->dp_rank, 0);
  EXPECT_EQ(second->zmq_addr, "tcp://pd:11");
  EXPECT_EQ(second->dp_rank, 1);
  EXPECT_EQ(third->dp_rank, 0);

  auto single = spec(InstanceRole::decode, "http://one:1");
  single.ec_zmq_addrs = {"tcp://one:10"};
  ASSERT_TRUE(roster.add(single));
  auto target = roster.consumer_target("http://one:1");
  ASSERT_TRUE(target);
  EXPECT_EQ(target->zmq_addr, "tcp://one:10");
  EXPECT_EQ(target->dp_rank, std::nullopt);  // dp_size 1: no header

  auto pinned = spec(InstanceRole::prefill, "http://p:1");
  pinned.dp_size = 4;
  pinned.dp_rank = 3;
  pinned.ec_zmq_addrs = {"tcp://p:13"};
  ASSERT_TRUE(roster.add(pinned));
  target = roster.consumer_target("http://p:1");
  ASSERT_TRUE(target);
  EXPECT_EQ(target->zmq_addr, "tcp://p:13");
  EXPECT_EQ(target->dp_rank, 3);
  EXPECT_EQ(roster.consumer_target("http://missing:1"), std::nullopt);
}

TEST(InstanceSpecParse, AcceptsTheRegistrationBodyAndRejectsBadOnes) {
  auto parsed = parse_instance_spec(json{{"role", "prefill_decode"},
                                         {"url", "http://10.0.0.1:8000/"},
                                         {"ec_zmq_addrs", {"tcp://10.0.0.1:14579"}},
                                         {"dp_size", 1}});
  ASSERT_TRUE(parsed) << parsed.status().to_string();
  EXPECT_EQ(parsed->role, InstanceRole::decode);
  EXPECT_EQ(parsed->url, "http://10.0.0.1:8000");
  EXPECT_EQ(parsed->ec_zmq_addrs, std::vector<std::string>{"tcp://10.0.0.1:14579"});
  EXPECT_FALSE(parse_instance_spec(json{{"role", "judge"}, {"url", "http://a:1"}}));
  EXPECT_FALSE(parse_instance_spec(json{{"role", "encode"}}));
  EXPECT_FALSE(parse_instance_spec(json{{"role", "encode"}, {"url", "ftp://a:1"}}));
  EXPECT_FALSE(parse_instance_spec(json{{"role", "encode"}, {"url", "http://a:1"}, {"dp_size", 0}}));
  EXPECT_FALSE(parse_instance_spec(json{{"role", "encode"}, {"url", "http://a:1"}, {"dp_size", 2}, {"dp_rank", 2}}));
  EXPECT_FALSE(parse_instance_spec(json{{"role", "encode"}, {"url", "http://a:1"}, {"ec_zmq_addrs", "tcp://x:1"}}));
  EXPECT_FALSE(parse_instance_spec(json::array()));
}

}  // namespace
}  // namespace ecx::proxy
