#include "ecx/producer/push_manager.h"

#include "core/logging.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <thread>

namespace ecx::producer {
namespace {

using namespace std::chrono_literals;
using P = PushState;
using Sh = ShardState;

TensorSpec spec_of(std::int64_t n) { return TensorSpec::make({n}, DType::uint8, 1ULL << 40).value(); }

PushSpec push(std::string tid, std::string hash = "img", std::string request = "req", std::int64_t n = 1000) {
  return PushSpec{std::move(tid), std::move(hash), "tcp://127.0.0.1:14579", spec_of(n), std::move(request)};
}

reply::Reserved writer(std::uint64_t offset = 0) { return reply::Reserved{ReservationId::random(), 1, offset, true}; }

struct Fixture {
  explicit Fixture(PushOptions o = {}) : clock(std::make_shared<ManualClock>()), options(o), m(o, clock) {}
  Actions start(const PushSpec& s, int shards) {
    auto r = m.start(s, shards);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    return r.is_ok() ? std::move(r).value() : Actions{};
  }
  void expect_invariants() {
    const Status st = m.check_invariants();
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  std::shared_ptr<ManualClock> clock;
  PushOptions options;
  PushManager m;
};

TEST(PushTransitions, TableIsExactlyTheDocumentedOne) {
  const std::set<std::pair<P, P>> allowed = {
      {P::waiting_inputs, P::writing},   {P::waiting_inputs, P::done},      {P::waiting_inputs, P::cancel_pending},
      {P::waiting_inputs, P::cancelled}, {P::waiting_inputs, P::failed},    {P::writing, P::done},
      {P::writing, P::failed},           {P::cancel_pending, P::cancelled}, {P::cancel_pending, P::failed},
      {P::writing, P::waiting_inputs},  // a direct payload turned away: its shard reserves
  };
  for (std::size_t f = 0; f < kPushStateCount; ++f) {
    for (std::size_t t = 0; t < kPushStateCount; ++t) {
      const auto from = static_cast<P>(f);
      const auto to = static_cast<P>(t);
      EXPECT_EQ(push_transition_allowed(from, to), allowed.contains({from, to}))
          << push_state_name(from) << " -> " << push_state_name(to);
    }
  }
}

TEST(ShardTransitions, TableIsExactlyTheDocumentedOne) {
  using S = ShardState;
  const std::set<std::pair<S, S>> allowed = {
      {S::reserving, S::reserved},   {S::reserving, S::no_write},    {S::reserving, S::retry_wait},
      {S::reserving, S::refused},    {S::retry_wait, S::reserving},  {S::retry_wait, S::released},
      {S::reserved, S::refreshing},  {S::reserved, S::abandoning},   {S::reserved, S::sending},
      {S::reserved, S::yielding},    {S::yielding, S::retry_wait},   {S::yielding, S::reserving},
      {S::yielding, S::abandoning},  {S::no_write, S::abandoning},   {S::no_write, S::released},
      {S::refreshing, S::reserving}, {S::refreshing, S::abandoning}, {S::sending, S::sent},
      {S::sending, S::reserved},     {S::refused, S::released},      {S::abandoning, S::released},
      {S::reserved, S::reserving},  // a direct payload turned away reserves the usual way
      {S::reserved, S::released},   // a direct shard holds nothing: the push ended before it sent
  };
  for (std::size_t f = 0; f < kShardStateCount; ++f) {
    for (std::size_t t = 0; t < kShardStateCount; ++t) {
      const auto from = static_cast<S>(f);
      const auto to = static_cast<S>(t);
      // Staying put (a reserve sent again, a second release) is no transition.
      EXPECT_EQ(shard_transition_allowed(from, to), from == to || allowed.contains({from, to}))
          << shard_state_name(from) << " -> " << shard_state_name(to);
    }
  }
  EXPECT_FALSE(shard_transition_allowed(S::sent, S::sending));  // a delivered payload is final
}

TEST(Push, ReservesOnEveryShardAtOnce) {
  Fixture f;
  auto a = f.start(push("t"), 3);
  ASSERT_EQ(a.reserves.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(a.reserves[static_cast<std::size_t>(i)].shard, i);
    EXPECT_EQ(a.reserves[static_cast<std::size_t>(i)].spec.nbytes(), 1000u);
  }
  EXPECT_EQ(f.m.state_of("t"), P::waiting_inputs);
  EXPECT_TRUE(f.m.pending());
  EXPECT_EQ(f.m.counters().io_in_flight, 3u);
}

TEST(Push, ReservationFirstThenSourceSendsToEveryWritableShard) {
  Fixture f;
  f.start(push("t"), 2);
  auto r0 = writer(256);
  EXPECT_TRUE(f.m.on_reserve_reply("t", 0, r0).empty());
  EXPECT_TRUE(f.m.on_reserve_reply("t", 1, writer(512)).empty());  // no source yet
  auto a = f.m.bind_source("img", 77, 1000);
  ASSERT_EQ(a.payloads.size(), 2u);
  EXPECT_EQ(a.payloads[0].source, 77u);
  EXPECT_EQ(a.payloads[0].reservation_id, r0.reservation_id);
  EXPECT_EQ(a.payloads[0].slot_offset, 256u);
  EXPECT_EQ(a.payloads[1].slot_offset, 512u);
  EXPECT_TRUE(a.release_sources.empty());
  EXPECT_EQ(f.m.state_of("t"), P::writing);
  EXPECT_TRUE(f.m.on_payload_result("t", 0, Status::ok()).release_sources.empty());
  auto last = f.m.on_payload_result("t", 1, Status::ok());
  EXPECT_EQ(last.release_sources, std::vector<SourceId>{77});
  EXPECT_EQ(f.m.state_of("t"), P::done);
  EXPECT_FALSE(f.m.pending());
  f.expect_invariants();
}

// Lesson 16: a reservation resolving after the source goes out at once.
TEST(Push, SourceFirstThenTheLastReservationSendsImmediately) {
  Fixture f;
  f.start(push("t"), 2);
  EXPECT_TRUE(f.m.bind_source("img", 5, 1000).empty());
  EXPECT_TRUE(f.m.on_reserve_reply("t", 1, writer()).empty());
  auto a = f.m.on_reserve_reply("t", 0, writer());
  EXPECT_EQ(a.payloads.size(), 2u);
}

// Lesson 17: a ready push does not wait for a slower sibling.
TEST(Push, AReadyPushDoesNotWaitForASibling) {
  Fixture f;
  f.start(push("fast", "a"), 1);
  f.start(push("slow", "b"), 1);
  f.m.bind_source("a", 1, 1000);
  f.m.bind_source("b", 2, 1000);
  auto a = f.m.on_reserve_reply("fast", 0, writer());
  ASSERT_EQ(a.payloads.size(), 1u);
  EXPECT_EQ(a.payloads[0].transfer_id, "fast");
  EXPECT_EQ(f.m.state_of("slow"), P::waiting_inputs);
}

TEST(Push, FollowerAndCachedShardsGetNoPayload) {
  Fixture f;
  f.start(push("t"), 3);
  f.m.on_reserve_reply("t", 0, reply::Reserved{ReservationId::random(), 1, 0, false});
  f.m.on_reserve_reply("t", 1, reply::Ready{ReservationId::random()});
  f.m.on_reserve_reply("t", 2, writer());
  auto a = f.m.bind_source("img", 9, 1000);
  ASSERT_EQ(a.payloads.size(), 1u);
  EXPECT_EQ(a.payloads[0].shard, 2);
}

TEST(Push, NothingToWriteEndsDoneWithoutWaitingForTheSource) {
  Fixture f;
  f.start(push("t"), 2);
  f.m.on_reserve_reply("t", 0, reply::Ready{ReservationId::random()});
  f.m.on_reserve_reply("t", 1, reply::Reserved{ReservationId::random(), 1, 0, false});
  EXPECT_EQ(f.m.state_of("t"), P::done);
  EXPECT_EQ(f.m.bind_source("img", 3, 1000).release_sources, std::vector<SourceId>{3});  // nobody needs it
  EXPECT_TRUE(f.m.drain_failures().empty());
}

TEST(Push, ConsumerCancelledOnEveryShardEndsCancelled) {
  Fixture f;
  f.start(push("t"), 2);
  f.m.on_reserve_reply("t", 0, reply::Cancelled{});
  f.m.on_reserve_reply("t", 1, reply::Cancelled{});
  EXPECT_EQ(f.m.state_of("t"), P::cancelled);
  EXPECT_TRUE(f.m.drain_failures().empty());
}

// The dispatcher hands its spec over by move and names a refused one in its failure.
TEST(Push, StartTakesTheSpecOnlyWhenItStartsAPush) {
  Fixture f;
  PushSpec first = push("t", "img", "r1");
  ASSERT_TRUE(f.m.start(std::move(first), 1).is_ok());
  PushSpec refused = push("t", "other", "r3");
  EXPECT_EQ(f.m.start(std::move(refused), 1).status().code(), StatusCode::conflict);
  EXPECT_EQ(refused.transfer_id, "t");  // NOLINT(bugprone-use-after-move): the contract under test
  EXPECT_EQ(refused.mm_hash, "other");
  EXPECT_EQ(refused.request_id, "r3");
  PushSpec invalid = push("", "img", "r4");
  EXPECT_FALSE(f.m.start(std::move(invalid), 1).is_ok());
  EXPECT_EQ(invalid.request_id, "r4");  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(invalid.spec, spec_of(1000));
}

// Lessons 9 and 10.
TEST(Push, SameEncodingSharesThePushAndAConflictFailsOnlyTheNewcomer) {
  Fixture f;
  f.start(push("t", "img", "r1"), 2);
  auto dup = f.m.start(push("t", "img", "r2"), 2);
  ASSERT_TRUE(dup.is_ok());
  EXPECT_TRUE(dup->empty());
  auto conflict = f.m.start(push("t", "other", "r3"), 2);
  EXPECT_EQ(conflict.status().code(), StatusCode::conflict);
  EXPECT_EQ(f.m.state_of("t"), P::waiting_inputs);
  EXPECT_EQ(f.m.counters().duplicates, 1u);
  EXPECT_EQ(f.m.counters().conflicts, 1u);
  // r1 finishing does not cancel it: r2 still needs it.
  const std::vector<std::string> r1{"r1"};
  EXPECT_TRUE(f.m.cancel_requests(r1).empty());
  EXPECT_EQ(f.m.state_of("t"), P::waiting_inputs);
}

TEST(Push, InvalidStartsAreRefused) {
  Fixture f;
  EXPECT_EQ(f.m.start(push(""), 1).status().code(), StatusCode::invalid_argument);
  EXPECT_EQ(f.m.start(push("t"), 0).status().code(), StatusCode::invalid_argument);
  EXPECT_EQ(f.m.start(push("t"), 65).status().code(), StatusCode::invalid_argument);
}

// Lesson 23: a partial reserve failure abandons the shards that did reserve,
// including one whose reply arrives after the failure.
TEST(Push, PartialReserveFailureAbandonsTheShardsThatSucceeded) {
  Fixture f;
  f.start(push("t"), 3);
  auto r0 = writer();
  f.m.on_reserve_reply("t", 0, r0);
  auto a = f.m.on_reserve_reply("t", 1, reply::Refused{unavailable("shard down")});
  ASSERT_EQ(a.cancels.size(), 1u);
  EXPECT_EQ(a.cancels[0].shard, 0);
  EXPECT_EQ(a.cancels[0].reservation_id, r0.reservation_id);
  EXPECT_FALSE(a.cancels[0].refresh);
  EXPECT_EQ(f.m.state_of("t"), P::failed);
  auto late = f.m.on_reserve_reply("t", 2, writer());
  ASSERT_EQ(late.cancels.size(), 1u);
  EXPECT_EQ(late.cancels[0].shard, 2);
  auto failures = f.m.drain_failures();
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].request_ids, std::vector<std::string>{"req"});
  EXPECT_NE(failures[0].reason.find("shard down"), std::string::npos);
  f.m.on_cancel_result("t", 0, Status::ok());
  f.m.on_cancel_result("t", 2, Status::ok());
  EXPECT_FALSE(f.m.pending());
  EXPECT_TRUE(f.m.drain_failures().empty());  // reported once
  f.expect_invariants();
}

TEST(Push, RetryAfterIsRetriedUntilItFits) {
  Fixture f;
  f.start(push("t"), 1);
  f.m.bind_source("img", 1, 1000);
  EXPECT_TRUE(f.m.on_reserve_reply("t", 0, reply::RetryAfter{5ms}).empty());
  EXPECT_EQ(f.m.shard_state_of("t", 0), Sh::retry_wait);
  EXPECT_EQ(f.m.next_wakeup(), f.clock->now() + 5ms);
  EXPECT_TRUE(f.m.tick().empty());
  f.clock->advance(5ms);
  auto a = f.m.tick();
  ASSERT_EQ(a.reserves.size(), 1u);
  EXPECT_EQ(f.m.on_reserve_reply("t", 0, writer()).payloads.size(), 1u);
  EXPECT_EQ(f.m.counters().retry_afters, 1u);
}

// A push holds every shard's slot or none: a shard told to retry makes the siblings
// that reserved give their slots back (a refresh cancel, so the consumer expires the
// record instead of marking the transfer cancelled), and they reserve again with it.
TEST(Push, AShardToldToRetryMakesItsReservedSiblingsGiveTheirSlotsBack) {
  Fixture f;
  f.start(push("t"), 3);
  auto r0 = writer(256);
  EXPECT_TRUE(f.m.on_reserve_reply("t", 0, r0).empty());
  auto refused = f.m.on_reserve_reply("t", 1, reply::RetryAfter{5ms});
  ASSERT_EQ(refused.cancels.size(), 1u);
  EXPECT_EQ(refused.cancels[0].shard, 0);
  EXPECT_EQ(refused.cancels[0].reservation_id, r0.reservation_id);
  EXPECT_TRUE(refused.cancels[0].refresh);
  EXPECT_EQ(f.m.shard_state_of("t", 0), Sh::yielding);
  // A sibling reserved while one waits gives its slot back at once.
  auto late = f.m.on_reserve_reply("t", 2, writer(512));
  ASSERT_EQ(late.cancels.size(), 1u);
  EXPECT_EQ(late.cancels[0].shard, 2);
  EXPECT_EQ(f.m.counters().yields, 0u);  // counted once the consumer took the slots back
  f.expect_invariants();
  // The slots given back wait for the refused shard's retry, then all three ask again.
  EXPECT_TRUE(f.m.on_cancel_result("t", 0, Status::ok()).empty());
  EXPECT_TRUE(f.m.on_cancel_result("t", 2, Status::ok()).empty());
  EXPECT_EQ(f.m.shard_state_of("t", 0), Sh::retry_wait);
  EXPECT_EQ(f.m.shard_state_of("t", 2), Sh::retry_wait);
  EXPECT_EQ(f.m.counters().yields, 2u);
  EXPECT_EQ(f.m.next_wakeup(), f.clock->now() + 5ms);
  f.expect_invariants();
  f.clock->advance(5ms);
  auto again = f.m.tick();
  ASSERT_EQ(again.reserves.size(), 3u);
  EXPECT_TRUE(f.m.bind_source("img", 9, 1000).empty());
  for (int shard = 0; shard < 3; ++shard) f.m.on_reserve_reply("t", shard, writer());
  EXPECT_EQ(f.m.state_of("t"), P::writing);
  EXPECT_EQ(f.m.counters().yields, 2u);
  f.expect_invariants();
}

// A push to two shards: shard 0 reserved (as `r0`), shard 1 told to retry after
// `retry`, so shard 0 gives its slot back (one cancel out).
void reserve_one_refuse_other(Fixture& f, Duration retry, const reply::Reserved& r0) {
  f.start(push("t"), 2);
  f.m.on_reserve_reply("t", 0, r0);
  ASSERT_EQ(f.m.on_reserve_reply("t", 1, reply::RetryAfter{retry}).cancels.size(), 1u);
}

// The consumer keeps a slot other transfers follow (it refuses the refresh): the shard
// asks for it again at once, gets it back, and does not offer it again.
TEST(Push, ASlotTheConsumerWillNotTakeBackIsKept) {
  Fixture f;
  const auto r0 = writer(256);
  reserve_one_refuse_other(f, 5ms, r0);
  auto kept = f.m.on_cancel_result("t", 0, conflict("the shard did not cancel"));
  ASSERT_EQ(kept.reserves.size(), 1u);
  EXPECT_EQ(kept.reserves[0].shard, 0);
  EXPECT_TRUE(f.m.on_reserve_reply("t", 0, r0).cancels.empty());  // still waiting on shard 1: kept anyway
  EXPECT_EQ(f.m.shard_state_of("t", 0), Sh::reserved);
  EXPECT_EQ(f.m.counters().yields, 0u);
  f.expect_invariants();
}

// The refused shard already asked again when the yield is answered: the yielded shard
// asks at once instead of waiting for nothing.
TEST(Push, AYieldAnsweredAfterTheSiblingAskedAgainReservesAtOnce) {
  Fixture f;
  reserve_one_refuse_other(f, 5ms, writer());
  f.clock->advance(5ms);
  ASSERT_EQ(f.m.tick().reserves.size(), 1u);  // shard 1 asks again; shard 0's yield is in flight
  auto answered = f.m.on_cancel_result("t", 0, Status::ok());
  ASSERT_EQ(answered.reserves.size(), 1u);
  EXPECT_EQ(answered.reserves[0].shard, 0);
  f.expect_invariants();
}

// A push that ends while a slot is being given back releases it when the cancel is
// answered; nothing stays held or pending.
TEST(Push, APushThatEndsWhileASlotIsGivenBackReleasesIt) {
  Fixture f;
  reserve_one_refuse_other(f, 60ms, writer());
  const std::vector<std::string> finished{"req"};
  EXPECT_TRUE(f.m.cancel_requests(finished).empty());  // its request finished before the encoder output came
  EXPECT_EQ(f.m.state_of("t"), P::cancel_pending);     // the yield's cancel is still out
  EXPECT_TRUE(f.m.on_cancel_result("t", 0, Status::ok()).empty());
  EXPECT_EQ(f.m.shard_state_of("t", 0), Sh::released);
  EXPECT_EQ(f.m.state_of("t"), P::cancelled);
  EXPECT_FALSE(f.m.pending());
  f.expect_invariants();
}

// A shard refused again and again backs off: the consumer's delay the first time, then
// twice as long each time (a uniform draw from the upper half of it), up to
// retry_backoff_max; a reservation still ends it.
TEST(Push, RepeatedRetryAfterBacksOffWithJitterUpToTheCap) {
  PushOptions o;
  o.retry_backoff_max = 40ms;
  Fixture f(o);
  f.start(push("t"), 1);
  f.m.bind_source("img", 1, 1000);
  const std::vector<std::pair<Duration, Duration>> bounds = {{5ms, 5ms},   {5ms, 10ms},  {10ms, 20ms},
                                                             {20ms, 40ms}, {20ms, 40ms}, {20ms, 40ms}};
  for (const auto& [lo, hi] : bounds) {
    EXPECT_TRUE(f.m.on_reserve_reply("t", 0, reply::RetryAfter{5ms}).empty());
    ASSERT_EQ(f.m.shard_state_of("t", 0), Sh::retry_wait);
    const auto wake = f.m.next_wakeup();
    ASSERT_TRUE(wake.has_value());
    const Duration delay = *wake - f.clock->now();
    EXPECT_GE(delay, lo);
    EXPECT_LE(delay, hi);
    f.clock->advance(delay);
    ASSERT_EQ(f.m.tick().reserves.size(), 1u);
  }
  EXPECT_EQ(f.m.on_reserve_reply("t", 0, writer()).payloads.size(), 1u);
  EXPECT_EQ(f.m.counters().retry_afters, bounds.size());
}

TEST(Push, RetryAfterPastTheDeadlineFailsThePush) {
  PushOptions o;
  o.push_deadline = 1s;
  Fixture f(o);
  f.start(push("t"), 2);
  f.m.on_reserve_reply("t", 0, writer());
  f.clock->advance(990ms);
  auto a = f.m.on_reserve_reply("t", 1, reply::RetryAfter{50ms});
  EXPECT_EQ(f.m.state_of("t"), P::failed);
  ASSERT_EQ(a.cancels.size(), 1u);  // shard 0 abandoned
  auto failures = f.m.drain_failures();
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].reason.find("full"), std::string::npos);
}

