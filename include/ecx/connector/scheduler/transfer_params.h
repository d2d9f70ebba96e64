#pragma once
// ec_transfer_params: the per-request routing a proxy attaches to a request,
//   {"consumer_zmq": "tcp://host:port",
//    "ec_items": [{"mm_hash"?: ..., "transfer_id"?: ..., "store"?: true}, ...]}
// An entry with "store": true names no transfer: the proxy found the item in the
// shared store (cross-encoder cache) and skipped its encoder, so the consumer loads it
// from the store, or encodes it itself when it cannot.
// Parsed strictly: a wrong type or an invalid id makes the whole value malformed
// (the request then fails as unavailable); unknown keys are tolerated because
// proxies add their own per-item handles next to these fields.

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/core/status.h"

namespace ecx::scheduler {

inline constexpr std::size_t kMaxEcItems = 4096;
inline constexpr std::size_t kMaxAddressLength = 512;

struct EcItem {
  std::optional<std::string> mm_hash;      // absent = match by position
  std::optional<std::string> transfer_id;  // absent = this entry names no transfer
  bool from_store = false;                 // "store": true (then transfer_id is absent)
};

struct EcTransferParams {
  std::string consumer_zmq;  // "" = none (the producer then plans no push)
  std::vector<EcItem> items;
};

// From JSON text, which must hold an object; a syntax error is a malformed value,
// not an exception. (Callers holding a parsed value use the private
// scheduler/transfer_params_json.h.)
Result<EcTransferParams> parse_ec_transfer_params_text(std::string_view json_text);

// The transfer id of feature `index` whose engine identifier is `identifier`:
// ec_items[index] when its mm_hash is absent or equal and it names a transfer
// (positional match), else the first entry whose mm_hash equals the identifier
// and names a transfer, else none.
std::optional<std::string_view> resolve_transfer_id(const EcTransferParams* params, std::size_t index,
                                                    std::string_view identifier);

// Whether feature `index` is to come from the shared store: ec_items[index] when its
// mm_hash is absent or equal says "store": true, or an entry whose mm_hash equals the
// identifier does.
bool is_store_item(const EcTransferParams* params, std::size_t index, std::string_view identifier);

}  // namespace ecx::scheduler
