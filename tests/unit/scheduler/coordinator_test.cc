#include "ecx/connector/scheduler/coordinator.h"

#include <set>

#include <gtest/gtest.h>

#include "fakes.h"

namespace ecx::scheduler {
namespace {

using namespace std::chrono_literals;
using testing::Harness;
using testing::request;
using testing::state_of;
using S = TransferState;

// ------------------------------------------------------------------ producer

TEST(CoordinatorProducer, PlansOnePushPerTransferIdAndEmitsItOnce) {
  Harness h(testing::producer_options());
  auto r = request("r1", {"h0", "h1"}, {"t0", "t1"}, "tcp://consumer:14579");
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
  h.coordinator.update_state_after_alloc(r, 0);
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
  auto meta = h.step();
  ASSERT_EQ(meta.pushes.size(), 2u);
  EXPECT_EQ(meta.pushes[0].transfer_id, "t0");
  EXPECT_EQ(meta.pushes[0].mm_hash, "h0");
  EXPECT_EQ(meta.pushes[0].consumer_zmq, "tcp://consumer:14579");
  EXPECT_EQ(meta.pushes[0].request_id, "r1");
  EXPECT_EQ(meta.pushes[0].spec, testing::spec_of(4, 16, DType::bfloat16));
  EXPECT_TRUE(h.step().pushes.empty());              // a later step emits nothing for the same request
  EXPECT_FALSE(h.coordinator.has_cache_item("h0"));  // producers never claim items
}

TEST(CoordinatorProducer, SkipsComputedItemsAndRequestsWithoutConsumer) {
  Harness h(testing::producer_options());
  auto r = request("r1", {"h0", "h1"}, {"t0", "t1"}, "tcp://consumer:14579");
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 10));  // item 0 covers tokens 0..9
  auto meta = h.step();
  ASSERT_EQ(meta.pushes.size(), 1u);
  EXPECT_EQ(meta.pushes[0].transfer_id, "t1");
  auto no_consumer = request("r2", {"h5"}, {"t5"});
  EXPECT_TRUE(h.coordinator.ensure_cache_available(no_consumer, 0));
  EXPECT_TRUE(h.step().pushes.empty());
}

TEST(CoordinatorProducer, UsesTheCallersOutputSpecWhenGiven) {
  Harness h(testing::producer_options());
  auto r = request("r1", {"h0"}, {"t0"}, "tcp://c:1");
  r.mm_features[0].output_spec = testing::spec_of(7, 3, DType::float32);
  h.coordinator.ensure_cache_available(r, 0);
  auto meta = h.step();
  ASSERT_EQ(meta.pushes.size(), 1u);
  EXPECT_EQ(meta.pushes[0].spec, testing::spec_of(7, 3, DType::float32));
}

TEST(CoordinatorProducer, UnknownEncoderWidthFailsTheRequestInsteadOfPushingGarbage) {
  auto options = testing::producer_options();
  options.encoder_output_width = 0;
  Harness h(options);
  auto r = request("r1", {"h0"}, {"t0"}, "tcp://c:1");
  h.coordinator.ensure_cache_available(r, 0);
  EXPECT_TRUE(h.step().pushes.empty());
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
}

TEST(CoordinatorProducer, RequestFinishedReportsItemsWithTransferIds) {
  Harness h(testing::producer_options());
  auto r = request("r1", {"h0", "h1"}, {"t0"}, "tcp://c:1");
  h.coordinator.ensure_cache_available(r, 0);
  auto finished = h.coordinator.request_finished(r);
  EXPECT_FALSE(finished.delay_free);
  ASSERT_TRUE(finished.params);
  const auto p = nlohmann::json::parse(*finished.params);
  EXPECT_EQ(p["h0"]["transfer_id"], "t0");
  EXPECT_EQ(p["h0"]["item_indices"], nlohmann::json::array({0}));
  EXPECT_FALSE(p["h1"].contains("transfer_id"));  // unresolved: pushed under an invented name
  ASSERT_TRUE(p.contains("ec_items"));
  EXPECT_EQ(p["ec_items"].size(), 2u);
  EXPECT_EQ(p["ec_items"][0]["transfer_id"], "t0");
  EXPECT_EQ(p["ec_items"][1]["transfer_id"], "r1:1");
  // The prepared ids are forgotten: a new request naming t0 plans it again.
  auto again = request("r2", {"h0"}, {"t0"}, "tcp://c:1");
  h.step();
  h.coordinator.ensure_cache_available(again, 0);
  EXPECT_EQ(h.step().pushes.size(), 1u);
  EXPECT_FALSE(h.coordinator.request_finished(request("r3", {}, {})).params);
}

TEST(CoordinatorProducer, StoreCandidatesExcludePreemptedRequests) {
  auto options = testing::producer_options();
  options.cross_encoder_cache = true;
  Harness h(options);
  auto a = request("ra", {"ha"}, {"ta"});
  auto b = request("rb", {"hb"}, {"tb"});
  auto audio = request("rc", {"hc"}, {"tc"});
  audio.mm_features[0].modality = "audio";
  h.coordinator.update_state_after_alloc(a, 0);
  h.coordinator.update_state_after_alloc(b, 0);
  h.coordinator.update_state_after_alloc(audio, 0);
  auto meta = h.step(StepView{{}, {"rb"}});
  ASSERT_EQ(meta.store_candidates.size(), 1u);
  EXPECT_EQ(meta.store_candidates[0].mm_hash, "ha");
  EXPECT_TRUE(h.step().store_candidates.empty());
}

// A test double of the store's presence index: what the shared store holds.
class FakeStorePresence final : public StorePresence {
 public:
  bool present(std::string_view mm_hash) override { return held.contains(std::string(mm_hash)); }
  void forget(std::string_view mm_hash) override {
    held.erase(std::string(mm_hash));
    forgotten.emplace_back(mm_hash);
  }
  std::set<std::string> held;
  std::vector<std::string> forgotten;
};

struct StoreHarness {
  explicit StoreHarness(bool asynchronous) : h(options(asynchronous)) {
    store->held = {"in-store", "corrupt"};
    h.coordinator.set_store_presence(store);
  }
  static CoordinatorOptions options(bool asynchronous) {
    auto o = testing::producer_options();
    o.cross_encoder_cache = true;
    o.asynchronous_loads = asynchronous;
    return o;
  }
  void report(const WorkerOutput& out) { h.coordinator.update_connector_output(out); }
  Harness h;
  std::shared_ptr<FakeStorePresence> store = std::make_shared<FakeStorePresence>();
};

