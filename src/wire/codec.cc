#include "ecx/wire/codec.h"

#include <array>
#include <exception>
#include <limits>
#include <new>

#include <fmt/format.h>
#include <msgpack.hpp>

#include "ecx/core/dtype.h"

namespace ecx::wire {
namespace {

// ------------------------------------------------------------------ writing

// msgpack-cxx packs into anything with write(const char*, size_t).
struct StringSink {
  std::string* out;
  void write(const char* data, std::size_t size) { out->append(data, size); }
};
using Packer = msgpack::packer<StringSink>;

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

struct RequestBodyWriter {
  Packer& pk;
  void operator()(const HelloRequest& r) const {
    pk.pack_map(r.client.empty() ? 0 : 1);
    if (!r.client.empty()) {
      put_str(pk, "client");
      put_str(pk, r.client);
    }
  }
  void operator()(const ReserveBatchRequest& r) const {
    pk.pack_map(1);
    put_str(pk, "items");
    pk.pack_array(static_cast<std::uint32_t>(r.items.size()));
    for (const ReserveItem& item : r.items) {
      pk.pack_map(5 + (item.checksum ? 1 : 0));
      put_str(pk, "transfer_id");
      put_str(pk, item.transfer_id);
      put_str(pk, "mm_hash");
      put_str(pk, item.mm_hash);
      put_shape(pk, item.spec);
      if (item.checksum) {
        put_str(pk, "checksum");
        pk.pack(*item.checksum);
      }
    }
  }
  void operator()(const CancelRequest& r) const {
    pk.pack_map(1 + (r.reservation_id.is_none() ? 0 : 1) + (r.abandon ? 1 : 0) + (r.refresh ? 1 : 0));
    put_str(pk, "transfer_id");
    put_str(pk, r.transfer_id);
    if (!r.reservation_id.is_none()) {
      put_str(pk, "reservation_id");
      put_reservation(pk, r.reservation_id);
    }
    if (r.abandon) {
      put_str(pk, "abandon");
      pk.pack_true();
    }
    if (r.refresh) {
      put_str(pk, "refresh");
      pk.pack_true();
    }
  }
  void operator()(const StatusRequest& r) const {
    pk.pack_map(1);
    put_str(pk, "transfer_id");
    put_str(pk, r.transfer_id);
  }
  void operator()(const CompleteRequest& r) const {
    pk.pack_map(3 + (r.checksum ? 1 : 0));
    put_str(pk, "transfer_id");
    put_str(pk, r.transfer_id);
    put_str(pk, "reservation_id");
    put_reservation(pk, r.reservation_id);
    put_str(pk, "generation");
    pk.pack(r.generation);
    if (r.checksum) {
      put_str(pk, "checksum");
      pk.pack(*r.checksum);
    }
  }
};

void put_reserve_result(Packer& pk, const ReserveResult& r) {
  switch (r.outcome) {
    case ReserveOutcome::reserved:
      pk.pack_map(5 + (r.offset ? 1 : 0));
      put_str(pk, "status");
      put_str(pk, reserve_outcome_name(r.outcome));
      put_str(pk, "reservation_id");
      put_reservation(pk, r.reservation_id);
      put_str(pk, "generation");
      pk.pack(r.generation);
      put_str(pk, "slot_bytes");
      pk.pack(r.slot_bytes);
      put_str(pk, "write");
      put_bool(pk, r.write);
      if (r.offset) {
        put_str(pk, "offset");
        pk.pack(*r.offset);
      }
      return;
    case ReserveOutcome::ready:
      pk.pack_map(3);
      put_str(pk, "status");
      put_str(pk, reserve_outcome_name(r.outcome));
      put_str(pk, "reservation_id");
      put_reservation(pk, r.reservation_id);
      put_str(pk, "cached");
      put_bool(pk, r.cached);
      return;
    case ReserveOutcome::cancelled:
      pk.pack_map(1);
      put_str(pk, "status");
      put_str(pk, reserve_outcome_name(r.outcome));
      return;
    case ReserveOutcome::retry:
      pk.pack_map(2);
      put_str(pk, "status");
      put_str(pk, reserve_outcome_name(r.outcome));
      put_str(pk, "retry_after_ms");
      pk.pack(r.retry_after_ms);
      return;
    case ReserveOutcome::error:
      pk.pack_map(2);
      put_str(pk, "status");
      put_str(pk, reserve_outcome_name(r.outcome));
      put_str(pk, "error");
      put_error(pk, r.error.is_ok() ? internal_error("unspecified error") : r.error, RejectReason::none, 0, 0);
      return;
  }
}

struct ReplyBodyWriter {
  Packer& pk;
  void operator()(const std::monostate&) const { pk.pack_map(0); }
  void operator()(const HelloReply& r) const {
    pk.pack_map(11);
    put_str(pk, "shard");
    pk.pack(r.shard);
    put_str(pk, "tp_size");
    pk.pack(r.tp_size);
    put_str(pk, "control_ports");
    pk.pack_array(static_cast<std::uint32_t>(r.control_ports.size()));
    for (std::uint32_t p : r.control_ports) pk.pack(p);
    put_str(pk, "event_port");
    pk.pack(r.event_port);
    put_str(pk, "instance");
    put_str(pk, r.instance);
    put_str(pk, "min_version");
    pk.pack(r.min_version);
    put_str(pk, "max_version");
    pk.pack(r.max_version);
    put_str(pk, "features");
    pk.pack_array(static_cast<std::uint32_t>(r.features.size()));
    for (const std::string& f : r.features) put_str(pk, f);
    put_str(pk, "data");
    pk.pack_map(2 + (r.data.segment.empty() ? 0 : 1) + (r.data.base != 0 ? 1 : 0));
    put_str(pk, "transport");
    put_str(pk, r.data.transport);
    put_str(pk, "address");
    put_bin(pk, r.data.address);
    if (!r.data.segment.empty()) {
      put_str(pk, "segment");
      put_str(pk, r.data.segment);
    }
    if (r.data.base != 0) {
      put_str(pk, "base");
      pk.pack(r.data.base);
    }
    put_str(pk, "pool_bytes");
    pk.pack(r.pool_bytes);
    put_str(pk, "max_tensor_bytes");
    pk.pack(r.max_tensor_bytes);
  }
  void operator()(const ReserveBatchReply& r) const {
    pk.pack_map(1);
    put_str(pk, "items");
    pk.pack_array(static_cast<std::uint32_t>(r.items.size()));
    for (const ReserveResult& item : r.items) put_reserve_result(pk, item);
  }
  void operator()(const CancelReply& r) const {
    pk.pack_map(1);
    put_str(pk, "cancelled");
    put_bool(pk, r.cancelled);
  }
  void operator()(const StatusReply& r) const {
    if (!r.found) {
      pk.pack_map(1);
      put_str(pk, "found");
      pk.pack_false();
      return;
    }
    pk.pack_map(5 + (r.spec ? 3 : 0));
    put_str(pk, "found");
    pk.pack_true();
    put_str(pk, "state");
    put_str(pk, r.state);
    put_str(pk, "mm_hash");
    put_str(pk, r.mm_hash);
    put_str(pk, "reservation_id");
    put_reservation(pk, r.reservation_id);
    put_str(pk, "generation");
    pk.pack(r.generation);
    if (r.spec) put_shape(pk, *r.spec);
  }
  void operator()(const CompleteReply& r) const {
    pk.pack_map(2);
    put_str(pk, "completed");
    put_bool(pk, r.completed);
    put_str(pk, "became_ready");
    put_bool(pk, r.became_ready);
  }
};

// ------------------------------------------------------------------ reading

using Obj = msgpack::object;

std::string_view type_name(const Obj& o) {
  switch (o.type) {
    case msgpack::type::NIL:
      return "nil";
    case msgpack::type::BOOLEAN:
      return "boolean";
    case msgpack::type::POSITIVE_INTEGER:
      return "unsigned integer";
    case msgpack::type::NEGATIVE_INTEGER:
      return "negative integer";
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64:
      return "float";
    case msgpack::type::STR:
      return "string";
    case msgpack::type::BIN:
      return "binary";
    case msgpack::type::ARRAY:
      return "array";
    case msgpack::type::MAP:
      return "map";
    case msgpack::type::EXT:
      return "extension";
  }
  return "unknown";
}

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

constexpr std::uint64_t kU32Max = std::numeric_limits<std::uint32_t>::max();

// nbytes, shape and dtype of a tensor, checked against each other.
template <std::size_t N>
Result<TensorSpec> read_spec(const Fields<N>& fields, std::size_t nbytes_f, std::size_t shape_f, std::size_t dtype_f) {
  std::uint64_t nbytes = 0;
  WIRE_ASSIGN(nbytes, fields.u64(nbytes_f));
  const msgpack::object_array* dims = nullptr;
  WIRE_ASSIGN(dims, fields.array(shape_f, kMaxTensorRank));
  std::vector<std::int64_t> shape;
  shape.reserve(dims->size);
  for (std::uint32_t i = 0; i < dims->size; ++i) {
    const Obj& d = dims->ptr[i];
    if (d.type != msgpack::type::POSITIVE_INTEGER ||
        d.via.u64 > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return fields.fail(fmt::format("{}.shape[{}] must be a positive integer", fields.path(), i));
    }
    shape.push_back(static_cast<std::int64_t>(d.via.u64));
  }
  std::string_view dtype_text;
  WIRE_ASSIGN(dtype_text, fields.str(dtype_f, 64));
  auto dtype = parse_dtype(dtype_text);
  if (!dtype) return fields.fail(fmt::format("{}.dtype: {}", fields.path(), dtype.status().message()));
  auto spec = TensorSpec::make(std::move(shape), *dtype, std::numeric_limits<std::uint64_t>::max());
  if (!spec) return fields.fail(fmt::format("{}: {}", fields.path(), spec.status().message()));
  if (spec->nbytes() != nbytes) {
    return fields.fail(
        fmt::format("{}.nbytes = {} does not match shape and dtype ({} bytes)", fields.path(), nbytes, spec->nbytes()));
  }
  return std::move(*spec);
}

Status check_id(const Status& s, StatusCode code) { return s.is_ok() ? s : Status(code, s.message()); }

// {code, message, reason?, min_version?, max_version?}
struct ErrorFields {
  Status status;
  RejectReason reason = RejectReason::none;
  std::uint32_t min_version = 0;
  std::uint32_t max_version = 0;
};

Result<ErrorFields> read_error(const Obj& o, const std::string& path, const Limits& limits) {
  static const std::array<std::string_view, 5> kNames = {"code", "message", "reason", "min_version", "max_version"};
  Fields<5> f(kNames, path);
  ECX_RETURN_IF_ERROR(f.read(o, StatusCode::protocol));
  std::string_view code_text;
  WIRE_ASSIGN(code_text, f.str(0, 64));
  std::string_view message;
  WIRE_ASSIGN(message, f.str(1, limits.max_string_bytes));
  std::string_view reason_text;
  WIRE_ASSIGN(reason_text, f.str_or(2, 64));
  ErrorFields out;
  WIRE_ASSIGN(out.min_version, f.u64_or(3, 0, kU32Max));
  WIRE_ASSIGN(out.max_version, f.u64_or(4, 0, kU32Max));
  const auto code = parse_status_code(code_text);
  if (code == StatusCode::ok) return f.fail(fmt::format("{}.code must not be 'ok'", path));
  if (code) {
    out.status = Status(*code, std::string(message));
  } else {
    // A newer peer may name a code this side does not know; keep its text.
    out.status = protocol_error(fmt::format("{}: {}", code_text, message));
  }
  out.reason = parse_reject_reason(reason_text);
  return out;
}

// Parses the bytes into an object tree, enforcing every container and string bound
// before it is allocated. Strings and binaries point into `frame` (no copies), so
// the tree must not outlive it.
Result<msgpack::object_handle> parse_frame(std::string_view frame, const Limits& limits, Envelope* envelope) {
  auto refuse = [&](RejectReason reason, std::string message) -> Status {
    if (envelope) envelope->reason = reason;
    return protocol_error(std::move(message));
  };
  if (frame.empty()) return refuse(RejectReason::malformed, "empty frame");
  if (frame.size() > limits.max_frame_bytes) {
    return refuse(RejectReason::too_large,
                  fmt::format("frame of {} bytes exceeds the limit of {} bytes", frame.size(), limits.max_frame_bytes));
  }
  const msgpack::unpack_limit bounds(std::max(limits.max_batch_items, limits.max_list_entries), limits.max_map_entries,
                                     limits.max_string_bytes, limits.max_binary_bytes, /*ext=*/0, limits.max_depth);
  try {
    std::size_t offset = 0;
    msgpack::object_handle handle = msgpack::unpack(
        frame.data(), frame.size(), offset, [](msgpack::type::object_type, std::size_t, void*) { return true; },
        nullptr, bounds);
    if (offset != frame.size()) {
      return refuse(RejectReason::malformed, fmt::format("{} trailing bytes after the message", frame.size() - offset));
    }
    return handle;
  } catch (const msgpack::depth_size_overflow&) {
    return refuse(RejectReason::malformed, fmt::format("nesting deeper than {}", limits.max_depth));
  } catch (const msgpack::size_overflow& e) {
    return refuse(RejectReason::malformed, fmt::format("a declared length exceeds its limit ({})", e.what()));
  } catch (const msgpack::insufficient_bytes&) {
    return refuse(RejectReason::malformed, "truncated msgpack");
  } catch (const std::bad_alloc&) {
    return refuse(RejectReason::malformed, "frame needs more memory than allowed");
  } catch (const std::exception& e) {
    return refuse(RejectReason::malformed, fmt::format("undecodable msgpack ({})", e.what()));
  }
}

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

Result<ReserveItem> read_item(const Obj& o, std::uint32_t index) {
  static const std::array<std::string_view, 6> kNames = {"transfer_id", "mm_hash", "nbytes",
                                                         "shape",       "dtype",   "checksum"};
  Fields<6> f(kNames, fmt::format("items[{}]", index));
  ECX_RETURN_IF_ERROR(f.read(o, StatusCode::invalid_argument));
  std::string_view transfer_id;
  WIRE_ASSIGN(transfer_id, f.str(0, kMaxIdLength));
  ECX_RETURN_IF_ERROR(validate_transfer_id(transfer_id));
  std::string_view mm_hash;
  WIRE_ASSIGN(mm_hash, f.str(1, kMaxIdLength));
  ECX_RETURN_IF_ERROR(validate_mm_hash(mm_hash));
  auto spec = read_spec(f, 2, 3, 4);
  if (!spec) return spec.status();
  std::optional<std::uint64_t> checksum;
  if (f.has(5)) {
    std::uint64_t value = 0;
    WIRE_ASSIGN(value, f.u64(5));
    checksum = value;
  }
  return ReserveItem{std::string(transfer_id), std::string(mm_hash), std::move(*spec), checksum};
}

Result<RequestBody> read_request_body(Op op, const Obj* body_obj, const Limits& limits,
                                      std::vector<ItemError>& item_errors) {
  static const Obj kEmptyMap = [] {
    Obj o;
    o.type = msgpack::type::MAP;
    o.via.map.size = 0;
    o.via.map.ptr = nullptr;
    return o;
  }();
  const Obj& body = body_obj ? *body_obj : kEmptyMap;
  switch (op) {
    case Op::hello: {
      static const std::array<std::string_view, 1> kNames = {"client"};
      Fields<1> f(kNames, "body");
      ECX_RETURN_IF_ERROR(f.read(body, StatusCode::protocol));
      HelloRequest r;
      std::string_view client;
      WIRE_ASSIGN(client, f.str_or(0, limits.max_string_bytes));
      r.client = std::string(client);
      return RequestBody{std::move(r)};
    }
    case Op::reserve_batch: {
      static const std::array<std::string_view, 1> kNames = {"items"};
      Fields<1> f(kNames, "body");
      ECX_RETURN_IF_ERROR(f.read(body, StatusCode::protocol));
      const msgpack::object_array* items = nullptr;
      WIRE_ASSIGN(items, f.array(0, limits.max_batch_items));
      ReserveBatchRequest r;
      r.items.reserve(items->size);
      for (std::uint32_t i = 0; i < items->size; ++i) {
        auto item = read_item(items->ptr[i], i);
        if (item) {
          r.items.push_back(std::move(*item));
        } else {
          item_errors.push_back(ItemError{i, item.status()});
        }
      }
      return RequestBody{std::move(r)};
    }
    case Op::cancel: {
      static const std::array<std::string_view, 4> kNames = {"transfer_id", "reservation_id", "abandon", "refresh"};
      Fields<4> f(kNames, "body");
      ECX_RETURN_IF_ERROR(f.read(body, StatusCode::invalid_argument));
      CancelRequest r;
      std::string_view transfer_id;
      WIRE_ASSIGN(transfer_id, f.str(0, kMaxIdLength));
      ECX_RETURN_IF_ERROR(check_id(validate_transfer_id(transfer_id), StatusCode::invalid_argument));
      r.transfer_id = std::string(transfer_id);
      WIRE_ASSIGN(r.reservation_id, f.reservation_or_none(1));
      WIRE_ASSIGN(r.abandon, f.boolean_or(2, false));
      WIRE_ASSIGN(r.refresh, f.boolean_or(3, false));
      return RequestBody{std::move(r)};
    }
    case Op::status: {
      static const std::array<std::string_view, 1> kNames = {"transfer_id"};
      Fields<1> f(kNames, "body");
      ECX_RETURN_IF_ERROR(f.read(body, StatusCode::invalid_argument));
      StatusRequest r;
      std::string_view transfer_id;
      WIRE_ASSIGN(transfer_id, f.str(0, kMaxIdLength));
      ECX_RETURN_IF_ERROR(validate_transfer_id(transfer_id));
      r.transfer_id = std::string(transfer_id);
      return RequestBody{std::move(r)};
    }
    case Op::complete: {
      static const std::array<std::string_view, 4> kNames = {"transfer_id", "reservation_id", "generation", "checksum"};
      Fields<4> f(kNames, "body");
      ECX_RETURN_IF_ERROR(f.read(body, StatusCode::invalid_argument));
      CompleteRequest r;
      std::string_view transfer_id;
      WIRE_ASSIGN(transfer_id, f.str(0, kMaxIdLength));
      ECX_RETURN_IF_ERROR(validate_transfer_id(transfer_id));
      r.transfer_id = std::string(transfer_id);
      WIRE_ASSIGN(r.reservation_id, f.reservation(1));
      WIRE_ASSIGN(r.generation, f.u64(2));
      if (f.has(3)) {
        std::uint64_t value = 0;
        WIRE_ASSIGN(value, f.u64(3));
        r.checksum = value;
      }
      return RequestBody{std::move(r)};
    }
  }
  return protocol_error("unknown op");
}

Result<ReserveResult> read_reserve_result(const Obj& o, std::uint32_t index, const Limits& limits) {
  static const std::array<std::string_view, 9> kNames = {
      "status", "reservation_id", "generation", "slot_bytes", "write", "offset", "cached", "retry_after_ms", "error"};
  Fields<9> f(kNames, fmt::format("items[{}]", index));
  ECX_RETURN_IF_ERROR(f.read(o, StatusCode::protocol));
  std::string_view outcome;
  WIRE_ASSIGN(outcome, f.str(0, 64));
  ReserveResult r;
  if (outcome == "reserved") {
    r.outcome = ReserveOutcome::reserved;
    WIRE_ASSIGN(r.reservation_id, f.reservation(1));
    WIRE_ASSIGN(r.generation, f.u64(2));
    WIRE_ASSIGN(r.slot_bytes, f.u64(3));
    WIRE_ASSIGN(r.write, f.boolean_or(4, true));
    if (f.has(5)) {
      std::uint64_t offset = 0;
      WIRE_ASSIGN(offset, f.u64(5));
      r.offset = offset;
    }
  } else if (outcome == "ready") {
    r.outcome = ReserveOutcome::ready;
    r.write = false;
    WIRE_ASSIGN(r.reservation_id, f.reservation_or_none(1));
    WIRE_ASSIGN(r.cached, f.boolean_or(6, false));
  } else if (outcome == "cancelled") {
    r.outcome = ReserveOutcome::cancelled;
    r.write = false;
  } else if (outcome == "retry") {
    r.outcome = ReserveOutcome::retry;
    r.write = false;
    WIRE_ASSIGN(r.retry_after_ms, f.u64(7, kU32Max));
  } else if (outcome == "error") {
    r.outcome = ReserveOutcome::error;
    r.write = false;
    if (!f.has(8)) return f.missing(8);
    auto error = read_error(*f.get(8), f.path() + ".error", limits);
    if (!error) return error.status();
    r.error = error->status;
  } else {
    return f.fail(fmt::format("{}.status '{}' is not one of reserved, ready, cancelled, retry, error", f.path(),
                              outcome.substr(0, 64)));
  }
  return r;
}

Result<ReplyBody> read_reply_body(Op op, const Obj& body, const Limits& limits) {
  switch (op) {
    case Op::hello: {
      static const std::array<std::string_view, 11> kNames = {
          "shard",       "tp_size",  "control_ports", "event_port", "instance",        "min_version",
          "max_version", "features", "data",          "pool_bytes", "max_tensor_bytes"};
      Fields<11> f(kNames, "body");
      ECX_RETURN_IF_ERROR(f.read(body, StatusCode::protocol));
      HelloReply r;
      WIRE_ASSIGN(r.shard, f.u64(0, kU32Max));
      WIRE_ASSIGN(r.tp_size, f.u64(1, kU32Max));
      const msgpack::object_array* ports = nullptr;
      WIRE_ASSIGN(ports, f.array(2, limits.max_list_entries));
      for (std::uint32_t i = 0; i < ports->size; ++i) {
        const Obj& p = ports->ptr[i];
        if (p.type != msgpack::type::POSITIVE_INTEGER || p.via.u64 > 65535) {
          return f.fail(fmt::format("body.control_ports[{}] must be a port number", i));
        }
        r.control_ports.push_back(static_cast<std::uint32_t>(p.via.u64));
      }
      WIRE_ASSIGN(r.event_port, f.u64(3, 65535));
      std::string_view instance;
      WIRE_ASSIGN(instance, f.str(4, limits.max_string_bytes));
      r.instance = std::string(instance);
      WIRE_ASSIGN(r.min_version, f.u64(5, kU32Max));
      WIRE_ASSIGN(r.max_version, f.u64(6, kU32Max));
      const msgpack::object_array* features = nullptr;
      WIRE_ASSIGN(features, f.array(7, limits.max_list_entries));
      for (std::uint32_t i = 0; i < features->size; ++i) {
        const Obj& s = features->ptr[i];
        if (s.type != msgpack::type::STR) return f.fail(fmt::format("body.features[{}] must be a string", i));
        r.features.emplace_back(s.via.str.ptr, s.via.str.size);
      }
      if (!f.has(8)) return f.missing(8);
      static const std::array<std::string_view, 4> kDataNames = {"transport", "address", "segment", "base"};
      Fields<4> d(kDataNames, "body.data");
      ECX_RETURN_IF_ERROR(d.read(*f.get(8), StatusCode::protocol));
      std::string_view text;
      WIRE_ASSIGN(text, d.str(0, 64));
      r.data.transport = std::string(text);
      WIRE_ASSIGN(text, d.bin(1, limits.max_binary_bytes));
      r.data.address = std::string(text);
      WIRE_ASSIGN(text, d.str_or(2, limits.max_string_bytes));
      r.data.segment = std::string(text);
      WIRE_ASSIGN(r.data.base, d.u64_or(3, 0));
      WIRE_ASSIGN(r.pool_bytes, f.u64(9));
      WIRE_ASSIGN(r.max_tensor_bytes, f.u64(10));
      return ReplyBody{std::move(r)};
    }
    case Op::reserve_batch: {
      static const std::array<std::string_view, 1> kNames = {"items"};
      Fields<1> f(kNames, "body");
      ECX_RETURN_IF_ERROR(f.read(body, StatusCode::protocol));
      const msgpack::object_array* items = nullptr;
      WIRE_ASSIGN(items, f.array(0, limits.max_batch_items));
      ReserveBatchReply r;
      r.items.reserve(items->size);
      for (std::uint32_t i = 0; i < items->size; ++i) {
        auto item = read_reserve_result(items->ptr[i], i, limits);
        if (!item) return item.status();
        r.items.push_back(std::move(*item));
      }
      return ReplyBody{std::move(r)};
    }
    case Op::cancel: {
      static const std::array<std::string_view, 1> kNames = {"cancelled"};
      Fields<1> f(kNames, "body");
      ECX_RETURN_IF_ERROR(f.read(body, StatusCode::protocol));
      CancelReply r;
      WIRE_ASSIGN(r.cancelled, f.boolean(0));
      return ReplyBody{r};
    }
    case Op::status: {
      static const std::array<std::string_view, 8> kNames = {"found",      "state",  "mm_hash", "reservation_id",
                                                             "generation", "nbytes", "shape",   "dtype"};
      Fields<8> f(kNames, "body");
      ECX_RETURN_IF_ERROR(f.read(body, StatusCode::protocol));
      StatusReply r;
      WIRE_ASSIGN(r.found, f.boolean(0));
      if (!r.found) return ReplyBody{std::move(r)};
      std::string_view text;
      WIRE_ASSIGN(text, f.str(1, 64));
      r.state = std::string(text);
      WIRE_ASSIGN(text, f.str(2, kMaxIdLength));
      r.mm_hash = std::string(text);
      WIRE_ASSIGN(r.reservation_id, f.reservation_or_none(3));
      WIRE_ASSIGN(r.generation, f.u64_or(4, 0));
      if (f.has(5) || f.has(6) || f.has(7)) {
        auto spec = read_spec(f, 5, 6, 7);
        if (!spec) return spec.status();
        r.spec = std::move(*spec);
      }
      return ReplyBody{std::move(r)};
    }
    case Op::complete: {
      static const std::array<std::string_view, 2> kNames = {"completed", "became_ready"};
      Fields<2> f(kNames, "body");
      ECX_RETURN_IF_ERROR(f.read(body, StatusCode::protocol));
      CompleteReply r;
      WIRE_ASSIGN(r.completed, f.boolean(0));
      WIRE_ASSIGN(r.became_ready, f.boolean(1));
      return ReplyBody{r};
    }
  }
  return protocol_error("unknown op");
}

}  // namespace

// ------------------------------------------------------------------ public

void encode_request(const Request& request, const AuthStamp* stamp, std::string& out) {
  out.clear();
  StringSink sink{&out};
  Packer pk(sink);
  pk.pack_map(4 + (request.timeout_ms ? 1 : 0) + stamp_fields(stamp));
  put_str(pk, "v");
  pk.pack(kProtocolVersion);
  put_str(pk, "id");
  pk.pack(request.id);
  put_str(pk, "op");
  put_str(pk, op_name(request.op()));
  if (request.timeout_ms) {
    put_str(pk, "timeout_ms");
    pk.pack(request.timeout_ms);
  }
  put_stamp(pk, stamp);
  put_str(pk, "body");
  std::visit(RequestBodyWriter{pk}, request.body);
}

void encode_reply(const Reply& reply, const AuthStamp* stamp, std::string& out) {
  out.clear();
  StringSink sink{&out};
  Packer pk(sink);
  const bool ok = reply.status.is_ok();
  pk.pack_map(5 + stamp_fields(stamp));
  put_str(pk, "v");
  pk.pack(kProtocolVersion);
  put_str(pk, "id");
  pk.pack(reply.id);
  put_str(pk, "op");
  put_str(pk, op_name(reply.op));
  put_str(pk, "ok");
  put_bool(pk, ok);
  put_stamp(pk, stamp);
  if (ok) {
    put_str(pk, "body");
    std::visit(ReplyBodyWriter{pk}, reply.body);
  } else {
    put_str(pk, "error");
    put_error(pk, reply.status, reply.reason, reply.peer_min_version, reply.peer_max_version);
  }
}

void encode_event(const Event& event, const AuthStamp* stamp, std::string& out) {
  out.clear();
  StringSink sink{&out};
  Packer pk(sink);
  pk.pack_map(5 + stamp_fields(stamp));
  put_str(pk, "v");
  pk.pack(kProtocolVersion);
  put_str(pk, "ev");
  put_str(pk, event_kind_name(event.kind));
  put_str(pk, "shard");
  pk.pack(event.shard);
  put_str(pk, "instance");
  put_str(pk, event.instance);
  put_stamp(pk, stamp);
  put_str(pk, "body");
  const bool has_rid = !event.reservation_id.is_none();
  switch (event.kind) {
    case EventKind::ready:
      pk.pack_map(4 + (event.spec ? 3 : 0) + (event.sent_ns != 0 ? 1 : 0));
      break;
    case EventKind::abandoned:
      pk.pack_map(2 + (has_rid ? 1 : 0));
      break;
    case EventKind::failed:
      pk.pack_map(3 + (has_rid ? 1 : 0));
      break;
  }
  put_str(pk, "transfer_id");
  put_str(pk, event.transfer_id);
  put_str(pk, "mm_hash");
  put_str(pk, event.mm_hash);
  if (event.kind == EventKind::ready) {
    put_str(pk, "reservation_id");
    put_reservation(pk, event.reservation_id);
    put_str(pk, "generation");
    pk.pack(event.generation);
    if (event.spec) put_shape(pk, *event.spec);
    if (event.sent_ns != 0) {
      put_str(pk, "sent_ns");
      pk.pack(event.sent_ns);
    }
  } else if (has_rid) {
    put_str(pk, "reservation_id");
    put_reservation(pk, event.reservation_id);
  }
  if (event.kind == EventKind::failed) {
    put_str(pk, "error");
    put_error(pk, event.error.is_ok() ? internal_error("unspecified failure") : event.error, RejectReason::none, 0, 0);
  }
}

Reply make_reject_reply(std::uint64_t id, RejectReason reason, std::string message) {
  Reply r;
  r.id = id;
  r.status = protocol_error(std::move(message));
  r.reason = reason;
  if (reason == RejectReason::version_mismatch) {
    r.peer_min_version = kMinProtocolVersion;
    r.peer_max_version = kProtocolVersion;
  }
  return r;
}

// A frame that parsed but whose content is wrong: rejected as malformed, with a
// protocol error that says why.
namespace {
Status malformed(Envelope* env, const Status& why) {
  env->reason = RejectReason::malformed;
  return Status(StatusCode::protocol, why.message());
}
}  // namespace

Result<DecodedRequest> decode_request(std::string_view frame, const Limits& limits, Envelope* envelope) {
  Envelope local;
  Envelope* env = envelope ? envelope : &local;
  *env = Envelope{};
  auto handle = parse_frame(frame, limits, env);
  if (!handle) return handle.status();
  static const std::array<std::string_view, 8> kNames = {"v", "id", "sid", "seq", "ts", "op", "timeout_ms", "body"};
  Fields<8> f(kNames, "request");
  if (Status s = f.read(handle->get(), StatusCode::protocol); !s) return malformed(env, s);
  ECX_RETURN_IF_ERROR(read_header(f, /*with_id=*/true, env));
  if (env->id == 0) return malformed(env, protocol_error("request.id must not be 0"));
  auto op_text = f.str(5, 64);
  if (!op_text) return malformed(env, op_text.status());
  const auto op = parse_op(*op_text);
  if (!op) {
    env->reason = RejectReason::unknown_op;
    return protocol_error(fmt::format("unknown op '{}'", *op_text));
  }
  DecodedRequest out;
  out.request.id = env->id;
  auto timeout = f.u64_or(6, 0, kU32Max);
  if (!timeout) return malformed(env, timeout.status());
  out.request.timeout_ms = static_cast<std::uint32_t>(*timeout);
  auto body = read_request_body(*op, f.get(7), limits, out.item_errors);
  if (!body) return malformed(env, body.status());
  out.request.body = std::move(*body);
  return out;
}

Result<Reply> decode_reply(std::string_view frame, const Limits& limits, Envelope* envelope) {
  Envelope local;
  Envelope* env = envelope ? envelope : &local;
  *env = Envelope{};
  auto handle = parse_frame(frame, limits, env);
  if (!handle) return handle.status();
  static const std::array<std::string_view, 9> kNames = {"v", "id", "sid", "seq", "ts", "op", "ok", "body", "error"};
  Fields<9> f(kNames, "reply");
  if (Status s = f.read(handle->get(), StatusCode::protocol); !s) return malformed(env, s);
  if (Status s = read_header(f, /*with_id=*/true, env); !s) {
    // A version_mismatch answer from a peer of another version is still readable:
    // its envelope (v, id, ok, error) is the same in every version.
    if (env->reason != RejectReason::version_mismatch) return s;
    if (!f.has(8)) return s;
  }
  Reply r;
  r.id = env->id;
  auto ok = f.boolean(6);
  if (!ok) return malformed(env, ok.status());
  auto op_text = f.str_or(5, 64);
  if (!op_text) return malformed(env, op_text.status());
  if (*ok) {
    const auto op = parse_op(*op_text);
    if (!op) return malformed(env, protocol_error(fmt::format("reply.op '{}' is unknown", op_text->substr(0, 64))));
    if (env->reason == RejectReason::version_mismatch)
      return malformed(env, protocol_error("reply of an unsupported version"));
    r.op = *op;
    if (!f.has(7)) return malformed(env, f.missing(7));
    auto body = read_reply_body(*op, *f.get(7), limits);
    if (!body) return malformed(env, body.status());
    r.body = std::move(*body);
    return r;
  }
  if (const auto op = parse_op(*op_text)) r.op = *op;
  if (!f.has(8)) return malformed(env, f.missing(8));
  auto error = read_error(*f.get(8), "reply.error", limits);
  if (!error) return malformed(env, error.status());
  r.status = error->status;
  r.reason = error->reason;
  r.peer_min_version = error->min_version;
  r.peer_max_version = error->max_version;
  env->reason = RejectReason::none;
  return r;
}

Result<Event> decode_event(std::string_view frame, const Limits& limits, Envelope* envelope) {
  Envelope local;
  Envelope* env = envelope ? envelope : &local;
  *env = Envelope{};
  auto handle = parse_frame(frame, limits, env);
  if (!handle) return handle.status();
  // Index 1 ("id") is unused by events; keeping the header layout shared.
  static const std::array<std::string_view, 9> kNames = {"v",  "",      "sid",      "seq", "ts",
                                                         "ev", "shard", "instance", "body"};
  Fields<9> f(kNames, "event");
  if (Status s = f.read(handle->get(), StatusCode::protocol); !s) return malformed(env, s);
  ECX_RETURN_IF_ERROR(read_header(f, /*with_id=*/false, env));
  Event e;
  auto kind_text = f.str(5, 64);
  if (!kind_text) return malformed(env, kind_text.status());
  const auto kind = parse_event_kind(*kind_text);
  if (!kind) {
    env->reason = RejectReason::unknown_op;
    return protocol_error(fmt::format("unknown event '{}'", kind_text->substr(0, 64)));
  }
  e.kind = *kind;
  auto shard = f.u64(6, kU32Max);
  if (!shard) return malformed(env, shard.status());
  e.shard = static_cast<std::uint32_t>(*shard);
  auto instance = f.str(7, limits.max_string_bytes);
  if (!instance) return malformed(env, instance.status());
  e.instance = std::string(*instance);
  if (!f.has(8)) return malformed(env, f.missing(8));

  static const std::array<std::string_view, 9> kBody = {
      "transfer_id", "mm_hash", "reservation_id", "generation", "nbytes", "shape", "dtype", "error", "sent_ns"};
  Fields<9> b(kBody, "event.body");
  if (Status s = b.read(*f.get(8), StatusCode::protocol); !s) return malformed(env, s);
  auto transfer_id = b.str(0, kMaxIdLength);
  if (!transfer_id) return malformed(env, transfer_id.status());
  if (Status s = validate_transfer_id(*transfer_id); !s) return malformed(env, s);
  e.transfer_id = std::string(*transfer_id);
  auto mm_hash = b.str(1, kMaxIdLength);
  if (!mm_hash) return malformed(env, mm_hash.status());
  // Abandoned and failed events may come from a tombstone that never learnt the hash.
  if (!mm_hash->empty() || e.kind == EventKind::ready) {
    if (Status s = validate_mm_hash(*mm_hash); !s) return malformed(env, s);
  }
  e.mm_hash = std::string(*mm_hash);
  auto rid = e.kind == EventKind::ready ? b.reservation(2) : b.reservation_or_none(2);
  if (!rid) return malformed(env, rid.status());
  e.reservation_id = *rid;
  if (e.kind == EventKind::ready) {
    auto generation = b.u64(3);
    if (!generation) return malformed(env, generation.status());
    e.generation = *generation;
    auto spec = read_spec(b, 4, 5, 6);
    if (!spec) return malformed(env, spec.status());
    e.spec = std::move(*spec);
    if (b.has(8)) {
      auto sent = b.u64(8);
      if (!sent) return malformed(env, sent.status());
      e.sent_ns = *sent;
    }
  }
  if (e.kind == EventKind::failed) {
    if (!b.has(7)) return malformed(env, b.missing(7));
    auto error = read_error(*b.get(7), "event.body.error", limits);
    if (!error) return malformed(env, error.status());
    e.error = error->status;
  }
  return e;
}

}  // namespace ecx::wire
