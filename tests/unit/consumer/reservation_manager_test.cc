#include "ecx/consumer/reservation_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include <xxhash.h>

#include "reservation_test_util.h"

namespace ecx::consumer {
namespace {

using namespace std::chrono_literals;
using testing::as;
using testing::events_of;
using testing::Harness;
using testing::request;
using S = ReservationState;

// ------------------------------------------------------------- transition table

TEST(ReservationTransitions, TableIsExactlyTheDocumentedOne) {
  const std::set<std::pair<S, S>> allowed = {
      {S::writing, S::landing},
      {S::writing, S::ready},
      {S::writing, S::cancel_pending},
      {S::writing, S::expire_pending},
      {S::writing, S::cancelled},
      {S::writing, S::expired},
      {S::writing, S::failed},
      {S::landing, S::ready},
      {S::landing, S::cancel_pending},
      {S::landing, S::expire_pending},
      {S::landing, S::failed},
      {S::ready, S::cancelled},
      {S::ready, S::expired},
      {S::ready, S::failed},
      {S::cancel_pending, S::cancelled},
      {S::cancel_pending, S::failed},
      {S::expire_pending, S::cancel_pending},
      {S::expire_pending, S::cancelled},
      {S::expire_pending, S::expired},
      {S::expire_pending, S::failed},
      {S::expired, S::cancelled},
  };
  for (std::size_t f = 0; f < kReservationStateCount; ++f) {
    for (std::size_t t = 0; t < kReservationStateCount; ++t) {
      const auto from = static_cast<S>(f);
      const auto to = static_cast<S>(t);
      EXPECT_EQ(reservation_transition_allowed(from, to), allowed.contains({from, to}))
          << reservation_state_name(from) << " -> " << reservation_state_name(to);
    }
  }
}

TEST(ReservationTransitions, EveryActiveStateCanFailAndTerminalStatesStayTerminal) {
  for (S s : {S::writing, S::landing, S::ready, S::cancel_pending, S::expire_pending}) {
    EXPECT_FALSE(is_terminal(s));
    EXPECT_TRUE(reservation_transition_allowed(s, S::failed)) << reservation_state_name(s);
  }
  for (S s : {S::cancelled, S::expired, S::failed}) EXPECT_TRUE(is_terminal(s));
  for (S to : {S::writing, S::landing, S::ready, S::cancel_pending, S::expire_pending, S::expired, S::failed}) {
    EXPECT_FALSE(reservation_transition_allowed(S::cancelled, to));
    EXPECT_FALSE(reservation_transition_allowed(S::failed, to));
  }
}

// ------------------------------------------------------------- reserve

TEST(Reserve, NewTransferGetsAWriterSlot) {
  Harness h;
  auto r = h.reserve_writer("t1", "h1", 1000);
  EXPECT_TRUE(r.write);
  EXPECT_FALSE(r.reservation_id.is_none());
  EXPECT_GT(r.generation, 0u);
  EXPECT_EQ(r.slot_length, 1000u);
  EXPECT_EQ(r.slot_offset % 256, 0u);
  EXPECT_EQ(h.manager->state_of("t1"), S::writing);
  const auto c = h.manager->counters();
  EXPECT_EQ(c.pool_used_bytes, 1024u);
  EXPECT_EQ(c.reserved_writer, 1u);
  EXPECT_EQ(c.writers, 1u);
  EXPECT_EQ(c.bytes_reserved, 1000u);
  h.expect_invariants();
}

TEST(Reserve, RepeatIsIdempotentAndKeepsTheReservation) {
  Harness h;
  auto first = h.reserve_writer("t1", "h1", 1000);
  auto again = as<outcome::Reserved>(h.manager->reserve(request("t1", "h1", 1000)));
  EXPECT_EQ(again.reservation_id, first.reservation_id);
  EXPECT_EQ(again.generation, first.generation);
  EXPECT_EQ(again.slot_offset, first.slot_offset);
  EXPECT_TRUE(again.write);  // a producer whose first reply was lost may still send
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 1024u);
  EXPECT_EQ(h.manager->counters().reserved_repeat, 1u);
}

TEST(Reserve, RepeatExtendsTheDeadlineOfAnUnfinishedReservation) {
  Harness h;
  h.reserve_writer("t1", "h1", 1000);
  h.clock->advance(200s);
  h.reserve_writer("t1", "h1", 1000);
  h.clock->advance(200s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("t1"), S::writing);
}

// Lessons 9 and 10: a transfer id naming different content fails only the newcomer.
TEST(Reserve, CollidingTransferIdIsRefusedAndTheFirstSurvives) {
  Harness h;
  auto first = h.reserve_writer("t1", "h1", 1000);
  auto refused = as<outcome::Refused>(h.manager->reserve(request("t1", "other", 1000)));
  EXPECT_EQ(refused.status.code(), StatusCode::conflict);
  auto refused_shape = as<outcome::Refused>(h.manager->reserve(request("t1", "h1", 2000)));
  EXPECT_EQ(refused_shape.status.code(), StatusCode::conflict);
  EXPECT_EQ(h.manager->state_of("t1"), S::writing);
  h.land("t1", first);
  EXPECT_EQ(h.manager->state_of("t1"), S::ready);
}

TEST(Reserve, InvalidIdsAndOversizedTensorsAreRefused) {
  Harness h(4096);
  EXPECT_EQ(as<outcome::Refused>(h.manager->reserve(request("", "h", 10))).status.code(), StatusCode::invalid_argument);
  EXPECT_EQ(as<outcome::Refused>(h.manager->reserve(request("t 1", "h", 10))).status.code(),
            StatusCode::invalid_argument);
  EXPECT_EQ(as<outcome::Refused>(h.manager->reserve(request("t", "h\n", 10))).status.code(),
            StatusCode::invalid_argument);
  // Larger than the whole pool: waiting would never help, so no retry_after.
  EXPECT_EQ(as<outcome::Refused>(h.manager->reserve(request("t", "h", 5000))).status.code(),
            StatusCode::invalid_argument);
  EXPECT_EQ(h.manager->counters().reserve_refused, 4u);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
}

TEST(Reserve, FullPoolAnswersRetryAfterInsteadOfFailing) {
  Harness h(4096);
  h.reserve_writer("a", "ha", 2048);
  h.reserve_writer("b", "hb", 2048);
  auto retry = as<outcome::RetryAfter>(h.manager->reserve(request("c", "hc", 1024)));
  EXPECT_EQ(retry.delay, h.options.retry_after);
  EXPECT_EQ(h.manager->counters().retry_afters, 1u);
  EXPECT_FALSE(h.manager->state_of("c").has_value());  // nothing recorded: the retry is a fresh reserve
  EXPECT_EQ(h.manager->cancel({"a", {}, false, false}), CancelOutcome::cancelled);
  auto ok = as<outcome::Reserved>(h.manager->reserve(request("c", "hc", 1024)));
  EXPECT_TRUE(ok.write);
  h.expect_invariants();
}

// What wakes the reserves the control server holds for space: every slot that frees
// or becomes reclaimable is signalled, and nothing else is.
TEST(Reserve, ASlotThatFreesOrBecomesReclaimableIsSignalled) {
  Harness h(4096);
  int signals = 0;
  h.options.space_freed = [&signals] { ++signals; };
  h.manager = std::make_unique<ReservationManager>(h.options, h.clock);
  const auto a = h.reserve_writer("a", "ha", 2048);
  h.reserve_writer("b", "hb", 2048);
  EXPECT_EQ(signals, 0) << "reserving frees nothing";
  EXPECT_EQ(h.manager->cancel({"b", {}, false, false}), CancelOutcome::cancelled);
  EXPECT_EQ(signals, 1) << "a cancelled writer's slot is free";
  h.land("a", a);
  auto lease = h.manager->take("a", "ha");
  ASSERT_TRUE(lease) << lease.status().to_string();
  const int before_release = signals;
  lease->release();
  EXPECT_GT(signals, before_release) << "a released landed slot is resident: reclaimable";
  h.expect_invariants();
}

// A large reserve the full pool keeps turning away must not starve while smaller
// ones take every block that frees up: past starvation_after, what frees up is held
// for it.
TEST(Reserve, AReserveRefusedForLongGetsTheNextSpaceBeforeNewerOnes) {
  Harness h(4096);
  for (const char* id : {"a", "b", "c", "d"}) h.reserve_writer(id, std::string("h") + id, 1024);
  // The producer retries w every half second (a real one, every retry_after).
  auto keep_retrying_w = [&](Duration for_how_long) {
    for (Duration waited{}; waited < for_how_long; waited += 500ms) {
      h.clock->advance(500ms);
      EXPECT_TRUE(std::holds_alternative<outcome::RetryAfter>(h.manager->reserve(request("w", "hw", 2048))));
    }
  };
  EXPECT_TRUE(std::holds_alternative<outcome::RetryAfter>(h.manager->reserve(request("w", "hw", 2048))));
  keep_retrying_w(10s);
  ASSERT_EQ(h.manager->cancel({"a", {}, false, false}), CancelOutcome::cancelled);
  // Not waited long enough yet: first come, first served.
  EXPECT_TRUE(std::holds_alternative<outcome::Reserved>(h.manager->reserve(request("n1", "hn1", 1024))));
  EXPECT_EQ(h.manager->counters().retry_afters_for_older, 0u);
  keep_retrying_w(5500ms);  // w has now waited 15.5 s
  ASSERT_EQ(h.manager->cancel({"n1", {}, false, false}), CancelOutcome::cancelled);
  EXPECT_TRUE(std::holds_alternative<outcome::RetryAfter>(h.manager->reserve(request("n2", "hn2", 1024))));
  EXPECT_EQ(h.manager->counters().retry_afters_for_older, 1u);
  ASSERT_EQ(h.manager->cancel({"b", {}, false, false}), CancelOutcome::cancelled);
  EXPECT_TRUE(std::holds_alternative<outcome::Reserved>(h.manager->reserve(request("w", "hw", 2048))));
  // Served: the newer reserve waits only for space now.
  EXPECT_TRUE(std::holds_alternative<outcome::RetryAfter>(h.manager->reserve(request("n2", "hn2", 1024))));
  EXPECT_EQ(h.manager->counters().retry_afters_for_older, 1u);
  ASSERT_EQ(h.manager->cancel({"c", {}, false, false}), CancelOutcome::cancelled);
  EXPECT_TRUE(std::holds_alternative<outcome::Reserved>(h.manager->reserve(request("n2", "hn2", 1024))));
  h.expect_invariants();
}

TEST(Reserve, AStarvingReserveThatStopsRetryingHoldsNothingBack) {
  Harness h(4096);
  for (const char* id : {"a", "b", "c", "d"}) h.reserve_writer(id, std::string("h") + id, 1024);
  EXPECT_TRUE(std::holds_alternative<outcome::RetryAfter>(h.manager->reserve(request("w", "hw", 2048))));
  for (int i = 0; i < 32; ++i) {
    h.clock->advance(500ms);
    EXPECT_TRUE(std::holds_alternative<outcome::RetryAfter>(h.manager->reserve(request("w", "hw", 2048))));
  }
  ASSERT_EQ(h.manager->cancel({"a", {}, false, false}), CancelOutcome::cancelled);
  EXPECT_TRUE(std::holds_alternative<outcome::RetryAfter>(h.manager->reserve(request("n", "hn", 1024))));
  h.clock->advance(2s);  // w's producer gave up
  EXPECT_TRUE(std::holds_alternative<outcome::Reserved>(h.manager->reserve(request("n", "hn", 1024))));
  h.expect_invariants();
}

// Lessons 29 and 38: reclaiming residents under pressure frees bytes at once and is
// reported, so the scheduler drops its residency for that hash.
TEST(Reserve, ReclaimsIdleResidentsBeforeAskingToRetry) {
  Harness h(4096);
  auto a = h.reserve_writer("a", "ha", 2048);
  h.land("a", a);
  {
    auto lease = h.manager->take("a", "ha");
    ASSERT_TRUE(lease.is_ok());
  }  // released: resident, idle
  EXPECT_EQ(h.manager->counters().resident_entries, 1u);
  h.reserve_writer("b", "hb", 2048);
  auto c = as<outcome::Reserved>(h.manager->reserve(request("c", "hc", 2048)));
  EXPECT_TRUE(c.write);
  EXPECT_EQ(h.manager->drain_reclaimed(), std::vector<std::string>{"ha"});
  EXPECT_EQ(h.manager->counters().residents_reclaimed, 1u);
  EXPECT_EQ(h.manager->counters().resident_entries, 0u);
  h.expect_invariants();
}

// Lesson 46: the same image in many requests is written once; every follower becomes
// READY from that one landing, each with its own readiness event.
TEST(Reserve, SameContentFollowsTheWriterAndLandsOnce) {
  Harness h;
  auto w = h.reserve_writer("w", "img", 4000);
  std::vector<outcome::Reserved> followers;
  for (int i = 0; i < 5; ++i) {
    followers.push_back(as<outcome::Reserved>(h.manager->reserve(request("f" + std::to_string(i), "img", 4000))));
    EXPECT_FALSE(followers.back().write);
    EXPECT_EQ(followers.back().slot_offset, w.slot_offset);
    EXPECT_NE(followers.back().reservation_id, w.reservation_id);
  }
  EXPECT_EQ(h.manager->counters().followers, 5u);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 4096u);
  // A follower is not a writer: its payload is refused.
  auto refused = h.manager->resolve_landing("f0", followers[0].reservation_id, 4000);
  EXPECT_EQ(refused.refusal, LandingRefusal::not_writer);
  h.land("w", w);
  auto ready = events_of<ReadyEvent>(h.manager->drain_events());
  ASSERT_EQ(ready.size(), 6u);
  std::set<std::string> ids;
  for (const auto& e : ready) {
    ids.insert(e.transfer_id);
    EXPECT_EQ(e.mm_hash, "img");
    EXPECT_EQ(e.nbytes, 4000u);
  }
  EXPECT_EQ(ids.size(), 6u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(h.manager->state_of("f" + std::to_string(i)), S::ready);
  EXPECT_EQ(h.manager->counters().landings_ready, 1u);
  h.expect_invariants();
}

TEST(Reserve, FollowerWithADifferentShapeIsRefused) {
  Harness h;
  h.reserve_writer("w", "img", 4000);
  auto refused = as<outcome::Refused>(h.manager->reserve(request("f", "img", 2000)));
  EXPECT_EQ(refused.status.code(), StatusCode::conflict);
}

TEST(Reserve, ResidentContentIsServedCachedWithoutAWrite) {
  Harness h;
  auto w = h.reserve_writer("w", "img", 4000);
  h.land("w", w, std::byte{7});
  ASSERT_TRUE(h.manager->take("w", "img").is_ok());  // lease dropped at once: resident
  h.manager->drain_events();
  auto hit = as<outcome::Ready>(h.manager->reserve(request("again", "img", 4000)));
  EXPECT_TRUE(hit.cached);
  auto events = events_of<ReadyEvent>(h.manager->drain_events());
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].transfer_id, "again");
  EXPECT_EQ(events[0].reservation_id, hit.reservation_id);
  auto lease = h.manager->take("again", "img");
  ASSERT_TRUE(lease.is_ok());
  EXPECT_EQ(lease->data()[3999], std::byte{7});
  EXPECT_EQ(h.manager->counters().resident_hits, 1u);
  EXPECT_EQ(h.manager->counters().bytes_landed, 4000u);
}

