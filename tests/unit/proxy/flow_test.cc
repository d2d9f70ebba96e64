#include "proxy/flow_json.h"

#include <set>

#include <gtest/gtest.h>

namespace ecx::proxy {
namespace {

using nlohmann::json;

json image(const std::string& url) { return {{"type", "image_url"}, {"image_url", {{"url", url}}}}; }

// Two user turns: text + image A + audio, then image B + image A again + video.
json chat_body() {
  return json{
      {"model", "m"},
      {"stream", true},
      {"mm_processor_kwargs", {{"max_pixels", 1024}}},
      {"messages",
       json::array({
           {{"role", "system"}, {"content", "be brief"}},
           {{"role", "user"},
            {"content",
             json::array({{{"type", "text"}, {"text", "look"}},
                          image("http://img/a.png"),
                          {{"type", "input_audio"}, {"input_audio", {{"data", "AAAA"}, {"format", "wav"}}}}})}},
           {{"role", "user"},
            {"content", json::array({image("http://img/b.png"),
                                     image("http://img/a.png"),
                                     {{"type", "video_url"}, {"video_url", {{"url", "http://vid/c.mp4"}}}}})}},
       })},
  };
}

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(ContentId, FromUrlElseCanonicalJsonElseClientUuid) {
  EXPECT_EQ(content_id(image("http://img/a.png")), sha256_hex("http://img/a.png"));
  EXPECT_EQ(content_id(json{{"type", "image_url"}, {"image_url", "http://img/a.png"}}), sha256_hex("http://img/a.png"));
  const json a = json::parse(R"({"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}})");
  const json b = json::parse(R"({"input_audio":{"format":"wav","data":"AAAA"},"type":"input_audio"})");
  EXPECT_EQ(content_id(a), content_id(b));
  EXPECT_EQ(content_id(a), sha256_hex(R"({"input_audio":{"data":"AAAA","format":"wav"},"type":"input_audio"})"));
  json with_uuid = image("http://img/a.png");
  with_uuid["uuid"] = "client-key";
  EXPECT_EQ(content_id(with_uuid), "client-key");
}

TEST(FindMedia, EveryKindInOrderWithContentIds) {
  auto media = find_media(chat_body());
  ASSERT_TRUE(media);
  ASSERT_EQ(media->size(), 5u);
  EXPECT_EQ((*media)[0].message, 1u);
  EXPECT_EQ((*media)[0].part, 1u);
  EXPECT_EQ((*media)[0].modality, Modality::image);
  EXPECT_EQ((*media)[1].modality, Modality::audio);
  EXPECT_EQ((*media)[2].message, 2u);
  EXPECT_EQ((*media)[2].part, 0u);
  EXPECT_EQ((*media)[4].modality, Modality::video);
  // A repeated image shares its content id.
  EXPECT_EQ((*media)[0].content_id, (*media)[3].content_id);
  EXPECT_NE((*media)[0].content_id, (*media)[2].content_id);

  EXPECT_TRUE(find_media(json{{"prompt", "x"}})->empty());
  EXPECT_FALSE(find_media(json{{"messages", "x"}}));
  EXPECT_FALSE(find_media(json{{"messages", json::array({1})}}));
}

TEST(GroupItems, ImagesBatchedOtherModalitiesAlone) {
  const auto media = *find_media(chat_body());  // image, audio, image, image, video
  using Groups = std::vector<std::vector<std::size_t>>;
  EXPECT_EQ(group_items(media, 1), (Groups{{0}, {1}, {2}, {3}, {4}}));
  EXPECT_EQ(group_items(media, 2), (Groups{{1}, {0, 2}, {4}, {3}}));
  EXPECT_EQ(group_items(media, 0), (Groups{{1}, {4}, {0, 2, 3}}));
}

