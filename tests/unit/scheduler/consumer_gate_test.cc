// The consumer half on its own: a ConsumerGate (and the ConsumerChannel it owns)
// wired to the fakes and a manual clock, without a PushPlanner.
#include "connector/scheduler/consumer_gate.h"

#include <gtest/gtest.h>

#include "connector/scheduler/consumer_channel.h"
#include "connector/scheduler/request_failures.h"
#include "fake_collaborators.h"

namespace ecx::scheduler {
namespace {

using namespace std::chrono_literals;
using testing::request;
using S = TransferState;

struct Gate {
  explicit Gate(CoordinatorOptions o = testing::consumer_options(), int shards = 1)
      : options(std::move(o)),
        clock(std::make_shared<ManualClock>()),
        events(std::make_shared<testing::FakeEventSource>(shards)),
        control(std::make_shared<testing::FakeConsumerControl>(std::vector<std::string>{"tcp://127.0.0.1:14579"})),
        failures(options.max_notified_remembered),
        gate(options, clock, events, control, failures) {}
  ConnectorMeta step(const StepView& view = {}) {
    ConnectorMeta meta;
    gate.build_step(view, meta);
    return meta;
  }
  S state(const std::string& transfer_id) const {
    const auto* r = gate.table().find(transfer_id);
    return r ? r->state() : S::failed;
  }

