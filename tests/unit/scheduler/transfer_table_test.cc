#include "ecx/connector/scheduler/transfer_table.h"

#include <gtest/gtest.h>

#include <set>

#include "fakes.h"

namespace ecx::scheduler {
namespace {

using std::chrono::seconds;
using testing::spec_of;
using S = TransferState;

class TransferTableTest : public ::testing::Test {
 protected:
  TransferTableTest() : table(TableLimits{seconds(300), 8, 1000}) {}
  void TearDown() override { EXPECT_TRUE(table.check_invariants()) << table.check_invariants().message(); }

  LoadSpec load(const std::string& id, const std::string& hash, std::int64_t rows = 4) {
    return LoadSpec{hash, id, spec_of(rows), false};
  }
  S state(const std::string& id) {
    const auto* r = table.find(id);
    EXPECT_NE(r, nullptr) << id;
    return r ? r->state() : S::failed;
  }
  // A record in AVAILABLE for `hash`.
  void make_available(const std::string& id, const std::string& hash, std::int64_t rows = 4) {
    ASSERT_TRUE(table.observe_ready(load(id, hash, rows), now));
  }
  void make_ready(const std::string& id, const std::string& hash, std::int64_t rows = 4) {
    make_available(id, hash, rows);
    ASSERT_NE(table.begin_load(hash, id, "req", now, now + seconds(60)), nullptr);
    ASSERT_TRUE(table.complete_load(hash));
  }
  void make_resident(const std::string& id, const std::string& hash, std::int64_t rows = 4) {
    make_ready(id, hash, rows);
    table.release_ready(hash, now);
    ASSERT_EQ(state(id), S::resident);
  }