TEST(CoordinatorStore, AnItemIsClaimedOnlyOnceTheWorkersPrefetchedItAndIsThenLoadedNotEncoded) {
  StoreHarness s(/*asynchronous=*/true);
  auto r = request("r1", {"in-store", "fresh"}, {"t1", "t2"}, "tcp://c:1");
  EXPECT_FALSE(s.h.coordinator.ensure_cache_available(r, 0)) << "deferred while the prefetch runs";
  EXPECT_FALSE(s.h.coordinator.has_cache_item("in-store")) << "not claimed before it is verified";
  auto meta = s.h.step();
  ASSERT_EQ(meta.store_prefetches.size(), 1u);
  EXPECT_EQ(meta.store_prefetches[0].mm_hash, "in-store");
  EXPECT_EQ(meta.pushes.size(), 2u) << "pushes are planned at once: a loaded item is pushed like an encoded one";
  EXPECT_TRUE(s.h.coordinator.has_pending_push_work()) << "the engine keeps stepping for the answer";
  EXPECT_FALSE(s.h.coordinator.ensure_cache_available(r, 0));
  EXPECT_TRUE(s.h.step().store_prefetches.empty()) << "asked once";
  s.report(WorkerOutput{.store_ready = {"in-store"}});
  ASSERT_TRUE(s.h.coordinator.ensure_cache_available(r, 0));
  EXPECT_TRUE(s.h.coordinator.has_cache_item("in-store"));
  EXPECT_FALSE(s.h.coordinator.has_cache_item("fresh"));
  s.h.coordinator.update_state_after_alloc(r, 0);
  s.h.coordinator.update_state_after_alloc(r, 1);
  meta = s.h.step();
  ASSERT_EQ(meta.store_loads.size(), 1u);
  EXPECT_EQ(meta.store_loads[0].mm_hash, "in-store");
  ASSERT_EQ(meta.store_candidates.size(), 1u) << "only the encoded item is offered to the store";
  EXPECT_EQ(meta.store_candidates[0].mm_hash, "fresh");
  const auto stats = s.h.coordinator.stats();
  EXPECT_EQ(stats.store_prefetches, 1u);
  EXPECT_EQ(stats.store_hits, 1u);
  EXPECT_EQ(stats.store_loads, 1u);
  // The prefetched copy went into that load: the next request prefetches again.
  auto again = request("r2", {"in-store"}, {"t3"}, "tcp://c:1");
  EXPECT_FALSE(s.h.coordinator.ensure_cache_available(again, 0));
}

TEST(CoordinatorStore, AnEntryTheWorkersCannotGiveIsEncodedAndForgotten) {
  StoreHarness s(/*asynchronous=*/true);
  auto r = request("r1", {"corrupt"}, {"t1"}, "tcp://c:1");
  EXPECT_FALSE(s.h.coordinator.ensure_cache_available(r, 0));
  (void)s.h.step();
  s.report(WorkerOutput{.store_failed = {"corrupt"}});
  EXPECT_TRUE(s.h.coordinator.ensure_cache_available(r, 0)) << "encoded instead";
  EXPECT_FALSE(s.h.coordinator.has_cache_item("corrupt"));
  EXPECT_EQ(s.store->forgotten, std::vector<std::string>{"corrupt"});
  s.h.coordinator.update_state_after_alloc(r, 0);
  auto meta = s.h.step();
  EXPECT_TRUE(meta.store_loads.empty());
  ASSERT_EQ(meta.store_candidates.size(), 1u) << "encoded, so written again (good) to the store";
  EXPECT_EQ(s.h.coordinator.stats().store_prefetch_failures, 1u);
}

TEST(CoordinatorStore, APrefetchTheWorkersDoNotAnswerInTimeIsEncoded) {
  StoreHarness s(/*asynchronous=*/true);
  auto r = request("r1", {"in-store"}, {"t1"}, "tcp://c:1");
  EXPECT_FALSE(s.h.coordinator.ensure_cache_available(r, 0));
  s.h.advance(StoreHarness::options(true).store_prefetch_timeout + std::chrono::milliseconds(1));
  EXPECT_TRUE(s.h.coordinator.ensure_cache_available(r, 0));
  EXPECT_FALSE(s.h.coordinator.has_cache_item("in-store"));
  EXPECT_FALSE(s.h.coordinator.has_pending_push_work());
  s.report(WorkerOutput{.store_ready = {"in-store"}});  // late: ignored
  EXPECT_FALSE(s.h.coordinator.has_cache_item("in-store"));
  EXPECT_EQ(s.h.coordinator.stats().store_prefetch_timeouts, 1u);
}

TEST(CoordinatorStore, WithSynchronousLoadsThePresenceIndexIsTrustedAndAFailedLoadForgotten) {
  StoreHarness s(/*asynchronous=*/false);
  auto r = request("r1", {"in-store"}, {"t1"}, "tcp://c:1");
  EXPECT_TRUE(s.h.coordinator.ensure_cache_available(r, 0));
  EXPECT_TRUE(s.h.coordinator.has_cache_item("in-store"));
  s.h.coordinator.update_state_after_alloc(r, 0);
  auto meta = s.h.step();
  EXPECT_TRUE(meta.store_prefetches.empty());
  ASSERT_EQ(meta.store_loads.size(), 1u);
  s.report(WorkerOutput{.failed_loads = {"in-store"}});
  EXPECT_EQ(s.store->forgotten, std::vector<std::string>{"in-store"});
  EXPECT_FALSE(s.h.coordinator.has_cache_item("in-store"));
  EXPECT_EQ(s.h.coordinator.stats().store_load_failures, 1u);
}

TEST(CoordinatorStore, WithoutTheCrossEncoderCacheTheStoreIsNeverAsked) {
  Harness h(testing::producer_options());
  auto store = std::make_shared<FakeStorePresence>();
  store->held = {"h"};
  h.coordinator.set_store_presence(store);
  auto r = request("r1", {"h"}, {"t1"}, "tcp://c:1");
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_FALSE(h.coordinator.has_cache_item("h"));
  EXPECT_EQ(h.coordinator.stats().store_lookups, 0u);
}

// ------------------------------------------------------------------ consumer and the store

// A consumer request whose items the proxy sent to come from the store
// (ec_items [{mm_hash, "store": true}]) after finding them there.
RequestView store_request(const std::string& id, const std::vector<std::string>& hashes) {
  RequestView r;
  r.request_id = id;
  nlohmann::json items = nlohmann::json::array();
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    r.mm_features.push_back(testing::feature(hashes[i], static_cast<std::int64_t>(i) * 10));
    items.push_back({{"mm_hash", hashes[i]}, {"store", true}});
  }
  set_ec_transfer_params(r, nlohmann::json{{"ec_items", items}});
  return r;
}

struct ConsumerStoreHarness {
  explicit ConsumerStoreHarness(bool cross_encoder_cache = true, bool asynchronous = true)
      : h(options(cross_encoder_cache, asynchronous)) {
    h.coordinator.set_store_presence(store);
  }
  static CoordinatorOptions options(bool cross_encoder_cache, bool asynchronous) {
    auto o = testing::consumer_options();
    o.cross_encoder_cache = cross_encoder_cache;
    o.asynchronous_loads = asynchronous;
    o.encoder_output_width = 16;
    o.encoder_dtype = DType::bfloat16;
    return o;
  }
  void report(const WorkerOutput& out) { h.coordinator.update_connector_output(out); }
  Harness h;
  // Empty: the proxy's word is enough to try a prefetch, which verifies the entry.
  std::shared_ptr<FakeStorePresence> store = std::make_shared<FakeStorePresence>();
};

TEST(CoordinatorConsumerStore, AStoreItemIsPrefetchedClaimedAndLoadedWithoutAwaitingAnyPush) {
  ConsumerStoreHarness s;
  auto r = store_request("r1", {"hs"});
  EXPECT_FALSE(s.h.coordinator.ensure_cache_available(r, 0)) << "deferred while the prefetch runs";
  EXPECT_FALSE(s.h.coordinator.has_cache_item("hs"));
  auto meta = s.h.step();
  ASSERT_EQ(meta.store_prefetches.size(), 1u);
  EXPECT_EQ(meta.store_prefetches[0].mm_hash, "hs");
  EXPECT_EQ(meta.store_prefetches[0].spec, testing::spec_of(4, 16, DType::bfloat16));
  EXPECT_EQ(s.h.coordinator.table().size(), 0u) << "no transfer is awaited for a store item";
  s.report(WorkerOutput{.store_ready = {"hs"}});
  ASSERT_TRUE(s.h.coordinator.ensure_cache_available(r, 0));
  EXPECT_TRUE(s.h.coordinator.has_cache_item("hs"));
  s.h.coordinator.update_state_after_alloc(r, 0);
  meta = s.h.step();
  ASSERT_EQ(meta.store_loads.size(), 1u);
  EXPECT_TRUE(meta.loads.empty());
  s.report(WorkerOutput{.loaded = {"hs"}});
  (void)s.h.coordinator.request_finished(r);
  EXPECT_EQ(s.h.coordinator.pending_remote_cancels(), 0u) << "nothing was reserved, nothing to cancel";
  EXPECT_TRUE(s.h.coordinator.take_unavailable_requests().empty());
  EXPECT_EQ(s.h.coordinator.stats().store_loads, 1u);
  EXPECT_EQ(s.h.coordinator.stats().unresolved_transfer_ids, 0u);
}

