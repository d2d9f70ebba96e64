#include <random>

#include <gtest/gtest.h>

#include "ecx/wire/codec.h"
#include "malformed_corpus.h"
#include "wire_test_util.h"

namespace ecx::wire {
namespace {

TEST(WireMalformed, EveryCorpusFrameIsRefusedWithItsReason) {
  for (const auto& bad : testing::malformed_corpus()) {
    Envelope envelope;
    auto decoded = decode_request(bad.bytes, Limits{}, &envelope);
    EXPECT_FALSE(decoded.is_ok()) << bad.name;
    EXPECT_EQ(decoded.status().code(), StatusCode::protocol) << bad.name;
    EXPECT_EQ(envelope.reason, bad.reason) << bad.name << ": " << decoded.status().message();
    EXPECT_EQ(envelope.id, bad.echo_id) << bad.name;
    // The other decoders see the same bytes without trouble.
    EXPECT_FALSE(decode_event(bad.bytes, Limits{}).is_ok()) << bad.name;
    (void)decode_reply(bad.bytes, Limits{});
  }
}

TEST(WireMalformed, VersionMismatchNamesBothVersions) {
  for (const auto& bad : testing::malformed_corpus()) {
    if (bad.name != "wrong_version") continue;
    auto decoded = decode_request(bad.bytes, Limits{});
    EXPECT_NE(decoded.status().message().find("version 99"), std::string::npos) << decoded.status().message();
    EXPECT_NE(decoded.status().message().find("1..1"), std::string::npos) << decoded.status().message();
  }
}

TEST(WireMalformed, EveryTruncationOfEveryMessageIsRefused) {
  ReserveBatchRequest batch;
  batch.items.push_back(testing::item("t-1"));
  batch.items.push_back(testing::item("t-2", "h-2", {3, 5, 7}));
  std::vector<std::string> frames(3);
  const AuthStamp stamp{1, 2, 3};
  encode_request(Request{1, 100, batch}, &stamp, frames[0]);
  encode_request(Request{2, 0, CancelRequest{"t-1", ReservationId(1, 2), true, false}}, nullptr, frames[1]);
  Event e;
  e.transfer_id = "t";
  e.mm_hash = "h";
  e.reservation_id = ReservationId(1, 1);
  e.spec = testing::spec({2, 2});
  encode_event(e, &stamp, frames[2]);
  for (const std::string& frame : frames) {
    for (std::size_t n = 0; n < frame.size(); ++n) {
      const std::string cut = frame.substr(0, n);
      EXPECT_FALSE(decode_request(cut, Limits{}).is_ok()) << n;
      EXPECT_FALSE(decode_event(cut, Limits{}).is_ok()) << n;
      EXPECT_FALSE(decode_reply(cut, Limits{}).is_ok()) << n;
    }
  }
}

// Random byte flips over valid frames: whatever comes out, it is a value, never a
// crash or an exception (ASan/UBSan builds check the memory side).
TEST(WireMalformed, RandomMutationsNeverEscapeTheDecoder) {
  std::mt19937_64 rng(20240611);
  ReserveBatchRequest batch;
  for (int i = 0; i < 4; ++i) batch.items.push_back(testing::item("t-" + std::to_string(i)));
  std::string request;
  encode_request(Request{5, 0, batch}, nullptr, request);
  Reply reply;
  reply.id = 5;
  reply.op = Op::reserve_batch;
  reply.body = ReserveBatchReply{{ReserveResult::reserved(ReservationId(1, 2), 1, 64), ReserveResult::retry(5)}};
  std::string answer;
  encode_reply(reply, nullptr, answer);
  std::size_t accepted = 0;
  for (int round = 0; round < 20000; ++round) {
    std::string frame = (round % 2) ? request : answer;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) frame[rng() % frame.size()] = static_cast<char>(rng() & 0xff);
    auto a = decode_request(frame, Limits{});
    auto b = decode_reply(frame, Limits{});
    auto c = decode_event(frame, Limits{});
    accepted += a.is_ok() + b.is_ok() + c.is_ok();
  }
  // Some mutations hit values only (a changed id, a changed letter) and still decode.
  EXPECT_GT(accepted, 0u);
}

}  // namespace
}  // namespace ecx::wire
