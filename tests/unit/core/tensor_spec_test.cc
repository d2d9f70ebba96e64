#include "ecx/core/tensor_spec.h"

#include <gtest/gtest.h>

#include <limits>

namespace ecx {
namespace {

constexpr std::uint64_t kMax = 1ULL << 40;

TEST(TensorSpec, ComputesBytes) {
  auto spec = TensorSpec::make({1300, 3584}, DType::bfloat16, kMax);
  ASSERT_TRUE(spec);
  EXPECT_EQ(spec->nbytes(), 1300ULL * 3584 * 2);
  EXPECT_EQ(spec->num_elements(), 1300ULL * 3584);
  EXPECT_NE(spec->to_string().find("bfloat16"), std::string::npos);
}

TEST(TensorSpec, RankMustBeOneToEight) {
  EXPECT_FALSE(TensorSpec::make({}, DType::uint8, kMax));
  EXPECT_TRUE(TensorSpec::make(std::vector<std::int64_t>(8, 2), DType::uint8, kMax));
  auto nine = TensorSpec::make(std::vector<std::int64_t>(9, 2), DType::uint8, kMax);
  ASSERT_FALSE(nine);
  EXPECT_NE(nine.status().message().find("rank"), std::string::npos);
}

TEST(TensorSpec, EveryDimMustBePositive) {
  auto zero = TensorSpec::make({4, 0}, DType::float32, kMax);
  ASSERT_FALSE(zero);
  EXPECT_NE(zero.status().message().find("shape[1]"), std::string::npos);
  EXPECT_FALSE(TensorSpec::make({-1, 4}, DType::float32, kMax));
}

TEST(TensorSpec, DetectsOverflow) {
  const auto big = std::numeric_limits<std::int64_t>::max();
  auto spec = TensorSpec::make({big, big}, DType::float64, std::numeric_limits<std::uint64_t>::max());
  ASSERT_FALSE(spec);
  EXPECT_NE(spec.status().message().find("overflow"), std::string::npos);
}

TEST(TensorSpec, BoundedByMaximum) {
  EXPECT_TRUE(TensorSpec::make({1024}, DType::uint8, 1024));
  auto over = TensorSpec::make({1025}, DType::uint8, 1024);
  ASSERT_FALSE(over);
  EXPECT_NE(over.status().message().find("exceeds"), std::string::npos);
}

}  // namespace
}  // namespace ecx
