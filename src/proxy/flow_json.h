#pragma once
// The JSON side of the proxy's request planning: which media items a chat request
// carries, what each encoder is sent, how the encoders' answers are read, and the
// bodies the prefill and decode hops receive. Every builder returns a fresh JSON value;
// the client's body is never modified. Private to the proxy: the public header
// (ecx/proxy/flow.h) exposes no JSON type.

#include <cstddef>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ecx/core/status.h"
#include "ecx/proxy/flow.h"

namespace ecx::proxy {

// The item's cache key (MediaRef::content_id).
std::string content_id(const nlohmann::json& item);

// Returns the media items; an error when "messages" is present but malformed.
Result<std::vector<MediaRef>> find_media(const nlohmann::json& body);

// The body of one encoder sub-request: only these items, "stream": false,
// "max_tokens": 1, the request's processor/IO kwargs, priority and session id, and
// — when `consumer_zmq` is not empty — ec_transfer_params {consumer_zmq, ec_items:
// [{transfer_id}]} (no mm_hash: the engine matches them by position).
// `attach_uuid` adds each item's content id as its "uuid".
nlohmann::json build_encoder_body(const nlohmann::json& client_body, const std::vector<MediaRef>& media,
                                  const std::vector<std::size_t>& items, const std::vector<std::string>& transfer_ids,
                                  const std::string& consumer_zmq, bool attach_uuid);

// What an encoder reported for one item.
struct ItemReport {
  std::string engine_hash;  // the engine's identifier for the item; empty when not reported
  nlohmann::json metadata;  // placeholder fields (object); empty object when none
  nlohmann::json handle;    // the producer's entry, forwarded to the consumer under engine_hash; null if none
  bool from_store = false;  // not encoded: the consumer loads engine_hash from the shared store
};

// Reads an encoder response's ec_transfer_params for the items of one sub-request.
// Accepts the keyed shape {<hash>: {"metadata", "item_indices"?, ...}, "ec_items"?}
// and the list shape {"ec_items": [{mm_hash, <fields>}]}. A response without
// ec_transfer_params yields empty reports (the item is forwarded raw); a malformed
// or unattributable one is a protocol error (the proxy answers 502).
Result<std::vector<ItemReport>> read_item_reports(const nlohmann::json& response, const std::vector<MediaRef>& media,
                                                  const std::vector<std::size_t>& items,
                                                  const std::vector<std::string>& transfer_ids);

// The body for the consumer (prefill, or decode/PD when there is no prefill): media
// rewritten into "<modality>_embeds" parts when `rewrite` and metadata allow (all raw
// when the request has audio and any item cannot be rewritten), and
// ec_transfer_params = the client's own, plus each reported handle under its engine
// hash, plus ec_items [{mm_hash?, transfer_id?}] in item order; an item the consumer
// loads from the store (ItemReport::from_store) stays raw and is bound as
// {mm_hash, "store": true}, without a transfer id. `transfer_ids` is empty when no
// consumer address is known.
nlohmann::json build_consumer_body(const nlohmann::json& client_body, const std::vector<MediaRef>& media,
                                   const std::vector<ItemReport>& reports, const std::vector<std::string>& transfer_ids,
                                   bool rewrite, ConsumerBodyStats* stats = nullptr);

// The prefill hop of E+P+D: kv_transfer_params asking for a remote decode,
// "stream": false, one token, no stream_options.
nlohmann::json build_prefill_body(const nlohmann::json& consumer_body);
// The decode body after a prefill: the consumer body with the kv_transfer_params the
// prefill returned (a protocol error when the prefill returned none).
Result<nlohmann::json> build_decode_body_after_prefill(const nlohmann::json& consumer_body,
                                                       const nlohmann::json& prefill_response);

}  // namespace ecx::proxy