  TimePoint now = TimePoint{} + std::chrono::hours(1);
  TransferTable table;
  std::vector<std::string> cancels;
};

TEST(TransferStateTable, ExactlyTheDocumentedTransitionsAreAllowed) {
  const std::set<std::pair<S, S>> allowed = {{S::waiting_event, S::available}, {S::waiting_event, S::unavailable},
                                             {S::waiting_event, S::cancelled}, {S::available, S::loading},
                                             {S::available, S::expired},       {S::available, S::cancelled},
                                             {S::loading, S::ready},           {S::loading, S::failed},
                                             {S::loading, S::cancelled},       {S::loading, S::unavailable},
                                             {S::ready, S::resident},          {S::ready, S::expired},
                                             {S::resident, S::loading},        {S::resident, S::expired},
                                             {S::unavailable, S::cancelled},   {S::expired, S::cancelled}};
  for (std::size_t a = 0; a < kTransferStateCount; ++a) {
    for (std::size_t b = 0; b < kTransferStateCount; ++b) {
      const auto from = static_cast<S>(a), to = static_cast<S>(b);
      EXPECT_EQ(transition_allowed(from, to), allowed.contains({from, to}))
          << transfer_state_name(from) << " -> " << transfer_state_name(to);
    }
  }
  EXPECT_TRUE(is_terminal(S::cancelled));
  EXPECT_FALSE(is_terminal(S::resident));
}

TEST_F(TransferTableTest, WaitForEventCreatesAWaitingRecordWithItsDeadline) {
  const auto* r = table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->state(), S::waiting_event);
  EXPECT_EQ(*r->deadline(), now + seconds(60));
  EXPECT_EQ(r->waiters(), std::vector<std::string>{"r1"});
  EXPECT_TRUE(table.has_state("h1", {S::waiting_event}));
  // A second request for the same id joins the waiters; the deadline stays.
  table.wait_for_event("t1", "r2", "h1", now + seconds(5), now + seconds(65));
  EXPECT_EQ(table.find("t1")->waiters().size(), 2u);
  EXPECT_EQ(*table.find("t1")->deadline(), now + seconds(60));
}

TEST_F(TransferTableTest, WaitingBecomesAvailableOnReadinessWithTheTtlDeadline) {
  table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  EXPECT_TRUE(table.observe_ready(load("t1", "h1"), now + seconds(1)));
  const auto* r = table.find("t1");
  EXPECT_EQ(r->state(), S::available);
  EXPECT_EQ(*r->deadline(), now + seconds(301));
  ASSERT_TRUE(r->spec());
  EXPECT_EQ(r->spec()->spec, spec_of(4));
  EXPECT_TRUE(r->waiters().empty());
}

TEST_F(TransferTableTest, ReadinessForAnUnknownIdCreatesAnAvailableRecord) {
  EXPECT_TRUE(table.observe_ready(load("t1", "h1"), now));
  EXPECT_EQ(state("t1"), S::available);
  EXPECT_TRUE(table.has_state("h1", {S::available}));
}

TEST_F(TransferTableTest, RefusesReadinessForRecordsNotWaitingOrWithAnotherHash) {
  make_available("t1", "h1");
  EXPECT_FALSE(table.observe_ready(load("t1", "h1"), now));  // duplicate
  table.wait_for_event("t2", "r", "h2", now, now + seconds(60));
  EXPECT_FALSE(table.observe_ready(load("t2", "other"), now));  // hash mismatch
  EXPECT_EQ(state("t2"), S::waiting_event);
  ASSERT_TRUE(table.cancel("t3", now));
  EXPECT_FALSE(table.observe_ready(load("t3", "h3"), now));  // cancelled is terminal
  EXPECT_EQ(state("t3"), S::cancelled);
  EXPECT_EQ(table.stats().ready_ignored, 3u);
}

TEST_F(TransferTableTest, WaitingBecomesUnavailableAtItsDeadlineAndNotifiesEveryWaiter) {
  table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  table.wait_for_event("t1", "r2", "h1", now, now + seconds(60));
  table.expire(now + seconds(59), cancels);
  EXPECT_EQ(state("t1"), S::waiting_event);
  table.expire(now + seconds(60), cancels);
  EXPECT_EQ(state("t1"), S::unavailable);
  EXPECT_EQ(cancels, std::vector<std::string>{"t1"});
  EXPECT_EQ(table.take_unavailable_requests(), (std::vector<std::string>{"r1", "r2"}));
  EXPECT_TRUE(table.take_unavailable_requests().empty());
}

TEST_F(TransferTableTest, MarkUnavailableNotifiesWaitersOnce) {
  table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  EXPECT_TRUE(table.mark_unavailable("t1", now));
  EXPECT_FALSE(table.mark_unavailable("t1", now));  // terminal: left alone
  // A request arriving later for the terminal record is told at once, once.
  table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  table.wait_for_event("t1", "r3", "h1", now, now + seconds(60));
  table.wait_for_event("t1", "r3", "h1", now, now + seconds(60));
  EXPECT_EQ(table.take_unavailable_requests(), (std::vector<std::string>{"r1", "r3"}));
}

TEST_F(TransferTableTest, AbandonedFailsWaitersAtOnceAndTombstonesUnknownIds) {
  table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  EXPECT_TRUE(table.observe_abandoned("t1", "h1", now));
  EXPECT_EQ(state("t1"), S::unavailable);
  EXPECT_EQ(table.take_unavailable_requests(), std::vector<std::string>{"r1"});
  EXPECT_TRUE(table.observe_abandoned("t2", "h2", now));
  EXPECT_EQ(state("t2"), S::unavailable);
  table.wait_for_event("t2", "r2", "h2", now, now + seconds(60));
  EXPECT_EQ(table.take_unavailable_requests(), std::vector<std::string>{"r2"});
  make_available("t3", "h3");
  EXPECT_FALSE(table.observe_abandoned("t3", "h3", now));  // the data landed
  EXPECT_EQ(state("t3"), S::available);
}

TEST_F(TransferTableTest, WaitingCanBeCancelledAndUnknownIdsBecomeTombstones) {
  table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  EXPECT_TRUE(table.cancel("t1", now, "h1", "r1"));
  EXPECT_EQ(state("t1"), S::cancelled);
  EXPECT_TRUE(table.cancel("t9", now));
  EXPECT_EQ(state("t9"), S::cancelled);
  EXPECT_FALSE(table.cancel("t9", now));  // already cancelled
}

TEST_F(TransferTableTest, CancelIsRefusedWhileAnotherRequestWaits) {
  table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  table.wait_for_event("t1", "r2", "h1", now, now + seconds(60));
  EXPECT_FALSE(table.cancel("t1", now, "h1", "r1"));
  EXPECT_EQ(table.find("t1")->waiters(), std::vector<std::string>{"r2"});
  EXPECT_TRUE(table.cancel("t1", now, "h1", "r2"));
}

TEST_F(TransferTableTest, CancelIsRefusedForAnotherHash) {
  table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  EXPECT_FALSE(table.cancel("t1", now, "other", "r1"));
  EXPECT_EQ(state("t1"), S::waiting_event);
}

TEST_F(TransferTableTest, AvailableLoadsThePreferredRecordElseTheEarliestOfTheHash) {
  make_available("a", "h");
  make_available("b", "h");
  const auto* r = table.begin_load("h", std::string_view("b"), "r1", now, now + seconds(60));
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->transfer_id(), "b");
  EXPECT_EQ(r->state(), S::loading);
  EXPECT_EQ(r->load_owner(), "r1");
  EXPECT_EQ(*r->deadline(), now + seconds(60));
  r = table.begin_load("h", std::string_view("unknown"), "r2", now, now + seconds(60));
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->transfer_id(), "a");
  EXPECT_EQ(table.begin_load("h", std::nullopt, "r3", now, now + seconds(60)), nullptr);
  const auto loads = table.take_loads_to_dispatch();
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_EQ(loads[0].transfer_id, "b");
  EXPECT_FALSE(loads[0].local);
  EXPECT_TRUE(table.take_loads_to_dispatch().empty());
}

