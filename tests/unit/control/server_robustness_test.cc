// The server against hostile frames on a real socket: every bad frame gets an error
// reply (or, for a frame over the size limit, the connection is dropped) and a valid
// request is still answered afterwards.

#include <gtest/gtest.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "../wire/malformed_corpus.h"
#include "../wire/wire_test_util.h"
#include "control_test_util.h"
#include "ecx/control/client.h"
#include "ecx/wire/auth.h"
#include "ecx/wire/codec.h"

namespace ecx::control {
namespace {

using namespace std::chrono_literals;
using testing::local;
using testing::TestHandler;

// A raw DEALER that sends exactly the parts it is given.
struct RawPeer {
  explicit RawPeer(const std::string& address) : socket(ctx, zmq::socket_type::dealer) {
    socket.set(zmq::sockopt::linger, 0);
    socket.connect(address);
  }
  void send(const std::vector<std::string>& parts) {
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const auto flags = i + 1 < parts.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
      socket.send(zmq::buffer(parts[i]), flags);
    }
  }
  // Waits (bounded) for one reply; its parts, or nothing.
  std::vector<std::string> receive(std::chrono::milliseconds max_wait = 5000ms) {
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, max_wait) != 1) return {};
    std::vector<zmq::message_t> parts;
    (void)zmq::recv_multipart(socket, std::back_inserter(parts));
    std::vector<std::string> out;
    out.reserve(parts.size());
    for (auto& p : parts) out.push_back(p.to_string());
    return out;
  }
  zmq::context_t ctx;
  zmq::socket_t socket;
};

std::string valid_request(std::uint64_t id, const wire::AuthStamp* stamp = nullptr) {
  std::string frame;
  wire::encode_request(wire::Request{id, 0, wire::StatusRequest{"t-valid"}}, stamp, frame);
  return frame;
}

TEST(ControlServerRobustness, SurvivesTheMalformedCorpusAndStillAnswers) {
  auto handler = std::make_shared<TestHandler>();
  auto server = testing::must(ControlServer::start(ServerOptions{}, handler));
  RawPeer peer(local(server->port()));
  const auto corpus = wire::testing::malformed_corpus();
  for (const auto& bad : corpus) {
    peer.send({bad.bytes});
    auto reply_parts = peer.receive();
    ASSERT_EQ(reply_parts.size(), 1u) << bad.name;
    auto reply = wire::decode_reply(reply_parts[0], wire::Limits{});
    ASSERT_TRUE(reply.is_ok()) << bad.name << ": " << reply.status().to_string();
    EXPECT_FALSE(reply->ok()) << bad.name;
    EXPECT_EQ(reply->status.code(), StatusCode::protocol) << bad.name;
    EXPECT_EQ(reply->reason, bad.reason) << bad.name;
    EXPECT_EQ(reply->id, bad.echo_id) << bad.name;
    if (bad.reason == wire::RejectReason::version_mismatch) {
      EXPECT_EQ(reply->peer_min_version, wire::kMinProtocolVersion);
      EXPECT_EQ(reply->peer_max_version, wire::kProtocolVersion);
      EXPECT_NE(reply->status.message().find("1..1"), std::string::npos);
    }
  }
  // Many parts, and a message whose only part is empty.
  peer.send({valid_request(1), "extra", "more", "and more"});
  auto many = peer.receive();
  ASSERT_EQ(many.size(), 1u);
  auto many_reply = wire::decode_reply(many[0], wire::Limits{});
  ASSERT_TRUE(many_reply.is_ok());
  EXPECT_EQ(many_reply->reason, wire::RejectReason::malformed);
  peer.send({valid_request(2), "a-mac-while-auth-is-off"});
  auto two = wire::decode_reply(peer.receive().at(0), wire::Limits{});
  EXPECT_EQ(two->id, 2u);
  EXPECT_NE(two->status.message().find("authentication is off"), std::string::npos);

  // Still serving, on the same raw connection and through a client.
  peer.send({valid_request(99)});
  auto ok = wire::decode_reply(peer.receive().at(0), wire::Limits{});
  ASSERT_TRUE(ok.is_ok());
  EXPECT_TRUE(ok->ok());
  EXPECT_EQ(ok->id, 99u);
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  EXPECT_TRUE(client->status(local(server->port()), "t-1", 2s).is_ok());

  const auto c = server->counters();
  std::size_t expect_malformed = 2;  // many parts, mac while auth off
  std::size_t expect_versions = 0;
  std::size_t expect_unknown = 0;
  for (const auto& bad : corpus) {
    if (bad.reason == wire::RejectReason::malformed) ++expect_malformed;
    if (bad.reason == wire::RejectReason::version_mismatch) ++expect_versions;
    if (bad.reason == wire::RejectReason::unknown_op) ++expect_unknown;
  }
  EXPECT_EQ(c.malformed_frames, expect_malformed);
  EXPECT_EQ(c.version_mismatches, expect_versions);
  EXPECT_EQ(c.unknown_ops, expect_unknown);
  EXPECT_EQ(handler->calls.load(), 2) << "no bad frame reached the handler";
}

