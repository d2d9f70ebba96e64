#pragma once
// The msgpack writing primitives the control-frame encoders are built from. Private
// to the wire component: the codec's public face is ecx/wire/codec.h.

#include <cstdint>
#include <string>
#include <string_view>

#include <msgpack.hpp>

#include "ecx/core/ids.h"
#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"
#include "ecx/wire/codec.h"
#include "ecx/wire/protocol.h"

namespace ecx::wire::detail {

// msgpack-cxx packs into anything with write(const char*, size_t).
struct StringSink {
  std::string* out;
  void write(const char* data, std::size_t size) { out->append(data, size); }
};
using Packer = msgpack::packer<StringSink>;

void put_str(Packer& pk, std::string_view s);
void put_bin(Packer& pk, std::string_view s);
void put_bool(Packer& pk, bool b);
// 16 bytes, big-endian hi then lo.
void put_reservation(Packer& pk, const ReservationId& id);
// Three entries of the enclosing map: "nbytes", "shape", "dtype".
void put_shape(Packer& pk, const TensorSpec& spec);
// {code, message, reason?, min_version?, max_version?}; the versions only for a
// version mismatch.
void put_error(Packer& pk, const Status& status, RejectReason reason, std::uint32_t min_version,
               std::uint32_t max_version);

// How many entries put_stamp adds to the enclosing map (0 without a stamp).
std::uint32_t stamp_fields(const AuthStamp* stamp);
// "sid", "seq", "ts" when `stamp` is not null.
void put_stamp(Packer& pk, const AuthStamp* stamp);

}  // namespace ecx::wire::detail
