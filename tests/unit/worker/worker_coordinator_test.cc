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
#include "ecx/store/embedding_store.h"
#include "ecx/store/store_config.h"
#include "sim/process.h"
#include "sim/redis_server.h"

namespace ecx::worker {
namespace {

using namespace std::chrono_literals;
using json = nlohmann::json;

Config config_for(const std::string& role, int port, const json& extra = json::object()) {
  json extra_config{{"control_timeout_s", 5}, {"checksum", true}};
  extra_config.update(extra);
  const json doc{{"ec_role", role},           {"ec_ip", "127.0.0.1"},      {"ec_port", port},
                 {"ec_buffer_size", "16MiB"}, {"ec_buffer_device", "cpu"}, {"ec_connector_extra_config", extra_config}};
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
    auto producer = WorkerCoordinator::start(config_for("ec_producer", port + 100, producer_extra()));
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

  virtual json producer_extra() const { return json::object(); }

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

// An encoder with checksums off still gives a consumer that verifies (it announces so)
// the checksum it needs: the output is hashed on the send path. The consumer refuses
// a payload without one, so a landing proves it came and matched.
class ChecksumOnlyAtTheConsumerTest : public WorkerCoordinatorTest {
 protected:
  json producer_extra() const override { return json{{"checksum", false}}; }
};

TEST_F(ChecksumOnlyAtTheConsumerTest, TheProducerHashesForTheConsumerThatVerifies) {
  const auto item = push("verified", std::uint64_t{64} * 1024, std::byte{0x3c});
  const auto counters = consumer_->shard()->counters().reservations;
  EXPECT_EQ(counters.checksum_mismatches, 0u);
  EXPECT_EQ(counters.landings_ready, 1u);
  std::vector<std::byte> cache(item.spec.nbytes());
  scheduler::ConnectorMeta meta;
  meta.loads.push_back(item);
  const auto report = consumer_->start_load_caches(meta, [&](const scheduler::LoadSpec&) {
    return Result<LoadDestination>(LoadDestination{cache.data(), false, 0});
  });
  EXPECT_EQ(report.loaded.size(), 1u);
  EXPECT_EQ(cache.front(), std::byte{0x3c});
}

TEST_F(WorkerCoordinatorTest, ShutdownIsIdempotentAndBounded) {
  (void)push("before-shutdown", 4096, std::byte{0x33});
  const auto started = std::chrono::steady_clock::now();
  producer_->shutdown();
  consumer_->shutdown();
  consumer_->shutdown();
  EXPECT_LT(std::chrono::steady_clock::now() - started, 4s);  // two budgets of 1.5 s at most
}

// The cross-encoder cache's prefetches and loads in one step: an engine that loads an
// item's prefetched copy while the scheduler asks for it again (a second request wants
// it) gets a second copy, read again from the store, not an answer that never comes.
TEST(WorkerCoordinatorStore, AnItemAskedAgainInTheStepItsCopyIsLoadedIsReadAgain) {
  auto redis = sim::RedisServer::start();
  if (!redis && redis.status().message().find("missing") != std::string::npos) GTEST_SKIP() << redis.status().message();
  ASSERT_TRUE(redis) << redis.status().to_string();
  const int port = sim::free_port_block(1);
  ASSERT_NE(port, 0);
  const Config config = config_for(
      "ec_producer", port, {{"cross_encoder_cache", true}, {"store_url", redis->url()}, {"store_model", "m@1"}});
  const auto spec = TensorSpec::make({64, 32}, DType::bfloat16, ~0ULL).value();
  const std::vector<std::byte> entry(spec.nbytes(), std::byte{0x6b});
  ASSERT_TRUE(store::open_store(config).value()->put("img", spec, entry));
  auto worker = WorkerCoordinator::start(config);
  ASSERT_TRUE(worker) << worker.status().to_string();

  std::vector<std::byte> landed(spec.nbytes());
  const auto allocate = [&](const scheduler::LoadSpec&) -> Result<LoadDestination> {
    return LoadDestination{landed.data(), false, 0};
  };
  // Steps (polling the prefetcher thread's progress, bounded) until `img` is held.
  const auto step_until_held = [&] {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < deadline) {
      if (auto step = (*worker)->build_worker_meta(); step && step->store_ready.contains("img")) return true;
      std::this_thread::sleep_for(2ms);
    }
    return false;
  };
  scheduler::ConnectorMeta first;
  first.store_prefetches = {scheduler::StoreLoad{"img", spec}};
  (void)(*worker)->start_load_caches(first, allocate);
  ASSERT_TRUE(step_until_held());

  scheduler::ConnectorMeta second;
  second.store_loads = {scheduler::StoreLoad{"img", spec}};
  second.store_prefetches = {scheduler::StoreLoad{"img", spec}};
  const auto report = (*worker)->start_load_caches(second, allocate);
  EXPECT_EQ(report.loaded, std::vector<std::string>{"img"});
  EXPECT_EQ(landed, entry);
  EXPECT_TRUE(step_until_held()) << "the second request's prefetch was never answered";
}

}  // namespace
}  // namespace ecx::worker
