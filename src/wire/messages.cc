#include "ecx/wire/messages.h"

#include <array>

namespace ecx::wire {
namespace {

constexpr std::array<std::string_view, kOpCount> kOpNames = {"hello",  "reserve_batch", "cancel",
                                                             "status", "complete",      "cancel_batch"};
constexpr std::array<std::string_view, kEventKindCount> kEventNames = {"ready", "abandoned", "failed"};
constexpr std::array<std::string_view, 6> kReasonNames = {"",           "malformed",        "too_large",
                                                          "unknown_op", "version_mismatch", "unauthenticated"};
constexpr std::array<std::string_view, kReserveOutcomeCount> kOutcomeNames = {"reserved", "ready", "cancelled", "retry",
                                                                              "error"};

}  // namespace

std::string_view op_name(Op op) noexcept { return kOpNames[static_cast<std::size_t>(op)]; }

std::optional<Op> parse_op(std::string_view name) noexcept {
  for (std::size_t i = 0; i < kOpNames.size(); ++i) {
    if (kOpNames[i] == name) return static_cast<Op>(i);
  }
  return std::nullopt;
}

std::string_view event_kind_name(EventKind kind) noexcept { return kEventNames[static_cast<std::size_t>(kind)]; }

std::optional<EventKind> parse_event_kind(std::string_view name) noexcept {
  for (std::size_t i = 0; i < kEventNames.size(); ++i) {
    if (kEventNames[i] == name) return static_cast<EventKind>(i);
  }
  return std::nullopt;
}

std::string_view reject_reason_name(RejectReason reason) noexcept {
  return kReasonNames[static_cast<std::size_t>(reason)];
}

RejectReason parse_reject_reason(std::string_view name) noexcept {
  for (std::size_t i = 1; i < kReasonNames.size(); ++i) {
    if (kReasonNames[i] == name) return static_cast<RejectReason>(i);
  }
  return RejectReason::none;
}

std::string_view reserve_outcome_name(ReserveOutcome outcome) noexcept {
  return kOutcomeNames[static_cast<std::size_t>(outcome)];
}

ReserveResult ReserveResult::reserved(ReservationId id, std::uint64_t generation, std::uint64_t slot_bytes, bool write,
                                      std::optional<std::uint64_t> offset) {
  ReserveResult r;
  r.outcome = ReserveOutcome::reserved;
  r.reservation_id = id;
  r.generation = generation;
  r.slot_bytes = slot_bytes;
  r.write = write;
  r.offset = offset;
  return r;
}

ReserveResult ReserveResult::ready(ReservationId id, bool cached) {
  ReserveResult r;
  r.outcome = ReserveOutcome::ready;
  r.reservation_id = id;
  r.cached = cached;
  r.write = false;
  return r;
}

ReserveResult ReserveResult::cancelled() {
  ReserveResult r;
  r.outcome = ReserveOutcome::cancelled;
  r.write = false;
  return r;
}

ReserveResult ReserveResult::retry(std::uint32_t after_ms) {
  ReserveResult r;
  r.outcome = ReserveOutcome::retry;
  r.retry_after_ms = after_ms;
  r.write = false;
  return r;
}

ReserveResult ReserveResult::failed(Status error) {
  ReserveResult r;
  r.outcome = ReserveOutcome::error;
  r.write = false;
  r.error = error.is_ok() ? internal_error("error result built from an ok status") : std::move(error);
  return r;
}

Op op_of(const RequestBody& body) noexcept { return static_cast<Op>(body.index()); }

}  // namespace ecx::wire
