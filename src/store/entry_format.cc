#include "store/entry_format.h"

#include <cstring>

#include <xxhash.h>

#include <fmt/format.h>

#include "ecx/core/dtype.h"

namespace ecx::store::detail {
namespace {

constexpr char kMagic[4] = {'E', 'C', 'X', 'E'};
constexpr std::size_t kFixedBytes = 26;

template <typename T>
void put(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // the hosts we run on are little-endian
  out.append(bytes, sizeof(T));
}

template <typename T>
T get(std::string_view in, std::size_t at) {
  T value;
  std::memcpy(&value, in.data() + at, sizeof(T));
  return value;
}

}  // namespace

std::string encode_entry_header(std::string_view model, const TensorSpec& spec, std::uint64_t checksum) {
  std::string out;
  out.reserve(kFixedBytes + model.size() + spec.shape().size() * sizeof(std::int64_t));
  out.append(kMagic, sizeof(kMagic));
  put<std::uint16_t>(out, kEntryVersion);
  put<std::uint8_t>(out, static_cast<std::uint8_t>(spec.dtype()));
  put<std::uint8_t>(out, static_cast<std::uint8_t>(spec.shape().size()));
  put<std::uint64_t>(out, spec.nbytes());
  put<std::uint64_t>(out, checksum);
  put<std::uint16_t>(out, static_cast<std::uint16_t>(model.size()));
  out.append(model);
  for (std::int64_t d : spec.shape()) put<std::int64_t>(out, d);
  return out;
}

Result<DecodedHeader> decode_entry_header(std::string_view value, std::string_view model, std::uint64_t max_nbytes) {
  if (value.size() < kFixedBytes) {
    return protocol_error(
        fmt::format("entry of {} bytes is shorter than its {}-byte header", value.size(), kFixedBytes));
  }
  if (std::memcmp(value.data(), kMagic, sizeof(kMagic)) != 0) return protocol_error("entry does not start with ECXE");
  if (const auto version = get<std::uint16_t>(value, 4); version != kEntryVersion) {
    return protocol_error(fmt::format("entry version {} (this build reads {})", version, kEntryVersion));
  }
  const auto dtype_code = get<std::uint8_t>(value, 6);
  const auto rank = get<std::uint8_t>(value, 7);
  const auto nbytes = get<std::uint64_t>(value, 8);
  const auto checksum = get<std::uint64_t>(value, 16);
  const auto model_len = get<std::uint16_t>(value, 24);
  if (dtype_code >= all_dtypes().size())
    return protocol_error(fmt::format("entry dtype code {} is unknown", dtype_code));
  if (rank == 0 || rank > kMaxTensorRank) return protocol_error(fmt::format("entry rank {} is outside 1..8", rank));
  const std::size_t header_bytes = kFixedBytes + model_len + std::size_t{rank} * sizeof(std::int64_t);
  if (value.size() < header_bytes) return protocol_error("entry is truncated inside its header");
  if (value.substr(kFixedBytes, model_len) != model) {
    return protocol_error(
        fmt::format("entry was written for model '{}', not '{}'", value.substr(kFixedBytes, model_len), model));
  }
  std::vector<std::int64_t> shape(rank);
  for (std::size_t i = 0; i < rank; ++i) {
    shape[i] = get<std::int64_t>(value, kFixedBytes + model_len + i * sizeof(std::int64_t));
  }
  auto spec = TensorSpec::make(shape, all_dtypes()[dtype_code], max_nbytes);
  if (!spec) return protocol_error("entry shape is invalid: " + spec.status().message());
  if (spec->nbytes() != nbytes) {
    return protocol_error(fmt::format("entry says {} bytes but its shape makes {}", nbytes, spec->nbytes()));
  }
  if (value.size() - header_bytes != nbytes) {
    return protocol_error(fmt::format("entry holds {} payload bytes, its header says {} (truncated)",
                                      value.size() - header_bytes, nbytes));
  }
  return DecodedHeader{*spec, checksum, header_bytes};
}

Result<Entry> check_and_land(std::string_view value, std::string_view model, std::uint64_t max_nbytes,
                             std::string_view mm_hash, const EmbeddingStore::Landing& land, bool& refused) {
  refused = false;
  auto header = decode_entry_header(value, model, max_nbytes);
  if (!header) {
    refused = true;
    return header.status();
  }
  const std::string_view payload = value.substr(header->header_bytes);
  if (XXH64(payload.data(), payload.size(), 0) != header->checksum) {
    refused = true;
    return protocol_error("entry payload does not match its checksum");
  }
  auto out = land(header->spec);
  if (!out) return out.status();
  if (out->size() != payload.size()) {
    return invalid_argument(
        fmt::format("the landing for {} has {} bytes, the entry {}", mm_hash, out->size(), payload.size()));
  }
  std::memcpy(out->data(), payload.data(), payload.size());
  return Entry{header->spec, header->checksum};
}

Result<std::string> header_for(std::string_view model, const TensorSpec& spec, std::span<const std::byte> payload,
                               std::uint64_t max_nbytes) {
  if (payload.size() != spec.nbytes()) {
    return invalid_argument(fmt::format("payload of {} bytes for {}", payload.size(), spec.to_string()));
  }
  if (spec.nbytes() > max_nbytes) {
    return invalid_argument(fmt::format("{} is larger than max_entry_bytes {}", spec.to_string(), max_nbytes));
  }
  return encode_entry_header(model, spec, XXH64(payload.data(), payload.size(), 0));
}

}  // namespace ecx::store::detail
