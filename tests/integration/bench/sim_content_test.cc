// The simulated engines' content (tools/sim/workload.h): what `ecx bench e2e`, `ecx
// demo` and the fault tests rely on to say every byte arrived where it belongs.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "sim/workload.h"

namespace ecx::sim {
namespace {

constexpr std::size_t kItemBytes = 3 * kContentBlockBytes + 4096 + 24;  // a partial last block

std::vector<std::byte> content_of(std::string_view mm_hash) {
  std::vector<std::byte> out(kItemBytes);
  fill_content(mm_hash, out);
  return out;
}

TEST(SimContent, TheSameHashGivesTheSameBytesAndTwoStepsMatchOne) {
  const auto a = content_of("img-a");
  EXPECT_EQ(a, content_of("img-a"));
  EXPECT_NE(a, content_of("img-b"));
  std::vector<std::byte> arena(kItemBytes);
  prepare_content_body(arena);
  stamp_content("img-a", arena);
  EXPECT_EQ(arena, a);
  EXPECT_TRUE(content_matches("img-a", a));
  EXPECT_TRUE(stamps_match("img-a", a));
}

TEST(SimContent, AForeignOrShiftedPayloadFailsTheStampCheck) {
  const auto a = content_of("img-a");
  EXPECT_FALSE(stamps_match("img-b", a));
  EXPECT_FALSE(content_matches("img-b", a));
  for (const std::size_t shift : {std::size_t{8}, std::size_t{4096}, kContentBlockBytes}) {
    std::vector<std::byte> shifted(kItemBytes);
    std::copy(a.begin(), a.end() - static_cast<std::ptrdiff_t>(shift),
              shifted.begin() + static_cast<std::ptrdiff_t>(shift));
    EXPECT_FALSE(stamps_match("img-a", shifted)) << "shifted by " << shift;
  }
  // Blocks swapped: each block's stamp names its place.
  std::vector<std::byte> swapped = a;
  std::swap_ranges(swapped.begin(), swapped.begin() + static_cast<std::ptrdiff_t>(kContentBlockBytes),
                   swapped.begin() + static_cast<std::ptrdiff_t>(kContentBlockBytes));
  EXPECT_FALSE(stamps_match("img-a", swapped));
}

TEST(SimContent, ACorruptedByteInsideABlockFailsOnlyTheFullCheck) {
  for (const std::size_t at : {std::size_t{9}, kContentBlockBytes + 4096, kItemBytes - 1}) {
    auto a = content_of("img-a");
    a[at] = static_cast<std::byte>(~static_cast<unsigned char>(a[at]));
    EXPECT_TRUE(stamps_match("img-a", a)) << at;
    EXPECT_FALSE(content_matches("img-a", a)) << at;
  }
}

}  // namespace
}  // namespace ecx::sim