TEST(Reserve, ResidentWithAConflictingSpecIsRefused) {
  Harness h;
  auto w = h.reserve_writer("w", "img", 4000);
  h.land("w", w);
  ASSERT_TRUE(h.manager->take("w", "img").is_ok());
  auto refused = as<outcome::Refused>(h.manager->reserve(request("x", "img", 1000)));
  EXPECT_EQ(refused.status.code(), StatusCode::conflict);
}

TEST(Reserve, ReadyRecordAnswersReadyAgainWithoutASecondEvent) {
  Harness h;
  auto w = h.reserve_writer("w", "img", 100);
  h.land("w", w);
  h.manager->drain_events();
  auto again = as<outcome::Ready>(h.manager->reserve(request("w", "img", 100)));
  EXPECT_FALSE(again.cached);
  EXPECT_EQ(again.reservation_id, w.reservation_id);
  EXPECT_EQ(h.count_events(), 0u);
}

// Lesson 52: a cancel that arrives before the reserve makes the reserve idempotent.
TEST(Reserve, CancelBeforeReserveAnswersCancelled) {
  Harness h;
  EXPECT_EQ(h.manager->cancel({"t", {}, false, false}), CancelOutcome::pre_reserved);
  EXPECT_TRUE(std::holds_alternative<outcome::Cancelled>(h.manager->reserve(request("t", "h", 100))));
  EXPECT_TRUE(std::holds_alternative<outcome::Cancelled>(h.manager->reserve(request("t", "h", 100))));
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
  EXPECT_EQ(h.manager->counters().pre_reserved_tombstones, 1u);
}

