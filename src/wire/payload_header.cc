#include "ecx/wire/payload_header.h"

#include <cstring>

#include <fmt/format.h>

namespace ecx::wire {
namespace {

constexpr std::uint8_t kMagic[4] = {'E', 'C', 'X', 'P'};
constexpr std::uint8_t kFlagChecksum = 1;

void put_u64(std::byte* at, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) at[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

std::uint64_t get_u64(const std::byte* at) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<std::uint64_t>(at[i]);
  return v;
}

}  // namespace

std::vector<std::byte> encode_payload_header(const PayloadHeader& h) {
  std::vector<std::byte> out(kPayloadHeaderFixedBytes + h.transfer_id.size());
  std::memcpy(out.data(), kMagic, 4);
  out[4] = static_cast<std::byte>(kPayloadHeaderVersion);
  out[5] = static_cast<std::byte>(h.checksum ? kFlagChecksum : 0);
  const auto len = static_cast<std::uint16_t>(h.transfer_id.size());
  out[6] = static_cast<std::byte>(len & 0xff);
  out[7] = static_cast<std::byte>(len >> 8);
  put_u64(out.data() + 8, h.reservation_id.hi());
  put_u64(out.data() + 16, h.reservation_id.lo());
  put_u64(out.data() + 24, h.generation);
  put_u64(out.data() + 32, h.nbytes);
  put_u64(out.data() + 40, h.checksum.value_or(0));
  std::memcpy(out.data() + kPayloadHeaderFixedBytes, h.transfer_id.data(), h.transfer_id.size());
  return out;
}

Result<PayloadHeader> decode_payload_header(std::span<const std::byte> bytes) {
  if (bytes.size() < kPayloadHeaderFixedBytes) {
    return protocol_error(
        fmt::format("payload header of {} bytes is shorter than {}", bytes.size(), kPayloadHeaderFixedBytes));
  }
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) return protocol_error("payload header has a wrong magic");
  const auto version = static_cast<std::uint8_t>(bytes[4]);
  if (version != kPayloadHeaderVersion) {
    return protocol_error(fmt::format("payload header version {} is not supported (this side speaks {})", version,
                                      kPayloadHeaderVersion));
  }
  const auto flags = static_cast<std::uint8_t>(bytes[5]);
  if ((flags & ~kFlagChecksum) != 0) return protocol_error("payload header has unknown flags");
  const std::size_t len = static_cast<std::size_t>(bytes[6]) | (static_cast<std::size_t>(bytes[7]) << 8);
  if (bytes.size() != kPayloadHeaderFixedBytes + len) {
    return protocol_error(fmt::format("payload header declares a {}-byte transfer id but carries {} bytes", len,
                                      bytes.size() - kPayloadHeaderFixedBytes));
  }
  PayloadHeader h;
  h.transfer_id.assign(reinterpret_cast<const char*>(bytes.data() + kPayloadHeaderFixedBytes), len);
  if (auto s = validate_transfer_id(h.transfer_id); !s) return protocol_error("payload header: " + s.message());
  h.reservation_id = ReservationId(get_u64(bytes.data() + 8), get_u64(bytes.data() + 16));
  h.generation = get_u64(bytes.data() + 24);
  h.nbytes = get_u64(bytes.data() + 32);
  if (flags & kFlagChecksum) h.checksum = get_u64(bytes.data() + 40);
  return h;
}

}  // namespace ecx::wire