TEST_F(TransferTableTest, AvailableExpiresAfterTheTtlUnlessTouched) {
  make_available("t1", "h1");
  make_available("t2", "h2");
  table.touch_available("t2", now + seconds(200));
  table.expire(now + seconds(300), cancels);
  EXPECT_EQ(state("t1"), S::expired);
  EXPECT_EQ(state("t2"), S::available);
  EXPECT_EQ(cancels, std::vector<std::string>{"t1"});
  EXPECT_TRUE(table.cancel("t1", now + seconds(300)));  // expired → cancelled releases it remotely
  EXPECT_EQ(state("t1"), S::cancelled);
  table.expire(now + seconds(500), cancels);
  EXPECT_EQ(state("t2"), S::expired);
}

TEST_F(TransferTableTest, AvailableCanBeCancelled) {
  make_available("t1", "h1");
  EXPECT_TRUE(table.cancel("t1", now, "h1", "r1"));
  EXPECT_EQ(state("t1"), S::cancelled);
  EXPECT_FALSE(table.has_state("h1", {S::available}));
}

TEST_F(TransferTableTest, LoadingCompletesToReadyIdempotently) {
  make_available("t1", "h1");
  table.begin_load("h1", std::nullopt, "r1", now, now + seconds(60));
  EXPECT_TRUE(table.complete_load("h1"));
  EXPECT_EQ(state("t1"), S::ready);
  EXPECT_FALSE(table.find("t1")->deadline());
  EXPECT_TRUE(table.complete_load("h1"));  // repeated report
  EXPECT_FALSE(table.complete_load("nothing"));
}

TEST_F(TransferTableTest, LoadingFailsOnAFailedLoad) {
  make_available("t1", "h1");
  table.begin_load("h1", std::nullopt, "r1", now, now + seconds(60));
  EXPECT_TRUE(table.fail_load("h1", now));
  EXPECT_EQ(state("t1"), S::failed);
  EXPECT_FALSE(table.fail_load("h1", now));
  EXPECT_FALSE(table.cancel("t1", now));  // failed refuses cancel
}

TEST_F(TransferTableTest, LoadingBecomesUnavailableAtItsDeadlineAndTellsItsOwner) {
  make_available("t1", "h1");
  table.begin_load("h1", std::nullopt, "r1", now, now + seconds(60));
  table.expire(now + seconds(60), cancels);
  EXPECT_EQ(state("t1"), S::unavailable);
  EXPECT_EQ(cancels, std::vector<std::string>{"t1"});
  EXPECT_EQ(table.take_unavailable_requests(), std::vector<std::string>{"r1"});
  EXPECT_FALSE(table.has_state("h1", {S::loading}));
}

TEST_F(TransferTableTest, LoadingRefusesCancel) {
  make_available("t1", "h1");
  table.begin_load("h1", std::nullopt, "r1", now, now + seconds(60));
  EXPECT_FALSE(table.cancel("t1", now, "h1", "r1"));
  EXPECT_EQ(state("t1"), S::loading);
  EXPECT_EQ(table.take_loads_to_dispatch().size(), 1u);
}

TEST_F(TransferTableTest, ReleaseMakesTheNewestReadyResidentAndOrphansTheRest) {
  make_ready("old", "h");
  make_ready("new", "h");
  table.release_ready("h", now);
  EXPECT_EQ(state("new"), S::resident);
  EXPECT_TRUE(table.find("new")->spec()->local);
  EXPECT_EQ(state("old"), S::expired);
  EXPECT_EQ(table.drain_orphaned(), std::vector<std::string>{"old"});
  EXPECT_EQ(table.resident_bytes(), spec_of(4).nbytes());
  EXPECT_FALSE(table.cancel("new", now));  // resident refuses cancel
  make_ready("newer", "h");
  EXPECT_FALSE(table.cancel("newer", now));  // ready refuses cancel
  table.release_ready("h", now);
  EXPECT_EQ(state("newer"), S::resident);
  EXPECT_EQ(state("new"), S::expired);  // the older resident of the hash
  EXPECT_EQ(table.drain_orphaned(), std::vector<std::string>{"new"});
}