TEST(ControlServerRobustness, ACancelBatchItemThatDoesNotDecodeIsAnsweredInItsPlace) {
  auto handler = std::make_shared<TestHandler>();
  auto server = testing::must(ControlServer::start(ServerOptions{}, handler));
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  ASSERT_TRUE(client->reserve_batch(local(server->port()), {testing::item("t-1")}, 2s).is_ok());
  RawPeer peer(local(server->port()));
  peer.send({wire::testing::cancel_batch_frame(
      5, {std::string("t-2"), std::string("bad id with spaces"), std::string("t-1")})});
  auto parts = peer.receive();
  ASSERT_EQ(parts.size(), 1u);
  auto reply = wire::decode_reply(parts[0], wire::Limits{});
  ASSERT_TRUE(reply.is_ok()) << reply.status().to_string();
  ASSERT_TRUE(reply->ok()) << reply->status.to_string();
  const auto& items = std::get<wire::CancelBatchReply>(reply->body).items;
  ASSERT_EQ(items.size(), 3u);
  EXPECT_TRUE(items[0].error.is_ok());
  EXPECT_FALSE(items[0].cancelled);
  EXPECT_EQ(items[1].error.code(), StatusCode::invalid_argument);
  EXPECT_NE(items[1].error.message().find("transfer_id"), std::string::npos) << items[1].error.message();
  EXPECT_TRUE(items[2].error.is_ok());
  EXPECT_TRUE(items[2].cancelled);  // the items after the bad one still ran
}

TEST(ControlServerRobustness, OversizedFrameDropsThatConnectionOnly) {
  auto handler = std::make_shared<TestHandler>();
  ServerOptions o;
  o.limits.max_frame_bytes = 4096;
  auto server = testing::must(ControlServer::start(o, handler));
  RawPeer peer(local(server->port()));
  peer.send({std::string(std::size_t{64} * 1024, 'x')});
  EXPECT_TRUE(peer.receive(200ms).empty()) << "libzmq refuses it before it is buffered";
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  EXPECT_TRUE(client->status(local(server->port()), "t-1", 2s).is_ok());
}

TEST(ControlServerRobustness, ClientRefusesToSendAFrameOverTheLimit) {
  auto handler = std::make_shared<TestHandler>();
  auto server = testing::must(ControlServer::start(ServerOptions{}, handler));
  ClientOptions o;
  o.limits.max_frame_bytes = 4096;
  auto client = testing::must(ControlClient::create(o));
  std::vector<wire::ReserveItem> items;
  items.reserve(200);
  for (int i = 0; i < 200; ++i) items.push_back(testing::item("t-" + std::to_string(i)));
  auto reply = client->reserve_batch(local(server->port()), items, 2s);
  EXPECT_EQ(reply.status().code(), StatusCode::invalid_argument);
  EXPECT_EQ(handler->calls.load(), 0);
}

// ---------------------------------------------------------------- authentication

