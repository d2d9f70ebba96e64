#pragma once
// The header that travels with every data-plane payload (docs/protocol.md, "Payload
// header"). The consumer's landing resolver reads it to decide, before any payload
// byte is written, whether the payload belongs to a live reservation and where it goes.
//
// Layout, little-endian, 48 bytes then the transfer id:
//   0  magic "ECXP"            4  version (u8) = 1       5  flags (u8): bit 0 = checksum present
//   6  transfer_id length (u16)
//   8  reservation id, high 64 bits   16 reservation id, low 64 bits
//   24 generation (u64)        32 payload bytes (u64)   40 xxHash64 of the payload (u64, 0 when absent)
//   48 transfer_id (UTF-8, 1..256 bytes)
// With flag bit 1 (direct: a small payload sent without a reservation; the receiver
// reserves for it on arrival, docs/protocol.md "Direct payloads"), then:
//      mm_hash length (u16), mm_hash (UTF-8), dtype (u8, its index in all_dtypes()),
//      rank (u8), each dimension (u64)
// and the reservation id and generation are zero.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ecx/core/ids.h"
#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"

namespace ecx::wire {

inline constexpr std::uint8_t kPayloadHeaderVersion = 1;
inline constexpr std::size_t kPayloadHeaderFixedBytes = 48;

// What a direct payload tells the receiver in place of a reservation.
struct DirectItem {
  std::string mm_hash;
  TensorSpec spec;
  friend bool operator==(const DirectItem&, const DirectItem&) = default;
};

struct PayloadHeader {
  std::string transfer_id;
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  std::uint64_t nbytes = 0;
  std::optional<std::uint64_t> checksum;
  std::optional<DirectItem> direct = std::nullopt;  // its spec's size is `nbytes`
  friend bool operator==(const PayloadHeader&, const PayloadHeader&) = default;
};

std::vector<std::byte> encode_payload_header(const PayloadHeader& header);
// Strict: wrong magic, version, length or an invalid transfer id is a protocol error.
Result<PayloadHeader> decode_payload_header(std::span<const std::byte> bytes);

}  // namespace ecx::wire
