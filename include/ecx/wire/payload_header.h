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

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ecx/core/ids.h"
#include "ecx/core/status.h"

namespace ecx::wire {

inline constexpr std::uint8_t kPayloadHeaderVersion = 1;
inline constexpr std::size_t kPayloadHeaderFixedBytes = 48;

struct PayloadHeader {
  std::string transfer_id;
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  std::uint64_t nbytes = 0;
  std::optional<std::uint64_t> checksum;
  friend bool operator==(const PayloadHeader&, const PayloadHeader&) = default;
};

std::vector<std::byte> encode_payload_header(const PayloadHeader& header);
// Strict: wrong magic, version, length or an invalid transfer id is a protocol error.
Result<PayloadHeader> decode_payload_header(std::span<const std::byte> bytes);

}  // namespace ecx::wire
