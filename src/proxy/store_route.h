#pragma once
// Skipping the encoder hop for images the encoders' shared store already holds (the
// cross-encoder cache). The proxy cannot compute the engine's identifier of an item
// (vLLM hashes the item's uuid together with the processor and IO kwargs), so it
// learns it: every encoder answer names each item's engine hash, remembered per
// (item, request kwargs). A later request for the same item asks the presence index
// (never the network) whether the store holds that hash; if it does, the consumer
// gets the raw item marked `store: true` and loads the output itself — or encodes it
// locally when the load fails, so a wrong answer costs time, never a request.
// Private to the proxy.

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "ecx/core/config.h"
#include "ecx/core/status.h"
#include "ecx/proxy/flow.h"
#include "ecx/proxy/options.h"
#include "ecx/store/presence_index.h"
#include "flow_json.h"

namespace ecx::proxy {

// The ecx::Config naming the options' store: what store::open_presence_index reads.
Config store_config(const ProxyOptions& options);
// A store error with the configuration's key names (ec_connector_extra_config.store_*)
// replaced by the proxy's flags (--store-*), so an operator knows what to fix.
Status with_store_flag_names(const Status& status);

// The learned map's key for one item: SHA-256 of its content id with the request
// fields that can change the engine's hash and that the encoder sub-request forwards
// ("model", "mm_processor_kwargs", "media_io_kwargs").
std::string learned_key(const nlohmann::json& client_body, const MediaRef& item);

// Engine hashes reported by the encoders, by learned_key. Bounded: beyond max_entries
// the least recently learned is forgotten (counted). Not thread-safe: the proxy uses
// it on its I/O thread only.
class LearnedHashes {
 public:
  explicit LearnedHashes(std::size_t max_entries);
  void learn(const std::string& key, const std::string& engine_hash);
  const std::string* find(const std::string& key) const;  // nullptr when not learned
  std::size_t size() const { return entries_.size(); }
  std::uint64_t forgotten() const { return forgotten_; }

 private:
  struct Learned {
    std::string engine_hash;
    std::list<std::string>::iterator place;  // in order_
  };
  const std::size_t max_entries_;
  std::unordered_map<std::string, Learned> entries_;
  std::list<std::string> order_;  // least recently learned first
  std::uint64_t forgotten_ = 0;
};

// Which items of one request the consumer loads from the store, which the encoders get.
struct StorePlan {
  std::vector<std::string> store_hashes;  // per media item: its engine hash when it is in the store, else empty
  std::vector<std::size_t> to_encode;     // the other items, in order
  bool checked = false;                   // store on and every item an image: the store was asked
  std::size_t hits = 0;                   // items whose learned hash the store holds
  std::size_t misses = 0;                 // learned hash, not in the store
  std::size_t unknown = 0;                // no learned hash yet
  // Every item is in the store: no encoder is called.
  bool skips_encoders() const { return checked && !store_hashes.empty() && to_encode.empty(); }
};

// Every item to the encoders (the store is off or not asked).
StorePlan encode_everything(const std::vector<MediaRef>& media);

class StoreRoute {
 public:
  StoreRoute(std::unique_ptr<store::PresenceIndex> index, std::size_t learned_max);

  // Only requests whose media are all images are checked (audio and video items are
  // always encoded, with their placeholders computed by the encoder).
  StorePlan plan(const nlohmann::json& client_body, const std::vector<MediaRef>& media);
  // Remembers the engine hash each encoded image's report names.
  void learn(const nlohmann::json& client_body, const std::vector<MediaRef>& media,
             const std::vector<std::size_t>& encoded, const std::vector<ItemReport>& reports);

  const LearnedHashes& learned() const { return learned_; }
  store::PresenceIndex& index() { return *index_; }

 private:
  const std::unique_ptr<store::PresenceIndex> index_;
  LearnedHashes learned_;
};

// The consumer's report for an item it loads from the store: its engine hash, no
// metadata (the item stays raw) and no handle.
ItemReport store_item_report(const std::string& engine_hash);

}  // namespace ecx::proxy
