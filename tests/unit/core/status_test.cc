#include "ecx/core/status.h"

#include <gtest/gtest.h>

#include <memory>

namespace ecx {
namespace {

TEST(Status, OkByDefault) {
  Status s;
  EXPECT_TRUE(s.is_ok());
  EXPECT_EQ(s.to_string(), "ok");
}

TEST(Status, CarriesCodeAndMessage) {
  const Status s = resource_exhausted("pool full");
  EXPECT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::resource_exhausted);
  EXPECT_EQ(s.to_string(), "resource_exhausted: pool full");
}

TEST(Status, EveryCodeNameRoundTrips) {
  for (int c = 0; c <= static_cast<int>(StatusCode::internal); ++c) {
    const auto code = static_cast<StatusCode>(c);
    auto parsed = parse_status_code(status_code_name(code));
    ASSERT_TRUE(parsed.has_value()) << status_code_name(code);
    EXPECT_EQ(*parsed, code);
  }
  EXPECT_FALSE(parse_status_code("nonsense").has_value());
}

TEST(Result, HoldsValueOrError) {
  Result<int> good = 7;
  ASSERT_TRUE(good.is_ok());
  EXPECT_EQ(*good, 7);
  EXPECT_TRUE(good.status().is_ok());

  Result<int> bad = not_found("nope");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::not_found);
  EXPECT_EQ(bad.value_or(3), 3);
}

TEST(Result, MovesOutMoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(5);
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 5);
}

Status fails_then_succeeds(bool fail) {
  ECX_RETURN_IF_ERROR(fail ? timeout_error("late") : Status::ok());
  return conflict("reached the end");
}

TEST(Status, ReturnIfErrorPropagates) {
  EXPECT_EQ(fails_then_succeeds(true).code(), StatusCode::timeout);
  EXPECT_EQ(fails_then_succeeds(false).code(), StatusCode::conflict);
}

}  // namespace
}  // namespace ecx