TEST(Push, DeadlineWhileRetryingFailsWithThePoolFullReason) {
  PushOptions o;
  o.push_deadline = 100ms;
  Fixture f(o);
  f.start(push("t"), 1);
  f.m.on_reserve_reply("t", 0, reply::RetryAfter{60ms});
  f.clock->advance(60ms);
  f.m.tick();  // retried
  f.m.on_reserve_reply("t", 0, reply::RetryAfter{30ms});
  f.clock->advance(30ms);
  f.m.tick();
  f.m.on_reserve_reply("t", 0, reply::RetryAfter{5ms});
  f.clock->advance(10ms);
  f.m.tick();
  EXPECT_EQ(f.m.state_of("t"), P::failed);
  EXPECT_FALSE(f.m.next_wakeup().has_value());
}

// Lesson 12 / 21: a push whose encoder output never arrives fails at its deadline and
// gives its reservations back.
TEST(Push, DeadlineFailsAPushWhoseSourceNeverArrives) {
  PushOptions o;
  o.push_deadline = 2s;
  Fixture f(o);
  f.start(push("t"), 1);
  auto r = writer();
  f.m.on_reserve_reply("t", 0, r);
  f.clock->advance(2s);
  auto a = f.m.tick();
  ASSERT_EQ(a.cancels.size(), 1u);
  EXPECT_EQ(a.cancels[0].reservation_id, r.reservation_id);
  EXPECT_EQ(f.m.state_of("t"), P::failed);
  auto failures = f.m.drain_failures();
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].reason.find("encoder output"), std::string::npos);
}

