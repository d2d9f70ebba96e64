// Replies: the body of each op written and read, the reply envelope (a body when
// ok, an error map otherwise), and the reply a server sends for a refused frame.
#include "ecx/wire/codec.h"

#include <array>
#include <optional>
#include <string>
#include <utility>
#include <variant>

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
using detail::put_bin;
using detail::put_bool;
using detail::put_error;
using detail::put_reservation;
using detail::put_shape;
using detail::put_stamp;
using detail::put_str;
using detail::read_error;
using detail::read_header;
using detail::read_spec;
using detail::stamp_fields;
using detail::StringSink;

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
  void operator()(const CancelBatchReply& r) const {
    pk.pack_map(1);
    put_str(pk, "items");
    pk.pack_array(static_cast<std::uint32_t>(r.items.size()));
    for (const CancelResult& item : r.items) {
      pk.pack_map(1);
      if (item.error.is_ok()) {
        put_str(pk, "cancelled");
        put_bool(pk, item.cancelled);
      } else {
        put_str(pk, "error");
        put_error(pk, item.error, RejectReason::none, 0, 0);
      }
    }
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

// One item of a cancel_batch reply: {cancelled: bool} or {error: error map}.
Result<CancelResult> read_cancel_result(const Obj& o, std::uint32_t index, const Limits& limits) {
  static const std::array<std::string_view, 2> kNames = {"cancelled", "error"};
  Fields<2> f(kNames, fmt::format("items[{}]", index));
  ECX_RETURN_IF_ERROR(f.read(o, StatusCode::protocol));
  CancelResult r;
  if (f.has(1)) {
    auto error = read_error(*f.get(1), f.path() + ".error", limits);
    if (!error) return error.status();
    r.error = error->status.is_ok() ? internal_error("unspecified error") : error->status;
    return r;
  }
  WIRE_ASSIGN(r.cancelled, f.boolean(0));
  return r;
}

// A batch reply's items, one per request item: a reply with an item that does not
// decode is malformed as a whole (the client could not tell which answer is whose).
template <typename Item>
Result<std::vector<Item>> read_batch(const Obj& body, const Limits& limits,
                                     Result<Item> (*read_one)(const Obj&, std::uint32_t, const Limits&)) {
  auto items = detail::batch_items(body, limits);
  if (!items) return items.status();
  std::vector<Item> out;
  out.reserve((*items)->size);
  for (std::uint32_t i = 0; i < (*items)->size; ++i) {
    auto item = read_one((*items)->ptr[i], i, limits);
    if (!item) return item.status();
    out.push_back(std::move(*item));
  }
  return out;
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
      ReserveBatchReply r;
      WIRE_ASSIGN(r.items, read_batch(body, limits, read_reserve_result));
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
    case Op::cancel_batch: {
      CancelBatchReply r;
      WIRE_ASSIGN(r.items, read_batch(body, limits, read_cancel_result));
      return ReplyBody{std::move(r)};
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
        r.spec = *spec;
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

}  // namespace ecx::wire
