// The proxy's side of the cross-encoder cache: engine hashes learned from encoder
// answers, the per-request decision which images skip the encoders (over a real
// presence index whose store is a test double), the consumer body's store items, and
// the store flags' validation.
#include "proxy/store_route.h"

#include <atomic>

#include <gtest/gtest.h>

namespace ecx::proxy {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;

// A store that holds nothing; counts the lookups the presence index makes.
class EmptyStore final : public store::EmbeddingStore {
 public:
  Result<std::vector<bool>> contains(std::span<const std::string> mm_hashes) override {
    lookups += mm_hashes.size();
    return std::vector<bool>(mm_hashes.size(), false);
  }
  Result<store::Entry> get_into(std::string_view, const Landing&) override { return not_found("empty"); }
  Status put(std::string_view, const TensorSpec&, std::span<const std::byte>) override { return Status::ok(); }
  store::StoreCounters counters() const override { return {}; }
  std::string describe() const override { return "empty test store"; }
  std::atomic<std::size_t> lookups{0};
};

json image(const std::string& url) { return {{"type", "image_url"}, {"image_url", {{"url", url}}}}; }

json chat(std::vector<json> parts, json kwargs = nullptr) {
  json body = {{"model", "m"}, {"messages", json::array({{{"role", "user"}, {"content", std::move(parts)}}})}};
  if (!kwargs.is_null()) body["mm_processor_kwargs"] = std::move(kwargs);
  return body;
}

// What an encoder reported for each item: its engine hash "eh-<n>".
std::vector<ItemReport> reports_for(std::size_t count) {
  std::vector<ItemReport> reports(count);
  for (std::size_t i = 0; i < count; ++i) {
    reports[i].engine_hash = "eh-" + std::to_string(i);
    reports[i].metadata = json::object();
  }
  return reports;
}

class StoreRouteTest : public ::testing::Test {
 protected:
  StoreRouteTest() {
    auto index = std::make_unique<store::PresenceIndex>(store_, nullptr, store::PresenceOptions{});
    index_ = index.get();
    route_ = std::make_unique<StoreRoute>(std::move(index), 100);
  }
  std::shared_ptr<EmptyStore> store_ = std::make_shared<EmptyStore>();
  store::PresenceIndex* index_ = nullptr;
  std::unique_ptr<StoreRoute> route_;
};

TEST(LearnedHashes, BoundedLeastRecentlyLearnedForgottenFirst) {
  LearnedHashes learned(2);
  learned.learn("a", "ha");
  learned.learn("b", "hb");
  learned.learn("a", "ha2");  // refreshed (and its hash replaced): "b" is now the oldest
  learned.learn("c", "hc");
  EXPECT_EQ(learned.size(), 2u);
  EXPECT_EQ(learned.forgotten(), 1u);
  EXPECT_EQ(learned.find("b"), nullptr);
  ASSERT_NE(learned.find("a"), nullptr);
  EXPECT_EQ(*learned.find("a"), "ha2");
  EXPECT_EQ(*learned.find("c"), "hc");
  learned.learn("d", "hd");
  EXPECT_EQ(learned.find("a"), nullptr);
  EXPECT_EQ(learned.forgotten(), 2u);
}

TEST(LearnedKey, NamesTheItemAndTheKwargsThatChangeTheEngineHash) {
  const auto media = *find_media(chat({image("http://a"), image("http://b")}, {{"max_pixels", 64}}));
  const json body = chat({image("http://a"), image("http://b")}, {{"max_pixels", 64}});
  const std::string key = learned_key(body, media[0]);
  EXPECT_EQ(key.size(), 64u);
  EXPECT_NE(key, learned_key(body, media[1]));

  json other = body;
  other["priority"] = 3;  // forwarded, but the engine hash does not depend on it
  other["session_id"] = "s";
  other["messages"][0]["content"].push_back({{"type", "text"}, {"text", "more"}});
  EXPECT_EQ(learned_key(other, media[0]), key);
  for (const auto& [field, value] : std::vector<std::pair<std::string, json>>{
           {"model", "other-model"},
           {"mm_processor_kwargs", {{"max_pixels", 128}}},
           {"media_io_kwargs", {{"image", {{"mode", "RGB"}}}}},
       }) {
    json changed = body;
    changed[field] = value;
    EXPECT_NE(learned_key(changed, media[0]), key) << field;
  }
  // Kwargs compare by value, whatever their key order in the request.
  const json a = json::parse(R"({"model":"m","mm_processor_kwargs":{"x":1,"y":2}})");
  const json b = json::parse(R"({"mm_processor_kwargs":{"y":2,"x":1},"model":"m"})");
  EXPECT_EQ(learned_key(a, media[0]), learned_key(b, media[0]));
}

TEST_F(StoreRouteTest, UnknownThenMissThenHit) {
  const json body = chat({image("http://a")});
  const auto media = *find_media(body);

  auto plan = route_->plan(body, media);  // nothing learned: the store is not even asked
  EXPECT_TRUE(plan.checked);
  EXPECT_EQ(plan.unknown, 1u);
  EXPECT_EQ(plan.to_encode, std::vector<std::size_t>{0});
  EXPECT_FALSE(plan.skips_encoders());
  EXPECT_EQ(index_->counters().lookups, 0u);

  route_->learn(body, media, plan.to_encode, reports_for(1));
  EXPECT_EQ(route_->learned().size(), 1u);
  plan = route_->plan(body, media);  // learned, not in the store (the index confirms it off-thread)
  EXPECT_EQ(plan.misses, 1u);
  EXPECT_EQ(plan.to_encode, std::vector<std::size_t>{0});
  EXPECT_EQ(index_->counters().lookups, 1u);
  ASSERT_TRUE(index_->wait_confirmed(5s));
  EXPECT_EQ(store_->lookups.load(), 1u);

  index_->learn("eh-0");  // the store now holds it
  plan = route_->plan(body, media);
  EXPECT_EQ(plan.hits, 1u);
  EXPECT_TRUE(plan.to_encode.empty());
  EXPECT_EQ(plan.store_hashes, std::vector<std::string>{"eh-0"});
  EXPECT_TRUE(plan.skips_encoders());

  // Other kwargs: another engine hash, not learned.
  const json resized = chat({image("http://a")}, {{"max_pixels", 64}});
  plan = route_->plan(resized, *find_media(resized));
  EXPECT_EQ(plan.unknown, 1u);
  EXPECT_FALSE(plan.skips_encoders());
}

TEST_F(StoreRouteTest, OnlyTheMissingImagesGoToTheEncoders) {
  const json body = chat({image("http://a"), image("http://b"), image("http://c")});
  const auto media = *find_media(body);
  route_->learn(body, media, {0, 1, 2}, reports_for(3));
  index_->learn("eh-0");
  index_->learn("eh-2");
  const auto plan = route_->plan(body, media);
  EXPECT_EQ(plan.hits, 2u);
  EXPECT_EQ(plan.misses, 1u);
  EXPECT_EQ(plan.to_encode, std::vector<std::size_t>{1});
  EXPECT_EQ(plan.store_hashes, (std::vector<std::string>{"eh-0", "", "eh-2"}));
  EXPECT_FALSE(plan.skips_encoders());
}

TEST_F(StoreRouteTest, RequestsWithAudioOrVideoAreNotChecked) {
  for (const json& other : {json{{"type", "input_audio"}, {"input_audio", {{"data", "AAAA"}, {"format", "wav"}}}},
                            json{{"type", "video_url"}, {"video_url", {{"url", "http://v"}}}}}) {
    const json body = chat({image("http://a"), other});
    const auto media = *find_media(body);
    route_->learn(body, media, {0, 1}, reports_for(2));
    index_->learn("eh-0");
    index_->learn("eh-1");
    const auto plan = route_->plan(body, media);
    EXPECT_FALSE(plan.checked);
    EXPECT_EQ(plan.to_encode, (std::vector<std::size_t>{0, 1}));
    EXPECT_FALSE(plan.skips_encoders());
  }
  EXPECT_EQ(route_->learned().size(), 1u) << "only images are learned (the image's key is the same both times)";
  EXPECT_EQ(index_->counters().lookups, 0u);
  const auto empty = route_->plan(chat({}), {});
  EXPECT_FALSE(empty.skips_encoders());
}

TEST(ConsumerBody, StoreItemsStayRawWithTheirUuidAndAreBoundAsStoreItems) {
  json body = chat({image("http://a"), image("http://b")});
  body["ec_transfer_params"] = {{"client_field", 7}};
  const auto media = *find_media(body);
  std::vector<ItemReport> reports(2);
  reports[0] = store_item_report("eh-a");
  reports[1].engine_hash = "eh-b";
  reports[1].metadata = {{"image_grid_thw", {{1, 4, 4}}}};
  reports[1].handle = {{"producer", "e0"}};
  ConsumerBodyStats stats;
  const json out = build_consumer_body(body, media, reports, {"t0", "t1"}, true, &stats);
  const json& parts = out["messages"][0]["content"];
  EXPECT_EQ(parts[0],
            (json{{"type", "image_url"}, {"image_url", {{"url", "http://a"}}}, {"uuid", media[0].content_id}}));
  EXPECT_EQ(parts[1]["type"], "image_embeds");
  const json& params = out["ec_transfer_params"];
  EXPECT_EQ(params["ec_items"],
            json::parse(R"([{"mm_hash":"eh-a","store":true},{"mm_hash":"eh-b","transfer_id":"t1"}])"));
  EXPECT_EQ(params["client_field"], 7);
  EXPECT_EQ(params["eh-b"], (json{{"producer", "e0"}}));
  EXPECT_FALSE(params.contains("eh-a"));
  EXPECT_EQ(stats.rewritten, 1u);
  EXPECT_EQ(stats.raw, 0u);
  EXPECT_EQ(stats.from_store, 1u);

  // Every item from the store, no consumer address: no transfer ids at all.
  const json all = build_consumer_body(body, media, {store_item_report("eh-a"), store_item_report("eh-b")}, {}, true);
  EXPECT_EQ(all["ec_transfer_params"]["ec_items"],
            json::parse(R"([{"mm_hash":"eh-a","store":true},{"mm_hash":"eh-b","store":true}])"));
  EXPECT_EQ(all["messages"][0]["content"][1]["uuid"], media[1].content_id);
}

TEST(GroupItems, OnlyTheNamedItems) {
  const json body = chat({image("http://a"),
                          image("http://b"),
                          image("http://c"),
                          {{"type", "input_audio"}, {"input_audio", {{"data", "AAAA"}, {"format", "wav"}}}}});
  const auto media = *find_media(body);
  using Groups = std::vector<std::vector<std::size_t>>;
  EXPECT_EQ(group_items(media, {0, 2, 3}, 0), (Groups{{3}, {0, 2}}));
  EXPECT_EQ(group_items(media, {1}, 0), (Groups{{1}}));
  EXPECT_EQ(group_items(media, {2, 3}, 1), (Groups{{2}, {3}}));
  EXPECT_TRUE(group_items(media, {}, 2).empty());
}

ProxyOptions with_store() {
  ProxyOptions options;
  options.store_url = "redis://127.0.0.1:6379/0";
  options.store_model = "Qwen/Qwen2.5-VL-7B-Instruct@main";
  return options;
}

TEST(StoreOptions, ErrorsNameTheFlagAndTheAcceptedForm) {
  EXPECT_TRUE(validate(with_store()));
  EXPECT_TRUE(validate(ProxyOptions{})) << "off by default";

  auto options = with_store();
  options.store_model.clear();
  auto s = validate(options);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument);
  EXPECT_EQ(s.message(),
            "--store-model is required with --store-url: the model identity the encoders file entries under (their "
            "store_model)");