TEST_F(TransferTableTest, ResidentReloadsLocally) {
  make_resident("t1", "h1");
  const auto* r = table.begin_load("h1", std::nullopt, "r2", now, now + seconds(60));
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->state(), S::loading);
  EXPECT_EQ(table.resident_bytes(), 0u);
  const auto loads = table.take_loads_to_dispatch();
  ASSERT_EQ(loads.size(), 1u);
  EXPECT_TRUE(loads[0].local);
}

TEST_F(TransferTableTest, ResidentsAreEvictedOldestFirstToTheCapacity) {
  // capacity 1000 bytes; each spec is 4 x 16 x 2 = 128 bytes... use bigger ones.
  make_resident("a", "ha", 12);  // 384 B
  make_resident("b", "hb", 12);
  make_resident("c", "hc", 12);  // 1152 B > 1000 → a evicted
  EXPECT_EQ(state("a"), S::expired);
  EXPECT_EQ(state("b"), S::resident);
  EXPECT_EQ(state("c"), S::resident);
  EXPECT_LE(table.resident_bytes(), 1000u);
  EXPECT_EQ(table.stats().resident_evictions, 1u);
  auto orphans = table.drain_orphaned();
  EXPECT_EQ(orphans, std::vector<std::string>{"a"});
}

TEST_F(TransferTableTest, ReclaimClearsReadySpecsAndExpiresResidents) {
  make_resident("res", "h");
  make_ready("rdy", "h");
  table.reclaim("h", now);
  EXPECT_EQ(state("res"), S::expired);
  EXPECT_EQ(state("rdy"), S::ready);
  EXPECT_FALSE(table.find("rdy")->spec());
  table.release_ready("h", now);  // a canonical record without spec expires
  EXPECT_EQ(state("rdy"), S::expired);
  EXPECT_EQ(table.drain_orphaned(), (std::vector<std::string>{"res", "rdy"}));
  EXPECT_EQ(table.resident_bytes(), 0u);
}

TEST_F(TransferTableTest, UnavailableAndExpiredCanBeCancelledOnce) {
  table.wait_for_event("u", "r", "h", now, now + seconds(1));
  table.mark_unavailable("u", now);
  EXPECT_TRUE(table.cancel("u", now));
  EXPECT_EQ(state("u"), S::cancelled);
  EXPECT_FALSE(table.cancel("u", now));
}

TEST_F(TransferTableTest, CollisionFailsOnlyTheNewcomer) {
  table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  EXPECT_EQ(table.wait_for_event("t1", "r2", "h2", now, now + seconds(60)), nullptr);
  EXPECT_EQ(state("t1"), S::waiting_event);
  EXPECT_EQ(table.find("t1")->mm_hash(), "h1");
  EXPECT_EQ(table.take_unavailable_requests(), std::vector<std::string>{"r2"});
  EXPECT_EQ(table.stats().collisions_refused, 1u);
}

TEST_F(TransferTableTest, InvalidTransitionIsCountedAndFailsOnlyThatTransfer) {
  make_available("t1", "h1");
  make_available("t2", "h1");
  EXPECT_FALSE(table.mark_unavailable("t1", now));  // AVAILABLE → UNAVAILABLE is not in the table
  EXPECT_EQ(table.stats().invalid_transitions, 1u);
  EXPECT_EQ(state("t1"), S::failed);
  EXPECT_EQ(state("t2"), S::available);
}

TEST_F(TransferTableTest, TombstonesAreDroppedAfterTheirTtlAndBeyondTheirBound) {
  for (int i = 0; i < 12; ++i) ASSERT_TRUE(table.cancel("c" + std::to_string(i), now + seconds(i)));
  EXPECT_EQ(table.tombstone_count(), 8u);  // bound 8: the oldest went first
  EXPECT_EQ(table.find("c3"), nullptr);
  EXPECT_NE(table.find("c4"), nullptr);
  EXPECT_EQ(table.stats().tombstones_evicted, 4u);
  table.expire(now + seconds(305), cancels);  // c4, c5 reach their TTL
  EXPECT_EQ(table.find("c5"), nullptr);
  EXPECT_NE(table.find("c6"), nullptr);
  EXPECT_EQ(table.tombstone_count(), 6u);
  EXPECT_TRUE(cancels.empty());
}

