// The reservation machine's cancel: from the consumer's scheduler (abandon = false),
// from the producer giving up (abandon = true) or re-reserving at once (refresh). One
// step per case; cancel_locked() only decides which case a request is.
//
// The rule behind every case: a slot a writer may still be writing is never released
// by a cancel. Such a cancel is deferred (cancel_pending / expire_pending) until the
// write ends, unless the writer itself says it stopped and its word settles the slot
// (writer_can_stop).

#include <utility>

#include "consumer/reservation_core.h"

namespace ecx::consumer::detail {

CancelOutcome ReservationCore::cancel(const CancelRequest& req) {
  std::lock_guard lock(mu_);
  expire_locked();
  return count_cancel(cancel_locked(req));
}

CancelOutcome ReservationCore::count_cancel(CancelOutcome outcome) {
  if (outcome == CancelOutcome::rejected) {
    ++counters_.cancels_rejected;
  } else {
    ++counters_.cancels_accepted;
    if (outcome == CancelOutcome::deferred) ++counters_.cancels_deferred;
    if (outcome == CancelOutcome::pre_reserved) ++counters_.pre_reserved_tombstones;
  }
  return outcome;
}

CancelOutcome ReservationCore::cancel_locked(const CancelRequest& req) {
  Record* r = find(req.transfer_id);
  if (r == nullptr) return cancel_unknown(req);
  if (!req.reservation_id.is_none() && !r->reservation_id.is_none() && req.reservation_id != r->reservation_id) {
    return CancelOutcome::rejected;  // a stale cancel must not touch a newer reservation
  }
  if (is_terminal(r->state)) return cancel_terminal(*r, req.refresh);
  if (req.refresh) return req.abandon ? refresh(*r) : CancelOutcome::rejected;
  if (!r->writer) return cancel_now(*r, req.abandon);
  switch (r->state) {
    case S::ready:
      return cancel_now(*r, req.abandon);
    case S::writing:
      return req.abandon ? abandon_writer(*r, S::cancelled) : cancel_writing(*r);
    case S::landing:
      return cancel_landing(*r, req.abandon);
    case S::cancel_pending:
    case S::expire_pending:
      return cancel_deferred(*r, req.abandon);
    default:
      return CancelOutcome::rejected;
  }
}

// No record: the cancel came first. A tombstone makes the reserve that may still
// arrive see a cancelled transfer.
CancelOutcome ReservationCore::cancel_unknown(const CancelRequest& req) {
  // A refresh of something unknown has nothing to release; a tombstone would refuse
  // the re-reserve that follows it.
  if (req.refresh) return req.abandon ? CancelOutcome::refreshed : CancelOutcome::rejected;
  if (!validate_transfer_id(req.transfer_id).is_ok()) return CancelOutcome::rejected;
  Record t;
  t.transfer_id = req.transfer_id;
  t.state = S::cancelled;
  auto [it, inserted] = records_.emplace(req.transfer_id, std::move(t));
  (void)inserted;
  count_state(it->second, +1);
  entomb(it->second);
  return CancelOutcome::pre_reserved;
}

// A tombstone: nothing is held any more, the cancel only confirms.
CancelOutcome ReservationCore::cancel_terminal(Record& r, bool refresh) {
  switch (r.state) {
    case S::cancelled:
      entomb(r);  // refresh the tombstone's deadline
      return CancelOutcome::already_cancelled;
    case S::failed:
      return CancelOutcome::already_terminal;
    default:  // expired
      if (refresh) return CancelOutcome::refreshed;
      if (transition(r, S::cancelled)) entomb(r);
      return CancelOutcome::already_terminal;
  }
}

// The producer gives up this reservation and re-reserves at once: the old record
// ends (expired, so the re-reserve is not told the transfer is cancelled).
CancelOutcome ReservationCore::refresh(Record& r) {
  if (r.writer) return refresh_writer(r);
  if (r.state != S::writing) return CancelOutcome::rejected;
  detach_follower(r);
  if (transition(r, S::expired)) entomb(r);
  return CancelOutcome::refreshed;
}

CancelOutcome ReservationCore::refresh_writer(Record& r) {
  switch (r.state) {
    case S::writing:
      // Other transfers of the same content wait on this landing: giving the slot up
      // would abandon them. Refused; the writer's reserve again finds the same
      // reservation, its TTL re-armed, and a producer giving space back keeps it.
      if (store_.filled_by(r.entry, r.transfer_id) && !store_.at(r.entry).followers.empty()) {
        return CancelOutcome::rejected;
      }
      [[fallthrough]];
    case S::expire_pending:
      if (!writer_can_stop(r)) return CancelOutcome::deferred;  // the payload is landing right now
      close_own_write(r);
      terminate_writer(r, S::expired, true);
      return CancelOutcome::refreshed;
    case S::landing:
      transition(r, S::expire_pending);
      return CancelOutcome::deferred;
    case S::cancel_pending:
      if (!writer_can_stop(r)) return CancelOutcome::rejected;
      // The consumer cancelled while the writer still held the slot. The writer's
      // refresh is its abandon: refusing it would leave the slot deferred for good
      // (the re-reserve that follows is told the transfer is cancelled, so nothing
      // else would ever settle it).
      return abandon_writer(r, S::cancelled);
    default:
      return CancelOutcome::rejected;
  }
}

// A follower or a READY record: nothing writes on its behalf, release now.
CancelOutcome ReservationCore::cancel_now(Record& r, bool abandon) {
  if (r.state == S::writing) {
    detach_follower(r);
    if (abandon) publish(AbandonedEvent{r.transfer_id, r.mm_hash});
  }
  if (transition(r, S::cancelled)) entomb(r);
  return CancelOutcome::cancelled;
}

// The consumer cancels a writer whose payload has not started to land. Deferred
// while the producer may write (one-sided), or while followers still wait for this
// landing (receiver-chosen).
CancelOutcome ReservationCore::cancel_writing(Record& r) {
  const bool write_open = writer_may_write(r);
  if (write_open || !store_.at(r.entry).followers.empty()) {
    transition(r, S::cancel_pending);
    if (write_open) disarm_deadline(r);  // only the writer's completion or abandon ends it
    return CancelOutcome::deferred;
  }
  terminate_writer(r, S::cancelled, false);
  return CancelOutcome::cancelled;
}

// The payload is landing: the cancel waits for complete_landing, which ends the
// transfer (the landed content stays resident).
CancelOutcome ReservationCore::cancel_landing(Record& r, bool abandon) {
  if (abandon) publish(AbandonedEvent{r.transfer_id, r.mm_hash});
  transition(r, S::cancel_pending);
  return CancelOutcome::deferred;
}

// Already deferred. The writer's abandon settles it where writer_can_stop; a
// consumer's cancel turns a deferred expiry into a deferred cancel.
CancelOutcome ReservationCore::cancel_deferred(Record& r, bool abandon) {
  if (abandon && writer_can_stop(r)) return abandon_writer(r, r.state == S::expire_pending ? S::expired : S::cancelled);
  if (r.state == S::expire_pending && !abandon) transition(r, S::cancel_pending);
  return CancelOutcome::deferred;
}

// The writer stopped: the write it held open (one-sided) is over, the transfer ends
// in `to` with an abandoned event, and its followers lose their landing.
CancelOutcome ReservationCore::abandon_writer(Record& r, S to) {
  close_own_write(r);
  publish(AbandonedEvent{r.transfer_id, r.mm_hash});
  terminate_writer(r, to, true);
  return CancelOutcome::cancelled;
}

// Whether the writer's word that it stopped settles its slot. One-sided: the producer
// is the only one who writes, so its abandon ends the write it holds open.
// Receiver-chosen: an open write is a landing under way, which only its completion ends.
bool ReservationCore::writer_can_stop(const Record& r) const {
  return options_.mode == LandingMode::one_sided || !writer_may_write(r);
}

void ReservationCore::close_own_write(Record& r) {
  if (writer_may_write(r)) close_write(r.entry);
}

}  // namespace ecx::consumer::detail
