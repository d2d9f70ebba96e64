#include "ecx/core/ids.h"

#include <gtest/gtest.h>

#include <set>

namespace ecx {
namespace {

TEST(Ids, AcceptsTypicalIds) {
  EXPECT_TRUE(validate_transfer_id("chatcmpl-7f3a:0:ab12"));
  EXPECT_TRUE(validate_mm_hash("0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0"));
  EXPECT_TRUE(validate_transfer_id(std::string(kMaxIdLength, 'a')));
}

TEST(Ids, RejectsBadIdsNamingTheField) {
  auto empty = validate_transfer_id("");
  EXPECT_EQ(empty.code(), StatusCode::invalid_argument);
  EXPECT_NE(empty.message().find("transfer_id"), std::string::npos);
  auto long_id = validate_mm_hash(std::string(kMaxIdLength + 1, 'a'));
  EXPECT_NE(long_id.message().find("mm_hash"), std::string::npos);
  for (const char* bad : {"a b", "a\nb", "a\"b", "naïve", "x\x01"}) {
    EXPECT_FALSE(validate_transfer_id(bad)) << bad;
  }
}

TEST(IdFromText, KeepsAnIdAndEscapesEverythingElseIntoTheAlphabet) {
  EXPECT_EQ(id_from_text("chatcmpl-1a2b/0"), "chatcmpl-1a2b/0");
  EXPECT_EQ(id_from_text("say \"hi\"\n"), "say~20~22hi~22~0a");
  EXPECT_EQ(id_from_text("a~20"), "a~7e20");  // '~' escaped too: "a " and "a~20" stay apart
  EXPECT_EQ(id_from_text("a "), "a~20");
  EXPECT_TRUE(validate_transfer_id(id_from_text(std::string("\0\xff\x80 x", 5))).ok());
}

TEST(IdFromText, HashesWhatWouldBeEmptyOrTooLongTheSameWayEachTime) {
  const std::string long_text(300, 'r');
  const auto hashed = id_from_text(long_text);
  EXPECT_EQ(hashed.size(), 34u);
  EXPECT_EQ(hashed.rfind("~h", 0), 0u);
  EXPECT_TRUE(validate_transfer_id(hashed).ok());
  EXPECT_EQ(id_from_text(long_text), hashed);  // deterministic: both sides of a transfer make it
  EXPECT_NE(id_from_text(std::string(300, 's')), hashed);
  EXPECT_NE(id_from_text(std::string(299, 'r')), hashed);
  EXPECT_TRUE(validate_transfer_id(id_from_text("")).ok());
  // The limit counts the escapes: 60 spaces are 180 characters escaped.
  EXPECT_EQ(id_from_text(std::string(60, ' '), 200).size(), 180u);
  EXPECT_EQ(id_from_text(std::string(60, ' '), 100).size(), 34u);
}

TEST(ReservationId, RandomIdsAreUniqueAndNeverNone) {
  std::set<ReservationId> seen;
  for (int i = 0; i < 10000; ++i) {
    const auto id = ReservationId::random();
    EXPECT_FALSE(id.is_none());
    EXPECT_TRUE(seen.insert(id).second);
  }
}

TEST(ReservationId, HexRoundTrip) {
  const auto id = ReservationId::random();
  const auto text = id.to_string();
  EXPECT_EQ(text.size(), 32U);
  auto parsed = ReservationId::parse(text);
  ASSERT_TRUE(parsed);
  EXPECT_EQ(*parsed, id);
  EXPECT_EQ(ReservationId(1, 2).to_string(), "00000000000000010000000000000002");
}

TEST(ReservationId, ParseRejectsBadText) {
  EXPECT_FALSE(ReservationId::parse(""));
  EXPECT_FALSE(ReservationId::parse("123"));
  EXPECT_FALSE(ReservationId::parse(std::string(32, 'g')));
  EXPECT_FALSE(ReservationId::parse(std::string(33, '0')));
}

}  // namespace
}  // namespace ecx
