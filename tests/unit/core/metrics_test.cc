#include "ecx/core/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <thread>

#include "ecx/core/metrics_server.h"
#include "ecx/core/stages.h"

namespace ecx::metrics {
namespace {

TEST(Metrics, CountersAndGaugesRenderWithPrefixAndLabels) {
  Registry registry;
  registry.counter("transfers_total", "Transfers by outcome", {{"outcome", "ready"}}).inc(3);
  registry.counter("transfers_total", "Transfers by outcome", {{"outcome", "failed"}}).inc();
  registry.gauge("pool_used_bytes", "Bytes in use").set(4096);
  const auto text = registry.prometheus_text();
  EXPECT_NE(text.find("# TYPE ecx_transfers_total counter"), std::string::npos) << text;
  EXPECT_NE(text.find("ecx_transfers_total{outcome=\"ready\"} 3"), std::string::npos) << text;
  EXPECT_NE(text.find("ecx_transfers_total{outcome=\"failed\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("ecx_pool_used_bytes 4096"), std::string::npos) << text;
  const auto snap = registry.snapshot();
  EXPECT_EQ(snap.at("ecx_transfers_total{outcome=\"ready\"}"), 3.0);
}

TEST(Metrics, SameNameAndLabelsIsTheSameSeries) {
  Registry registry;
  auto& a = registry.counter("x", "help", {{"k", "v"}});
  auto& b = registry.counter("x", "help", {{"k", "v"}});
  EXPECT_EQ(&a, &b);
}

TEST(Metrics, HistogramBucketsAreCumulative) {
  Registry registry;
  auto& h = registry.histogram("time_to_ready_seconds", "Time to ready", {}, {0.001, 0.01, 0.1});
  for (double v : {0.0005, 0.005, 0.005, 0.05, 5.0}) h.observe(v);
  const auto s = h.snapshot();
  EXPECT_EQ(s.count, 5U);
  EXPECT_EQ(s.cumulative_counts, (std::vector<std::uint64_t>{1, 3, 4, 5}));
  EXPECT_GT(s.quantile(0.5), 0.001);
  EXPECT_LE(s.quantile(0.5), 0.01);
  const auto text = registry.prometheus_text();
  EXPECT_NE(text.find("ecx_time_to_ready_seconds_bucket{le=\"0.01\"} 3"), std::string::npos) << text;
  EXPECT_NE(text.find("ecx_time_to_ready_seconds_bucket{le=\"+Inf\"} 5"), std::string::npos) << text;
  EXPECT_NE(text.find("ecx_time_to_ready_seconds_count 5"), std::string::npos) << text;
}

TEST(Metrics, SnapshotSinceIsWhatWasObservedInBetween) {
  Registry registry;
  auto& h = registry.histogram("x_seconds", "x", {}, {0.001, 0.01});
  h.observe(0.0005);
  const auto before = h.snapshot();
  h.observe(0.005);
  h.observe(0.5);
  const auto d = h.snapshot().since(before);
  EXPECT_EQ(d.count, 2U);
  EXPECT_EQ(d.cumulative_counts, (std::vector<std::uint64_t>{0, 1, 2}));
  EXPECT_NEAR(d.sum, 0.505, 1e-12);
}

TEST(Stages, EveryStageIsAHistogramOfTheGlobalRegistry) {
  const auto before = stages::snapshot();
  stages::record(stages::Stage::wire, std::chrono::microseconds(30));
  stages::record(stages::Stage::wire, std::chrono::microseconds(-5));  // clocks that disagree: dropped
  stages::record(stages::Stage::load_copy, std::chrono::milliseconds(2));
  const auto after = stages::snapshot();
  const auto wire =
      after[static_cast<std::size_t>(stages::Stage::wire)].since(before[static_cast<std::size_t>(stages::Stage::wire)]);
  EXPECT_EQ(wire.count, 1U);
  EXPECT_NEAR(wire.sum, 30e-6, 1e-9);
  // Read back from its bucket, (20 us, 30 us]: four bounds per decade.
  EXPECT_GT(wire.quantile(0.5), 20e-6);
  EXPECT_LE(wire.quantile(0.5), 30e-6);
  // 2 ms reads back from (1 ms, 2 ms], a bucket 1 ms wide (it was 1.5 ms wide, 1 to 2.5 ms).
  const auto copy = after[static_cast<std::size_t>(stages::Stage::load_copy)].since(
      before[static_cast<std::size_t>(stages::Stage::load_copy)]);
  EXPECT_GT(copy.quantile(0.5), 1e-3);
  EXPECT_LE(copy.quantile(0.5), 2e-3);
  const auto text = Registry::global().prometheus_text();
  for (std::size_t i = 0; i < stages::kStageCount; ++i) {
    const auto name = std::string(stages::stage_name(static_cast<stages::Stage>(i)));
    EXPECT_NE(text.find("ecx_transfer_stage_seconds_count{stage=\"" + name + "\"}"), std::string::npos) << name;
  }
  EXPECT_NE(text.find("ecx_transfer_stage_seconds_bucket{stage=\"wire\",le=\"5e-05\"}"), std::string::npos) << text;
}

TEST(Metrics, CollectorsAreReadAtScrapeTime) {
  Registry registry;
  int value = 1;
  const auto id = registry.add_collector([&value](SampleSink& sink) {
    sink.sample("tombstones", "Terminal records kept", SampleType::gauge, {{"shard", "0"}}, value);
  });
  value = 7;
  EXPECT_NE(registry.prometheus_text().find("ecx_tombstones{shard=\"0\"} 7"), std::string::npos);
  registry.remove_collector(id);
  EXPECT_EQ(registry.prometheus_text().find("ecx_tombstones"), std::string::npos);
}

TEST(Metrics, LabelValuesAreEscaped) { EXPECT_EQ(series_name("a", {{"k", "x\"y\\z"}}), "ecx_a{k=\"x\\\"y\\\\z\"}"); }

std::string http_get(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return {};
  }
  const std::string request = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  (void)::send(fd, request.data(), request.size(), 0);
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, static_cast<std::size_t>(n));
  ::close(fd);
  return response;
}

TEST(MetricsServer, ServesPrometheusTextOverHttp) {
  Registry registry;
  registry.counter("requests_total", "Requests").inc(5);
  auto server = MetricsServer::start(registry, "127.0.0.1", 0);
  ASSERT_TRUE(server) << server.status().to_string();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  const auto ok = http_get(port, "/metrics");
  EXPECT_NE(ok.find("200 OK"), std::string::npos) << ok;
  EXPECT_NE(ok.find("ecx_requests_total 5"), std::string::npos) << ok;
  EXPECT_NE(http_get(port, "/other").find("404"), std::string::npos);
  (*server)->stop();
  (*server)->stop();  // idempotent
}

// The scheduler's own endpoint also shows the process-wide registry, but only while no
// other endpoint of the process serves it (no worker there, as with TP > 1).
TEST(MetricsServer, AddsTheGlobalRegistryOnlyWhileNoOtherServerServesIt) {
  Registry own;
  own.counter("own_total", "Own").inc(2);
  Registry::global().counter("global_only_for_this_test_total", "Global").inc(3);
  ASSERT_EQ(MetricsServer::global_servers(), 0);
  auto plain = MetricsServer::start(own, "127.0.0.1", 0);
  auto fallback = MetricsServer::start(own, "127.0.0.1", 0, ServeOptions{.global_when_unserved = true});
  ASSERT_TRUE(plain && fallback);
  auto scrape = [](const auto& server) { return http_get(server->port(), "/metrics"); };
  EXPECT_NE(scrape(*fallback).find("ecx_own_total 2"), std::string::npos);
  EXPECT_NE(scrape(*fallback).find("ecx_global_only_for_this_test_total 3"), std::string::npos);
  EXPECT_EQ(scrape(*plain).find("ecx_global_only_for_this_test_total"), std::string::npos);

  auto global = MetricsServer::start(Registry::global(), "127.0.0.1", 0);
  ASSERT_TRUE(global);
  EXPECT_EQ(MetricsServer::global_servers(), 1);
  EXPECT_NE(scrape(*global).find("ecx_global_only_for_this_test_total 3"), std::string::npos);
  const auto while_served = scrape(*fallback);
  EXPECT_NE(while_served.find("ecx_own_total 2"), std::string::npos);
  EXPECT_EQ(while_served.find("ecx_global_only_for_this_test_total"), std::string::npos) << "shown twice";

  (*global)->stop();
  (*global)->stop();  // counted down once
  EXPECT_EQ(MetricsServer::global_servers(), 0);
  EXPECT_NE(scrape(*fallback).find("ecx_global_only_for_this_test_total 3"), std::string::npos);
}

TEST(MetricsServer, RejectsANonNumericHost) {
  Registry registry;
  auto server = MetricsServer::start(registry, "not-an-ip", 0);
  ASSERT_FALSE(server);
  EXPECT_NE(server.status().message().find("numeric IP"), std::string::npos);
}

}  // namespace
}  // namespace ecx::metrics
