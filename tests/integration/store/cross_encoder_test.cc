// Two encoders sharing their outputs through a real redis-server: `ecx demo` runs the
// real producers, consumer, ZeroMQ, UCX and store; this test compares runs of the same
// seed and breaks the store under them. It reads each run's --json summary.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "sim/process.h"
#include "sim/redis_server.h"

namespace ecx::sim {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

std::string ecx_binary() { return std::string(ECX_BINARY_DIR) + "/bin/ecx"; }

struct DemoRun {
  json summary;
  int exit_code = -1;
};

// One demo run: small images, many repeats, so that encoders meet each other's images.
DemoRun demo(const std::string& tag, const std::vector<std::string>& extra,
             const std::function<void(ChildProcess&)>& during = nullptr) {
  const auto file = (std::filesystem::temp_directory_path() / ("ecx-cross-" + tag + ".json")).string();
  std::filesystem::remove(file);
  std::vector<std::string> argv = {ecx_binary(), "demo",         "--quiet", "--requests",  "60",     "--max-tokens",
                                   "600",        "--min-tokens", "64",      "--hidden",    "1024",   "--repeat",
                                   "0.5",        "--seed",       "5",       "--pool-size", "256MiB", "--encoders",
                                   "2",          "--deadline",   "120",     "--json",      file};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto child = ChildProcess::spawn(argv);
  EXPECT_TRUE(child) << child.status().to_string();
  DemoRun run;
  if (!child) return run;
  if (during) during(*child);
  while (child->read_line(200ms) || !child->eof()) {
  }
  run.exit_code = child->wait(200s).value_or(-1);
  std::ifstream in(file);
  if (in) run.summary = json::parse(in, nullptr, false);
  EXPECT_TRUE(run.summary.is_object()) << tag << ": no summary in " << file;
  return run;
}

std::uint64_t n(const DemoRun& r, const char* key) { return r.summary.value(key, std::uint64_t{0}); }

// Every request resolved one way or the other: nothing hung.
void expect_all_resolved(const DemoRun& r, const char* tag) {
  EXPECT_EQ(n(r, "requests_ready") + n(r, "requests_failed"), n(r, "requests_total")) << tag;
  EXPECT_EQ(n(r, "requests_total"), 60u) << tag;
  EXPECT_EQ(n(r, "content_mismatches"), 0u) << tag << ": a wrong byte reached the consumer";
  EXPECT_EQ(n(r, "leaked_pool_bytes"), 0u) << tag;
}

class CrossEncoder : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access(kRedisServerPath, X_OK) != 0) GTEST_SKIP() << kRedisServerPath << " is missing (Debian redis-server)";
  }
};

TEST_F(CrossEncoder, TwoEncodersEncodeFewerImagesWithTheStoreThanWithout) {
  const DemoRun plain = demo("plain", {});
  const DemoRun shared = demo("shared", {"--cross-encoder-cache"});
  ASSERT_EQ(plain.exit_code, 0) << plain.summary.dump();
  ASSERT_EQ(shared.exit_code, 0) << shared.summary.dump();
  EXPECT_TRUE(shared.summary.value("passed", false));
  EXPECT_EQ(n(plain, "images_requested"), n(shared, "images_requested")) << "the same workload";
  EXPECT_LT(n(shared, "encoder_runs"), n(plain, "encoder_runs"));
  EXPECT_GT(n(shared, "cross_encoder_hits"), 0u);
  EXPECT_EQ(n(shared, "store_loads"), n(shared, "cross_encoder_hits")) << "every hit loaded";
  EXPECT_EQ(n(shared, "store_load_failures"), 0u);
  EXPECT_EQ(n(shared, "store_prefetch_timeouts"), 0u) << "every prefetch answered";
  EXPECT_GT(n(shared, "store_published"), 0u);
}

