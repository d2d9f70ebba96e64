// One named test per lesson of the reference's §10 that concerns the scheduler.

#include <gtest/gtest.h>

#include <spdlog/sinks/ostream_sink.h>

#include <sstream>

#include "core/logging.h"
#include "ecx/connector/scheduler/coordinator.h"
#include "fakes.h"

namespace ecx::scheduler {
namespace {

using namespace std::chrono_literals;
using testing::Harness;
using testing::request;
using testing::state_of;
using S = TransferState;

// Captures every log line while alive.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    sink_->set_pattern("%v");
    log::set_sink(sink_);
  }
  ~LogCapture() { log::set_sink(nullptr); }
  std::size_t count(const std::string& needle) const {
    const std::string text = out_.str();
    std::size_t n = 0;
    for (auto p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
    return n;
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

// Makes a request's item ready (loaded into the engine cache) through events and
// worker output.
void load_item(Harness& h, const RequestView& r, const std::string& transfer_id, const std::string& hash) {
  h.events->ready_all_shards(transfer_id, hash);
  h.step();
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  auto meta = h.step();
  ASSERT_EQ(meta.loads.size(), 1u);
  h.coordinator.update_connector_output(WorkerOutput{{hash}, {}, {}, false, {}});
}

TEST(SchedulerLessons, Lesson08_UnresolvedTransferIdsAreMatchedByPositionAndWarnedAboutRateLimited) {
  LogCapture logs;
  Harness h(testing::producer_options());
  // Positional: no mm_hash in the entry, so the engine identifier cannot mismatch.
  auto ok = request("ok", {"engine-hash"}, {"t-ok"}, "tcp://c:1");
  h.coordinator.ensure_cache_available(ok, 0);
  EXPECT_EQ(h.step().pushes.at(0).transfer_id, "t-ok");
  // A caller-derived mm_hash that is not the engine identifier cannot resolve.
  for (int i = 0; i < 2010; ++i) {
    RequestView r;
    r.request_id = "r" + std::to_string(i);
    r.mm_features.push_back(testing::feature("engine-hash"));
    set_ec_transfer_params(
        r, nlohmann::json::parse(
               R"({"consumer_zmq": "tcp://c:1", "ec_items": [{"mm_hash": "media-uuid", "transfer_id": "t"}]})"));
    h.coordinator.ensure_cache_available(r, 0);
  }
  EXPECT_EQ(h.coordinator.stats().unresolved_transfer_ids, 2010u);
  // First 5, then every 1000th (1000 and 2000).
  EXPECT_EQ(logs.count("could not resolve a transfer id at push prepare"), 7u);
  EXPECT_EQ(logs.count("must echo an engine-reported identifier"), 7u);
}

TEST(SchedulerLessons, Lesson09_ATransferIdCollisionFailsOnlyTheOffendingRequest) {
  Harness h;
  auto first = request("r1", {"h1"}, {"t"});
  auto second = request("r2", {"h2"}, {"t"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(first, 0));
  EXPECT_FALSE(h.coordinator.ensure_cache_available(second, 0));  // no throw
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r2"});
  EXPECT_EQ(h.coordinator.table().find("t")->mm_hash(), "h1");
  h.events->ready("t", "h1");
  h.step();
  EXPECT_FALSE(h.coordinator.ensure_cache_available(first, 0));
  EXPECT_EQ(h.step().loads.size(), 1u);  // the original transfer proceeds
}

TEST(SchedulerLessons, Lesson10_TheSameEncodingMayShareATransferIdButOtherContentMayNot) {
  Harness p(testing::producer_options());
  auto a = request("ra", {"h"}, {"t"}, "tcp://c:1");
  auto b = request("rb", {"h"}, {"t"}, "tcp://c:1");
  auto conflict = request("rc", {"other"}, {"t"}, "tcp://c:1");
  p.coordinator.ensure_cache_available(a, 0);
  p.coordinator.ensure_cache_available(b, 0);
  p.coordinator.ensure_cache_available(conflict, 0);
  EXPECT_EQ(p.step().pushes.size(), 1u);  // one push serves both
  EXPECT_EQ(p.coordinator.take_unavailable_requests(), std::vector<std::string>{"rc"});
  EXPECT_EQ(p.coordinator.stats().push_conflicts, 1u);
  auto fa = p.coordinator.request_finished(a);
  auto fb = p.coordinator.request_finished(b);
  EXPECT_EQ(nlohmann::json::parse(*fa.params).at("ec_items").size(), 1u);  // the shared binding is reported to both
  EXPECT_EQ(nlohmann::json::parse(*fb.params).at("ec_items").size(), 1u);

  // Consumer: one sharer finishing does not cancel the transfer the other waits for.
  Harness c;
  auto ca = request("ca", {"h"}, {"t"});
  auto cb = request("cb", {"h"}, {"t"});
  c.coordinator.ensure_cache_available(ca, 0);
  c.coordinator.ensure_cache_available(cb, 0);
  c.coordinator.request_finished(ca);
  EXPECT_EQ(state_of(c.coordinator, "t"), S::waiting_event);
  EXPECT_EQ(c.coordinator.stats().cancels_queued, 0u);
}

TEST(SchedulerLessons, Lesson11_ItemsAreSharedByContentIdentifierNotByRequest) {
  Harness h;
  auto a = request("ra", {"content-h"}, {"ta"});
  load_item(h, a, "ta", "content-h");
  // Another request for the same content, under its own transfer id, is ready now.
  auto b = request("rb", {"content-h"}, {"tb"});
  EXPECT_TRUE(h.coordinator.ensure_cache_available(b, 0));
  EXPECT_TRUE(h.coordinator.has_cache_item("content-h"));
}

TEST(SchedulerLessons, Lesson12_APushThatNeverArrivesFailsItsRequestAfterThePushWait) {
  Harness h;
  auto r = request("r1", {"h"}, {"t"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.advance(59s);
  h.step();
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
  h.advance(1s);
  h.step();
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
  EXPECT_EQ(state_of(h.coordinator, "t"), S::cancelled);  // and its reservation is released remotely
  h.settle_cancels(1);
}

TEST(SchedulerLessons, Lesson13_ALoadNeverReportedBackHasItsOwnDeadline) {
  Harness h;
  auto r = request("r1", {"h"}, {"t"});
  h.events->ready("t", "h");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.step().loads.size(), 1u);
  auto later = request("r2", {"h"}, {"t2"});
  h.advance(59s);
  h.step();
  EXPECT_FALSE(h.coordinator.ensure_cache_available(later, 0));  // deferred while loading
  h.advance(1s);
  h.step();
  h.coordinator.has_cache_item("h");  // a drain runs expire
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
  EXPECT_NE(state_of(h.coordinator, "t"), S::loading);
  EXPECT_FALSE(h.coordinator.table().has_state("h", {S::loading}));
  h.settle_cancels(1);
}

TEST(SchedulerLessons, Lesson14_AnUnsubscribedOrUnreachableConsumerDoesNotFreezeTheScheduler) {
  Harness h(testing::consumer_options(), 0);  // the event source has not subscribed yet
  h.control->locked([&] { return h.control->gated = true; });
  auto r = request("r1", {"h"}, {"t"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.coordinator.request_finished(r);  // its cancel blocks on the executor, not here
  EXPECT_TRUE(h.control->wait_discovers(1));
  for (int i = 0; i < 10; ++i) {
    EXPECT_FALSE(h.coordinator.has_cache_item("h"));
    h.step();
  }
  h.control->open_gate();
  h.settle_cancels(1);
}

TEST(SchedulerLessons, Lesson15_AnAbandonedReservationFailsItsWaitersAtOnce) {
  Harness h;
  auto r = request("r1", {"h"}, {"t"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.step();
  h.events->abandoned("t", "h");
  h.coordinator.has_cache_item("h");
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
  // Abandoned before any request: the request fails on arrival.
  h.events->abandoned("t2", "h2");
  h.step();
  h.coordinator.has_cache_item("h2");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(request("r2", {"h2"}, {"t2"}), 0));
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r2"});
}

TEST(SchedulerLessons, Lesson16_ReadinessArrivingBetweenStepsIsDispatchedInTheNextStep) {
  Harness h;
  auto r = request("r1", {"h"}, {"t"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_TRUE(h.step().loads.empty());
  h.events->ready("t", "h");                                 // arrives after the step that created the wait
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));  // no clock advance needed
  EXPECT_TRUE(h.coordinator.has_pending_push_work());        // keeps the engine stepping
  EXPECT_EQ(h.step().loads.size(), 1u);
}

TEST(SchedulerLessons, Lesson17_AReadyItemIsLoadedWithoutWaitingForASlowerSibling) {
  Harness h;
  auto r = request("r1", {"fast", "slow"}, {"tf", "ts"});
  h.events->ready("tf", "fast");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  auto meta = h.step();
  ASSERT_EQ(meta.loads.size(), 1u);
  EXPECT_EQ(meta.loads[0].mm_hash, "fast");
  h.coordinator.update_connector_output(WorkerOutput{{"fast"}, {}, {}, false, {}});
  h.events->ready("ts", "slow");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(state_of(h.coordinator, "tf"), S::ready);  // kept while the request is still gated
  h.step();
  h.coordinator.update_connector_output(WorkerOutput{{"slow"}, {}, {}, false, {}});
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
}

TEST(SchedulerLessons, Lesson18_PendingSavesKeepTheEngineStepping) {
  Harness h(testing::producer_options());
  EXPECT_FALSE(h.coordinator.has_pending_push_work());
  h.coordinator.update_connector_output(WorkerOutput{{}, {}, {}, true, {}});
  EXPECT_TRUE(h.coordinator.has_pending_push_work());
  h.coordinator.update_connector_output(WorkerOutput{{}, {}, {}, false, {}});
  EXPECT_FALSE(h.coordinator.has_pending_push_work());
}

// Lesson 19 guards against a record expired straight out of READY or RESIDENT leaving
// its buffer pinned. Here a record reaches READY only through a load every rank
// reported, and each rank's take ended its consumer record then: the slot went to the
// load's lease, and from the lease to the consumer's resident cache, which evicts it
// by itself. So the orphan ends here; a cancel would find no record on any shard and
// leave a tombstone there for every item.
TEST(SchedulerLessons, Lesson19_RecordsExpiredOutOfReadyOrResidentEndWithoutPinningOrTombstones) {
  auto options = testing::consumer_options();
  options.table.resident_capacity_bytes = 200;  // one 128-byte item fits, two do not
  Harness h(options);
  auto a = request("ra", {"ha"}, {"ta"});
  auto b = request("rb", {"hb"}, {"tb"});
  load_item(h, a, "ta", "ha");
  load_item(h, b, "tb", "hb");
  h.coordinator.update_state_after_alloc(a, 0);  // the engine frees only what it allocated
  h.coordinator.update_state_after_alloc(b, 0);
  h.step();
  h.step(StepView{{"ha"}, {}});
  auto meta = h.step(StepView{{"hb"}, {}});  // hb resident evicts ha
  EXPECT_EQ(meta.orphan_cancels, std::vector<std::string>{"ta"});
  EXPECT_EQ(state_of(h.coordinator, "ta"), S::cancelled);
  EXPECT_EQ(h.coordinator.pending_remote_cancels(), 0u);
  EXPECT_TRUE(h.control->locked([&] { return h.control->cancel_calls.empty(); }));
  EXPECT_EQ(h.coordinator.stats().cancels_local_only, 1u);
  EXPECT_EQ(h.coordinator.stats().cancels_queued, 0u);
}

// The same orphan before its load completed still holds a consumer record: that one
// is cancelled on the shards.
TEST(SchedulerLessons, Lesson19_ARecordExpiredBeforeItsLoadCompletedIsCancelledOnTheShards) {
  Harness h;
  auto r = request("r1", {"h"}, {"t"});
  h.events->ready("t", "h");
  h.step();
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  ASSERT_EQ(h.step().loads.size(), 1u);
  // One rank missed the load: it fails, and that rank's record was never taken.
  h.coordinator.update_connector_output(WorkerOutput{{}, {"h"}, {}, false, {}});
  ASSERT_EQ(state_of(h.coordinator, "t"), S::failed);
  h.coordinator.request_finished(r);
  h.step();
  h.settle_cancels(1);
  auto calls = h.control->locked([&] { return h.control->cancel_calls; });
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].second, "t");
}

TEST(SchedulerLessons, Lesson36_AShardedConsumerIsLoadableOnlyWhenEveryShardReportedOnce) {
  Harness h(testing::consumer_options(), 2);
  h.events->ready("t", "h", 4, 14579);
  h.events->ready("t", "h", 4, 14579);  // the same shard twice is not two shards
  EXPECT_FALSE(h.coordinator.has_cache_item("h"));
  h.step();
  h.events->ready("t", "h", 4, -1);  // untagged cannot count as the missing shard
  EXPECT_FALSE(h.coordinator.has_cache_item("h"));
  h.step();
  h.events->ready("t", "h", 4, 14580);
  EXPECT_TRUE(h.coordinator.has_cache_item("h"));
  EXPECT_EQ(state_of(h.coordinator, "t"), S::available);
}

TEST(SchedulerLessons, Lesson37_ALoadOneRankMissedFailsInsteadOfCompleting) {
  Harness h;
  auto r = request("r1", {"h"}, {"t"});
  h.events->ready("t", "h");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.step();
  // The aggregate left h out of `loaded` (one rank missed it) and reports it failed.
  h.coordinator.update_connector_output(WorkerOutput{{}, {"h"}, {}, false, {}});
  EXPECT_EQ(state_of(h.coordinator, "t"), S::failed);
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
}

TEST(SchedulerLessons, Lesson38_AReclaimOnAnyRankInvalidatesResidency) {
  Harness h;
  auto a = request("ra", {"h"}, {"ta"});
  load_item(h, a, "ta", "h");
  h.coordinator.update_state_after_alloc(a, 0);
  h.step();
  h.step(StepView{{"h"}, {}});
  ASSERT_EQ(state_of(h.coordinator, "ta"), S::resident);
  h.coordinator.update_connector_output(WorkerOutput{{}, {}, {"h"}, false, {}});
  EXPECT_FALSE(h.coordinator.has_cache_item("h"));
  auto meta = h.step();
  EXPECT_EQ(meta.orphan_cancels, std::vector<std::string>{"ta"});
  EXPECT_EQ(state_of(h.coordinator, "ta"), S::cancelled);
  // Its load took the slot on every rank (Lesson 19): nothing is left to cancel there.
  EXPECT_EQ(h.coordinator.stats().cancels_local_only, 1u);
  EXPECT_TRUE(h.control->locked([&] { return h.control->cancel_calls.empty(); }));
}

TEST(SchedulerLessons, Lesson39_NoCancelIsSentWithoutAConfirmedTopology) {
  Harness h(testing::consumer_options(), 1, {"tcp://h:1", "tcp://h:2"});
  h.control->locked([&] { return h.control->discover_failures = 2; });
  h.coordinator.request_finished(request("r1", {"h"}, {"t"}));
  ASSERT_TRUE(h.control->wait_discovers(2));
  for (int i = 0; i < 100000 && h.coordinator.pending_remote_cancels() > 0; ++i) {
    h.step();
    std::this_thread::yield();
  }
  EXPECT_EQ(h.control->locked([&] { return h.control->discover_calls; }), 2u);
  EXPECT_TRUE(h.control->locked([&] { return h.control->cancel_calls.empty(); }));  // not even the base address
  EXPECT_EQ(h.coordinator.stats().cancels_failed, 1u);
}

TEST(SchedulerLessons, Lesson44_EventsAreDrainedOncePerStepNotPerHookCall) {
  Harness h;
  for (int i = 0; i < 100; ++i) h.coordinator.has_cache_item("h" + std::to_string(i));
  EXPECT_EQ(h.events->drain_calls, 1);
  h.step();
  h.coordinator.has_cache_item("x");
  h.coordinator.ensure_cache_available(request("r", {"y"}, {"ty"}), 0);
  EXPECT_EQ(h.events->drain_calls, 2);
  h.advance(5ms);  // a long step drains again after the minimum interval
  h.coordinator.has_cache_item("x");
  EXPECT_EQ(h.events->drain_calls, 3);
}

TEST(SchedulerLessons, Lesson46_AnEvictedItemStaysResidentAndReloadsLocally) {
  Harness h;
  auto a = request("ra", {"h"}, {"ta"});
  load_item(h, a, "ta", "h");
  h.coordinator.update_state_after_alloc(a, 0);
  h.step();
  h.step(StepView{{"h"}, {}});  // a later step: the encoder cache evicted it
  // A later request for the same image whose own transfer is gone still loads it.
  auto b = request("rb", {"h"}, {"tb-gone"});
  EXPECT_TRUE(h.coordinator.has_cache_item("h"));
  EXPECT_FALSE(h.coordinator.ensure_cache_available(b, 0));
  auto meta = h.step();
  ASSERT_EQ(meta.loads.size(), 1u);
  EXPECT_TRUE(meta.loads[0].local);
  EXPECT_EQ(meta.loads[0].transfer_id, "ta");
}

TEST(SchedulerLessons, Lesson47_ALocalCacheHitDoesNotCancelTheTransfer) {
  Harness h;
  auto other = request("ro", {"h"}, {"to"});
  h.coordinator.update_state_after_alloc(other, 0);  // h is in the engine's cache
  h.step();
  h.events->ready("t", "h");
  auto r = request("r1", {"h"}, {"t"});
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(state_of(h.coordinator, "t"), S::available);  // kept, not cancelled
  h.step(StepView{{"h"}, {}});                            // the local entry is evicted
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.step().loads.size(), 1u);  // the kept transfer serves it
}

TEST(SchedulerLessons, Lesson52_CancelledIsTerminalAndLateEventsAreIdempotent) {
  Harness h;
  auto r = request("r1", {"h"}, {"t"});
  h.coordinator.request_finished(r);  // cancelled before its readiness was drained
  h.events->ready("t", "h");
  h.events->ready("t", "h");
  EXPECT_FALSE(h.coordinator.has_cache_item("h"));
  EXPECT_EQ(state_of(h.coordinator, "t"), S::cancelled);
  EXPECT_EQ(h.coordinator.stats().ready_ignored, 2u);
  // A repeated request id for the cancelled transfer is failed once.
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
  h.settle_cancels(1);
}

}  // namespace
}  // namespace ecx::scheduler
