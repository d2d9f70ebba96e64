#include "ecx/wire/payload_header.h"

#include <gtest/gtest.h>

#include <cstring>

namespace ecx::wire {
namespace {

TensorSpec rows(std::int64_t n) { return TensorSpec::make({n, 64}, DType::bfloat16, 1ULL << 40).value(); }

PayloadHeader reserved() { return PayloadHeader{"t-1", ReservationId(7, 9), 3, rows(4).nbytes(), 0xabcdefULL}; }

PayloadHeader direct() {
  PayloadHeader h{"t-2", ReservationId(), 0, rows(5).nbytes(), std::nullopt};
  h.direct = DirectItem{"img-5", rows(5)};
  return h;
}

TEST(PayloadHeader, ReservedAndDirectRoundTrip) {
  for (const PayloadHeader& h : {reserved(), direct()}) {
    auto decoded = decode_payload_header(encode_payload_header(h));
    ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
    EXPECT_EQ(*decoded, h);
  }
  PayloadHeader checked = direct();
  checked.checksum = 42;
  EXPECT_EQ(decode_payload_header(encode_payload_header(checked)).value(), checked);
}

TEST(PayloadHeader, AReservedHeaderKeepsItsFixedSize) {
  EXPECT_EQ(encode_payload_header(reserved()).size(), kPayloadHeaderFixedBytes + 3);
}

void expect_protocol_error(std::vector<std::byte> bytes, std::string_view says) {
  auto decoded = decode_payload_header(bytes);
  ASSERT_FALSE(decoded.is_ok());
  EXPECT_EQ(decoded.status().code(), StatusCode::protocol);
  EXPECT_NE(decoded.status().message().find(says), std::string::npos) << decoded.status().message();
}

TEST(PayloadHeader, MalformedDirectItemsAreProtocolErrors) {
  const auto good = encode_payload_header(direct());
  const std::size_t item = kPayloadHeaderFixedBytes + 3;  // after "t-2"
  const std::size_t dtype_at = item + 2 + 5;              // after the u16 length and "img-5"

  auto truncated = good;
  truncated.resize(truncated.size() - 3);
  expect_protocol_error(truncated, "does not fill");
  auto cut_in_hash = good;
  cut_in_hash.resize(item + 3);
  expect_protocol_error(cut_in_hash, "truncated");

  auto bad_dtype = good;
  bad_dtype[dtype_at] = std::byte{0xee};
  expect_protocol_error(bad_dtype, "unknown dtype");

  auto bigger = good;  // the spec says 6 rows, the payload 5
  bigger[dtype_at + 2] = std::byte{6};
  expect_protocol_error(bigger, "direct item");

  auto named = encode_payload_header(direct());
  named[8] = std::byte{1};  // a reservation id
  expect_protocol_error(named, "names a reservation");

  auto bad_hash = good;
  bad_hash[item + 2] = std::byte{0};  // a NUL in the mm_hash
  expect_protocol_error(bad_hash, "mm_hash");
}

TEST(PayloadHeader, UnknownFlagsAreRefused) {
  auto bytes = encode_payload_header(reserved());
  bytes[5] = std::byte{0x04};
  expect_protocol_error(bytes, "unknown flags");
}

}  // namespace
}  // namespace ecx::wire