TEST(Reserve, ExpiredTransferStartsOverWithANewReservation) {
  Harness h;
  auto first = h.reserve_writer("t", "h", 100);
  h.clock->advance(301s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("t"), S::expired);
  auto second = h.reserve_writer("t", "h", 100);
  EXPECT_NE(second.reservation_id, first.reservation_id);
  EXPECT_GT(second.generation, first.generation);
  // The old reservation's payload is refused: only the live one may land.
  EXPECT_EQ(h.manager->resolve_landing("t", first.reservation_id, 100).refusal, LandingRefusal::stale_reservation);
}

TEST(Reserve, FailedTransferIsRefused) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  ASSERT_TRUE(h.manager->resolve_landing("t", w.reservation_id, 100).accepted());
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, false), CompletionOutcome::failed);
  auto refused = as<outcome::Refused>(h.manager->reserve(request("t", "h", 100)));
  EXPECT_EQ(refused.status.code(), StatusCode::unavailable);
}

// ------------------------------------------------------------- landing

TEST(Landing, AcceptsOnlyTheLiveWriterWithMatchingIdsAndSize) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 1000);
  EXPECT_EQ(h.manager->resolve_landing("nope", w.reservation_id, 1000).refusal, LandingRefusal::unknown_transfer);
  EXPECT_EQ(h.manager->resolve_landing("t", ReservationId::random(), 1000).refusal, LandingRefusal::stale_reservation);
  EXPECT_EQ(h.manager->resolve_landing("t", w.reservation_id, 1000, w.generation + 1).refusal,
            LandingRefusal::stale_reservation);
  EXPECT_EQ(h.manager->resolve_landing("t", w.reservation_id, 999).refusal, LandingRefusal::size_mismatch);
  EXPECT_EQ(h.manager->resolve_landing("t", w.reservation_id, 1001).refusal, LandingRefusal::size_mismatch);
  auto ok = h.manager->resolve_landing("t", w.reservation_id, 1000, w.generation);
  ASSERT_TRUE(ok.accepted());
  EXPECT_EQ(ok.target->data, h.slab.data() + w.slot_offset);
  EXPECT_EQ(ok.target->length, 1000u);
  EXPECT_EQ(h.manager->state_of("t"), S::landing);
  // A second payload while the first is landing is refused.
  EXPECT_EQ(h.manager->resolve_landing("t", w.reservation_id, 1000).refusal, LandingRefusal::not_awaiting_payload);
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true), CompletionOutcome::became_ready);
  EXPECT_EQ(h.manager->resolve_landing("t", w.reservation_id, 1000).refusal, LandingRefusal::not_awaiting_payload);
  EXPECT_EQ(h.manager->counters().landings_refused, 7u);
  EXPECT_EQ(h.manager->counters().landings_accepted, 1u);
}

// A producer that lies about the size: payload rejected, pool intact.
TEST(Landing, LyingSizeIsRejectedAndThePoolStaysIntact) {
  Harness h(4096);
  auto w = h.reserve_writer("t", "h", 1000);
  EXPECT_FALSE(h.manager->resolve_landing("t", w.reservation_id, 4096).accepted());
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 1024u);
  EXPECT_EQ(h.manager->state_of("t"), S::writing);
  h.expect_invariants();
}

TEST(Landing, CompletionIsAcceptedOnceAndOnlyForTheLandingReservation) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true), CompletionOutcome::rejected);  // not landing
  ASSERT_TRUE(h.manager->resolve_landing("t", w.reservation_id, 100).accepted());
  EXPECT_EQ(h.manager->complete_landing("t", ReservationId::random(), true), CompletionOutcome::rejected);
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true), CompletionOutcome::became_ready);
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true), CompletionOutcome::rejected);
  EXPECT_EQ(h.manager->counters().completions_rejected, 3u);
}

TEST(Landing, FailedLandingFailsWriterAndFollowersAndFreesTheSlot) {
  Harness h;
  auto w = h.reserve_writer("w", "img", 1000);
  h.manager->reserve(request("f", "img", 1000));
  ASSERT_TRUE(h.manager->resolve_landing("w", w.reservation_id, 1000).accepted());
  EXPECT_EQ(h.manager->complete_landing("w", w.reservation_id, false), CompletionOutcome::failed);
  EXPECT_EQ(h.manager->state_of("w"), S::failed);
  EXPECT_EQ(h.manager->state_of("f"), S::failed);
  auto failed = events_of<FailedEvent>(h.manager->drain_events());
  ASSERT_EQ(failed.size(), 2u);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
  EXPECT_EQ(h.manager->counters().landings_failed, 1u);
  h.expect_invariants();
}

TEST(Landing, ChecksumMatchLands) {
  Harness h(std::uint64_t{64} * 1024, LandingMode::receiver_chosen, /*checksum=*/true);
  std::vector<std::byte> payload(5000);
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 31);
  const std::uint64_t sum = XXH64(payload.data(), payload.size(), 0);
  auto w = h.reserve_writer("t", "h", 5000);
  auto target = h.manager->resolve_landing("t", w.reservation_id, 5000);
  ASSERT_TRUE(target.accepted());
  std::copy(payload.begin(), payload.end(), target.target->data);
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true, sum), CompletionOutcome::became_ready);
  EXPECT_EQ(h.manager->counters().checksum_mismatches, 0u);
}

