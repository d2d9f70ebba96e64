#pragma once
// The strict msgpack reading the control-frame decoders share: bounded parsing of a
// frame, a map's known fields read in one pass with typed accessors, and the pieces
// every frame has (envelope header, tensor spec, error map). Private to the wire
// component: the codec's public face is ecx/wire/codec.h.

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <msgpack.hpp>

#include "ecx/core/dtype.h"
#include "ecx/core/ids.h"
#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"
#include "ecx/wire/codec.h"
#include "ecx/wire/protocol.h"

namespace ecx::wire::detail {

using Obj = msgpack::object;

// The msgpack type of `o` as a peer would name it in an error message.
std::string_view type_name(const Obj& o);

// Reads one map's known keys in a single pass. Unknown keys are skipped; a known
// key present twice, or a key that is not a string, makes the map invalid.
template <std::size_t N>
class Fields {
 public:
  Fields(const std::array<std::string_view, N>& names, std::string path) : names_(names), path_(std::move(path)) {}

  Status read(const Obj& o, StatusCode code) {
    code_ = code;
    if (o.type != msgpack::type::MAP) return fail(fmt::format("{} must be a map, got {}", path_, type_name(o)));
    const msgpack::object_map& map = o.via.map;
    for (std::uint32_t i = 0; i < map.size; ++i) {
      const Obj& key = map.ptr[i].key;
      if (key.type != msgpack::type::STR)
        return fail(fmt::format("{} has a {} key; keys are strings", path_, type_name(key)));
      const std::string_view k(key.via.str.ptr, key.via.str.size);
      for (std::size_t f = 0; f < N; ++f) {
        if (names_[f] != k) continue;
        if (values_[f]) return fail(fmt::format("{} repeats the key '{}'", path_, k));
        values_[f] = &map.ptr[i].val;
        break;
      }
    }
    return Status::ok();
  }

  const Obj* get(std::size_t f) const { return values_[f]; }
  bool has(std::size_t f) const { return values_[f] != nullptr; }

  Status missing(std::size_t f) const { return fail(fmt::format("{}.{} is missing", path_, names_[f])); }
  Status wrong(std::size_t f, std::string_view expected) const {
    return fail(fmt::format("{}.{} must be {}, got {}", path_, names_[f], expected, type_name(*values_[f])));
  }
  Status fail(std::string message) const { return Status(code_, std::move(message)); }

  // Typed accessors: required fields fail when absent; optional ones return fallback.
  Result<std::uint64_t> u64(std::size_t f, std::uint64_t max = std::numeric_limits<std::uint64_t>::max()) const {
    if (!has(f)) return missing(f);
    return u64_present(f, max);
  }
  Result<std::uint64_t> u64_or(std::size_t f, std::uint64_t fallback,
                               std::uint64_t max = std::numeric_limits<std::uint64_t>::max()) const {
    if (!has(f)) return fallback;
    return u64_present(f, max);
  }
  Result<bool> boolean(std::size_t f) const {
    if (!has(f)) return missing(f);
    if (values_[f]->type != msgpack::type::BOOLEAN) return wrong(f, "a boolean");
    return values_[f]->via.boolean;
  }
  Result<bool> boolean_or(std::size_t f, bool fallback) const {
    if (!has(f)) return fallback;
    return boolean(f);
  }
  Result<std::string_view> str(std::size_t f, std::size_t max_bytes) const {
    if (!has(f)) return missing(f);
    const Obj& o = *values_[f];
    if (o.type != msgpack::type::STR) return wrong(f, "a string");
    if (o.via.str.size > max_bytes) {
      return fail(
          fmt::format("{}.{} is {} bytes long; the maximum is {}", path_, names_[f], o.via.str.size, max_bytes));
    }
    return std::string_view(o.via.str.ptr, o.via.str.size);
  }
  Result<std::string_view> str_or(std::size_t f, std::size_t max_bytes) const {
    if (!has(f)) return std::string_view{};
    return str(f, max_bytes);
  }
  Result<std::string_view> bin(std::size_t f, std::size_t max_bytes) const {
    if (!has(f)) return missing(f);
    const Obj& o = *values_[f];
    if (o.type != msgpack::type::BIN) return wrong(f, "binary");
    if (o.via.bin.size > max_bytes) {
      return fail(
          fmt::format("{}.{} is {} bytes long; the maximum is {}", path_, names_[f], o.via.bin.size, max_bytes));
    }
    return std::string_view(o.via.bin.ptr, o.via.bin.size);
  }
  Result<const msgpack::object_array*> array(std::size_t f, std::size_t max_entries) const {
    if (!has(f)) return missing(f);
    const Obj& o = *values_[f];
    if (o.type != msgpack::type::ARRAY) return wrong(f, "an array");
    if (o.via.array.size > max_entries) {
      return fail(
          fmt::format("{}.{} has {} entries; the maximum is {}", path_, names_[f], o.via.array.size, max_entries));
    }
    return &o.via.array;
  }
  Result<ReservationId> reservation(std::size_t f) const {
    auto bytes = bin(f, 16);
    if (!bytes) return bytes.status();
    if (bytes->size() != 16)
      return fail(fmt::format("{}.{} must be 16 bytes, got {}", path_, names_[f], bytes->size()));
    std::uint64_t hi = 0;
    std::uint64_t lo = 0;
    for (std::size_t i = 0; i < 8; ++i) {
      hi = (hi << 8) | static_cast<unsigned char>((*bytes)[i]);
      lo = (lo << 8) | static_cast<unsigned char>((*bytes)[8 + i]);
    }
    return ReservationId(hi, lo);
  }
  Result<ReservationId> reservation_or_none(std::size_t f) const {
    if (!has(f)) return ReservationId{};
    return reservation(f);
  }
  const std::string& path() const { return path_; }

