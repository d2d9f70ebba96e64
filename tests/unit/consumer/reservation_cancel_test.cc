// cancel() case by case: every record a cancel can meet (by landing mode, state,
// writer or follower, open write or not) crossed with every kind of cancel (consumer,
// abandon, refresh, refresh without abandon, a stale reservation id, no reservation
// id). Each line of the table pins what the cancel returns and what it leaves behind:
// the record's state, a follower's state, the events, the pool's bytes, the writes
// still open, the cancel counters and what a reserve of the same transfer gets next.

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "core/logging.h"
#include "reservation_test_util.h"

namespace ecx::consumer {
namespace {

using namespace std::chrono_literals;
using testing::as;
using testing::Harness;
using testing::request;

constexpr std::int64_t kBytes = 1000;

// A record set up for the cancel: the transfer the cancel names, its reservation id,
// and a follower of the same content when the case has one.
struct Subject {
  std::string tid = "t";
  ReservationId rid;
  std::string follower;
};

using Arrange = std::function<Subject(Harness&)>;

Subject writer(Harness& h) { return {"t", h.reserve_writer("t", "h", kBytes).reservation_id, ""}; }

Subject writer_with_follower(Harness& h) {
  Subject s = writer(h);
  as<outcome::Reserved>(h.manager->reserve(request("f", "h", kBytes)));
  s.follower = "f";
  return s;
}

Subject writer_landing(Harness& h) {
  Subject s = writer(h);
  EXPECT_TRUE(h.manager->resolve_landing("t", s.rid, kBytes).accepted());
  return s;
}

Subject writer_ready(Harness& h) {
  Subject s = writer(h);
  if (h.options.mode == LandingMode::one_sided) {
    EXPECT_EQ(h.manager->writer_completed("t", s.rid), CompletionOutcome::became_ready);
  } else {
    h.land("t", outcome::Reserved{s.rid, 0, 0, kBytes, true});
  }
  return s;
}

// Consumer-side cancel deferred by the open write (one-sided) or the follower.
Subject writer_cancel_pending(Harness& h) {
  Subject s = h.options.mode == LandingMode::one_sided ? writer(h) : writer_with_follower(h);
  EXPECT_EQ(h.manager->cancel(CancelRequest{"t", s.rid, false, false}), CancelOutcome::deferred);
  return s;
}

Subject writer_cancel_pending_landing(Harness& h) {
  Subject s = writer_landing(h);
  EXPECT_EQ(h.manager->cancel(CancelRequest{"t", s.rid, false, false}), CancelOutcome::deferred);
  return s;
}

// Expired (one-sided, open write) or refreshed while landing (receiver-chosen).
Subject writer_expire_pending(Harness& h) {
  if (h.options.mode == LandingMode::one_sided) {
    Subject s = writer(h);
    h.clock->advance(h.options.ttl + 1s);
    h.manager->expire();
    return s;
  }
  Subject s = writer_landing(h);
  EXPECT_EQ(h.manager->cancel(CancelRequest{"t", s.rid, true, true}), CancelOutcome::deferred);
  return s;
}

Subject follower_writing(Harness& h) {
  writer(h);
  return {"f", as<outcome::Reserved>(h.manager->reserve(request("f", "h", kBytes))).reservation_id, ""};
}

Subject follower_ready(Harness& h) {
  Subject s = follower_writing(h);
  const Subject w{"t", h.manager->describe("t")->reservation_id, ""};
  if (h.options.mode == LandingMode::one_sided) {
    EXPECT_EQ(h.manager->writer_completed("t", w.rid), CompletionOutcome::became_ready);
  } else {
    h.land("t", outcome::Reserved{w.rid, 0, 0, kBytes, true});
  }
  return s;
}

Subject resident_ready(Harness& h) {
  writer_ready(h);
  EXPECT_TRUE(h.manager->take("t", "h").is_ok());  // the lease ends at once: resident
  return {"r", as<outcome::Ready>(h.manager->reserve(request("r", "h", kBytes))).reservation_id, ""};
}

Subject tomb_pre_reserved(Harness& h) {
  EXPECT_EQ(h.manager->cancel(CancelRequest{"t", ReservationId{}, false, false}), CancelOutcome::pre_reserved);
  return {"t", ReservationId{}, ""};
}

Subject tomb_expired(Harness& h) {
  Subject s = writer(h);
  if (h.options.mode == LandingMode::one_sided) {
    EXPECT_EQ(h.manager->cancel(CancelRequest{"t", s.rid, true, true}), CancelOutcome::refreshed);
  } else {
    h.clock->advance(h.options.ttl + 1s);
    h.manager->expire();
  }
  return s;
}

Subject tomb_failed(Harness& h) {
  Subject s = writer_landing(h);
  EXPECT_EQ(h.manager->complete_landing("t", s.rid, false), CompletionOutcome::failed);
  return s;
}

std::string reserve_kind(const ReserveOutcome& o) {
  if (const auto* r = std::get_if<outcome::Reserved>(&o)) return r->write ? "reserved-write" : "reserved-follow";
  if (const auto* r = std::get_if<outcome::Ready>(&o)) return r->cached ? "ready-cached" : "ready";
  if (std::holds_alternative<outcome::Cancelled>(o)) return "cancelled";
  if (std::holds_alternative<outcome::RetryAfter>(o)) return "retry";
  return "refused";
}

std::string state_name(Harness& h, const std::string& tid) {
  const auto state = h.manager->state_of(tid);
  return state ? std::string(reservation_state_name(*state)) : "gone";
}

std::string events(Harness& h) {
  std::string out;
  for (const ReservationEvent& e : h.manager->drain_events()) {
    if (!out.empty()) out += ",";
    std::visit([&](const auto& ev) { out += ev.transfer_id; }, e);
    if (std::holds_alternative<ReadyEvent>(e)) out += ":ready";
    if (std::holds_alternative<AbandonedEvent>(e)) out += ":abandoned";
    if (std::holds_alternative<FailedEvent>(e)) out += ":failed";
  }
  return out.empty() ? "-" : out;
}

// Sets the case up, drains what the setup published, runs the cancel, and describes
// what it did.
std::string run(LandingMode mode, const Arrange& setup, bool abandon, bool refresh, const char* rid_kind) {
  Harness h(std::uint64_t{64} * 1024, mode);
  const Subject s = setup(h);
  h.manager->drain_events();
  const ReservationCounters before = h.manager->counters();
  const ReservationId rid = std::string_view(rid_kind) == "stale"  ? ReservationId::random()
                            : std::string_view(rid_kind) == "none" ? ReservationId{}
                                                                   : s.rid;
  const CancelOutcome outcome = h.manager->cancel(CancelRequest{s.tid, rid, abandon, refresh});
  const ReservationCounters after = h.manager->counters();
  const Status invariants = h.manager->check_invariants();
  std::string out = fmt::format("{} state={}", cancel_outcome_name(outcome), state_name(h, s.tid));
  if (!s.follower.empty()) out += fmt::format(" follower={}", state_name(h, s.follower));
  out +=
      fmt::format(" events={} used={} open={} accepted={} deferred={} rejected={}", events(h), after.pool_used_bytes,
                  h.manager->wait_for_writers(0s).writers_remaining, after.cancels_accepted - before.cancels_accepted,
                  after.cancels_deferred - before.cancels_deferred, after.cancels_rejected - before.cancels_rejected);
  if (!invariants.is_ok()) out += " invariants=" + invariants.to_string();
  out += " next=" + reserve_kind(h.manager->reserve(request(s.tid, "h", kBytes)));
  return out;
}

struct Variant {
  const char* name;
  bool abandon;
  bool refresh;
  const char* rid;
};
constexpr Variant kVariants[] = {
    {"consumer", false, false, "same"},    {"abandon", true, false, "same"}, {"refresh", true, true, "same"},
    {"refresh-only", false, true, "same"}, {"stale", true, false, "stale"},  {"no-rid", false, false, "none"},
};

// A function's static: a namespace-scope map's construction could throw before main.
const std::map<std::string, std::string>& expected() {
  // clang-format off
  static const std::map<std::string, std::string> table = {
    {"receiver-chosen writer-writing consumer",
     "cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen writer-writing abandon",
     "cancelled state=cancelled events=t:abandoned used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen writer-writing refresh",
     "refreshed state=expired events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=reserved-write"},
    {"receiver-chosen writer-writing refresh-only",
     "rejected state=writing events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"receiver-chosen writer-writing stale",
     "rejected state=writing events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"receiver-chosen writer-writing no-rid",
     "cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen writer-writing-followed consumer",
     "deferred state=cancel_pending follower=writing events=- used=1024 open=0 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-writing-followed abandon",
     "cancelled state=cancelled follower=cancelled events=t:abandoned,f:abandoned used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen writer-writing-followed refresh",
     "rejected state=writing follower=writing events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"receiver-chosen writer-writing-followed refresh-only",
     "rejected state=writing follower=writing events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"receiver-chosen writer-writing-followed stale",
     "rejected state=writing follower=writing events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"receiver-chosen writer-writing-followed no-rid",
     "deferred state=cancel_pending follower=writing events=- used=1024 open=0 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-landing consumer",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-landing abandon",
     "deferred state=cancel_pending events=t:abandoned used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-landing refresh",
     "deferred state=expire_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=refused"},
    {"receiver-chosen writer-landing refresh-only",
     "rejected state=landing events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=reserved-follow"},
    {"receiver-chosen writer-landing stale",
     "rejected state=landing events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=reserved-follow"},
    {"receiver-chosen writer-landing no-rid",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-ready consumer",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen writer-ready abandon",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen writer-ready refresh",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"receiver-chosen writer-ready refresh-only",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"receiver-chosen writer-ready stale",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"receiver-chosen writer-ready no-rid",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen writer-cancel-pending consumer",
     "deferred state=cancel_pending follower=writing events=- used=1024 open=0 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-cancel-pending abandon",
     "cancelled state=cancelled follower=cancelled events=t:abandoned,f:abandoned used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen writer-cancel-pending refresh",
     "cancelled state=cancelled follower=cancelled events=t:abandoned,f:abandoned used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen writer-cancel-pending refresh-only",
     "rejected state=cancel_pending follower=writing events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=cancelled"},
    {"receiver-chosen writer-cancel-pending stale",
     "rejected state=cancel_pending follower=writing events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=cancelled"},
    {"receiver-chosen writer-cancel-pending no-rid",
     "deferred state=cancel_pending follower=writing events=- used=1024 open=0 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-cancel-pending-landing consumer",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-cancel-pending-landing abandon",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-cancel-pending-landing refresh",
     "rejected state=cancel_pending events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=cancelled"},
    {"receiver-chosen writer-cancel-pending-landing refresh-only",
     "rejected state=cancel_pending events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=cancelled"},
    {"receiver-chosen writer-cancel-pending-landing stale",
     "rejected state=cancel_pending events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=cancelled"},
    {"receiver-chosen writer-cancel-pending-landing no-rid",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-expire-pending consumer",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen writer-expire-pending abandon",
     "deferred state=expire_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=refused"},
    {"receiver-chosen writer-expire-pending refresh",
     "deferred state=expire_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=refused"},
    {"receiver-chosen writer-expire-pending refresh-only",
     "rejected state=expire_pending events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=refused"},
    {"receiver-chosen writer-expire-pending stale",
     "rejected state=expire_pending events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=refused"},
    {"receiver-chosen writer-expire-pending no-rid",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"receiver-chosen follower-writing consumer",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen follower-writing abandon",
     "cancelled state=cancelled events=f:abandoned used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen follower-writing refresh",
     "refreshed state=expired events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=reserved-follow"},
    {"receiver-chosen follower-writing refresh-only",
     "rejected state=writing events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=reserved-follow"},
    {"receiver-chosen follower-writing stale",
     "rejected state=writing events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=reserved-follow"},
    {"receiver-chosen follower-writing no-rid",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen follower-ready consumer",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen follower-ready abandon",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen follower-ready refresh",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"receiver-chosen follower-ready refresh-only",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"receiver-chosen follower-ready stale",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"receiver-chosen follower-ready no-rid",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen resident-ready consumer",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen resident-ready abandon",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen resident-ready refresh",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"receiver-chosen resident-ready refresh-only",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"receiver-chosen resident-ready stale",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"receiver-chosen resident-ready no-rid",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen tomb-pre-reserved consumer",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen tomb-pre-reserved abandon",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen tomb-pre-reserved refresh",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen tomb-pre-reserved refresh-only",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen tomb-pre-reserved stale",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen tomb-pre-reserved no-rid",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen tomb-expired consumer",
     "already_terminal state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen tomb-expired abandon",
     "already_terminal state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen tomb-expired refresh",
     "refreshed state=expired events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=reserved-write"},
    {"receiver-chosen tomb-expired refresh-only",
     "refreshed state=expired events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=reserved-write"},
    {"receiver-chosen tomb-expired stale",
     "rejected state=expired events=- used=0 open=0 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"receiver-chosen tomb-expired no-rid",
     "already_terminal state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"receiver-chosen tomb-failed consumer",
     "already_terminal state=failed events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=refused"},
    {"receiver-chosen tomb-failed abandon",
     "already_terminal state=failed events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=refused"},
    {"receiver-chosen tomb-failed refresh",
     "already_terminal state=failed events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=refused"},
    {"receiver-chosen tomb-failed refresh-only",
     "already_terminal state=failed events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=refused"},
    {"receiver-chosen tomb-failed stale",
     "rejected state=failed events=- used=0 open=0 accepted=0 deferred=0 rejected=1 next=refused"},
    {"receiver-chosen tomb-failed no-rid",
     "already_terminal state=failed events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=refused"},
    {"one-sided writer-writing consumer",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"one-sided writer-writing abandon",
     "cancelled state=cancelled events=t:abandoned used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided writer-writing refresh",
     "refreshed state=expired events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=reserved-write"},
    {"one-sided writer-writing refresh-only",
     "rejected state=writing events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"one-sided writer-writing stale",
     "rejected state=writing events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"one-sided writer-writing no-rid",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"one-sided writer-writing-followed consumer",
     "deferred state=cancel_pending follower=writing events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"one-sided writer-writing-followed abandon",
     "cancelled state=cancelled follower=cancelled events=t:abandoned,f:abandoned used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided writer-writing-followed refresh",
     "rejected state=writing follower=writing events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"one-sided writer-writing-followed refresh-only",
     "rejected state=writing follower=writing events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"one-sided writer-writing-followed stale",
     "rejected state=writing follower=writing events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"one-sided writer-writing-followed no-rid",
     "deferred state=cancel_pending follower=writing events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"one-sided writer-ready consumer",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided writer-ready abandon",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided writer-ready refresh",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"one-sided writer-ready refresh-only",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"one-sided writer-ready stale",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"one-sided writer-ready no-rid",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided writer-cancel-pending consumer",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"one-sided writer-cancel-pending abandon",
     "cancelled state=cancelled events=t:abandoned used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided writer-cancel-pending refresh",
     "cancelled state=cancelled events=t:abandoned used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided writer-cancel-pending refresh-only",
     "rejected state=cancel_pending events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=cancelled"},
    {"one-sided writer-cancel-pending stale",
     "rejected state=cancel_pending events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=cancelled"},
    {"one-sided writer-cancel-pending no-rid",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"one-sided writer-expire-pending consumer",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"one-sided writer-expire-pending abandon",
     "cancelled state=expired events=t:abandoned used=0 open=0 accepted=1 deferred=0 rejected=0 next=reserved-write"},
    {"one-sided writer-expire-pending refresh",
     "refreshed state=expired events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=reserved-write"},
    {"one-sided writer-expire-pending refresh-only",
     "rejected state=expire_pending events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=refused"},
    {"one-sided writer-expire-pending stale",
     "rejected state=expire_pending events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=refused"},
    {"one-sided writer-expire-pending no-rid",
     "deferred state=cancel_pending events=- used=1024 open=1 accepted=1 deferred=1 rejected=0 next=cancelled"},
    {"one-sided follower-writing consumer",
     "cancelled state=cancelled events=- used=1024 open=1 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided follower-writing abandon",
     "cancelled state=cancelled events=f:abandoned used=1024 open=1 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided follower-writing refresh",
     "refreshed state=expired events=- used=1024 open=1 accepted=1 deferred=0 rejected=0 next=reserved-follow"},
    {"one-sided follower-writing refresh-only",
     "rejected state=writing events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=reserved-follow"},
    {"one-sided follower-writing stale",
     "rejected state=writing events=- used=1024 open=1 accepted=0 deferred=0 rejected=1 next=reserved-follow"},
    {"one-sided follower-writing no-rid",
     "cancelled state=cancelled events=- used=1024 open=1 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided follower-ready consumer",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided follower-ready abandon",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided follower-ready refresh",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"one-sided follower-ready refresh-only",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"one-sided follower-ready stale",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"one-sided follower-ready no-rid",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided resident-ready consumer",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided resident-ready abandon",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided resident-ready refresh",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"one-sided resident-ready refresh-only",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"one-sided resident-ready stale",
     "rejected state=ready events=- used=1024 open=0 accepted=0 deferred=0 rejected=1 next=ready"},
    {"one-sided resident-ready no-rid",
     "cancelled state=cancelled events=- used=1024 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided tomb-pre-reserved consumer",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided tomb-pre-reserved abandon",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided tomb-pre-reserved refresh",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided tomb-pre-reserved refresh-only",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided tomb-pre-reserved stale",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided tomb-pre-reserved no-rid",
     "already_cancelled state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided tomb-expired consumer",
     "already_terminal state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided tomb-expired abandon",
     "already_terminal state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
    {"one-sided tomb-expired refresh",
     "refreshed state=expired events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=reserved-write"},
    {"one-sided tomb-expired refresh-only",
     "refreshed state=expired events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=reserved-write"},
    {"one-sided tomb-expired stale",
     "rejected state=expired events=- used=0 open=0 accepted=0 deferred=0 rejected=1 next=reserved-write"},
    {"one-sided tomb-expired no-rid",
     "already_terminal state=cancelled events=- used=0 open=0 accepted=1 deferred=0 rejected=0 next=cancelled"},
};
  // clang-format on
  return table;
}

TEST(ReservationCancel, EveryCaseDoesWhatTheTableSays) {
  // wait_for_writers(0) logs every open write it finds; here that is expected.
  const spdlog::level::level_enum saved = log::level();
  log::set_level(spdlog::level::off);
  const std::vector<std::pair<const char*, Arrange>> setups = {
      {"writer-writing", writer},
      {"writer-writing-followed", writer_with_follower},
      {"writer-landing", writer_landing},
      {"writer-ready", writer_ready},
      {"writer-cancel-pending", writer_cancel_pending},
      {"writer-cancel-pending-landing", writer_cancel_pending_landing},
      {"writer-expire-pending", writer_expire_pending},
      {"follower-writing", follower_writing},
      {"follower-ready", follower_ready},
      {"resident-ready", resident_ready},
      {"tomb-pre-reserved", tomb_pre_reserved},
      {"tomb-expired", tomb_expired},
      {"tomb-failed", tomb_failed},
  };
  for (const LandingMode mode : {LandingMode::receiver_chosen, LandingMode::one_sided}) {
    const char* mode_name = mode == LandingMode::one_sided ? "one-sided" : "receiver-chosen";
    for (const auto& [setup_name, setup] : setups) {
      // The payload lands only through resolve_landing in receiver-chosen mode.
      const std::string_view name(setup_name);
      if (mode == LandingMode::one_sided &&
          (name == "writer-landing" || name == "writer-cancel-pending-landing" || name == "tomb-failed")) {
        continue;
      }
      for (const Variant& v : kVariants) {
        const std::string key = fmt::format("{} {} {}", mode_name, setup_name, v.name);
        const std::string actual = run(mode, setup, v.abandon, v.refresh, v.rid);
        auto it = expected().find(key);
        EXPECT_TRUE(it != expected().end() && it->second == actual)
            << "    {\"" << key << "\",\n     \"" << actual << "\"},";
      }
    }
  }
  log::set_level(saved);
}

}  // namespace
}  // namespace ecx::consumer