// Lesson 28: a source is not released while any send may still read it, even after
// one shard failed.
TEST(Push, SourceIsNeverReleasedWhileAPayloadIsInFlight) {
  Fixture f;
  f.start(push("t"), 2);
  f.m.on_reserve_reply("t", 0, writer());
  f.m.on_reserve_reply("t", 1, writer());
  f.m.bind_source("img", 42, 1000);
  auto a = f.m.on_payload_result("t", 0, unavailable("peer reset"));
  EXPECT_TRUE(a.release_sources.empty());
  EXPECT_EQ(f.m.state_of("t"), P::writing);
  f.clock->advance(1h);
  EXPECT_TRUE(f.m.tick().release_sources.empty());  // deadlines never cut a send short
  auto last = f.m.on_payload_result("t", 1, Status::ok());
  EXPECT_EQ(last.release_sources, std::vector<SourceId>{42});
  ASSERT_EQ(last.cancels.size(), 1u);  // the failed shard's reservation is abandoned
  EXPECT_EQ(last.cancels[0].shard, 0);
  EXPECT_EQ(f.m.state_of("t"), P::failed);
  f.expect_invariants();
}

TEST(Push, SharedSourceIsReleasedAfterTheLastPushUsingIt) {
  Fixture f;
  f.start(push("a", "img", "r1"), 1);
  f.start(push("b", "img", "r2"), 1);
  f.m.on_reserve_reply("a", 0, writer());
  f.m.on_reserve_reply("b", 0, writer());
  auto a = f.m.bind_source("img", 7, 1000);
  EXPECT_EQ(a.payloads.size(), 2u);
  EXPECT_TRUE(f.m.on_payload_result("a", 0, Status::ok()).release_sources.empty());
  EXPECT_EQ(f.m.on_payload_result("b", 0, Status::ok()).release_sources, std::vector<SourceId>{7});
}