 private:
  Result<std::uint64_t> u64_present(std::size_t f, std::uint64_t max) const {
    const Obj& o = *values_[f];
    if (o.type != msgpack::type::POSITIVE_INTEGER) return wrong(f, "an unsigned integer");
    if (o.via.u64 > max) return fail(fmt::format("{}.{} = {} exceeds {}", path_, names_[f], o.via.u64, max));
    return o.via.u64;
  }

  const std::array<std::string_view, N>& names_;
  std::string path_;
  StatusCode code_ = StatusCode::protocol;
  std::array<const Obj*, N> values_{};
};

// Assigns the value of a Result expression to lhs, or returns its error.
#define WIRE_CONCAT_INNER(a, b) a##b
#define WIRE_CONCAT(a, b) WIRE_CONCAT_INNER(a, b)
// (tmp is a name and lhs may be a declaration: neither can be parenthesized.)
// NOLINTBEGIN(bugprone-macro-parentheses)
#define WIRE_ASSIGN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                     \
  if (!tmp) return tmp.status();         \
  lhs = std::move(*tmp)
#define WIRE_ASSIGN(lhs, expr) WIRE_ASSIGN_IMPL(WIRE_CONCAT(wire_result_, __LINE__), lhs, expr)
// NOLINTEND(bugprone-macro-parentheses)

inline constexpr std::uint64_t kU32Max = std::numeric_limits<std::uint32_t>::max();

// nbytes, shape and dtype of a tensor, checked against each other.
template <std::size_t N>
Result<TensorSpec> read_spec(const Fields<N>& fields, std::size_t nbytes_f, std::size_t shape_f, std::size_t dtype_f) {
  std::uint64_t nbytes = 0;
  WIRE_ASSIGN(nbytes, fields.u64(nbytes_f));
  const msgpack::object_array* dims = nullptr;
  WIRE_ASSIGN(dims, fields.array(shape_f, kMaxTensorRank));
  std::array<std::int64_t, kMaxTensorRank> shape{};  // the array's length was bounded above
  for (std::uint32_t i = 0; i < dims->size; ++i) {
    const Obj& d = dims->ptr[i];
    if (d.type != msgpack::type::POSITIVE_INTEGER ||
        d.via.u64 > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return fields.fail(fmt::format("{}.shape[{}] must be a positive integer", fields.path(), i));
    }
    shape.at(i) = static_cast<std::int64_t>(d.via.u64);
  }
  std::string_view dtype_text;
  WIRE_ASSIGN(dtype_text, fields.str(dtype_f, 64));
  auto dtype = parse_dtype(dtype_text);
  if (!dtype) return fields.fail(fmt::format("{}.dtype: {}", fields.path(), dtype.status().message()));
  auto spec = TensorSpec::make(std::span<const std::int64_t>(shape.data(), dims->size), *dtype,
                               std::numeric_limits<std::uint64_t>::max());
  if (!spec) return fields.fail(fmt::format("{}: {}", fields.path(), spec.status().message()));
  if (spec->nbytes() != nbytes) {
    return fields.fail(
        fmt::format("{}.nbytes = {} does not match shape and dtype ({} bytes)", fields.path(), nbytes, spec->nbytes()));
  }
  return std::move(*spec);
}

// {code, message, reason?, min_version?, max_version?}
struct ErrorFields {
  Status status;
  RejectReason reason = RejectReason::none;
  std::uint32_t min_version = 0;
  std::uint32_t max_version = 0;
};

Result<ErrorFields> read_error(const Obj& o, const std::string& path, const Limits& limits);

// The `items` array of a batch body (reserve_batch, cancel_batch; requests and
// replies), at most limits.max_batch_items long.
Result<const msgpack::object_array*> batch_items(const Obj& body, const Limits& limits);

// A parsed frame: its root object and the zone the tree lives in. The zone goes back
// to its thread's spare when the frame is done with, emptied to its first chunk: a
// zone of its own per frame cost every decode four allocations (the zone, its 8 KiB
// chunk and its finalizer array among them), on both ends of every control round trip.
class ParsedFrame {
 public:
  ParsedFrame(msgpack::object root, std::unique_ptr<msgpack::zone> zone) noexcept
      : root_(root), zone_(std::move(zone)) {}
  ParsedFrame(ParsedFrame&&) noexcept = default;
  ParsedFrame& operator=(ParsedFrame&&) = delete;
  ParsedFrame(const ParsedFrame&) = delete;
  ParsedFrame& operator=(const ParsedFrame&) = delete;
  ~ParsedFrame();
  const msgpack::object& get() const noexcept { return root_; }

