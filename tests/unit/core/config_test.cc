#include "ecx/core/config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

namespace ecx {
namespace {

ParallelLayout tp(int size, int rank = 0) {
  ParallelLayout l;
  l.tp_size = size;
  l.tp_rank = rank;
  return l;
}

Status error_of(std::string_view json, ParallelLayout layout = {}) { return parse_config(json, layout).status(); }

void expect_error_mentions(std::string_view json, std::initializer_list<std::string_view> needles,
                           ParallelLayout layout = {}) {
  const Status s = error_of(json, layout);
  ASSERT_FALSE(s.is_ok()) << json;
  EXPECT_EQ(s.code(), StatusCode::invalid_argument);
  for (auto needle : needles) {
    EXPECT_NE(s.message().find(needle), std::string::npos) << "'" << needle << "' not in: " << s.message();
  }
}

TEST(Config, ParsesAVllmStyleConsumerConfig) {
  auto config = parse_config(R"({
      "ec_connector": "ECXConnector", "ec_connector_module_path": "ecx.vllm",
      "ec_role": "ec_consumer", "ec_ip": "10.0.0.5", "ec_port": 20000, "ec_buffer_size": 2e9,
      "ec_buffer_device": "CUDA", "ec_rank": null, "engine_id": "abc",
      "ec_connector_extra_config": {"control_timeout_s": 5, "push_wait_timeout_s": 12.5, "checksum": true,
                                    "pool_alignment": "4KiB"}})",
                             tp(2, 1));
  ASSERT_TRUE(config) << config.status().to_string();
  EXPECT_TRUE(config->is_consumer());
  EXPECT_FALSE(config->is_producer());
  EXPECT_EQ(config->buffer_size, 2'000'000'000ULL);
  EXPECT_EQ(config->buffer_device, "cuda");
  EXPECT_DOUBLE_EQ(config->control_timeout_s, 5.0);
  EXPECT_DOUBLE_EQ(config->push_wait_timeout_s, 12.5);
  EXPECT_TRUE(config->checksum);
  EXPECT_EQ(config->pool_alignment, 4096U);
  EXPECT_EQ(config->control_address(0), "tcp://10.0.0.5:20000");
  EXPECT_EQ(config->control_address(1), "tcp://10.0.0.5:20001");
}

TEST(Config, DefaultsMatchTheReference) {
  auto config = parse_config(R"({"ec_role": "ec_producer"})", {});
  ASSERT_TRUE(config);
  EXPECT_EQ(config->ec_port, 14579);
  EXPECT_EQ(config->ec_ip, "127.0.0.1");
  EXPECT_EQ(config->buffer_size, 1'000'000'000ULL);
  EXPECT_DOUBLE_EQ(config->control_timeout_s, 30.0);
  EXPECT_DOUBLE_EQ(config->push_wait_timeout_s, 60.0);
  EXPECT_DOUBLE_EQ(config->reservation_ttl_s, 300.0);
  EXPECT_EQ(config->tombstone_max, 65536U);
  EXPECT_EQ(config->event_queue_max, 4096U);
  EXPECT_EQ(config->transport, "ucx");
  EXPECT_EQ(config->effective_max_tensor_bytes(), config->buffer_size);
}

TEST(Config, DpReplicasOffsetTheirPorts) {
  ParallelLayout l = tp(4, 0);
  l.dp_size = 3;
  l.dp_index = 2;
  auto config = parse_config(R"({"ec_role": "ec_consumer", "ec_port": 30000})", l);
  ASSERT_TRUE(config);
  EXPECT_EQ(config->control_port(), 30008);
  EXPECT_EQ(config->control_address(3), "tcp://127.0.0.1:30011");
}

TEST(Config, Ipv6AddressesAreBracketed) {
  auto config = parse_config(R"({"ec_role": "ec_consumer", "ec_ip": "::1"})", {});
  ASSERT_TRUE(config);
  EXPECT_EQ(config->control_address(0), "tcp://[::1]:14579");
}

TEST(Config, MisspelledKeySuggestsTheClosestAndListsValidOnes) {
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_prot": 1})",
                        {"'ec_prot'", "did you mean 'ec_port'", "Valid keys:", "ec_buffer_size"});
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_connector_extra_config": {"control_timeout": 3}})",
                        {"'control_timeout'", "ec_connector_extra_config", "did you mean 'control_timeout_s'"});
}