TEST(Landing, ChecksumFromTheReserveIsUsedWhenTheLandingCarriesNone) {
  Harness h(std::uint64_t{64} * 1024, LandingMode::receiver_chosen, true);
  std::vector<std::byte> payload(300, std::byte{9});
  auto w = as<outcome::Reserved>(h.manager->reserve(request("t", "h", 300, XXH64(payload.data(), 300, 0))));
  auto target = h.manager->resolve_landing("t", w.reservation_id, 300);
  std::copy(payload.begin(), payload.end(), target.target->data);
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true), CompletionOutcome::became_ready);
}

TEST(Landing, ChecksumMismatchFailsTheTransferAndFreesTheSlot) {
  Harness h(std::uint64_t{64} * 1024, LandingMode::receiver_chosen, true);
  auto w = h.reserve_writer("t", "h", 5000);
  auto f = as<outcome::Reserved>(h.manager->reserve(request("f", "h", 5000)));
  (void)f;
  auto target = h.manager->resolve_landing("t", w.reservation_id, 5000);
  std::fill_n(target.target->data, 5000, std::byte{1});
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true, 0x1234), CompletionOutcome::failed);
  EXPECT_EQ(h.manager->state_of("t"), S::failed);
  EXPECT_EQ(h.manager->state_of("f"), S::failed);
  EXPECT_EQ(h.manager->counters().checksum_mismatches, 1u);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
  auto failed = events_of<FailedEvent>(h.manager->drain_events());
  ASSERT_EQ(failed.size(), 2u);
  EXPECT_NE(failed[1].reason.find("checksum"), std::string::npos);
  // Not resident: corrupt bytes never serve a later reserve.
  EXPECT_TRUE(as<outcome::Reserved>(h.manager->reserve(request("t2", "h", 5000))).write);
}

TEST(Landing, MissingChecksumFailsWhenChecksumsAreOn) {
  Harness h(std::uint64_t{64} * 1024, LandingMode::receiver_chosen, true);
  auto w = h.reserve_writer("t", "h", 100);
  ASSERT_TRUE(h.manager->resolve_landing("t", w.reservation_id, 100).accepted());
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true), CompletionOutcome::failed);
}

// Lesson 26: neither a cancel nor expiry frees a slot the transport is writing into.
TEST(Landing, CancelDuringLandingDefersUntilTheLandingEnds) {
  Harness h(4096);
  auto w = h.reserve_writer("t", "h", 4096);
  auto target = h.manager->resolve_landing("t", w.reservation_id, 4096);
  ASSERT_TRUE(target.accepted());
  EXPECT_EQ(h.manager->cancel({"t", {}, false, false}), CancelOutcome::deferred);
  EXPECT_EQ(h.manager->state_of("t"), S::cancel_pending);
  h.clock->advance(10 * 300s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("t"), S::cancel_pending);
  // The slot is still held: nothing else can be placed over it.
  EXPECT_TRUE(std::holds_alternative<outcome::RetryAfter>(h.manager->reserve(request("x", "hx", 256))));
  std::fill_n(target.target->data, 4096, std::byte{3});
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true), CompletionOutcome::released);
  EXPECT_EQ(h.manager->state_of("t"), S::cancelled);
  EXPECT_EQ(h.manager->counters().deferred, 0u);
  // The landed content is intact and resident; a later reserve by content is cached.
  EXPECT_TRUE(as<outcome::Ready>(h.manager->reserve(request("t2", "h", 4096))).cached);
  h.expect_invariants();
}

TEST(Landing, AbandonDuringLandingDefersAndReportsAbandoned) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  ASSERT_TRUE(h.manager->resolve_landing("t", w.reservation_id, 100).accepted());
  EXPECT_EQ(h.manager->cancel({"t", w.reservation_id, true, false}), CancelOutcome::deferred);
  EXPECT_EQ(events_of<AbandonedEvent>(h.manager->drain_events()).size(), 1u);
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, false), CompletionOutcome::failed);
  EXPECT_EQ(h.manager->state_of("t"), S::cancelled);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
}

TEST(Landing, RefreshDuringLandingDefersAndTheReReserveWaits) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  ASSERT_TRUE(h.manager->resolve_landing("t", w.reservation_id, 100).accepted());
  EXPECT_EQ(h.manager->cancel({"t", w.reservation_id, true, true}), CancelOutcome::deferred);
  EXPECT_EQ(h.manager->state_of("t"), S::expire_pending);
  EXPECT_EQ(as<outcome::Refused>(h.manager->reserve(request("t", "h", 100))).status.code(), StatusCode::conflict);
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true), CompletionOutcome::released);
  EXPECT_EQ(h.manager->state_of("t"), S::expired);
  // Now the re-reserve finds the content resident.
  EXPECT_TRUE(as<outcome::Ready>(h.manager->reserve(request("t", "h", 100))).cached);
}

TEST(Landing, FollowersOfACancelPendingWriterAreStillServed) {
  Harness h;
  auto w = h.reserve_writer("w", "img", 100);
  h.manager->reserve(request("f", "img", 100));
  ASSERT_TRUE(h.manager->resolve_landing("w", w.reservation_id, 100).accepted());
  EXPECT_EQ(h.manager->cancel({"w", {}, false, false}), CancelOutcome::deferred);
  EXPECT_EQ(h.manager->complete_landing("w", w.reservation_id, true), CompletionOutcome::released);
  EXPECT_EQ(h.manager->state_of("f"), S::ready);
  auto ready = events_of<ReadyEvent>(h.manager->drain_events());
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0].transfer_id, "f");
}

// ------------------------------------------------------------- cancel

TEST(Cancel, StaleReservationIdIsRejected) {
  Harness h;
  h.reserve_writer("t", "h", 100);
  EXPECT_EQ(h.manager->cancel({"t", ReservationId::random(), true, false}), CancelOutcome::rejected);
  EXPECT_EQ(h.manager->state_of("t"), S::writing);
  EXPECT_EQ(h.manager->counters().cancels_rejected, 1u);
}

TEST(Cancel, RepeatedCancelRefreshesTheTombstone) {
  Harness h;
  EXPECT_EQ(h.manager->cancel({"t", {}, false, false}), CancelOutcome::pre_reserved);
  h.clock->advance(200s);
  EXPECT_EQ(h.manager->cancel({"t", {}, false, false}), CancelOutcome::already_cancelled);
  h.clock->advance(200s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("t"), S::cancelled);  // 400 s after the first, 200 s after the second
  h.clock->advance(101s);
  h.manager->expire();
  EXPECT_FALSE(h.manager->state_of("t").has_value());
}

TEST(Cancel, WriterWithoutFollowersIsReleasedAtOnce) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  EXPECT_EQ(h.manager->cancel({"t", w.reservation_id, false, false}), CancelOutcome::cancelled);
  EXPECT_EQ(h.manager->state_of("t"), S::cancelled);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
  // Its payload arriving afterwards is refused.
  EXPECT_EQ(h.manager->resolve_landing("t", w.reservation_id, 100).refusal, LandingRefusal::not_awaiting_payload);
  EXPECT_EQ(h.count_events(), 0u);  // the consumer asked for it: nobody to tell
}

