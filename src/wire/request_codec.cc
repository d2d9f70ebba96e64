// Requests: the body of each op written and read, and the request envelope.
#include "ecx/wire/codec.h"

#include <array>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <msgpack.hpp>

#include "ecx/core/ids.h"
#include "wire/msgpack_reader.h"
#include "wire/msgpack_writer.h"

namespace ecx::wire {
namespace {

using detail::Fields;
using detail::kU32Max;
using detail::malformed;
using detail::Obj;
using detail::Packer;
using detail::parse_frame;
using detail::put_reservation;
using detail::put_shape;
using detail::put_stamp;
using detail::put_str;
using detail::read_header;
using detail::read_spec;
using detail::stamp_fields;
using detail::StringSink;

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
  void operator()(const CancelBatchRequest& r) const {
    pk.pack_map(1);
    put_str(pk, "items");
    pk.pack_array(static_cast<std::uint32_t>(r.items.size()));
    for (const CancelRequest& item : r.items) (*this)(item);
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

Status check_id(const Status& s, StatusCode code) { return s.is_ok() ? s : Status(code, s.message()); }

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
  return ReserveItem{std::string(transfer_id), std::string(mm_hash), *spec, checksum};
}

// One cancel: the body of `cancel`, or one item of `cancel_batch` (path names it).
Result<CancelRequest> read_cancel(const Obj& o, std::string path) {
  static const std::array<std::string_view, 4> kNames = {"transfer_id", "reservation_id", "abandon", "refresh"};
  Fields<4> f(kNames, std::move(path));
  ECX_RETURN_IF_ERROR(f.read(o, StatusCode::invalid_argument));
  CancelRequest r;
  std::string_view transfer_id;
  WIRE_ASSIGN(transfer_id, f.str(0, kMaxIdLength));
  ECX_RETURN_IF_ERROR(check_id(validate_transfer_id(transfer_id), StatusCode::invalid_argument));
  r.transfer_id = std::string(transfer_id);
  WIRE_ASSIGN(r.reservation_id, f.reservation_or_none(1));
  WIRE_ASSIGN(r.abandon, f.boolean_or(2, false));
  WIRE_ASSIGN(r.refresh, f.boolean_or(3, false));
  return r;
}

// A batch body's items, each read by `read_one`; one that does not decode is recorded
// in `item_errors` (and answered as an error by the server) while the others go on.
template <typename Item, typename ReadOne>
Result<std::vector<Item>> read_batch(const Obj& body, const Limits& limits, std::vector<ItemError>& item_errors,
                                     ReadOne read_one) {
  std::vector<Item> out;
  auto items = detail::batch_items(body, limits);
  if (!items) return items.status();
  out.reserve((*items)->size);
  for (std::uint32_t i = 0; i < (*items)->size; ++i) {
    auto item = read_one((*items)->ptr[i], i);
    if (item) {
      out.push_back(std::move(*item));
    } else {
      item_errors.push_back(ItemError{i, item.status()});
    }
  }
  return out;
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
      ReserveBatchRequest r;
      WIRE_ASSIGN(r.items, read_batch<ReserveItem>(body, limits, item_errors,
                                                   [](const Obj& o, std::uint32_t i) { return read_item(o, i); }));
      return RequestBody{std::move(r)};
    }
    case Op::cancel: {
      auto r = read_cancel(body, "body");
      if (!r) return r.status();
      return RequestBody{std::move(*r)};
    }
    case Op::cancel_batch: {
      CancelBatchRequest r;
      WIRE_ASSIGN(r.items, read_batch<CancelRequest>(body, limits, item_errors, [](const Obj& o, std::uint32_t i) {
                    return read_cancel(o, fmt::format("items[{}]", i));
                  }));
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

}  // namespace

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

}  // namespace ecx::wire
