#include "ecx/connector/scheduler/transfer_params.h"

#include <gtest/gtest.h>

#include "connector/scheduler/transfer_params_json.h"
#include "ecx/connector/scheduler/types.h"

namespace ecx::scheduler {
namespace {

using nlohmann::json;

TEST(TransferParams, ParsesTheProxyShapeAndToleratesExtraKeys) {
  auto p = parse_ec_transfer_params(json::parse(R"({
    "consumer_zmq": "tcp://10.0.0.2:14579",
    "ec_items": [{"transfer_id": "abc"}, {"mm_hash": "h1", "transfer_id": "def", "metadata": {"grid": [1,2,3]}}],
    "h1": {"handle": 1}})"));
  ASSERT_TRUE(p) << p.status().message();
  EXPECT_EQ(p->consumer_zmq, "tcp://10.0.0.2:14579");
  ASSERT_EQ(p->items.size(), 2u);
  EXPECT_FALSE(p->items[0].mm_hash);
  EXPECT_EQ(*p->items[0].transfer_id, "abc");
  EXPECT_EQ(*p->items[1].mm_hash, "h1");
}

TEST(TransferParams, AbsentAndNullFieldsMeanNone) {
  auto p = parse_ec_transfer_params(json::parse(R"({"consumer_zmq": null, "ec_items": [{"mm_hash": null}]})"));
  ASSERT_TRUE(p);
  EXPECT_TRUE(p->consumer_zmq.empty());
  EXPECT_FALSE(p->items[0].transfer_id);
  EXPECT_TRUE(parse_ec_transfer_params(json::object()));
}

TEST(TransferParams, RejectsWrongTypesAndInvalidIds) {
  const char* bad[] = {
      R"([])",
      R"({"consumer_zmq": 5})",
      R"({"consumer_zmq": "no-scheme"})",
      R"({"ec_items": {}})",
      R"({"ec_items": [5]})",
      R"({"ec_items": [{"transfer_id": 7}]})",
      R"({"ec_items": [{"transfer_id": ""}]})",
      R"({"ec_items": [{"transfer_id": "has space"}]})",
      R"({"ec_items": [{"mm_hash": ["x"]}]})",
      R"({"ec_items": [{"mm_hash": "h", "store": "yes"}]})",
      R"({"ec_items": [{"mm_hash": "h", "transfer_id": "t", "store": true}]})",
  };
  for (const char* text : bad) {
    auto p = parse_ec_transfer_params_text(text);
    EXPECT_FALSE(p) << text;
    if (!p) {
      EXPECT_EQ(p.status().code(), StatusCode::invalid_argument) << text;
    }
  }
  auto syntax = parse_ec_transfer_params_text("{not json");
  ASSERT_FALSE(syntax);
  EXPECT_NE(syntax.status().message().find("not valid JSON"), std::string::npos);
}

TEST(TransferParams, ResolvesByPositionWhenMmHashIsAbsentOrEqualElseByHash) {
  auto p = *parse_ec_transfer_params(json::parse(R"({"ec_items": [
      {"transfer_id": "t0"},
      {"mm_hash": "hB", "transfer_id": "tB"},
      {"mm_hash": "hX", "transfer_id": "tX"},
      {"mm_hash": "hZ"}]})"));
  EXPECT_EQ(*resolve_transfer_id(&p, 0, "anything"), "t0");  // positional, no mm_hash
  EXPECT_EQ(*resolve_transfer_id(&p, 1, "hB"), "tB");        // positional, equal mm_hash
  EXPECT_EQ(*resolve_transfer_id(&p, 2, "hB"), "tB");        // position disagrees → by hash
  EXPECT_FALSE(resolve_transfer_id(&p, 3, "hZ"));            // names no transfer
  EXPECT_FALSE(resolve_transfer_id(&p, 7, "nope"));
  EXPECT_FALSE(resolve_transfer_id(nullptr, 0, "hB"));
}

TEST(TransferParams, StoreItemsAreMatchedByPositionOrHashAndNameNoTransfer) {
  auto p = *parse_ec_transfer_params(json::parse(R"({"ec_items": [
      {"store": true},
      {"mm_hash": "hB", "store": true},
      {"mm_hash": "hC", "transfer_id": "tC"},
      {"mm_hash": "hD", "store": false},
      {"mm_hash": "hE", "store": null}]})"));
  EXPECT_TRUE(p.items[0].from_store);
  EXPECT_FALSE(p.items[2].from_store);
  EXPECT_TRUE(is_store_item(&p, 0, "anything"));  // positional, no mm_hash
  EXPECT_TRUE(is_store_item(&p, 1, "hB"));
  EXPECT_TRUE(is_store_item(&p, 5, "hB"));   // position disagrees → by hash
  EXPECT_FALSE(is_store_item(&p, 2, "hC"));  // a pushed item
  EXPECT_FALSE(is_store_item(&p, 3, "hD"));
  EXPECT_FALSE(is_store_item(&p, 4, "hE"));
  EXPECT_FALSE(is_store_item(nullptr, 0, "hB"));
  EXPECT_FALSE(resolve_transfer_id(&p, 1, "hB"));
}

TEST(TransferParams, RequestViewRecordsMalformedParamsInsteadOfThrowing) {
  RequestView r;
  set_ec_transfer_params(r, json::parse(R"({"ec_items": "x"})"));
  EXPECT_TRUE(r.has_malformed_params());
  EXPECT_FALSE(r.ec_transfer_params);
  set_ec_transfer_params(r, json(nullptr));
  EXPECT_FALSE(r.has_malformed_params());
  EXPECT_FALSE(r.ec_transfer_params);
  r.set_ec_transfer_params_text(R"({"ec_items": [{"transfer_id": "t"}]})");
  ASSERT_TRUE(r.ec_transfer_params);
  r.set_ec_transfer_params_text("]");
  EXPECT_TRUE(r.has_malformed_params());
}

}  // namespace
}  // namespace ecx::scheduler
