// PushEngine against real ZeroMQ peers on loopback: a consumer that stops answering
// (a ROUTER that reads every request and replies to none, with the reference's 30 s
// control timeout: shutdown must still end within its own budget), a shard whose
// data plane lands payloads the other way (the push fails, naming both), and lent
// outputs (lend_source) given back once whatever becomes of their pushes.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include <gtest/gtest.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <nlohmann/json.hpp>

#include "../control/control_test_util.h"
#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/metrics.h"
#include "ecx/core/stages.h"
#include "ecx/producer/push_engine.h"
#include "ecx/wire/protocol.h"

namespace ecx::producer {
namespace {

using namespace std::chrono_literals;

Config producer_config(const nlohmann::json& extra) {
  const nlohmann::json doc{{"ec_role", "ec_producer"},
                           {"ec_ip", "127.0.0.1"},
                           {"ec_buffer_size", "8MiB"},
                           {"ec_buffer_device", "cpu"},
                           {"ec_connector_extra_config", extra}};
  auto config = parse_config(doc.dump(), ParallelLayout{});
  EXPECT_TRUE(config) << config.status().to_string();
  return *config;
}

// A consumer that is there (the connection succeeds) but never replies.
struct SilentConsumer {
  zmq::context_t ctx;
  zmq::socket_t socket{ctx, zmq::socket_type::router};
  std::string address;

  SilentConsumer() {
    socket.set(zmq::sockopt::linger, 0);
    socket.bind("tcp://127.0.0.1:*");
    address = socket.get(zmq::sockopt::last_endpoint);
  }
  // True once a request reached it (so the push is really in flight).
  bool received_within(std::chrono::milliseconds deadline) {
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, deadline) != 1) return false;
    std::vector<zmq::message_t> frames;
    return zmq::recv_multipart(socket, std::back_inserter(frames)).has_value();
  }
};

TEST(PushEngineShutdown, EndsWithinItsBudgetWhenTheConsumerNeverAnswers) {
  SilentConsumer consumer;
  // Defaults except the control timeout, set to the reference's 30 s on purpose.
  const auto config = producer_config({{"control_timeout_s", 30}});
  ASSERT_DOUBLE_EQ(config.shutdown_drain_timeout_s, 1.5);
  auto engine = PushEngine::start(config);
  ASSERT_TRUE(engine) << engine.status().to_string();

  auto spec = TensorSpec::make({16, 64}, DType::float16, 1 << 20);
  ASSERT_TRUE(spec);
  const std::vector<std::byte> output(spec->nbytes(), std::byte{7});
  (*engine)->submit(PushSpec{"t-silent", "h-silent", consumer.address, *spec, "r-silent"});
  ASSERT_TRUE((*engine)->bind_source("h-silent", output.data(), output.size()).ok());
  ASSERT_TRUE(consumer.received_within(5s)) << "the push never reached the consumer";
  ASSERT_TRUE((*engine)->pending());

  const auto started = std::chrono::steady_clock::now();
  (*engine)->shutdown(seconds_to_duration(config.shutdown_drain_timeout_s));
  const auto took = std::chrono::steady_clock::now() - started;
  // The bound under test, not a speed target: the budget plus closing sockets.
  EXPECT_LT(took, 2s) << std::chrono::duration<double>(took).count() << " s";
  (*engine)->shutdown(seconds_to_duration(config.shutdown_drain_timeout_s));  // idempotent
}

TEST(PushEngineShutdown, IdleEngineStopsAtOnce) {
  auto engine = PushEngine::start(producer_config(nlohmann::json::object()));
  ASSERT_TRUE(engine) << engine.status().to_string();
  EXPECT_FALSE((*engine)->pending());
  const auto started = std::chrono::steady_clock::now();
  (*engine)->shutdown(10s);
  EXPECT_LT(std::chrono::steady_clock::now() - started, 5s);
}

// Records how many items each reserve_batch carries.
class CountingShard : public control::testing::TestHandler {
 public:
  std::vector<wire::ReserveResult> reserve_batch(const control::RequestContext& context,
                                                 std::span<const wire::ReserveItem> items) override {
    {
      std::lock_guard lock(mutex);
      sizes.push_back(items.size());
    }
    return TestHandler::reserve_batch(context, items);
  }
  std::vector<std::size_t> batch_sizes() {
    std::lock_guard lock(mutex);
    return sizes;
  }

 private:
  std::mutex mutex;
  std::vector<std::size_t> sizes;
};

