#include "wire/msgpack_reader.h"

#include <algorithm>
#include <exception>
#include <new>

namespace ecx::wire::detail {

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

Result<const msgpack::object_array*> batch_items(const Obj& body, const Limits& limits) {
  static const std::array<std::string_view, 1> kNames = {"items"};
  Fields<1> f(kNames, "body");
  ECX_RETURN_IF_ERROR(f.read(body, StatusCode::protocol));
  return f.array(0, limits.max_batch_items);
}

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

namespace {

// One emptied zone per thread, kept between frames (see ParsedFrame).
thread_local std::unique_ptr<msgpack::zone> spare_zone;

std::unique_ptr<msgpack::zone> take_zone() {
  if (spare_zone) return std::move(spare_zone);
  return std::make_unique<msgpack::zone>();
}

}  // namespace

ParsedFrame::~ParsedFrame() {
  if (!zone_ || spare_zone) return;  // a second zone alive on this thread is simply freed
  // Frees every chunk but the first. The tree registered no finalizers: its strings
  // and binaries reference the frame.
  zone_->clear();
  spare_zone = std::move(zone_);
}

Result<ParsedFrame> parse_frame(std::string_view frame, const Limits& limits, Envelope* envelope) {
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
    auto zone = take_zone();
    const msgpack::object root = msgpack::unpack(
        *zone, frame.data(), frame.size(), offset, [](msgpack::type::object_type, std::size_t, void*) { return true; },
        nullptr, bounds);
    if (offset != frame.size()) {
      return refuse(RejectReason::malformed, fmt::format("{} trailing bytes after the message", frame.size() - offset));
    }
    return ParsedFrame(root, std::move(zone));
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

Status malformed(Envelope* env, const Status& why) {
  env->reason = RejectReason::malformed;
  return Status(StatusCode::protocol, why.message());
}

}  // namespace ecx::wire::detail