TEST(Push, SourceSizeMismatchFailsThePush) {
  Fixture f;
  f.start(push("t"), 1);
  f.m.on_reserve_reply("t", 0, writer());
  auto a = f.m.bind_source("img", 7, 999);
  EXPECT_EQ(a.release_sources, std::vector<SourceId>{7});
  EXPECT_EQ(a.cancels.size(), 1u);
  EXPECT_EQ(f.m.state_of("t"), P::failed);
}

// Lesson 21: a pre-reservation without an encoder tensor does not outlive its request.
TEST(Push, SourcelessPushesAreCancelledWhenTheirRequestsFinish) {
  Fixture f;
  f.start(push("waiting", "a", "r1"), 2);
  f.start(push("bound", "b", "r1"), 1);
  auto r0 = writer();
  f.m.on_reserve_reply("waiting", 0, r0);  // shard 1 still reserving
  f.m.bind_source("b", 1, 1000);
  const std::vector<std::string> done{"r1"};
  auto a = f.m.cancel_requests(done);
  ASSERT_EQ(a.cancels.size(), 1u);
  EXPECT_EQ(a.cancels[0].reservation_id, r0.reservation_id);
  EXPECT_EQ(f.m.state_of("waiting"), P::cancel_pending);
  EXPECT_EQ(f.m.state_of("bound"), P::waiting_inputs);  // the encode finished: it proceeds
  auto late = f.m.on_reserve_reply("waiting", 1, writer());
  EXPECT_EQ(late.cancels.size(), 1u);
  f.m.on_cancel_result("waiting", 0, Status::ok());
  EXPECT_EQ(f.m.state_of("waiting"), P::cancel_pending);
  f.m.on_cancel_result("waiting", 1, Status::ok());
  EXPECT_EQ(f.m.state_of("waiting"), P::cancelled);
  EXPECT_TRUE(f.m.drain_failures().empty());
  f.expect_invariants();
}

