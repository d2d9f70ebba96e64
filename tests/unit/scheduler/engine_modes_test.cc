// The coordinator under engines that call fewer hooks: synchronous loads (no
// worker reports on steps without tokens), no take_unavailable_requests, and a
// shutdown that must not wait out control deadlines.
#include <chrono>

#include <gtest/gtest.h>

#include "ecx/connector/scheduler/coordinator.h"
#include "fakes.h"

namespace ecx::scheduler {
namespace {

using namespace std::chrono_literals;
using testing::Harness;
using testing::request;
using testing::state_of;
using S = TransferState;

CoordinatorOptions sync_options() {
  CoordinatorOptions o = testing::consumer_options();
  o.asynchronous_loads = false;
  return o;
}

// ------------------------------------------------------------------ synchronous loads

TEST(SynchronousLoads, ALandedItemPassesTheGateAndLoadsInTheStepThatAllocatesIt) {
  Harness h(sync_options());
  auto r = request("r1", {"h"}, {"t"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));  // not landed yet
  EXPECT_TRUE(h.step().loads.empty());
  h.events->ready("t", "h");
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));  // landed: no load started at the gate
  EXPECT_EQ(state_of(h.coordinator, "t"), S::available);
  EXPECT_FALSE(h.coordinator.has_pending_push_work());
  EXPECT_TRUE(h.coordinator.has_cache_item("h"));
  h.coordinator.update_state_after_alloc(r, 0);
  EXPECT_EQ(state_of(h.coordinator, "t"), S::loading);
  auto meta = h.step();
  ASSERT_EQ(meta.loads.size(), 1u);
  EXPECT_EQ(meta.loads[0].transfer_id, "t");
  // The request runs in this very step: nothing for an idle engine to step for.
  EXPECT_FALSE(h.coordinator.has_pending_push_work());
  h.coordinator.update_connector_output(WorkerOutput{{"h"}, {}, {}, false, {}});
  EXPECT_EQ(state_of(h.coordinator, "t"), S::ready);
  EXPECT_EQ(h.coordinator.stats().alloc_loads, 1u);
}

TEST(SynchronousLoads, AnItemEncodedLocallyIsNotLoaded) {
  Harness h(sync_options());
  auto r = request("r1", {"h"}, {"t"});
  EXPECT_FALSE(h.coordinator.has_cache_item("h"));  // the engine encodes it itself
  h.events->ready("t", "h");                        // landing afterwards changes nothing
  h.coordinator.update_state_after_alloc(r, 0);
  EXPECT_TRUE(h.step().loads.empty());
  EXPECT_EQ(h.coordinator.stats().alloc_loads, 0u);
}

TEST(SynchronousLoads, ASecondRequestForAHashLoadingThisStepNeedsNoLoadOfItsOwn) {
  Harness h(sync_options());
  auto a = request("a", {"h"}, {"ta"});
  auto b = request("b", {"h"}, {"tb"});
  h.events->ready("ta", "h");
  EXPECT_TRUE(h.coordinator.ensure_cache_available(a, 0));
  EXPECT_TRUE(h.coordinator.has_cache_item("h"));
  h.coordinator.update_state_after_alloc(a, 0);
  EXPECT_TRUE(h.coordinator.ensure_cache_available(b, 0));  // loading in a planned step counts
  EXPECT_EQ(h.step().loads.size(), 1u);
}

TEST(AsynchronousLoads, AnEntryEvictedAfterTheGateSawItInTheEngineCacheIsLoadedAtAllocation) {
  Harness h;
  auto first = request("first", {"h"}, {});  // the engine encoded "h" itself
  h.coordinator.update_state_after_alloc(first, 0);
  h.step();
  auto r = request("r1", {"h"}, {"t"});
  h.events->ready("t", "h");
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));  // a local hit, a snapshot
  h.step(StepView{{"h"}, {}});                              // the engine evicts it
  EXPECT_TRUE(h.coordinator.has_cache_item("h"));           // so it asks: an external load now
  h.coordinator.update_state_after_alloc(r, 0);
  auto meta = h.step();
  ASSERT_EQ(meta.loads.size(), 1u);  // without it the engine would miss the entry
  EXPECT_EQ(meta.loads[0].transfer_id, "t");
}

TEST(AsynchronousLoads, PendingWorkLastsOnlyUntilTheGateLoadIsReported) {
  Harness h;  // asynchronous (the default)
  auto r = request("r1", {"h"}, {"t"});
  h.events->ready("t", "h");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));  // load started, request deferred
  EXPECT_TRUE(h.coordinator.has_pending_push_work());
  EXPECT_EQ(h.step().loads.size(), 1u);
  EXPECT_TRUE(h.coordinator.has_pending_push_work());
  h.coordinator.update_connector_output(WorkerOutput{{"h"}, {}, {}, false, {}});
  EXPECT_FALSE(h.coordinator.has_pending_push_work());
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
}

