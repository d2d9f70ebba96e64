#include "core/logging.h"

#include <gtest/gtest.h>

#include <spdlog/sinks/ostream_sink.h>

#include <sstream>

namespace ecx {
namespace {

TEST(Logging, OneNamedLoggerPerComponent) {
  auto a = log::get("scheduler");
  auto b = log::get("scheduler");
  auto c = log::get("control");
  EXPECT_EQ(a.get(), b.get());
  EXPECT_NE(a.get(), c.get());
  EXPECT_EQ(a->name(), "ecx.scheduler");
}

TEST(Logging, SinkIsReplaceableAndLevelApplies) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  sink->set_pattern("%n %l %v");
  log::set_sink(sink);
  const auto saved = log::level();
  log::set_level(spdlog::level::warn);
  auto logger = log::get("logging_test");
  logger->info("hidden");
  logger->warn("shown {}", 42);
  logger->flush();
  log::set_sink(nullptr);
  log::set_level(saved);
  const std::string text = out.str();
  EXPECT_EQ(text.find("hidden"), std::string::npos);
  EXPECT_NE(text.find("ecx.logging_test warning shown 42"), std::string::npos);
}

TEST(Logging, ParsesLevels) {
  EXPECT_EQ(*log::parse_level("debug"), spdlog::level::debug);
  EXPECT_EQ(*log::parse_level("warning"), spdlog::level::warn);
  auto bad = log::parse_level("loud");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("accepted"), std::string::npos);
}

}  // namespace
}  // namespace ecx
