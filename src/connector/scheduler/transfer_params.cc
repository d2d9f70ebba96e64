#include "ecx/connector/scheduler/transfer_params.h"

#include <algorithm>

#include <fmt/format.h>

#include "connector/scheduler/transfer_params_json.h"
#include "ecx/connector/scheduler/types.h"
#include "ecx/core/ids.h"

namespace ecx::scheduler {
namespace {

std::string_view type_name(const nlohmann::json& v) { return v.type_name(); }

// A present, non-null value must be a valid id string.
Result<std::optional<std::string>> optional_id(const nlohmann::json& item, const char* key, std::size_t index) {
  auto it = item.find(key);
  if (it == item.end() || it->is_null()) return std::optional<std::string>{};
  if (!it->is_string()) {
    return invalid_argument(fmt::format("ec_items[{}].{} must be a string, got {}", index, key, type_name(*it)));
  }
  const auto& text = it->get_ref<const std::string&>();
  if (Status s = validate_id(text, key); !s) {
    return invalid_argument(fmt::format("ec_items[{}].{}: {}", index, key, s.message()));
  }
  return std::optional<std::string>{text};
}

}  // namespace

Result<EcTransferParams> parse_ec_transfer_params(const nlohmann::json& value) {
  if (!value.is_object()) {
    return invalid_argument(fmt::format("ec_transfer_params must be an object, got {}", type_name(value)));
  }
  EcTransferParams params;
  if (auto it = value.find("consumer_zmq"); it != value.end() && !it->is_null()) {
    if (!it->is_string()) {
      return invalid_argument(fmt::format("ec_transfer_params.consumer_zmq must be a string, got {}", type_name(*it)));
    }
    params.consumer_zmq = it->get<std::string>();
    if (params.consumer_zmq.size() > kMaxAddressLength ||
        (!params.consumer_zmq.empty() && params.consumer_zmq.find("://") == std::string::npos)) {
      return invalid_argument(
          fmt::format("ec_transfer_params.consumer_zmq must be an address like tcp://host:port, got '{}'",
                      params.consumer_zmq.substr(0, 64)));
    }
  }
  if (auto it = value.find("ec_items"); it != value.end() && !it->is_null()) {
    if (!it->is_array()) {
      return invalid_argument(fmt::format("ec_transfer_params.ec_items must be an array, got {}", type_name(*it)));
    }
    if (it->size() > kMaxEcItems) {
      return invalid_argument(
          fmt::format("ec_transfer_params.ec_items has {} entries; at most {}", it->size(), kMaxEcItems));
    }
    params.items.reserve(it->size());
    for (std::size_t i = 0; i < it->size(); ++i) {
      const auto& item = (*it)[i];
      if (!item.is_object()) {
        return invalid_argument(fmt::format("ec_items[{}] must be an object, got {}", i, type_name(item)));
      }
      auto mm_hash = optional_id(item, "mm_hash", i);
      if (!mm_hash) return mm_hash.status();
      auto transfer_id = optional_id(item, "transfer_id", i);
      if (!transfer_id) return transfer_id.status();
      bool from_store = false;
      if (auto store = item.find("store"); store != item.end() && !store->is_null()) {
        if (!store->is_boolean()) {
          return invalid_argument(fmt::format("ec_items[{}].store must be a boolean, got {}", i, type_name(*store)));
        }
        from_store = store->get<bool>();
      }
      if (from_store && *transfer_id) {
        return invalid_argument(fmt::format(
            "ec_items[{}] names a transfer_id and \"store\": true; an item comes from a push or from the store", i));
      }
      params.items.push_back(EcItem{std::move(*mm_hash), std::move(*transfer_id), from_store});
    }
  }
  return params;
}

Result<EcTransferParams> parse_ec_transfer_params_text(std::string_view json_text) {
  auto value = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) return invalid_argument("ec_transfer_params is not valid JSON");
  return parse_ec_transfer_params(value);
}

std::optional<std::string_view> resolve_transfer_id(const EcTransferParams* params, std::size_t index,
                                                    std::string_view identifier) {
  if (params == nullptr) return std::nullopt;
  const auto& items = params->items;
  if (index < items.size()) {
    const EcItem& item = items[index];
    if ((!item.mm_hash || *item.mm_hash == identifier) && item.transfer_id) return *item.transfer_id;
  }
  for (const EcItem& item : items) {
    if (item.mm_hash && *item.mm_hash == identifier && item.transfer_id) return *item.transfer_id;
  }
  return std::nullopt;
}

bool is_store_item(const EcTransferParams* params, std::size_t index, std::string_view identifier) {
  if (params == nullptr) return false;
  const auto& items = params->items;
  if (index < items.size() && (!items[index].mm_hash || *items[index].mm_hash == identifier)) {
    return items[index].from_store;
  }
  return std::any_of(items.begin(), items.end(), [&](const EcItem& item) {
    return item.from_store && item.mm_hash && *item.mm_hash == identifier;
  });
}

void set_ec_transfer_params(RequestView& request, const nlohmann::json& value) {
  request.ec_transfer_params.reset();
  request.ec_transfer_params_error.clear();
  if (value.is_null()) return;
  auto parsed = parse_ec_transfer_params(value);
  if (parsed)
    request.ec_transfer_params = std::move(*parsed);
  else
    request.ec_transfer_params_error = parsed.status().message();
}

void RequestView::set_ec_transfer_params_text(std::string_view json_text) {
  ec_transfer_params.reset();
  ec_transfer_params_error.clear();
  auto value = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) {
    ec_transfer_params_error = "ec_transfer_params is not valid JSON";
    return;
  }
  set_ec_transfer_params(*this, value);
}

}  // namespace ecx::scheduler