// A shard holds a request none of whose items fits until one does, then answers it
// whole: items asked together would come back as retry_after whenever only some fit.
TEST(PushEngineReserves, EachItemIsReservedInARequestOfItsOwn) {
  auto handler = std::make_shared<CountingShard>();
  auto shards = control::testing::start_shards(1, handler);
  ASSERT_EQ(shards.size(), 1u);
  auto engine = PushEngine::start(producer_config(nlohmann::json{{"direct_payload_max_bytes", 0}}));
  ASSERT_TRUE(engine) << engine.status().to_string();
  auto spec = TensorSpec::make({16, 64}, DType::float16, 1 << 20);
  ASSERT_TRUE(spec);
  const std::string consumer = shards[0]->control_endpoint();
  for (int i = 0; i < 6; ++i) {
    const auto n = std::to_string(i);
    (*engine)->submit(PushSpec{"t-" + n, "h-" + n, consumer, *spec, "r-" + n});
  }
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (handler->batch_sizes().size() < 6 && std::chrono::steady_clock::now() < deadline) {
    (*engine)->wait_idle(50ms);
  }
  const auto sizes = handler->batch_sizes();
  ASSERT_EQ(sizes.size(), 6u);
  for (const std::size_t n : sizes) EXPECT_EQ(n, 1u);
  (*engine)->shutdown(1s);
}

// A shard that says the producer writes its pool one-sidedly (as a Mooncake shard
// does), reached by a producer whose data plane is UCX (the receiver chooses).
class OneSidedShard : public control::testing::TestHandler {
 public:
  void describe(wire::HelloReply& reply) override {
    TestHandler::describe(reply);
    reply.data.transport = "mooncake";
    reply.data.segment = "127.0.0.1:1";
    reply.data.base = 0x10000;
    reply.features = {std::string(wire::kFeatureOneSided)};
  }
};

// Waits (bounded) until a push failed and `also` holds; the failures reported so far.
std::vector<FailedSave> wait_for_failures(
    PushEngine& engine, const std::function<bool()>& also = [] { return true; }) {
  std::vector<FailedSave> failures;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while ((failures.empty() || !also()) && std::chrono::steady_clock::now() < deadline) {
    engine.wait_idle(200ms);
    for (auto& f : engine.drain_failures()) failures.push_back(std::move(f));
  }
  return failures;
}

// An engine whose one consumer shard lands payloads the other way: every push to it fails.
class MismatchedShard : public ::testing::Test {
 protected:
  void SetUp() override {
    shards = control::testing::start_shards(1, std::make_shared<OneSidedShard>());
    ASSERT_EQ(shards.size(), 1u);
    auto started = PushEngine::start(producer_config(nlohmann::json::object()));
    ASSERT_TRUE(started) << started.status().to_string();
    engine = std::move(*started);
    auto made = TensorSpec::make({16, 64}, DType::float16, 1 << 20);
    ASSERT_TRUE(made);
    spec = *made;
    output.assign(spec->nbytes(), std::byte{7});
  }
  void submit(const std::string& name) {
    engine->submit(PushSpec{"t-" + name, "h-" + name, shards[0]->control_endpoint(), *spec, "r-" + name});
  }

  std::vector<std::unique_ptr<control::ControlServer>> shards;
  std::unique_ptr<PushEngine> engine;
  std::optional<TensorSpec> spec;
  std::vector<std::byte> output;
};

TEST_F(MismatchedShard, ThePushFailsNamingBothLandings) {
  submit("mismatch");
  ASSERT_TRUE(engine->bind_source("h-mismatch", output.data(), output.size()).ok());

  // The failure is reported, not thrown.
  const auto failures = wait_for_failures(*engine);
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].transfer_id, "t-mismatch");
  EXPECT_NE(failures[0].reason.find("'mooncake' (sender-chosen landing)"), std::string::npos) << failures[0].reason;
  EXPECT_NE(failures[0].reason.find("(receiver-chosen landing)"), std::string::npos) << failures[0].reason;
  // Decided, then refused before any byte moved: the small item's direct payload first,
  // then the payload the fallback reserve decided on.
  EXPECT_EQ(engine->counters().pushes.direct_turned_away, 1u);
  EXPECT_EQ(engine->counters().pushes.payloads_sent, 2u);
  engine->shutdown(1s);
}

