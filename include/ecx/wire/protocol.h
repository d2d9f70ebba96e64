#pragma once
// Constants of the ECX control protocol (docs/protocol.md is the specification).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace ecx::wire {

// Every message carries `v`. Peers speaking the same version interoperate; a peer
// accepts any version in [kMinProtocolVersion, kProtocolVersion] and answers any
// other one with a version_mismatch error naming both ranges. Adding an optional
// field does not change the version (receivers ignore unknown keys); removing a
// field, changing a type or a meaning, or adding a required field does.
inline constexpr std::uint32_t kProtocolVersion = 1;
inline constexpr std::uint32_t kMinProtocolVersion = 1;

// Bounds enforced while decoding, before anything is allocated for a field.
struct Limits {
  std::size_t max_frame_bytes = std::size_t{1} << 20;  // Config::max_frame_bytes
  std::size_t max_batch_items = 4096;                  // items of one reserve_batch or cancel_batch
  std::size_t max_string_bytes = 4096;                 // any string (ids are further capped at 256)
  std::size_t max_binary_bytes = 16384;                // a data-plane address
  std::size_t max_map_entries = 64;                    // keys of any map
  std::size_t max_list_entries = 1024;                 // shard lists, feature lists
  std::size_t max_depth = 8;                           // nesting of maps and arrays
};

enum class Op : std::uint8_t { hello, reserve_batch, cancel, status, complete, cancel_batch };
inline constexpr std::size_t kOpCount = 6;
std::string_view op_name(Op op) noexcept;
std::optional<Op> parse_op(std::string_view name) noexcept;

enum class EventKind : std::uint8_t { ready, abandoned, failed };
inline constexpr std::size_t kEventKindCount = 3;
std::string_view event_kind_name(EventKind kind) noexcept;
std::optional<EventKind> parse_event_kind(std::string_view name) noexcept;

// Why a request was refused before reaching a handler; sent as `error.reason` beside
// the code `protocol` so that a peer can tell the cases apart without parsing text.
enum class RejectReason : std::uint8_t { none, malformed, too_large, unknown_op, version_mismatch, unauthenticated };
std::string_view reject_reason_name(RejectReason reason) noexcept;
RejectReason parse_reject_reason(std::string_view name) noexcept;  // unknown names -> none

// The three directions a frame can travel; part of what the HMAC covers, so that a
// captured reply cannot be replayed as a request or an event.
enum class FrameKind : char { request = 'Q', reply = 'R', event = 'E' };

// Feature flags a shard may advertise in its hello reply.
// How payloads land: the shard picks each landing from the payload's header (UCX, in
// either ucx_mode), or the producer writes at the reserved offset and `complete`s.
inline constexpr std::string_view kFeatureReceiverLands = "receiver_lands";
inline constexpr std::string_view kFeatureOneSided = "one_sided";
inline constexpr std::string_view kFeatureDirect = "direct_payloads";  // lands payloads sent without a reservation
inline constexpr std::string_view kFeatureChecksum = "checksum";       // xxHash64 verified on landing
inline constexpr std::string_view kFeatureAuth = "auth";               // HMAC-authenticated frames
inline constexpr std::string_view kFeatureCancelBatch =
    "cancel_batch";  // answers cancel_batch (many cancels, one frame)

}  // namespace ecx::wire
