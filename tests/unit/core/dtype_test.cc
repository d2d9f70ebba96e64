#include "ecx/core/dtype.h"

#include <gtest/gtest.h>

namespace ecx {
namespace {

TEST(DType, EveryNameRoundTripsWithItsSize) {
  for (DType d : all_dtypes()) {
    auto parsed = parse_dtype(dtype_name(d));
    ASSERT_TRUE(parsed) << dtype_name(d);
    EXPECT_EQ(*parsed, d);
    EXPECT_GT(dtype_item_size(d), 0U);
  }
  EXPECT_EQ(all_dtypes().size(), 14U);
}

TEST(DType, ItemSizes) {
  EXPECT_EQ(dtype_item_size(DType::bfloat16), 2U);
  EXPECT_EQ(dtype_item_size(DType::float16), 2U);
  EXPECT_EQ(dtype_item_size(DType::float32), 4U);
  EXPECT_EQ(dtype_item_size(DType::float64), 8U);
  EXPECT_EQ(dtype_item_size(DType::float8_e4m3fn), 1U);
  EXPECT_EQ(dtype_item_size(DType::int64), 8U);
  EXPECT_EQ(dtype_item_size(DType::bool_), 1U);
}

TEST(DType, AcceptsTorchPrefixAndAliases) {
  EXPECT_EQ(*parse_dtype("torch.bfloat16"), DType::bfloat16);
  EXPECT_EQ(*parse_dtype("torch.half"), DType::float16);
  EXPECT_EQ(*parse_dtype("float"), DType::float32);
  EXPECT_EQ(*parse_dtype("torch.long"), DType::int64);
  EXPECT_EQ(*parse_dtype("bool"), DType::bool_);
}

TEST(DType, RejectsUnknownNamesListingTheAcceptedOnes) {
  for (const char* bad : {"", "bf16", "torch.", "Float32", "torch.complex64", "float32 ", "torch.torch.float32"}) {
    auto parsed = parse_dtype(bad);
    ASSERT_FALSE(parsed) << bad;
    EXPECT_EQ(parsed.status().code(), StatusCode::invalid_argument);
    EXPECT_NE(parsed.status().message().find("bfloat16"), std::string::npos);
  }
}

}  // namespace
}  // namespace ecx
