#include "ecx/wire/payload_header.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include <fmt/format.h>

#include "core/byte_order.h"

namespace ecx::wire {
namespace {

constexpr std::uint8_t kMagic[4] = {'E', 'C', 'X', 'P'};
constexpr std::uint8_t kFlagChecksum = 1;
constexpr std::uint8_t kFlagDirect = 2;

using byte_order::get_le;
using byte_order::put_le;

std::size_t direct_bytes(const DirectItem& d) { return 2 + d.mm_hash.size() + 2 + 8 * d.spec.shape().size(); }

void put_direct(std::byte* at, const DirectItem& d) {
  put_le(at, static_cast<std::uint16_t>(d.mm_hash.size()));
  std::memcpy(at + 2, d.mm_hash.data(), d.mm_hash.size());
  at += 2 + d.mm_hash.size();
  const auto dtypes = all_dtypes();
  at[0] = static_cast<std::byte>(std::find(dtypes.begin(), dtypes.end(), d.spec.dtype()) - dtypes.begin());
  at[1] = static_cast<std::byte>(d.spec.shape().size());
  at += 2;
  for (const std::int64_t dim : d.spec.shape()) {
    put_le(at, static_cast<std::uint64_t>(dim));
    at += 8;
  }
}

// The direct part after the transfer id, which must fill `bytes` exactly.
Result<DirectItem> get_direct(std::span<const std::byte> bytes, std::uint64_t nbytes) {
  auto truncated = [] { return protocol_error("payload header: the direct item is truncated"); };
  if (bytes.size() < 2) return truncated();
  const std::size_t hash_len = get_le<std::uint16_t>(bytes.data());
  if (bytes.size() < 2 + hash_len + 2) return truncated();
  std::string mm_hash(reinterpret_cast<const char*>(bytes.data() + 2), hash_len);
  if (auto s = validate_mm_hash(mm_hash); !s) return protocol_error("payload header: " + s.message());
  const std::byte* at = bytes.data() + 2 + hash_len;
  const auto dtype_index = static_cast<std::size_t>(at[0]);
  const auto rank = static_cast<std::size_t>(at[1]);
  const auto dtypes = all_dtypes();
  if (dtype_index >= dtypes.size()) return protocol_error("payload header: the direct item has an unknown dtype");
  if (bytes.size() != 2 + hash_len + 2 + 8 * rank) {
    return protocol_error(fmt::format("payload header: a direct item of rank {} does not fill its {} bytes", rank,
                                      bytes.size() - 2 - hash_len - 2));
  }
  at += 2;
  std::array<std::int64_t, kMaxTensorRank> shape{};
  if (rank > shape.size()) {
    return protocol_error(
        fmt::format("payload header: direct item: shape must have rank 1..{}, got rank {}", kMaxTensorRank, rank));
  }
  for (std::size_t i = 0; i < rank; ++i, at += 8) {
    const std::uint64_t dim = get_le<std::uint64_t>(at);
    if (dim > static_cast<std::uint64_t>(INT64_MAX)) return protocol_error("payload header: a dimension overflows");
    shape.at(i) = static_cast<std::int64_t>(dim);
  }
  auto spec = TensorSpec::make(std::span<const std::int64_t>(shape.data(), rank), dtypes[dtype_index], nbytes);
  if (!spec) return protocol_error("payload header: direct item: " + spec.status().message());
  if (spec->nbytes() != nbytes) {
    return protocol_error(
        fmt::format("payload header: the direct item's {} is not the payload's {} bytes", spec->to_string(), nbytes));
  }
  return DirectItem{std::move(mm_hash), *std::move(spec)};
}

}  // namespace

std::vector<std::byte> encode_payload_header(const PayloadHeader& h) {
  std::vector<std::byte> out(kPayloadHeaderFixedBytes + h.transfer_id.size() +
                             (h.direct ? direct_bytes(*h.direct) : 0));
  std::memcpy(out.data(), kMagic, 4);
  out[4] = static_cast<std::byte>(kPayloadHeaderVersion);
  out[5] = static_cast<std::byte>((h.checksum ? kFlagChecksum : 0) | (h.direct ? kFlagDirect : 0));
  put_le(out.data() + 6, static_cast<std::uint16_t>(h.transfer_id.size()));
  put_le<std::uint64_t>(out.data() + 8, h.reservation_id.hi());
  put_le<std::uint64_t>(out.data() + 16, h.reservation_id.lo());
  put_le<std::uint64_t>(out.data() + 24, h.generation);
  put_le<std::uint64_t>(out.data() + 32, h.nbytes);
  put_le<std::uint64_t>(out.data() + 40, h.checksum.value_or(0));
  std::memcpy(out.data() + kPayloadHeaderFixedBytes, h.transfer_id.data(), h.transfer_id.size());
  if (h.direct) put_direct(out.data() + kPayloadHeaderFixedBytes + h.transfer_id.size(), *h.direct);
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
  if ((flags & ~(kFlagChecksum | kFlagDirect)) != 0) return protocol_error("payload header has unknown flags");
  const bool direct = (flags & kFlagDirect) != 0;
  const std::size_t len = get_le<std::uint16_t>(bytes.data() + 6);
  if (direct ? bytes.size() < kPayloadHeaderFixedBytes + len : bytes.size() != kPayloadHeaderFixedBytes + len) {
    return protocol_error(fmt::format("payload header declares a {}-byte transfer id but carries {} bytes", len,
                                      bytes.size() - kPayloadHeaderFixedBytes));
  }
  PayloadHeader h;
  h.transfer_id.assign(reinterpret_cast<const char*>(bytes.data() + kPayloadHeaderFixedBytes), len);
  if (auto s = validate_transfer_id(h.transfer_id); !s) return protocol_error("payload header: " + s.message());
  h.reservation_id = ReservationId(get_le<std::uint64_t>(bytes.data() + 8), get_le<std::uint64_t>(bytes.data() + 16));
  h.generation = get_le<std::uint64_t>(bytes.data() + 24);
  h.nbytes = get_le<std::uint64_t>(bytes.data() + 32);
  if (flags & kFlagChecksum) h.checksum = get_le<std::uint64_t>(bytes.data() + 40);
  if (direct) {
    if (!h.reservation_id.is_none() || h.generation != 0) {
      return protocol_error("payload header: a direct payload names a reservation");
    }
    auto item = get_direct(bytes.subspan(kPayloadHeaderFixedBytes + len), h.nbytes);
    if (!item) return item.status();
    h.direct = *std::move(item);
  }
  return h;
}

}  // namespace ecx::wire