TEST(Cancel, ConsumerCancelOfAWriterWithFollowersKeepsTheLandingForThem) {
  Harness h;
  auto w = h.reserve_writer("w", "img", 100);
  h.manager->reserve(request("f", "img", 100));
  EXPECT_EQ(h.manager->cancel({"w", {}, false, false}), CancelOutcome::deferred);
  EXPECT_EQ(h.manager->state_of("w"), S::cancel_pending);
  EXPECT_TRUE(std::holds_alternative<outcome::Cancelled>(h.manager->reserve(request("w", "img", 100))));
  ASSERT_TRUE(h.manager->resolve_landing("w", w.reservation_id, 100).accepted());
  EXPECT_EQ(h.manager->complete_landing("w", w.reservation_id, true), CompletionOutcome::released);
  EXPECT_EQ(h.manager->state_of("f"), S::ready);
  EXPECT_EQ(h.manager->state_of("w"), S::cancelled);
}

TEST(Cancel, CancelPendingWriterThatNeverSendsExpiresAndAbandonsFollowers) {
  Harness h;
  h.reserve_writer("w", "img", 100);
  h.clock->advance(10s);
  h.manager->reserve(request("f", "img", 100));
  EXPECT_EQ(h.manager->cancel({"w", {}, false, false}), CancelOutcome::deferred);
  h.clock->advance(291s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("w"), S::cancelled);
  EXPECT_EQ(h.manager->state_of("f"), S::cancelled);
  auto abandoned = events_of<AbandonedEvent>(h.manager->drain_events());
  ASSERT_EQ(abandoned.size(), 1u);
  EXPECT_EQ(abandoned[0].transfer_id, "f");
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
}

// Lesson 15: followers of an abandoned writer are told at once, not after a timeout.
TEST(Cancel, AbandonedWriterAbandonsItsFollowersAtOnce) {
  Harness h;
  auto w = h.reserve_writer("w", "img", 100);
  h.manager->reserve(request("f1", "img", 100));
  h.manager->reserve(request("f2", "img", 100));
  EXPECT_EQ(h.manager->cancel({"w", w.reservation_id, true, false}), CancelOutcome::cancelled);
  auto abandoned = events_of<AbandonedEvent>(h.manager->drain_events());
  std::set<std::string> ids;
  for (const auto& e : abandoned) ids.insert(e.transfer_id);
  EXPECT_EQ(ids, (std::set<std::string>{"w", "f1", "f2"}));
  EXPECT_EQ(h.manager->state_of("f1"), S::cancelled);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
  h.expect_invariants();
}

TEST(Cancel, FollowerCancelDetachesWithoutTouchingTheWriter) {
  Harness h;
  auto w = h.reserve_writer("w", "img", 100);
  h.manager->reserve(request("f", "img", 100));
  EXPECT_EQ(h.manager->cancel({"f", {}, true, false}), CancelOutcome::cancelled);
  EXPECT_EQ(events_of<AbandonedEvent>(h.manager->drain_events()).size(), 1u);
  EXPECT_EQ(h.manager->state_of("w"), S::writing);
  h.land("w", w);
  EXPECT_EQ(events_of<ReadyEvent>(h.manager->drain_events()).size(), 1u);  // the writer's only
}

// Lesson 26: refresh abandons the old destination before the producer re-reserves.
TEST(Cancel, RefreshReleasesTheWriterAndTheNextReserveGetsANewReservation) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  EXPECT_EQ(h.manager->cancel({"t", w.reservation_id, true, true}), CancelOutcome::refreshed);
  EXPECT_EQ(h.manager->state_of("t"), S::expired);
  EXPECT_TRUE(events_of<AbandonedEvent>(h.manager->drain_events()).empty());  // the writer re-reserves at once
  auto fresh = h.reserve_writer("t", "h", 100);
  EXPECT_NE(fresh.reservation_id, w.reservation_id);
  EXPECT_EQ(h.manager->resolve_landing("t", w.reservation_id, 100).refusal, LandingRefusal::stale_reservation);
}

// Other transfers of the same content follow the writer's landing: giving its slot up
// would abandon them, so the refresh is refused, and the writer's reserve again gets
// the same reservation (its TTL re-armed). Its landing still serves the follower.
TEST(Cancel, RefreshOfAFollowedWriterIsRefusedAndItsReserveAgainKeepsTheSlot) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  h.manager->reserve(request("f", "h", 100));
  EXPECT_EQ(h.manager->cancel({"t", w.reservation_id, true, true}), CancelOutcome::rejected);
  EXPECT_EQ(h.manager->state_of("t"), S::writing);
  EXPECT_EQ(h.manager->state_of("f"), S::writing);
  EXPECT_TRUE(events_of<AbandonedEvent>(h.manager->drain_events()).empty());
  h.clock->advance(h.options.ttl / 2 + 1s);
  auto again = h.reserve_writer("t", "h", 100);
  EXPECT_EQ(again.reservation_id, w.reservation_id);
  EXPECT_EQ(again.slot_offset, w.slot_offset);
  h.manager->reserve(request("f", "h", 100));  // the follower's producer asks again too
  h.clock->advance(h.options.ttl / 2 + 1s);    // past the first deadlines, inside the re-armed ones
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("t"), S::writing);
  EXPECT_EQ(h.manager->state_of("f"), S::writing);
  h.land("t", w);
  EXPECT_EQ(events_of<ReadyEvent>(h.manager->drain_events()).size(), 2u);  // the writer and its follower
}

TEST(Cancel, RefreshNeedsAbandonAndAnUnfinishedReservation) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  EXPECT_EQ(h.manager->cancel({"t", w.reservation_id, false, true}), CancelOutcome::rejected);
  h.land("t", w);
  EXPECT_EQ(h.manager->cancel({"t", w.reservation_id, true, true}), CancelOutcome::rejected);
  EXPECT_EQ(h.manager->state_of("t"), S::ready);
  // A refresh of an unknown transfer leaves no tombstone behind.
  EXPECT_EQ(h.manager->cancel({"u", {}, true, true}), CancelOutcome::refreshed);
  EXPECT_FALSE(h.manager->state_of("u").has_value());
}

TEST(Cancel, FollowerRefreshDoesNotAbandonTheWriter) {
  Harness h;
  h.reserve_writer("w", "img", 100);
  auto f = as<outcome::Reserved>(h.manager->reserve(request("f", "img", 100)));
  EXPECT_EQ(h.manager->cancel({"f", f.reservation_id, true, true}), CancelOutcome::refreshed);
  EXPECT_EQ(h.manager->state_of("w"), S::writing);
  EXPECT_EQ(h.manager->state_of("f"), S::expired);
}

TEST(Cancel, ReadyRecordIsReleasedAndItsContentStaysResident) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  h.land("t", w);
  EXPECT_EQ(h.manager->cancel({"t", {}, false, false}), CancelOutcome::cancelled);
  EXPECT_EQ(h.manager->counters().resident_entries, 1u);
  EXPECT_TRUE(h.manager->take_resident("h", testing::bytes_spec(100)).is_ok());
  EXPECT_FALSE(h.manager->take("t", "h").is_ok());
}

TEST(Cancel, CancelAfterExpiryTurnsTheTombstoneIntoACancel) {
  Harness h;
  h.reserve_writer("t", "h", 100);
  h.clock->advance(301s);
  h.manager->expire();
  EXPECT_EQ(h.manager->cancel({"t", {}, false, false}), CancelOutcome::already_terminal);
  EXPECT_EQ(h.manager->state_of("t"), S::cancelled);
  EXPECT_TRUE(std::holds_alternative<outcome::Cancelled>(h.manager->reserve(request("t", "h", 100))));
}

TEST(Cancel, FailedTransferStaysFailed) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  ASSERT_TRUE(h.manager->resolve_landing("t", w.reservation_id, 100).accepted());
  h.manager->complete_landing("t", w.reservation_id, false);
  EXPECT_EQ(h.manager->cancel({"t", {}, false, false}), CancelOutcome::already_terminal);
  EXPECT_EQ(h.manager->state_of("t"), S::failed);
}

