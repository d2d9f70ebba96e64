// The worker end-to-end suite and its fault cases again, with transport = mooncake:
// this process is the consumer (stepped like an engine), `ecx demo --role producer
// --transport mooncake` the producer; ZeroMQ control plane, Mooncake (tcp) one-sided
// writes, all inside this test's private network namespace. Then the one-sided
// protocol against one shard: a slot whose writer may still write is never given
// back on a consumer-side cancel or a timeout, and a late completion never completes
// a newer reservation. Skipped, naming ECX_MOONCAKE_LIB, without the library.
#include <signal.h>

#include <future>
#include <thread>

#include <gtest/gtest.h>
#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "ecx/consumer/consumer_shard.h"
#include "ecx/control/client.h"
#include "ecx/core/config.h"
#include "fault_support.h"
#include "mooncake_test_support.h"
#include "sim/engine_sim.h"
#include "sim/process.h"
#include "sim/workload.h"

namespace ecx::sim {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

// The fault tests' CPU-pool consumer, over the Mooncake data plane.
Config consumer_config(int tp, int port, const std::string& pool, json extra_overrides = json::object()) {
  extra_overrides["transport"] = "mooncake";
  return fault::consumer_config(tp, port, pool, extra_overrides);
}

struct Workload {
  int requests = 200;
  int min_images = 1;
  int max_images = 4;
  int min_tokens = 32;    // 32 x 1024 x 2 B = 64 KiB
  int max_tokens = 8192;  // 8192 x 1024 x 2 B = 16 MiB
  double repeat = 0.2;
  bool log_sizes = true;
  std::uint64_t seed = 7;
  std::string pool = "512MiB";  // the producer's staging pool
};

std::vector<std::string> producer_argv(const Workload& w, const ConsumerSim& consumer, int port) {
  std::vector<std::string> argv = {std::string(ECX_BINARY_DIR) + "/bin/ecx",
                                   "demo",
                                   "--role",
                                   "producer",
                                   "--transport",
                                   "mooncake",
                                   "--consumer",
                                   consumer.control_address(),
                                   "--admit",
                                   consumer.admit_endpoint(),
                                   "--requests",
                                   std::to_string(w.requests),
                                   "--min-images",
                                   std::to_string(w.min_images),
                                   "--max-images",
                                   std::to_string(w.max_images),
                                   "--min-tokens",
                                   std::to_string(w.min_tokens),
                                   "--max-tokens",
                                   std::to_string(w.max_tokens),
                                   "--hidden",
                                   "1024",
                                   "--repeat",
                                   std::to_string(w.repeat),
                                   "--seed",
                                   std::to_string(w.seed),
                                   "--pool-size",
                                   w.pool,
                                   "--port",
                                   std::to_string(port),
                                   "--deadline",
                                   "120"};
  if (w.log_sizes) argv.emplace_back("--log-sizes");
  return argv;
}

struct Run {
  ConsumerResult result;
  int producer_exit = -1;
};

Run run_pair(const Workload& w, int tp, const std::string& consumer_pool, const json& extra = json::object()) {
  Run run;
  const int port = free_port_block(tp);
  EXPECT_NE(port, 0);
  ConsumerSimOptions options;
  options.config = consumer_config(tp, port, consumer_pool, extra);
  options.deadline = 180s;
  auto consumer = ConsumerSim::start(std::move(options));
  EXPECT_TRUE(consumer) << consumer.status().to_string();
  if (!consumer) return run;
  auto producer = ChildProcess::spawn(producer_argv(w, **consumer, port));
  EXPECT_TRUE(producer) << producer.status().to_string();
  if (!producer) return run;
  run.result = (*consumer)->run();
  run.producer_exit = producer->wait(60s).value_or(-1);
  return run;
}

void expect_clean(const Run& run, int requests) {
  const auto& r = run.result;
  ASSERT_TRUE(r.producer_done) << "the producer never said it was done";
  EXPECT_EQ(run.producer_exit, 0);
  EXPECT_EQ(r.progress.requests_admitted, static_cast<std::uint64_t>(requests));
  EXPECT_EQ(r.progress.requests_ready, static_cast<std::uint64_t>(requests));
  EXPECT_EQ(r.progress.requests_failed, 0U)
      << "first failed: " << (r.failed_requests.empty() ? "" : r.failed_requests[0]);
  EXPECT_EQ(r.content_mismatches, 0U);
  EXPECT_EQ(r.checksum_mismatches, 0U);
  EXPECT_EQ(r.live_reservations, 0U);
  EXPECT_EQ(r.leaked_pool_bytes, 0U);
  EXPECT_EQ(r.invariant_error, "");
}

class MooncakeEndToEnd : public ::testing::TestWithParam<int> {};

TEST_P(MooncakeEndToEnd, EveryItemArrivesBitExactAndThePoolEndsFree) {
  ECX_REQUIRE_MOONCAKE();
  Workload w;
  const auto run = run_pair(w, GetParam(), "512MiB");
  expect_clean(run, w.requests);
  EXPECT_GE(run.result.items_ready, 400U);  // 200 requests of 1..4 images
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, MooncakeEndToEnd, ::testing::Values(1, 2),
                         [](const auto& param_info) { return "tp" + std::to_string(param_info.param); });

// A consumer pool far smaller than the traffic: reserves get retry_after and every
// item still arrives once slots free up.
TEST(MooncakeFaults, PoolExhaustedBackPressureStillDeliversEveryItem) {
  ECX_REQUIRE_MOONCAKE();
  Workload w;
  w.requests = 50;
  w.min_images = 1;
  w.max_images = 1;
  w.min_tokens = 512;  // 1..4 MiB items
  w.max_tokens = 2048;
  w.repeat = 0;
  w.log_sizes = false;
  w.pool = "128MiB";
  const auto run = run_pair(w, 1, "8MiB");
  expect_clean(run, w.requests);
}

// The same image in every request: one write lands it, every transfer is served.
TEST(MooncakeFaults, SameImageInFiftyRequestsOneWriteServesAll) {
  ECX_REQUIRE_MOONCAKE();
  Workload w;
  w.requests = 50;
  w.min_images = 1;
  w.max_images = 1;
  w.min_tokens = 512;
  w.max_tokens = 512;
  w.repeat = 1.0;
  w.log_sizes = false;
  w.pool = "64MiB";
  const auto run = run_pair(w, 1, "64MiB");
  expect_clean(run, w.requests);
}

// ---- the one-sided protocol against one shard, written by a Mooncake engine here.

constexpr std::uint64_t kMiB = 1ULL << 20;

TensorSpec bytes_spec(std::uint64_t n) {
  return TensorSpec::make({static_cast<std::int64_t>(n)}, DType::uint8, ~0ULL).value();
}

class OneSidedShard : public ::testing::Test {
 protected:
  void SetUp() override {
    ECX_REQUIRE_MOONCAKE();
    const int port = free_port_block(1);
    ASSERT_NE(port, 0);
    config_ = consumer_config(1, port, "16MiB", {{"reservation_ttl_s", 5}});
    clock_ = std::make_shared<ManualClock>();
    auto shard = consumer::ConsumerShard::start(config_, clock_);
    ASSERT_TRUE(shard) << shard.status().to_string();
    shard_ = std::move(*shard);
    address_ = config_.control_address(0);
    auto client = control::ControlClient::create(control::ClientOptions::from_config(config_));
    ASSERT_TRUE(client) << client.status().to_string();
    client_ = std::move(*client);
    auto hello = client_->hello(address_, 5s);
    ASSERT_TRUE(hello) << hello.status().to_string();
    ASSERT_EQ(hello->data.transport, "mooncake");
    ASSERT_FALSE(hello->data.segment.empty());
    ASSERT_NE(hello->data.base, 0U);
    base_ = hello->data.base;
    auto writer = transport::create_mooncake_transport(transport::MooncakeOptions{});
    ASSERT_TRUE(writer) << writer.status().to_string();
    writer_ = std::move(*writer);
    source_.resize(4 * kMiB);
    auto region = writer_->register_region(source_.data(), source_.size(), transport::MemoryKind::host);
    ASSERT_TRUE(region) << region.status().to_string();
    region_ = *region;
    auto endpoint = writer_->connect(hello->data.segment);
    ASSERT_TRUE(endpoint) << endpoint.status().to_string();
    endpoint_ = *endpoint;
  }

