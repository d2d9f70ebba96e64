#include "connector/scheduler/json_events.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

namespace ecx::scheduler::detail {
namespace {

using Sax = nlohmann::json_sax<nlohmann::json>;
constexpr auto kUnknownSize = static_cast<std::size_t>(-1);  // what nlohmann passes to start_object/array

class Reader {
 public:
  Reader(std::string_view text, Sax& handler) : p_(text.data()), end_(text.data() + text.size()), sax_(handler) {}

  bool read() {
    if (end_ - p_ >= 3 && std::string_view(p_, 3) == "\xEF\xBB\xBF") p_ += 3;  // a byte order mark
    // Each pass reads one value, then closes what it ends; `open_` holds the open
    // containers (true: an object), so nesting costs heap, not stack.
    for (;;) {
      const Read read = value();
      if (read == Read::failed) return false;
      if (read == Read::opened) continue;  // its first value next
      for (;;) {
        skip_whitespace();
        // A NUL byte where a token would start ends the input, as in nlohmann's lexer
        // (made for NUL-terminated strings): what follows it is not read.
        if (open_.empty()) return p_ == end_ || *p_ == '\0';
        if (p_ == end_) return false;
        const char c = *p_++;
        const bool object = open_.back();
        if (c == ',') {
          if (object && !key()) return false;
          break;  // the next value
        }
        if (c != (object ? '}' : ']')) return false;
        open_.pop_back();
        if (!(object ? sax_.end_object() : sax_.end_array())) return false;
      }
    }
  }

 private:
  enum class Read : unsigned char { failed, complete, opened };

  static Read done(bool ok) { return ok ? Read::complete : Read::failed; }

  // One value, or the opening of a non-empty container (and its first key).
  Read value() {
    skip_whitespace();
    if (p_ == end_) return Read::failed;
    switch (*p_) {
      case '{':
        return open(true);
      case '[':
        return open(false);
      case '"':
        return done(string(text_) && sax_.string(text_));
      case 't':
        return done(literal("true") && sax_.boolean(true));
      case 'f':
        return done(literal("false") && sax_.boolean(false));
      case 'n':
        return done(literal("null") && sax_.null());
      default:
        return done(number());
    }
  }

  // An empty container is complete at once; another is left open, after an object's
  // first key.
  Read open(bool object) {
    ++p_;
    if (!(object ? sax_.start_object(kUnknownSize) : sax_.start_array(kUnknownSize))) return Read::failed;
    skip_whitespace();
    if (p_ != end_ && *p_ == (object ? '}' : ']')) {
      ++p_;
      return done(object ? sax_.end_object() : sax_.end_array());
    }
    open_.push_back(object);
    return !object || key() ? Read::opened : Read::failed;
  }

  // `"name"`, then `:`.
  bool key() {
    skip_whitespace();
    if (p_ == end_ || *p_ != '"' || !string(text_) || !sax_.key(text_)) return false;
    skip_whitespace();
    if (p_ == end_ || *p_ != ':') return false;
    ++p_;
    return true;
  }

  void skip_whitespace() {
    while (p_ != end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }

  bool literal(std::string_view word) {
    if (static_cast<std::size_t>(end_ - p_) < word.size() || std::string_view(p_, word.size()) != word) return false;
    p_ += word.size();
    return true;
  }

  static bool plain(unsigned char c) { return c >= 0x20 && c < 0x80 && c != '"' && c != '\\'; }

  // A string from its opening quote; `out` gets it decoded.
  bool string(std::string& out) {
    ++p_;
    out.clear();
    for (;;) {
      const char* run = p_;
      while (p_ != end_ && plain(static_cast<unsigned char>(*p_))) ++p_;
      out.append(run, p_);
      if (p_ == end_) return false;
      const auto c = static_cast<unsigned char>(*p_);
      if (c == '"') {
        ++p_;
        return true;
      }
      if (c == '\\') {
        if (!escape(out)) return false;
      } else if (c < 0x20 || !utf8_sequence(out)) {
        return false;
      }
    }
  }

  // One multi-byte UTF-8 sequence, well-formed as RFC 3629 draws it.
  bool utf8_sequence(std::string& out) {
    const auto lead = static_cast<unsigned char>(*p_);
    unsigned char low = 0x80;
    unsigned char high = 0xBF;
    std::size_t length = 0;
    if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3;
      if (lead == 0xE0) low = 0xA0;   // no overlong form
      if (lead == 0xED) high = 0x9F;  // no surrogate
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4;
      if (lead == 0xF0) low = 0x90;   // no overlong form
      if (lead == 0xF4) high = 0x8F;  // nothing above U+10FFFF
    } else {
      return false;
    }
    if (static_cast<std::size_t>(end_ - p_) < length) return false;
    for (std::size_t i = 1; i < length; ++i) {
      const auto c = static_cast<unsigned char>(p_[i]);
      if (c < (i == 1 ? low : 0x80) || c > (i == 1 ? high : 0xBF)) return false;
    }
    out.append(p_, length);
    p_ += length;
    return true;
  }