// Records live in a pool and an erased one is reused by the next new transfer:
// nothing of the old transfer may show through.
TEST_F(TransferTableTest, ARecordReusedAfterItsTombstoneWasDroppedStartsClean) {
  table.wait_for_event("old", "r-old", "h-old", now, now + seconds(60), /*invented_name=*/true);
  ASSERT_TRUE(table.mark_unavailable("old", now));
  EXPECT_EQ(table.take_unavailable_requests(), std::vector<std::string>{"r-old"});
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(table.cancel("c" + std::to_string(i), now));  // bound 8 drops "old"
  ASSERT_EQ(table.find("old"), nullptr);

  make_available("new", "h-new");
  const TransferRecord* r = table.find("new");
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->state(), S::available);
  EXPECT_EQ(r->mm_hash(), "h-new");
  EXPECT_EQ(r->request_id(), "");
  EXPECT_TRUE(r->waiters().empty());
  EXPECT_TRUE(r->notified().empty());
  EXPECT_EQ(r->load_owner(), "");
  EXPECT_FALSE(r->invented_name());
  EXPECT_FALSE(table.has_state("h-old", {S::waiting_event}));
  // The old id is unknown again: a request for it waits afresh.
  const TransferRecord* again = table.wait_for_event("old", "r2", "h-old", now, now + seconds(60));
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->state(), S::waiting_event);
  EXPECT_EQ(again->waiters(), std::vector<std::string>{"r2"});
  EXPECT_TRUE(again->notified().empty());
  EXPECT_TRUE(table.take_unavailable_requests().empty());
}

TEST_F(TransferTableTest, LoadsDispatchInTheOrderBegunEvenWhenAQueuedRecordWasReused) {
  make_available("t1", "h1");
  make_available("t3", "h3");
  ASSERT_NE(table.begin_load("h1", "t1", "r1", now, now + seconds(60)), nullptr);
  ASSERT_TRUE(table.mark_unavailable("t1", now));                                       // still in the queue
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(table.cancel("c" + std::to_string(i), now));  // drops t1
  ASSERT_EQ(table.find("t1"), nullptr);
  make_available("t2", "h2");  // reuses t1's record
  ASSERT_NE(table.begin_load("h3", "t3", "r3", now, now + seconds(60)), nullptr);
  ASSERT_NE(table.begin_load("h2", "t2", "r2", now, now + seconds(60)), nullptr);
  const auto loads = table.take_loads_to_dispatch();
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_EQ(loads[0].transfer_id, "t3");  // not at the place t1 held in the queue
  EXPECT_EQ(loads[1].transfer_id, "t2");
  EXPECT_TRUE(table.take_loads_to_dispatch().empty());
}

TEST_F(TransferTableTest, SteadyChurnKeepsEveryIndexExact) {
  // Many more transfers than the table keeps: records, hash entries and index
  // slots are reused over and over.
  for (int i = 0; i < 3000; ++i) {
    const std::string id = "t" + std::to_string(i);
    make_available(id, "h" + std::to_string(i % 7));
    if (i % 3 == 0) {
      ASSERT_NE(table.begin_load("h" + std::to_string(i % 7), id, "r", now, now + seconds(60)), nullptr);
      ASSERT_TRUE(table.complete_load("h" + std::to_string(i % 7)));
      table.release_ready("h" + std::to_string(i % 7), now);
    } else {
      ASSERT_TRUE(table.cancel(id, now));
    }
    if (i % 500 == 0) {
      ASSERT_TRUE(table.check_invariants()) << table.check_invariants().message();
    }
  }
  EXPECT_LE(table.tombstone_count(), 8u);
  EXPECT_EQ(table.find("t0"), nullptr);
  EXPECT_NE(table.find("t2999"), nullptr);
}

TEST_F(TransferTableTest, WithdrawnRequestsAreNotNotified) {
  table.wait_for_event("t1", "r1", "h1", now, now + seconds(60));
  table.withdraw("t1", "r1");
  table.expire(now + seconds(60), cancels);
  EXPECT_TRUE(table.take_unavailable_requests().empty());
  table.wait_for_event("t2", "r2", "h2", now, now + seconds(60));
  table.mark_unavailable("t2", now);
  table.forget_pending_request("r2");
  EXPECT_TRUE(table.take_unavailable_requests().empty());
}

TEST_F(TransferTableTest, ExpireTouchesOnlyDueRecords) {
  // Many live records, none due: expire changes nothing and returns nothing.
  for (int i = 0; i < 1000; ++i) make_available("t" + std::to_string(i), "h" + std::to_string(i));
  table.expire(now + seconds(299), cancels);
  EXPECT_TRUE(cancels.empty());
  EXPECT_EQ(table.live_count(), 1000u);
}

}  // namespace
}  // namespace ecx::scheduler
