// The embedding store against a real redis-server that the test starts on loopback
// (Debian's redis-server), and its entry format on its own.

#include <hiredis/hiredis.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <thread>

#include <gtest/gtest.h>

#include "ecx/core/clock.h"
#include "ecx/store/embedding_store.h"
#include "ecx/store/publisher.h"
#include "sim/process.h"
#include "store/entry_format.h"

namespace ecx::store {
namespace {

using namespace std::chrono_literals;

constexpr const char* kRedisServer = "/usr/bin/redis-server";

TensorSpec spec(std::vector<std::int64_t> shape, DType dtype = DType::bfloat16) {
  return TensorSpec::make(std::move(shape), dtype, std::uint64_t{1} << 34).value();
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 131 + seed * 7 + (i >> 9)) & 0xff);
  return out;
}

// A redis-server of its own on a free loopback port, no persistence; killed at the end.
class RedisServer {
 public:
  static std::optional<RedisServer> start() {
    const int port = sim::free_port_block(1);
    if (port == 0) return std::nullopt;
    auto child = sim::ChildProcess::spawn({kRedisServer, "--port", std::to_string(port), "--bind", "127.0.0.1",
                                           "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel",
                                           "warning", "--dir", std::filesystem::temp_directory_path().string()});
    if (!child) return std::nullopt;
    RedisServer server(port, std::move(*child));
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < until) {
      if (server.ping()) return server;
      std::this_thread::sleep_for(20ms);  // polling its start-up (bounded), not a timeout
    }
    return std::nullopt;
  }

  int port() const { return port_; }
  sim::ChildProcess& process() { return process_; }

  // A raw command on a connection of the test's own; the reply, or nullptr.
  std::unique_ptr<redisReply, void (*)(void*)> raw(const std::vector<std::string>& args) const {
    std::unique_ptr<redisContext, void (*)(redisContext*)> c(redisConnectWithTimeout("127.0.0.1", port_, {2, 0}),
                                                             redisFree);
    std::unique_ptr<redisReply, void (*)(void*)> none(nullptr, freeReplyObject);
    if (!c || c->err) return none;
    std::vector<const char*> argv;
    std::vector<std::size_t> lengths;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lengths.push_back(a.size());
    }
    return {
        static_cast<redisReply*>(redisCommandArgv(c.get(), static_cast<int>(argv.size()), argv.data(), lengths.data())),
        freeReplyObject};
  }
  bool ping() const {
    auto r = raw({"PING"});
    return r && r->type == REDIS_REPLY_STATUS;
  }

 private:
  RedisServer(int port, sim::ChildProcess process) : port_(port), process_(std::move(process)) {}
  int port_;
  sim::ChildProcess process_;
};

RedisOptions options_for(int port, std::string model = "test-model@1", std::shared_ptr<const Clock> clock = nullptr) {
  RedisOptions o;
  o.port = port;
  o.keys.prefix = "ecxtest";
  o.keys.model = std::move(model);
  o.ttl_s = 600;
  o.io_timeout_s = 1.0;
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
    server_ = RedisServer::start();
    ASSERT_TRUE(server_.has_value()) << "redis-server did not start";
  }
  std::unique_ptr<EmbeddingStore> open(std::string model = "test-model@1", std::shared_ptr<const Clock> clock = nullptr,
                                       int port = 0) {
    auto s = open_redis_store(options_for(port ? port : server_->port(), std::move(model), std::move(clock)));
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
  EXPECT_GT(ttl->integer, 0);
  EXPECT_LE(ttl->integer, 600'000);
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
  EXPECT_EQ(store->counters().rejected, 2u);

  // Encoded again and written again: served.
  ASSERT_TRUE(store->put("img-c", s, payload));
  ASSERT_TRUE(store->get_into("img-c", into(loaded)));
  EXPECT_TRUE(loaded == payload);
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
  auto second = store->contains(asked);
  EXPECT_EQ(second.status().code(), StatusCode::unavailable);
  EXPECT_NE(second.status().message().find("next attempt"), std::string::npos) << "fails fast, no new connect";
  EXPECT_EQ(store->counters().errors, 2u);

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
  auto store = open();
  ASSERT_TRUE(store);
  const TensorSpec s = spec({32, 32});
  ASSERT_TRUE(store->put("img-f", s, pattern(s.nbytes(), 4)));
  server_->process().signal(SIGSTOP);
  std::vector<std::byte> loaded;
  auto stalled = store->get_into("img-f", into(loaded));
  server_->process().signal(SIGCONT);
  EXPECT_EQ(stalled.status().code(), StatusCode::timeout) << stalled.status().to_string();
  EXPECT_EQ(store->counters().errors, 1u);
}

TEST_F(StoreWithRedis, APublisherKeepsItsBoundsDropsWhatDoesNotFitAndPublishesTheRest) {
  std::shared_ptr<EmbeddingStore> store = open();
  ASSERT_TRUE(store);
  const TensorSpec s = spec({8, 8});
  {
    Publisher publisher(store, PublisherOptions{.max_pending_items = 2, .max_pending_bytes = 1 << 20});
    // Stalled store: the first entry sits in its write, two more fill the bounds.
    server_->process().signal(SIGSTOP);
    int accepted = 0;
    for (int i = 0; i < 6; ++i) accepted += publisher.offer("img-p" + std::to_string(i), s, pattern(s.nbytes(), i));
    const auto c = publisher.counters();
    EXPECT_LE(c.pending_items, 2u);
    EXPECT_EQ(c.offered, 6u);
    EXPECT_EQ(c.dropped_full, 6u - static_cast<unsigned>(accepted));
    EXPECT_GE(c.dropped_full, 3u);
    server_->process().signal(SIGCONT);
    ASSERT_TRUE(publisher.wait_idle(10s));
    const auto done = publisher.counters();
    EXPECT_EQ(done.published + done.failed, static_cast<unsigned>(accepted));
    EXPECT_EQ(done.pending_items, 0u);
    EXPECT_EQ(done.pending_bytes, 0u);
  }
  // What was published after the stall is served; a byte bound refuses a large entry.
  Publisher small(store, PublisherOptions{.max_pending_items = 8, .max_pending_bytes = 100});
  EXPECT_FALSE(small.offer("img-big", s, pattern(s.nbytes(), 9))) << "128 bytes over a 100-byte bound";
  ASSERT_TRUE(small.offer("img-q", spec({2, 2}), pattern(8, 1)));
  ASSERT_TRUE(small.wait_idle(10s));
  EXPECT_EQ(small.counters().published, 1u);
  std::vector<std::byte> loaded;
  ASSERT_TRUE(store->get_into("img-q", into(loaded)));
  EXPECT_TRUE(loaded == pattern(8, 1));
}

}  // namespace
}  // namespace ecx::store
