#pragma once
// Frames a hostile or broken peer could send, each with what the decoder must say.
// Used by the codec tests, the server tests (over a real socket) and to seed the
// fuzzer's corpus.

#include <string>
#include <vector>

#include <msgpack.hpp>

#include "ecx/wire/codec.h"
#include "ecx/wire/protocol.h"

namespace ecx::wire::testing {

struct BadFrame {
  std::string name;
  std::string bytes;
  RejectReason reason;    // what decode_request reports
  std::uint64_t echo_id;  // the id a reply can still echo (0 = unreadable)
};

inline std::string pack_request(std::uint32_t entries,
                                const std::function<void(msgpack::packer<msgpack::sbuffer>&)>& body) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(entries);
  body(pk);
  return std::string(buffer.data(), buffer.size());
}

inline std::vector<BadFrame> malformed_corpus() {
  using P = msgpack::packer<msgpack::sbuffer>;
  std::vector<BadFrame> out;
  std::string valid;
  encode_request(Request{77, 0, StatusRequest{"t-1"}}, nullptr, valid);

  out.push_back({"empty", "", RejectReason::malformed, 0});
  out.push_back({"truncated", valid.substr(0, valid.size() - 3), RejectReason::malformed, 0});
  out.push_back({"trailing_bytes", valid + std::string("\xc0", 1), RejectReason::malformed, 0});
  out.push_back({"not_msgpack", std::string("\xc1\xc1\xc1", 3), RejectReason::malformed, 0});
  out.push_back({"top_level_array", std::string("\x93\x01\x02\x03", 4), RejectReason::malformed, 0});
  out.push_back({"top_level_int", std::string("\x2a", 1), RejectReason::malformed, 0});
  // map32 / array32 / str32 / bin32 declaring ~4 billion entries or bytes.
  out.push_back({"huge_map", std::string("\xdf\xff\xff\xff\xff", 5), RejectReason::malformed, 0});
  out.push_back({"huge_array",
                 std::string("\x81\xa4"
                             "body\xdd\xff\xff\xff\xff",
                             11),
                 RejectReason::malformed, 0});
  out.push_back({"huge_string",
                 std::string("\x81\xa1v\xdb\xff\xff\xff\xff"
                             "abc",
                             11),
                 RejectReason::malformed, 0});
  out.push_back({"huge_binary", std::string("\x81\xa1v\xc6\xff\xff\xff\xff", 8), RejectReason::malformed, 0});
  out.push_back({"extension", std::string("\x81\xa1v\xd4\x01\x02", 6), RejectReason::malformed, 0});
  out.push_back({"deep_nesting", std::string(64, '\x91') + std::string("\x01", 1), RejectReason::malformed, 0});
  out.push_back({"missing_version",
                 pack_request(2,
                              [](P& pk) {
                                pk.pack(std::string("id"));
                                pk.pack(5);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("hello"));
                              }),
                 RejectReason::malformed, 0});
  out.push_back({"version_as_string",
                 pack_request(3,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(std::string("1"));
                                pk.pack(std::string("id"));
                                pk.pack(5);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("hello"));
                              }),
                 RejectReason::malformed, 0});
  out.push_back({"wrong_version",
                 pack_request(3,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(99);
                                pk.pack(std::string("id"));
                                pk.pack(5);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("hello"));
                              }),
                 RejectReason::version_mismatch, 5});
  out.push_back({"version_zero",
                 pack_request(3,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(0);
                                pk.pack(std::string("id"));
                                pk.pack(6);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("hello"));
                              }),
                 RejectReason::version_mismatch, 6});
  out.push_back({"unknown_op",
                 pack_request(3,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(8);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("format_disk"));
                              }),
                 RejectReason::unknown_op, 8});
  out.push_back({"op_as_int",
                 pack_request(3,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(9);
                                pk.pack(std::string("op"));
                                pk.pack(3);
                              }),
                 RejectReason::malformed, 9});
  out.push_back({"id_zero",
                 pack_request(3,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(0);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("hello"));
                              }),
                 RejectReason::malformed, 0});
  out.push_back({"negative_id",
                 pack_request(3,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(-4);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("hello"));
                              }),
                 RejectReason::malformed, 0});
  out.push_back({"duplicate_key",
                 pack_request(4,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(10);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("hello"));
                                pk.pack(std::string("op"));
                                pk.pack(std::string("cancel"));
                              }),
                 RejectReason::malformed, 0});
  out.push_back({"integer_key",
                 pack_request(3,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(11);
                                pk.pack(7);
                                pk.pack(std::string("hello"));
                              }),
                 RejectReason::malformed, 0});
  out.push_back({"body_not_a_map",
                 pack_request(4,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(12);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("cancel"));
                                pk.pack(std::string("body"));
                                pk.pack(std::vector<int>{1});
                              }),
                 RejectReason::malformed, 12});
  out.push_back({"cancel_without_transfer_id",
                 pack_request(4,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(13);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("cancel"));
                                pk.pack(std::string("body"));
                                pk.pack_map(0);
                              }),
                 RejectReason::malformed, 13});
  out.push_back({"reservation_id_wrong_length",
                 pack_request(4,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(14);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("cancel"));
                                pk.pack(std::string("body"));
                                pk.pack_map(2);
                                pk.pack(std::string("transfer_id"));
                                pk.pack(std::string("t"));
                                pk.pack(std::string("reservation_id"));
                                pk.pack_bin(3);
                                pk.pack_bin_body("abc", 3);
                              }),
                 RejectReason::malformed, 14});
  out.push_back({"items_not_an_array",
                 pack_request(4,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(15);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("reserve_batch"));
                                pk.pack(std::string("body"));
                                pk.pack_map(1);
                                pk.pack(std::string("items"));
                                pk.pack(std::string("all of them"));
                              }),
                 RejectReason::malformed, 15});
  out.push_back({"float_timeout",
                 pack_request(4,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(16);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("hello"));
                                pk.pack(std::string("timeout_ms"));
                                pk.pack(1.5);
                              }),
                 RejectReason::malformed, 16});
  out.push_back({"long_transfer_id",
                 pack_request(4,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(17);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("status"));
                                pk.pack(std::string("body"));
                                pk.pack_map(1);
                                pk.pack(std::string("transfer_id"));
                                pk.pack(std::string(300, 'x'));
                              }),
                 RejectReason::malformed, 17});
  out.push_back({"partial_stamp",
                 pack_request(4,
                              [](P& pk) {
                                pk.pack(std::string("v"));
                                pk.pack(1);
                                pk.pack(std::string("id"));
                                pk.pack(18);
                                pk.pack(std::string("op"));
                                pk.pack(std::string("hello"));
                                pk.pack(std::string("sid"));
                                pk.pack(5);
                              }),
                 RejectReason::malformed, 18});
  return out;
}

}  // namespace ecx::wire::testing