 private:
  msgpack::object root_;
  std::unique_ptr<msgpack::zone> zone_;
};

// Parses the bytes into an object tree, enforcing every container and string bound
// before it is allocated. Strings and binaries point into `frame` (no copies), so
// the tree must not outlive it.
Result<ParsedFrame> parse_frame(std::string_view frame, const Limits& limits, Envelope* envelope);

// Reads v, id and the stamp of a top-level map. Fields<N> must list them first:
// "v", "id", "sid", "seq", "ts" at 0..4.
template <std::size_t N>
Status read_header(const Fields<N>& f, bool with_id, Envelope* envelope) {
  // Every early return below is a malformed header; success clears the reason.
  if (envelope) envelope->reason = RejectReason::malformed;
  std::uint64_t version = 0;
  WIRE_ASSIGN(version, f.u64(0, kU32Max));
  if (envelope) envelope->version = static_cast<std::uint32_t>(version);
  if (with_id) {
    std::uint64_t id = 0;
    WIRE_ASSIGN(id, f.u64(1));
    if (envelope) envelope->id = id;
  }
  if (f.has(2) || f.has(3) || f.has(4)) {
    AuthStamp stamp;
    WIRE_ASSIGN(stamp.sender, f.u64(2));
    WIRE_ASSIGN(stamp.seq, f.u64(3));
    WIRE_ASSIGN(stamp.time_ms, f.u64(4));
    if (envelope) envelope->stamp = stamp;
  }
  if (version < kMinProtocolVersion || version > kProtocolVersion) {
    if (envelope) envelope->reason = RejectReason::version_mismatch;
    return protocol_error(fmt::format("protocol version {} is not supported; this peer speaks versions {}..{}", version,
                                      kMinProtocolVersion, kProtocolVersion));
  }
  if (envelope) envelope->reason = RejectReason::none;
  return Status::ok();
}

// A frame that parsed but whose content is wrong: rejected as malformed, with a
// protocol error that says why.
Status malformed(Envelope* env, const Status& why);

}  // namespace ecx::wire::detail