TEST(CoordinatorConsumerStore, AStoreItemTheStoreCannotGiveIsEncodedLocallyFromItsMedia) {
  ConsumerStoreHarness s;
  auto r = store_request("r1", {"gone"});
  EXPECT_FALSE(s.h.coordinator.ensure_cache_available(r, 0));
  (void)s.h.step();
  s.report(WorkerOutput{.store_failed = {"gone"}});
  EXPECT_TRUE(s.h.coordinator.ensure_cache_available(r, 0)) << "encoded by the engine instead";
  EXPECT_FALSE(s.h.coordinator.has_cache_item("gone"));
  EXPECT_TRUE(s.h.coordinator.take_unavailable_requests().empty());
  EXPECT_EQ(s.h.coordinator.stats().store_prefetch_failures, 1u);
}

TEST(CoordinatorConsumerStore, AStoreItemWithoutMediaTheStoreCannotGiveFailsItsRequestOnce) {
  ConsumerStoreHarness s;
  auto r = store_request("r1", {"gone"});
  r.mm_features[0].has_media = false;
  EXPECT_FALSE(s.h.coordinator.ensure_cache_available(r, 0));
  (void)s.h.step();
  s.report(WorkerOutput{.store_failed = {"gone"}});
  (void)s.h.coordinator.ensure_cache_available(r, 0);
  (void)s.h.coordinator.ensure_cache_available(r, 0);
  EXPECT_EQ(s.h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
  EXPECT_EQ(s.h.coordinator.stats().stranded_items, 1u);
}

TEST(CoordinatorConsumerStore, AFailedStoreLoadFailsTheRequestsThatAllocatedIt) {
  ConsumerStoreHarness s;
  auto r = store_request("r1", {"hs"});
  (void)s.h.coordinator.ensure_cache_available(r, 0);
  (void)s.h.step();
  s.report(WorkerOutput{.store_ready = {"hs"}});
  ASSERT_TRUE(s.h.coordinator.ensure_cache_available(r, 0));
  ASSERT_TRUE(s.h.coordinator.has_cache_item("hs"));
  s.h.coordinator.update_state_after_alloc(r, 0);
  (void)s.h.step();
  s.report(WorkerOutput{.failed_loads = {"hs"}});
  EXPECT_EQ(s.h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
  EXPECT_EQ(s.h.coordinator.stats().store_load_failures, 1u);
  EXPECT_EQ(s.store->forgotten, std::vector<std::string>{"hs"});
}

TEST(CoordinatorConsumerStore, PushedItemsNeverComeFromTheStoreAndRequestsWithoutParamsAskTheIndex) {
  ConsumerStoreHarness s;
  s.store->held = {"pushed", "local"};
  auto pushed = request("r1", {"pushed"}, {"t1"});
  EXPECT_FALSE(s.h.coordinator.ensure_cache_available(pushed, 0)) << "waits for its push";
  EXPECT_TRUE(s.h.step().store_prefetches.empty());
  RequestView plain;  // sent to this instance without a proxy: it would encode the item itself
  plain.request_id = "r2";
  plain.mm_features.push_back(testing::feature("local"));
  EXPECT_FALSE(s.h.coordinator.ensure_cache_available(plain, 0));
  auto meta = s.h.step();
  ASSERT_EQ(meta.store_prefetches.size(), 1u);
  EXPECT_EQ(meta.store_prefetches[0].mm_hash, "local");
}

TEST(CoordinatorConsumerStore, WithoutTheCacheOrWithSynchronousLoadsStoreItemsAreEncodedLocally) {
  for (const bool cache : {false, true}) {
    ConsumerStoreHarness s(/*cross_encoder_cache=*/cache, /*asynchronous=*/false);
    auto r = store_request("r1", {"hs"});
    EXPECT_TRUE(s.h.coordinator.ensure_cache_available(r, 0)) << "cache " << cache;
    EXPECT_FALSE(s.h.coordinator.has_cache_item("hs")) << "cache " << cache;
    EXPECT_TRUE(s.h.step().store_prefetches.empty());
    EXPECT_EQ(s.h.coordinator.table().size(), 0u);
  }
}

TEST(CoordinatorProducer, FailedSavesFailTheirRequestsOnce) {
  Harness h(testing::producer_options());
  h.coordinator.update_connector_output(WorkerOutput{{}, {}, {}, true, {"r1", "r2"}});
  EXPECT_TRUE(h.coordinator.has_pending_push_work());
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), (std::vector<std::string>{"r1", "r2"}));
  h.coordinator.update_connector_output(WorkerOutput{{}, {}, {}, false, {"r1"}});
  EXPECT_FALSE(h.coordinator.has_pending_push_work());
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
}

// ------------------------------------------------------------------ consumer

TEST(CoordinatorConsumer, HappyPathFromReadinessToResident) {
  Harness h;
  auto r = request("r1", {"h0"}, {"t0"});
  h.events->ready("t0", "h0");
  EXPECT_TRUE(h.coordinator.has_cache_item("h0"));
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::available);
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));  // load started
  EXPECT_TRUE(h.coordinator.has_pending_push_work());
  auto meta = h.step();
  ASSERT_EQ(meta.loads.size(), 1u);
  EXPECT_EQ(meta.loads[0].transfer_id, "t0");
  EXPECT_EQ(meta.loads[0].mm_hash, "h0");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));  // still loading
  h.coordinator.update_connector_output(WorkerOutput{{"h0"}, {}, {}, false, {}});
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::ready);
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_TRUE(h.coordinator.has_cache_item("h0"));
  h.coordinator.update_state_after_alloc(r, 0);
  h.coordinator.update_state_after_free(r, 0);  // READY refuses: the worker's take consumed it
  EXPECT_EQ(h.coordinator.stats().cancels_queued, 0u);
  h.coordinator.request_finished(r);
  h.step();
  auto freed = h.step(StepView{{"h0"}, {}});  // evicted in a later step
  EXPECT_EQ(freed.freed, std::vector<std::string>{"h0"});
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::resident);
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
}

// Steps until `transfer_id` stops waiting for its readiness or the bound runs out
// (the recheck's answer is taken on the scheduler thread at a step).
// An engine step: the scheduler's hooks drain (has_cache_item here), then the step ends.
void engine_step(Harness& h) {
  (void)h.coordinator.has_cache_item("unrelated");
  h.step();
}

bool step_until_not_waiting(Harness& h, const std::string& transfer_id) {
  for (int i = 0; i < 100000; ++i) {
    if (state_of(h.coordinator, transfer_id) != S::waiting_event) return true;
    engine_step(h);
    std::this_thread::yield();
  }
  return false;
}