  options = {};
  options.store_model = "m";
  EXPECT_NE(validate(options).message().find("--store-model is set without --store-url"), std::string::npos);

  for (const auto* url : {"http://127.0.0.1:6379", "redis://", "redis://host:99999", "mooncake://host"}) {
    options = with_store();
    options.store_url = url;
    s = validate(options);
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << url;
    EXPECT_TRUE(s.message().starts_with("--store-url: ")) << s.message();
    EXPECT_NE(s.message().find("expected "), std::string::npos) << s.message();
    EXPECT_EQ(s.message().find("ec_connector_extra_config"), std::string::npos) << s.message();
  }

  options = with_store();
  options.store_prefix = "a:b";
  s = validate(options);
  EXPECT_TRUE(s.message().starts_with("--store-prefix / --store-model: ")) << s.message();

  options = with_store();
  options.store_ttl = Duration::zero();
  EXPECT_TRUE(validate(options).message().starts_with("--store-ttl"));
  options = with_store();
  options.store_io_timeout = Duration::zero();
  EXPECT_TRUE(validate(options).message().starts_with("--store-io-timeout"));
  options = with_store();
  options.store_presence_max = 0;
  EXPECT_TRUE(validate(options).message().starts_with("--store-presence-max"));
  options = with_store();
  options.store_learned_max = 0;
  EXPECT_TRUE(validate(options).message().starts_with("--store-learned-max"));
}

TEST(StoreOptions, TheConfigTheEncodersUse) {
  auto options = with_store();
  options.store_prefix = "tenant1";
  options.store_ttl = std::chrono::seconds(90);
  options.store_io_timeout = std::chrono::milliseconds(250);
  options.store_presence_max = 1234;
  const Config config = store_config(options);
  EXPECT_EQ(config.store_url, options.store_url);
  EXPECT_EQ(config.store_prefix, "tenant1");
  EXPECT_EQ(config.store_model, options.store_model);
  EXPECT_DOUBLE_EQ(config.store_ttl_s, 90);
  EXPECT_DOUBLE_EQ(config.store_io_timeout_s, 0.25);
  EXPECT_EQ(config.store_presence_max, 1234u);
}

}  // namespace
}  // namespace ecx::proxy