TEST(Config, WrongTypesNameTheKey) {
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_port": "abc"})", {"ec_port", "integer"});
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_port": true})", {"ec_port", "boolean"});
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_connector_extra_config": {"checksum": "yes"}})",
                        {"ec_connector_extra_config.checksum", "true or false"});
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_connector_extra_config": []})",
                        {"ec_connector_extra_config", "object"});
  expect_error_mentions(R"({"ec_role": 3})", {"ec_role"});
  expect_error_mentions(R"([1,2])", {"JSON object"});
  expect_error_mentions(R"({"ec_role": )", {"not valid JSON"});
}

TEST(Config, RangesAreChecked) {
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_port": 70000})", {"ec_port", "1..65535"});
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_port": 0})", {"ec_port"});
  // The last shard's port must fit too.
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_port": 65535})", {"ec_port", "65535..65536"}, tp(2));
  for (const char* bad : {"0", "-1", "1e308", "\"5\"", "true"}) {
    const std::string json =
        std::string(R"({"ec_role": "ec_consumer", "ec_connector_extra_config": {"control_timeout_s": )") + bad + "}}";
    expect_error_mentions(json, {"control_timeout_s"});
  }
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_buffer_size": 1.5})", {"ec_buffer_size"});
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_buffer_size": "lots"})", {"ec_buffer_size", "512MiB"});
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_connector_extra_config": {"pool_alignment": 300}})",
                        {"power of two"});
  expect_error_mentions(
      R"({"ec_role": "ec_consumer", "ec_buffer_size": 65536, "ec_connector_extra_config": {"max_tensor_bytes": 1e6}})",
      {"max_tensor_bytes", "exceeds"});
}

TEST(Config, EnumsListAcceptedValues) {
  expect_error_mentions(R"({"ec_role": "ec_encoder"})", {"ec_role", "ec_producer, ec_consumer, ec_both"});
  expect_error_mentions(R"({})", {"ec_role is required"});
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_connector_extra_config": {"transport": "nccl"}})",
                        {"transport", "ucx, mooncake"});
  expect_error_mentions(R"({"ec_role": "ec_consumer", "ec_buffer_device": "tpu"})", {"ec_buffer_device", "cpu, cuda"});
}

TEST(Config, ByteSizesAcceptHumanUnits) {
  auto config = parse_config(R"({"ec_role": "ec_consumer", "ec_buffer_size": "512MiB"})", {});
  ASSERT_TRUE(config);
  EXPECT_EQ(config->buffer_size, 512ULL << 20);
  config = parse_config(R"({"ec_role": "ec_consumer", "ec_buffer_size": "1e9"})", {});
  ASSERT_TRUE(config);
  EXPECT_EQ(config->buffer_size, 1'000'000'000ULL);
}

TEST(Config, ProducerMustBeUnsharded) {
  ParallelLayout l = tp(2);
  expect_error_mentions(R"({"ec_role": "ec_producer"})", {"tensor_parallel_size=1"}, l);
  expect_error_mentions(R"({"ec_role": "ec_both"})", {"data_parallel_size=1"}, l);
  EXPECT_TRUE(parse_config(R"({"ec_role": "ec_consumer"})", l));
}

TEST(Config, LayoutRanksMustFitSizes) {
  expect_error_mentions(R"({"ec_role": "ec_consumer"})", {"tp_rank"}, tp(2, 2));
  ParallelLayout l;
  l.dp_size = 0;
  expect_error_mentions(R"({"ec_role": "ec_consumer"})", {"dp_size"}, l);
}

TEST(Config, SecretFileIsReadAndExclusive) {
  const std::string path = ::testing::TempDir() + "/ecx_secret";
  std::ofstream(path) << "s3cret\n";
  auto config = parse_config(
      R"({"ec_role": "ec_consumer", "ec_connector_extra_config": {"auth_secret_file": ")" + path + "\"}}", {});
  ASSERT_TRUE(config) << config.status().to_string();
  EXPECT_EQ(config->auth_secret, "s3cret");
  expect_error_mentions(
      R"({"ec_role": "ec_consumer", "ec_connector_extra_config": {"auth_secret": "x", "auth_secret_file": ")" + path +
          "\"}}",
      {"exclusive"});
  expect_error_mentions(
      R"({"ec_role": "ec_consumer", "ec_connector_extra_config": {"auth_secret_file": "/nonexistent/x"}})",
      {"auth_secret_file", "cannot read"});
}