TEST(AsynchronousLoads, AnEngineThatStopsReportingLeavesNoPendingWorkInSynchronousMode) {
  Harness h;
  auto r = request("r1", {"h"}, {"t"});
  h.events->ready("t", "h");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_TRUE(h.coordinator.has_pending_push_work());
  h.coordinator.set_asynchronous_loads(false);
  EXPECT_FALSE(h.coordinator.has_pending_push_work());
}

// ------------------------------------------------------------------ no take_unavailable_requests

CoordinatorOptions unpolled_options() {
  CoordinatorOptions o = sync_options();
  o.unavailable_reaches_engine = false;
  o.push_wait_timeout = 10s;
  return o;
}

TEST(NoUnavailableChannel, AnItemWhosePushNeverArrivesIsReleasedToLocalEncoding) {
  Harness h(unpolled_options());
  auto r = request("r1", {"h"}, {"t"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.step();
  h.advance(9s);
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.step();
  h.advance(2s);
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));  // the engine encodes it now
  EXPECT_FALSE(h.coordinator.has_cache_item("h"));
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.coordinator.stats().local_fallbacks, 1u);  // counted once per item
  EXPECT_EQ(h.coordinator.stats().stranded_items, 0u);
}

TEST(NoUnavailableChannel, AnAbandonedTransferIsReleasedAtOnce) {
  Harness h(unpolled_options());
  auto r = request("r1", {"h0", "h1"}, {"t0", "t1"});
  h.events->ready("t1", "h1");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.step();
  h.events->abandoned("t0", "h0");
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_FALSE(h.coordinator.has_cache_item("h0"));  // encoded locally
  EXPECT_TRUE(h.coordinator.has_cache_item("h1"));   // loaded
  EXPECT_EQ(h.coordinator.stats().local_fallbacks, 1u);
}

TEST(NoUnavailableChannel, WithoutMediaTheItemIsReportedAndStillFailsThroughTheChannelIfItAppears) {
  Harness h(unpolled_options());
  auto r = request("r1", {"h"}, {"t"});
  r.mm_features[0].has_media = false;
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.step();
  h.advance(11s);
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.coordinator.stats().stranded_items, 1u);
  EXPECT_EQ(h.coordinator.stats().local_fallbacks, 0u);
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
}

TEST(NoUnavailableChannel, WithTheChannelTheRequestFailsInstead) {
  CoordinatorOptions o = unpolled_options();
  o.unavailable_reaches_engine = true;
  Harness h(o);
  auto r = request("r1", {"h"}, {"t"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.step();
  h.advance(11s);
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
  EXPECT_EQ(h.coordinator.stats().local_fallbacks, 0u);
}

TEST(NoUnavailableChannel, MalformedParamsAreEncodedLocallyInsteadOfHeldForGood) {
  Harness h(unpolled_options());
  RequestView r = request("bad", {"h0", "h1"}, {});
  r.set_ec_transfer_params_text(R"({"ec_items": "not-a-list"})");
  ASSERT_TRUE(r.has_malformed_params());
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.coordinator.stats().local_fallbacks, 2u);  // both items, counted once
  r.mm_features[1].has_media = false;
  RequestView stranded = r;
  stranded.request_id = "bad-no-media";
  EXPECT_FALSE(h.coordinator.ensure_cache_available(stranded, 0));
  EXPECT_EQ(h.coordinator.stats().stranded_items, 2u);
}

// ------------------------------------------------------------------ shutdown

TEST(BoundedShutdown, CloseAbandonsAnUnansweredCancelAtOnce) {
  Harness h;
  h.control->locked([&] { return h.control->gated = true; });  // the shard never answers
  h.coordinator.request_finished(request("r1", {"h0"}, {"t0"}));
  ASSERT_TRUE(h.control->wait_started_cancels(1));
  const auto start = std::chrono::steady_clock::now();
  h.coordinator.close();
  const auto took = std::chrono::steady_clock::now() - start;
  // The fake would hold the call for 10 s; closing the client ends it at once.
  EXPECT_LT(took, 2s);
  EXPECT_EQ(h.coordinator.stats().cancels_abandoned, 1u);
  EXPECT_EQ(h.coordinator.pending_remote_cancels(), 0u);
  EXPECT_TRUE(h.control->locked([&] { return h.control->closed; }));
}

}  // namespace
}  // namespace ecx::scheduler