// An encoder that admits work below a bound waits for a push to end instead of
// polling. The shard keeps answering the push's reserve with retry_after ("full-*"),
// so it stays active until its request finishes.
TEST(PushEngineWaits, WaitActiveBelowReturnsOnceAPushEnds) {
  auto shards = control::testing::start_shards(1, std::make_shared<control::testing::TestHandler>());
  ASSERT_EQ(shards.size(), 1u);
  auto engine = PushEngine::start(producer_config(nlohmann::json{{"direct_payload_max_bytes", 0}}));
  ASSERT_TRUE(engine) << engine.status().to_string();
  EXPECT_TRUE((*engine)->wait_active_below(1, 0ms));  // nothing active
  auto spec = TensorSpec::make({16, 64}, DType::float16, 1 << 20);
  ASSERT_TRUE(spec);
  (*engine)->submit(PushSpec{"full-1", "h-1", shards[0]->control_endpoint(), *spec, "r-1"});
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while ((*engine)->counters().pushes.active == 0 && std::chrono::steady_clock::now() < deadline) {
    (*engine)->wait_idle(10ms);  // polls the dispatcher's progress (it stays pending)
  }
  ASSERT_EQ((*engine)->counters().pushes.active, 1u);
  EXPECT_FALSE((*engine)->wait_active_below(1, 0ms));
  EXPECT_TRUE((*engine)->wait_active_below(2, 0ms));
  const std::vector<std::string> finished{"r-1"};
  (*engine)->requests_finished(finished);  // no source will come: the push is abandoned
  EXPECT_TRUE((*engine)->wait_active_below(1, 20s));
  EXPECT_EQ((*engine)->counters().pushes.active, 0u);
  (*engine)->shutdown(1s);
}

// A push counts against the bound from submit() on, not from when the dispatcher
// starts it: here it waits for a consumer that never answers its discovery, so it
// never becomes active. Counting only the active ones, an engine that stepped faster
// than the dispatcher had three times its bound in flight.
TEST(PushEngineWaits, WaitActiveBelowCountsAPushTheDispatcherHasNotStarted) {
  SilentConsumer consumer;
  auto engine = PushEngine::start(producer_config({{"control_timeout_s", 30}}));
  ASSERT_TRUE(engine) << engine.status().to_string();
  auto spec = TensorSpec::make({16, 64}, DType::float16, 1 << 20);
  ASSERT_TRUE(spec);
  (*engine)->submit(PushSpec{"t-parked", "h-parked", consumer.address, *spec, "r-parked"});
  EXPECT_FALSE((*engine)->wait_active_below(1, 0ms));  // queued for the dispatcher
  ASSERT_TRUE(consumer.received_within(5s)) << "the discovery never reached the consumer";
  // The dispatcher's pass that parked it ends (its count moves from queued to parked).
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while ((*engine)->counters().unstarted != 1 && std::chrono::steady_clock::now() < deadline) {
    (*engine)->wait_idle(10ms);
  }
  const auto counters = (*engine)->counters();
  EXPECT_EQ(counters.unstarted, 1u);
  EXPECT_EQ(counters.pushes.active, 0u);
  EXPECT_FALSE((*engine)->wait_active_below(1, 0ms));
  EXPECT_TRUE((*engine)->wait_active_below(2, 0ms));
  metrics::Registry registry;
  (*engine)->export_metrics(registry);
  EXPECT_EQ(registry.snapshot().at("ecx_producer_unstarted_pushes"), 1.0);
  (*engine)->shutdown(1s);
}