  bool escape(std::string& out) {
    ++p_;
    if (p_ == end_) return false;
    const char c = *p_++;
    // The one-letter escapes and what each stands for; \u is read below.
    constexpr std::string_view kLetters = "\"\\/bfnrt";
    constexpr std::string_view kMeanings = "\"\\/\b\f\n\r\t";
    if (const auto at = kLetters.find(c); at != std::string_view::npos) {
      out.push_back(kMeanings[at]);
      return true;
    }
    if (c != 'u') return false;
    std::uint32_t code = 0;
    if (!hex4(code)) return false;
    if (code >= 0xDC00 && code <= 0xDFFF) return false;  // a low surrogate first
    if (code >= 0xD800 && code <= 0xDBFF) {
      std::uint32_t low = 0;
      if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u') return false;
      p_ += 2;
      if (!hex4(low) || low < 0xDC00 || low > 0xDFFF) return false;
      code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
    }
    append_utf8(code, out);
    return true;
  }

  bool hex4(std::uint32_t& code) {
    if (end_ - p_ < 4) return false;
    for (int i = 0; i < 4; ++i) {
      const char c = *p_++;
      std::uint32_t digit = 0;
      if (c >= '0' && c <= '9') {
        digit = static_cast<std::uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        digit = static_cast<std::uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        digit = static_cast<std::uint32_t>(c - 'A' + 10);
      } else {
        return false;
      }
      code = (code << 4) | digit;
    }
    return true;
  }

  static void append_utf8(std::uint32_t code, std::string& out) {
    if (code < 0x80) {
      out.push_back(static_cast<char>(code));
    } else if (code < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (code >> 6)));
      out.push_back(static_cast<char>(0x80 | (code & 0x3F)));
    } else if (code < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (code >> 12)));
      out.push_back(static_cast<char>(0x80 | ((code >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (code & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (code >> 18)));
      out.push_back(static_cast<char>(0x80 | ((code >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((code >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (code & 0x3F)));
    }
  }

  static bool digit(char c) { return c >= '0' && c <= '9'; }

  std::size_t digits() {
    const char* start = p_;
    while (p_ != end_ && digit(*p_)) ++p_;
    return static_cast<std::size_t>(p_ - start);
  }

  // -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?
  bool number() {
    const char* start = p_;
    const bool negative = *p_ == '-';
    if (negative) ++p_;
    if (p_ == end_ || !digit(*p_)) return false;
    const char* int_start = p_;
    if (*p_ == '0') {
      ++p_;
    } else {
      digits();
    }
    const char* int_end = p_;
    const char* fraction = nullptr;
    const char* fraction_end = nullptr;
    if (p_ != end_ && *p_ == '.') {
      ++p_;
      fraction = p_;
      if (digits() == 0) return false;
      fraction_end = p_;
    }
    bool exponent_negative = false;
    const char* exponent = nullptr;
    if (p_ != end_ && (*p_ == 'e' || *p_ == 'E')) {
      ++p_;
      if (p_ != end_ && (*p_ == '+' || *p_ == '-')) exponent_negative = *p_++ == '-';
      exponent = p_;
      if (digits() == 0) return false;
    }
    const std::string_view text(start, static_cast<std::size_t>(p_ - start));
    if (fraction == nullptr && exponent == nullptr) {
      if (negative) {
        std::int64_t v = 0;
        if (const auto r = std::from_chars(text.data(), text.data() + text.size(), v); r.ec == std::errc()) {
          return sax_.number_integer(v);
        }
      } else {
        std::uint64_t v = 0;
        if (const auto r = std::from_chars(text.data(), text.data() + text.size(), v); r.ec == std::errc()) {
          return sax_.number_unsigned(v);
        }
      }
      // Too large for a 64-bit integer: a float, as nlohmann reads it.
    }
    double v = 0;
    const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
    if (r.ec == std::errc::result_out_of_range) {
      // Out of range one way or the other: beyond the largest double fails (as an
      // overflow does in nlohmann), below the smallest reads as zero.
      if (!tiny(int_start, int_end, fraction, fraction_end, exponent, exponent_negative)) return false;
      v = negative ? -0.0 : 0.0;
    } else if (r.ec != std::errc() || !std::isfinite(v)) {
      return false;
    }
    number_text_.assign(text);
    return sax_.number_float(v, number_text_);
  }

  // Whether a number out of a double's range is below it: its first significant
  // digit's decimal position plus its exponent is negative.
  bool tiny(const char* int_start, const char* int_end, const char* fraction, const char* fraction_end,
            const char* exponent, bool exponent_negative) const {
    std::int64_t lead = 0;
    if (!(int_end - int_start == 1 && *int_start == '0')) {
      lead = int_end - int_start - 1;
    } else {
      std::int64_t zeros = 0;
      const char* f = fraction;
      while (f != nullptr && f != fraction_end && *f == '0') {
        ++f;
        ++zeros;
      }
      if (f == nullptr || f == fraction_end) return true;  // all zeros: zero is in range anyway
      lead = -(zeros + 1);
    }
    // The exponent, saturated: any exponent this large settles the answer.
    constexpr std::int64_t kSaturated = std::int64_t{1} << 40;
    std::int64_t e = 0;
    for (const char* q = exponent; q != nullptr && q != p_; ++q) {
      e = std::min<std::int64_t>(kSaturated, e * 10 + (*q - '0'));
    }
    if (exponent_negative) e = -e;
    return lead + e < 0;
  }

  const char* p_;
  const char* end_;
  Sax& sax_;
  std::vector<bool> open_;  // the open containers, innermost last; true: an object
  std::string text_;        // the last string or key read
  std::string number_text_;
};

}  // namespace

bool read_json_events(std::string_view text, Sax& handler) { return Reader(text, handler).read(); }

}  // namespace ecx::scheduler::detail