// Lesson 24.
TEST(Push, ShutdownCancelsEveryPushWithoutASource) {
  Fixture f;
  f.start(push("x", "a"), 1);
  f.start(push("y", "b"), 1);
  f.m.bind_source("b", 3, 1000);
  f.m.cancel_sourceless();
  EXPECT_EQ(f.m.state_of("x"), P::cancel_pending);
  EXPECT_EQ(f.m.state_of("y"), P::waiting_inputs);
  f.m.on_reserve_reply("x", 0, reply::Refused{unavailable("gone")});
  EXPECT_EQ(f.m.state_of("x"), P::cancelled);
}

// Lesson 26: a destination older than refresh_after is given up and reserved again
// before the payload goes.
TEST(Push, StaleReservationIsRefreshedBeforeWriting) {
  Fixture f;
  f.start(push("t"), 1);
  auto old = writer();
  f.m.on_reserve_reply("t", 0, old);
  f.clock->advance(151s);
  auto a = f.m.bind_source("img", 1, 1000);
  ASSERT_EQ(a.cancels.size(), 1u);
  EXPECT_TRUE(a.cancels[0].refresh);
  EXPECT_EQ(a.cancels[0].reservation_id, old.reservation_id);
  EXPECT_TRUE(a.payloads.empty());
  auto again = f.m.on_cancel_result("t", 0, Status::ok());
  ASSERT_EQ(again.reserves.size(), 1u);
  auto fresh = writer();
  auto send = f.m.on_reserve_reply("t", 0, fresh);
  ASSERT_EQ(send.payloads.size(), 1u);
  EXPECT_EQ(send.payloads[0].reservation_id, fresh.reservation_id);
  EXPECT_EQ(f.m.counters().refreshes, 1u);
}

TEST(Push, AbandonIsRetriedOnceThenGivenUp) {
  Fixture f;
  f.start(push("t"), 1);
  f.m.on_reserve_reply("t", 0, writer());
  const std::vector<std::string> done{"req"};
  f.m.cancel_requests(done);
  auto retry = f.m.on_cancel_result("t", 0, timeout_error("no reply"));
  ASSERT_EQ(retry.cancels.size(), 1u);
  auto give_up = f.m.on_cancel_result("t", 0, timeout_error("no reply"));
  EXPECT_TRUE(give_up.empty());
  EXPECT_EQ(f.m.state_of("t"), P::cancelled);
  EXPECT_EQ(f.m.counters().abandons_failed, 1u);
}

TEST(Push, LateAndUnknownRepliesAreIgnored) {
  Fixture f;
  EXPECT_TRUE(f.m.on_reserve_reply("nope", 0, writer()).empty());
  f.start(push("t"), 1);
  EXPECT_TRUE(f.m.on_reserve_reply("t", 5, writer()).empty());
  f.m.on_reserve_reply("t", 0, writer());
  EXPECT_TRUE(f.m.on_reserve_reply("t", 0, writer()).empty());  // duplicate
  EXPECT_TRUE(f.m.on_payload_result("t", 0, Status::ok()).empty());
  EXPECT_TRUE(f.m.on_cancel_result("t", 0, Status::ok()).empty());
  EXPECT_EQ(f.m.counters().late_replies, 5u);
  f.expect_invariants();
}

TEST(Push, TerminalRecordsAreBoundedAndKeepDuplicatesIdempotent) {
  PushOptions o;
  o.terminal_limit = 4;
  Fixture f(o);
  for (int i = 0; i < 10; ++i) {
    const std::string id = "t" + std::to_string(i);
    f.start(push(id, "h" + id), 1);
    f.m.on_reserve_reply(id, 0, reply::Ready{ReservationId::random()});
  }
  EXPECT_EQ(f.m.counters().terminal_records, 4u);
  EXPECT_FALSE(f.m.state_of("t0").has_value());
  EXPECT_EQ(f.m.state_of("t9"), P::done);
  auto dup = f.m.start(push("t9", "ht9"), 1);
  ASSERT_TRUE(dup.is_ok());
  EXPECT_TRUE(dup->empty());  // a retained terminal record answers a repeated spec
}

TEST(Push, TerminalRecordsLastTheirTtl) {
  PushOptions o;
  o.terminal_ttl = 300s;
  Fixture f(o);
  auto finish = [&](const std::string& id) {
    f.start(push(id, "h" + id), 1);
    f.m.on_reserve_reply(id, 0, reply::Ready{ReservationId::random()});
  };
  finish("old");
  f.clock->advance(200s);
  finish("young");
  f.clock->advance(100s);
  finish("now");  // a push becoming terminal expires what is due
  EXPECT_FALSE(f.m.state_of("old").has_value());
  EXPECT_EQ(f.m.state_of("young"), P::done);
  EXPECT_EQ(f.m.counters().terminal_records, 2u);
  f.expect_invariants();
}