ConsumerControl::ShardTransfer held_ready(const std::string& mm_hash) {
  return ConsumerControl::ShardTransfer{true, "ready", mm_hash, testing::spec_of(4), ReservationId(1, 2)};
}

// A shard's readiness event can be lost on the way (a full event backlog drops the
// oldest, nothing resends it). A transfer that waited readiness_recheck is asked
// about on the shards; one held ready there counts as its event.
TEST(CoordinatorConsumer, AReadinessEventLostOnTheWayIsLearntByAskingTheShard) {
  Harness h;
  const std::string shard = "tcp://127.0.0.1:14579";
  auto r = request("r1", {"h0"}, {"t0"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.control->locked([&] { return h.control->held[{shard, "t0"}] = held_ready("h0"); });
  h.advance(4s);
  engine_step(h);
  EXPECT_EQ(h.control->locked([&] { return h.control->status_calls.size(); }), 0u) << "not waited long enough yet";
  h.advance(2s);
  engine_step(h);
  ASSERT_TRUE(h.control->wait_status_calls(1));
  ASSERT_TRUE(step_until_not_waiting(h, "t0"));
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::available);
  const auto stats = h.coordinator.stats();
  EXPECT_EQ(stats.readiness_rechecks, 1u);
  EXPECT_EQ(stats.readiness_recovered, 1u);
  EXPECT_EQ(stats.events_received, 0u) << "no event came";
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));  // the gate starts its load
  auto meta = h.step();
  ASSERT_EQ(meta.loads.size(), 1u);
  EXPECT_EQ(meta.loads[0].transfer_id, "t0");
}

// A transfer no shard holds ready (its producer is slow) keeps waiting: asked again
// every interval, and failed at push_wait_timeout as before.
TEST(CoordinatorConsumer, ATransferNoShardHoldsReadyIsAskedAgainEachIntervalAndStillExpires) {
  Harness h;
  auto r = request("r1", {"h0"}, {"t0"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  for (int round = 1; round <= 3; ++round) {
    h.advance(5s);
    engine_step(h);
    ASSERT_TRUE(h.control->wait_status_calls(static_cast<std::size_t>(round)));
    for (int i = 0; i < 1000; ++i) engine_step(h);  // takes the answer when it is done; nothing to apply
    EXPECT_EQ(state_of(h.coordinator, "t0"), S::waiting_event);
  }
  engine_step(h);  // within the same interval: not asked again
  EXPECT_EQ(h.control->locked([&] { return h.control->status_calls.size(); }), 3u);
  EXPECT_EQ(h.coordinator.stats().readiness_recovered, 0u);
  h.advance(50s);
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
}

// At TP 2 the event of one shard came and the other's was lost: asking recovers only
// the missing shard's readiness, and the transfer becomes loadable.
TEST(CoordinatorConsumer, OnlyTheShardWhoseReadinessEventWasLostIsRecovered) {
  Harness h(testing::consumer_options(), 2, {"tcp://127.0.0.1:14579", "tcp://127.0.0.1:14580"});
  auto r = request("r1", {"h0"}, {"t0"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.events->ready("t0", "h0", 4, /*shard=*/0);
  engine_step(h);
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::waiting_event);
  h.control->locked([&] {
    h.control->held[{"tcp://127.0.0.1:14579", "t0"}] = held_ready("h0");
    return h.control->held[{"tcp://127.0.0.1:14580", "t0"}] = held_ready("h0");
  });
  h.advance(6s);
  engine_step(h);
  ASSERT_TRUE(h.control->wait_status_calls(2));
  ASSERT_TRUE(step_until_not_waiting(h, "t0"));
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::available);
  EXPECT_EQ(h.coordinator.stats().readiness_recovered, 1u) << "shard 0's event came; only shard 1's was lost";
}

// vLLM's encoder cache may evict an entry and allocate it again in one scheduling
// step; the engine drops evicted entries first, so the workers must put ECX's copy
// back.
TEST(CoordinatorConsumer, EntryEvictedAndAllocatedAgainInOneStepIsRetained) {
  auto options = testing::consumer_options();
  options.table.resident_capacity_bytes = 0;  // no resident copy to fall back on
  Harness h(options);
  auto a = request("ra", {"h0"}, {"t0"});
  h.events->ready("t0", "h0");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(a, 0));
  h.step();
  h.coordinator.update_connector_output(WorkerOutput{{"h0"}, {}, {}, false, {}});
  ASSERT_TRUE(h.coordinator.ensure_cache_available(a, 0));
  h.coordinator.update_state_after_alloc(a, 0);
  h.coordinator.request_finished(a);
  h.step();
  // Next step: the engine evicts h0 for room, then a new request needs h0 again.
  auto b = request("rb", {"h0"}, {"t0"});
  EXPECT_TRUE(h.coordinator.has_cache_item("h0"));
  EXPECT_TRUE(h.coordinator.ensure_cache_available(b, 0));
  h.coordinator.update_state_after_alloc(b, 0);
  auto meta = h.step(StepView{{"h0", "h0"}, {}});
  EXPECT_EQ(meta.retained, std::vector<std::string>{"h0"});
  EXPECT_TRUE(meta.freed.empty());
  EXPECT_TRUE(meta.loads.empty());
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::ready);  // still in the workers' caches
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
  // Freed for good in a later step.
  h.coordinator.request_finished(b);
  auto later = h.step(StepView{{"h0"}, {}});
  EXPECT_TRUE(later.retained.empty());
  EXPECT_EQ(later.freed, std::vector<std::string>{"h0"});
  EXPECT_FALSE(h.coordinator.has_cache_item("h0"));  // no resident copy was kept
}

TEST(CoordinatorConsumer, EntryTheEngineEncodedItselfIsNotRetained) {
  Harness h;
  RequestView a;
  a.request_id = "ra";
  a.mm_features.push_back(testing::feature("h0"));
  EXPECT_TRUE(h.coordinator.ensure_cache_available(a, 0));
  h.coordinator.update_state_after_alloc(a, 0);
  h.step();
  RequestView b = a;
  b.request_id = "rb";
  h.coordinator.update_state_after_alloc(b, 0);
  auto meta = h.step(StepView{{"h0"}, {}});
  EXPECT_TRUE(meta.retained.empty());
  EXPECT_EQ(meta.freed, std::vector<std::string>{"h0"});
  EXPECT_TRUE(meta.loads.empty());
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
}

TEST(CoordinatorConsumer, RequestsWithoutTransferParamsAreNotGated) {
  Harness h;
  RequestView r;
  r.request_id = "plain";
  r.mm_features.push_back(testing::feature("h0"));
  EXPECT_TRUE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.coordinator.table().size(), 0u);
}

TEST(CoordinatorConsumer, MalformedParamsFailTheRequestOnceWithoutThrowing) {
  Harness h;
  RequestView r;
  r.request_id = "bad";
  r.mm_features.push_back(testing::feature("h0"));
  r.set_ec_transfer_params_text(R"({"ec_items": [{"transfer_id": 12}]})");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.coordinator.update_state_after_alloc(r, 0);
  h.coordinator.update_state_after_free(r, 0);
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"bad"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
  EXPECT_EQ(h.coordinator.stats().malformed_requests, 1u);
}

TEST(CoordinatorConsumer, MalformedEventsCostOnlyThemselves) {
  Harness h;
  TransferEvent no_spec;
  no_spec.transfer_id = "t1";
  no_spec.mm_hash = "h1";
  h.events->push(no_spec);
  TransferEvent bad_id;
  bad_id.transfer_id = "bad id with spaces";
  bad_id.mm_hash = "h1";
  bad_id.spec = testing::spec_of(2);
  h.events->push(bad_id);
  h.events->ready("t2", "h2");
  EXPECT_TRUE(h.coordinator.has_cache_item("h2"));
  EXPECT_EQ(h.coordinator.stats().events_malformed, 2u);
  EXPECT_EQ(h.coordinator.table().find("t1"), nullptr);
}

