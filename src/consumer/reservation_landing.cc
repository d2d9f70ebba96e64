// The reservation machine's write path (a landing accepted, a write completed or
// failed, the checksum checked) and the worker's take of a landed slot.

#include <utility>

#include <fmt/format.h>

#include "consumer/reservation_core.h"

namespace ecx::consumer::detail {

// ---------------------------------------------------------------- landing

LandingResolution ReservationCore::resolve_landing(std::string_view tid, const ReservationId& rid, std::uint64_t nbytes,
                                                   std::uint64_t generation) {
  std::lock_guard lock(mu_);
  auto refuse = [this](LandingRefusal why) {
    ++counters_.landings_refused;
    return LandingResolution{std::nullopt, why};
  };
  Record* r = find(tid);
  if (r == nullptr) return refuse(LandingRefusal::unknown_transfer);
  if (is_terminal(r->state)) return refuse(LandingRefusal::not_awaiting_payload);
  if (r->reservation_id != rid || (generation != 0 && generation != r->generation)) {
    return refuse(LandingRefusal::stale_reservation);
  }
  if (!r->writer) return refuse(LandingRefusal::not_writer);
  if (options_.mode != LandingMode::receiver_chosen || store_.at(r->entry).write_open || r->finishing ||
      (r->state != S::writing && r->state != S::cancel_pending)) {
    return refuse(LandingRefusal::not_awaiting_payload);
  }
  if (nbytes != r->spec->nbytes()) return refuse(LandingRefusal::size_mismatch);
  return open_landing(*r, nbytes);
}

LandingResolution ReservationCore::open_landing(Record& r, std::uint64_t nbytes) {
  store_.open_write(r.entry);
  if (r.state == S::writing) transition(r, S::landing);
  disarm_deadline(r);  // a landing cannot be timed out from here: only its completion ends it
  ++counters_.landings_accepted;
  return LandingResolution{LandingTarget{store_.data(r.entry), nbytes, r.generation}, LandingRefusal::none};
}

DirectLandingResolution ReservationCore::resolve_direct_landing(const ReserveRequest& req) {
  std::lock_guard lock(mu_);
  auto turn_away = [this](std::string why) {
    ++counters_.landings_refused;
    ++counters_.direct_turned_away;
    return DirectLandingResolution{LandingResolution{std::nullopt, LandingRefusal::direct_turned_away}, ReservationId(),
                                   std::move(why)};
  };
  if (options_.mode != LandingMode::receiver_chosen) return turn_away("this shard does not land payloads itself");
  // A transfer it already knows (reserved, cancelled before its payload, ...) keeps to
  // the usual path, whose reserve reply says what became of it.
  if (find(req.transfer_id) != nullptr) return turn_away("the transfer already has a record");
  // Content resident or already landing: the producer's reserve makes the record (a
  // resident hit or a follower). Made here as well, the reserve that follows could find
  // it taken already and make a second one, whose READY nobody would take.
  if (store_.resident(req.mm_hash) != kNoSlot || store_.filling(req.mm_hash) != kNoSlot) {
    return turn_away("its content is resident or already landing here");
  }
  const ReserveOutcome reserved = reserve_and_settle_waiter(req);
  const auto* slot = std::get_if<outcome::Reserved>(&reserved);
  Record* r = slot != nullptr && slot->write ? find(req.transfer_id) : nullptr;
  if (r == nullptr) return turn_away(consumer::describe(reserved));
  ++counters_.direct_accepted;
  return DirectLandingResolution{open_landing(*r, req.spec.nbytes()), r->reservation_id, {}};
}

CompletionOutcome ReservationCore::complete_write(std::string_view tid, const ReservationId& rid, bool ok,
                                                  std::optional<std::uint64_t> checksum, bool one_sided_call,
                                                  std::optional<std::uint64_t> generation) {
  std::unique_lock lock(mu_);
  auto reject = [this] {
    ++counters_.completions_rejected;
    return CompletionOutcome::rejected;
  };
  auto accepts = [&](const Record& rec) {
    if (rec.reservation_id != rid || !rec.writer || rec.entry == kNoSlot || rec.finishing) return false;
    if (generation && *generation != rec.generation) return false;
    if (!store_.at(rec.entry).write_open) return false;
    const bool mode_ok = one_sided_call == (options_.mode == LandingMode::one_sided);
    const S first = one_sided_call ? S::writing : S::landing;
    return mode_ok && (rec.state == first || rec.state == S::cancel_pending || rec.state == S::expire_pending);
  };
  Record* r = find(tid);
  // A one-sided producer repeating its completion, or completing a follower it never
  // wrote, must not fail its whole batch: both are accepted no-ops.
  if (one_sided_call && r != nullptr && r->reservation_id == rid && (!generation || *generation == r->generation) &&
      (r->state == S::ready || !r->writer) && !is_terminal(r->state)) {
    return CompletionOutcome::repeated;
  }
  if (r == nullptr || !accepts(*r)) return reject();

  std::string reason = ok ? "" : "the payload did not arrive completely";
  if (ok && options_.checksum) {
    const std::optional<std::uint64_t> expected = checksum ? checksum : store_.at(r->entry).expected_checksum;
    if (!expected) {
      ok = false;
      reason = "checksums are on but the producer sent none";
    } else {
      // Hash outside the lock: the slot cannot be freed or reused while its write is
      // open, and `finishing` keeps a second completion out.
      r->finishing = true;
      const SlotBytes bytes = store_.bytes(r->entry, r->spec->nbytes());
      const std::string key(tid);
      lock.unlock();
      const std::uint64_t actual = bytes.xxh64();
      lock.lock();
      r = find(key);
      if (r == nullptr) return reject();  // unreachable: records with an open write are never erased
      r->finishing = false;
      if (actual != *expected) {
        ok = false;
        ++counters_.checksum_mismatches;
        reason = fmt::format("checksum mismatch: landed xxh64={:016x}, producer sent {:016x}", actual, *expected);
        log_->warn("transfer_id={} mm_hash={}: {}", r->transfer_id, r->mm_hash, reason);
      }
    }
  }
  bool became_ready = false;
  const bool landed = ok;
  finish_write(*r, ok, reason, &became_ready);
  if (!landed) return CompletionOutcome::failed;
  return became_ready ? CompletionOutcome::became_ready : CompletionOutcome::released;
}

void ReservationCore::finish_write(Record& r, bool ok, const std::string& reason, bool* became_ready) {
  const SlotId entry_id = r.entry;
  close_write(entry_id);
  if (ok) {
    counters_.bytes_landed += r.spec->nbytes();
    ++counters_.landings_ready;
    for (const std::string& tid : store_.land(entry_id)) {
      Record* f = find(tid);
      if (f == nullptr || f->state != S::writing) continue;
      if (transition(*f, S::ready)) {
        arm_deadline(*f, now() + options_.ttl);
        publish_ready(*f);
      }
    }
    if (r.state == S::landing || r.state == S::writing) {
      if (transition(r, S::ready)) {
        arm_deadline(r, now() + options_.ttl);
        publish_ready(r);
        *became_ready = true;
      }
    } else {
      // Cancelled or expired while the payload was landing: the transfer ends now,
      // the landed content stays resident for its followers and later reserves.
      if (transition(r, r.state == S::expire_pending ? S::expired : S::cancelled)) entomb(r);
    }
    // entomb() above may already have released (or even reclaimed) the slot.
    store_.settle(entry_id);
    return;
  }
  ++counters_.landings_failed;
  lose_filling(entry_id, S::failed, true);
  if (r.state == S::landing || r.state == S::writing) {
    if (transition(r, S::failed)) {
      publish(FailedEvent{r.transfer_id, r.mm_hash, reason});
      entomb(r);
    }
  } else if (transition(r, r.state == S::expire_pending ? S::expired : S::cancelled)) {
    entomb(r);
  }
}

// ---------------------------------------------------------------- take

SlotLease ReservationCore::make_lease(SlotId id) {
  store_.lease(id);
  ++counters_.taken;
  const SlotEntry& e = store_.at(id);
  return SlotLease(shared_from_this(), id, store_.data(id), e.slot.offset, e.spec, e.mm_hash);
}

Result<SlotLease> ReservationCore::take(std::string_view tid, std::string_view mm_hash) {
  std::lock_guard lock(mu_);
  Record* r = find(tid);
  if (r == nullptr || r->state != S::ready || r->mm_hash != mm_hash || r->entry == kNoSlot) {
    ++counters_.takes_refused;
    return not_found(fmt::format("pushed tensor is not ready for transfer_id={} mm_hash={} ({})", tid, mm_hash,
                                 r == nullptr ? "unknown" : reservation_state_name(r->state)));
  }
  // The lease holds the slot before the record lets go of its own hold.
  SlotLease lease = make_lease(r->entry);
  const std::string key(tid);
  erase_record(key);
  return lease;
}

Result<SlotLease> ReservationCore::take_resident(std::string_view mm_hash, const TensorSpec& spec) {
  std::lock_guard lock(mu_);
  const SlotId id = store_.resident(std::string(mm_hash));
  if (id == kNoSlot) {
    ++counters_.takes_refused;
    return not_found(fmt::format("no resident copy of mm_hash={}", mm_hash));
  }
  const SlotEntry& e = store_.at(id);
  if (e.spec != spec) {
    ++counters_.takes_refused;
    return conflict(fmt::format("resident mm_hash={} is {}, not {}", mm_hash, e.spec.to_string(), spec.to_string()));
  }
  return make_lease(id);
}

void ReservationCore::release_lease(SlotId entry_id) noexcept {
  std::lock_guard lock(mu_);
  store_.release_lease(entry_id);
}

}  // namespace ecx::consumer::detail
