#include "ecx/core/tensor_spec.h"

#include <gtest/gtest.h>

#include <array>
#include <limits>
#include <span>
#include <vector>

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
  EXPECT_FALSE(TensorSpec::make(std::span<const std::int64_t>{}, DType::uint8, kMax));
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

TEST(TensorSpec, KeepsItsShapeAndComparesByIt) {
  const std::array<std::int64_t, 3> dims{3, 5, 7};
  auto from_span = TensorSpec::make(std::span<const std::int64_t>(dims), DType::float16, kMax);
  auto from_vector = TensorSpec::make(std::vector<std::int64_t>{3, 5, 7}, DType::float16, kMax);
  ASSERT_TRUE(from_span && from_vector);
  EXPECT_EQ(from_span->shape_vector(), (std::vector<std::int64_t>{3, 5, 7}));
  EXPECT_EQ(from_span->shape().size(), 3U);
  EXPECT_EQ(*from_span, *from_vector);
  // A trailing dim of 1 is a different shape, though it holds as many bytes.
  auto longer = TensorSpec::make({3, 5, 7, 1}, DType::float16, kMax);
  ASSERT_TRUE(longer);
  EXPECT_EQ(longer->nbytes(), from_span->nbytes());
  EXPECT_NE(*longer, *from_span);
  EXPECT_NE(*from_span, *TensorSpec::make({3, 5, 7}, DType::bfloat16, kMax));
  const TensorSpec copy = *from_span;  // NOLINT(performance-unnecessary-copy-initialization): the copy is the point
  EXPECT_EQ(copy.shape_vector(), from_span->shape_vector());
  EXPECT_EQ(copy.to_string(), from_span->to_string());
}

}  // namespace
}  // namespace ecx