struct AuthFixture : ::testing::Test {
  void SetUp() override {
    handler = std::make_shared<TestHandler>();
    ServerOptions o;
    o.auth_secret = "the-right-secret";
    server = testing::must(ControlServer::start(o, handler));
    address = local(server->port());
  }
  std::unique_ptr<ControlClient> client_with(const std::string& secret) {
    ClientOptions o;
    o.auth_secret = secret;
    return testing::must(ControlClient::create(o));
  }
  std::shared_ptr<TestHandler> handler;
  std::unique_ptr<ControlServer> server;
  std::string address;
};

TEST_F(AuthFixture, RightKeyWorksAndTheShardAdvertisesAuth) {
  auto client = client_with("the-right-secret");
  auto hello = client->hello(address, 2s);
  ASSERT_TRUE(hello.is_ok()) << hello.status().to_string();
  EXPECT_NE(std::find(hello->features.begin(), hello->features.end(), "auth"), hello->features.end());
  EXPECT_TRUE(client->reserve_batch(address, {testing::item("t-1")}, 2s).is_ok());
  EXPECT_EQ(handler->reservation_count(), 1u);
}

TEST_F(AuthFixture, WrongKeyOrNoKeyIsRejectedAndChangesNothing) {
  auto wrong = client_with("a-wrong-secret");
  auto reply = wrong->reserve_batch(address, {testing::item("t-1")}, 2s);
  EXPECT_EQ(reply.status().code(), StatusCode::protocol);
  EXPECT_NE(reply.status().message().find("MAC"), std::string::npos) << reply.status().message();
  auto none = client_with("");
  reply = none->reserve_batch(address, {testing::item("t-2")}, 2s);
  EXPECT_EQ(reply.status().code(), StatusCode::protocol);
  EXPECT_NE(reply.status().message().find("authentication is required"), std::string::npos);
  EXPECT_EQ(handler->calls.load(), 0);
  EXPECT_EQ(handler->reservation_count(), 0u);
  EXPECT_EQ(server->counters().auth_failures, 2u);
}

TEST_F(AuthFixture, TamperedAndReplayedFramesAreRejected) {
  auto auth = testing::must(wire::FrameAuthenticator::create("the-right-secret"));
  wire::StampIssuer issuer;
  auto signed_frame = [&](std::uint64_t id) {
    const wire::AuthStamp stamp = issuer.next();
    std::string body;
    wire::encode_request(wire::Request{id, 0, wire::ReserveBatchRequest{{testing::item("t-" + std::to_string(id))}}},
                         &stamp, body);
    const wire::Mac mac = auth->sign(wire::FrameKind::request, body);
    return std::vector<std::string>{body, std::string(reinterpret_cast<const char*>(mac.data()), mac.size())};
  };
  RawPeer peer(address);
  auto frame = signed_frame(1);
  peer.send(frame);
  auto accepted = peer.receive();
  ASSERT_EQ(accepted.size(), 2u) << "signed reply: body and MAC";
  EXPECT_TRUE(auth->verify(wire::FrameKind::reply, accepted[0], accepted[1]));
  EXPECT_EQ(handler->reservation_count(), 1u);

  peer.send(frame);  // the same bytes again
  auto replayed = wire::decode_reply(peer.receive().at(0), wire::Limits{});
  EXPECT_EQ(replayed->reason, wire::RejectReason::unauthenticated);
  EXPECT_NE(replayed->status.message().find("replayed"), std::string::npos) << replayed->status.message();

  auto tampered = signed_frame(2);
  tampered[0][tampered[0].size() - 2] ^= 0x01;  // inside the dtype string
  peer.send(tampered);
  auto refused = wire::decode_reply(peer.receive().at(0), wire::Limits{});
  EXPECT_EQ(refused->reason, wire::RejectReason::unauthenticated);
  EXPECT_EQ(handler->reservation_count(), 1u);
  EXPECT_EQ(handler->calls.load(), 1);
  EXPECT_EQ(server->counters().auth_failures, 2u);
}

}  // namespace
}  // namespace ecx::control