// A small push to a consumer already discovered is submitted without waking the
// dispatcher (it can do nothing for it before the source comes; the bind wakes it and
// it handles both in one pass). The source_wait stage still starts at submit(), and
// such a submit is never lost: a bad one fails as any other does.
TEST(PushEngineWaits, AQuietSubmitStartsItsSourceWaitAtSubmitAndFailsLikeAnyOther) {
  auto shards = control::testing::start_shards(1, std::make_shared<control::testing::TestHandler>());
  ASSERT_EQ(shards.size(), 1u);
  auto clock = std::make_shared<ManualClock>();
  auto engine = PushEngine::start(producer_config(nlohmann::json::object()), clock);
  ASSERT_TRUE(engine) << engine.status().to_string();
  auto spec = TensorSpec::make({16, 64}, DType::float16, 1 << 20);  // 2 KiB: direct
  ASSERT_TRUE(spec);
  const std::string consumer = shards[0]->control_endpoint();
  // The first push discovers the consumer; it then waits for a source that never comes.
  (*engine)->submit(PushSpec{"t-first", "h-first", consumer, *spec, "r-first"});
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while ((*engine)->counters().pushes.started == 0 && std::chrono::steady_clock::now() < deadline) {
    (*engine)->wait_idle(10ms);
  }
  ASSERT_EQ((*engine)->counters().pushes.started, 1u);

  const auto before = stages::snapshot()[static_cast<std::size_t>(stages::Stage::source_wait)];
  (*engine)->submit(PushSpec{"t-quiet", "h-quiet", consumer, *spec, "r-quiet"});
  clock->advance(7ms);  // the encoder runs
  const std::vector<std::byte> output(spec->nbytes(), std::byte{1});
  ASSERT_TRUE((*engine)->bind_source("h-quiet", output.data(), output.size()).ok());
  metrics::Histogram::Snapshot waited;
  deadline = std::chrono::steady_clock::now() + 20s;
  while (waited.count == 0 && std::chrono::steady_clock::now() < deadline) {
    (*engine)->wait_idle(10ms);
    waited = stages::snapshot()[static_cast<std::size_t>(stages::Stage::source_wait)].since(before);
  }
  ASSERT_EQ(waited.count, 1u);
  // From submit(), not from when the dispatcher took it (then 0). The sums are doubles:
  // a difference of two can read a hair under 7 ms.
  EXPECT_GE(waited.sum, 0.0069);

  // (The test shard has no data plane: the quiet push itself fails at its send.)
  (*engine)->submit(PushSpec{"bad id", "h-bad", consumer, *spec, "r-bad"});  // not an id
  std::vector<FailedSave> failures;
  const auto bad_reported = [&] {
    for (auto& f : (*engine)->drain_failures()) failures.push_back(std::move(f));
    return std::any_of(failures.begin(), failures.end(), [](const FailedSave& f) { return f.transfer_id == "bad id"; });
  };
  deadline = std::chrono::steady_clock::now() + 20s;
  while (!bad_reported() && std::chrono::steady_clock::now() < deadline) (*engine)->wait_idle(10ms);
  EXPECT_TRUE(bad_reported());
  (*engine)->shutdown(1s);
}

// lend_source: the engine's memory is sent in place and given back (the release runs
// once) whatever becomes of its pushes: a push that fails, content no push wants, or a
// consumer that never answers until shutdown.
TEST_F(MismatchedShard, ALentOutputIsGivenBackOnceWhenItsPushFails) {
  std::atomic<int> released{0};
  submit("lent");
  ASSERT_TRUE(engine->lend_source("h-lent", output.data(), output.size(), [&released] { ++released; }).ok());
  const auto failures = wait_for_failures(*engine, [&released] { return released.load() > 0; });
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(released.load(), 1) << "given back before shutdown, once";
  EXPECT_EQ(engine->counters().sources_lent, 1u);
  EXPECT_EQ(engine->counters().staging_used_bytes, 0u);  // nothing was copied
  engine->shutdown(1s);
  EXPECT_EQ(released.load(), 1);
}

TEST(PushEngineLending, ContentNoPushWantsIsGivenBackAtOnce) {
  auto engine = PushEngine::start(producer_config(nlohmann::json::object()));
  ASSERT_TRUE(engine) << engine.status().to_string();
  const std::vector<std::byte> output(4096, std::byte{1});
  std::atomic<int> released{0};
  ASSERT_TRUE((*engine)->lend_source("h-nobody", output.data(), output.size(), [&released] { ++released; }).ok());
  ASSERT_TRUE((*engine)->wait_idle(5s));
  EXPECT_EQ(released.load(), 1);
  EXPECT_EQ((*engine)->counters().sources_unused, 1u);
  (*engine)->shutdown(1s);
  EXPECT_EQ(released.load(), 1);
}

TEST(PushEngineLending, ShutdownGivesBackWhatAPushToASilentConsumerHeld) {
  SilentConsumer consumer;
  const auto config = producer_config({{"control_timeout_s", 30}});
  auto engine = PushEngine::start(config);
  ASSERT_TRUE(engine) << engine.status().to_string();
  auto spec = TensorSpec::make({16, 64}, DType::float16, 1 << 20);
  ASSERT_TRUE(spec);
  const std::vector<std::byte> output(spec->nbytes(), std::byte{7});
  std::atomic<int> released{0};
  (*engine)->submit(PushSpec{"t-held", "h-held", consumer.address, *spec, "r-held"});
  ASSERT_TRUE((*engine)->lend_source("h-held", output.data(), output.size(), [&released] { ++released; }).ok());
  ASSERT_TRUE(consumer.received_within(5s)) << "the push never reached the consumer";
  EXPECT_EQ(released.load(), 0);  // the push still needs it
  (*engine)->shutdown(seconds_to_duration(config.shutdown_drain_timeout_s));
  EXPECT_EQ(released.load(), 1);
}

}  // namespace
}  // namespace ecx::producer
