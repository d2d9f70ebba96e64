// The simulators' admit channel on the wire (tools/sim/admit_link.h), over real TCP
// sockets on loopback: what a producer queues reaches the consumer whole and in order,
// however the bytes are split; answers reach the producer that asked; a producer that
// leaves or speaks something else is dropped without harm to the others.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <variant>
#include <vector>

#include <gtest/gtest.h>

#include "sim/admit_link.h"
#include "sim/admit_message.h"

namespace ecx::sim {
namespace {

using std::chrono::milliseconds;

constexpr auto kWait = std::chrono::seconds(10);  // a bound, never waited out by a passing test

std::string request_frame(const std::string& id) {
  return encode_admit(AdmitRequestView{id, std::nullopt, true, {}, ""});
}

// The request ids `listener` receives until `count` arrived (or the bound passed),
// with the sender of each.
std::vector<std::pair<std::string, std::string>> receive_requests(AdmitListener& listener, std::size_t count) {
  std::vector<std::pair<std::string, std::string>> got;
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (got.size() < count && std::chrono::steady_clock::now() < deadline) {
    for (auto& batch : listener.receive()) {
      for (auto& decoded : batch.admits) {
        EXPECT_TRUE(decoded) << decoded.status().to_string();
        if (!decoded) continue;
        if (const auto* request = std::get_if<AdmitRequest>(&*decoded))
          got.emplace_back(batch.sender, request->request_id);
      }
    }
    if (got.size() < count) (void)listener.wait(milliseconds(100));
  }
  return got;
}

std::unique_ptr<AdmitListener> bind_loopback() {
  auto listener = AdmitListener::bind("tcp://127.0.0.1:0");
  EXPECT_TRUE(listener) << listener.status().to_string();
  return listener ? std::move(*listener) : nullptr;
}

std::unique_ptr<AdmitConnection> connect_to(const AdmitListener& listener) {
  auto connection = AdmitConnection::connect(listener.endpoint(), kWait);
  EXPECT_TRUE(connection) << connection.status().to_string();
  return connection ? std::move(*connection) : nullptr;
}

// A consumer's listener on loopback and one producer connected to it.
class SimAdmitLink : public ::testing::Test {
 protected:
  void SetUp() override {
    listener = bind_loopback();
    ASSERT_TRUE(listener);
    producer = connect_to(*listener);
    ASSERT_TRUE(producer);
  }
  std::unique_ptr<AdmitListener> listener;
  std::unique_ptr<AdmitConnection> producer;
};

TEST_F(SimAdmitLink, AStepsRequestsArriveInOrderAndAnswersReachTheirProducer) {
  EXPECT_TRUE(listener->endpoint().starts_with("tcp://127.0.0.1:")) << listener->endpoint();
  EXPECT_NE(listener->endpoint(), "tcp://127.0.0.1:0");
  auto& first = producer;
  auto second = connect_to(*listener);
  ASSERT_TRUE(second);
  for (const char* id : {"a-1", "a-2", "a-3"}) first->queue(request_frame(id));
  second->queue(request_frame("b-1"));
  first->flush();
  second->flush();
  const auto got = receive_requests(*listener, 4);
  ASSERT_EQ(got.size(), 4U);
  std::vector<std::string> from_first;
  std::string first_sender;
  std::string second_sender;
  for (const auto& [sender, id] : got) {
    if (id.starts_with("a-")) {
      from_first.push_back(id);
      first_sender = sender;
    } else {
      second_sender = sender;
    }
  }
  EXPECT_EQ(from_first, (std::vector<std::string>{"a-1", "a-2", "a-3"}));
  ASSERT_FALSE(first_sender.empty());
  ASSERT_FALSE(second_sender.empty());
  EXPECT_NE(first_sender, second_sender);

  listener->send(second_sender, encode_answer(AdmitAnswer{"b-1", true}));
  ASSERT_TRUE(second->wait(kWait));
  const auto answers = second->receive();
  ASSERT_EQ(answers.size(), 1U);
  auto answer = decode_answer(answers[0]);
  ASSERT_TRUE(answer) << answer.status().to_string();
  EXPECT_EQ(answer->request_id, "b-1");
  EXPECT_TRUE(answer->ready);
  EXPECT_TRUE(first->receive().empty());  // the other producer got nothing
}

TEST_F(SimAdmitLink, AProducerThatConnectsIsNoRequest) {
  // Connected (the handshake is done when connect returns): the wait takes the
  // producer on, but nothing was sent, so it reports nothing to read.
  EXPECT_FALSE(listener->wait(Duration::zero()));
  EXPECT_EQ(listener->wake_sources().size(), 2U);
  producer->queue(request_frame("first"));
  producer->flush();
  EXPECT_TRUE(listener->wait(kWait));
  const auto got = receive_requests(*listener, 1);
  ASSERT_EQ(got.size(), 1U);
  EXPECT_EQ(got[0].second, "first");
}

TEST_F(SimAdmitLink, AFrameSplitOverManyReadsArrivesWhole) {
  // Params of 4 MiB: more than one read of the consumer (64 KiB) and than the
  // socket's buffers take in one write.
  const std::string params(4U << 20, 'p');
  producer->queue(encode_admit(AdmitRequestView{"big", 7, false, {}, params}));
  producer->queue(request_frame("after"));
  std::vector<AdmitRequest> got;
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (got.size() < 2 && std::chrono::steady_clock::now() < deadline) {
    producer->flush();  // what the socket did not take stays queued for the next flush
    for (auto& batch : listener->receive()) {
      for (auto& decoded : batch.admits) {
        ASSERT_TRUE(decoded) << decoded.status().to_string();
        got.push_back(std::get<AdmitRequest>(std::move(*decoded)));
      }
    }
    if (got.size() < 2) (void)listener->wait(milliseconds(10));
  }
  ASSERT_EQ(got.size(), 2U);
  EXPECT_EQ(got[0].request_id, "big");
  EXPECT_EQ(got[0].encoded_at_ns, 7);
  EXPECT_EQ(got[0].ec_transfer_params, params);
  EXPECT_EQ(got[1].request_id, "after");
}

TEST_F(SimAdmitLink, AProducerThatLeavesIsReadToTheEndThenDropped) {
  producer->queue(request_frame("last"));
  ASSERT_TRUE(producer->flush_within(kWait));
  producer.reset();  // closes its connection
  const auto got = receive_requests(*listener, 1);
  ASSERT_EQ(got.size(), 1U);
  EXPECT_EQ(got[0].second, "last");
  // The closed connection goes: only the listening socket is left to poll.
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (listener->wake_sources().size() > 1 && std::chrono::steady_clock::now() < deadline) {
    (void)listener->wait(milliseconds(100));
    EXPECT_TRUE(listener->receive().empty());
  }
  EXPECT_EQ(listener->wake_sources().size(), 1U);
}

TEST_F(SimAdmitLink, APeerThatIsNoProducerIsDroppedAndTheOthersAreServed) {
  // A raw client whose first four bytes announce a frame longer than any admit message.
  auto address = listener->endpoint().substr(std::string("tcp://127.0.0.1:").size());
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<std::uint16_t>(std::stoi(address)));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int stranger = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(stranger, 0);
  ASSERT_EQ(::connect(stranger, reinterpret_cast<const sockaddr*>(&to), sizeof to), 0);
  const char junk[] = "GET / HTTP/1.1\r\n\r\n";
  ASSERT_EQ(::send(stranger, junk, sizeof junk - 1, 0), static_cast<ssize_t>(sizeof junk - 1));
  producer->queue(request_frame("served"));
  producer->flush();
  const auto got = receive_requests(*listener, 1);
  ASSERT_EQ(got.size(), 1U);
  EXPECT_EQ(got[0].second, "served");
  // The stranger's connection is closed by the listener: its next read ends.
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  char byte = 0;
  ssize_t n = -1;
  while (std::chrono::steady_clock::now() < deadline) {
    (void)listener->receive();
    timeval tv{0, 100'000};
    (void)::setsockopt(stranger, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    n = ::recv(stranger, &byte, 1, 0);
    if (n == 0) break;
  }
  EXPECT_EQ(n, 0);
  ::close(stranger);
  EXPECT_EQ(listener->wake_sources().size(), 2U);  // the listening socket and the producer
}

TEST_F(SimAdmitLink, AConsumerThatLeavesClosesTheProducersEnd) {
  producer->queue(request_frame("taken"));
  producer->flush();
  ASSERT_EQ(receive_requests(*listener, 1).size(), 1U);  // the consumer took the producer on
  listener.reset();                                      // and leaves: its sockets close
  ASSERT_TRUE(producer->wait(kWait));                    // the end of the stream is readable
  EXPECT_TRUE(producer->receive().empty());
  EXPECT_FALSE(producer->open());
  EXPECT_NE(producer->why_closed().find("closed"), std::string::npos) << producer->why_closed();
  // Nothing more can come: a wait does not report the closed socket as an answer, and
  // what is queued now is dropped, not sent (no SIGPIPE).
  EXPECT_FALSE(producer->wait(Duration::zero()));
  producer->queue(request_frame("lost"));
  producer->flush();
  EXPECT_FALSE(producer->flush_within(Duration::zero()));
}

TEST_F(SimAdmitLink, ALastFlushNobodyReadsEndsAtItsBound) {
  // More than loopback's socket buffers hold, and the consumer never reads: a flush
  // bounded by zero returns at once, naming what is left.
  const std::string params(12U << 20, 'p');
  for (int i = 0; i < 6; ++i) producer->queue(encode_admit(AdmitRequestView{"r", 0, false, {}, params}));
  const Status sent = producer->flush_within(Duration::zero());
  EXPECT_EQ(sent.code(), StatusCode::timeout) << sent.to_string();
  EXPECT_NE(sent.message().find("not taken by the peer"), std::string::npos) << sent.to_string();
  EXPECT_TRUE(producer->open());
}

TEST(SimAdmitLinkEndpoints, BadEndpointsAreRefusedWithTheReason) {
  auto no_scheme = AdmitListener::bind("127.0.0.1:0");
  ASSERT_FALSE(no_scheme);
  EXPECT_EQ(no_scheme.status().code(), StatusCode::invalid_argument);
  EXPECT_NE(no_scheme.status().message().find("tcp://HOST:PORT"), std::string::npos);
  auto bad_port = AdmitListener::bind("tcp://127.0.0.1:99999");
  ASSERT_FALSE(bad_port);
  EXPECT_NE(bad_port.status().message().find("port"), std::string::npos);
  // Nobody listens: refused, and with no time to retry, reported at once.
  auto listener = bind_loopback();
  ASSERT_TRUE(listener);
  const std::string endpoint = listener->endpoint();
  listener.reset();
  auto refused = AdmitConnection::connect(endpoint, Duration::zero());
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.status().code(), StatusCode::unavailable);
  EXPECT_NE(refused.status().message().find(endpoint), std::string::npos) << refused.status().to_string();
}

}  // namespace
}  // namespace ecx::sim