  CoordinatorOptions options;
  std::shared_ptr<ManualClock> clock;
  std::shared_ptr<testing::FakeEventSource> events;
  std::shared_ptr<testing::FakeConsumerControl> control;
  RequestFailures failures;
  ConsumerGate gate;
};

TEST(ConsumerGate, ARequestWaitsForItsPushThenForItsLoad) {
  Gate g;
  auto r = request("r1", {"h0"}, {"t0"});
  EXPECT_FALSE(g.gate.admit(r, 0));
  EXPECT_EQ(g.state("t0"), S::waiting_event);
  g.events->ready("t0", "h0");
  g.step();                          // a step boundary: the next hook drains again
  EXPECT_FALSE(g.gate.admit(r, 0));  // the gate starts the load
  EXPECT_TRUE(g.gate.loads_in_flight());
  auto meta = g.step();
  ASSERT_EQ(meta.loads.size(), 1u);
  EXPECT_EQ(meta.loads[0].transfer_id, "t0");
  g.gate.take_output(WorkerOutput{{"h0"}, {}, {}, false, {}});
  EXPECT_FALSE(g.gate.loads_in_flight());
  EXPECT_TRUE(g.gate.admit(r, 0));
  EXPECT_EQ(g.gate.bookkeeping().requests_counting_on_copies, 1u);
  g.gate.after_alloc(r, 0);
  EXPECT_EQ(g.gate.bookkeeping().requests_counting_on_copies, 0u);
  EXPECT_EQ(g.gate.bookkeeping().engine_cache_entries, 1u);
  EXPECT_EQ(g.gate.channel().stats().ready_accepted, 1u);
}

TEST(ConsumerGate, ItemsAlreadyComputedOrWithoutParamsPassTheGate) {
  Gate g;
  EXPECT_TRUE(g.gate.admit(request("r1", {"h0"}, {"t0"}), 10));  // item 0 covers tokens 0..9
  RequestView plain;
  plain.request_id = "r2";
  plain.mm_features.push_back(testing::feature("h1"));
  EXPECT_TRUE(g.gate.admit(plain, 0));
  EXPECT_EQ(g.gate.table().find("t0"), nullptr);
}

TEST(ConsumerGate, APushThatNeverArrivesFailsTheRequest) {
  Gate g;
  auto r = request("r1", {"h0"}, {"t0"});
  EXPECT_FALSE(g.gate.admit(r, 0));
  g.clock->advance(61s);
  EXPECT_FALSE(g.gate.admit(r, 0));
  EXPECT_EQ(g.failures.take(g.gate.take_unavailable_requests()), std::vector<std::string>{"r1"});
}

TEST(ConsumerGate, AWaitingRequestIsReCheckedFromMemoryUntilSomethingItWaitsOnChanges) {
  Gate g;
  auto r = request("r1", {"h0"}, {"t0"});
  auto other = request("r2", {"h1"}, {"t1"});
  EXPECT_FALSE(g.gate.admit(r, 0));  // creates the wait, which the next check would find: remembered
  EXPECT_EQ(g.gate.bookkeeping().remembered_waits, 1u);
  EXPECT_FALSE(g.gate.admit(r, 0));
  EXPECT_EQ(g.gate.stats().rechecks_remembered, 1u);

  // Another item's push landing changes nothing r1 waits on.
  EXPECT_FALSE(g.gate.admit(other, 0));
  g.events->ready("t1", "h1");
  g.step();
  EXPECT_FALSE(g.gate.admit(r, 0));
  EXPECT_EQ(g.gate.stats().rechecks_remembered, 2u);

  // Its own push lands: decided afresh, and its load starts.
  g.events->ready("t0", "h0");
  g.step();
  EXPECT_FALSE(g.gate.admit(r, 0));
  EXPECT_EQ(g.gate.stats().rechecks_remembered, 2u);
  EXPECT_EQ(g.state("t0"), S::loading);
  EXPECT_FALSE(g.gate.admit(r, 0));  // waits for the load: remembered again
  EXPECT_EQ(g.gate.stats().rechecks_remembered, 3u);
  g.step();
  g.gate.take_output(WorkerOutput{{"h0"}, {}, {}, false, {}});
  EXPECT_TRUE(g.gate.admit(r, 0));
  EXPECT_EQ(g.gate.stats().rechecks_remembered, 3u);
  EXPECT_EQ(g.gate.bookkeeping().remembered_waits, 1u);  // r2's (not checked since its push landed)
  g.gate.finish(other);
  EXPECT_EQ(g.gate.bookkeeping().remembered_waits, 0u);
}

TEST(ConsumerGate, ARememberedWaitStillEndsAtItsDeadline) {
  Gate g;
  auto r = request("r1", {"h0"}, {"t0"});
  EXPECT_FALSE(g.gate.admit(r, 0));
  EXPECT_FALSE(g.gate.admit(r, 0));
  EXPECT_EQ(g.gate.stats().rechecks_remembered, 1u);
  g.clock->advance(60s);  // the push wait (push_wait_timeout) ends now
  EXPECT_FALSE(g.gate.admit(r, 0));
  EXPECT_EQ(g.gate.stats().rechecks_remembered, 1u);
  EXPECT_TRUE(is_terminal(g.state("t0")));
  EXPECT_EQ(g.failures.take(g.gate.take_unavailable_requests()), std::vector<std::string>{"r1"});
}

TEST(ConsumerGate, AnEngineCacheEntryOfAnItemEndsItsRememberedWait) {
  Gate g;
  auto r = request("r1", {"h0"}, {"t0"});
  auto holder = request("r2", {"h0"}, {"t9"});
  EXPECT_FALSE(g.gate.admit(r, 0));
  EXPECT_FALSE(g.gate.admit(r, 0));
  EXPECT_EQ(g.gate.stats().rechecks_remembered, 1u);
  g.gate.after_alloc(holder, 0);  // the engine now holds h0 (encoded it, say)
  EXPECT_TRUE(g.gate.admit(r, 0));
  EXPECT_EQ(g.gate.stats().rechecks_remembered, 1u);
}

TEST(ConsumerGate, ALoadWhoseEntryTheEngineDroppedBeforeItLandedIsFreedWhenItLands) {
  Gate g;
  auto r = request("r1", {"h0"}, {"t0"});
  g.events->ready("t0", "h0");
  EXPECT_FALSE(g.gate.admit(r, 0));  // starts the load
  ASSERT_EQ(g.step().loads.size(), 1u);
  // The engine allocates the entry while the load is in flight (a preempted request
  // re-checked, say), then evicts it.
  g.gate.after_alloc(r, 0);
  g.step();
  StepView evicted;
  evicted.free_encoder_mm_hashes = {"h0"};
  g.step(evicted);
  g.gate.take_output(WorkerOutput{{"h0"}, {}, {}, false, {}});
  // Nobody holds the copy the load brought in: the workers drop it.
  const auto meta = g.step();
  EXPECT_EQ(meta.freed, std::vector<std::string>{"h0"});
  EXPECT_NE(g.state("t0"), S::ready);
  g.gate.finish(r);
  EXPECT_EQ(g.gate.bookkeeping().unowned_loads, 0u);
}

TEST(ConsumerGate, WithoutTheUnavailableChannelAnUnreachableItemIsEncodedLocally) {
  auto options = testing::consumer_options();
  options.unavailable_reaches_engine = false;
  Gate g(options);
  auto r = request("r1", {"h0"}, {"t0"});
  g.events->abandoned("t0", "h0");
  EXPECT_TRUE(g.gate.admit(r, 0));  // its push cannot arrive: the engine encodes it
  EXPECT_TRUE(g.gate.admit(r, 0));
  EXPECT_EQ(g.gate.stats().local_fallbacks, 1u);  // counted once
  auto no_media = request("r2", {"h1"}, {"t1"});
  no_media.mm_features[0].has_media = false;
  no_media.ec_transfer_params_error = "bad";
  EXPECT_FALSE(g.gate.release_malformed(no_media));
  EXPECT_EQ(g.gate.stats().stranded_items, 1u);
}

TEST(ConsumerGate, ClaimsLoadAtAllocationWhenTheEngineAllocatesALandedItem) {
  auto options = testing::consumer_options();
  options.asynchronous_loads = false;
  Gate g(options);
  auto r = request("r1", {"h0"}, {"t0"});
  g.events->ready("t0", "h0");
  EXPECT_TRUE(g.gate.has_cache_item("h0"));
  EXPECT_TRUE(g.gate.admit(r, 0));  // landed: loaded in the step that allocates it
  g.gate.after_alloc(r, 0);
  EXPECT_EQ(g.gate.stats().alloc_loads, 1u);
  EXPECT_EQ(g.step().loads.size(), 1u);
}

TEST(ConsumerGate, AnAllocatedClaimWithNothingToLoadFailsTheRequest) {
  Gate g;
  auto r = request("r1", {"h0"}, {"t0"});
  g.events->ready("t0", "h0");
  EXPECT_TRUE(g.gate.has_cache_item("h0"));
  g.clock->advance(301s);
  EXPECT_FALSE(g.gate.has_cache_item("h1"));  // drains: t0's reservation expired meanwhile
  g.gate.after_alloc(r, 0);
  EXPECT_EQ(g.gate.stats().alloc_load_misses, 1u);
  EXPECT_EQ(g.failures.take({}), std::vector<std::string>{"r1"});
}

TEST(ConsumerGate, FinishingARequestCancelsItsTransferRemotely) {
  Gate g;
  auto r = request("r1", {"h0"}, {"t0"});
  EXPECT_FALSE(g.gate.admit(r, 0));
  g.gate.finish(r);
  EXPECT_EQ(g.state("t0"), S::cancelled);
  EXPECT_TRUE(g.control->wait_cancels(1));
  for (int i = 0; i < 100000 && g.gate.channel().pending_cancels() > 0; ++i) {
    g.step();
    std::this_thread::yield();
  }
  EXPECT_EQ(g.gate.channel().stats().cancels_succeeded, 1u);
  EXPECT_EQ(g.control->locked([&] { return g.control->cancel_calls; }),
            (std::vector<std::pair<std::string, std::string>>{{"tcp://127.0.0.1:14579", "t0"}}));
}

TEST(ConsumerGate, APureProducersGateMirrorsTheEngineCacheAndClaimsNothing) {
  Gate g(testing::producer_options());
  auto r = request("r1", {"h0"}, {"t0"});
  g.events->ready("t0", "h0");
  EXPECT_FALSE(g.gate.has_cache_item("h0"));
  g.gate.after_alloc(r, 0);
  EXPECT_EQ(g.gate.bookkeeping().engine_cache_entries, 1u);
  g.step();
  auto meta = g.step(StepView{{"h0"}, {}});
  EXPECT_EQ(meta.freed, std::vector<std::string>{"h0"});  // the workers drop what the engine freed
  EXPECT_EQ(g.gate.bookkeeping().engine_cache_entries, 0u);
  EXPECT_EQ(g.events->drain_calls, 0);
}

TEST(ConsumerGate, CloseClosesTheCollaboratorsOnce) {
  Gate g;
  g.gate.close();
  g.gate.close();
  EXPECT_TRUE(g.gate.closed());
  EXPECT_TRUE(g.events->closed);
  EXPECT_TRUE(g.control->closed);
}

TEST(ConsumerChannel, AMultiShardTransferIsReadyOnceEveryShardReported) {
  auto options = testing::consumer_options();
  TransferTable table(options.table);
  auto events = std::make_shared<testing::FakeEventSource>(2);
  ConsumerChannel channel(options, table, events, nullptr);
  const TimePoint now{};
  ASSERT_TRUE(table.wait_for_event("t0", "r1", "h0", now, now + 60s, false));
  events->ready("t0", "h0", 4, 14579);
  channel.drain(now);
  EXPECT_EQ(table.find("t0")->state(), S::waiting_event);
  EXPECT_EQ(channel.stats().awaiting_shards, 1u);
  events->ready("t0", "h0", 4, 14580);
  channel.drain(now);  // within drain_min_interval, not re-armed: skipped
  EXPECT_EQ(table.find("t0")->state(), S::waiting_event);
  channel.rearm_drain();
  channel.drain(now);
  EXPECT_EQ(table.find("t0")->state(), S::available);
  EXPECT_EQ(channel.stats().ready_accepted, 1u);
  EXPECT_EQ(channel.stats().drains, 2u);
}

TEST(ConsumerChannel, WithoutAControlClientCancelsStayLocal) {
  auto options = testing::consumer_options();
  TransferTable table(options.table);
  ConsumerChannel channel(options, table, nullptr, nullptr);
  const TimePoint now{};
  ASSERT_TRUE(table.wait_for_event("t0", "r1", "h0", now, now + 60s, false));
  channel.queue_cancel("t0", now);
  EXPECT_EQ(table.find("t0")->state(), S::cancelled);
  EXPECT_EQ(channel.stats().cancels_local_only, 1u);
  EXPECT_EQ(channel.pending_cancels(), 0u);
}

}  // namespace
}  // namespace ecx::scheduler