TEST(EncoderBody, OnlyItsItemsWithTransferIdsAndNoMmHash) {
  const json body = chat_body();
  const auto media = *find_media(body);
  const std::vector<std::string> ids = {"t0", "t1", "t2", "t3", "t4"};
  const json sub = build_encoder_body(body, media, {3}, ids, "tcp://consumer:5", true);
  EXPECT_EQ(sub["model"], "m");
  EXPECT_EQ(sub["stream"], false);
  EXPECT_EQ(sub["max_tokens"], 1);
  EXPECT_EQ(sub["mm_processor_kwargs"], body["mm_processor_kwargs"]);
  ASSERT_EQ(sub["messages"].size(), 1u);
  const auto& content = sub["messages"][0]["content"];
  ASSERT_EQ(content.size(), 1u);
  EXPECT_EQ(content[0]["image_url"]["url"], "http://img/a.png");
  EXPECT_EQ(content[0]["uuid"], media[3].content_id);
  EXPECT_EQ(sub["ec_transfer_params"],
            (json{{"consumer_zmq", "tcp://consumer:5"}, {"ec_items", json::array({{{"transfer_id", "t3"}}})}}));

  const json batch = build_encoder_body(body, media, {0, 2}, ids, "", false);
  EXPECT_FALSE(batch.contains("ec_transfer_params"));
  EXPECT_EQ(batch["messages"][0]["content"].size(), 2u);
  EXPECT_FALSE(batch["messages"][0]["content"][0].contains("uuid"));
  EXPECT_FALSE(batch.contains("stream_options"));
}

std::vector<MediaRef> two_images() {
  return *find_media(
      json{{"messages",
            json::array({{{"role", "user"}, {"content", json::array({image("http://a"), image("http://b")})}}})}});
}

TEST(ItemReports, KeyedSingleEntryBelongsToTheOnlyItem) {
  const auto media = two_images();
  const json response = {
      {"ec_transfer_params", {{"engine-hash-1", {{"metadata", {{"image_grid_thw", {{1, 4, 4}}}}}, {"handle", 7}}}}}};
  auto reports = read_item_reports(response, media, {1}, {"t0", "t1"});
  ASSERT_TRUE(reports) << reports.status().to_string();
  ASSERT_EQ(reports->size(), 1u);
  EXPECT_EQ((*reports)[0].engine_hash, "engine-hash-1");
  EXPECT_EQ((*reports)[0].metadata, (json{{"image_grid_thw", {{1, 4, 4}}}}));
  EXPECT_EQ((*reports)[0].handle["handle"], 7);
}

TEST(ItemReports, ListShapeAndMissingParams) {
  const auto media = two_images();
  const json list = {
      {"ec_transfer_params",
       {{"ec_items", json::array({{{"mm_hash", "h"}, {"image_grid_thw", {{1, 2, 2}}}, {"transfer_id", "t0"}}})}}}};
  auto reports = read_item_reports(list, media, {0}, {"t0", "t1"});
  ASSERT_TRUE(reports);
  EXPECT_EQ((*reports)[0].engine_hash, "h");
  EXPECT_EQ((*reports)[0].metadata, (json{{"image_grid_thw", {{1, 2, 2}}}}));
  EXPECT_TRUE((*reports)[0].handle.is_null());

  auto none = read_item_reports(json{{"id", "x"}}, media, {0}, {});
  ASSERT_TRUE(none);
  EXPECT_TRUE((*none)[0].engine_hash.empty());
  EXPECT_TRUE((*none)[0].metadata.empty());
}

