#pragma once
// A SAX handler that writes every event down, so that ECX's JSON reader
// (connector/scheduler/json_events.h) and nlohmann's sax_parse can be compared
// event for event: by its unit test and by the transfer-params fuzzer.

#include <cstdio>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "connector/scheduler/json_events.h"

namespace ecx::scheduler::testing {

class JsonEventLog final : public nlohmann::json_sax<nlohmann::json> {
 public:
  std::string log;

  bool null() override { return add("null"); }
  bool boolean(bool value) override { return add(value ? "true" : "false"); }
  bool number_integer(number_integer_t value) override { return add("i" + std::to_string(value)); }
  bool number_unsigned(number_unsigned_t value) override { return add("u" + std::to_string(value)); }
  bool number_float(number_float_t value, const string_t& text) override {
    char bits[64];
    std::snprintf(bits, sizeof bits, "%a", value);
    return add("f" + text + "=" + bits);
  }
  bool string(string_t& value) override { return add("s" + std::to_string(value.size()) + ":" + value); }
  bool binary(binary_t& /*value*/) override { return add("binary"); }
  bool start_object(std::size_t elements) override { return add("{" + std::to_string(elements)); }
  bool key(string_t& value) override { return add("k" + std::to_string(value.size()) + ":" + value); }
  bool end_object() override { return add("}"); }
  bool start_array(std::size_t elements) override { return add("[" + std::to_string(elements)); }
  bool end_array() override { return add("]"); }
  bool parse_error(std::size_t /*position*/, const std::string& /*token*/,
                   const nlohmann::detail::exception& /*error*/) override {
    return false;
  }

 private:
  bool add(const std::string& event) {
    log += event;
    log += ';';
    return true;
  }
};

// Both readers' verdicts on `text`: whether it is JSON and, if so, the events.
struct JsonReadings {
  bool ours_accepted = false;
  bool theirs_accepted = false;
  std::string ours;
  std::string theirs;
  bool agree() const { return ours_accepted == theirs_accepted && (!ours_accepted || ours == theirs); }
};

inline JsonReadings read_both(std::string_view text) {
  JsonReadings r;
  JsonEventLog ours;
  JsonEventLog theirs;
  r.ours_accepted = detail::read_json_events(text, ours);
  r.theirs_accepted = nlohmann::json::sax_parse(text, &theirs);
  r.ours = std::move(ours.log);
  r.theirs = std::move(theirs.log);
  return r;
}

}  // namespace ecx::scheduler::testing
