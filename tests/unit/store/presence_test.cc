// The presence index behind a producer's has_cache_item, against a real redis-server
// started by the test on loopback: the store's keyspace notifications keep it current,
// unknown items are confirmed off the caller's thread, and a store that goes away
// empties it (every item is encoded until it is back).

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/store/embedding_store.h"
#include "ecx/store/presence_index.h"
#include "ecx/store/store_config.h"
#include "sim/redis_server.h"

namespace ecx::store {
namespace {

using namespace std::chrono_literals;

TensorSpec spec_of(std::int64_t rows) { return TensorSpec::make({rows, 8}, DType::bfloat16, 1 << 30).value(); }

// Polls a condition that another thread makes true (an event arriving), bounded.
bool eventually(const std::function<bool()>& condition) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < until) {
    if (condition()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return condition();
}

RedisOptions options_for(int port, std::string model = "model@1") {
  RedisOptions o;
  o.port = port;
  o.keys.prefix = "ecxtest";
  o.keys.model = std::move(model);
  o.ttl_s = 600;
  o.io_timeout_s = 1.0;
  o.reconnect_interval_s = 0.05;
  return o;
}

class Presence : public ::testing::Test {
 protected:
  void start(bool keyspace_events = true) {
    sim::RedisServerOptions o;
    o.keyspace_events = keyspace_events;
    auto s = sim::RedisServer::start(o);
    if (!s && s.status().message().find("missing") != std::string::npos) GTEST_SKIP() << s.status().message();
    ASSERT_TRUE(s) << s.status().to_string();
    server_.emplace(std::move(*s));
  }
  std::unique_ptr<EmbeddingStore> writer(std::string model = "model@1") {
    return open_redis_store(options_for(server_->port(), std::move(model))).value();
  }
  std::unique_ptr<PresenceIndex> index(const PresenceOptions& p = {}, bool with_feed = true) {
    auto o = options_for(server_->port());
    std::shared_ptr<EmbeddingStore> lookups = open_redis_store(o).value();
    std::unique_ptr<PresenceFeed> feed;
    if (with_feed) feed = open_redis_feed(o).value();
    auto made = std::make_unique<PresenceIndex>(std::move(lookups), std::move(feed), p);
    if (with_feed) {
      EXPECT_TRUE(eventually([&] { return made->counters().feed_resyncs >= 1; })) << "subscribed";
    }
    return made;
  }
  Status put(EmbeddingStore& store, const std::string& h) {
    const TensorSpec s = spec_of(4);
    std::vector<std::byte> payload(s.nbytes(), std::byte{7});
    return store.put(h, s, payload);
  }
  std::optional<sim::RedisServer> server_;
};

TEST_F(Presence, AnotherEncodersWriteIsKnownWithoutAskingAndADeleteUnknowsIt) {
  start();
  auto idx = index();
  auto other = writer();
  ASSERT_TRUE(put(*other, "img-a"));
  ASSERT_TRUE(eventually([&] { return idx->counters().feed_events >= 2; }));  // resync + set
  EXPECT_TRUE(idx->present("img-a"));
  EXPECT_EQ(idx->counters().confirmations, 0u) << "known from the notification, not from a lookup";
  server_->raw({"DEL", "ecxtest:model@1:img-a"});
  ASSERT_TRUE(eventually([&] { return !idx->present("img-a"); }));
}

TEST_F(Presence, AnotherModelsEntriesAreNeverKnown) {
  start();
  auto idx = index();
  auto foreign = writer("other-model@1");
  auto mine = writer();
  ASSERT_TRUE(put(*foreign, "img-f"));
  ASSERT_TRUE(put(*mine, "img-m"));
  ASSERT_TRUE(eventually([&] { return idx->present("img-m"); }));
  EXPECT_FALSE(idx->present("img-f"));
  ASSERT_TRUE(idx->wait_confirmed(5s));
  EXPECT_FALSE(idx->present("img-f")) << "confirmed absent under this model's key";
}

TEST_F(Presence, AnUnknownItemIsAnsweredAbsentThenConfirmedOffThread) {
  start(/*keyspace_events=*/false);  // the server tells nothing: only confirmations
  auto other = writer();
  ASSERT_TRUE(put(*other, "img-c"));
  auto idx = index({}, /*with_feed=*/true);
  EXPECT_FALSE(idx->present("img-c")) << "never waits for the network";
  ASSERT_TRUE(idx->wait_confirmed(5s));
  EXPECT_TRUE(idx->present("img-c"));
  EXPECT_FALSE(idx->present("img-absent"));
  ASSERT_TRUE(idx->wait_confirmed(5s));
  EXPECT_FALSE(idx->present("img-absent"));
  const auto c = idx->counters();
  EXPECT_EQ(c.confirmations, 2u);
  EXPECT_EQ(c.confirmed_present, 1u);
  EXPECT_EQ(c.lookups, 4u);
  EXPECT_EQ(c.hits, 1u);
}

TEST_F(Presence, IsBoundedForgetsOnAFailedLoadAndExpiresWithTheStore) {
  start();
  auto clock = std::make_shared<ManualClock>();
  PresenceOptions p;
  p.max_entries = 3;
  p.max_queued = 2;
  p.entry_lifetime = 10s;
  p.clock = clock;
  auto idx = index(p, /*with_feed=*/false);
  for (const char* h : {"a", "b", "c", "d"}) idx->learn(h);
  EXPECT_EQ(idx->counters().entries, 3u);
  EXPECT_FALSE(idx->present("a")) << "the oldest went first";
  EXPECT_TRUE(idx->present("d"));
  idx->forget("d");
  EXPECT_FALSE(idx->present("d"));
  EXPECT_EQ(idx->counters().forgotten, 1u);
  clock->advance(11s);
  EXPECT_FALSE(idx->present("c")) << "past the store's TTL";
  // The confirmation queue is bounded too: what does not fit is dropped, counted.
  ASSERT_TRUE(idx->wait_confirmed(5s));
  const auto before = idx->counters();
  // A stalled store holds the lookup in flight, so the asks pile up against the bound.
  server_->process().signal(SIGSTOP);
  for (const char* h : {"q1", "q2", "q3", "q4", "q5", "q6"}) (void)idx->present(h);
  EXPECT_LE(idx->counters().queued, 2u);
  server_->process().signal(SIGCONT);
  ASSERT_TRUE(idx->wait_confirmed(5s));
  const auto c = idx->counters();
  const auto looked_up = c.confirmations - before.confirmations;
  const auto dropped = c.confirmations_dropped - before.confirmations_dropped;
  EXPECT_EQ(looked_up + dropped, 6u) << "each was looked up or dropped, counted";
  EXPECT_GE(dropped, 1u) << "six asks do not fit a queue of two";
}

// The real Redis feed, held back from subscribing until the test opens it (a test
// double of a slow first subscription, which the real feed cannot be made to have).
class HeldBackFeed final : public PresenceFeed {
 public:
  explicit HeldBackFeed(std::unique_ptr<PresenceFeed> real, std::shared_ptr<std::atomic<bool>> open)
      : real_(std::move(real)), open_(std::move(open)) {}
  Result<std::optional<PresenceEvent>> next(std::chrono::milliseconds wait) override {
    if (!open_->load()) {
      std::this_thread::sleep_for(std::min(wait, std::chrono::milliseconds(5)));
      return std::optional<PresenceEvent>();
    }
    return real_->next(wait);
  }
  std::string describe() const override { return real_->describe(); }

 private:
  std::unique_ptr<PresenceFeed> real_;
  std::shared_ptr<std::atomic<bool>> open_;
};

TEST_F(Presence, WhatWasConfirmedBeforeTheFeedSubscribedIsStillKnownAfter) {
  start();
  auto other = writer();
  ASSERT_TRUE(put(*other, "img-early"));
  auto o = options_for(server_->port());
  auto open = std::make_shared<std::atomic<bool>>(false);
  PresenceIndex idx(open_redis_store(o).value(), std::make_unique<HeldBackFeed>(open_redis_feed(o).value(), open),
                    PresenceOptions{});
  EXPECT_FALSE(idx.present("img-early")) << "unknown: asked, answered absent meanwhile";
  ASSERT_TRUE(eventually([&] { return idx.present("img-early"); })) << "confirmed by a lookup";
  EXPECT_FALSE(idx.wait_confirmed(0ms)) << "not current before the feed is subscribed";
  const auto lookups = idx.counters().confirmations;
  open->store(true);
  ASSERT_TRUE(idx.wait_confirmed(10s));
  EXPECT_EQ(idx.counters().feed_resyncs, 1u);
  EXPECT_TRUE(idx.present("img-early")) << "a subscription that came late did not forget it";
  EXPECT_GT(idx.counters().confirmations, lookups) << "looked up again: it may have gone before the subscription";
}

TEST_F(Presence, AStoreThatDiesEmptiesTheIndexAndItRefillsWhenItIsBack) {
  start();
  auto idx = index();
  auto other = writer();
  ASSERT_TRUE(put(*other, "img-k"));
  ASSERT_TRUE(eventually([&] { return idx->present("img-k"); }));
  const int port = server_->port();
  server_->process().signal(SIGKILL);
  ASSERT_TRUE(server_->process().wait(10s).has_value());
  ASSERT_TRUE(eventually([&] { return idx->counters().feed_errors >= 1; }));
  EXPECT_FALSE(idx->present("img-k")) << "events may be missed while the store is away";
  EXPECT_GE(idx->counters().cleared, 1u);
  // Back on the same port (empty: no persistence): the feed resubscribes by itself.
  auto again = sim::ChildProcess::spawn({sim::kRedisServerPath, "--port", std::to_string(port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no", "--notify-keyspace-events", "K$gxe"});
  ASSERT_TRUE(again) << again.status().to_string();
  const auto resyncs = idx->counters().feed_resyncs;
  ASSERT_TRUE(eventually([&] { return idx->counters().feed_resyncs > resyncs; }));
  auto writer_again = open_redis_store(options_for(port)).value();
  ASSERT_TRUE(eventually([&] { return put(*writer_again, "img-n").is_ok(); }));
  EXPECT_TRUE(eventually([&] { return idx->present("img-n"); }));
}

TEST(StoreConfig, TheUrlIsReadAndBadOnesAreNamed) {
  Config c;
  c.store_model = "m@1";
  c.store_url = "redis://:secret@10.0.0.7:6380/3";
  auto o = redis_options(c);
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->host, "10.0.0.7");
  EXPECT_EQ(o->port, 6380);
  EXPECT_EQ(o->database, 3);
  EXPECT_EQ(o->password, "secret");
  c.store_url = "redis://[::1]";
  o = redis_options(c);
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->host, "::1");
  EXPECT_EQ(o->port, 6379);
  for (const char* bad : {"memcached://h:1", "redis://h:99999", "redis://h:1/x", "redis://", "redis://[::1"}) {
    c.store_url = bad;
    auto r = redis_options(c);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.status().message().find("store_url"), std::string::npos) << r.status().message();
  }
  c.store_url = "redis://:s3cret@h:99999";
  auto leaked = redis_options(c);
  ASSERT_FALSE(leaked);
  EXPECT_EQ(leaked.status().message().find("s3cret"), std::string::npos) << "a password is never printed";
  c.store_url = "redis://h";
  c.store_model = "has space";
  EXPECT_NE(redis_options(c).status().message().find("store_model"), std::string::npos);
}

TEST(StoreConfig, TheCrossEncoderCacheNeedsAStoreAndAModelOnEveryRole) {
  for (const std::string role : {"ec_producer", "ec_consumer", "ec_both"}) {
    const auto parse = [&](const std::string& extra) {
      std::string text = R"({"ec_role": ")";
      text += role;
      text += R"(", "ec_connector_extra_config": {)";
      text += extra;
      text += "}}";
      return parse_config(text, {});
    };
    EXPECT_NE(parse(R"("cross_encoder_cache": true)").status().message().find("store_url"), std::string::npos) << role;
    EXPECT_NE(parse(R"("cross_encoder_cache": true, "store_url": "redis://h")").status().message().find("store_model"),
              std::string::npos)
        << role;
    auto ok = parse(R"("cross_encoder_cache": true, "store_url": "redis://h", "store_model": "m", "store_ttl_s": 60)");
    ASSERT_TRUE(ok) << role << ": " << ok.status().to_string();
    EXPECT_EQ(ok->store_ttl_s, 60);
    EXPECT_NE(parse(R"("store_ttl_s": -1)").status().message().find("store_ttl_s"), std::string::npos);
  }
}

}  // namespace
}  // namespace ecx::store