// ------------------------------------------------------------- one-sided mode

TEST(OneSided, ConsumerCancelDefersUntilTheWriterCompletes) {
  Harness h(4096, LandingMode::one_sided);
  auto w = h.reserve_writer("t", "h", 4096);
  EXPECT_EQ(h.manager->cancel({"t", {}, false, false}), CancelOutcome::deferred);
  EXPECT_EQ(h.manager->state_of("t"), S::cancel_pending);
  h.clock->advance(100 * 300s);
  h.manager->expire();
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 4096u);  // never freed under a writer
  EXPECT_EQ(h.manager->writer_completed("t", w.reservation_id), CompletionOutcome::released);
  EXPECT_EQ(h.manager->state_of("t"), S::cancelled);
  h.expect_invariants();
}

TEST(OneSided, ExpiryOfAnUnfinishedWriterIsDeferred) {
  Harness h(4096, LandingMode::one_sided);
  auto w = h.reserve_writer("t", "h", 1000);
  h.clock->advance(301s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("t"), S::expire_pending);
  EXPECT_EQ(as<outcome::Refused>(h.manager->reserve(request("t", "h", 1000))).status.code(), StatusCode::conflict);
  h.clock->advance(100 * 300s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("t"), S::expire_pending);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 1024u);
  EXPECT_EQ(h.manager->writer_completed("t", w.reservation_id), CompletionOutcome::released);
  EXPECT_EQ(h.manager->state_of("t"), S::expired);
}

// Lesson 26: a late completion never completes a newer reservation.
TEST(OneSided, LateCompletionOfAnOldReservationIsRejected) {
  Harness h(4096, LandingMode::one_sided);
  auto old = h.reserve_writer("t", "h", 1000);
  EXPECT_EQ(h.manager->writer_abandoned("t", old.reservation_id), CancelOutcome::cancelled);
  h.clock->advance(301s);
  h.manager->expire();  // tombstone gone
  EXPECT_FALSE(h.manager->state_of("t").has_value());
  auto fresh = h.reserve_writer("t", "h", 1000);
  EXPECT_EQ(h.manager->writer_completed("t", old.reservation_id), CompletionOutcome::rejected);
  EXPECT_EQ(h.manager->state_of("t"), S::writing);
  EXPECT_EQ(h.manager->writer_completed("t", fresh.reservation_id), CompletionOutcome::became_ready);
}

// Lesson 51: a repeated completion, or one for a follower, is an idempotent no-op.
TEST(OneSided, RepeatedOrFollowerCompletionIsANoOp) {
  Harness h(4096, LandingMode::one_sided);
  auto w = h.reserve_writer("w", "img", 100);
  auto f = as<outcome::Reserved>(h.manager->reserve(request("f", "img", 100)));
  EXPECT_EQ(h.manager->writer_completed("f", f.reservation_id), CompletionOutcome::repeated);
  EXPECT_EQ(h.manager->state_of("f"), S::writing);
  EXPECT_EQ(h.manager->writer_completed("w", w.reservation_id), CompletionOutcome::became_ready);
  EXPECT_EQ(h.manager->writer_completed("w", w.reservation_id), CompletionOutcome::repeated);
  EXPECT_EQ(h.manager->writer_completed("w", ReservationId::random()), CompletionOutcome::rejected);
  EXPECT_EQ(events_of<ReadyEvent>(h.manager->drain_events()).size(), 2u);
}

TEST(OneSided, RefreshOfAnExpirePendingWriterReleasesIt) {
  Harness h(4096, LandingMode::one_sided);
  auto w = h.reserve_writer("t", "h", 1000);
  h.clock->advance(301s);
  h.manager->expire();
  EXPECT_EQ(h.manager->cancel({"t", w.reservation_id, true, true}), CancelOutcome::refreshed);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
  EXPECT_TRUE(h.reserve_writer("t", "h", 1000).write);
}

// The consumer cancelled while the writer held the slot; the writer then refreshes
// (its reservation grew old before it had a source). The refresh is the writer's
// abandon: it frees the slot, and the re-reserve learns the transfer is cancelled.
TEST(OneSided, RefreshOfACancelPendingWriterReleasesItAndTheTransferStaysCancelled) {
  Harness h(4096, LandingMode::one_sided);
  auto w = h.reserve_writer("t", "h", 1000);
  EXPECT_EQ(h.manager->cancel({"t", {}, false, false}), CancelOutcome::deferred);
  EXPECT_EQ(h.manager->state_of("t"), S::cancel_pending);
  EXPECT_EQ(h.manager->cancel({"t", w.reservation_id, true, true}), CancelOutcome::cancelled);
  EXPECT_EQ(h.manager->state_of("t"), S::cancelled);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
  EXPECT_EQ(h.manager->counters().live_records, 0u);
  EXPECT_TRUE(std::holds_alternative<outcome::Cancelled>(h.manager->reserve(request("t", "h", 1000))));
  EXPECT_TRUE(h.manager->check_invariants());
}

TEST(OneSided, ReceiverChosenLandingIsRefused) {
  Harness h(4096, LandingMode::one_sided);
  auto w = h.reserve_writer("t", "h", 1000);
  EXPECT_EQ(h.manager->resolve_landing("t", w.reservation_id, 1000).refusal, LandingRefusal::not_awaiting_payload);
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true), CompletionOutcome::rejected);
}

TEST(OneSided, ChecksumIsVerifiedOnWriterCompletion) {
  Harness h(4096, LandingMode::one_sided, true);
  auto w = h.reserve_writer("t", "h", 1000);
  std::fill_n(h.slab.data() + w.slot_offset, 1000, std::byte{4});
  std::vector<std::byte> expected(1000, std::byte{4});
  EXPECT_EQ(h.manager->writer_completed("t", w.reservation_id, XXH64(expected.data(), 1000, 0)),
            CompletionOutcome::became_ready);
  auto w2 = h.reserve_writer("t2", "h2", 1000);
  EXPECT_EQ(h.manager->writer_completed("t2", w2.reservation_id, 42), CompletionOutcome::failed);
  EXPECT_EQ(h.manager->counters().checksum_mismatches, 1u);
}

// ------------------------------------------------------------- take and leases

TEST(Take, RequiresAReadyRecordWithTheSameContent) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  EXPECT_EQ(h.manager->take("t", "h").status().code(), StatusCode::not_found);  // not landed yet
  h.land("t", w);
  EXPECT_FALSE(h.manager->take("t", "other").is_ok());
  EXPECT_FALSE(h.manager->take("nope", "h").is_ok());
  auto lease = h.manager->take("t", "h");
  ASSERT_TRUE(lease.is_ok());
  EXPECT_EQ(lease->nbytes(), 100u);
  EXPECT_EQ(lease->mm_hash(), "h");
  EXPECT_EQ(lease->data(), h.slab.data() + w.slot_offset);
  EXPECT_FALSE(h.manager->state_of("t").has_value());  // taken: the record is gone
  EXPECT_FALSE(h.manager->take("t", "h").is_ok());
  EXPECT_EQ(h.manager->counters().takes_refused, 4u);
}

