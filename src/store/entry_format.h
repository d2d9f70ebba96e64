#pragma once
// The bytes of one stored entry: a fixed little-endian header, the model identity,
// the shape, then the payload. The header repeats what the key already says (the
// model) so that a value copied under the wrong key is still refused.
//
//   0  "ECXE"       4  u16 version (1)   6  u8 dtype   7  u8 rank
//   8  u64 nbytes   16 u64 xxHash64 of the payload     24 u16 model length
//   26 model bytes, then rank x i64 dims, then nbytes of payload

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"
#include "ecx/store/embedding_store.h"

namespace ecx::store::detail {

inline constexpr std::uint16_t kEntryVersion = 1;

// The header for `spec` and `checksum` under `model` (the payload follows it).
std::string encode_entry_header(std::string_view model, const TensorSpec& spec, std::uint64_t checksum);

struct DecodedHeader {
  TensorSpec spec;
  std::uint64_t checksum = 0;
  std::size_t header_bytes = 0;  // where the payload starts
};

// Checks magic, version, model, dtype, shape and that exactly nbytes of payload
// follow; protocol_error naming what is wrong otherwise.
Result<DecodedHeader> decode_entry_header(std::string_view value, std::string_view model, std::uint64_t max_nbytes);

// What every backend does with a value it read, before a byte reaches the caller:
// the header checked, then the payload's checksum (protocol_error: refuse the entry),
// then `land(spec)` asked for the buffer, which must be exactly the payload's size.
Result<Entry> check_and_land(std::string_view value, std::string_view model, std::uint64_t max_nbytes,
                             std::string_view mm_hash, const EmbeddingStore::Landing& land, bool& refused);

// The header of a new entry for `payload` (its checksum computed here), after checking
// that the payload is spec's size and within max_nbytes.
Result<std::string> header_for(std::string_view model, const TensorSpec& spec, std::span<const std::byte> payload,
                               std::uint64_t max_nbytes);

}  // namespace ecx::store::detail