TEST(CoordinatorConsumer, FreeCancelsATransferTheRequestNoLongerNeeds) {
  Harness h;
  auto r = request("r1", {"h0"}, {"t0"});
  h.events->ready("t0", "h0");
  // A drain makes it AVAILABLE, but the request is served otherwise (from the
  // engine's cache: the engine never asks has_cache_item("h0")).
  h.coordinator.has_cache_item("unrelated");
  h.coordinator.update_state_after_alloc(r, 0);
  h.coordinator.update_state_after_free(r, 0);
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::cancelled);
  h.settle_cancels(1);
  EXPECT_EQ(h.coordinator.stats().cancels_succeeded, 1u);
}

TEST(CoordinatorConsumer, RemoteCancelsRunOnTheExecutorAndRetryOnlyFailedShards) {
  Harness h(testing::consumer_options(), 2, {"tcp://h:1", "tcp://h:2", "tcp://h:3"});
  h.control->locked([&] { return h.control->cancel_failures["tcp://h:2"] = 1; });
  h.coordinator.request_finished(request("r1", {"h0"}, {"t0"}));  // unknown id: tombstone + remote cancel
  h.settle_cancels(4);
  auto calls = h.control->locked([&] { return h.control->cancel_calls; });
  ASSERT_EQ(calls.size(), 4u);
  EXPECT_EQ(calls[3].first, "tcp://h:2");  // round 2 retries only the failed shard
  auto threads = h.control->locked([&] { return h.control->threads; });
  EXPECT_FALSE(threads.contains(std::this_thread::get_id()));
  EXPECT_EQ(h.coordinator.stats().cancels_succeeded, 1u);
  EXPECT_EQ(h.control->locked([&] { return h.control->discover_addresses; }),
            std::vector<std::string>{"tcp://127.0.0.1:14579"});
}

TEST(CoordinatorConsumer, ACancelThatFailsTwiceIsLoggedAsFailedNextStep) {
  Harness h(testing::consumer_options(), 1, {"tcp://h:1"});
  h.control->locked([&] { return h.control->cancel_failures["tcp://h:1"] = 5; });
  h.coordinator.request_finished(request("r1", {"h0"}, {"t0"}));
  h.settle_cancels(2);
  EXPECT_EQ(h.coordinator.stats().cancels_failed, 1u);
  EXPECT_EQ(h.control->locked([&] { return h.control->cancel_calls.size(); }), 2u);
}

TEST(CoordinatorConsumer, HooksDoNotWaitForAnInFlightCancel) {
  Harness h;
  h.control->locked([&] { return h.control->gated = true; });
  h.coordinator.request_finished(request("r1", {"h0"}, {"t0"}));
  ASSERT_TRUE(h.control->wait_discovers(1));
  // The cancel RPC is blocked; every hook still returns at once.
  h.events->ready("t1", "h1");
  EXPECT_TRUE(h.coordinator.has_cache_item("h1"));
  h.step();
  EXPECT_EQ(h.coordinator.pending_remote_cancels(), 1u);
  h.control->open_gate();
  h.settle_cancels(1);
  EXPECT_EQ(h.coordinator.pending_remote_cancels(), 0u);
}

TEST(CoordinatorConsumer, CancelsQueuedWhileOneIsOnTheWireGoTogetherInOneCallPerShard) {
  Harness h(testing::consumer_options(), 2, {"tcp://127.0.0.1:14579", "tcp://127.0.0.1:14580"});
  h.control->locked([&] { return h.control->gated = true; });
  h.coordinator.request_finished(request("r0", {"h0"}, {"t0"}));
  ASSERT_TRUE(h.control->wait_started_cancels(1));  // t0 alone: a lone cancel waits for no company
  for (int i = 1; i <= 3; ++i) {
    h.coordinator.request_finished(
        request("r" + std::to_string(i), {"h" + std::to_string(i)}, {"t" + std::to_string(i)}));
  }
  EXPECT_EQ(h.coordinator.pending_remote_cancels(), 4u);
  h.control->open_gate();
  h.settle_cancels(8);  // 4 transfers on 2 shards
  EXPECT_EQ(h.coordinator.pending_remote_cancels(), 0u);
  const auto calls = h.control->locked([&] { return h.control->cancel_many_calls; });
  const std::vector<std::string> first{"t0"};
  const std::vector<std::string> rest{"t1", "t2", "t3"};
  ASSERT_EQ(calls.size(), 4u);  // per shard: t0, then the three that queued behind it
  EXPECT_EQ(calls[0], std::make_pair(std::string("tcp://127.0.0.1:14579"), first));
  EXPECT_EQ(calls[1], std::make_pair(std::string("tcp://127.0.0.1:14580"), first));
  EXPECT_EQ(calls[2], std::make_pair(std::string("tcp://127.0.0.1:14579"), rest));
  EXPECT_EQ(calls[3], std::make_pair(std::string("tcp://127.0.0.1:14580"), rest));
  EXPECT_EQ(h.coordinator.stats().cancels_succeeded, 4u);
  // Two discoveries (one per batch), not one per transfer.
  EXPECT_EQ(h.control->locked([&] { return h.control->discover_calls; }), 2u);
}

TEST(CoordinatorConsumer, InABatchOnlyTheCancelsAShardFailedAreAskedAgain) {
  Harness h(testing::consumer_options(), 2, {"tcp://127.0.0.1:14579", "tcp://127.0.0.1:14580"});
  h.control->locked([&] { return h.control->gated = true; });
  h.coordinator.request_finished(request("r0", {"h0"}, {"t0"}));
  ASSERT_TRUE(h.control->wait_started_cancels(1));
  h.coordinator.request_finished(request("r1", {"h1"}, {"t1"}));
  h.coordinator.request_finished(request("r2", {"h2"}, {"t2"}));
  // The second shard times out once on t2, the second cancel of the batch [t1, t2].
  h.control->locked([&] { return h.control->cancel_failures_for[{"tcp://127.0.0.1:14580", "t2"}] = 1; });
  h.control->open_gate();
  h.settle_cancels(7);  // t0, t1, t2 on both shards, and t2 again on the second
  const auto calls = h.control->locked([&] { return h.control->cancel_many_calls; });
  ASSERT_EQ(calls.size(), 5u);
  EXPECT_EQ(calls[3], std::make_pair(std::string("tcp://127.0.0.1:14580"), std::vector<std::string>{"t1", "t2"}));
  EXPECT_EQ(calls[4], std::make_pair(std::string("tcp://127.0.0.1:14580"), std::vector<std::string>{"t2"}));
  EXPECT_EQ(h.coordinator.stats().cancels_succeeded, 3u);
  EXPECT_EQ(h.coordinator.stats().cancels_failed, 0u);
}

