#include "ecx/proxy/options.h"

#include <gtest/gtest.h>

namespace ecx::proxy {
namespace {

TEST(UpstreamUrl, ParsesAndNormalises) {
  auto url = parse_upstream_url("http://127.0.0.1:8001/");
  ASSERT_TRUE(url);
  EXPECT_EQ(url->host, "127.0.0.1");
  EXPECT_EQ(url->port, 8001);
  EXPECT_EQ(url->text(), "http://127.0.0.1:8001");
  auto v6 = parse_upstream_url("http://[::1]:9000");
  ASSERT_TRUE(v6);
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 9000);
  EXPECT_EQ(parse_upstream_url("http://host")->port, 80);
  EXPECT_FALSE(parse_upstream_url("https://host:1"));
  EXPECT_FALSE(parse_upstream_url("http://host:1/v1"));
  EXPECT_FALSE(parse_upstream_url("http://host:0"));
  EXPECT_FALSE(parse_upstream_url("http://host:70000"));
  EXPECT_FALSE(parse_upstream_url("http://:1"));
}

TEST(ProxyOptionsValidate, ConsumerAddressesMustCoverEveryReplica) {
  ProxyOptions options;
  options.decode_urls = {"http://d0:1", "http://d1:1"};
  options.ec_consumer_dp_size = 2;
  options.ec_consumer_zmq_addrs = {"tcp://d0:10", "tcp://d0:11", "tcp://d1:10"};
  EXPECT_EQ(validate(options).code(), StatusCode::invalid_argument);
  options.ec_consumer_zmq_addrs.push_back("tcp://d1:11");
  EXPECT_TRUE(validate(options));
  // With a prefill, the prefill instances are the consumers.
  options.prefill_urls = {"http://p0:1"};
  EXPECT_FALSE(validate(options));
  options.ec_consumer_zmq_addrs.resize(2);
  EXPECT_TRUE(validate(options));
}

TEST(ProxyOptionsValidate, RejectsBadRangesAndUrls) {
  ProxyOptions options;
  EXPECT_TRUE(validate(options));
  options.fail_threshold = 0;
  EXPECT_FALSE(validate(options));
  options = {};
  options.encode_urls = {"localhost:8000"};
  EXPECT_FALSE(validate(options));
  options = {};
  options.probe_timeout = Duration::zero();
  EXPECT_FALSE(validate(options));
  options = {};
  options.decode_retries = -1;
  EXPECT_FALSE(validate(options));
}

}  // namespace
}  // namespace ecx::proxy
