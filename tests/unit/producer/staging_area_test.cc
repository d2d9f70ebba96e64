// The staging pool hashes an output while staging it only when this producer's
// `checksum` is on; otherwise the first consumer that verifies has it hashed then.
#include "producer/staging_area.h"

#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>
#include <nlohmann/json.hpp>

namespace ecx::producer {
namespace {

Config producer_config(bool checksum) {
  const nlohmann::json doc{{"ec_role", "ec_producer"},  {"ec_ip", "127.0.0.1"},
                           {"ec_port", 14600},          {"ec_buffer_size", "1MiB"},
                           {"ec_buffer_device", "cpu"}, {"ec_connector_extra_config", {{"checksum", checksum}}}};
  auto config = parse_config(doc.dump(), ParallelLayout{});
  EXPECT_TRUE(config) << config.status().to_string();
  return *config;
}

std::vector<std::byte> output(std::size_t n) {
  std::vector<std::byte> bytes(n);
  for (std::size_t i = 0; i < n; ++i) bytes[i] = static_cast<std::byte>((i * 131) & 0xff);
  return bytes;
}

TEST(StagingArea, WithChecksumsOffAnOutputIsHashedOnlyWhenAskedAndOnce) {
  auto staging = StagingArea::create(producer_config(false), SteadyClock::shared());
  ASSERT_TRUE(staging) << staging.status().to_string();
  const auto bytes = output(10'000);
  auto id = (*staging)->stage(bytes.data(), bytes.size(), SourceMemory::host);
  ASSERT_TRUE(id) << id.status().to_string();
  EXPECT_FALSE((*staging)->find(*id)->checksum.has_value());  // nobody asked yet
  const std::uint64_t expected = XXH64(bytes.data(), bytes.size(), 0);
  EXPECT_EQ((*staging)->checksum(*id), expected);
  EXPECT_EQ((*staging)->find(*id)->checksum, expected);  // kept for the next shard
  (*staging)->release(*id);
  EXPECT_FALSE((*staging)->checksum(*id).has_value());  // released: nothing to hash
}

TEST(StagingArea, WithChecksumsOnAnOutputIsHashedWhileStaged) {
  auto staging = StagingArea::create(producer_config(true), SteadyClock::shared());
  ASSERT_TRUE(staging) << staging.status().to_string();
  const auto bytes = output(4096);
  auto id = (*staging)->stage(bytes.data(), bytes.size(), SourceMemory::host);
  ASSERT_TRUE(id) << id.status().to_string();
  EXPECT_EQ((*staging)->find(*id)->checksum, XXH64(bytes.data(), bytes.size(), 0));
}

}  // namespace
}  // namespace ecx::producer