TEST(CoordinatorConsumer, ExportedMetricsAreTheCountersAsOfTheLastStep) {
  Harness h;
  metrics::Registry registry;
  const auto id = h.coordinator.export_metrics(registry);
  h.land_and_load(request("r9", {"h9"}, {"t9"}), "t9", "h9");
  h.coordinator.request_finished(request("r0", {"h0"}, {"t0"}));
  h.settle_cancels(1);  // steps until the cancel's outcome is taken
  h.step();
  auto snap = registry.snapshot();
  EXPECT_EQ(snap.at("ecx_scheduler_cancels_total{outcome=\"queued\"}"), 1.0);
  EXPECT_EQ(snap.at("ecx_scheduler_cancels_total{outcome=\"succeeded\"}"), 1.0);
  EXPECT_EQ(snap.at("ecx_scheduler_events_total{outcome=\"ready_accepted\"}"), 1.0);
  // Between steps the collector shows the last step's counters, not half-made ones.
  h.coordinator.request_finished(request("r1", {"h2"}, {"t2"}));
  EXPECT_EQ(registry.snapshot().at("ecx_scheduler_cancels_total{outcome=\"queued\"}"), 1.0);
  h.settle_cancels(2);
  EXPECT_EQ(registry.snapshot().at("ecx_scheduler_cancels_total{outcome=\"queued\"}"), 2.0);
  // It outlives the coordinator's close (the last snapshot stays).
  h.coordinator.close();
  EXPECT_EQ(registry.snapshot().at("ecx_scheduler_cancels_total{outcome=\"succeeded\"}"), 2.0);
  registry.remove_collector(id);
  EXPECT_EQ(registry.snapshot().count("ecx_scheduler_cancels_total{outcome=\"queued\"}"), 0u);
}

TEST(CoordinatorConsumer, ExportedMetricsCarryTheSubscriptionsOwnCounts) {
  Harness h;
  metrics::Registry registry;
  h.coordinator.export_metrics(registry);
  h.events->counters = SubscriptionCounters{2, 1, 5, 3, 1};
  EXPECT_EQ(registry.snapshot().at("ecx_scheduler_subscription_rejected_total{reason=\"auth_failed\"}"), 0.0);
  h.step();
  const auto snap = registry.snapshot();
  EXPECT_EQ(snap.at("ecx_scheduler_subscription_rejected_total{reason=\"malformed\"}"), 2.0);
  EXPECT_EQ(snap.at("ecx_scheduler_subscription_rejected_total{reason=\"unknown_kind\"}"), 1.0);
  EXPECT_EQ(snap.at("ecx_scheduler_subscription_rejected_total{reason=\"auth_failed\"}"), 5.0);
  EXPECT_EQ(snap.at("ecx_scheduler_subscription_discoveries_total{outcome=\"started\"}"), 3.0);
  EXPECT_EQ(snap.at("ecx_scheduler_subscription_discoveries_total{outcome=\"failed\"}"), 1.0);
  EXPECT_EQ(h.coordinator.stats().subscription_auth_failures, 5u);
}

TEST(CoordinatorConsumer, CloseJoinsTheExecutorAndClosesCollaboratorsOnce) {
  Harness h;
  h.coordinator.request_finished(request("r1", {"h0"}, {"t0"}));
  h.coordinator.close();
  h.coordinator.close();
  EXPECT_TRUE(h.events->closed);
  EXPECT_TRUE(h.control->locked([&] { return h.control->closed; }));
  h.coordinator.request_finished(request("r2", {"h1"}, {"t1"}));  // after close: counted, not sent
  EXPECT_GE(h.coordinator.stats().cancels_dropped, 1u);
}

TEST(CoordinatorConsumer, RequestFinishedCancelsBindingsThatMatchNoFeature) {
  Harness h;
  RequestView r = request("r1", {"h0"}, {"t0"});
  set_ec_transfer_params(
      r,
      nlohmann::json::parse(R"({"ec_items": [{"transfer_id": "t0"}, {"mm_hash": "zz", "transfer_id": "t-extra"}]})"));
  h.coordinator.request_finished(r);
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::cancelled);
  EXPECT_EQ(state_of(h.coordinator, "t-extra"), S::cancelled);
  h.settle_cancels(2);
}

TEST(CoordinatorConsumer, AReadinessQueuedBeforeTheNextDrainBeatsAPushWaitThatPassedMeanwhile) {
  Harness h;
  auto r = request("r1", {"h0"}, {"t0"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));  // waits for the push
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::waiting_event);
  h.step();
  // The engine was busy: the readiness reached the inbox, and the push-wait deadline
  // passed, before the scheduler looked again.
  h.events->ready("t0", "h0");
  h.advance(61s);
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));  // loads it
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::loading);
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());

  // With nothing in the inbox, the same deadline does fail the request.
  Harness quiet;
  EXPECT_FALSE(quiet.coordinator.ensure_cache_available(r, 0));
  quiet.step();
  quiet.advance(61s);
  EXPECT_FALSE(quiet.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(quiet.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
}

TEST(CoordinatorConsumer, LoadsOfAFinishedRequestThatNeverAllocatedThemAreFreed) {
  Harness h;
  auto r = request("r1", {"h0", "h1"}, {"t0", "t1"});
  h.events->ready("t0", "h0");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.step();
  h.coordinator.update_connector_output(WorkerOutput{{"h0"}, {}, {}, false, {}});
  h.coordinator.request_finished(r);  // aborted while waiting for h1
  auto meta = h.step();
  EXPECT_EQ(meta.freed, std::vector<std::string>{"h0"});
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::resident);
}

TEST(CoordinatorConsumer, ALoadStillInFlightWhenItsRequestFinishedIsFreedOnceItCompletes) {
  Harness h;
  auto r = request("r1", {"h0"}, {"t0"});
  h.events->ready("t0", "h0");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.step().loads.size(), 1u);
  h.coordinator.request_finished(r);  // aborted while the workers load h0
  EXPECT_TRUE(h.step().freed.empty());
  h.coordinator.update_connector_output(WorkerOutput{{"h0"}, {}, {}, false, {}});
  auto meta = h.step();
  EXPECT_EQ(meta.freed, std::vector<std::string>{"h0"});
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::resident);
}

TEST(CoordinatorConsumer, ALoadAnotherRequestAllocatedMeanwhileIsNotFreed) {
  Harness h;
  auto r = request("r1", {"h0"}, {"t0"});
  h.events->ready("t0", "h0");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.step();
  h.coordinator.request_finished(r);
  h.coordinator.update_connector_output(WorkerOutput{{"h0"}, {}, {}, false, {}});
  auto other = request("r2", {"h0"}, {"t0"});
  EXPECT_TRUE(h.coordinator.ensure_cache_available(other, 0));
  h.coordinator.update_state_after_alloc(other, 0);
  EXPECT_TRUE(h.step().freed.empty());
}

// Request B loads A's delivery of the same image (B's own push has not landed yet).
// B's own transfer is then owed to A: B must not cancel it, and A uses it.
TEST(CoordinatorConsumer, ARequestThatUsedAnotherRequestsDeliveryLeavesItsOwnToThatRequest) {
  Harness h;
  auto a = request("ra", {"h"}, {"ta"});
  auto b = request("rb", {"h"}, {"tb"});
  h.events->ready("ta", "h");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(b, 0));  // borrows ta
  auto meta = h.step();
  ASSERT_EQ(meta.loads.size(), 1u);
  EXPECT_EQ(meta.loads[0].transfer_id, "ta");
  h.coordinator.update_connector_output(WorkerOutput{{"h"}, {}, {}, false, {}});
  ASSERT_TRUE(h.coordinator.ensure_cache_available(b, 0));
  h.coordinator.update_state_after_alloc(b, 0);
  h.coordinator.update_state_after_free(b, 0);
  h.coordinator.request_finished(b);
  h.step();
  h.step(StepView{{"h"}, {}});                                                    // evicted: ta is resident
  h.coordinator.update_connector_output(WorkerOutput{{}, {}, {"h"}, false, {}});  // and its copy reclaimed
  h.step();
  EXPECT_NE(state_of(h.coordinator, "ta"), S::resident);
  EXPECT_EQ(h.coordinator.table().find("tb"), nullptr);  // tb was not cancelled
  // A arrives before tb landed: it waits for tb, not for its consumed ta.
  EXPECT_FALSE(h.coordinator.ensure_cache_available(a, 0));
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
  ASSERT_NE(h.coordinator.table().find("tb"), nullptr);
  EXPECT_EQ(state_of(h.coordinator, "tb"), S::waiting_event);
  h.events->ready("tb", "h");
  h.step();
  EXPECT_FALSE(h.coordinator.ensure_cache_available(a, 0));
  meta = h.step();
  ASSERT_EQ(meta.loads.size(), 1u);
  EXPECT_EQ(meta.loads[0].transfer_id, "tb");
  h.coordinator.update_connector_output(WorkerOutput{{"h"}, {}, {}, false, {}});
  EXPECT_TRUE(h.coordinator.ensure_cache_available(a, 0));
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
}

