#pragma once
// Value types of the consumer's reservation lifecycle. The control server maps wire
// messages onto these; the reservation manager knows nothing about sockets.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "ecx/core/clock.h"
#include "ecx/core/ids.h"
#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"

namespace ecx::consumer {

// Record states. Active: writing, landing, ready, cancel_pending, expire_pending.
// Terminal (kept as bounded tombstones): cancelled, expired, failed.
//   writing         reserved; the writer's payload has not started to land (followers
//                   wait here for their writer's landing)
//   landing         the transport is receiving the payload into the slot
//   ready           landed; waiting for take()
//   cancel_pending  cancelled while a writer may still write into the slot
//   expire_pending  expired (or refreshed) while a writer may still write
enum class ReservationState : unsigned char {
  writing,
  landing,
  ready,
  cancel_pending,
  expire_pending,
  cancelled,
  expired,
  failed,
};
inline constexpr std::size_t kReservationStateCount = 8;

std::string_view reservation_state_name(ReservationState state) noexcept;
bool is_terminal(ReservationState state) noexcept;
// The validated transition table; every state change of a record goes through it.
bool reservation_transition_allowed(ReservationState from, ReservationState to) noexcept;

// How payloads reach the slab.
enum class LandingMode : unsigned char {
  // The consumer's transport asks resolve_landing() where a payload goes and reports
  // complete_landing(); a slot can be written only between the two.
  receiver_chosen,
  // The producer writes straight into the slot (RDMA put): from reserve until
  // writer_completed()/writer_abandoned() the slot may be written at any time.
  one_sided,
};

struct ReserveRequest {
  std::string transfer_id;
  std::string mm_hash;
  TensorSpec spec;
  // xxHash64 of the payload when the producer already knows it; the landing may also
  // carry it (complete_landing's value wins).
  std::optional<std::uint64_t> checksum;
};

namespace outcome {
// A slot is held for this transfer. write == true: this producer must send the
// payload (the writer). write == false: another transfer is already bringing the same
// content (a follower), or the payload is already landing; a readiness event follows.
struct Reserved {
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  std::uint64_t slot_offset = 0;  // from the start of the receive slab
  std::uint64_t slot_length = 0;  // exactly the payload size
  bool write = true;
};
// The content is already here: cached == true when a resident copy served it (a
// readiness event is queued), false when this transfer had already landed.
struct Ready {
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  bool cached = false;
};
// The transfer was cancelled (possibly before it was reserved); do not send.
struct Cancelled {};
// The pool is full right now; ask again after `delay`.
struct RetryAfter {
  Duration delay{};
};
// Refused: the status says why (conflict, invalid_argument, unavailable, ...).
struct Refused {
  Status status;
};
}  // namespace outcome

using ReserveOutcome =
    std::variant<outcome::Reserved, outcome::Ready, outcome::Cancelled, outcome::RetryAfter, outcome::Refused>;
std::string describe(const ReserveOutcome& result);

// What a cancel did (for replies and counters).
enum class CancelOutcome : unsigned char {
  rejected,           // reservation id mismatch, or not allowed in this state
  pre_reserved,       // no record: a tombstone now refuses a later reserve
  already_cancelled,  // tombstone refreshed
  already_terminal,   // expired or failed before; nothing held
  deferred,           // a writer may still write; released when it finishes
  cancelled,          // released now
  refreshed,          // the old destination is gone; the next reserve gets a new one
};
std::string_view cancel_outcome_name(CancelOutcome outcome) noexcept;
inline bool cancel_accepted(CancelOutcome outcome) noexcept { return outcome != CancelOutcome::rejected; }

struct CancelRequest {
  std::string transfer_id;
  ReservationId reservation_id;  // none = whichever reservation holds the id
  bool abandon = false;          // the producer gives up writing (it will not write)
  bool refresh = false;          // the producer will re-reserve at once (needs abandon)
};

// Where an accepted payload lands.
struct LandingTarget {
  std::byte* data = nullptr;
  std::uint64_t length = 0;
  std::uint64_t generation = 0;
};
enum class LandingRefusal : unsigned char {
  none,
  unknown_transfer,      // no live record for the transfer id
  stale_reservation,     // reservation id or generation do not match the record's
  not_writer,            // a follower or a resident hit: nothing to write
  not_awaiting_payload,  // landed, landing, terminal, or shutting down
  size_mismatch,         // the payload is not exactly the reserved size
  direct_turned_away,    // a direct payload whose reserve did not make it the writer of a free slot
};
std::string_view landing_refusal_name(LandingRefusal refusal) noexcept;

struct LandingResolution {
  std::optional<LandingTarget> target;  // set when accepted
  LandingRefusal refusal = LandingRefusal::none;
  bool accepted() const noexcept { return target.has_value(); }
};

// resolve_direct_landing(): the landing, the reservation the payload now writes (when
// accepted), and what its reserve answered (when turned away).
struct DirectLandingResolution {
  LandingResolution landing;
  ReservationId reservation_id;
  std::string reserve_outcome;
};

// Result of complete_landing / writer_completed.
enum class CompletionOutcome : unsigned char {
  became_ready,  // the writer (and its followers) are READY
  released,      // the write finished after a cancel/expiry: the record is terminal
  failed,        // transport failure or checksum mismatch: the transfer failed
  repeated,      // one-sided: already READY, or a follower (nothing to complete); a no-op
  rejected,      // unknown transfer, stale reservation, or no write in progress
};
std::string_view completion_outcome_name(CompletionOutcome outcome) noexcept;

// Events the manager publishes; the caller drains and sends them.
struct ReadyEvent {
  std::string transfer_id;
  std::string mm_hash;
  std::uint64_t nbytes = 0;
  TensorSpec spec;
  ReservationId reservation_id;
};
struct AbandonedEvent {
  std::string transfer_id;
  std::string mm_hash;
};
struct FailedEvent {
  std::string transfer_id;
  std::string mm_hash;
  std::string reason;
};
using ReservationEvent = std::variant<ReadyEvent, AbandonedEvent, FailedEvent>;

struct ReservationCounters {
  // reserve outcomes
  std::uint64_t reserved_writer = 0;
  std::uint64_t reserved_follower = 0;
  std::uint64_t reserved_repeat = 0;  // idempotent re-reserve of a live record
  std::uint64_t resident_hits = 0;    // served from a resident copy (cached)
  std::uint64_t ready_repeat = 0;     // re-reserve of an already READY record
  std::uint64_t reserve_cancelled = 0;
  std::uint64_t retry_afters = 0;
  std::uint64_t retry_afters_for_older = 0;  // of retry_afters: space held back for a starving reserve
  std::uint64_t reserve_refused = 0;
  // cancels
  std::uint64_t cancels_accepted = 0;
  std::uint64_t cancels_rejected = 0;
  std::uint64_t cancels_deferred = 0;
  std::uint64_t pre_reserved_tombstones = 0;
  // landing
  std::uint64_t landings_accepted = 0;
  std::uint64_t landings_refused = 0;
  std::uint64_t landings_ready = 0;
  std::uint64_t landings_failed = 0;
  std::uint64_t completions_rejected = 0;
  std::uint64_t direct_accepted = 0;     // direct payloads that reserved on arrival and landed
  std::uint64_t direct_turned_away = 0;  // direct payloads whose producer reserves the usual way instead
  std::uint64_t checksum_mismatches = 0;
  std::uint64_t bytes_reserved = 0;
  std::uint64_t bytes_landed = 0;
  // lifecycle
  std::uint64_t expired = 0;
  std::uint64_t taken = 0;
  std::uint64_t takes_refused = 0;
  std::uint64_t residents_reclaimed = 0;
  std::uint64_t invalid_transitions = 0;
  std::uint64_t events_dropped = 0;
  std::uint64_t tombstones_dropped = 0;  // beyond tombstone_max
  // gauges
  std::uint64_t pool_capacity = 0;
  std::uint64_t pool_used_bytes = 0;
  std::uint64_t live_records = 0;
  std::uint64_t writers = 0;  // writer records not yet terminal or READY
  std::uint64_t followers = 0;
  std::uint64_t ready = 0;
  std::uint64_t deferred = 0;
  std::uint64_t tombstones = 0;
  std::uint64_t resident_entries = 0;  // landed copies indexed by content
  std::uint64_t resident_bytes = 0;
  std::uint64_t leases = 0;  // outstanding take()/take_resident() leases
  std::uint64_t pending_events = 0;
};

}  // namespace ecx::consumer