TEST(ItemReports, BatchedByItemIndicesElseByBinding) {
  const auto media = two_images();
  const json by_indices = {{"ec_transfer_params",
                            {{"hb", {{"metadata", {{"f", 2}}}, {"item_indices", {1}}}},
                             {"ha", {{"metadata", {{"f", 1}}}, {"item_indices", {0}}}}}}};
  auto reports = read_item_reports(by_indices, media, {0, 1}, {"t0", "t1"});
  ASSERT_TRUE(reports) << reports.status().to_string();
  EXPECT_EQ((*reports)[0].engine_hash, "ha");
  EXPECT_EQ((*reports)[1].engine_hash, "hb");
  EXPECT_FALSE((*reports)[1].handle.contains("item_indices"));

  const json by_binding = {{"ec_transfer_params",
                            {{"hb", {{"metadata", {{"f", 2}}}}},
                             {"ha", {{"metadata", {{"f", 1}}}}},
                             {"ec_items", json::array({{{"mm_hash", "ha"}, {"transfer_id", "t0"}},
                                                       {{"mm_hash", "hb"}, {"transfer_id", "t1"}}})}}}};
  reports = read_item_reports(by_binding, media, {0, 1}, {"t0", "t1"});
  ASSERT_TRUE(reports) << reports.status().to_string();
  EXPECT_EQ((*reports)[0].engine_hash, "ha");
  EXPECT_EQ((*reports)[1].engine_hash, "hb");
}

TEST(ItemReports, UnusableMetadataIsAProtocolError) {
  const auto media = two_images();
  const std::vector<std::string> ids = {"t0", "t1"};
  const auto code = [&](const json& params, const std::vector<std::size_t>& items) {
    return read_item_reports(json{{"ec_transfer_params", params}}, media, items, ids).status().code();
  };
  EXPECT_EQ(code("nope", {0}), StatusCode::protocol);
  EXPECT_EQ(code(json{{"h", {{"metadata", "x"}}}}, {0}), StatusCode::protocol);
  EXPECT_EQ(code(json{{"h1", {{"metadata", {{"f", 1}}}}}, {"h2", {{"metadata", {{"f", 1}}}}}}, {0}),
            StatusCode::protocol);
  EXPECT_EQ(code(json{{"h", {{"item_indices", {5}}}}}, {0, 1}), StatusCode::protocol);
  EXPECT_EQ(code(json{{"h", {{"item_indices", {0, 0}}}}}, {0, 1}), StatusCode::protocol);
  EXPECT_EQ(code(json{{"ec_items", "x"}}, {0}), StatusCode::protocol);
  EXPECT_EQ(code(json{{"ec_items", json::array({{{"mm_hash", 1}}})}}, {0}), StatusCode::protocol);
  EXPECT_EQ(read_item_reports(json::array(), media, {0}, ids).status().code(), StatusCode::protocol);
}

TEST(ConsumerBody, RewritesWhatHasMetadataBindsEveryOccurrenceAndLeavesTheClientBodyAlone) {
  json body = chat_body();
  body["messages"][1]["content"].erase(2);  // no audio: per-item rewriting
  body["ec_transfer_params"] = {{"client_key", "kept"}};
  const json original = body;
  const auto media = *find_media(body);  // a, b, a, video
  ASSERT_EQ(media.size(), 4u);
  std::vector<ItemReport> reports(4, ItemReport{{}, json::object(), nullptr});
  reports[0] = {"ha1", {{"image_grid_thw", {{1, 2, 2}}}}, {{"metadata", {{"image_grid_thw", {{1, 2, 2}}}}}}};
  reports[1] = {"hb", {{"image_grid_thw", {{1, 4, 4}}}}, nullptr};
  reports[2] = {"ha2", json::object(), nullptr};  // no metadata: forwarded raw
  const std::vector<std::string> ids = {"t0", "t1", "t2", "t3"};
  ConsumerBodyStats stats;
  const json out = build_consumer_body(body, media, reports, ids, true, &stats);
  EXPECT_EQ(body, original);
  EXPECT_EQ(stats.rewritten, 2u);
  EXPECT_EQ(stats.raw, 2u);
  const auto& first = out["messages"][1]["content"][1];
  EXPECT_EQ(first, (json{{"type", "image_embeds"},
                         {"image_embeds", {{"image_grid_thw", {{1, 2, 2}}}}},
                         {"uuid", media[0].content_id}}));
  const auto& raw_repeat = out["messages"][2]["content"][1];
  EXPECT_EQ(raw_repeat["type"], "image_url");
  EXPECT_EQ(raw_repeat["uuid"], media[0].content_id);
  EXPECT_EQ(out["ec_transfer_params"]["client_key"], "kept");
  EXPECT_EQ(out["ec_transfer_params"]["ha1"], reports[0].handle);
  EXPECT_EQ(out["ec_transfer_params"]["ec_items"], json::array({{{"mm_hash", "ha1"}, {"transfer_id", "t0"}},
                                                                {{"mm_hash", "hb"}, {"transfer_id", "t1"}},
                                                                {{"mm_hash", "ha2"}, {"transfer_id", "t2"}},
                                                                {{"transfer_id", "t3"}}}));
  EXPECT_EQ(out["stream"], true);

  const json plain = build_consumer_body(body, media, reports, ids, false);
  EXPECT_EQ(plain["messages"], original["messages"]);  // --no-rewrite: media untouched, no uuid
  EXPECT_TRUE(plain["ec_transfer_params"].contains("ec_items"));
}

