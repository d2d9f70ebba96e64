#include "ecx/proxy/metrics.h"

#include <gtest/gtest.h>

namespace ecx::proxy {
namespace {

TEST(Metrics, RendersCountersGaugesAndCumulativeHistograms) {
  Metrics metrics;
  metrics.describe("ecx_proxy_requests_total", "counter", "Requests");
  metrics.describe("ecx_proxy_stage_seconds", "histogram", "Stage time");
  const auto labels = Metrics::label("route", "/v1/chat/completions") + "," + Metrics::label("status", "200");
  metrics.add("ecx_proxy_requests_total", labels);
  metrics.add("ecx_proxy_requests_total", labels, 2);
  metrics.observe("ecx_proxy_stage_seconds", Metrics::label("stage", "encode"), 0.0003);
  metrics.observe("ecx_proxy_stage_seconds", Metrics::label("stage", "encode"), 0.002);
  metrics.observe("ecx_proxy_stage_seconds", Metrics::label("stage", "encode"), 500);  // beyond the last bucket

  EXPECT_EQ(metrics.value("ecx_proxy_requests_total", labels), 3);
  EXPECT_EQ(metrics.observations("ecx_proxy_stage_seconds", Metrics::label("stage", "encode")), 3u);
  const auto text = metrics.render();
  EXPECT_NE(text.find("# TYPE ecx_proxy_requests_total counter\n"), std::string::npos);
  EXPECT_NE(text.find("ecx_proxy_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 3\n"),
            std::string::npos);
  EXPECT_NE(text.find("# TYPE ecx_proxy_stage_seconds histogram\n"), std::string::npos);
  EXPECT_NE(text.find("ecx_proxy_stage_seconds_bucket{stage=\"encode\",le=\"0.0001\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find("ecx_proxy_stage_seconds_bucket{stage=\"encode\",le=\"0.0005\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("ecx_proxy_stage_seconds_bucket{stage=\"encode\",le=\"0.0025\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("ecx_proxy_stage_seconds_bucket{stage=\"encode\",le=\"120\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("ecx_proxy_stage_seconds_bucket{stage=\"encode\",le=\"+Inf\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("ecx_proxy_stage_seconds_count{stage=\"encode\"} 3\n"), std::string::npos);
}

TEST(Metrics, GaugesAreSetAndLabelsEscaped) {
  Metrics metrics;
  metrics.describe("ecx_proxy_instances", "gauge", "Instances");
  metrics.set("ecx_proxy_instances", Metrics::label("role", "decode"), 4);
  metrics.set("ecx_proxy_instances", Metrics::label("role", "decode"), 2);
  EXPECT_EQ(metrics.value("ecx_proxy_instances", Metrics::label("role", "decode")), 2);
  EXPECT_EQ(Metrics::label("k", "a\"b\\c\nd"), "k=\"a\\\"b\\\\c\\nd\"");
  EXPECT_EQ(metrics.render().find("ecx_proxy_unset"), std::string::npos);
}

}  // namespace
}  // namespace ecx::proxy
