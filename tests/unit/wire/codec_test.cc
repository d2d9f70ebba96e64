#include <gtest/gtest.h>

#include "ecx/wire/codec.h"
#include "wire_test_util.h"

namespace ecx::wire {
namespace {

using testing::cancel_batch_frame;
using testing::item;
using testing::RawMap;
using testing::spec;

Request round_trip(const Request& request, const AuthStamp* stamp = nullptr, Envelope* envelope = nullptr) {
  std::string frame;
  encode_request(request, stamp, frame);
  auto decoded = decode_request(frame, Limits{}, envelope);
  EXPECT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  EXPECT_TRUE(decoded->item_errors.empty());
  return decoded->request;
}

Reply round_trip(const Reply& reply) {
  std::string frame;
  encode_reply(reply, nullptr, frame);
  auto decoded = decode_reply(frame, Limits{});
  EXPECT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  return *decoded;
}

TEST(WireCodec, HelloRoundTrip) {
  Request request{7, 250, HelloRequest{"producer-0"}};
  const Request back = round_trip(request);
  EXPECT_EQ(back.id, 7u);
  EXPECT_EQ(back.timeout_ms, 250u);
  EXPECT_EQ(std::get<HelloRequest>(back.body).client, "producer-0");

  HelloReply hello;
  hello.shard = 1;
  hello.tp_size = 2;
  hello.control_ports = {14579, 14580};
  hello.event_port = 40001;
  hello.instance = "abc";
  hello.features = {"am", "checksum"};
  hello.data = DataPlane{"ucx", std::string("\x00\x01\xff", 3), "segment-a", 0x7f0000001000};
  hello.pool_bytes = 1'000'000'000;
  hello.max_tensor_bytes = 64 << 20;
  Reply reply;
  reply.id = 7;
  reply.op = Op::hello;
  reply.body = hello;
  const Reply got = round_trip(reply);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got.op, Op::hello);
  EXPECT_EQ(std::get<HelloReply>(got.body), hello);
}

TEST(WireCodec, ReserveBatchRoundTripKeepsEveryOutcome) {
  ReserveBatchRequest batch;
  batch.items.push_back(item("t-1"));
  batch.items.push_back(item("t-2", "hash-2", {1300, 3584}));
  batch.items.back().checksum = 0xdeadbeefcafef00dULL;
  const Request back = round_trip(Request{9, 0, batch});
  EXPECT_EQ(std::get<ReserveBatchRequest>(back.body), batch);

  ReserveBatchReply answer;
  answer.items = {ReserveResult::reserved(ReservationId(1, 2), 3, 4096),
                  ReserveResult::reserved(ReservationId(5, 6), 7, 8192, false, 65536),
                  ReserveResult::ready(ReservationId(8, 9), true),
                  ReserveResult::cancelled(),
                  ReserveResult::retry(25),
                  ReserveResult::failed(conflict("conflicting reservation"))};
  Reply reply;
  reply.id = 9;
  reply.op = Op::reserve_batch;
  reply.body = answer;
  const Reply got = round_trip(reply);
  EXPECT_EQ(std::get<ReserveBatchReply>(got.body), answer);
}

TEST(WireCodec, CancelStatusCompleteRoundTrip) {
  CancelRequest cancel{"t-1", ReservationId(3, 4), true, true};
  EXPECT_EQ(std::get<CancelRequest>(round_trip(Request{1, 0, cancel}).body), cancel);
  CancelRequest any{"t-2", {}, false, false};
  EXPECT_EQ(std::get<CancelRequest>(round_trip(Request{2, 0, any}).body), any);

  StatusRequest status{"t-3"};
  EXPECT_EQ(std::get<StatusRequest>(round_trip(Request{3, 0, status}).body), status);
  CompleteRequest complete{"t-4", ReservationId(5, 6), 11};
  EXPECT_EQ(std::get<CompleteRequest>(round_trip(Request{4, 0, complete}).body), complete);

  Reply reply;
  reply.id = 1;
  reply.op = Op::cancel;
  reply.body = CancelReply{true};
  EXPECT_TRUE(std::get<CancelReply>(round_trip(reply).body).cancelled);

  StatusReply found{true, "writing", "hash-1", ReservationId(1, 1), 2, spec({4, 4})};
  reply.op = Op::status;
  reply.body = found;
  EXPECT_EQ(std::get<StatusReply>(round_trip(reply).body), found);
  reply.body = StatusReply{};
  EXPECT_FALSE(std::get<StatusReply>(round_trip(reply).body).found);

  reply.op = Op::complete;
  reply.body = CompleteReply{true, false};
  EXPECT_EQ(std::get<CompleteReply>(round_trip(reply).body), (CompleteReply{true, false}));
}

TEST(WireCodec, CancelBatchRoundTrip) {
  CancelBatchRequest batch;
  batch.items = {CancelRequest{"t-1", ReservationId(3, 4), true, true}, CancelRequest{"t-2", {}, false, false}};
  const Request back = round_trip(Request{7, 0, batch});
  EXPECT_EQ(back.op(), Op::cancel_batch);
  EXPECT_EQ(std::get<CancelBatchRequest>(back.body), batch);

  CancelBatchReply answer;
  answer.items = {CancelResult{true, {}}, CancelResult{false, {}},
                  CancelResult{false, invalid_argument("items[2].transfer_id is not a valid id")}};
  Reply reply;
  reply.id = 7;
  reply.op = Op::cancel_batch;
  reply.body = answer;
  EXPECT_EQ(std::get<CancelBatchReply>(round_trip(reply).body), answer);
}

TEST(WireCodec, ACancelBatchItemThatDoesNotDecodeFailsThatItemOnly) {
  const std::string frame = cancel_batch_frame(3, {std::string("a"), 17, std::string("c")});  // 17: not a string

  auto decoded = decode_request(frame, Limits{});
  ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  const auto& batch = std::get<CancelBatchRequest>(decoded->request.body);
  ASSERT_EQ(batch.items.size(), 2u);
  EXPECT_EQ(batch.items[0].transfer_id, "a");
  EXPECT_EQ(batch.items[1].transfer_id, "c");
  ASSERT_EQ(decoded->item_errors.size(), 1u);
  EXPECT_EQ(decoded->item_errors[0].index, 1u);
  EXPECT_EQ(decoded->item_errors[0].error.code(), StatusCode::invalid_argument);
  EXPECT_NE(decoded->item_errors[0].error.message().find("items[1].transfer_id"), std::string::npos)
      << decoded->item_errors[0].error.message();
}

TEST(WireCodec, ErrorReplyCarriesCodeReasonAndVersions) {
  Reply reply;
  reply.id = 5;
  reply.op = Op::cancel;
  reply.status = not_found("no such transfer");
  Reply got = round_trip(reply);
  EXPECT_FALSE(got.ok());
  EXPECT_EQ(got.status, not_found("no such transfer"));
  EXPECT_EQ(got.reason, RejectReason::none);

  got = round_trip(make_reject_reply(6, RejectReason::version_mismatch, "speak 1"));
  EXPECT_EQ(got.id, 6u);
  EXPECT_EQ(got.status.code(), StatusCode::protocol);
  EXPECT_EQ(got.reason, RejectReason::version_mismatch);
  EXPECT_EQ(got.peer_min_version, kMinProtocolVersion);
  EXPECT_EQ(got.peer_max_version, kProtocolVersion);
}

TEST(WireCodec, EventsRoundTrip) {
  Event ready;
  ready.kind = EventKind::ready;
  ready.shard = 1;
  ready.instance = "i-1";
  ready.transfer_id = "t-1";
  ready.mm_hash = "hash-1";
  ready.reservation_id = ReservationId(1, 2);
  ready.generation = 3;
  ready.spec = spec({2, 8}, DType::float16);
  ready.sent_ns = 123'456'789'012;  // optional: absent (0) in the other events
  Event abandoned;
  abandoned.kind = EventKind::abandoned;
  abandoned.transfer_id = "t-2";
  abandoned.instance = "i-1";
  Event failed;
  failed.kind = EventKind::failed;
  failed.transfer_id = "t-3";
  failed.mm_hash = "hash-3";
  failed.instance = "i-1";
  failed.reservation_id = ReservationId(4, 5);
  failed.error = protocol_error("checksum mismatch");
  for (const Event& e : {ready, abandoned, failed}) {
    std::string frame;
    encode_event(e, nullptr, frame);
    auto back = decode_event(frame, Limits{});
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(*back, e);
  }
}

TEST(WireCodec, StampTravelsInTheEnvelope) {
  const AuthStamp stamp{42, 7, 1'700'000'000'000};
  Envelope envelope;
  round_trip(Request{1, 0, StatusRequest{"t"}}, &stamp, &envelope);
  ASSERT_TRUE(envelope.stamp.has_value());
  EXPECT_EQ(*envelope.stamp, stamp);
  envelope = {};
  round_trip(Request{1, 0, StatusRequest{"t"}}, nullptr, &envelope);
  EXPECT_FALSE(envelope.stamp.has_value());
}

TEST(WireCodec, OneBadItemDoesNotFailTheOthers) {
  // Item 1 has a bad id, item 2 a size that does not match its shape, item 3 a
  // string where a number belongs; items 0 and 4 are good.
  RawMap top(4);
  top.kv("v", 1).kv("id", 3).kv("op", std::string("reserve_batch"));
  auto& pk = top.packer();
  pk.pack(std::string("body"));
  pk.pack_map(1);
  pk.pack(std::string("items"));
  pk.pack_array(5);
  auto good = [&](const std::string& id) {
    pk.pack_map(5);
    pk.pack(std::string("transfer_id"));
    pk.pack(id);
    pk.pack(std::string("mm_hash"));
    pk.pack(std::string("h"));
    pk.pack(std::string("nbytes"));
    pk.pack(32);
    pk.pack(std::string("shape"));
    pk.pack(std::vector<int>{4, 4});
    pk.pack(std::string("dtype"));
    pk.pack(std::string("bfloat16"));
  };
  good("a");
  good("bad id with spaces");
  pk.pack_map(5);
  pk.pack(std::string("transfer_id"));
  pk.pack(std::string("c"));
  pk.pack(std::string("mm_hash"));
  pk.pack(std::string("h"));
  pk.pack(std::string("nbytes"));
  pk.pack(33);
  pk.pack(std::string("shape"));
  pk.pack(std::vector<int>{4, 4});
  pk.pack(std::string("dtype"));
  pk.pack(std::string("bfloat16"));
  pk.pack_map(1);
  pk.pack(std::string("transfer_id"));
  pk.pack(17);
  good("e");

  auto decoded = decode_request(top.str(), Limits{});
  ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  const auto& batch = std::get<ReserveBatchRequest>(decoded->request.body);
  ASSERT_EQ(batch.items.size(), 2u);
  EXPECT_EQ(batch.items[0].transfer_id, "a");
  EXPECT_EQ(batch.items[1].transfer_id, "e");
  ASSERT_EQ(decoded->item_errors.size(), 3u);
  EXPECT_EQ(decoded->item_errors[0].index, 1u);
  EXPECT_EQ(decoded->item_errors[1].index, 2u);
  EXPECT_NE(decoded->item_errors[1].error.message().find("does not match"), std::string::npos);
  EXPECT_EQ(decoded->item_errors[2].index, 3u);
  EXPECT_EQ(decoded->item_errors[2].error.code(), StatusCode::invalid_argument);
}

TEST(WireCodec, UnknownKeysAreIgnoredForForwardCompatibility) {
  RawMap top(6);
  top.kv("v", 1).kv("id", 3).kv("op", std::string("status")).kv("future_field", std::string("x"));
  top.packer().pack(std::string("body"));
  top.packer().pack_map(2);
  top.packer().pack(std::string("transfer_id"));
  top.packer().pack(std::string("t-9"));
  top.packer().pack(std::string("priority"));
  top.packer().pack(3);
  top.kv("another", std::vector<int>{1, 2});
  auto decoded = decode_request(top.str(), Limits{});
  ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  EXPECT_EQ(std::get<StatusRequest>(decoded->request.body).transfer_id, "t-9");
}

TEST(WireCodec, BatchAndShapeLimits) {
  ReserveBatchRequest batch;
  for (int i = 0; i < 4097; ++i) batch.items.push_back(item("t-" + std::to_string(i)));
  std::string frame;
  encode_request(Request{1, 0, batch}, nullptr, frame);
  Limits roomy;
  roomy.max_frame_bytes = 8 << 20;
  Envelope envelope;
  auto decoded = decode_request(frame, roomy, &envelope);
  ASSERT_FALSE(decoded.is_ok());
  EXPECT_EQ(envelope.reason, RejectReason::malformed);
  EXPECT_EQ(envelope.id, 0u) << "the array limit trips while parsing, before the id is read";

  batch.items.pop_back();
  encode_request(Request{1, 0, batch}, nullptr, frame);
  EXPECT_TRUE(decode_request(frame, roomy).is_ok());
  Limits small;
  small.max_frame_bytes = frame.size() - 1;
  decoded = decode_request(frame, small, &envelope);
  EXPECT_FALSE(decoded.is_ok());
  EXPECT_EQ(envelope.reason, RejectReason::too_large);
}

TEST(WireCodec, RankAboveEightIsAnItemError) {
  RawMap top(4);
  top.kv("v", 1).kv("id", 3).kv("op", std::string("reserve_batch"));
  auto& pk = top.packer();
  pk.pack(std::string("body"));
  pk.pack_map(1);
  pk.pack(std::string("items"));
  pk.pack_array(1);
  pk.pack_map(5);
  pk.pack(std::string("transfer_id"));
  pk.pack(std::string("t"));
  pk.pack(std::string("mm_hash"));
  pk.pack(std::string("h"));
  pk.pack(std::string("nbytes"));
  pk.pack(1024);
  pk.pack(std::string("shape"));
  pk.pack(std::vector<int>(9, 2));
  pk.pack(std::string("dtype"));
  pk.pack(std::string("bfloat16"));
  auto decoded = decode_request(top.str(), Limits{});
  ASSERT_TRUE(decoded.is_ok());
  ASSERT_EQ(decoded->item_errors.size(), 1u);
  EXPECT_NE(decoded->item_errors[0].error.message().find("maximum is 8"), std::string::npos)
      << decoded->item_errors[0].error.message();
}

}  // namespace
}  // namespace ecx::wire
