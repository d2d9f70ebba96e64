#include "ecx/connector/scheduler/transfer_params.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

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

// The text is read without building a JSON value; the value reader is the reference.
// Both must give the same params or the same error, word for word: on the fuzz
// target's corpus, and on documents that repeat keys, nest where ids belong, carry more
// ec_items than allowed, or are no object at all.
std::string outcome(const Result<EcTransferParams>& p) {
  if (!p) return "error: " + p.status().message();
  std::string out = "zmq=" + p->consumer_zmq;
  for (const auto& item : p->items) {
    out += " [" + item.mm_hash.value_or("-") + "|" + item.transfer_id.value_or("-") + "|" +
           (item.from_store ? "store" : "push") + "]";
  }
  return out;
}

void expect_readers_agree(const std::string& text) {
  const auto value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  const auto from_text = parse_ec_transfer_params_text(text);
  if (value.is_discarded()) {
    EXPECT_FALSE(from_text) << text;
    return;
  }
  EXPECT_EQ(outcome(from_text), outcome(parse_ec_transfer_params(value))) << text;
  RequestView by_text;
  by_text.set_ec_transfer_params_text(text);
  RequestView by_value;
  set_ec_transfer_params(by_value, value);
  EXPECT_EQ(by_text.ec_transfer_params.has_value(), by_value.ec_transfer_params.has_value()) << text;
  EXPECT_EQ(by_text.ec_transfer_params_error, by_value.ec_transfer_params_error) << text;
}

TEST(TransferParams, TheTextReaderAgreesWithTheValueReader) {
  const std::string documents[] = {
      R"({"consumer_zmq": "tcp://a:1", "ec_items": [{"mm_hash": "h", "transfer_id": "t"}],
          "h": {"metadata": {"grid": [[1, 2], [3, 4]], "ec_items": 5}, "item_indices": [0]}})",
      R"({"ec_items": [{"transfer_id": "a"}], "ec_items": [{"transfer_id": "b"}, {"store": true}]})",
      R"({"ec_items": [{"transfer_id": "a", "transfer_id": null}]})",
      R"({"ec_items": [{"transfer_id": {"nested": "t"}}]})",
      R"({"ec_items": [{"mm_hash": ["h"]}]})",
      R"({"ec_items": [{"mm_hash": 5}]})",
      R"({"ec_items": [{"mm_hash": "bad id with spaces"}]})",
      R"({"ec_items": [{"store": "yes"}]})",
      R"({"ec_items": [{"store": true, "transfer_id": "t"}]})",
      R"({"ec_items": [[{"transfer_id": "t"}]]})",
      R"({"ec_items": [null, {"transfer_id": "t"}]})",
      R"({"ec_items": {"transfer_id": "t"}})",
      R"({"ec_items": null, "consumer_zmq": null})",
      R"({"consumer_zmq": 5, "ec_items": "x"})",
      R"({"consumer_zmq": "no-scheme"})",
      R"({"consumer_zmq": {"ec_items": []}})",
      R"({"outer": {"ec_items": [{"transfer_id": "t"}]}})",
      R"([{"ec_items": []}])",
      R"("text")",
      R"(null)",
      R"(12.5)",
      R"({})",
      R"({"ec_items": []})",
      R"({"ec_items": [{"transfer_id": "t"}] )",
      R"({"ec_items": [{"transfer_id": "t"}]} trailing)",
      "{\"ec_items\": [{\"transfer_id\": \"\xff\"}]}",
  };
  for (const auto& text : documents) expect_readers_agree(text);

  // More entries than allowed, and exactly as many.
  for (const std::size_t n : {kMaxEcItems, kMaxEcItems + 1}) {
    std::string many = R"({"ec_items": [)";
    for (std::size_t i = 0; i < n; ++i)
      many += (i ? ",{" : "{") + std::string(R"("transfer_id": "t)") + std::to_string(i) + "\"}";
    expect_readers_agree(many + "]}");
  }
}

TEST(TransferParams, TheTextReaderAgreesWithTheValueReaderOnTheFuzzCorpus) {
  const std::filesystem::path corpus = std::filesystem::path(ECX_SOURCE_DIR) / "tests/fuzz/corpus/transfer_params";
  std::size_t read = 0;
  for (const auto& entry : std::filesystem::directory_iterator(corpus)) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    expect_readers_agree(text);
    ++read;
  }
  EXPECT_GT(read, 100u);
}

}  // namespace
}  // namespace ecx::scheduler
