// The scheduler's event source over the real control plane: a ControlServer on
// loopback publishes readiness events, the source built by make_event_source drains
// them through a real EventInbox.
#include <chrono>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "../control/control_test_util.h"
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
  source->close();
  EXPECT_EQ(source->drain(out, 3), 0u);
}

}  // namespace
}  // namespace ecx::worker
