#pragma once
// Builders shared by the wire tests.

#include <string>
#include <vector>

#include <variant>
#include <vector>

#include <msgpack.hpp>

#include "ecx/core/dtype.h"
#include "ecx/core/tensor_spec.h"
#include "ecx/wire/messages.h"

namespace ecx::wire::testing {

inline TensorSpec spec(std::vector<std::int64_t> shape, DType dtype = DType::bfloat16) {
  return TensorSpec::make(std::move(shape), dtype, 1ULL << 40).value();
}

inline ReserveItem item(std::string transfer_id, std::string mm_hash = "hash-1",
                        std::vector<std::int64_t> shape = {16, 64}) {
  return ReserveItem{std::move(transfer_id), std::move(mm_hash), spec(std::move(shape)), std::nullopt};
}

// A msgpack map written by hand, for frames the encoder would never produce.
class RawMap {
 public:
  explicit RawMap(std::uint32_t entries) : packer_(buffer_) { packer_.pack_map(entries); }
  template <typename T>
  RawMap& kv(const std::string& key, const T& value) {
    packer_.pack(key);
    packer_.pack(value);
    return *this;
  }
  msgpack::packer<msgpack::sbuffer>& packer() { return packer_; }
  std::string str() const { return std::string(buffer_.data(), buffer_.size()); }

 private:
  msgpack::sbuffer buffer_;
  msgpack::packer<msgpack::sbuffer> packer_;
};

// A cancel_batch request whose items carry only a transfer_id each: a string, or an
// integer for an item that cannot decode.
inline std::string cancel_batch_frame(std::uint64_t id,
                                      const std::vector<std::variant<std::string, int>>& transfer_ids) {
  RawMap top(4);
  top.kv("v", 1).kv("id", id).kv("op", std::string("cancel_batch"));
  auto& pk = top.packer();
  pk.pack(std::string("body"));
  pk.pack_map(1);
  pk.pack(std::string("items"));
  pk.pack_array(static_cast<std::uint32_t>(transfer_ids.size()));
  for (const auto& transfer_id : transfer_ids) {
    pk.pack_map(1);
    pk.pack(std::string("transfer_id"));
    std::visit([&pk](const auto& value) { pk.pack(value); }, transfer_id);
  }
  return top.str();
}

}  // namespace ecx::wire::testing
