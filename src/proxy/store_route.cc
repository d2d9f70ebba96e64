#include "store_route.h"

#include <utility>

namespace ecx::proxy {

using nlohmann::json;

namespace {

void replace_all(std::string& text, std::string_view from, std::string_view to) {
  for (auto at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
}

}  // namespace

Config store_config(const ProxyOptions& options) {
  Config config;
  config.store_url = options.store_url;
  config.store_prefix = options.store_prefix;
  config.store_model = options.store_model;
  config.store_ttl_s = duration_to_seconds(options.store_ttl);
  config.store_io_timeout_s = duration_to_seconds(options.store_io_timeout);
  config.store_presence_max = options.store_presence_max;
  return config;
}

Status with_store_flag_names(const Status& status) {
  if (status) return status;
  std::string message = status.message();
  replace_all(message, "ec_connector_extra_config.store_prefix / store_model", "--store-prefix / --store-model");
  replace_all(message, "ec_connector_extra_config.store_url", "--store-url");
  return Status(status.code(), std::move(message));
}

std::string learned_key(const json& client_body, const MediaRef& item) {
  const auto field = [&](const char* name) -> json {
    if (!client_body.is_object()) return nullptr;
    const auto it = client_body.find(name);
    return it == client_body.end() ? json(nullptr) : *it;
  };
  // nlohmann's objects keep their keys sorted, so equal kwargs dump equally.
  const json identity =
      json::array({item.content_id, field("model"), field("mm_processor_kwargs"), field("media_io_kwargs")});
  return sha256_hex(identity.dump());
}

LearnedHashes::LearnedHashes(std::size_t max_entries) : max_entries_(max_entries < 1 ? 1 : max_entries) {}

void LearnedHashes::learn(const std::string& key, const std::string& engine_hash) {
  if (auto it = entries_.find(key); it != entries_.end()) {
    it->second.engine_hash = engine_hash;
    order_.splice(order_.end(), order_, it->second.place);
    return;
  }
  while (entries_.size() >= max_entries_) {
    entries_.erase(order_.front());
    order_.pop_front();
    ++forgotten_;
  }
  order_.push_back(key);
  entries_.emplace(key, Learned{engine_hash, std::prev(order_.end())});
}

const std::string* LearnedHashes::find(const std::string& key) const {
  const auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : &it->second.engine_hash;
}

StorePlan encode_everything(const std::vector<MediaRef>& media) {
  StorePlan plan;
  plan.store_hashes.assign(media.size(), std::string());
  for (std::size_t i = 0; i < media.size(); ++i) plan.to_encode.push_back(i);
  return plan;
}

StoreRoute::StoreRoute(std::unique_ptr<store::PresenceIndex> index, std::size_t learned_max)
    : index_(std::move(index)), learned_(learned_max) {}

StorePlan StoreRoute::plan(const json& client_body, const std::vector<MediaRef>& media) {
  StorePlan plan = encode_everything(media);
  if (media.empty()) return plan;
  for (const auto& item : media) {
    if (item.modality != Modality::image) return plan;
  }
  plan.checked = true;
  plan.to_encode.clear();
  for (std::size_t i = 0; i < media.size(); ++i) {
    const std::string* hash = learned_.find(learned_key(client_body, media[i]));
    if (!hash) {
      ++plan.unknown;
      plan.to_encode.push_back(i);
    } else if (index_->present(*hash)) {  // never waits: an unknown hash is confirmed off-thread
      ++plan.hits;
      plan.store_hashes[i] = *hash;
    } else {
      ++plan.misses;
      plan.to_encode.push_back(i);
    }
  }
  return plan;
}

void StoreRoute::learn(const json& client_body, const std::vector<MediaRef>& media,
                       const std::vector<std::size_t>& encoded, const std::vector<ItemReport>& reports) {
  for (const auto i : encoded) {
    if (i >= media.size() || i >= reports.size() || media[i].modality != Modality::image) continue;
    if (reports[i].engine_hash.empty()) continue;
    learned_.learn(learned_key(client_body, media[i]), reports[i].engine_hash);
  }
}

ItemReport store_item_report(const std::string& engine_hash) {
  ItemReport report;
  report.engine_hash = engine_hash;
  report.metadata = json::object();
  report.handle = nullptr;
  report.from_store = true;
  return report;
}

}  // namespace ecx::proxy