  void TearDown() override {
    writer_.reset();
    client_.reset();
    if (shard_) shard_->shutdown();
  }

  wire::ReserveResult reserve(const std::string& tid, const std::string& hash, std::uint64_t n) {
    auto reply = client_->reserve_batch(address_, {wire::ReserveItem{tid, hash, bytes_spec(n), std::nullopt}}, 5s);
    EXPECT_TRUE(reply) << reply.status().to_string();
    if (!reply || reply->items.size() != 1) return wire::ReserveResult::failed(internal_error("no reply"));
    return reply->items[0];
  }

  // Writes `hash`'s content into the reserved slot and waits for it to settle.
  std::uint64_t write(const wire::ReserveResult& r, const std::string& hash, std::uint64_t n) {
    EXPECT_TRUE(r.offset.has_value()) << "a one-sided reserve reply names the slot offset";
    fill_content(hash, std::span<std::byte>(source_.data(), n));
    std::promise<Status> done;
    auto settled = done.get_future();
    EXPECT_TRUE(writer_->write(endpoint_, region_, 0, n, base_ + r.offset.value_or(0),
                               SteadyClock::shared()->now() + 20s, [&done](const Status& s) { done.set_value(s); }));
    EXPECT_EQ(settled.wait_for(20s), std::future_status::ready);
    EXPECT_TRUE(settled.get());
    return XXH64(source_.data(), n, 0);
  }