TEST_F(CrossEncoder, AStoreThatIsDownAtStartMeansEveryImageIsEncoded) {
  const int port = free_port_block(1);  // nothing listens there
  const DemoRun plain = demo("down-plain", {});
  const DemoRun down =
      demo("down", {"--cross-encoder-cache", "--store-url", "redis://127.0.0.1:" + std::to_string(port) + "/0"});
  ASSERT_EQ(down.exit_code, 0) << down.summary.dump();
  EXPECT_TRUE(down.summary.value("passed", false)) << "every request served by encoding";
  EXPECT_EQ(n(down, "encoder_runs"), n(plain, "encoder_runs"));
  EXPECT_EQ(n(down, "cross_encoder_hits"), 0u);
  EXPECT_GT(n(down, "store_errors") + n(down, "store_publish_failed") + n(down, "store_publish_dropped"), 0u)
      << "the outage is counted";
}

// Kills or stalls the store once it holds a few entries, with the demo running.
void break_store_mid_run(RedisServer& redis, int sig) {
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < until) {  // bounded: until entries exist
    auto size = redis.raw({"DBSIZE"});
    if (size && size->type == REDIS_REPLY_INTEGER && size->integer >= 5) break;
    std::this_thread::sleep_for(10ms);
  }
  redis.process().signal(sig);
}

void expect_failures_explained(const DemoRun& r, const char* tag) {
  expect_all_resolved(r, tag);
  // A request fails only when its producer counted on an entry it then could not load
  // (that push is abandoned, the consumer told at once): the window of the outage.
  if (n(r, "requests_failed") > 0) {
    EXPECT_GT(n(r, "store_load_failures"), 0u) << tag << ": " << r.summary.dump();
  }
  EXPECT_GT(n(r, "store_errors") + n(r, "store_publish_failed"), 0u) << tag << ": the outage is counted";
}

TEST_F(CrossEncoder, AStoreKilledMidRunHangsNothing) {
  auto redis = RedisServer::start();
  ASSERT_TRUE(redis) << redis.status().to_string();
  const DemoRun r = demo("killed", {"--cross-encoder-cache", "--store-url", redis->url()},
                         [&](ChildProcess&) { break_store_mid_run(*redis, SIGKILL); });
  expect_failures_explained(r, "killed");
  EXPECT_LE(r.summary.value("wall_s", 1e9), 110.0) << "ended on its own, not at the deadline";
}

TEST_F(CrossEncoder, AStoreStalledMidRunHangsNothing) {
  auto redis = RedisServer::start();
  ASSERT_TRUE(redis) << redis.status().to_string();
  const DemoRun r = demo("stalled", {"--cross-encoder-cache", "--store-url", redis->url()},
                         [&](ChildProcess&) { break_store_mid_run(*redis, SIGSTOP); });
  redis->process().signal(SIGCONT);
  expect_failures_explained(r, "stalled");
  EXPECT_LE(r.summary.value("wall_s", 1e9), 110.0) << "ended on its own, not at the deadline";
}

// Flips the last byte of every demo entry: the header still reads, the checksum does not match.
void corrupt_every_entry(RedisServer& redis) {
  auto keys = redis.raw({"KEYS", "ecxdemo:*"});
  ASSERT_TRUE(keys && keys->type == REDIS_REPLY_ARRAY && keys->elements > 0);
  for (std::size_t i = 0; i < keys->elements; ++i) {
    const std::string key(keys->element[i]->str, keys->element[i]->len);
    auto length = redis.raw({"STRLEN", key});
    ASSERT_TRUE(length && length->type == REDIS_REPLY_INTEGER && length->integer > 0);
    redis.raw({"SETRANGE", key, std::to_string(length->integer - 1), "\x7f"});
  }
}

