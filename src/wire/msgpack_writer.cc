#include "wire/msgpack_writer.h"

#include <array>

#include "ecx/core/dtype.h"

namespace ecx::wire::detail {

void put_str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<std::uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
}

void put_bin(Packer& pk, std::string_view s) {
  pk.pack_bin(static_cast<std::uint32_t>(s.size()));
  pk.pack_bin_body(s.data(), static_cast<std::uint32_t>(s.size()));
}

void put_bool(Packer& pk, bool b) {
  if (b) {
    pk.pack_true();
  } else {
    pk.pack_false();
  }
}

void put_reservation(Packer& pk, const ReservationId& id) {
  std::array<char, 16> bytes{};
  for (int i = 0; i < 8; ++i) {
    bytes[static_cast<std::size_t>(i)] = static_cast<char>((id.hi() >> (56 - 8 * i)) & 0xff);
    bytes[8 + static_cast<std::size_t>(i)] = static_cast<char>((id.lo() >> (56 - 8 * i)) & 0xff);
  }
  put_bin(pk, std::string_view(bytes.data(), bytes.size()));
}

void put_shape(Packer& pk, const TensorSpec& spec) {
  put_str(pk, "nbytes");
  pk.pack(spec.nbytes());
  put_str(pk, "shape");
  pk.pack_array(static_cast<std::uint32_t>(spec.shape().size()));
  for (std::int64_t d : spec.shape()) pk.pack(d);
  put_str(pk, "dtype");
  put_str(pk, dtype_name(spec.dtype()));
}

void put_error(Packer& pk, const Status& status, RejectReason reason, std::uint32_t min_version,
               std::uint32_t max_version) {
  const bool versions = reason == RejectReason::version_mismatch;
  pk.pack_map(2 + (reason != RejectReason::none ? 1 : 0) + (versions ? 2 : 0));
  put_str(pk, "code");
  put_str(pk, status_code_name(status.code()));
  put_str(pk, "message");
  put_str(pk, status.message());
  if (reason != RejectReason::none) {
    put_str(pk, "reason");
    put_str(pk, reject_reason_name(reason));
  }
  if (versions) {
    put_str(pk, "min_version");
    pk.pack(min_version);
    put_str(pk, "max_version");
    pk.pack(max_version);
  }
}

std::uint32_t stamp_fields(const AuthStamp* stamp) { return stamp ? 3 : 0; }

void put_stamp(Packer& pk, const AuthStamp* stamp) {
  if (!stamp) return;
  put_str(pk, "sid");
  pk.pack(stamp->sender);
  put_str(pk, "seq");
  pk.pack(stamp->seq);
  put_str(pk, "ts");
  pk.pack(stamp->time_ms);
}

}  // namespace ecx::wire::detail
