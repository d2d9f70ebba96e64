#include "flow_json.h"

#include <array>
#include <optional>
#include <utility>

#include <fmt/format.h>

namespace ecx::proxy {

using nlohmann::json;

namespace {

struct MediaKind {
  std::string_view part_type;
  Modality modality;
};
constexpr std::array<MediaKind, 4> kMediaKinds = {{
    {"image_url", Modality::image},
    {"audio_url", Modality::audio},
    {"input_audio", Modality::audio},
    {"video_url", Modality::video},
}};

const json* find_key(const json& object, std::string_view key) {
  if (!object.is_object()) return nullptr;
  const auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

const json& part_of(const json& body, const MediaRef& ref) {
  return body["messages"][ref.message]["content"][ref.part];
}

// A copy of the media item as sent to an engine, with its content id as "uuid".
json item_with_uuid(const json& item, const MediaRef& ref, bool attach_uuid) {
  json copy = item;
  if (attach_uuid) copy["uuid"] = ref.content_id;
  return copy;
}

}  // namespace

std::string content_id(const json& item) {
  if (const json* uuid = find_key(item, "uuid");
      uuid && uuid->is_string() && !uuid->get_ref<const std::string&>().empty()) {
    return uuid->get<std::string>();
  }
  for (const auto key : {"image_url", "audio_url", "video_url"}) {
    const json* field = find_key(item, key);
    if (!field) continue;
    if (field->is_string()) return sha256_hex(field->get_ref<const std::string&>());
    if (const json* url = find_key(*field, "url"); url && url->is_string()) {
      return sha256_hex(url->get_ref<const std::string&>());
    }
  }
  // nlohmann's object type is ordered, so dump() is the canonical sorted-key form.
  return sha256_hex(item.dump());
}

Result<std::vector<MediaRef>> find_media(const json& body) {
  std::vector<MediaRef> media;
  const json* messages = find_key(body, "messages");
  if (!messages) return media;
  if (!messages->is_array()) return invalid_argument("'messages' must be a list");
  for (std::size_t m = 0; m < messages->size(); ++m) {
    const json& message = (*messages)[m];
    if (!message.is_object()) return invalid_argument(fmt::format("messages[{}] must be an object", m));
    const json* content = find_key(message, "content");
    if (!content || !content->is_array()) continue;  // plain text content
    for (std::size_t p = 0; p < content->size(); ++p) {
      const json& part = (*content)[p];
      const json* type = find_key(part, "type");
      if (!type || !type->is_string()) continue;
      for (const auto& kind : kMediaKinds) {
        if (type->get_ref<const std::string&>() == kind.part_type) {
          media.push_back(MediaRef{m, p, kind.modality, content_id(part)});
          break;
        }
      }
    }
  }
  return media;
}

json build_encoder_body(const json& client_body, const std::vector<MediaRef>& media,
                        const std::vector<std::size_t>& items, const std::vector<std::string>& transfer_ids,
                        const std::string& consumer_zmq, bool attach_uuid) {
  json content = json::array();
  json ec_items = json::array();
  for (const auto index : items) {
    content.push_back(item_with_uuid(part_of(client_body, media[index]), media[index], attach_uuid));
    if (index < transfer_ids.size()) ec_items.push_back({{"transfer_id", transfer_ids[index]}});
  }
  json body = {
      {"messages", json::array({json{{"role", "user"}, {"content", std::move(content)}}})},
      {"stream", false},
      {"max_tokens", 1},
  };
  if (const json* model = find_key(client_body, "model")) body["model"] = *model;
  // Copied so the encoder derives the same engine identifier as the consumer.
  for (const auto key : {"mm_processor_kwargs", "media_io_kwargs", "priority", "session_id"}) {
    if (const json* value = find_key(client_body, key)) body[key] = *value;
  }
  if (!consumer_zmq.empty()) {
    body["ec_transfer_params"] = {{"consumer_zmq", consumer_zmq}, {"ec_items", std::move(ec_items)}};
  }
  return body;
}

namespace {

// The item's placeholder metadata and forwarded handle out of a keyed entry.
Result<ItemReport> report_from_entry(const std::string& hash, const json& entry) {
  ItemReport report;
  report.engine_hash = hash;
  report.metadata = json::object();
  if (const json* metadata = find_key(entry, "metadata")) {
    if (!metadata->is_object() && !metadata->is_null()) {
      return protocol_error(fmt::format("ec_transfer_params['{}'].metadata is not an object", hash));
    }
    if (metadata->is_object()) report.metadata = *metadata;
  }
  report.handle = entry;
  report.handle.erase("item_indices");  // positions inside the encoder's sub-request only
  return report;
}

bool is_keyed_entry(const std::string& key, const json& value) { return key != "ec_items" && value.is_object(); }

}  // namespace

Result<std::vector<ItemReport>> read_item_reports(const json& response, const std::vector<MediaRef>& media,
                                                  const std::vector<std::size_t>& items,
                                                  const std::vector<std::string>& transfer_ids) {
  std::vector<ItemReport> reports(items.size(), ItemReport{{}, json::object(), nullptr});
  if (!response.is_object()) return protocol_error("the encoder's response is not a JSON object");
  const json* params = find_key(response, "ec_transfer_params");
  if (!params || params->is_null()) return reports;
  if (!params->is_object()) return protocol_error("the encoder's ec_transfer_params is not an object");

  const json* bindings = find_key(*params, "ec_items");
  if (bindings && !bindings->is_array())
    return protocol_error("the encoder's ec_transfer_params.ec_items is not a list");

  std::vector<std::pair<std::string, const json*>> keyed;
  for (const auto& [key, value] : params->items()) {
    if (is_keyed_entry(key, value)) keyed.emplace_back(key, &value);
  }

  if (keyed.empty()) {
    // List shape: {"ec_items": [{mm_hash, <fields>, transfer_id?}]}, one entry per item.
    if (!bindings) return reports;
    if (bindings->size() > items.size()) {
      return protocol_error(
          fmt::format("the encoder reported {} ec_items for {} item(s)", bindings->size(), items.size()));
    }
    for (std::size_t i = 0; i < bindings->size(); ++i) {
      const json& entry = (*bindings)[i];
      if (!entry.is_object()) return protocol_error("an ec_items entry of the encoder is not an object");
      const json* hash = find_key(entry, "mm_hash");
      if (hash && !hash->is_string()) return protocol_error("an ec_items entry's mm_hash is not a string");
      if (hash) reports[i].engine_hash = hash->get<std::string>();
      for (const auto& [key, value] : entry.items()) {
        if (key != "mm_hash" && key != "transfer_id") reports[i].metadata[key] = value;
      }
    }
    return reports;
  }

  std::vector<bool> assigned(items.size(), false);
  const auto assign = [&](std::size_t slot, const std::string& hash, const json& entry) -> Status {
    if (assigned[slot])
      return protocol_error(fmt::format("two reported entries claim item {} of the sub-request", slot));
    auto report = report_from_entry(hash, entry);
    if (!report) return report.status();
    reports[slot] = std::move(*report);
    assigned[slot] = true;
    return Status::ok();
  };

  for (const auto& [hash, entry] : keyed) {
    if (const json* indices = find_key(*entry, "item_indices"); indices && items.size() > 1) {
      if (!indices->is_array())
        return protocol_error(fmt::format("ec_transfer_params['{}'].item_indices is not a list", hash));
      for (const auto& index : *indices) {
        if (!index.is_number_unsigned() && !(index.is_number_integer() && index.get<long long>() >= 0)) {
          return protocol_error(fmt::format("ec_transfer_params['{}'].item_indices has a non-index value", hash));
        }
        const auto slot = index.get<std::size_t>();
        if (slot >= items.size()) {
          return protocol_error(
              fmt::format("ec_transfer_params['{}'].item_indices names item {} of {}", hash, slot, items.size()));
        }
        ECX_RETURN_IF_ERROR(assign(slot, hash, *entry));
      }
      continue;
    }
    // Without positions: the entry keyed by the item's content id, else the one
    // whose transfer id (or binding) names the item, else — one item — the only entry.
    std::optional<std::size_t> slot;
    for (std::size_t i = 0; i < items.size() && !slot; ++i) {
      if (!assigned[i] && media[items[i]].content_id == hash) slot = i;
    }
    const auto transfer_of = [&](std::size_t i) -> std::string {
      return items[i] < transfer_ids.size() ? transfer_ids[items[i]] : std::string();
    };
    if (!slot) {
      std::string bound_transfer;
      if (const json* id = find_key(*entry, "transfer_id"); id && id->is_string())
        bound_transfer = id->get<std::string>();
      if (bound_transfer.empty() && bindings) {
        for (const auto& binding : *bindings) {
          const json* bhash = find_key(binding, "mm_hash");
          const json* bid = find_key(binding, "transfer_id");
          if (bhash && bid && bhash->is_string() && bid->is_string() && bhash->get_ref<const std::string&>() == hash) {
            bound_transfer = bid->get<std::string>();
            break;
          }
        }
      }
      for (std::size_t i = 0; i < items.size() && !slot && !bound_transfer.empty(); ++i) {
        if (!assigned[i] && transfer_of(i) == bound_transfer) slot = i;
      }
    }
    if (!slot && items.size() == 1 && keyed.size() == 1) slot = 0;
    if (!slot) {
      return protocol_error(
          fmt::format("cannot tell which item the encoder's entry '{}' belongs to ({} entries for {} item(s))", hash,
                      keyed.size(), items.size()));
    }
    ECX_RETURN_IF_ERROR(assign(*slot, hash, *entry));
  }
  return reports;
}

json build_consumer_body(const json& client_body, const std::vector<MediaRef>& media,
                         const std::vector<ItemReport>& reports, const std::vector<std::string>& transfer_ids,
                         bool rewrite, ConsumerBodyStats* stats) {
  json body = client_body;
  ConsumerBodyStats counted;
  const auto can_rewrite = [&](std::size_t i) {
    return rewrite && i < reports.size() && reports[i].metadata.is_object() && !reports[i].metadata.empty();
  };
  bool rewrite_all_allowed = true;
  bool has_audio = false;
  for (std::size_t i = 0; i < media.size(); ++i) {
    has_audio = has_audio || media[i].modality == Modality::audio;
    rewrite_all_allowed = rewrite_all_allowed && can_rewrite(i);
  }
  // Audio placeholders depend on every item of the request: all or nothing.
  const bool keep_all_raw = has_audio && !rewrite_all_allowed;
  for (std::size_t i = 0; i < media.size(); ++i) {
    json& part = body["messages"][media[i].message]["content"][media[i].part];
    if (can_rewrite(i) && !keep_all_raw) {
      const std::string type = fmt::format("{}_embeds", modality_name(media[i].modality));
      part = json{{"type", type}, {type, reports[i].metadata}, {"uuid", media[i].content_id}};
      ++counted.rewritten;
    } else {
      if (rewrite) part["uuid"] = media[i].content_id;  // the same identifier the encoder derived
      ++(i < reports.size() && reports[i].from_store ? counted.from_store : counted.raw);
    }
  }
  if (!media.empty()) {
    json params = json::object();
    if (const json* own = find_key(client_body, "ec_transfer_params"); own && own->is_object()) params = *own;
    json ec_items = json::array();
    bool any_binding = false;
    for (std::size_t i = 0; i < media.size(); ++i) {
      json binding = json::object();
      const bool from_store = i < reports.size() && reports[i].from_store;
      if (i < reports.size() && !reports[i].engine_hash.empty()) {
        binding["mm_hash"] = reports[i].engine_hash;
        if (!reports[i].handle.is_null()) params[reports[i].engine_hash] = reports[i].handle;
      }
      if (from_store) {
        binding["store"] = true;  // nothing is pushed for it: no transfer id
      } else if (i < transfer_ids.size()) {
        binding["transfer_id"] = transfer_ids[i];
      }
      any_binding = any_binding || !binding.empty();
      ec_items.push_back(std::move(binding));
    }
    if (any_binding) params["ec_items"] = std::move(ec_items);
    if (!params.empty()) body["ec_transfer_params"] = std::move(params);
  }
  if (stats) *stats = counted;
  return body;
}

json build_prefill_body(const json& consumer_body) {
  json body = consumer_body;
  body["kv_transfer_params"] = {
      {"do_remote_decode", true},    {"do_remote_prefill", false}, {"remote_engine_id", nullptr},
      {"remote_block_ids", nullptr}, {"remote_host", nullptr},     {"remote_port", nullptr},
  };
  body["stream"] = false;
  body["max_tokens"] = 1;
  if (body.contains("max_completion_tokens")) body["max_completion_tokens"] = 1;
  body.erase("stream_options");
  return body;
}

Result<json> build_decode_body_after_prefill(const json& consumer_body, const json& prefill_response) {
  const json* params = find_key(prefill_response, "kv_transfer_params");
  if (!params || !params->is_object()) {
    return protocol_error("the prefill's response has no kv_transfer_params object");
  }
  json body = consumer_body;
  body["kv_transfer_params"] = *params;
  return body;
}

}  // namespace ecx::proxy
