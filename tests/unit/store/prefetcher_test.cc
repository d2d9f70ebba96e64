// The producer worker's store prefetcher against a real redis-server on loopback: a
// prefetch is read and verified off the caller's thread, held within its byte budget,
// handed over once, and dropped when nobody takes it in time.
#include <chrono>
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "connector/worker/store_prefetcher.h"
#include "ecx/core/clock.h"
#include "ecx/store/embedding_store.h"
#include "sim/redis_server.h"

namespace ecx::worker {
namespace {

using namespace std::chrono_literals;

TensorSpec spec_of(std::int64_t rows) { return TensorSpec::make({rows, 64}, DType::bfloat16, 1 << 30).value(); }

std::vector<std::byte> payload_of(const TensorSpec& s, unsigned seed) {
  std::vector<std::byte> out(s.nbytes());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>((i * 31 + seed) & 0xff);
  return out;
}

// Polls for the prefetcher thread's answers (bounded), gathering every report.
StorePrefetcher::Report wait_for(StorePrefetcher& p, std::size_t answers) {
  StorePrefetcher::Report all;
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (all.ready.size() + all.failed.size() < answers && std::chrono::steady_clock::now() < until) {
    auto r = p.drain();
    all.ready = r.ready;  // every copy held now, each time
    all.failed.insert(all.failed.end(), r.failed.begin(), r.failed.end());
    all.dropped.insert(all.dropped.end(), r.dropped.begin(), r.dropped.end());
    std::this_thread::sleep_for(2ms);
  }
  return all;
}

class Prefetcher : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = sim::RedisServer::start();
    if (!s && s.status().message().find("missing") != std::string::npos) GTEST_SKIP() << s.status().message();
    ASSERT_TRUE(s) << s.status().to_string();
    server_.emplace(std::move(*s));
    store::RedisOptions o;
    o.port = server_->port();
    o.keys.model = "m@1";
    store_ = store::open_redis_store(o).value();
  }
  std::optional<sim::RedisServer> server_;
  std::shared_ptr<store::EmbeddingStore> store_;
};

TEST_F(Prefetcher, AVerifiedEntryIsHeldAndHandedOverOnce) {
  const TensorSpec s = spec_of(32);
  const auto bytes = payload_of(s, 3);
  ASSERT_TRUE(store_->put("img", s, bytes));
  auto clock = std::make_shared<ManualClock>();
  StorePrefetcher p(store_, std::uint64_t{1} << 20, 60s, clock);
  p.request({"img", s});
  p.request({"absent", s});
  const auto report = wait_for(p, 2);
  EXPECT_EQ(report.ready, std::vector<std::string>{"img"});
  EXPECT_EQ(report.failed, std::vector<std::string>{"absent"});
  EXPECT_EQ(p.counters().held_bytes, s.nbytes());
  // Reported again while held: another TP rank may answer only in a later step.
  EXPECT_EQ(p.drain().ready, std::vector<std::string>{"img"});
  auto copy = p.take("img");
  ASSERT_TRUE(copy);
  EXPECT_EQ(copy->bytes, bytes) << "bit-exact";
  EXPECT_FALSE(p.take("img")) << "handed over once";
  EXPECT_EQ(p.counters().held_bytes, 0u);
  EXPECT_TRUE(p.drain().ready.empty()) << "no longer held";
}

TEST_F(Prefetcher, AnEntryOfAnotherShapeOrOverTheBudgetIsNotHeld) {
  const TensorSpec s = spec_of(32);
  ASSERT_TRUE(store_->put("img", s, payload_of(s, 1)));
  ASSERT_TRUE(store_->put("big", spec_of(64), payload_of(spec_of(64), 2)));
  StorePrefetcher p(store_, spec_of(48).nbytes(), 60s, std::make_shared<ManualClock>());
  p.request({"img", spec_of(16)});  // the engine expects another shape
  p.request({"big", spec_of(64)});  // over the byte budget
  const auto report = wait_for(p, 2);
  EXPECT_TRUE(report.ready.empty());
  EXPECT_EQ(report.failed.size(), 2u);
  EXPECT_EQ(p.counters().failed, 2u);
}

TEST_F(Prefetcher, ACopyNobodyTakesIsDroppedAfterItsHoldTime) {
  const TensorSpec s = spec_of(8);
  ASSERT_TRUE(store_->put("img", s, payload_of(s, 5)));
  auto clock = std::make_shared<ManualClock>();
  StorePrefetcher p(store_, std::uint64_t{1} << 20, 30s, clock);
  p.request({"img", s});
  ASSERT_EQ(wait_for(p, 1).ready.size(), 1u);
  clock->advance(31s);
  const auto report = p.drain();
  EXPECT_EQ(report.dropped, std::vector<std::string>{"img"});
  EXPECT_FALSE(p.take("img"));
  EXPECT_EQ(p.counters().dropped, 1u);
}

}  // namespace
}  // namespace ecx::worker