TEST(Push, OptionsFollowTheConfiguration) {
  Config c;
  c.push_wait_timeout_s = 12;
  c.reservation_ttl_s = 100;
  auto o = PushOptions::from_config(c);
  EXPECT_EQ(o.push_deadline, 12s);
  EXPECT_EQ(o.refresh_after, 50s);
  EXPECT_EQ(o.terminal_ttl, 100s);
  EXPECT_EQ(o.direct_max_bytes, 1ULL << 30);
  c.ucx_mode = "put";  // its sends cannot be confirmed: no direct payloads
  EXPECT_EQ(PushOptions::from_config(c).direct_max_bytes, 0u);
  c.ucx_mode = "am";
  c.transport = "mooncake";
  EXPECT_EQ(PushOptions::from_config(c).direct_max_bytes, 0u);
}

PushOptions direct_up_to(std::uint64_t bytes) {
  PushOptions o;
  o.direct_max_bytes = bytes;
  return o;
}

// A finished push leaves a compact record once its I/O has settled: a repeat of its
// transfer id is still a duplicate with the same destination and a conflict with any
// other (content, consumer, shape or shard count), and its states still answer.
TEST(Push, AFinishedPushStillAnswersRepeatsAndQueries) {
  Fixture f(direct_up_to(1000));
  f.start(push("t", "img", "r1"), 2);
  auto sent = f.m.bind_source("img", 9, 1000);
  ASSERT_EQ(sent.payloads.size(), 2u);
  EXPECT_TRUE(f.m.on_payload_result("t", 0, Status::ok()).empty());
  EXPECT_EQ(f.m.on_payload_result("t", 1, Status::ok()).release_sources, std::vector<SourceId>{9});
  f.m.tick();  // the next call moves it to the settled records
  f.expect_invariants();
  EXPECT_EQ(f.m.state_of("t"), P::done);
  EXPECT_EQ(f.m.shard_state_of("t", 1), Sh::sent);
  EXPECT_FALSE(f.m.shard_state_of("t", 2).has_value());
  EXPECT_EQ(f.m.counters().terminal_records, 1u);
  EXPECT_EQ(f.m.counters().active, 0u);
  EXPECT_FALSE(f.m.pending());

  auto dup = f.m.start(push("t", "img", "r2"), 2);
  ASSERT_TRUE(dup.is_ok());
  EXPECT_TRUE(dup->empty());
  EXPECT_EQ(f.m.counters().duplicates, 1u);
  PushSpec elsewhere = push("t", "img", "r3");
  elsewhere.consumer_address = "tcp://127.0.0.1:14580";
  for (auto [spec, shards] : std::vector<std::pair<PushSpec, int>>{{push("t", "other", "r3"), 2},
                                                                   {elsewhere, 2},
                                                                   {push("t", "img", "r3", 999), 2},
                                                                   {push("t", "img", "r3"), 1}}) {
    EXPECT_EQ(f.m.start(spec, shards).status().code(), StatusCode::conflict) << spec.mm_hash << " " << shards;
  }
  EXPECT_EQ(f.m.counters().conflicts, 4u);
  EXPECT_EQ(f.m.state_of("t"), P::done);
  f.expect_invariants();
}

// A push that ends with a reserve in flight keeps its full record until the reply
// comes: that reply must still give back what it reserved.
TEST(Push, AFinishedPushWithAReplyInFlightSettlesOnlyAfterIt) {
  PushOptions o;
  o.terminal_limit = 1;
  Fixture f(o);
  f.start(push("t", "img", "r1"), 1);
  const std::vector<std::string> r1{"r1"};
  f.m.cancel_requests(r1);  // no source yet: cancelled while its reserve is out
  f.start(push("u", "img2", "r2"), 1);
  f.start(push("v", "img3", "r3"), 1);
  EXPECT_EQ(f.m.counters().io_in_flight, 3u);
  // The limit of 1 cannot drop "t": its reply is still to come.
  EXPECT_TRUE(f.m.state_of("t").has_value());
  auto abandon = f.m.on_reserve_reply("t", 0, writer());
  ASSERT_EQ(abandon.cancels.size(), 1u);  // the late reservation is given back
  EXPECT_TRUE(f.m.on_cancel_result("t", 0, Status::ok()).empty());
  EXPECT_EQ(f.m.state_of("t"), P::cancelled);
  f.m.tick();
  f.expect_invariants();
  EXPECT_EQ(f.m.state_of("t"), P::cancelled);
  EXPECT_EQ(f.m.shard_state_of("t", 0), Sh::released);
  EXPECT_EQ(f.m.counters().terminal_records, 1u);
}

TEST(Direct, ASmallItemSkipsTheReserveAndGoesOutWithItsSource) {
  Fixture f(direct_up_to(1000));
  auto a = f.start(push("t"), 2);
  EXPECT_TRUE(a.reserves.empty());
  EXPECT_EQ(f.m.counters().io_in_flight, 0u);
  auto sent = f.m.bind_source("img", 9, 1000);
  ASSERT_EQ(sent.payloads.size(), 2u);
  for (const auto& p : sent.payloads) {
    EXPECT_TRUE(p.direct);
    EXPECT_TRUE(p.reservation_id.is_none());
    EXPECT_EQ(p.mm_hash, "img");
    ASSERT_TRUE(p.spec.has_value());
    EXPECT_EQ(p.spec->nbytes(), 1000u);
  }
  EXPECT_TRUE(f.m.on_payload_result("t", 0, Status::ok()).empty());
  auto last = f.m.on_payload_result("t", 1, Status::ok());
  EXPECT_EQ(last.release_sources, std::vector<SourceId>{9});
  EXPECT_EQ(f.m.state_of("t"), P::done);
  EXPECT_EQ(f.m.counters().direct_sent, 2u);
  EXPECT_EQ(f.m.counters().direct_turned_away, 0u);
  f.expect_invariants();
}

TEST(Direct, ALargerItemReservesFirst) {
  Fixture f(direct_up_to(999));
  EXPECT_EQ(f.start(push("t"), 2).reserves.size(), 2u);
}

