// The producer half on its own: a PushPlanner and the RequestFailures it reports
// to, without a transfer table, an event source or a control client.
#include "connector/scheduler/push_planner.h"

#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "connector/scheduler/request_failures.h"
#include "fake_collaborators.h"

namespace ecx::scheduler {
namespace {

using testing::request;

std::optional<nlohmann::json> parsed(const std::optional<std::string>& text) {
  if (!text) return std::nullopt;
  return nlohmann::json::parse(*text);
}

struct Planner {
  explicit Planner(CoordinatorOptions o = testing::producer_options())
      : options(std::move(o)), failures(options.max_notified_remembered), planner(options, failures) {}
  ConnectorMeta step(const StepView& view = {}) {
    ConnectorMeta meta;
    planner.take_step(view, meta);
    return meta;
  }

  CoordinatorOptions options;
  RequestFailures failures;
  PushPlanner planner;
};

TEST(PushPlanner, OneEncodingNamedByTwoRequestsIsPushedOnceAndReportedToBoth) {
  Planner p;
  auto a = request("ra", {"h"}, {"t"}, "tcp://c:1");
  auto b = request("rb", {"h"}, {"t"}, "tcp://c:1");
  p.planner.plan_uncomputed(a, 0);
  p.planner.plan_uncomputed(b, 0);
  p.planner.plan_uncomputed(a, 0);  // planned once per request and transfer
  auto meta = p.step();
  ASSERT_EQ(meta.pushes.size(), 1u);
  EXPECT_EQ(meta.pushes[0].request_id, "ra");
  EXPECT_EQ(meta.pushes[0].spec, testing::spec_of(4, 16, DType::bfloat16));
  EXPECT_EQ(p.planner.stats().pushes_planned, 1u);
  EXPECT_EQ(p.planner.bindings(), 1u);
  auto fa = parsed(p.planner.finish(a));
  ASSERT_TRUE(fa);
  EXPECT_EQ(fa->at("ec_items").size(), 1u);
  EXPECT_EQ(p.planner.bindings(), 1u);  // still rb's
  auto fb = parsed(p.planner.finish(b));
  ASSERT_TRUE(fb);
  EXPECT_EQ(fb->at("ec_items")[0]["transfer_id"], "t");
  EXPECT_EQ(p.planner.bindings(), 0u);
}

TEST(PushPlanner, ATransferIdPlannedForOtherContentFailsTheNewcomer) {
  Planner p;
  p.planner.plan_uncomputed(request("ra", {"h1"}, {"t"}, "tcp://c:1"), 0);
  p.planner.plan_uncomputed(request("rb", {"h2"}, {"t"}, "tcp://c:1"), 0);
  p.planner.plan_uncomputed(request("rc", {"h1"}, {"t"}, "tcp://other:1"), 0);
  EXPECT_EQ(p.step().pushes.size(), 1u);
  EXPECT_EQ(p.planner.stats().push_conflicts, 2u);
  EXPECT_EQ(p.failures.take({}), (std::vector<std::string>{"rb", "rc"}));
}

TEST(PushPlanner, UnresolvedItemsArePushedUnderAnInventedNameAndCounted) {
  Planner p;
  auto r = request("r1", {"h0", "h1"}, {"t0"}, "tcp://c:1");
  p.planner.plan_uncomputed(r, 0);
  auto meta = p.step();
  ASSERT_EQ(meta.pushes.size(), 2u);
  EXPECT_EQ(meta.pushes[1].transfer_id, "r1:1");
  EXPECT_EQ(p.failures.stats().unresolved_transfer_ids, 1u);
  EXPECT_TRUE(p.failures.take({}).empty());  // a warning, not a failure
}

TEST(PushPlanner, NothingIsPlannedWithoutAConsumerOrForAPureConsumer) {
  Planner p;
  p.planner.plan_uncomputed(request("r1", {"h0"}, {"t0"}), 0);
  EXPECT_TRUE(p.step().pushes.empty());
  EXPECT_EQ(p.failures.stats().unresolved_transfer_ids, 0u);

  Planner consumer(testing::consumer_options());
  auto r = request("r2", {"h0"}, {"t0"}, "tcp://c:1");
  consumer.planner.plan_uncomputed(r, 0);
  consumer.planner.after_alloc(r, 0);
  EXPECT_TRUE(consumer.step().pushes.empty());
  EXPECT_FALSE(consumer.planner.finish(r));
}

TEST(PushPlanner, StoreCandidatesKeepTheLatestPerHashAndSkipPreemptedRequests) {
  auto options = testing::producer_options();
  options.cross_encoder_cache = true;
  Planner p(options);
  auto a = request("ra", {"h"}, {"ta"});
  auto b = request("rb", {"h"}, {"tb"});
  b.mm_features[0].output_spec = testing::spec_of(9);
  auto c = request("rc", {"hc"}, {"tc"});
  p.planner.after_alloc(a, 0);
  p.planner.after_alloc(b, 0);
  p.planner.after_alloc(c, 0);
  auto meta = p.step(StepView{{}, {"rc"}});
  ASSERT_EQ(meta.store_candidates.size(), 1u);
  EXPECT_EQ(meta.store_candidates[0].mm_hash, "h");
  EXPECT_EQ(meta.store_candidates[0].spec, testing::spec_of(9));
  EXPECT_TRUE(p.step().store_candidates.empty());
}

TEST(PushPlanner, MalformedParamsAreNotPlannedAtAllocation) {
  Planner p;
  RequestView r = request("r1", {"h0"}, {"t0"}, "tcp://c:1");
  r.ec_transfer_params_error = "bad";
  p.planner.after_alloc(r, 0);
  EXPECT_TRUE(p.step().pushes.empty());
}

TEST(PushPlanner, FinishReportsIndicesPerIdentifierAndForgetsEmptyRequests) {
  Planner p;
  auto r = request("r1", {"h0", "h0"}, {"t0", "t1"});
  auto params = parsed(p.planner.finish(r));
  ASSERT_TRUE(params);
  EXPECT_EQ((*params)["h0"]["item_indices"], nlohmann::json::array({0, 1}));
  EXPECT_EQ((*params)["h0"]["transfer_id"], "t1");
  EXPECT_FALSE(params->contains("ec_items"));  // nothing was planned (no consumer)
  EXPECT_FALSE(p.planner.finish(request("r2", {}, {})));
}

TEST(PushPlanner, PendingSavesAreWhatTheWorkersLastReported) {
  Planner p;
  EXPECT_FALSE(p.planner.pushes_in_flight());
  p.planner.note_pending_saves(true);
  EXPECT_TRUE(p.planner.pushes_in_flight());
  p.planner.note_pending_saves(false);
  EXPECT_FALSE(p.planner.pushes_in_flight());
}

TEST(RequestFailures, EachRequestIsReturnedOnceAndAFinishedOneIsForgotten) {
  RequestFailures f(2);
  f.mark("r1");
  f.mark("r2");
  f.add_failed_saves({"r2", "r3"});
  EXPECT_EQ(f.pending(), 2u);
  f.forget("r2");  // finished: only its failed save remains
  EXPECT_EQ(f.take({"r0", "r1"}), (std::vector<std::string>{"r0", "r1", "r2", "r3"}));
  EXPECT_EQ(f.pending(), 0u);
  f.mark("r3");
  EXPECT_TRUE(f.take({"r2"}).empty());                        // both remembered (the bound keeps the latest two)
  EXPECT_EQ(f.take({"r0"}), std::vector<std::string>{"r0"});  // forgotten by the bound
}

TEST(RequestFailures, MalformedParamsAreReportedAndCountedOnce) {
  RequestFailures f(16);
  RequestView ok = request("ok", {"h"}, {"t"});
  EXPECT_FALSE(f.report_malformed(ok));
  RequestView bad = ok;
  bad.request_id = "bad";
  bad.ec_transfer_params_error = "ec_items must be an array";
  EXPECT_TRUE(f.report_malformed(bad));
  EXPECT_TRUE(f.report_malformed(bad));
  EXPECT_EQ(f.stats().malformed_requests, 1u);
  EXPECT_EQ(f.take({}), std::vector<std::string>{"bad"});
  EXPECT_TRUE(f.report_malformed(bad));  // already returned: not marked again
  EXPECT_EQ(f.stats().malformed_requests, 1u);
  EXPECT_TRUE(f.take({}).empty());
}

// The params are written as text directly: keys in the order a JSON object sorts them
// ("ec_items" among the identifiers), one entry per identifier with every index and the
// last transfer id, and text that is not an id's (a request id in an invented
// transfer id) escaped.
TEST(PushPlanner, FinishWritesItsParamsAsSortedEscapedJsonText) {
  Planner p;
  auto r = request("r1", {"zz", "aa", "aa"}, {"t2", "t0", "t1"}, "tcp://c:1");
  p.planner.plan_uncomputed(r, 0);
  EXPECT_EQ(p.step().pushes.size(), 3u);
  EXPECT_EQ(p.planner.finish(r).value_or(""),
            R"({"aa":{"item_indices":[1,2],"transfer_id":"t1"},"ec_items":[{"mm_hash":"zz","transfer_id":"t2"},)"
            R"({"mm_hash":"aa","transfer_id":"t0"},{"mm_hash":"aa","transfer_id":"t1"}],)"
            R"("zz":{"item_indices":[0],"transfer_id":"t2"}})");
  EXPECT_EQ(p.planner.bindings(), 0u);

  auto odd = request("say \"hi\"\\\n", {"h"}, {}, "tcp://c:1");
  p.planner.plan_uncomputed(odd, 0);
  p.step();
  const auto text = p.planner.finish(odd);
  ASSERT_TRUE(text);
  const auto params = nlohmann::json::parse(*text);
  // The invented name is the request id made an id: pushed as it was, it failed validation.
  EXPECT_EQ(params.at("ec_items").at(0).at("transfer_id"), "say~20~22hi~22~5c~0a:0") << *text;
  EXPECT_TRUE(validate_transfer_id(params.at("ec_items").at(0).at("transfer_id").get<std::string>()).ok());
  EXPECT_EQ(params.at("h").at("item_indices"), nlohmann::json::array({0})) << *text;
  EXPECT_FALSE(params.at("h").contains("transfer_id")) << *text;
}

// An engine's identifier is not validated on the way in: one that is no valid mm_hash
// is refused when its push is planned (the request fails, nothing is pushed), and one
// that is not even UTF-8 is still written as JSON rather than thrown out of finish().
TEST(PushPlanner, AnIdentifierThatIsNoValidMmHashIsNotPushedAndItsRequestFails) {
  Planner p;
  auto r = request("r1", {"ok", "has space", std::string("bad\xff")}, {"t0", "t1", "t2"}, "tcp://c:1");
  p.planner.plan_uncomputed(r, 0);
  const auto meta = p.step();
  ASSERT_EQ(meta.pushes.size(), 1u);
  EXPECT_EQ(meta.pushes[0].mm_hash, "ok");
  EXPECT_EQ(p.failures.take({}), std::vector<std::string>{"r1"});

  std::optional<std::string> text;
  ASSERT_NO_THROW(text = p.planner.finish(r));
  ASSERT_TRUE(text);
  const auto params = nlohmann::json::parse(*text);
  EXPECT_EQ(params.at("ec_items").size(), 1u) << *text;
  EXPECT_EQ(params.at("has space").at("transfer_id"), "t1") << *text;
  EXPECT_EQ(params.at("bad\xef\xbf\xbd").at("item_indices"), nlohmann::json::array({2})) << *text;
}

}  // namespace
}  // namespace ecx::scheduler
