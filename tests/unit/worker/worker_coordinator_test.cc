// WorkerCoordinator through its public interface: a producer-role coordinator pushes
// to a consumer-role coordinator in this process, over the real control plane and
// UCX on loopback; the consumer's loads are then driven the way an engine drives
// start_load_caches, including the ways a load can fail.
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "ecx/connector/worker/worker_coordinator.h"
#include "ecx/core/config.h"
#include "sim/process.h"

namespace ecx::worker {
namespace {

using namespace std::chrono_literals;
using json = nlohmann::json;

Config config_for(const std::string& role, int port) {
  const json doc{
      {"ec_role", role},           {"ec_ip", "127.0.0.1"},
      {"ec_port", port},           {"ec_buffer_size", "16MiB"},
      {"ec_buffer_device", "cpu"}, {"ec_connector_extra_config", {{"control_timeout_s", 5}, {"checksum", true}}}};
  auto config = parse_config(doc.dump(), ParallelLayout{});
  EXPECT_TRUE(config) << config.status().to_string();
  return *config;
}

class WorkerCoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const int port = sim::free_port_block(1);
    ASSERT_NE(port, 0);
    consumer_config_ = config_for("ec_consumer", port);
    auto consumer = WorkerCoordinator::start(consumer_config_);
    ASSERT_TRUE(consumer) << consumer.status().to_string();
    consumer_ = std::move(*consumer);
    auto producer = WorkerCoordinator::start(config_for("ec_producer", port + 100));
    ASSERT_TRUE(producer) << producer.status().to_string();
    producer_ = std::move(*producer);
  }

  // Pushes `n` bytes of `fill` as mm_hash `hash` and waits (bounded) until it landed.
  scheduler::LoadSpec push(const std::string& hash, std::uint64_t n, std::byte fill) {
    auto spec = TensorSpec::make({static_cast<std::int64_t>(n)}, DType::uint8, ~0ULL).value();
    const std::string tid = "t-" + hash;
    // Counted before the push starts: a landing can finish before save_cache returns.
    const auto landed_before = landed();
    scheduler::ConnectorMeta meta;
    meta.pushes.push_back(scheduler::PushSpec{hash, spec, consumer_config_.control_address(0), tid, "r-" + hash});
    producer_->start_save_caches(meta);
    const std::vector<std::byte> output(n, fill);
    EXPECT_TRUE(producer_->save_cache(hash, output.data(), output.size()).ok());
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (landed() == landed_before && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(2ms);  // polling real sockets' progress, not waiting out a timeout
    }
    EXPECT_GT(landed(), landed_before) << hash << " never landed";
    return scheduler::LoadSpec{hash, tid, spec};
  }
  std::uint64_t landed() const { return consumer_->shard()->counters().reservations.landings_ready; }
  std::uint64_t pool_used() const { return consumer_->shard()->counters().reservations.pool_used_bytes; }

  Config consumer_config_;
  std::unique_ptr<WorkerCoordinator> consumer_;
  std::unique_ptr<WorkerCoordinator> producer_;
};

TEST_F(WorkerCoordinatorTest, LoadsCopyTheLandedBytesAndEachFailureFailsOnlyItsItem) {
  const auto good = push("good", 4096, std::byte{0x5a});
  const auto refused = push("refused", 4096, std::byte{0x11});
  const scheduler::LoadSpec unknown{"unknown", "t-unknown", good.spec};
  scheduler::ConnectorMeta meta;
  meta.loads = {good, refused, unknown};

  std::vector<std::byte> destination(4096);
  int allocations = 0;
  const auto report =
      consumer_->start_load_caches(meta, [&](const scheduler::LoadSpec& load) -> Result<LoadDestination> {
        ++allocations;
        if (load.mm_hash == "refused") return resource_exhausted("the engine's encoder cache is full");
        return LoadDestination{destination.data(), false, 0};
      });
  EXPECT_EQ(report.loaded, std::vector<std::string>{"good"});
  EXPECT_EQ(report.failed, (std::vector<std::string>{"refused", "unknown"}));
  EXPECT_EQ(allocations, 2) << "an item with nothing landed must not make the engine allocate";
  EXPECT_EQ(destination, std::vector<std::byte>(4096, std::byte{0x5a}));

  const auto step = consumer_->build_worker_meta();
  ASSERT_TRUE(step.has_value());
  EXPECT_EQ(step->loaded, std::set<std::string>{"good"});
  EXPECT_EQ(step->failed_loads, (std::set<std::string>{"refused", "unknown"}));
  EXPECT_TRUE(consumer_->build_worker_meta()->loaded.empty()) << "a report is for one step";
  EXPECT_TRUE(consumer_->shard()->check_invariants()) << consumer_->shard()->check_invariants().to_string();
}

TEST_F(WorkerCoordinatorTest, AnItemTheEngineAlreadyHasIsConsumedWithoutACopy) {
  const auto item = push("present", 8192, std::byte{0x22});
  scheduler::ConnectorMeta meta;
  meta.loads = {item};
  const auto report = consumer_->start_load_caches(
      meta, [](const scheduler::LoadSpec&) -> Result<LoadDestination> { return internal_error("not called"); },
      [](const std::string& hash) { return hash == "present"; });
  EXPECT_EQ(report.loaded, std::vector<std::string>{"present"});
  EXPECT_TRUE(report.failed.empty());
  // The transfer was taken and given back: its record no longer holds a lease.
  EXPECT_EQ(consumer_->shard()->counters().reservations.taken, 1U);
  EXPECT_TRUE(consumer_->shard()->check_invariants()) << consumer_->shard()->check_invariants().to_string();
}

TEST_F(WorkerCoordinatorTest, ShutdownIsIdempotentAndBounded) {
  (void)push("before-shutdown", 4096, std::byte{0x33});
  const auto started = std::chrono::steady_clock::now();
  producer_->shutdown();
  consumer_->shutdown();
  consumer_->shutdown();
  EXPECT_LT(std::chrono::steady_clock::now() - started, 4s);  // two budgets of 1.5 s at most
}

}  // namespace
}  // namespace ecx::worker