TEST(ConsumerBody, AudioKeepsTheWholeRequestRawWhenAnyItemCannotBeRewritten) {
  const json body = chat_body();
  const auto media = *find_media(body);
  std::vector<ItemReport> reports(media.size(), ItemReport{"h", {{"f", 1}}, nullptr});
  reports[4].metadata = json::object();
  ConsumerBodyStats stats;
  const json out = build_consumer_body(body, media, reports, {}, true, &stats);
  EXPECT_EQ(stats.rewritten, 0u);
  EXPECT_EQ(out["messages"][1]["content"][1]["type"], "image_url");
  EXPECT_EQ(out["messages"][1]["content"][1]["uuid"], media[0].content_id);
  reports[4].metadata = {{"f", 1}};
  EXPECT_EQ(build_consumer_body(body, media, reports, {}, true)["messages"][1]["content"][2]["type"], "audio_embeds");
}

TEST(ConsumerBody, NoMediaLeavesTheBodyAsIs) {
  const json body = {{"model", "m"}, {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}};
  EXPECT_EQ(build_consumer_body(body, {}, {}, {}, true), body);
}

TEST(PrefillHop, AsksForARemoteDecodeAndPassesKvParamsOn) {
  json consumer = {{"model", "m"},
                   {"stream", true},
                   {"stream_options", {{"include_usage", true}}},
                   {"max_tokens", 100},
                   {"max_completion_tokens", 100}};
  const json prefill = build_prefill_body(consumer);
  EXPECT_EQ(prefill["stream"], false);
  EXPECT_EQ(prefill["max_tokens"], 1);
  EXPECT_EQ(prefill["max_completion_tokens"], 1);
  EXPECT_FALSE(prefill.contains("stream_options"));
  EXPECT_EQ(prefill["kv_transfer_params"]["do_remote_decode"], true);
  EXPECT_EQ(prefill["kv_transfer_params"]["do_remote_prefill"], false);
  EXPECT_TRUE(prefill["kv_transfer_params"]["remote_engine_id"].is_null());

  const json kv = {{"do_remote_prefill", true}, {"remote_engine_id", "e1"}, {"remote_block_ids", {1, 2}}};
  auto decode = build_decode_body_after_prefill(consumer, json{{"kv_transfer_params", kv}});
  ASSERT_TRUE(decode);
  EXPECT_EQ((*decode)["kv_transfer_params"], kv);
  EXPECT_EQ((*decode)["stream"], true);
  EXPECT_EQ((*decode)["max_tokens"], 100);
  EXPECT_FALSE(build_decode_body_after_prefill(consumer, json{{"id", "x"}}));
}

TEST(RandomHex, LengthAndUniqueness) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const auto id = random_hex(32);
    ASSERT_EQ(id.size(), 32u);
    ASSERT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos);
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 1000u);
  EXPECT_EQ(random_hex(6).size(), 6u);
}

}  // namespace
}  // namespace ecx::proxy
