// Events: ready, abandoned and failed, written and read with their envelope.
#include "ecx/wire/codec.h"

#include <array>
#include <string>
#include <utility>

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
using detail::Packer;
using detail::parse_frame;
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

}  // namespace

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
    e.spec = *spec;
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
