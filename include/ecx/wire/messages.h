#pragma once
// Control-plane messages as plain structs. The codec (codec.h) turns them into
// msgpack frames and back; docs/protocol.md gives the field-by-field wire format.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ecx/core/ids.h"
#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"
#include "ecx/wire/protocol.h"

namespace ecx::wire {

// ---- hello: a shard describes itself and names its siblings.

struct HelloRequest {
  std::string client;  // free-form name of the caller, for the server's logs ("" = anonymous)
  friend bool operator==(const HelloRequest&, const HelloRequest&) = default;
};

// Where the payloads for this shard go. `address` is opaque to the control plane
// (a UCX worker address, or a Mooncake session "host:port").
struct DataPlane {
  std::string transport;   // "ucx" | "mooncake"
  std::string address;     // bytes (msgpack bin)
  std::string segment;     // one-sided mode: pool segment name ("" = none)
  std::uint64_t base = 0;  // one-sided mode: pool base address
  friend bool operator==(const DataPlane&, const DataPlane&) = default;
};

struct HelloReply {
  std::uint32_t shard = 0;  // this shard's TP rank
  std::uint32_t tp_size = 1;
  std::vector<std::uint32_t> control_ports;  // control port of every shard, index = rank
  std::uint32_t event_port = 0;              // this shard's PUSH port
  std::string instance;                      // changes whenever the shard restarts
  std::uint32_t min_version = kMinProtocolVersion;
  std::uint32_t max_version = kProtocolVersion;
  std::vector<std::string> features;
  DataPlane data;
  std::uint64_t pool_bytes = 0;        // receive pool capacity
  std::uint64_t max_tensor_bytes = 0;  // largest single payload accepted
  bool has_feature(std::string_view feature) const {
    return std::find(features.begin(), features.end(), feature) != features.end();
  }
  friend bool operator==(const HelloReply&, const HelloReply&) = default;
};

// ---- reserve_batch

struct ReserveItem {
  std::string transfer_id;
  std::string mm_hash;
  TensorSpec spec;                        // shape + dtype; nbytes on the wire must match
  std::optional<std::uint64_t> checksum;  // xxHash64 of the payload, when the producer computes one
  friend bool operator==(const ReserveItem&, const ReserveItem&) = default;
};

struct ReserveBatchRequest {
  std::vector<ReserveItem> items;
  friend bool operator==(const ReserveBatchRequest&, const ReserveBatchRequest&) = default;
};

enum class ReserveOutcome : std::uint8_t { reserved, ready, cancelled, retry, error };
inline constexpr std::size_t kReserveOutcomeCount = 5;
std::string_view reserve_outcome_name(ReserveOutcome outcome) noexcept;

// One item's answer. Which fields mean something depends on `outcome`:
// reserved: reservation_id, generation, slot_bytes, write, offset (one-sided mode);
// ready: reservation_id, cached; retry: retry_after_ms; error: error.
struct ReserveResult {
  ReserveOutcome outcome = ReserveOutcome::error;
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  std::uint64_t slot_bytes = 0;
  bool write = true;                    // false: another transfer already writes this content
  std::optional<std::uint64_t> offset;  // offset of the slot in the pool segment (one-sided mode)
  bool cached = false;
  std::uint32_t retry_after_ms = 0;
  Status error;