// One shard: any item up to the limit goes direct. Several shards: a push holds every
// shard's slot or none, so only items up to kDirectMaxBytesAcrossShards skip the reserve.
TEST(Direct, ALargeItemGoesDirectToOneShardButReservesFirstAcrossSeveral) {
  Fixture f(direct_up_to(1ULL << 30));
  const std::int64_t large = static_cast<std::int64_t>(kDirectMaxBytesAcrossShards) + 2;
  const std::int64_t small = static_cast<std::int64_t>(kDirectMaxBytesAcrossShards);
  EXPECT_TRUE(f.start(push("one", "a", "req", large), 1).reserves.empty());
  EXPECT_EQ(f.start(push("two", "b", "req", large), 2).reserves.size(), 2u);
  EXPECT_TRUE(f.start(push("small", "c", "req", small), 2).reserves.empty());
  EXPECT_EQ(f.m.shard_state_of("one", 0), Sh::reserved);
  EXPECT_EQ(f.m.shard_state_of("two", 1), Sh::reserving);
  f.expect_invariants();
}

TEST(Direct, AShardThatTurnsThePayloadAwayIsReservedOnceTheOtherSendsSettle) {
  Fixture f(direct_up_to(1000));
  f.start(push("t"), 2);
  f.m.bind_source("img", 9, 1000);
  // Shard 1 turns it away while shard 0's send is still out: nothing is asked yet.
  EXPECT_TRUE(f.m.on_payload_result("t", 1, resource_exhausted("pool full")).empty());
  EXPECT_EQ(f.m.state_of("t"), P::writing);
  auto a = f.m.on_payload_result("t", 0, Status::ok());
  ASSERT_EQ(a.reserves.size(), 1u);
  EXPECT_EQ(a.reserves[0].shard, 1);
  EXPECT_TRUE(a.release_sources.empty());  // the fallback payload still needs it
  EXPECT_EQ(f.m.state_of("t"), P::waiting_inputs);
  EXPECT_EQ(f.m.shard_state_of("t", 0), Sh::sent);
  f.expect_invariants();
  // The reserve's answer decides: here a writer slot, so the usual payload follows,
  // to shard 1 only.
  auto r = writer(4096);
  auto b = f.m.on_reserve_reply("t", 1, r);
  ASSERT_EQ(b.payloads.size(), 1u);
  EXPECT_EQ(b.payloads[0].shard, 1);
  EXPECT_FALSE(b.payloads[0].direct);
  EXPECT_EQ(b.payloads[0].reservation_id, r.reservation_id);
  auto done = f.m.on_payload_result("t", 1, Status::ok());
  EXPECT_EQ(done.release_sources, std::vector<SourceId>{9});
  EXPECT_EQ(f.m.state_of("t"), P::done);
  EXPECT_EQ(f.m.counters().direct_turned_away, 1u);
  f.expect_invariants();
}

// A one-shard direct push "t" whose payload (source 9) the shard turned away,
// `encoding` after the push started: what the push asks for next.
Actions turned_away_alone(Fixture& f, Duration encoding = {}) {
  f.start(push("t"), 1);
  f.clock->advance(encoding);
  f.m.bind_source("img", 9, 1000);
  return f.m.on_payload_result("t", 0, resource_exhausted("turned away"));
}

TEST(Direct, AFallbackReserveThatFindsTheContentThereEndsDone) {
  Fixture f(direct_up_to(1000));
  auto a = turned_away_alone(f);
  ASSERT_EQ(a.reserves.size(), 1u);
  auto b = f.m.on_reserve_reply("t", 0, reply::Ready{ReservationId::random()});
  EXPECT_EQ(b.release_sources, std::vector<SourceId>{9});
  EXPECT_EQ(f.m.state_of("t"), P::done);
  f.expect_invariants();
}

TEST(Direct, AFallbackKeepsThePushDeadline) {
  Fixture f(direct_up_to(1000));
  turned_away_alone(f, 30s);
  // 35 s more would pass the deadline the push started with (60 s from its start).
  auto a = f.m.on_reserve_reply("t", 0, reply::RetryAfter{35s});
  EXPECT_EQ(a.release_sources, std::vector<SourceId>{9});
  EXPECT_EQ(f.m.state_of("t"), P::failed);
  f.expect_invariants();
}

TEST(Direct, APayloadThatDidNotArriveIsReservedAndAGoneConsumerFailsThePush) {
  Fixture f(direct_up_to(1000));
  f.start(push("t"), 2);
  f.m.bind_source("img", 9, 1000);
  f.m.on_payload_result("t", 0, resource_exhausted("turned away"));
  // A direct payload that did not arrive is turned away the same way: the shard reserves.
  auto a = f.m.on_payload_result("t", 1, unavailable("peer gone"));
  EXPECT_EQ(a.reserves.size(), 2u);
  // The consumer is gone: the first refused reserve fails the push.
  auto b = f.m.on_reserve_reply("t", 0, reply::Refused{unavailable("unreachable")});
  EXPECT_EQ(b.release_sources, std::vector<SourceId>{9});
  EXPECT_TRUE(f.m.on_reserve_reply("t", 1, reply::Refused{unavailable("unreachable")}).empty());
  EXPECT_EQ(f.m.state_of("t"), P::failed);
  f.expect_invariants();
}