  Result<wire::CompleteReply> complete(const std::string& tid, const wire::ReserveResult& r,
                                       std::optional<std::uint64_t> checksum) {
    return control::reply_body<wire::CompleteReply>(
        client_->call(address_, wire::CompleteRequest{tid, r.reservation_id, r.generation, checksum}, 5s).get());
  }

  std::string state_of(const std::string& tid) {
    auto s = client_->status(address_, tid, 5s);
    if (!s) return "error: " + s.status().to_string();
    return s->found ? s->state : "absent";
  }

  consumer::ReservationCounters counters() { return shard_->counters().reservations; }

  Config config_;
  std::shared_ptr<ManualClock> clock_;
  std::unique_ptr<consumer::ConsumerShard> shard_;
  std::string address_;
  std::unique_ptr<control::ControlClient> client_;
  std::uint64_t base_ = 0;
  std::unique_ptr<transport::MooncakeTransport> writer_;
  std::vector<std::byte> source_;
  transport::RegionHandle region_;
  transport::EndpointHandle endpoint_;
};

TEST_F(OneSidedShard, WriteThenCompleteMakesTheSlotReadyWithTheWrittenBytes) {
  const auto r = reserve("t-ok", "h-ok", 3 * kMiB);
  ASSERT_EQ(r.outcome, wire::ReserveOutcome::reserved);
  const auto checksum = write(r, "h-ok", 3 * kMiB);
  auto done = complete("t-ok", r, checksum);
  ASSERT_TRUE(done) << done.status().to_string();
  EXPECT_TRUE(done->completed);
  EXPECT_TRUE(done->became_ready);
  auto lease = shard_->take("t-ok", "h-ok");
  ASSERT_TRUE(lease) << lease.status().to_string();
  EXPECT_TRUE(content_matches("h-ok", std::span<const std::byte>(lease->data(), 3 * kMiB)));
}

TEST_F(OneSidedShard, ConsumerCancelDefersUntilTheWriterCompletes) {
  const auto r = reserve("t-cancel", "h-cancel", 2 * kMiB);
  ASSERT_EQ(r.outcome, wire::ReserveOutcome::reserved);
  const auto used = counters().pool_used_bytes;
  ASSERT_GE(used, 2 * kMiB);
  // The consumer's scheduler gives up; the producer may still be writing.
  auto cancel = client_->cancel(address_, wire::CancelRequest{"t-cancel", {}, false, false}, 5s);
  ASSERT_TRUE(cancel) << cancel.status().to_string();
  EXPECT_EQ(state_of("t-cancel"), "cancel_pending");
  EXPECT_EQ(counters().pool_used_bytes, used) << "the slot was given back while its writer may still write";
  // Neither a new reservation nor the TTL takes that slot meanwhile.
  clock_->advance(60s);
  EXPECT_TRUE(shard_->check_invariants());
  EXPECT_EQ(state_of("t-cancel"), "cancel_pending");
  EXPECT_EQ(counters().pool_used_bytes, used);
  const auto checksum = write(r, "h-cancel", 2 * kMiB);
  auto done = complete("t-cancel", r, checksum);
  ASSERT_TRUE(done) << done.status().to_string();
  EXPECT_TRUE(done->completed);
  EXPECT_FALSE(done->became_ready);
  EXPECT_EQ(state_of("t-cancel"), "cancelled");
  // The transfer is over; what landed stays only as a resident (reusable) copy.
  EXPECT_EQ(counters().live_records, 0U);
  EXPECT_EQ(counters().pool_used_bytes, counters().resident_bytes);
  EXPECT_TRUE(shard_->check_invariants());
}

TEST_F(OneSidedShard, TimeoutDefersUntilTheWriterAbandons) {
  const auto r = reserve("t-ttl", "h-ttl", kMiB);
  ASSERT_EQ(r.outcome, wire::ReserveOutcome::reserved);
  const auto used = counters().pool_used_bytes;
  clock_->advance(10s);  // past reservation_ttl_s; the next reserve runs the sweep
  const auto other = reserve("t-other", "h-other", kMiB);
  EXPECT_EQ(state_of("t-ttl"), "expire_pending");
  EXPECT_GE(counters().pool_used_bytes, used) << "a timeout cannot prove the writer stopped";
  auto abandon = client_->cancel(address_, wire::CancelRequest{"t-ttl", r.reservation_id, true, false}, 5s);
  ASSERT_TRUE(abandon) << abandon.status().to_string();
  EXPECT_TRUE(abandon->cancelled);
  EXPECT_NE(state_of("t-ttl"), "expire_pending");
  EXPECT_TRUE(client_->cancel(address_, wire::CancelRequest{"t-other", other.reservation_id, true, false}, 5s));
  EXPECT_EQ(counters().live_records, 0U);
  EXPECT_EQ(counters().pool_used_bytes, 0U);
  EXPECT_TRUE(shard_->check_invariants());
}

TEST_F(OneSidedShard, LateCompletionNeverCompletesANewerReservation) {
  const auto first = reserve("t-late", "h-late", kMiB);
  ASSERT_EQ(first.outcome, wire::ReserveOutcome::reserved);
  // The producer refreshes the reservation (abandon + refresh), then reserves again.
  auto refresh = client_->cancel(address_, wire::CancelRequest{"t-late", first.reservation_id, true, true}, 5s);
  ASSERT_TRUE(refresh) << refresh.status().to_string();
  const auto second = reserve("t-late", "h-late", kMiB);
  ASSERT_EQ(second.outcome, wire::ReserveOutcome::reserved);
  ASSERT_NE(second.reservation_id, first.reservation_id);
  // A completion naming the first reservation arrives late: refused, nothing ready.
  const auto checksum = write(second, "h-late", kMiB);
  auto stale = complete("t-late", first, checksum);
  ASSERT_TRUE(stale) << stale.status().to_string();
  EXPECT_FALSE(stale->completed);
  EXPECT_EQ(state_of("t-late"), "writing");
  auto fresh = complete("t-late", second, checksum);
  ASSERT_TRUE(fresh) << fresh.status().to_string();
  EXPECT_TRUE(fresh->became_ready);
  auto lease = shard_->take("t-late", "h-late");
  ASSERT_TRUE(lease) << lease.status().to_string();
  EXPECT_TRUE(content_matches("h-late", std::span<const std::byte>(lease->data(), kMiB)));
}

TEST_F(OneSidedShard, WrongChecksumFailsTheTransferAndFreesTheSlot) {
  const auto r = reserve("t-bad", "h-bad", kMiB);
  ASSERT_EQ(r.outcome, wire::ReserveOutcome::reserved);
  const auto checksum = write(r, "h-bad", kMiB);
  auto done = complete("t-bad", r, checksum ^ 1);
  ASSERT_TRUE(done) << done.status().to_string();
  EXPECT_FALSE(done->became_ready);
  EXPECT_EQ(counters().checksum_mismatches, 1U);
  EXPECT_FALSE(shard_->take("t-bad", "h-bad"));
  EXPECT_EQ(counters().pool_used_bytes, 0U);
}

}  // namespace
}  // namespace ecx::sim