  static ReserveResult reserved(ReservationId id, std::uint64_t generation, std::uint64_t slot_bytes, bool write = true,
                                std::optional<std::uint64_t> offset = std::nullopt);
  static ReserveResult ready(ReservationId id, bool cached);
  static ReserveResult cancelled();
  static ReserveResult retry(std::uint32_t after_ms);
  static ReserveResult failed(Status error);
  friend bool operator==(const ReserveResult&, const ReserveResult&) = default;
};

struct ReserveBatchReply {
  std::vector<ReserveResult> items;  // same order and count as the request's items
  friend bool operator==(const ReserveBatchReply&, const ReserveBatchReply&) = default;
};

// ---- cancel

struct CancelRequest {
  std::string transfer_id;
  ReservationId reservation_id;  // none = whatever reservation the transfer holds
  bool abandon = false;          // the producer gives up writing (frees a writer-owned slot)
  bool refresh = false;          // with abandon: expire a stale reservation so that it can be re-reserved
  friend bool operator==(const CancelRequest&, const CancelRequest&) = default;
};

struct CancelReply {
  bool cancelled = false;
  friend bool operator==(const CancelReply&, const CancelReply&) = default;
};

// ---- cancel_batch: many cancels in one frame (a shard announces kFeatureCancelBatch).
// The scheduler releases every item its engine is done with; one round trip per
// shard and step instead of one per item.

struct CancelBatchRequest {
  std::vector<CancelRequest> items;
  friend bool operator==(const CancelBatchRequest&, const CancelBatchRequest&) = default;
};

// One item's answer: `cancelled` as in CancelReply, or the error that item got (a
// malformed item, or what the shard's cancel answered); one bad item never fails
// the others.
struct CancelResult {
  bool cancelled = false;
  Status error;
  friend bool operator==(const CancelResult&, const CancelResult&) = default;
};

struct CancelBatchReply {
  std::vector<CancelResult> items;  // same order and count as the request's items
  friend bool operator==(const CancelBatchReply&, const CancelBatchReply&) = default;
};

// ---- status (diagnostic)

struct StatusRequest {
  std::string transfer_id;
  friend bool operator==(const StatusRequest&, const StatusRequest&) = default;
};

struct StatusReply {
  bool found = false;
  std::string state;  // the reservation state's name, e.g. "writing", "ready"
  std::string mm_hash;
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  std::optional<TensorSpec> spec;
  friend bool operator==(const StatusReply&, const StatusReply&) = default;
};

// ---- complete (one-sided mode only: the producer says its write has landed)

struct CompleteRequest {
  std::string transfer_id;
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  std::optional<std::uint64_t> checksum = std::nullopt;  // xxHash64 of what was written (checksums on)
  friend bool operator==(const CompleteRequest&, const CompleteRequest&) = default;
};

struct CompleteReply {
  bool completed = false;
  bool became_ready = false;
  friend bool operator==(const CompleteReply&, const CompleteReply&) = default;
};

// ---- envelopes

using RequestBody =
    std::variant<HelloRequest, ReserveBatchRequest, CancelRequest, StatusRequest, CompleteRequest, CancelBatchRequest>;
using ReplyBody = std::variant<std::monostate, HelloReply, ReserveBatchReply, CancelReply, StatusReply, CompleteReply,
                               CancelBatchReply>;

Op op_of(const RequestBody& body) noexcept;

struct Request {
  std::uint64_t id = 0;          // chosen by the client, echoed by the reply; never 0
  std::uint32_t timeout_ms = 0;  // how long the client waits (0 = not said)
  RequestBody body;
  Op op() const noexcept { return op_of(body); }
};

struct Reply {
  std::uint64_t id = 0;                      // the request's id; 0 when the request's id was unreadable
  Op op = Op::hello;                         // meaningful when ok()
  Status status;                             // ok, or the error the server answered
  RejectReason reason = RejectReason::none;  // set when the server refused the frame itself
  std::uint32_t peer_min_version = 0;        // version_mismatch: what the server accepts
  std::uint32_t peer_max_version = 0;
  ReplyBody body;  // monostate unless ok()
  bool ok() const noexcept { return status.is_ok(); }
};

// ---- events (PUSH -> PULL)

struct Event {
  EventKind kind = EventKind::ready;
  std::uint32_t shard = 0;  // TP rank of the shard that published it
  std::string instance;     // the publishing shard's instance id
  std::string transfer_id;
  std::string mm_hash;
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  std::optional<TensorSpec> spec;  // ready: shape, dtype, nbytes
  Status error;                    // failed: why
  // ready, optional (0 = absent): the publisher's CLOCK_MONOTONIC in ns when it sent
  // the event; a receiver on the same host times the delivery with it.
  std::uint64_t sent_ns = 0;
  friend bool operator==(const Event&, const Event&) = default;
};

}  // namespace ecx::wire