TEST(Config, DescribeShowsEveryShard) {
  auto config = parse_config(R"({"ec_role": "ec_consumer", "ec_buffer_size": 4e9})", tp(2));
  ASSERT_TRUE(config);
  const auto text = describe_config(*config);
  EXPECT_NE(text.find("shard 1: tcp://127.0.0.1:14580"), std::string::npos) << text;
  EXPECT_NE(text.find("4.0 GB"), std::string::npos) << text;
  EXPECT_NE(text.find("push wait 60 s"), std::string::npos) << text;
}

// docs/configuration.md documents every key with its type and default; this test
// fails when the doc and config_keys() disagree in either direction.
TEST(ConfigDoc, DocumentsEveryKeyExactly) {
  std::ifstream in(std::string(ECX_SOURCE_DIR) + "/docs/configuration.md");
  ASSERT_TRUE(in) << "docs/configuration.md is missing";
  const std::regex row(R"(^\|\s*`([^`]+)`\s*\|\s*([^|]+?)\s*\|\s*`?([^|`]*?)`?\s*\|)");
  std::map<std::string, std::pair<std::string, std::string>> documented;
  std::string line;
  std::string section;
  while (std::getline(in, line)) {
    if (line.starts_with("## "))
      section = line.find("ec_connector_extra_config") != std::string::npos ? "ec_connector_extra_config" : "";
    std::smatch m;
    if (std::regex_search(line, m, row)) {
      const std::string key = section.empty() ? m[1].str() : section + "." + m[1].str();
      documented[key] = {m[2].str(), m[3].str()};
    }
  }
  std::set<std::string> in_code;
  for (const auto& info : config_keys()) {
    const std::string key =
        info.section.empty() ? std::string(info.name) : std::string(info.section) + "." + std::string(info.name);
    in_code.insert(key);
    auto it = documented.find(key);
    if (it == documented.end()) {
      ADD_FAILURE() << "key " << key << " is not documented in docs/configuration.md";
      continue;
    }
    EXPECT_EQ(it->second.first, info.type) << key;
    EXPECT_EQ(it->second.second, info.default_text) << key;
  }
  for (const auto& [key, unused] : documented) {
    EXPECT_TRUE(in_code.count(key)) << "docs/configuration.md documents " << key << " which the code does not know";
  }
}

TEST(Config, UrlsArePrintedWithoutTheirPassword) {
  EXPECT_EQ(redact_url_password("redis://:s3cret@10.0.0.5:6379/0"), "redis://***@10.0.0.5:6379/0");
  EXPECT_EQ(redact_url_password("redis://user:s3cret@h"), "redis://***@h");
  EXPECT_EQ(redact_url_password("redis://h:6379/0"), "redis://h:6379/0");
  EXPECT_EQ(redact_url_password("mooncake://m:50051?metadata=http://x"), "mooncake://m:50051?metadata=http://x");
  EXPECT_EQ(redact_url_password(std::string(300, 'a')).size(), 128u);
}

}  // namespace
}  // namespace ecx
