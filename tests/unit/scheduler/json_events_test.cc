// ECX's JSON reader against nlohmann's sax_parse: the same verdict on every text,
// and the same events for every text both accept.

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "json_event_log.h"

namespace ecx::scheduler {
namespace {

using testing::read_both;

void expect_agreement(const std::vector<std::string>& texts, bool accepted) {
  for (const auto& text : texts) {
    const auto r = read_both(text);
    EXPECT_TRUE(r.agree()) << "text: " << text << "\nours (" << r.ours_accepted << "): " << r.ours << "\ntheirs ("
                           << r.theirs_accepted << "): " << r.theirs;
    EXPECT_EQ(r.ours_accepted, accepted) << "text: " << text;
  }
}

TEST(JsonEvents, DocumentsAreReadEventForEventAsNlohmannReadsThem) {
  expect_agreement(
      {
          R"({"consumer_zmq":"tcp://127.0.0.1:1","ec_items":[{"mm_hash":"h","transfer_id":"t"}]})",
          R"({"a":[1,-2,3.5,true,false,null,"x",{},[]],"b":{"c":{"d":[[[]]]}}})", " \t\r\n{ \"a\" : [ 1 , 2 ] } \n",
          "\xEF\xBB\xBF{}",  // a byte order mark
          "[]", "{}", "0", "-0", "\"\"", "true", "false", "null",
          R"({"a":1,"a":2})",  // a key twice: both reported
      },
      true);
}

TEST(JsonEvents, StringsAreDecodedAndValidatedAsUtf8) {
  expect_agreement(
      {
          R"("\u00e9\ud83d\ude00\n\t\"\\\/\b\f\r")",
          R"("\u0000")",  // a NUL in a string is a character
          "\"\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80 \x7F\"",
          "\"\xED\x9F\xBF\xEE\x80\x80\xF4\x8F\xBF\xBF\"",  // the edges next to the surrogates and at U+10FFFF
      },
      true);
  expect_agreement(
      {
          R"("\ud800")",
          R"("\udc00")",
          R"("\ud800\u0041")",
          R"("\ud800\n")",
          R"("\u12")",
          R"("\u12G4")",
          R"("\x")",
          "\"\x01\"",
          "\"a\nb\"",
          "\"unterminated",
          "\"\xC0\x80\"",
          "\"\xC1\xBF\"",  // overlong 2-byte
          "\"\xE0\x80\x80\"",
          "\"\xE0\x9F\xBF\"",  // overlong 3-byte
          "\"\xED\xA0\x80\"",  // an encoded surrogate
          "\"\xF0\x80\x80\x80\"",
          "\"\xF4\x90\x80\x80\"",  // overlong 4-byte, above U+10FFFF
          "\"\xF5\x80\x80\x80\"",
          "\"\xFF\"",
          "\"\x80\"",  // no such lead byte, a lone continuation
          "\"\xC3\"",
          "\"\xE2\x82\"",
          "\"\xF0\x9F\x98\"",  // cut short by the quote
          "\"\xE2\x82",        // cut short by the end
      },
      false);
}

TEST(JsonEvents, NumbersAreIntegersWhenTheyFitAndFiniteFloatsOtherwise) {
  expect_agreement(
      {
          "[0,-0,7,-7,1.5,-1.5,1e5,1E+5,1e-5,2.5E-3,0.0]",
          "18446744073709551615",                    // the largest unsigned
          "18446744073709551616",                    // one more: a float
          "-9223372036854775808",                    // the smallest signed
          "-9223372036854775809",                    // one less: a float
          "123456789012345678901234567890",          // a float
          "1e-400", "-1e-400", "0.0000000001e-330",  // below a double's range: zero
          "4.9e-324",                                // the smallest subnormal
          "1.7976931348623157e308",                  // the largest double
      },
      true);
  expect_agreement({"1e400", "-1e400", "1.8e308", "1e99999999999999999999", "01", "-01", "1.", ".5", "-", "+1", "1e",
                    "1e+", "--1", "1.e5", "0x10", "Infinity", "NaN", "1 2"},
                   false);
}

TEST(JsonEvents, MalformedDocumentsAreRefused) {
  expect_agreement(
      {
          "",           " ",
          "\xEF\xBB",   "\xEF{}",
          "[1,]",       R"({"a":1,})",
          R"({"a" 1})", R"({"a":})",
          R"({1:2})",   "[1 2]",
          "{",          "[",
          "]",          "}",
          "[1}",        R"({"a":1])",
          "tru",        "nul",
          "truex",      "[true false]",
          "{}{}",       "{} x",
          "// c\n{}",   "/* c */{}",
          "'a'",        std::string("\0{}", 3),
      },
      false);
}

TEST(JsonEvents, ANulByteEndsTheInputWhereATokenWouldStart) {
  // nlohmann reads a NUL there as the end of its input; a reader that kept going
  // would refuse texts nlohmann accepts, or the other way round.
  expect_agreement({std::string("{}\0garbage", 10), std::string("1\0 2", 4), std::string("[1]  \0", 6)}, true);
  expect_agreement({std::string("[1\0]", 4), std::string("{\"a\"\0:1}", 8), std::string("[\0]", 3)}, false);
}

TEST(JsonEvents, DeepNestingCostsHeapNotStack) {
  const std::size_t depth = 200000;
  const auto r = read_both(std::string(depth, '[') + std::string(depth, ']'));
  EXPECT_TRUE(r.ours_accepted);
  EXPECT_TRUE(r.agree());
  EXPECT_FALSE(read_both(std::string(depth, '[') + std::string(depth - 1, ']')).ours_accepted);
}

TEST(JsonEvents, AHandlerThatRefusesAnEventStopsTheRead) {
  class StopAtKey final : public nlohmann::json_sax<nlohmann::json> {
   public:
    int events = 0;
    bool null() override { return ++events > 0; }
    bool boolean(bool) override { return ++events > 0; }
    bool number_integer(number_integer_t) override { return ++events > 0; }
    bool number_unsigned(number_unsigned_t) override { return ++events > 0; }
    bool number_float(number_float_t, const string_t&) override { return ++events > 0; }
    bool string(string_t&) override { return ++events > 0; }
    bool binary(binary_t&) override { return ++events > 0; }
    bool start_object(std::size_t) override { return ++events > 0; }
    bool key(string_t&) override {
      ++events;
      return false;
    }
    bool end_object() override { return ++events > 0; }
    bool start_array(std::size_t) override { return ++events > 0; }
    bool end_array() override { return ++events > 0; }
    bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
  } handler;
  EXPECT_FALSE(detail::read_json_events(R"({"a":1,"b":2})", handler));
  EXPECT_EQ(handler.events, 2);  // start_object, then the refused key
}

}  // namespace
}  // namespace ecx::scheduler
