// The consumer runs here, stepped exactly as an engine steps the connector; the
// producer is a separate process (`ecx demo --role producer`). Everything between
// them is real: ZeroMQ control plane, readiness events, UCX payloads on loopback.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "ecx/core/config.h"
#include "ecx/core/stages.h"
#include "sim/engine_sim.h"
#include "sim/process.h"

namespace ecx::sim {
namespace {

using json = nlohmann::json;

struct Workload {
  int requests = 200;
  int min_tokens = 32;    // 32 x 1024 x 2 B = 64 KiB
  int max_tokens = 8192;  // 8192 x 1024 x 2 B = 16 MiB
  int hidden = 1024;
  double repeat = 0.2;
  std::uint64_t seed = 7;
  std::string pool = "512MiB";
  std::string ucx_mode = "am";
  bool zero_copy = false;  // the producer lends its outputs (zero_copy_saves)
};

// The consumer waits for a push as long as the producer (`ecx demo --role producer`,
// push_wait_timeout_s 60) keeps trying to deliver it. A request is admitted here before
// its pushes reserve, so the wait includes the producer's backlog (up to 64 pushes);
// under TSan on two cores that alone passes 12 s, and 30 s on a loaded machine, and a
// shorter wait fails requests whose payloads still arrive (refused then as cancelled).
constexpr int kPushWaitTimeoutS = 60;

Config consumer_config(int tp, int port, const std::string& pool, const json& extra_overrides = json::object()) {
  json extra{{"checksum", true},
             {"push_wait_timeout_s", kPushWaitTimeoutS},
             {"control_timeout_s", 5},
             {"shutdown_drain_timeout_s", 2}};
  extra.update(extra_overrides);
  json doc{{"ec_role", "ec_consumer"}, {"ec_ip", "127.0.0.1"},      {"ec_port", port},
           {"ec_buffer_size", pool},   {"ec_buffer_device", "cpu"}, {"ec_connector_extra_config", extra}};
  ParallelLayout layout;
  layout.tp_size = tp;
  auto config = parse_config(doc.dump(), layout);
  EXPECT_TRUE(config) << config.status().to_string();
  return *config;
}

std::vector<std::string> producer_argv(const Workload& w, const ConsumerSim& consumer, int port) {
  std::vector<std::string> argv{std::string(ECX_BINARY_DIR) + "/bin/ecx",
                                "demo",
                                "--role",
                                "producer",
                                "--consumer",
                                consumer.control_address(),
                                "--admit",
                                consumer.admit_endpoint(),
                                "--requests",
                                std::to_string(w.requests),
                                "--min-tokens",
                                std::to_string(w.min_tokens),
                                "--max-tokens",
                                std::to_string(w.max_tokens),
                                "--hidden",
                                std::to_string(w.hidden),
                                "--repeat",
                                std::to_string(w.repeat),
                                "--log-sizes",
                                "--seed",
                                std::to_string(w.seed),
                                "--pool-size",
                                w.pool,
                                "--port",
                                std::to_string(port),
                                "--deadline",
                                "120",
                                "--ucx-mode",
                                w.ucx_mode};
  if (w.zero_copy) argv.emplace_back("--zero-copy");
  return argv;
}

// One consumer (this process, `tp` ranks) fed by one producer process over the whole
// workload. The stage counters are read before the run, so a test can tell what it
// recorded.
struct ProducerRun {
  ConsumerResult result;
  std::optional<int> producer_exit;
  json producer_result;  // the producer's {"event": "result", ...} line
  decltype(stages::snapshot()) stages_before{};
};

void run_with_producer(const Workload& w, int tp, const json& extra, ProducerRun& run) {
  const int port = free_port_block(tp);
  ASSERT_NE(port, 0);
  ConsumerSimOptions options;
  options.config = consumer_config(tp, port, w.pool, extra);
  options.deadline = std::chrono::seconds(180);
  auto consumer = ConsumerSim::start(std::move(options));
  ASSERT_TRUE(consumer) << consumer.status().to_string();
  auto producer = ChildProcess::spawn(producer_argv(w, **consumer, port));
  ASSERT_TRUE(producer) << producer.status().to_string();
  run.stages_before = stages::snapshot();
  run.result = (*consumer)->run();
  run.producer_exit = producer->wait(std::chrono::seconds(60));
  while (auto line = producer->read_line(std::chrono::seconds(1))) {
    auto doc = json::parse(*line, nullptr, false);
    if (doc.is_object() && doc.value("event", "") == "result") run.producer_result = std::move(doc);
  }
}

// Every request of `w` ready, byte for byte, and nothing left held.
void expect_every_request_delivered(const Workload& w, const ProducerRun& run) {
  const auto& result = run.result;
  EXPECT_TRUE(result.producer_done) << "the producer never said it was done";
  EXPECT_EQ(run.producer_exit.value_or(-1), 0);
  EXPECT_EQ(result.progress.requests_admitted, static_cast<std::uint64_t>(w.requests));
  EXPECT_EQ(result.progress.requests_ready, static_cast<std::uint64_t>(w.requests));
  EXPECT_EQ(result.progress.requests_failed, 0U)
      << "first failed: " << (result.failed_requests.empty() ? "" : result.failed_requests[0]);
  EXPECT_EQ(result.content_mismatches, 0U);
  EXPECT_EQ(result.checksum_mismatches, 0U);
  EXPECT_EQ(result.live_reservations, 0U);
  EXPECT_EQ(result.leaked_pool_bytes, 0U);
  EXPECT_EQ(result.invariant_error, "");
}

// (TP size, UCX mode)
class EndToEnd : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(EndToEnd, EveryItemArrivesBitExactAndThePoolEndsFree) {
  const auto& [tp, ucx_mode] = GetParam();
  Workload w;
  w.ucx_mode = ucx_mode;
  ProducerRun run;
  run_with_producer(w, tp, json{{"ucx_mode", ucx_mode}}, run);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(run.result.producer_done) << "the producer never said it was done";
  expect_every_request_delivered(w, run);
  EXPECT_GE(run.result.items_ready, 400U);   // 200 requests of 1..4 images
  EXPECT_EQ(run.result.loads_as_views, 0U);  // copies, by default
  // Its shards run in this process: the scheduler's cancels ran there without the
  // network (one per item and rank at most).
  EXPECT_GT(run.result.in_process_cancels, 0U);
  EXPECT_LE(run.result.in_process_cancels, run.result.items_ready * static_cast<std::uint64_t>(tp));
  // A loaded item's records went with its take: releasing it sends nothing, so the
  // shards keep no tombstone per item (0.64 per item and rank when they did).
  EXPECT_LT(run.result.cancels_of_unknown, run.result.items_ready * static_cast<std::uint64_t>(tp) / 4);
  // This process is the consumer instance: it recorded each of its stages, at most
  // once per item and rank (repeats served from the resident cache or already in the
  // engine's cache skip landing and copying).
  const auto stages_after = stages::snapshot();
  for (auto stage : {stages::Stage::landing, stages::Stage::event_delivery, stages::Stage::load_dispatch,
                     stages::Stage::load_copy}) {
    const auto i = static_cast<std::size_t>(stage);
    const auto observed = stages_after[i].since(run.stages_before[i]).count;
    EXPECT_GT(observed, 0U) << stages::stage_name(stage) << " was never recorded";
    EXPECT_LE(observed, run.result.items_ready * static_cast<std::uint64_t>(tp)) << stages::stage_name(stage);
  }
}

// A scheduler that falls behind loses readiness events (each shard's backlog holds
// event_queue_max and drops the oldest; nothing resends them). Asking the shards
// about transfers that waited readiness_recheck_s recovers them: every request is
// ready, none waits out push_wait_timeout_s.
TEST(EndToEndEventLoss, ReadinessEventsLostToAFullBacklogAreRecoveredByAskingTheShards) {
  Workload w;
  w.requests = 60;
  w.max_tokens = 2048;
  ProducerRun run;
  run_with_producer(w, /*tp=*/2, json{{"event_queue_max", 1}, {"readiness_recheck_s", 0.5}}, run);
  if (HasFatalFailure()) return;
  expect_every_request_delivered(w, run);
  // The run must really have lost events for this to show anything. (Recovered
  // readiness also counts events still queued behind others when the answer came:
  // the scheduler drains at most event_queue_max per step.)
  EXPECT_GT(run.result.events_dropped, 0U);
  EXPECT_GT(run.result.readiness_recovered, 0U);
}

// zero_copy_loads: the engine keeps views of the landed slots as its encoder-cache
// entries. Every item is still read byte for byte from them, and every slot comes back
// to its pool once the engine drops the entry (no leaked pool bytes at the end).
// With zero_copy_saves the producer lends its outputs: each is sent from the encoder's
// own memory and given back once its pushes are done (the producer exits 1 if any
// was not).
TEST(EndToEndZeroCopy, BothEnginesShareTheirMemoryWithECXAndGetEveryByteOfItBack) {
  Workload w;
  w.requests = 80;
  w.zero_copy = true;
  ProducerRun run;
  run_with_producer(w, /*tp=*/2, json{{"zero_copy_loads", true}}, run);
  if (HasFatalFailure()) return;
  expect_every_request_delivered(w, run);
  EXPECT_GT(run.result.loads_as_views, 0U);
  EXPECT_GT(run.producer_result.value("outputs_lent", 0ULL), 0ULL) << run.producer_result.dump();
  EXPECT_EQ(run.producer_result.value("outputs_not_given_back", 1ULL), 0ULL) << run.producer_result.dump();
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, EndToEnd,
                         ::testing::Values(std::tuple{1, std::string("am")}, std::tuple{2, std::string("am")},
                                           std::tuple{2, std::string("put")}),
                         [](const auto& param_info) {
                           return "tp" + std::to_string(std::get<0>(param_info.param)) + "_" +
                                  std::get<1>(param_info.param);
                         });

}  // namespace
}  // namespace ecx::sim