// Lesson 30: a slot handed to the engine is never reclaimed under it.
TEST(Take, LeasedSlotIsNeverReclaimedUntilReleased) {
  Harness h(4096);
  auto w = h.reserve_writer("a", "ha", 4096);
  h.land("a", w, std::byte{0x11});
  auto lease = h.manager->take("a", "ha");
  ASSERT_TRUE(lease.is_ok());
  EXPECT_TRUE(std::holds_alternative<outcome::RetryAfter>(h.manager->reserve(request("b", "hb", 256))));
  EXPECT_EQ(lease->data()[100], std::byte{0x11});
  lease->release();
  EXPECT_EQ(h.manager->counters().leases, 0u);
  EXPECT_TRUE(as<outcome::Reserved>(h.manager->reserve(request("b", "hb", 256))).write);  // reclaimed now
  h.expect_invariants();
}

// Lesson 31: an item reserved again after its release becomes live and still serves
// a local reload.
TEST(Take, ResidentCopyServesALocalReload) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  h.land("t", w, std::byte{9});
  ASSERT_TRUE(h.manager->take("t", "h").is_ok());
  auto again = h.manager->take_resident("h", testing::bytes_spec(100));
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(again->data()[0], std::byte{9});
  EXPECT_EQ(h.manager->take_resident("h", testing::bytes_spec(50)).status().code(), StatusCode::conflict);
  EXPECT_EQ(h.manager->take_resident("x", testing::bytes_spec(100)).status().code(), StatusCode::not_found);
  // A reserve for the same content while leased is still a cached hit.
  EXPECT_TRUE(as<outcome::Ready>(h.manager->reserve(request("t2", "h", 100))).cached);
  h.expect_invariants();
}

TEST(Take, LeaseMayOutliveTheManager) {
  auto h = std::make_unique<Harness>();
  auto w = h->reserve_writer("t", "h", 100);
  h->land("t", w);
  auto lease = h->manager->take("t", "h");
  ASSERT_TRUE(lease.is_ok());
  SlotLease moved = std::move(*lease);
  h->manager.reset();
  EXPECT_TRUE(moved.valid());
  moved.release();
  EXPECT_FALSE(moved.valid());
}

TEST(Take, ResidentBytesAreCappedByResidentCapacity) {
  std::vector<std::byte> slab(8192);
  auto clock = std::make_shared<ManualClock>();
  ReservationOptions o;
  o.slab_base = slab.data();
  o.slab_size = slab.size();
  o.resident_capacity_bytes = 2048;
  ReservationManager m(o, clock);
  for (int i = 0; i < 3; ++i) {
    const std::string id = "t" + std::to_string(i);
    auto r = std::get<outcome::Reserved>(m.reserve(testing::request(id, "h" + id, 1024)));
    ASSERT_TRUE(m.resolve_landing(id, r.reservation_id, 1024).accepted());
    ASSERT_EQ(m.complete_landing(id, r.reservation_id, true), CompletionOutcome::became_ready);
    ASSERT_TRUE(m.take(id, "h" + id).is_ok());
  }
  EXPECT_EQ(m.counters().resident_bytes, 2048u);
  EXPECT_EQ(m.drain_reclaimed(), std::vector<std::string>{"ht0"});  // least recently used first
}

// ------------------------------------------------------------- expiry, tombstones

TEST(Expiry, UnclaimedReadyRecordExpiresButItsContentStaysResident) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  h.land("t", w);
  h.clock->advance(299s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("t"), S::ready);
  h.clock->advance(2s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("t"), S::expired);
  EXPECT_EQ(h.manager->counters().resident_entries, 1u);
  EXPECT_EQ(h.manager->counters().expired, 1u);
}

TEST(Expiry, WriterThatNeverSendsExpiresAndItsFollowersAreAbandoned) {
  Harness h;
  h.reserve_writer("w", "img", 100);
  h.clock->advance(1s);
  h.manager->reserve(request("f", "img", 100));
  h.clock->advance(300s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("w"), S::expired);
  EXPECT_EQ(h.manager->state_of("f"), S::expired);
  auto abandoned = events_of<AbandonedEvent>(h.manager->drain_events());
  ASSERT_EQ(abandoned.size(), 1u);
  EXPECT_EQ(abandoned[0].transfer_id, "f");
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
  h.expect_invariants();
}

TEST(Expiry, ALandingIsNeverTimedOut) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  ASSERT_TRUE(h.manager->resolve_landing("t", w.reservation_id, 100).accepted());
  h.clock->advance(10 * 300s);
  h.manager->expire();
  EXPECT_EQ(h.manager->state_of("t"), S::landing);
  EXPECT_EQ(h.manager->complete_landing("t", w.reservation_id, true), CompletionOutcome::became_ready);
}

TEST(Expiry, TheSweepRunsBeforeEveryReserve) {
  Harness h(4096);
  h.reserve_writer("a", "ha", 4096);
  EXPECT_TRUE(std::holds_alternative<outcome::RetryAfter>(h.manager->reserve(request("b", "hb", 4096))));
  h.clock->advance(301s);
  EXPECT_TRUE(as<outcome::Reserved>(h.manager->reserve(request("b", "hb", 4096))).write);  // no expire() call
}

TEST(Expiry, TombstonesAreBoundedInCount) {
  Harness h(std::uint64_t{64} * 1024, LandingMode::receiver_chosen, false, /*tombstone_max=*/10);
  for (int i = 0; i < 25; ++i) h.manager->cancel({"c" + std::to_string(i), {}, false, false});
  const auto c = h.manager->counters();
  EXPECT_EQ(c.tombstones, 10u);
  EXPECT_EQ(c.tombstones_dropped, 15u);
  EXPECT_FALSE(h.manager->state_of("c0").has_value());  // the oldest went first
  EXPECT_EQ(h.manager->state_of("c24"), S::cancelled);
  h.expect_invariants();
}

TEST(Expiry, TombstonesAreReapedAfterTheTtl) {
  Harness h;
  auto w = h.reserve_writer("t", "h", 100);
  h.manager->cancel({"t", w.reservation_id, false, false});
  h.clock->advance(299s);
  h.manager->expire();
  EXPECT_EQ(h.manager->counters().tombstones, 1u);
  h.clock->advance(2s);
  h.manager->expire();
  EXPECT_EQ(h.manager->counters().tombstones, 0u);
  EXPECT_FALSE(h.manager->state_of("t").has_value());
}

TEST(Events, TheQueueIsBoundedAndDropsTheOldest) {
  std::vector<std::byte> slab(std::size_t{64} * 1024);
  ReservationOptions o;
  o.slab_base = slab.data();
  o.slab_size = slab.size();
  o.event_queue_max = 3;
  ReservationManager m(o, std::make_shared<ManualClock>());
  for (int i = 0; i < 5; ++i) {
    const std::string id = "t" + std::to_string(i);
    auto r = std::get<outcome::Reserved>(m.reserve(testing::request(id, "h" + id, 10)));
    m.resolve_landing(id, r.reservation_id, 10);
    m.complete_landing(id, r.reservation_id, true);
  }
  auto events = events_of<ReadyEvent>(m.drain_events(2));
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].transfer_id, "t2");
  EXPECT_EQ(m.counters().events_dropped, 2u);
  EXPECT_EQ(m.drain_events().size(), 1u);
}

// ------------------------------------------------------------- shutdown

