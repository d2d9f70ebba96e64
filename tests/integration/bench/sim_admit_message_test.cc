// The simulators' admit channel (tools/sim/admit_message.h): what a producer forwards
// reaches the consumer whole, and a message that is not one of them is refused with a
// reason instead of being half read.
#include <string>
#include <variant>

#include <gtest/gtest.h>

#include "sim/admit_message.h"

namespace ecx::sim {
namespace {

Item item(std::string mm_hash, std::string transfer_id, const std::vector<std::int64_t>& shape, DType dtype) {
  auto spec = TensorSpec::make(shape, dtype, ~0ULL);
  EXPECT_TRUE(spec);
  return Item{std::move(mm_hash), std::move(transfer_id), *spec};
}

// What a producer writes for `request`.
std::string encode(const AdmitRequest& request) {
  return encode_admit(AdmitRequestView{request.request_id, request.encoded_at_ns, request.wants_answer, request.items,
                                       request.ec_transfer_params});
}

TEST(SimAdmitMessage, ARequestArrivesWhole) {
  AdmitRequest sent{"req-1",
                    -42,
                    true,
                    {item("h-a", "t-1", {16, 64}, DType::float16), item("h-b", "", {3, 5, 7}, DType::bfloat16)},
                    R"({"ec_items":[{"mm_hash":"h-a","transfer_id":"t-1"}]})"};
  auto decoded = decode_admit(encode(sent));
  ASSERT_TRUE(decoded) << decoded.status().to_string();
  const auto* got = std::get_if<AdmitRequest>(&*decoded);
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->request_id, "req-1");
  EXPECT_EQ(got->encoded_at_ns, -42);
  EXPECT_TRUE(got->wants_answer);
  ASSERT_EQ(got->items.size(), 2u);
  EXPECT_EQ(got->items[0].mm_hash, "h-a");
  EXPECT_EQ(got->items[0].transfer_id, "t-1");
  EXPECT_EQ(got->items[0].spec.shape_vector(), (std::vector<std::int64_t>{16, 64}));
  EXPECT_EQ(got->items[0].spec.dtype(), DType::float16);
  EXPECT_EQ(got->items[1].transfer_id, "");  // an item the proxy found in the store
  EXPECT_EQ(got->items[1].spec.shape_vector(), (std::vector<std::int64_t>{3, 5, 7}));
  EXPECT_EQ(got->items[1].spec.dtype(), DType::bfloat16);
  EXPECT_EQ(got->ec_transfer_params, sent.ec_transfer_params);

  sent.encoded_at_ns.reset();
  sent.wants_answer = false;
  decoded = decode_admit(encode(sent));
  ASSERT_TRUE(decoded);
  EXPECT_FALSE(std::get<AdmitRequest>(*decoded).encoded_at_ns.has_value());
  EXPECT_FALSE(std::get<AdmitRequest>(*decoded).wants_answer);
}

// Messages are unpacked into memory each thread reuses: one larger than its first
// chunk, and the ones after it, still arrive whole, each with nothing of the last.
TEST(SimAdmitMessage, MessagesOneAfterAnotherEachArriveWhole) {
  for (const std::size_t params_bytes : {std::size_t{10}, std::size_t{64} * 1024, std::size_t{3}, std::size_t{20000}}) {
    const std::string params(params_bytes, 'p');
    const std::string id = "req-" + std::to_string(params_bytes);
    auto decoded = decode_admit(encode(AdmitRequest{id, 1, false, {item("h", "t", {2, 2}, DType::float32)}, params}));
    ASSERT_TRUE(decoded) << params_bytes << ": " << decoded.status().to_string();
    const auto& got = std::get<AdmitRequest>(*decoded);
    EXPECT_EQ(got.request_id, id);
    EXPECT_EQ(got.ec_transfer_params, params);
    ASSERT_EQ(got.items.size(), 1u);
    EXPECT_EQ(got.items[0].mm_hash, "h");
    auto answer = decode_answer(encode_answer(AdmitAnswer{id, params_bytes % 2 == 0}));
    ASSERT_TRUE(answer);
    EXPECT_EQ(answer->request_id, id);
    EXPECT_EQ(answer->ready, params_bytes % 2 == 0);
  }
}

TEST(SimAdmitMessage, DoneAndAnswersArriveWhole) {
  auto done = decode_admit(encode_admit(AdmitDone{1234}));
  ASSERT_TRUE(done);
  ASSERT_TRUE(std::holds_alternative<AdmitDone>(*done));
  EXPECT_EQ(std::get<AdmitDone>(*done).requests, 1234u);

  auto answer = decode_answer(encode_answer(AdmitAnswer{"req-9", true}));
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->request_id, "req-9");
  EXPECT_TRUE(answer->ready);
  EXPECT_FALSE(decode_answer(encode_answer(AdmitAnswer{"req-9", false}))->ready);
}

TEST(SimAdmitMessage, WhatIsNotAnAdmitMessageIsRefusedWithAReason) {
  const auto json_text = decode_admit(R"({"request_id": "r"})");
  ASSERT_FALSE(json_text);
  EXPECT_NE(json_text.status().message().find("admit message"), std::string::npos) << json_text.status().to_string();
  EXPECT_FALSE(decode_admit(""));
  // An answer is not an admit message, nor the reverse.
  EXPECT_FALSE(decode_admit(encode_answer(AdmitAnswer{"r", true})));
  EXPECT_FALSE(decode_answer(encode_admit(AdmitDone{1})));
  // A request cut short is refused, not read in part.
  const std::string whole = encode(AdmitRequest{"r", 1, false, {item("h", "t", {4, 4}, DType::float32)}, "{}"});
  for (std::size_t cut = 1; cut < whole.size(); ++cut) {
    EXPECT_FALSE(decode_admit(whole.substr(0, cut))) << "cut at " << cut;
  }
}

}  // namespace
}  // namespace ecx::sim
