#include "ecx/consumer/reservation_types.h"

#include <fmt/format.h>

#include "ecx/core/transition_table.h"

namespace ecx::consumer {

namespace {

using S = ReservationState;

// Failing a transfer is allowed from every active state, so an unexpected event can
// always fail just that transfer.
constexpr TransitionTable<S, kReservationStateCount> kTransitions{
    {S::writing, {S::landing, S::ready, S::cancel_pending, S::expire_pending, S::cancelled, S::expired, S::failed}},
    {S::landing, {S::ready, S::cancel_pending, S::expire_pending, S::failed}},
    {S::ready, {S::cancelled, S::expired, S::failed}},
    {S::cancel_pending, {S::cancelled, S::failed}},
    {S::expire_pending, {S::cancel_pending, S::cancelled, S::expired, S::failed}},
    // A cancel turns an expiry tombstone into a cancel tombstone, so a late reserve of
    // a transfer the consumer gave up on is refused instead of starting over.
    {S::expired, {S::cancelled}},
};

}  // namespace

std::string_view reservation_state_name(ReservationState state) noexcept {
  switch (state) {
    case S::writing:
      return "writing";
    case S::landing:
      return "landing";
    case S::ready:
      return "ready";
    case S::cancel_pending:
      return "cancel_pending";
    case S::expire_pending:
      return "expire_pending";
    case S::cancelled:
      return "cancelled";
    case S::expired:
      return "expired";
    case S::failed:
      return "failed";
  }
  return "unknown";
}

bool is_terminal(ReservationState state) noexcept {
  return state == S::cancelled || state == S::expired || state == S::failed;
}

bool reservation_transition_allowed(ReservationState from, ReservationState to) noexcept {
  return kTransitions.allows(from, to);
}

std::string describe(const ReserveOutcome& result) {
  struct Visitor {
    std::string operator()(const outcome::Reserved& r) const {
      return fmt::format("reserved(reservation_id={}, generation={}, offset={}, length={}, write={})",
                         r.reservation_id.to_string(), r.generation, r.slot_offset, r.slot_length, r.write);
    }
    std::string operator()(const outcome::Ready& r) const {
      return fmt::format("ready(reservation_id={}, cached={})", r.reservation_id.to_string(), r.cached);
    }
    std::string operator()(const outcome::Cancelled&) const { return "cancelled"; }
    std::string operator()(const outcome::RetryAfter& r) const {
      return fmt::format("retry_after({} ms)", std::chrono::duration_cast<std::chrono::milliseconds>(r.delay).count());
    }
    std::string operator()(const outcome::Refused& r) const { return "refused(" + r.status.to_string() + ")"; }
  };
  return std::visit(Visitor{}, result);
}

std::string_view cancel_outcome_name(CancelOutcome outcome) noexcept {
  switch (outcome) {
    case CancelOutcome::rejected:
      return "rejected";
    case CancelOutcome::pre_reserved:
      return "pre_reserved";
    case CancelOutcome::already_cancelled:
      return "already_cancelled";
    case CancelOutcome::already_terminal:
      return "already_terminal";
    case CancelOutcome::deferred:
      return "deferred";
    case CancelOutcome::cancelled:
      return "cancelled";
    case CancelOutcome::refreshed:
      return "refreshed";
  }
  return "unknown";
}

std::string_view landing_refusal_name(LandingRefusal refusal) noexcept {
  switch (refusal) {
    case LandingRefusal::none:
      return "none";
    case LandingRefusal::unknown_transfer:
      return "unknown_transfer";
    case LandingRefusal::stale_reservation:
      return "stale_reservation";
    case LandingRefusal::not_writer:
      return "not_writer";
    case LandingRefusal::not_awaiting_payload:
      return "not_awaiting_payload";
    case LandingRefusal::size_mismatch:
      return "size_mismatch";
    case LandingRefusal::direct_turned_away:
      return "direct_turned_away";
  }
  return "unknown";
}

std::string_view completion_outcome_name(CompletionOutcome outcome) noexcept {
  switch (outcome) {
    case CompletionOutcome::became_ready:
      return "became_ready";
    case CompletionOutcome::released:
      return "released";
    case CompletionOutcome::failed:
      return "failed";
    case CompletionOutcome::repeated:
      return "repeated";
    case CompletionOutcome::rejected:
      return "rejected";
  }
  return "unknown";
}

}  // namespace ecx::consumer
