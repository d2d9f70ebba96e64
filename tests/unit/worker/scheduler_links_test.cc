// The scheduler's event source over the real control plane: a ControlServer on
// loopback publishes readiness events, the source built by make_event_source drains
// them through a real EventInbox.
#include <chrono>
#include <future>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "../control/control_test_util.h"
#include "../control/hand_driven_router.h"
#include "ecx/connector/worker/scheduler_links.h"
#include "ecx/control/client.h"
#include "ecx/core/config.h"

namespace ecx::worker {
namespace {

using namespace std::chrono_literals;

Config consumer_config(int port) {
  const nlohmann::json doc{{"ec_role", "ec_consumer"},
                           {"ec_ip", "127.0.0.1"},
                           {"ec_port", port},
                           {"ec_buffer_device", "cpu"},
                           {"ec_connector_extra_config", {{"control_timeout_s", 2}}}};
  auto config = parse_config(doc.dump(), ParallelLayout{});
  EXPECT_TRUE(config) << config.status().to_string();
  return *config;
}

wire::Event ready_event(const std::string& transfer_id) {
  wire::Event e;
  e.kind = wire::EventKind::ready;
  e.transfer_id = transfer_id;
  e.mm_hash = "hash-" + transfer_id;
  e.reservation_id = ReservationId(1, 2);
  e.generation = 1;
  e.spec = control::testing::spec({4, 8});
  return e;
}

// One consumer shard on loopback and a control client to reach it.
struct OneShard {
  std::shared_ptr<control::testing::TestHandler> handler = std::make_shared<control::testing::TestHandler>();
  std::vector<std::unique_ptr<control::ControlServer>> shards = control::testing::start_shards(1, handler);
  std::shared_ptr<control::ControlClient> client = control::testing::must(control::ControlClient::create({}));
};

// A drain smaller than what the inbox received loses nothing: the rest comes in
// the following drains, in order.
TEST(InboxEventSource, EventsBeyondOneDrainsBoundComeInTheNextDrains) {
  OneShard consumer;
  ASSERT_EQ(consumer.shards.size(), 1u);
  auto& shards = consumer.shards;
  auto source = make_event_source(consumer.client, consumer_config(shards[0]->port()), SteadyClock::shared());

  // Subscribe first (bounded): events published before the subscription are not the point.
  std::vector<scheduler::TransferEvent> out;
  const auto subscribe_by = std::chrono::steady_clock::now() + 10s;
  while (source->shard_count() == 0 && std::chrono::steady_clock::now() < subscribe_by) {
    ASSERT_EQ(source->drain(out, 16), 0u);
    std::this_thread::sleep_for(5ms);  // polling a real socket's progress, not waiting out a timeout
  }
  ASSERT_EQ(source->shard_count(), 1);

  constexpr int kEvents = 10;
  for (int i = 0; i < kEvents; ++i) ASSERT_TRUE(shards[0]->publish(ready_event("t-" + std::to_string(i))).is_ok());

  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (out.size() < kEvents && std::chrono::steady_clock::now() < deadline) {
    const auto n = source->drain(out, 3);
    ASSERT_LE(n, 3u) << "a drain handed on more than its bound";
    if (n == 0) std::this_thread::sleep_for(2ms);
  }
  ASSERT_EQ(out.size(), static_cast<std::size_t>(kEvents));
  for (int i = 0; i < kEvents; ++i) {
    EXPECT_EQ(out[i].transfer_id, "t-" + std::to_string(i));
    EXPECT_EQ(out[i].kind, scheduler::TransferEvent::Kind::ready);
    EXPECT_EQ(out[i].mm_hash, "hash-t-" + std::to_string(i));
  }
  EXPECT_EQ(source->drain(out, 3), 0u);
  // The subscription's own counts (exported as the scheduler's metrics) come from the
  // inbox, and stay after close.
  const auto counted = source->subscription_counters();
  EXPECT_GE(counted.discoveries_started, 1u);
  EXPECT_EQ(counted.discoveries_failed, 0u);
  EXPECT_EQ(counted.malformed + counted.unknown_kind + counted.auth_failures, 0u);
  source->close();
  EXPECT_EQ(source->drain(out, 3), 0u);
  EXPECT_EQ(source->subscription_counters().discoveries_started, counted.discoveries_started);
}

// ---------------------------------------------------------------- the consumer control

TEST(ConsumerControlOverTheControlPlane, CancelsForOneShardGoInOneFrame) {
  OneShard consumer;
  const std::string address = control::testing::local(consumer.shards[0]->port());
  auto control = make_consumer_control(consumer.client, 2s);
  ASSERT_TRUE(control->discover_shards(address).is_ok());
  ASSERT_TRUE(
      consumer.client->reserve_batch(address, {control::testing::item("t-1"), control::testing::item("t-2")}, 2s)
          .is_ok());
  const auto answers = control->cancel_many(address, {"t-1", "t-unknown", "t-2"});
  ASSERT_EQ(answers.size(), 3u);
  ASSERT_TRUE(answers[0].is_ok() && answers[1].is_ok() && answers[2].is_ok());
  EXPECT_TRUE(*answers[0]);
  EXPECT_FALSE(*answers[1]);  // nothing held: not an error
  EXPECT_TRUE(*answers[2]);
  const auto c = consumer.shards[0]->counters();
  EXPECT_EQ(c.requests[static_cast<int>(wire::Op::cancel_batch)][0], 1u);
  EXPECT_EQ(c.requests[static_cast<int>(wire::Op::cancel)][0], 0u);
}

// A shard that announced cancel_batch and then refuses it (restarted as an older
// release) is asked one cancel per transfer, and nothing is lost.
TEST(ConsumerControlOverTheControlPlane, AShardThatRefusesTheBatchIsAskedOneByOne) {
  control::testing::HandDrivenRouter shard;
  std::shared_ptr<control::ControlClient> client = control::testing::must(control::ControlClient::create({}));
  auto control = make_consumer_control(client, 2s);
  auto discovered = std::async(std::launch::async, [&] { return control->discover_shards(shard.address); });
  // Discovery says hello to the base address, then to every shard it lists (this one).
  for (int i = 0; i < 2; ++i) {
    auto hello = shard.next_request();
    ASSERT_TRUE(hello);
    ASSERT_EQ(hello->second.op(), wire::Op::hello);
    wire::Reply reply;
    reply.id = hello->second.id;
    reply.op = wire::Op::hello;
    wire::HelloReply body;
    body.control_ports = {static_cast<std::uint32_t>(shard.port())};
    body.event_port = 1;
    body.instance = "old-release";
    body.features = {std::string(wire::kFeatureReceiverLands), std::string(wire::kFeatureCancelBatch)};
    body.data = wire::DataPlane{"ucx", "addr", "", 0};
    reply.body = body;
    shard.answer(hello->first, reply);
  }
  ASSERT_TRUE(discovered.get().is_ok());

  auto cancelled = std::async(std::launch::async, [&] { return control->cancel_many(shard.address, {"t-1", "t-2"}); });
  auto batch = shard.next_request();
  ASSERT_TRUE(batch);
  ASSERT_EQ(batch->second.op(), wire::Op::cancel_batch);
  shard.answer(batch->first,
               wire::make_reject_reply(batch->second.id, wire::RejectReason::unknown_op, "unknown op 'cancel_batch'"));
  for (const std::string expected : {"t-1", "t-2"}) {
    auto one = shard.next_request();
    ASSERT_TRUE(one);
    ASSERT_EQ(one->second.op(), wire::Op::cancel);
    EXPECT_EQ(std::get<wire::CancelRequest>(one->second.body).transfer_id, expected);
    shard.answer_cancel(one->first, one->second.id, true);
  }
  const auto answers = cancelled.get();
  ASSERT_EQ(answers.size(), 2u);
  EXPECT_TRUE(answers[0].is_ok() && *answers[0]);
  EXPECT_TRUE(answers[1].is_ok() && *answers[1]);

  // From now on it is asked one at a time straight away.
  auto again = std::async(std::launch::async, [&] { return control->cancel_many(shard.address, {"t-3"}); });
  auto next = shard.next_request();
  ASSERT_TRUE(next);
  EXPECT_EQ(next->second.op(), wire::Op::cancel);
  shard.answer_cancel(next->first, next->second.id, false);
  const auto last = again.get();
  ASSERT_EQ(last.size(), 1u);
  EXPECT_TRUE(last[0].is_ok());
  control->close();
}

}  // namespace
}  // namespace ecx::worker