TEST_F(CrossEncoder, CorruptEntriesAreRefusedDeletedAndWrittenAgainGood) {
  auto redis = RedisServer::start();
  ASSERT_TRUE(redis) << redis.status().to_string();
  const DemoRun first = demo("fill", {"--cross-encoder-cache", "--store-url", redis->url()});
  ASSERT_EQ(first.exit_code, 0) << first.summary.dump();
  corrupt_every_entry(*redis);
  const DemoRun corrupt = demo("corrupt", {"--cross-encoder-cache", "--store-url", redis->url()});
  expect_all_resolved(corrupt, "corrupt");
  EXPECT_GT(n(corrupt, "store_rejected"), 0u) << corrupt.summary.dump();
  // Refused when prefetched, before the engine counted on them: those images were encoded.
  EXPECT_LE(n(corrupt, "store_rejected"), n(corrupt, "store_prefetch_failures") + n(corrupt, "store_load_failures"));
  EXPECT_EQ(n(corrupt, "requests_failed"), 0u) << "every request served";
  EXPECT_TRUE(corrupt.summary.value("passed", false));
  // The refused entries were deleted and encoded again: a third run loads good ones.
  const DemoRun again = demo("again", {"--cross-encoder-cache", "--store-url", redis->url()});
  ASSERT_EQ(again.exit_code, 0) << again.summary.dump();
  EXPECT_EQ(n(again, "store_rejected"), 0u);
  EXPECT_EQ(n(again, "store_load_failures"), 0u);
  EXPECT_GT(n(again, "cross_encoder_hits"), 0u);
}

TEST_F(CrossEncoder, RequestsWhoseImagesAreAllStoredSkipTheEncoderAndTheConsumerLoadsThem) {
  auto redis = RedisServer::start();
  ASSERT_TRUE(redis) << redis.status().to_string();
  const DemoRun plain = demo("skip-plain", {});
  const DemoRun fill = demo("skip-fill", {"--cross-encoder-cache", "--store-url", redis->url()});
  ASSERT_EQ(fill.exit_code, 0) << fill.summary.dump();
  // Store round trips get 10 s: on a loaded machine a 0.5 s one can time out, and the
  // consumer would rightly encode the image instead of loading it.
  const DemoRun skip = demo(
      "skip", {"--cross-encoder-cache", "--store-url", redis->url(), "--skip-encoder-hop", "--store-io-timeout", "10"});
  ASSERT_EQ(skip.exit_code, 0) << skip.summary.dump();
  EXPECT_TRUE(skip.summary.value("passed", false)) << skip.summary.dump();
  EXPECT_EQ(n(skip, "content_mismatches"), 0u) << "the store's bytes are the encoder's";
  EXPECT_GT(n(skip, "encoder_hops_skipped"), 0u) << skip.summary.dump();
  EXPECT_GT(n(skip, "consumer_store_loads"), 0u) << skip.summary.dump();
  EXPECT_EQ(n(skip, "consumer_local_encodes"), 0u) << "every entry was good";
  // With 10 s round trips a prefetch may wait 41 s: one that does was never answered.
  EXPECT_EQ(n(skip, "store_prefetch_timeouts") + n(skip, "consumer_store_prefetch_timeouts"), 0u)
      << skip.summary.dump();
  EXPECT_LT(n(skip, "encoder_runs"), n(plain, "encoder_runs"));
  EXPECT_EQ(n(skip, "images_requested"), n(plain, "images_requested")) << "the same workload";
}

TEST_F(CrossEncoder, AConsumerEncodesTheStoredImagesItCannotLoadWhenTheEncoderHopWasSkipped) {
  auto redis = RedisServer::start();
  ASSERT_TRUE(redis) << redis.status().to_string();
  const DemoRun fill = demo("skip-corrupt-fill", {"--cross-encoder-cache", "--store-url", redis->url()});
  ASSERT_EQ(fill.exit_code, 0) << fill.summary.dump();
  corrupt_every_entry(*redis);
  const DemoRun r = demo("skip-corrupt", {"--cross-encoder-cache", "--store-url", redis->url(), "--skip-encoder-hop"});
  ASSERT_EQ(r.exit_code, 0) << r.summary.dump();
  EXPECT_TRUE(r.summary.value("passed", false)) << "every request served: " << r.summary.dump();
  EXPECT_EQ(n(r, "content_mismatches"), 0u) << "no corrupt byte was used";
  EXPECT_GT(n(r, "encoder_hops_skipped"), 0u) << r.summary.dump();
  EXPECT_GT(n(r, "consumer_local_encodes"), 0u) << r.summary.dump();
  EXPECT_GT(n(r, "consumer_store_prefetch_failures"), 0u) << r.summary.dump();
}

}  // namespace
}  // namespace ecx::sim
