// The embedding store against a real redis-server that the test starts on loopback
// (Debian's redis-server), and its entry format on its own.

#include <hiredis/hiredis.h>
#include <signal.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <thread>

#include <gtest/gtest.h>

#include "ecx/core/clock.h"
#include "ecx/store/embedding_store.h"
#include "ecx/store/publisher.h"
#include "sim/process.h"
#include "sim/redis_server.h"
#include "store/entry_format.h"

namespace ecx::store {
namespace {

using namespace std::chrono_literals;

TensorSpec spec(const std::vector<std::int64_t>& shape, DType dtype = DType::bfloat16) {
  return TensorSpec::make(shape, dtype, std::uint64_t{1} << 34).value();
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = static_cast<std::byte>((i * 131 + std::size_t{seed} * 7 + (i >> 9)) & 0xff);
  return out;
}

using sim::RedisServer;
constexpr const char* kRedisServer = sim::kRedisServerPath;

std::optional<RedisServer> start_redis() {
  auto server = RedisServer::start();
  if (!server) return std::nullopt;
  return std::move(*server);
}

RedisOptions options_for(int port, std::string model = "test-model@1", std::shared_ptr<const Clock> clock = nullptr,
                         double io_timeout_s = 1.0) {
  RedisOptions o;
  o.port = port;
  o.keys.prefix = "ecxtest";
  o.keys.model = std::move(model);
  o.ttl_s = 600;
  o.io_timeout_s = io_timeout_s;
  o.clock = std::move(clock);
  return o;
}

// Lands into a vector sized from the entry's own spec.
EmbeddingStore::Landing into(std::vector<std::byte>& out) {
  return [&out](const TensorSpec& s) -> Result<std::span<std::byte>> {
    out.assign(s.nbytes(), std::byte{0});
    return std::span<std::byte>(out);
  };
}

class StoreWithRedis : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access(kRedisServer, X_OK) != 0) GTEST_SKIP() << kRedisServer << " is missing (Debian package redis-server)";
    server_ = start_redis();
    ASSERT_TRUE(server_.has_value()) << "redis-server did not start";
  }
  std::unique_ptr<EmbeddingStore> open(std::string model = "test-model@1", std::shared_ptr<const Clock> clock = nullptr,
                                       int port = 0, double io_timeout_s = 1.0) {
    auto s =
        open_redis_store(options_for(port ? port : server_->port(), std::move(model), std::move(clock), io_timeout_s));
    EXPECT_TRUE(s) << s.status().to_string();
    return s ? std::move(*s) : nullptr;
  }
  std::optional<RedisServer> server_;
};

TEST(StoreEntryFormat, RoundTripsAndRefusesWhatDoesNotMatch) {
  const TensorSpec s = spec({3, 5});
  const std::string header = detail::encode_entry_header("m", s, 42);
  std::string value = header + std::string(s.nbytes(), 'x');
  auto decoded = detail::decode_entry_header(value, "m", 1 << 20);
  ASSERT_TRUE(decoded) << decoded.status().to_string();
  EXPECT_EQ(decoded->spec, s);
  EXPECT_EQ(decoded->checksum, 42u);
  EXPECT_EQ(decoded->header_bytes, header.size());

  EXPECT_NE(detail::decode_entry_header(value, "other", 1 << 20).status().message().find("model 'm'"),
            std::string::npos);
  EXPECT_NE(
      detail::decode_entry_header(value.substr(0, value.size() - 1), "m", 1 << 20).status().message().find("truncated"),
      std::string::npos);
  EXPECT_EQ(detail::decode_entry_header(value.substr(0, 10), "m", 1 << 20).status().code(), StatusCode::protocol);
  std::string bad_magic = value;
  bad_magic[0] = 'X';
  EXPECT_EQ(detail::decode_entry_header(bad_magic, "m", 1 << 20).status().code(), StatusCode::protocol);
  std::string bad_rank = value;
  bad_rank[7] = 9;
  EXPECT_EQ(detail::decode_entry_header(bad_rank, "m", 1 << 20).status().code(), StatusCode::protocol);
  EXPECT_EQ(detail::decode_entry_header(value, "m", 8).status().code(), StatusCode::protocol) << "over the size bound";
}

