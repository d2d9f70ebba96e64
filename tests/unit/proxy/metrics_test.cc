#include "ecx/proxy/metrics.h"

#include <gtest/gtest.h>

namespace ecx::proxy {
namespace {

TEST(Metrics, RendersCountersGaugesAndCumulativeHistograms) {
  Metrics metrics;
  metrics.describe("ecx_proxy_requests_total", "Requests");
  metrics.describe("ecx_proxy_stage_seconds", "Stage time");
  const ecx::metrics::Labels labels = {{"route", "/v1/chat/completions"}, {"status", "200"}};
  const ecx::metrics::Labels encode = {{"stage", "encode"}};
  metrics.add("ecx_proxy_requests_total", labels);
  metrics.add("ecx_proxy_requests_total", labels, 2);
  metrics.observe("ecx_proxy_stage_seconds", encode, 0.0003);
  metrics.observe("ecx_proxy_stage_seconds", encode, 0.002);
  metrics.observe("ecx_proxy_stage_seconds", encode, 500);  // beyond the last bucket

  EXPECT_EQ(metrics.value("ecx_proxy_requests_total", labels), 3);
  EXPECT_EQ(metrics.observations("ecx_proxy_stage_seconds", encode), 3u);
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
  metrics.describe("ecx_proxy_instances", "Instances");
  metrics.set("ecx_proxy_instances", {{"role", "decode"}}, 4);
  metrics.set("ecx_proxy_instances", {{"role", "decode"}}, 2);
  EXPECT_EQ(metrics.value("ecx_proxy_instances", {{"role", "decode"}}), 2);
  metrics.set("ecx_proxy_instances", {{"role", "a\"b\\c\nd"}}, 1);
  EXPECT_NE(metrics.render().find("ecx_proxy_instances{role=\"a\\\"b\\\\c\\nd\"} 1\n"), std::string::npos)
      << metrics.render();
  EXPECT_NE(metrics.render().find("# HELP ecx_proxy_instances Instances\n"), std::string::npos);
  EXPECT_EQ(metrics.render().find("ecx_proxy_unset"), std::string::npos);
}

}  // namespace
}  // namespace ecx::proxy
