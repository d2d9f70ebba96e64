#pragma once
// msgpack encoding and strict, bounded decoding of control frames.
//
// Decoding never throws and never trusts a declared length: every container and
// string is bounded by Limits before it is materialised, every field's msgpack type
// is checked, duplicate keys are refused, unknown keys are ignored (that is how
// optional fields are added without a version change).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ecx/core/status.h"
#include "ecx/wire/messages.h"
#include "ecx/wire/protocol.h"

namespace ecx::wire {

// Replay-protection fields carried by authenticated frames (see auth.h).
struct AuthStamp {
  std::uint64_t sender = 0;   // random per sending socket, never 0
  std::uint64_t seq = 0;      // 1, 2, 3, ... per sender
  std::uint64_t time_ms = 0;  // sender's wall clock, milliseconds since the Unix epoch
  friend bool operator==(const AuthStamp&, const AuthStamp&) = default;
};

// What could be read of a frame's envelope, filled in even when decoding fails so
// that a server can still echo the request id and say why it refused the frame.
struct Envelope {
  std::uint32_t version = 0;  // 0 = unreadable
  std::uint64_t id = 0;       // 0 = unreadable (requests and replies)
  std::optional<AuthStamp> stamp;
  RejectReason reason = RejectReason::none;  // set on failure
};

// Encoders append to `out` (cleared first). `stamp` is written when non-null.
void encode_request(const Request& request, const AuthStamp* stamp, std::string& out);
void encode_reply(const Reply& reply, const AuthStamp* stamp, std::string& out);
void encode_event(const Event& event, const AuthStamp* stamp, std::string& out);

// A decoded reserve_batch keeps the items that passed validation in `request`, and
// for each refused item its position in the frame and why: one bad item must not
// fail the others.
struct ItemError {
  std::uint32_t index = 0;
  Status error;
};

struct DecodedRequest {
  Request request;
  std::vector<ItemError> item_errors;  // reserve_batch and cancel_batch only; sorted by index
};

Result<DecodedRequest> decode_request(std::string_view frame, const Limits& limits, Envelope* envelope = nullptr);
Result<Reply> decode_reply(std::string_view frame, const Limits& limits, Envelope* envelope = nullptr);
Result<Event> decode_event(std::string_view frame, const Limits& limits, Envelope* envelope = nullptr);

// The reply a server sends for a frame it refused (malformed, unknown op, wrong
// version, unauthenticated): code `protocol`, the reason, and for a version mismatch
// the versions this side accepts.
Reply make_reject_reply(std::uint64_t id, RejectReason reason, std::string message);

}  // namespace ecx::wire