// Lesson 34: shutdown waits for writers before the pool may be unregistered.
TEST(Shutdown, RefusesNewWorkCancelsWaitersAndWaitsForLandingWriters) {
  Harness h;
  auto landing = h.reserve_writer("l", "hl", 100);
  ASSERT_TRUE(h.manager->resolve_landing("l", landing.reservation_id, 100).accepted());
  auto idle = h.reserve_writer("w", "hw", 100);
  (void)idle;
  h.manager->reserve(request("f", "hw", 100));
  auto ready = h.reserve_writer("r", "hr", 100);
  h.land("r", ready);
  h.manager->drain_events();

  h.manager->begin_shutdown();
  EXPECT_EQ(as<outcome::Refused>(h.manager->reserve(request("n", "hn", 100))).status.code(), StatusCode::unavailable);
  EXPECT_EQ(h.manager->state_of("f"), S::cancelled);
  EXPECT_EQ(h.manager->state_of("r"), S::cancelled);
  EXPECT_EQ(h.manager->state_of("w"), S::cancelled);
  EXPECT_EQ(h.manager->state_of("l"), S::cancel_pending);
  EXPECT_EQ(events_of<AbandonedEvent>(h.manager->drain_events()).size(), 1u);  // the follower

  auto report = h.manager->wait_for_writers(0ms);
  EXPECT_FALSE(report.writers_finished);
  EXPECT_EQ(report.writers_remaining, 1u);

  std::thread transport([&] { h.manager->complete_landing("l", landing.reservation_id, true); });
  report = h.manager->wait_for_writers(10s);
  transport.join();
  EXPECT_TRUE(report.writers_finished);
  EXPECT_EQ(h.manager->state_of("l"), S::cancelled);
  h.expect_invariants();
}

TEST(Shutdown, OneSidedWritersKeepThePoolRegisteredUntilTheyFinish) {
  Harness h(4096, LandingMode::one_sided);
  auto w = h.reserve_writer("t", "h", 100);
  h.manager->begin_shutdown();
  EXPECT_EQ(h.manager->state_of("t"), S::cancel_pending);
  EXPECT_FALSE(h.manager->wait_for_writers(1ms).writers_finished);
  EXPECT_EQ(h.manager->writer_abandoned("t", w.reservation_id), CancelOutcome::cancelled);
  EXPECT_TRUE(h.manager->wait_for_writers(0ms).writers_finished);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 0u);
}

TEST(Config, OptionsFollowTheConfiguration) {
  Config c;
  c.reservation_ttl_s = 12.5;
  c.tombstone_max = 7;
  c.retry_after_ms = 9;
  c.checksum = true;
  c.ucx_mode = "put";
  std::vector<std::byte> slab(1024);
  auto o = ReservationOptions::from_config(c, slab.data(), slab.size());
  EXPECT_EQ(o.ttl, std::chrono::milliseconds(12500));
  EXPECT_EQ(o.tombstone_max, 7u);
  EXPECT_EQ(o.retry_after, std::chrono::milliseconds(9));
  EXPECT_TRUE(o.checksum);
  // The landing mode is not configuration: the shard takes it from its data plane's
  // capabilities (tests/integration/transport: the factory's backends).
  EXPECT_EQ(o.mode, LandingMode::receiver_chosen);
  c.transport = "mooncake";
  EXPECT_EQ(ReservationOptions::from_config(c, slab.data(), slab.size()).mode, LandingMode::receiver_chosen);
}

// ---------------------------------------------------------------- direct payloads

TEST(Direct, AFreshTransferReservesOnArrivalAndLands) {
  Harness h;
  auto d = h.manager->resolve_direct_landing(request("t", "img", 1000));
  ASSERT_TRUE(d.landing.accepted()) << d.reserve_outcome;
  EXPECT_FALSE(d.reservation_id.is_none());
  EXPECT_EQ(d.landing.target->length, 1000u);
  EXPECT_EQ(h.manager->state_of("t"), ReservationState::landing);
  std::fill_n(d.landing.target->data, 1000, std::byte{3});
  EXPECT_EQ(h.manager->complete_landing("t", d.reservation_id, true), CompletionOutcome::became_ready);
  auto ready = events_of<ReadyEvent>(h.manager->drain_events());
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0].reservation_id, d.reservation_id);
  EXPECT_EQ(h.manager->counters().direct_accepted, 1u);
  EXPECT_EQ(h.manager->counters().reserved_writer, 1u);
  // The producer's fallback reserve (had it not heard the verdict) finds it ready.
  EXPECT_TRUE(std::holds_alternative<outcome::Ready>(h.manager->reserve(request("t", "img", 1000))));
  h.expect_invariants();
}

TEST(Direct, AFullPoolTurnsThePayloadAwayAndRemembersItsWait) {
  Harness h(4096);
  h.reserve_writer("a", "ha", 4096);
  auto d = h.manager->resolve_direct_landing(request("t", "img", 1000));
  EXPECT_FALSE(d.landing.accepted());
  EXPECT_EQ(d.landing.refusal, LandingRefusal::direct_turned_away);
  EXPECT_NE(d.reserve_outcome.find("retry_after"), std::string::npos) << d.reserve_outcome;
  EXPECT_FALSE(h.manager->state_of("t").has_value());  // nothing held: the producer reserves next
  EXPECT_EQ(h.manager->counters().direct_turned_away, 1u);
  EXPECT_EQ(h.manager->counters().pool_used_bytes, 4096u);
  h.expect_invariants();
}

TEST(Direct, AKnownTransferKeepsToTheUsualPath) {
  Harness h;
  EXPECT_EQ(h.manager->cancel({"t", {}, false, false}), CancelOutcome::pre_reserved);  // cancelled before it came
  auto cancelled = h.manager->resolve_direct_landing(request("t", "img", 1000));
  EXPECT_FALSE(cancelled.landing.accepted());
  h.reserve_writer("r", "other", 1000);
  EXPECT_FALSE(h.manager->resolve_direct_landing(request("r", "other", 1000)).landing.accepted());
  EXPECT_EQ(h.manager->counters().direct_turned_away, 2u);
  EXPECT_EQ(h.manager->counters().reserved_writer, 1u);  // r's own reserve only
  EXPECT_EQ(h.manager->state_of("r"), ReservationState::writing);
  h.expect_invariants();
}

// Content resident or landing is turned away without a record: the producer's reserve
// makes the resident hit or the follower, once. A record made here too could be taken
// before that reserve came, which would then make a second one nobody takes.
TEST(Direct, ContentAlreadyThereIsLeftToTheReserve) {
  Harness h;
  auto w = h.reserve_writer("w", "img", 1000);
  auto landing = h.manager->resolve_direct_landing(request("f", "img", 1000));
  EXPECT_FALSE(landing.landing.accepted());
  EXPECT_FALSE(h.manager->state_of("f").has_value());
  h.land("w", w, std::byte{9});
  ASSERT_TRUE(h.manager->take("w", "img").is_ok());
  h.manager->drain_events();
  auto resident = h.manager->resolve_direct_landing(request("again", "img", 1000));
  EXPECT_FALSE(resident.landing.accepted());
  EXPECT_FALSE(h.manager->state_of("again").has_value());
  EXPECT_EQ(h.count_events(), 0u);
  // The reserve that follows serves it from the resident copy, once.
  EXPECT_TRUE(std::holds_alternative<outcome::Ready>(h.manager->reserve(request("again", "img", 1000))));
  ASSERT_TRUE(h.manager->take("again", "img").is_ok());
  EXPECT_EQ(h.manager->counters().live_records, 0u);
  h.expect_invariants();
}

TEST(Direct, OneSidedShardsTurnDirectPayloadsAway) {
  Harness h(std::uint64_t{64} * 1024, LandingMode::one_sided);
  EXPECT_FALSE(h.manager->resolve_direct_landing(request("t", "img", 1000)).landing.accepted());
  EXPECT_FALSE(h.manager->state_of("t").has_value());
}

}  // namespace
}  // namespace ecx::consumer
