// libFuzzer target for the ec_transfer_params parser (what a proxy attaches to every
// request). ECX's JSON reader must give nlohmann's verdict and, where both accept,
// nlohmann's events. Any text must come back as a value or an error; what parses must honour
// the documented bounds and ids, agree with the JSON-value entry point, and survive a
// re-serialisation unchanged; resolve_transfer_id only ever answers a transfer id
// the value named.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "connector/scheduler/transfer_params_json.h"
#include "ecx/connector/scheduler/transfer_params.h"
#include "ecx/core/ids.h"

#include "../unit/scheduler/json_event_log.h"

namespace {

void check(bool condition) {
  if (!condition) std::abort();
}

bool same(const ecx::scheduler::EcTransferParams& a, const ecx::scheduler::EcTransferParams& b) {
  if (a.consumer_zmq != b.consumer_zmq || a.items.size() != b.items.size()) return false;
  for (std::size_t i = 0; i < a.items.size(); ++i) {
    if (a.items[i].mm_hash != b.items[i].mm_hash || a.items[i].transfer_id != b.items[i].transfer_id ||
        a.items[i].from_store != b.items[i].from_store) {
      return false;
    }
  }
  return true;
}

nlohmann::json to_json(const ecx::scheduler::EcTransferParams& p) {
  nlohmann::json items = nlohmann::json::array();
  for (const auto& item : p.items) {
    nlohmann::json entry = nlohmann::json::object();
    if (item.mm_hash) entry["mm_hash"] = *item.mm_hash;
    if (item.transfer_id) entry["transfer_id"] = *item.transfer_id;
    items.push_back(std::move(entry));
  }
  return nlohmann::json{{"consumer_zmq", p.consumer_zmq}, {"ec_items", std::move(items)}};
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ecx::scheduler;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  check(testing::read_both(text).agree());
  auto parsed = parse_ec_transfer_params_text(text);

  // The JSON-value entry point agrees with the text one.
  auto value = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) {
    check(!parsed.is_ok());
    return 0;
  }
  // (The text is read without building a JSON value: the two readers must agree on
  // every input, errors word for word.)
  auto from_value = parse_ec_transfer_params(value);
  check(parsed.is_ok() == from_value.is_ok());
  if (!parsed) {
    check(!parsed.status().message().empty());
    check(parsed.status().message() == from_value.status().message());
    return 0;
  }
  check(same(*parsed, *from_value));

  // Documented bounds and ids.
  check(parsed->consumer_zmq.size() <= kMaxAddressLength);
  check(parsed->consumer_zmq.empty() || parsed->consumer_zmq.find("://") != std::string::npos);
  check(parsed->items.size() <= kMaxEcItems);
  for (const auto& item : parsed->items) {
    if (item.mm_hash) check(ecx::validate_id(*item.mm_hash, "mm_hash").is_ok());
    if (item.transfer_id) check(ecx::validate_id(*item.transfer_id, "transfer_id").is_ok());
  }

  // What parsed survives serialisation unchanged.
  auto again = parse_ec_transfer_params_text(to_json(*parsed).dump());
  check(again.is_ok());
  check(same(*parsed, *again));

  // Resolution answers only ids the value named, for any index and identifier.
  const std::size_t n = parsed->items.size();
  for (std::size_t index = 0; index < n + 2; ++index) {
    for (const std::string_view identifier : {std::string_view{}, std::string_view{"x"}}) {
      const auto& probe =
          index < n && parsed->items[index].mm_hash ? std::string_view(*parsed->items[index].mm_hash) : identifier;
      for (const auto id :
           {resolve_transfer_id(&*parsed, index, identifier), resolve_transfer_id(&*parsed, index, probe)}) {
        if (!id) continue;
        bool named = false;
        for (const auto& item : parsed->items) named = named || (item.transfer_id && *item.transfer_id == *id);
        check(named);
      }
    }
    if (index > 64) break;  // bounded work per input
  }
  check(!resolve_transfer_id(nullptr, 0, "x"));
  return 0;
}