TEST(StoreKeys, AreBuiltFromPrefixModelAndHashAndRefuseAmbiguousFields) {
  KeySpace k{"ecx", "Qwen/Qwen2.5-VL-7B@abc"};
  EXPECT_EQ(k.key("h1").value(), "ecx:Qwen/Qwen2.5-VL-7B@abc:h1");
  EXPECT_NE((KeySpace{"ecx", ""}).validate().message().find("model identity"), std::string::npos);
  EXPECT_NE((KeySpace{"a:b", "m"}).validate().message().find("key prefix"), std::string::npos);
  EXPECT_FALSE(KeySpace({"ecx", "m:x"}).validate());
  EXPECT_NE(k.key("").status().message().find("mm_hash"), std::string::npos);
  EXPECT_FALSE(k.key("has space"));
  EXPECT_NE(open_redis_store(RedisOptions{}).status().message().find("model identity"), std::string::npos);
  RedisOptions bad_ttl;
  bad_ttl.keys.model = "m";
  bad_ttl.ttl_s = 0;
  EXPECT_NE(open_redis_store(bad_ttl).status().message().find("ttl_s"), std::string::npos);
}

TEST_F(StoreWithRedis, WhatOneEncoderPutsAnotherFindsAndLoadsBitExact) {
  auto writer = open();
  auto reader = open();  // another encoder's connection
  ASSERT_TRUE(writer && reader);
  const TensorSpec s = spec({1300, 3584});  // ~9 MiB
  const auto payload = pattern(s.nbytes(), 1);
  ASSERT_TRUE(writer->put("img-a", s, payload));

  const std::vector<std::string> asked = {"img-a", "img-b"};
  auto present = reader->contains(asked);
  ASSERT_TRUE(present) << present.status().to_string();
  EXPECT_EQ(*present, (std::vector<bool>{true, false}));

  std::vector<std::byte> loaded;
  auto entry = reader->get_into("img-a", into(loaded));
  ASSERT_TRUE(entry) << entry.status().to_string();
  EXPECT_EQ(entry->spec, s);
  EXPECT_EQ(entry->checksum, XXH64(payload.data(), payload.size(), 0)) << "the checksum the get verified";
  EXPECT_TRUE(loaded == payload) << "not bit-exact";
  EXPECT_EQ(reader->get_into("img-b", into(loaded)).status().code(), StatusCode::not_found);

  const auto w = writer->counters();
  EXPECT_EQ(w.puts, 1u);
  EXPECT_EQ(w.bytes_published, s.nbytes());
  const auto r = reader->counters();
  EXPECT_EQ(r.lookups, 2u);
  EXPECT_EQ(r.hits, 1u);
  EXPECT_EQ(r.misses, 1u);
  EXPECT_EQ(r.gets, 2u);
  EXPECT_EQ(r.bytes_loaded, s.nbytes());
  EXPECT_EQ(r.errors, 0u);

  // Every entry expires by itself (the TTL the options name).
  auto ttl = server_->raw({"PTTL", "ecxtest:test-model@1:img-a"});
  ASSERT_TRUE(ttl && ttl->type == REDIS_REPLY_INTEGER);
  EXPECT_GT(ttl->integer, 590'000) << "the configured ttl_s (600 s), set by the put itself";
  EXPECT_LE(ttl->integer, 600'000);
}

TEST_F(StoreWithRedis, ABatchedLookupAnswersEveryItemInOrder) {
  auto store = open();
  ASSERT_TRUE(store);
  const TensorSpec s = spec({4, 4});
  std::vector<std::string> asked;
  std::vector<bool> expected;
  for (int i = 0; i < 200; ++i) {
    asked.push_back("batch-" + std::to_string(i));
    expected.push_back(i % 3 == 0);
    if (i % 3 == 0) {
      ASSERT_TRUE(store->put(asked.back(), s, pattern(s.nbytes(), static_cast<unsigned>(i))));
    }
  }
  auto present = store->contains(asked);
  ASSERT_TRUE(present) << present.status().to_string();
  EXPECT_EQ(*present, expected);
  const auto c = store->counters();
  EXPECT_EQ(c.lookups, 200u);
  EXPECT_EQ(c.hits, 67u);
  EXPECT_EQ(c.misses, 133u);
  EXPECT_EQ(store->contains({}).value(), std::vector<bool>{}) << "an empty batch asks nothing";

  // One bad mm_hash refuses the batch before anything is sent.
  asked.push_back("bad:hash");
  EXPECT_EQ(store->contains(asked).status().code(), StatusCode::invalid_argument);
  EXPECT_EQ(store->counters().lookups, 200u);
}

TEST_F(StoreWithRedis, ACorruptOrTruncatedEntryIsRefusedDeletedAndNeverLanded) {
  auto store = open();
  ASSERT_TRUE(store);
  const TensorSpec s = spec({64, 128});
  const auto payload = pattern(s.nbytes(), 2);
  const std::string key = "ecxtest:test-model@1:img-c";

  // One flipped payload byte.
  ASSERT_TRUE(store->put("img-c", s, payload));
  auto len = server_->raw({"STRLEN", key});
  ASSERT_TRUE(len && len->type == REDIS_REPLY_INTEGER);
  ASSERT_TRUE(server_->raw({"SETRANGE", key, std::to_string(len->integer - 100), "Z"}));
  bool landed = false;
  auto corrupt = store->get_into("img-c", [&](const TensorSpec&) -> Result<std::span<std::byte>> {
    landed = true;
    return internal_error("must not be called");
  });
  EXPECT_EQ(corrupt.status().code(), StatusCode::protocol) << corrupt.status().to_string();
  EXPECT_NE(corrupt.status().message().find("checksum"), std::string::npos);
  EXPECT_FALSE(landed);
  auto exists = server_->raw({"EXISTS", key});
  EXPECT_EQ(exists->integer, 0) << "a refused entry is deleted so that it is encoded and written again";

  // Cut short.
  ASSERT_TRUE(store->put("img-c", s, payload));
  auto whole = server_->raw({"GET", key});
  ASSERT_TRUE(whole && whole->type == REDIS_REPLY_STRING);
  ASSERT_TRUE(server_->raw({"SET", key, std::string(whole->str, whole->len - 1)}));
  std::vector<std::byte> loaded;
  auto truncated = store->get_into("img-c", into(loaded));
  EXPECT_EQ(truncated.status().code(), StatusCode::protocol);
  EXPECT_NE(truncated.status().message().find("truncated"), std::string::npos) << truncated.status().message();

  // Bytes that were never an entry, and a header cut inside its shape.
  ASSERT_TRUE(server_->raw({"SET", key, "not an entry at all, just some bytes"}));
  EXPECT_EQ(store->get_into("img-c", into(loaded)).status().code(), StatusCode::protocol);
  ASSERT_TRUE(server_->raw({"SET", key, std::string(whole->str, 30)}));
  EXPECT_EQ(store->get_into("img-c", into(loaded)).status().code(), StatusCode::protocol);
  EXPECT_EQ(store->counters().rejected, 4u);
  EXPECT_EQ(store->counters().bytes_loaded, 0u);
  EXPECT_EQ(store->counters().errors, 0u) << "a bad entry is not a store error";

  // Encoded again and written again: served.
  ASSERT_TRUE(store->put("img-c", s, payload));
  ASSERT_TRUE(store->get_into("img-c", into(loaded)));
  EXPECT_TRUE(loaded == payload);
}

TEST_F(StoreWithRedis, AValueTooLargeToBeAnEntryIsRefusedWithoutReadingItWhole) {
  RedisOptions o = options_for(server_->port());
  o.max_entry_bytes = 1 << 20;
  auto opened = open_redis_store(o);
  ASSERT_TRUE(opened) << opened.status().to_string();
  auto& store = *opened;
  const std::string key = "ecxtest:test-model@1:img-huge";
  ASSERT_TRUE(server_->raw({"SET", key, std::string(std::size_t{3} << 20, 'h')}));
  std::vector<std::byte> loaded;
  auto huge = store->get_into("img-huge", into(loaded));
  EXPECT_EQ(huge.status().code(), StatusCode::protocol) << huge.status().to_string();
  EXPECT_NE(huge.status().message().find("over max_entry_bytes"), std::string::npos) << huge.status().message();
  EXPECT_EQ(server_->raw({"EXISTS", key})->integer, 0);
  const auto c = store->counters();
  EXPECT_EQ(c.rejected, 1u);
  EXPECT_EQ(c.errors, 0u) << "the connection stays usable";
  const TensorSpec too_big = spec({1024, 1024});  // 2 MiB
  EXPECT_EQ(store->put("img-huge", too_big, pattern(too_big.nbytes(), 1)).code(), StatusCode::invalid_argument);
  const TensorSpec s = spec({8, 8});
  ASSERT_TRUE(store->put("img-small", s, pattern(s.nbytes(), 2)));
  EXPECT_TRUE(store->get_into("img-small", into(loaded)));
}

TEST_F(StoreWithRedis, AnEntryWrittenUnderAnotherModelIsNeverUsed) {
  auto model_a = open("model-a");
  auto model_b = open("model-b");
  ASSERT_TRUE(model_a && model_b);
  const TensorSpec s = spec({16, 16});
  ASSERT_TRUE(model_a->put("img-d", s, pattern(s.nbytes(), 3)));
  const std::vector<std::string> asked = {"img-d"};
  EXPECT_EQ(model_b->contains(asked).value(), std::vector<bool>{false}) << "another model's key space";
  std::vector<std::byte> loaded;
  EXPECT_EQ(model_b->get_into("img-d", into(loaded)).status().code(), StatusCode::not_found);

  // Even copied under model b's key, the value names model a: refused.
  auto value = server_->raw({"GET", "ecxtest:model-a:img-d"});
  ASSERT_TRUE(value && value->type == REDIS_REPLY_STRING);
  ASSERT_TRUE(server_->raw({"SET", "ecxtest:model-b:img-d", std::string(value->str, value->len)}));
  auto foreign = model_b->get_into("img-d", into(loaded));
  EXPECT_EQ(foreign.status().code(), StatusCode::protocol);
  EXPECT_NE(foreign.status().message().find("model 'model-a'"), std::string::npos) << foreign.status().message();
  EXPECT_EQ(model_b->counters().rejected, 1u);
  EXPECT_EQ(server_->raw({"EXISTS", "ecxtest:model-b:img-d"})->integer, 0) << "the foreign copy is deleted";
  EXPECT_EQ(server_->raw({"EXISTS", "ecxtest:model-a:img-d"})->integer, 1) << "model a's own entry is untouched";
  EXPECT_TRUE(model_a->get_into("img-d", into(loaded))) << "and still serves model a";
}

TEST_F(StoreWithRedis, AStoreThatIsDownFailsFastUntilItsRetryIntervalThenRecovers) {
  auto clock = std::make_shared<ManualClock>();
  const int port = server_->port();
  server_.reset();  // nothing listens there now
  auto store = open("test-model@1", clock, port);
  ASSERT_TRUE(store);
  const std::vector<std::string> asked = {"img-e"};
  auto first = store->contains(asked);
  EXPECT_EQ(first.status().code(), StatusCode::unavailable) << first.status().to_string();
  EXPECT_NE(first.status().message().find("cannot connect"), std::string::npos) << first.status().message();
  EXPECT_NE(first.status().message().find(std::to_string(port)), std::string::npos) << "names the address";
  auto second = store->contains(asked);
  EXPECT_EQ(second.status().code(), StatusCode::unavailable);
  EXPECT_NE(second.status().message().find("next attempt"), std::string::npos) << "fails fast, no new connect";
  std::vector<std::byte> loaded;
  EXPECT_EQ(store->get_into("img-e", into(loaded)).status().code(), StatusCode::unavailable);
  const TensorSpec s = spec({2, 2});
  EXPECT_EQ(store->put("img-e", s, pattern(s.nbytes(), 5)).code(), StatusCode::unavailable);
  EXPECT_EQ(store->counters().errors, 4u);
  EXPECT_EQ(store->counters().puts, 0u);

  // The store comes back (on its old port); after the retry interval calls go through.
  auto child = sim::ChildProcess::spawn(
      {kRedisServer, "--port", std::to_string(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"});
  ASSERT_TRUE(child) << child.status().to_string();
  clock->advance(2s);
  Result<std::vector<bool>> again = unavailable("not asked yet");
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (!again && std::chrono::steady_clock::now() < until) {  // bounded: until the server accepts
    clock->advance(2s);
    again = store->contains(asked);
  }
  ASSERT_TRUE(again) << again.status().to_string();
  EXPECT_EQ(*again, std::vector<bool>{false});
}

TEST_F(StoreWithRedis, AStoreThatStallsMidRunCostsOneTimeoutNotAHang) {
  auto clock = std::make_shared<ManualClock>();
  auto store = open("test-model@1", clock, 0, /*io_timeout_s=*/0.2);
  ASSERT_TRUE(store);
  const TensorSpec s = spec({32, 32});
  ASSERT_TRUE(store->put("img-f", s, pattern(s.nbytes(), 4)));
  server_->process().signal(SIGSTOP);
  std::vector<std::byte> loaded;
  auto stalled = store->get_into("img-f", into(loaded));
  EXPECT_EQ(stalled.status().code(), StatusCode::timeout) << stalled.status().to_string();
  // A large put to a stalled server: the send side is bounded by the same deadline.
  clock->advance(2s);
  const TensorSpec big = spec({1300, 3584});
  auto stalled_put = store->put("img-f2", big, pattern(big.nbytes(), 6));
  EXPECT_EQ(stalled_put.code(), StatusCode::timeout) << stalled_put.to_string();
  server_->process().signal(SIGCONT);
  EXPECT_EQ(store->counters().errors, 2u);

  // Within the retry interval calls fail fast; after it the store is used again.
  EXPECT_NE(store->get_into("img-f", into(loaded)).status().message().find("next attempt"), std::string::npos);
  clock->advance(2s);
  auto again = store->get_into("img-f", into(loaded));
  ASSERT_TRUE(again) << again.status().to_string();
  EXPECT_TRUE(loaded == pattern(s.nbytes(), 4));
}

TEST_F(StoreWithRedis, AStoreKilledMidRunIsAnErrorAtOnceAndCounted) {
  auto clock = std::make_shared<ManualClock>();
  // A long I/O timeout: if a call waited for it instead of seeing the closed
  // connection, it would say timeout, not unavailable.
  auto store = open("test-model@1", clock, 0, /*io_timeout_s=*/30);
  ASSERT_TRUE(store);
  std::shared_ptr<EmbeddingStore> shared = std::move(store);
  const TensorSpec s = spec({64, 64});
  ASSERT_TRUE(shared->put("img-k", s, pattern(s.nbytes(), 7)));
  const std::vector<std::string> asked = {"img-k"};
  ASSERT_EQ(shared->contains(asked).value(), std::vector<bool>{true});

  server_->process().signal(SIGKILL);
  ASSERT_TRUE(server_->process().wait(10s).has_value()) << "redis-server did not exit";

  std::vector<std::byte> loaded;
  auto gone = shared->get_into("img-k", into(loaded));
  EXPECT_EQ(gone.status().code(), StatusCode::unavailable) << gone.status().to_string();
  // The next calls fail fast, without a new connect, until the retry interval passed.
  EXPECT_NE(shared->contains(asked).status().message().find("next attempt"), std::string::npos);
  EXPECT_EQ(shared->put("img-k2", s, pattern(s.nbytes(), 8)).code(), StatusCode::unavailable);
  clock->advance(2s);
  auto refused = shared->contains(asked);
  EXPECT_EQ(refused.status().code(), StatusCode::unavailable) << "nothing listens any more";
  EXPECT_NE(refused.status().message().find("cannot connect"), std::string::npos) << refused.status().message();
  EXPECT_EQ(shared->counters().errors, 4u);

  // Publishing to it neither blocks nor throws: each offer is taken, fails and is counted.
  Publisher publisher(shared, PublisherOptions{});
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(publisher.offer("img-pk" + std::to_string(i), s, pattern(s.nbytes(), 9)));
  }
  ASSERT_TRUE(publisher.wait_idle(10s));
  EXPECT_EQ(publisher.counters().failed, 4u);
  EXPECT_EQ(publisher.counters().published, 0u);
}

// A store whose put waits at a gate the test opens (bounded, so a broken test cannot
// hang), to hold the publisher inside a write.
class GatedStore final : public EmbeddingStore {
 public:
  Result<std::vector<bool>> contains(std::span<const std::string> mm_hashes) override {
    return std::vector<bool>(mm_hashes.size(), false);
  }
  Result<Entry> get_into(std::string_view, const Landing&) override { return not_found("gated store"); }
  Status put(std::string_view mm_hash, const TensorSpec&, std::span<const std::byte> payload) override {
    std::unique_lock lock(mutex_);
    ++entered_;
    changed_.notify_all();
    if (!changed_.wait_for(lock, 10s, [&] { return open_; })) return timeout_error("gate never opened");
    written_.emplace_back(mm_hash);
    bytes_ += payload.size();
    return Status::ok();
  }
  StoreCounters counters() const override { return {}; }
  std::string describe() const override { return "gated"; }

  bool wait_entered(int n) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, 10s, [&] { return entered_ >= n; });
  }
  void open_gate() {
    std::lock_guard lock(mutex_);
    open_ = true;
    changed_.notify_all();
  }
  std::vector<std::string> written() const {
    std::lock_guard lock(mutex_);
    return written_;
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  int entered_ = 0;
  bool open_ = false;
  std::vector<std::string> written_;
  std::uint64_t bytes_ = 0;
};

TEST(StorePublisher, DefaultsAreThirtyTwoItemsAndTwoGibibytesPending) {
  const PublisherOptions defaults;
  EXPECT_EQ(defaults.max_pending_items, 32u);
  EXPECT_EQ(defaults.max_pending_bytes, std::uint64_t{2} << 30);
}

TEST(StorePublisher, NeverWaitsOnAStuckStoreAndDropsWhatDoesNotFit) {
  auto store = std::make_shared<GatedStore>();
  const TensorSpec s = spec({8, 8});
  Publisher publisher(store, PublisherOptions{});
  ASSERT_TRUE(publisher.offer("first", s, pattern(s.nbytes(), 0)));
  ASSERT_TRUE(store->wait_entered(1)) << "the publisher is now inside a write that does not return";
  int accepted = 1;
  for (int i = 1; i < 40; ++i) accepted += publisher.offer("img-" + std::to_string(i), s, pattern(s.nbytes(), i));
  EXPECT_EQ(accepted, 32) << "the item being written counts against the bound until it is written";
  auto c = publisher.counters();
  EXPECT_EQ(c.offered, 40u);
  EXPECT_EQ(c.dropped_full, 8u);
  EXPECT_EQ(c.pending_items, 32u);
  EXPECT_EQ(c.pending_bytes, 32u * s.nbytes());
  EXPECT_FALSE(publisher.wait_idle(0ms));

  store->open_gate();
  ASSERT_TRUE(publisher.wait_idle(10s));
  c = publisher.counters();
  EXPECT_EQ(c.published, 32u);
  EXPECT_EQ(c.pending_items, 0u);
  EXPECT_EQ(c.pending_bytes, 0u);
  const auto written = store->written();
  ASSERT_EQ(written.size(), 32u);
  EXPECT_EQ(written.front(), "first");
  EXPECT_EQ(written.back(), "img-31") << "in the order offered";
  EXPECT_TRUE(publisher.offer("after", s, pattern(s.nbytes(), 1))) << "room again";
}

TEST(StorePublisher, TheByteBoundDropsLargeEntries) {
  auto store = std::make_shared<GatedStore>();
  Publisher publisher(store, PublisherOptions{.max_pending_items = 32, .max_pending_bytes = 1000});
  const TensorSpec s = spec({150});  // 300 bytes of bfloat16
  int accepted = 0;
  for (int i = 0; i < 5; ++i) accepted += publisher.offer("b" + std::to_string(i), s, pattern(s.nbytes(), i));
  EXPECT_EQ(accepted, 3);
  EXPECT_EQ(publisher.counters().dropped_full, 2u);
  EXPECT_LE(publisher.counters().pending_bytes, 1000u);
  const TensorSpec big = spec({600});
  EXPECT_FALSE(publisher.offer("big", big, pattern(big.nbytes(), 1))) << "1200 bytes never fit a 1000-byte bound";
  store->open_gate();
  ASSERT_TRUE(publisher.wait_idle(10s));
  EXPECT_EQ(publisher.counters().published, 3u);
}

TEST(StorePublisher, StopsPromptlyWithEntriesPending) {
  auto store = std::make_shared<GatedStore>();
  const TensorSpec s = spec({8, 8});
  {
    Publisher publisher(store, PublisherOptions{});
    for (int i = 0; i < 10; ++i) {
      ASSERT_TRUE(publisher.offer("s" + std::to_string(i), s, pattern(s.nbytes(), static_cast<unsigned>(i))));
    }
    ASSERT_TRUE(store->wait_entered(1));
    store->open_gate();  // the write in progress finishes; the destructor drops the rest
  }
  EXPECT_GE(store->written().size(), 1u);
  EXPECT_LE(store->written().size(), 10u);
}

TEST_F(StoreWithRedis, APublisherWritesWhatAnotherEncoderThenLoads) {
  std::shared_ptr<EmbeddingStore> writer = open();
  auto reader = open();
  ASSERT_TRUE(writer && reader);
  Publisher publisher(writer, PublisherOptions{});
  std::vector<std::string> asked;
  for (int i = 0; i < 8; ++i) {
    const TensorSpec s = spec({16, 16 + i});
    asked.push_back("pub-" + std::to_string(i));
    ASSERT_TRUE(publisher.offer(asked.back(), s, pattern(s.nbytes(), static_cast<unsigned>(i))));
  }
  ASSERT_TRUE(publisher.wait_idle(10s));
  EXPECT_EQ(publisher.counters().published, 8u);
  EXPECT_EQ(reader->contains(asked).value(), std::vector<bool>(8, true));
  for (int i = 0; i < 8; ++i) {
    std::vector<std::byte> loaded;
    auto entry = reader->get_into(asked[static_cast<std::size_t>(i)], into(loaded));
    ASSERT_TRUE(entry) << entry.status().to_string();
    EXPECT_EQ(entry->spec, spec({16, 16 + i}));
    EXPECT_TRUE(loaded == pattern(entry->spec.nbytes(), static_cast<unsigned>(i)));
  }
}

}  // namespace
}  // namespace ecx::store