// A small simulated world: actions are executed with random outcomes and delays.
// Checks that a source is never released while a payload naming it is outstanding,
// that every reservation handed out is either written, owned by the consumer or
// abandoned, and that everything settles.
TEST(PushModel, RandomWorldsSettleWithoutLeaks) {
  const auto level = log::level();
  log::set_level(spdlog::level::err);  // thousands of expected warnings otherwise
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed=" << seed);
    std::mt19937_64 rng(seed);
    auto pick = [&rng](int n) { return static_cast<int>(rng() % static_cast<std::uint64_t>(n)); };
    PushOptions o;
    o.push_deadline = 2s;
    o.refresh_after = 1s;
    if (seed % 2 == 0) o.direct_max_bytes = 1000;  // every item goes direct first
    Fixture f(o);
    std::vector<ReserveCommand> reserves;
    std::vector<PayloadCommand> payloads;
    std::vector<CancelCommand> cancels;
    std::multiset<SourceId> outstanding_sources;
    std::set<SourceId> released;
    std::set<std::pair<std::string, int>> held;  // reservations the simulated consumer holds for us
    SourceId next_source = 1;
    auto absorb = [&](Actions a) {
      for (auto& c : a.reserves) reserves.push_back(std::move(c));
      for (auto& c : a.payloads) {
        ASSERT_FALSE(released.contains(c.source)) << "payload names a released source";
        outstanding_sources.insert(c.source);
        payloads.push_back(std::move(c));
      }
      for (auto& c : a.cancels) cancels.push_back(std::move(c));
      for (SourceId s : a.release_sources) {
        ASSERT_FALSE(outstanding_sources.contains(s)) << "source " << s << " released under a send";
        released.insert(s);
      }
    };
    for (int step = 0; step < 80 && !HasFatalFailure(); ++step) {
      const std::string tid = "t" + std::to_string(pick(8));
      const std::string hash = "h" + std::to_string(pick(3));
      switch (pick(8)) {
        case 0: {
          auto r = f.m.start(push(tid, hash, "r" + std::to_string(pick(4))), 1 + pick(2));
          if (r.is_ok()) absorb(std::move(r).value());
          break;
        }
        case 1:
          if (!reserves.empty()) {
            auto c = reserves[static_cast<std::size_t>(pick(static_cast<int>(reserves.size())))];
            std::erase_if(reserves, [&](const ReserveCommand& x) {
              return x.transfer_id == c.transfer_id && x.shard == c.shard;
            });
            const int kind = pick(10);
            ReserveReply rep = kind < 5   ? ReserveReply{writer()}
                               : kind < 6 ? ReserveReply{reply::Ready{ReservationId::random()}}
                               : kind < 7 ? ReserveReply{reply::Cancelled{}}
                               : kind < 9 ? ReserveReply{reply::RetryAfter{100ms}}
                                          : ReserveReply{reply::Refused{unavailable("x")}};
            if (kind < 5) held.insert({c.transfer_id, c.shard});
            absorb(f.m.on_reserve_reply(c.transfer_id, c.shard, rep));
          }
          break;
        case 2:
          absorb(f.m.bind_source(hash, next_source++, 1000));
          break;
        case 3:
          if (!payloads.empty()) {
            const std::size_t i = static_cast<std::size_t>(pick(static_cast<int>(payloads.size())));
            auto c = payloads[i];
            payloads.erase(payloads.begin() + static_cast<std::ptrdiff_t>(i));
            outstanding_sources.erase(outstanding_sources.find(c.source));
            const bool ok = pick(5) != 0;
            if (ok) held.erase({c.transfer_id, c.shard});
            absorb(f.m.on_payload_result(c.transfer_id, c.shard, ok ? Status::ok() : unavailable("lost")));
          }
          break;
        case 4:
          if (!cancels.empty()) {
            const std::size_t i = static_cast<std::size_t>(pick(static_cast<int>(cancels.size())));
            auto c = cancels[i];
            cancels.erase(cancels.begin() + static_cast<std::ptrdiff_t>(i));
            held.erase({c.transfer_id, c.shard});
            absorb(f.m.on_cancel_result(c.transfer_id, c.shard, Status::ok()));
          }
          break;
        case 5: {
          const std::vector<std::string> done{"r" + std::to_string(pick(4))};
          absorb(f.m.cancel_requests(done));
          break;
        }
        default:
          f.clock->advance(std::chrono::milliseconds(pick(400)));
          absorb(f.m.tick());
          break;
      }
      const Status st = f.m.check_invariants();
      ASSERT_TRUE(st.is_ok()) << st.to_string();
    }
    // Settle: answer everything still outstanding, let deadlines pass.
    for (int round = 0; round < 20 && !HasFatalFailure(); ++round) {
      auto rs = std::move(reserves);
      reserves.clear();
      for (auto& c : rs) {
        held.insert({c.transfer_id, c.shard});
        absorb(f.m.on_reserve_reply(c.transfer_id, c.shard, writer()));
      }
      auto ps = std::move(payloads);
      payloads.clear();
      for (auto& c : ps) {
        outstanding_sources.erase(outstanding_sources.find(c.source));
        held.erase({c.transfer_id, c.shard});
        absorb(f.m.on_payload_result(c.transfer_id, c.shard, Status::ok()));
      }
      auto cs = std::move(cancels);
      cancels.clear();
      for (auto& c : cs) {
        held.erase({c.transfer_id, c.shard});
        absorb(f.m.on_cancel_result(c.transfer_id, c.shard, Status::ok()));
      }
      f.clock->advance(3s);
      absorb(f.m.tick());
    }
    EXPECT_FALSE(f.m.pending());
    EXPECT_EQ(f.m.counters().sources_held, 0u);
    // Every shard move the random world drove is one the shard table allows.
    EXPECT_EQ(f.m.counters().invalid_transitions, 0u);
    // Every writer reservation the consumer granted was written or abandoned.
    for (const auto& [tid, shard] : held) ADD_FAILURE() << tid << " left its reservation on shard " << shard;
  }
  log::set_level(level);
}

TEST(PushConcurrency, ThreadsDrivingPushesKeepTheBookkeepingConsistent) {
  Fixture f;
  auto run = [&f](int id) {
    for (int i = 0; i < 400; ++i) {
      const std::string tid = "p" + std::to_string(id) + "-" + std::to_string(i);
      const std::string hash = "h" + std::to_string(id) + "-" + std::to_string(i);
      auto started = f.m.start(push(tid, hash), 2);
      if (!started.is_ok()) continue;
      f.m.on_reserve_reply(tid, 0, writer());
      f.m.on_reserve_reply(tid, 1, writer());
      auto a = f.m.bind_source(hash, static_cast<SourceId>(id) * 100000 + static_cast<SourceId>(i), 1000);
      for (const auto& p : a.payloads) f.m.on_payload_result(p.transfer_id, p.shard, Status::ok());
      f.m.tick();
      (void)f.m.drain_failures();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) threads.emplace_back(run, t);
  for (auto& t : threads) t.join();
  EXPECT_FALSE(f.m.pending());
  EXPECT_EQ(f.m.counters().done, 1600u);
  f.expect_invariants();
}

}  // namespace
}  // namespace ecx::producer