// B uses the copy A's own load brought into the workers' caches (no load of its
// own), runs and finishes first, so the engine frees the entry while A still waits
// for another item. The copy is A's: the workers keep it (retained) even when the
// pool's resident copy is reclaimed, and A is served from it.
TEST(CoordinatorConsumer, ACopyLoadedForAWaitingRequestIsRetainedWhenAnotherRequestsUseOfItEnds) {
  Harness h;
  auto a = request("ra", {"h", "other"}, {"ta", "t-other"});
  auto b = request("rb", {"h"}, {"tb"});
  h.land_and_load(a, "ta", "h");                            // "other" has not arrived
  ASSERT_TRUE(h.coordinator.ensure_cache_available(b, 0));  // served by A's load
  h.coordinator.update_state_after_alloc(b, 0);
  h.coordinator.update_state_after_free(b, 0);
  h.coordinator.request_finished(b);
  h.step();
  auto meta = h.step(StepView{{"h"}, {}});  // B's use ends: the engine frees h
  EXPECT_EQ(meta.retained, std::vector<std::string>{"h"});
  EXPECT_TRUE(meta.freed.empty());
  EXPECT_EQ(state_of(h.coordinator, "ta"), S::ready);
  h.coordinator.update_connector_output(WorkerOutput{{}, {}, {"h"}, false, {}});  // the pool's copy reclaimed
  h.step();
  meta = h.land_and_load(a, "t-other", "other");  // h is still in the workers: only "other" loads
  ASSERT_EQ(meta.loads.size(), 1u);
  EXPECT_EQ(meta.loads[0].mm_hash, "other");
  EXPECT_TRUE(h.coordinator.ensure_cache_available(a, 0));
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
  // A runs and finishes: from then on a free of h releases it as usual.
  h.coordinator.update_state_after_alloc(a, 0);
  h.coordinator.update_state_after_alloc(a, 1);
  h.coordinator.request_finished(a);
  h.step();
  meta = h.step(StepView{{"h", "other"}, {}});
  EXPECT_TRUE(meta.retained.empty());
  EXPECT_EQ(meta.freed, (std::vector<std::string>{"h", "other"}));
}

// The same when the waiting request only found the copy (another request loaded it,
// ran and finished): a copy two waiting requests count on stays until both let go.
TEST(CoordinatorConsumer, ACopyAWaitingRequestFoundLoadedIsRetainedWhenTheLoadersUseEnds) {
  Harness h;
  auto a = request("ra", {"h"}, {"ta"});
  auto b = request("rb", {"h", "other"}, {"tb", "t-other"});
  auto c = request("rc", {"h", "other2"}, {"tc", "t-other2"});
  h.events->ready("ta", "h");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(a, 0));  // A loads ta
  EXPECT_FALSE(h.coordinator.ensure_cache_available(b, 0));  // B finds it loading
  h.step();
  h.coordinator.update_connector_output(WorkerOutput{{"h"}, {}, {}, false, {}});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(c, 0));  // C finds it loaded
  ASSERT_TRUE(h.coordinator.ensure_cache_available(a, 0));
  h.coordinator.update_state_after_alloc(a, 0);
  h.coordinator.request_finished(a);
  h.step();
  auto meta = h.step(StepView{{"h"}, {}});  // A's use ends
  EXPECT_EQ(meta.retained, std::vector<std::string>{"h"});
  h.coordinator.request_finished(b);  // B gives up; C still counts on the copy
  EXPECT_TRUE(h.step().freed.empty());
  h.land_and_load(c, "t-other2", "other2");
  EXPECT_TRUE(h.coordinator.ensure_cache_available(c, 0));
  EXPECT_TRUE(h.coordinator.take_unavailable_requests().empty());
  h.coordinator.request_finished(c);  // C ends without running: nothing counts on h now
  meta = h.step();
  EXPECT_NE(std::find(meta.freed.begin(), meta.freed.end(), "h"), meta.freed.end());
}

// A request served by a copy whose own request has finished owes that request
// nothing: its own transfer is cancelled when it finishes, not kept as a substitute.
TEST(CoordinatorConsumer, ARequestServedByTheCopyOfAFinishedRequestOwesItNothing) {
  Harness h;
  auto a = request("ra", {"h"}, {"ta"});
  auto c = request("rc", {"h", "other"}, {"", "t-other"});  // names no transfer for h: owes nothing
  auto b = request("rb", {"h"}, {"tb"});
  h.land_and_load(a, "ta", "h");                             // A loads ta
  EXPECT_FALSE(h.coordinator.ensure_cache_available(c, 0));  // C counts on A's copy
  ASSERT_TRUE(h.coordinator.ensure_cache_available(a, 0));
  h.coordinator.update_state_after_alloc(a, 0);
  h.coordinator.request_finished(a);
  h.step();
  EXPECT_EQ(h.step(StepView{{"h"}, {}}).retained, std::vector<std::string>{"h"});  // kept for C
  h.events->ready("tb", "h");
  h.step();
  ASSERT_TRUE(h.coordinator.ensure_cache_available(b, 0));  // served by ta's copy
  h.coordinator.update_state_after_alloc(b, 0);
  h.coordinator.request_finished(b);
  EXPECT_EQ(state_of(h.coordinator, "tb"), S::cancelled);
}

// B borrows a delivery whose own request never arrives (its client went away): B's
// transfer, kept as that request's substitute, is forgotten once the reservation
// TTL has passed (its lease is over by then) instead of lingering until the bound.
TEST(CoordinatorConsumer, ASubstituteForALenderThatNeverArrivesIsForgottenAfterTheTtl) {
  Harness h;
  auto b = request("rb", {"h"}, {"tb"});
  h.land_and_load(b, "ta", "h");  // ta: nobody named it yet
  EXPECT_EQ(h.coordinator.bookkeeping().substitutes, 1u);
  ASSERT_TRUE(h.coordinator.ensure_cache_available(b, 0));
  h.coordinator.update_state_after_alloc(b, 0);
  h.coordinator.update_state_after_free(b, 0);
  h.coordinator.request_finished(b);
  h.step();
  EXPECT_EQ(h.coordinator.bookkeeping().substitutes, 1u);  // the lender's request may still come
  h.advance(h.coordinator.options().table.reservation_ttl + 1s);
  h.step();
  EXPECT_EQ(h.coordinator.bookkeeping().substitutes, 0u);
}

// The workers finish a load whose record expired meanwhile (its request was told
// unavailable and finished): nobody will use that copy, so it is freed from the
// workers' caches at the next step instead of staying there for good.
TEST(CoordinatorConsumer, ALoadThatCompletesAfterItsRecordExpiredIsFreed) {
  Harness h;
  auto r = request("r1", {"h"}, {"t1"});
  h.events->ready("t1", "h");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  ASSERT_EQ(h.step().loads.size(), 1u);
  h.advance(h.coordinator.options().push_wait_timeout + 1s);
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
  h.coordinator.request_finished(r);
  h.step();
  h.coordinator.update_connector_output(WorkerOutput{{"h"}, {}, {}, false, {}});  // the late report
  EXPECT_EQ(h.step().freed, std::vector<std::string>{"h"});
  EXPECT_EQ(h.coordinator.bookkeeping().unowned_loads, 0u);
}

// A load started for a request that finished, whose record expires before any step
// dispatched it, is never reported: it is not waited for.
TEST(CoordinatorConsumer, AnUnownedLoadThatExpiredBeforeItsDispatchIsNotWaitedFor) {
  Harness h;
  auto r = request("r1", {"h"}, {"t1"});
  h.events->ready("t1", "h");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));  // load queued, not dispatched
  h.coordinator.request_finished(r);
  EXPECT_EQ(h.coordinator.bookkeeping().unowned_loads, 1u);
  h.advance(h.coordinator.options().push_wait_timeout + 1s);
  EXPECT_FALSE(h.coordinator.has_cache_item("h"));  // drains: the load's deadline passed
  EXPECT_TRUE(h.step().loads.empty());
  EXPECT_EQ(h.coordinator.bookkeeping().unowned_loads, 0u);
}

// A request that counted on a copy it loaded, and finishes without running, lets the
// retained copy go.
TEST(CoordinatorConsumer, ARetainedCopyIsFreedWhenTheRequestThatLoadedItFinishesWithoutRunning) {
  Harness h;
  auto a = request("ra", {"h", "other"}, {"ta", "t-other"});
  auto b = request("rb", {"h"}, {"tb"});
  h.land_and_load(a, "ta", "h");
  ASSERT_TRUE(h.coordinator.ensure_cache_available(b, 0));
  h.coordinator.update_state_after_alloc(b, 0);
  h.coordinator.request_finished(b);
  h.step();
  EXPECT_EQ(h.step(StepView{{"h"}, {}}).retained, std::vector<std::string>{"h"});
  h.coordinator.request_finished(a);  // aborted while waiting for "other"
  auto meta = h.step();
  EXPECT_EQ(meta.freed, std::vector<std::string>{"h"});
  EXPECT_TRUE(meta.retained.empty());
}

TEST(CoordinatorConsumer, ASubstituteIsCancelledOnceBothRequestsFinished) {
  Harness h;
  auto a = request("ra", {"h", "other"}, {"ta", "t-other"});
  auto b = request("rb", {"h"}, {"tb"});
  h.events->ready("ta", "h");
  EXPECT_FALSE(h.coordinator.ensure_cache_available(a, 0));
  h.step();
  h.coordinator.update_connector_output(WorkerOutput{{"h"}, {}, {}, false, {}});
  ASSERT_TRUE(h.coordinator.ensure_cache_available(b, 0));  // tb becomes A's substitute
  h.coordinator.request_finished(b);
  h.events->ready("tb", "h");
  h.step();
  h.coordinator.has_cache_item("h");  // drains: tb is available, kept for A
  EXPECT_EQ(state_of(h.coordinator, "tb"), S::available);
  h.coordinator.request_finished(a);  // the second to finish cancels it
  EXPECT_EQ(state_of(h.coordinator, "tb"), S::cancelled);
  h.settle_cancels(2);
}

// B waited for its own transfer, then was served by A's delivery (its transfer kept
// as A's substitute) and used it. When A finishes, the substitute is cancelled: B no
// longer waits for it, so B is not told its input cannot be obtained (the engine
// would fail a request that already has its encoder output).
TEST(CoordinatorConsumer, ARequestServedByABorrowedCopyIsNotToldItsOwnCancelledTransferIsLost) {
  Harness h;
  auto a = request("ra", {"h"}, {"ta"});
  auto b = request("rb", {"h"}, {"tb"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(b, 0));  // B waits for tb
  h.step();
  h.land_and_load(a, "ta", "h");
  ASSERT_TRUE(h.coordinator.ensure_cache_available(b, 0));  // served by ta: tb becomes A's substitute
  h.coordinator.update_state_after_alloc(b, 0);
  h.coordinator.update_state_after_free(b, 0);  // B used it and runs on
  ASSERT_TRUE(h.coordinator.ensure_cache_available(a, 0));
  h.coordinator.update_state_after_alloc(a, 0);
  h.coordinator.request_finished(a);  // the second side done: tb is cancelled
  EXPECT_EQ(state_of(h.coordinator, "tb"), S::cancelled);
  h.step();
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{});
}

TEST(CoordinatorConsumer, PartialShardReadinessIsBounded) {
  auto options = testing::consumer_options();
  options.max_pending_shard_events = 3;
  Harness h(options, 2);
  for (int i = 0; i < 5; ++i) h.events->ready("t" + std::to_string(i), "h" + std::to_string(i), 4, 14579);
  h.coordinator.has_cache_item("x");
  EXPECT_EQ(h.coordinator.stats().partial_dropped, 2u);
  h.step();
  h.events->ready("t0", "h0", 4, 14580);  // t0's first half was dropped
  h.events->ready("t4", "h4", 4, 14580);
  EXPECT_FALSE(h.coordinator.has_cache_item("h0"));
  EXPECT_TRUE(h.coordinator.has_cache_item("h4"));
}

TEST(CoordinatorConsumer, ShardsThatDisagreeOnTheSpecFailTheTransfer) {
  Harness h(testing::consumer_options(), 2);
  auto r = request("r1", {"h0"}, {"t0"});
  EXPECT_FALSE(h.coordinator.ensure_cache_available(r, 0));
  h.step();
  h.events->ready("t0", "h0", 4, 14579);
  h.events->ready("t0", "h0", 5, 14580);
  EXPECT_FALSE(h.coordinator.has_cache_item("h0"));
  EXPECT_EQ(state_of(h.coordinator, "t0"), S::unavailable);
  EXPECT_EQ(h.coordinator.take_unavailable_requests(), std::vector<std::string>{"r1"});
}

TEST(CoordinatorConsumer, FromConfigTakesEveryScheduledKey) {
  Config c;
  c.role = Role::both;
  c.push_wait_timeout_s = 7;
  c.reservation_ttl_s = 11;
  c.tombstone_max = 99;
  c.buffer_size = 5000;
  c.cross_encoder_cache = true;
  auto o = CoordinatorOptions::from_config(c, DType::float16, 1234);
  EXPECT_TRUE(o.is_producer && o.is_consumer);
  EXPECT_EQ(o.push_wait_timeout, 7s);
  EXPECT_EQ(o.table.reservation_ttl, 11s);
  EXPECT_EQ(o.table.tombstone_max, 99u);
  EXPECT_EQ(o.table.resident_capacity_bytes, 5000u);
  EXPECT_EQ(o.encoder_output_width, 1234);
  EXPECT_EQ(o.encoder_dtype, DType::float16);
  EXPECT_EQ(o.control_address, "tcp://127.0.0.1:14579");
  c.encoder_output_width = 77;
  c.resident_capacity_bytes = 300;
  o = CoordinatorOptions::from_config(c, DType::float16, 1234);
  EXPECT_EQ(o.encoder_output_width, 77);
  EXPECT_EQ(o.table.resident_capacity_bytes, 300u);
}

}  // namespace
}  // namespace ecx::scheduler
