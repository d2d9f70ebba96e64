#include <pthread.h>

#include <csignal>
#include <future>
#include <optional>
#include <thread>

#include <gtest/gtest.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "control_test_util.h"
#include "ecx/control/client.h"
#include "ecx/control/server.h"
#include "ecx/wire/codec.h"
#include "hand_driven_router.h"

namespace ecx::control {
namespace {

using namespace std::chrono_literals;
using testing::item;
using testing::Latch;
using testing::local;
using testing::TestHandler;

struct Fixture : ::testing::Test {
  void SetUp() override {
    handler = std::make_shared<TestHandler>();
    auto s = ControlServer::start(ServerOptions{}, handler);
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    server = std::move(*s);
    auto c = ControlClient::create(ClientOptions{});
    ASSERT_TRUE(c.is_ok());
    client = std::move(*c);
    address = local(server->port());
  }
  std::shared_ptr<TestHandler> handler;
  std::unique_ptr<ControlServer> server;
  std::unique_ptr<ControlClient> client;
  std::string address;
};

using ControlRoundTrip = Fixture;

TEST_F(ControlRoundTrip, HelloDescribesTheShard) {
  auto hello = client->hello(address, 2s);
  ASSERT_TRUE(hello.is_ok()) << hello.status().to_string();
  EXPECT_EQ(hello->shard, 0u);
  EXPECT_EQ(hello->tp_size, 1u);
  EXPECT_EQ(hello->control_ports, std::vector<std::uint32_t>{static_cast<std::uint32_t>(server->port())});
  EXPECT_EQ(hello->event_port, static_cast<std::uint32_t>(server->event_port()));
  EXPECT_EQ(hello->instance, server->instance());
  EXPECT_EQ(hello->data.transport, "ucx");
  EXPECT_EQ(hello->data.address, std::string("\x01\x02\x03\x00", 4));
  EXPECT_EQ(hello->pool_bytes, 1u << 30);
  EXPECT_EQ(hello->max_version, wire::kProtocolVersion);
}

TEST_F(ControlRoundTrip, ReserveBatchAnswersEveryItemInOrder) {
  auto reply = client->reserve_batch(address, {item("t-1"), item("full-2"), item("cached-3"), item("t-4")}, 2s);
  ASSERT_TRUE(reply.is_ok()) << reply.status().to_string();
  ASSERT_EQ(reply->items.size(), 4u);
  EXPECT_EQ(reply->items[0].outcome, wire::ReserveOutcome::reserved);
  EXPECT_EQ(reply->items[0].slot_bytes, 64u);
  EXPECT_EQ(reply->items[1].outcome, wire::ReserveOutcome::retry);
  EXPECT_EQ(reply->items[1].retry_after_ms, 7u);
  EXPECT_EQ(reply->items[2].outcome, wire::ReserveOutcome::ready);
  EXPECT_TRUE(reply->items[2].cached);
  EXPECT_EQ(reply->items[3].outcome, wire::ReserveOutcome::reserved);
  EXPECT_NE(reply->items[0].reservation_id, reply->items[3].reservation_id);
  const auto c = server->counters();
  EXPECT_EQ(c.reserve_items[static_cast<int>(wire::ReserveOutcome::reserved)], 2u);
  EXPECT_EQ(c.reserve_items[static_cast<int>(wire::ReserveOutcome::retry)], 1u);
  EXPECT_EQ(c.requests[static_cast<int>(wire::Op::reserve_batch)][0], 1u);
}

TEST_F(ControlRoundTrip, CancelStatusAndErrors) {
  ASSERT_TRUE(client->reserve_batch(address, {item("t-1")}, 2s).is_ok());
  auto cancelled = client->cancel(address, wire::CancelRequest{"t-1", {}, true, false}, 2s);
  ASSERT_TRUE(cancelled.is_ok());
  EXPECT_TRUE(cancelled->cancelled);
  cancelled = client->cancel(address, wire::CancelRequest{"t-1", {}, true, false}, 2s);
  EXPECT_FALSE(cancelled->cancelled);

  auto status = client->status(address, "t-7", 2s);
  ASSERT_TRUE(status.is_ok());
  EXPECT_EQ(status->state, "t-7");
  status = client->status(address, "missing", 2s);
  EXPECT_EQ(status.status().code(), StatusCode::not_found);

  // `complete` is refused by a shard that lands payloads itself.
  auto complete = client->call(address, wire::CompleteRequest{"t-1", ReservationId(1, 1), 1}, 2s).get();
  ASSERT_TRUE(complete.is_ok());
  EXPECT_FALSE(complete->ok());
  EXPECT_EQ(complete->status.code(), StatusCode::protocol);
  EXPECT_EQ(server->counters().requests[static_cast<int>(wire::Op::status)][1], 1u);
}

TEST_F(ControlRoundTrip, CancelBatchAnswersEveryItemInOrderAndOneBadItemFailsOnlyItself) {
  auto hello = client->hello(address, 2s);
  ASSERT_TRUE(hello.is_ok());
  EXPECT_TRUE(hello->has_feature(wire::kFeatureCancelBatch));
  ASSERT_TRUE(client->reserve_batch(address, {item("t-1"), item("t-3")}, 2s).is_ok());
  auto reply = client->cancel_batch(
      address,
      {wire::CancelRequest{"t-1", {}, false, false}, wire::CancelRequest{"t-2", {}, false, false},
       wire::CancelRequest{"boom", {}, false, false}, wire::CancelRequest{"refused", {}, false, false},
       wire::CancelRequest{"t-3", {}, false, false}},
      2s);
  ASSERT_TRUE(reply.is_ok()) << reply.status().to_string();
  ASSERT_EQ(reply->items.size(), 5u);
  EXPECT_TRUE(reply->items[0].cancelled);
  EXPECT_TRUE(reply->items[0].error.is_ok());
  EXPECT_FALSE(reply->items[1].cancelled);  // nothing held: not an error
  EXPECT_TRUE(reply->items[1].error.is_ok());
  EXPECT_EQ(reply->items[2].error.code(), StatusCode::internal);
  EXPECT_NE(reply->items[2].error.message().find("handler exploded"), std::string::npos);
  EXPECT_EQ(reply->items[3].error.code(), StatusCode::conflict);
  EXPECT_TRUE(reply->items[4].cancelled);
  const auto c = server->counters();
  EXPECT_EQ(c.requests[static_cast<int>(wire::Op::cancel_batch)][0], 1u);
  EXPECT_EQ(c.handler_exceptions, 1u);
}

TEST_F(ControlRoundTrip, HandlerExceptionIsAnErrorReplyAndTheServerGoesOn) {
  auto reply = client->reserve_batch(address, {item("boom")}, 2s);
  EXPECT_EQ(reply.status().code(), StatusCode::internal);
  EXPECT_NE(reply.status().message().find("handler exploded"), std::string::npos);
  EXPECT_TRUE(client->reserve_batch(address, {item("t-2")}, 2s).is_ok());
  EXPECT_EQ(server->counters().handler_exceptions, 1u);
}

TEST_F(ControlRoundTrip, TenThousandPipelinedRequestsAllMatchTheirReplies) {
  constexpr int kCount = 10'000;
  Latch done(kCount);
  std::atomic<int> matched{0};
  std::atomic<int> failed{0};
  for (int i = 0; i < kCount; ++i) {
    const std::string id = "t-" + std::to_string(i);
    client->call_async(address, wire::StatusRequest{id}, 60s, [&, id](Result<wire::Reply> reply) {
      auto status = reply_body<wire::StatusReply>(std::move(reply));
      if (status && status->state == id) {
        matched.fetch_add(1);
      } else {
        failed.fetch_add(1);
      }
      done.count_down();
    });
  }
  ASSERT_TRUE(done.wait(120s));
  EXPECT_EQ(matched.load(), kCount);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(client->counters().sent[static_cast<int>(wire::Op::status)], static_cast<std::uint64_t>(kCount));
}

TEST_F(ControlRoundTrip, TooManyInFlightIsRefusedAtOnce) {
  ClientOptions o;
  o.max_in_flight = 1;
  auto small = ControlClient::create(o);
  ASSERT_TRUE(small.is_ok());
  // A listener that never answers keeps the first call in flight.
  zmq::context_t ctx;
  zmq::socket_t silent(ctx, zmq::socket_type::router);
  silent.set(zmq::sockopt::linger, 0);
  silent.bind("tcp://127.0.0.1:*");
  const std::string silent_address = silent.get(zmq::sockopt::last_endpoint);
  auto first = (*small)->call(silent_address, wire::HelloRequest{}, 5s);
  auto second = (*small)->call(silent_address, wire::HelloRequest{}, 5s).get();
  EXPECT_EQ(second.status().code(), StatusCode::resource_exhausted);
  small->reset();  // shutting down cancels the call in flight
  EXPECT_EQ(first.get().status().code(), StatusCode::cancelled);
}

TEST(ControlDeadlines, LostReplyTimesOutAndTheSocketStaysUsable) {
  // A hand-driven ROUTER: it ignores the first request and answers the second.
  zmq::context_t ctx;
  zmq::socket_t router(ctx, zmq::socket_type::router);
  router.set(zmq::sockopt::linger, 0);
  router.bind("tcp://127.0.0.1:*");
  const std::string address = router.get(zmq::sockopt::last_endpoint);
  auto client = testing::must(ControlClient::create(ClientOptions{}));

  // Long enough for a loaded machine to send it (a request not sent by its deadline
  // is never sent), short enough to wait out.
  auto lost = client->call(address, wire::StatusRequest{"first"}, 1s);
  zmq::pollitem_t item{router.handle(), 0, ZMQ_POLLIN, 0};
  ASSERT_EQ(zmq::poll(&item, 1, 5000ms), 1);
  std::vector<zmq::message_t> first;
  ASSERT_TRUE(zmq::recv_multipart(router, std::back_inserter(first)));
  const auto result = lost.get();
  EXPECT_EQ(result.status().code(), StatusCode::timeout) << result.status().to_string();

  auto answered = client->call(address, wire::StatusRequest{"second"}, 5s);
  ASSERT_EQ(zmq::poll(&item, 1, 5000ms), 1);
  std::vector<zmq::message_t> second;
  ASSERT_TRUE(zmq::recv_multipart(router, std::back_inserter(second)));
  ASSERT_EQ(second.size(), 2u);
  auto decoded = wire::decode_request(second[1].to_string_view(), wire::Limits{});
  ASSERT_TRUE(decoded.is_ok());
  // Answer the late first request too: it must be dropped, not matched.
  auto first_decoded = wire::decode_request(first[1].to_string_view(), wire::Limits{});
  ASSERT_TRUE(first_decoded.is_ok());
  for (const auto* req : {&first_decoded->request, &decoded->request}) {
    wire::Reply reply;
    reply.id = req->id;
    reply.op = wire::Op::status;
    reply.body = wire::StatusReply{true, "answered", "h", {}, 0, std::nullopt};
    std::string frame;
    wire::encode_reply(reply, nullptr, frame);
    router.send(zmq::buffer(second[0].to_string_view()), zmq::send_flags::sndmore);
    router.send(zmq::buffer(frame), zmq::send_flags::none);
  }
  auto status = reply_body<wire::StatusReply>(answered.get());
  ASSERT_TRUE(status.is_ok()) << status.status().to_string();
  EXPECT_EQ(status->state, "answered");
  EXPECT_EQ(client->counters().timeouts, 1u);
}

TEST(ControlDeadlines, NobodyListeningIsATimeout) {
  // Reserve a port, then close it so nothing listens there.
  const std::string address = testing::closed_address();
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  auto result = client->hello(address, 100ms);
  EXPECT_EQ(result.status().code(), StatusCode::timeout);
  EXPECT_NE(result.status().message().find("could not reach"), std::string::npos) << result.status().message();
}

// ---------------------------------------------------------------- lanes (blocking calls)

using testing::HandDrivenRouter;

TEST_F(ControlRoundTrip, BlockingCallsGoOverALaneThatIsKeptForTheNextCall) {
  ASSERT_TRUE(client->hello(address, 2s).is_ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client->reserve_batch(address, {item("t-" + std::to_string(i))}, 2s).is_ok());
  auto status = client->status(address, "t-9", 2s);
  ASSERT_TRUE(status.is_ok()) << status.status().to_string();
  EXPECT_EQ(status->state, "t-9");
  const auto c = client->counters();
  EXPECT_EQ(c.lane_calls, 5u);
  EXPECT_EQ(c.lanes_opened, 1u) << "one lane, reused";
  EXPECT_EQ(c.peers_opened, 0u) << "the I/O thread's socket was never needed";
  EXPECT_EQ(c.sent[static_cast<int>(wire::Op::reserve_batch)], 3u);
  EXPECT_EQ(c.replies_ok, 5u);
  EXPECT_EQ(handler->reservation_count(), 3u);
}

TEST(ControlLanes, ALateReplyIsDroppedAndTheNextCallOnTheLaneGetsItsOwn) {
  HandDrivenRouter router;
  auto clock = std::make_shared<ManualClock>();
  ClientOptions o;
  o.clock = clock;
  auto client = testing::must(ControlClient::create(o));

  auto lost = std::async(std::launch::async, [&] { return client->status(router.address, "first", 1s); });
  auto first = router.next_request();
  ASSERT_TRUE(first.has_value());
  clock->advance(2s);  // the injected clock passes the deadline; the lane sees it within one poll
  const auto timed_out = lost.get();
  EXPECT_EQ(timed_out.status().code(), StatusCode::timeout) << timed_out.status().to_string();
  EXPECT_NE(timed_out.status().message().find("no reply from"), std::string::npos) << timed_out.status().message();

  auto answered = std::async(std::launch::async, [&] { return client->status(router.address, "second", 60s); });
  auto second = router.next_request();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->first, first->first) << "the same lane";
  router.answer_status(first->first, first->second.id, "late");  // must be dropped, not matched
  router.answer_status(second->first, second->second.id, "answered");
  auto status = answered.get();
  ASSERT_TRUE(status.is_ok()) << status.status().to_string();
  EXPECT_EQ(status->state, "answered");
  const auto c = client->counters();
  EXPECT_EQ(c.timeouts, 1u);
  EXPECT_EQ(c.unmatched_replies, 1u);
  EXPECT_EQ(c.lanes_opened, 1u);
}

TEST(ControlLanes, CloseEndsABlockingCallInFlightWithCancelled) {
  HandDrivenRouter router;
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  auto call = std::async(std::launch::async, [&] { return client->hello(router.address, 60s); });
  ASSERT_TRUE(router.next_request().has_value()) << "the call is in flight";
  client->close();
  ASSERT_EQ(call.wait_for(10s), std::future_status::ready) << "close() waits for the lane, not for the 60 s deadline";
  EXPECT_EQ(call.get().status().code(), StatusCode::cancelled);
  EXPECT_EQ(client->hello(router.address, 1s).status().code(), StatusCode::cancelled) << "refused after close";
}

// A handler installed without SA_RESTART: each signal cuts the caller's wait short
// (EINTR), as a Python process's signal handling or a profiler's timer would.
extern "C" void ignore_signal(int) {}

TEST(ControlLanes, ASignalToABlockingCallerDoesNotEndItsCall) {
  struct sigaction action {};
  action.sa_handler = ignore_signal;
  sigemptyset(&action.sa_mask);
  struct sigaction previous {};
  ASSERT_EQ(sigaction(SIGUSR1, &action, &previous), 0);
  HandDrivenRouter router;
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  std::promise<Result<wire::StatusReply>> outcome;
  std::thread caller([&] { outcome.set_value(client->status(router.address, "x", 60s)); });
  auto request = router.next_request();
  ASSERT_TRUE(request.has_value()) << "the call is in flight";
  // Sent: the caller waits for its reply from here on.
  for (int i = 0; i < 5; ++i) ASSERT_EQ(pthread_kill(caller.native_handle(), SIGUSR1), 0);
  router.answer_status(request->first, request->second.id, "answered");
  auto reply = outcome.get_future().get();
  caller.join();
  sigaction(SIGUSR1, &previous, nullptr);
  ASSERT_TRUE(reply.is_ok()) << reply.status().to_string();
  EXPECT_EQ(reply->state, "answered");
  EXPECT_EQ(client->counters().lane_calls, 1u) << "the blocking call took a lane";
}

TEST_F(ControlRoundTrip, ManyBlockingCallersShareFewLanesAndEachGetsItsOwnReply) {
  ClientOptions o;
  o.max_lanes = 2;  // fewer lanes than callers: the others take the I/O thread's way
  auto shared = testing::must(ControlClient::create(o));
  constexpr int kThreads = 6;
  constexpr int kCalls = 100;
  std::atomic<int> matched{0};
  std::vector<std::thread> callers;
  callers.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    callers.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        const std::string id = "t-" + std::to_string(t) + "-" + std::to_string(i);
        auto status = shared->status(address, id, 30s);
        if (status && status->state == id) matched.fetch_add(1);
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(matched.load(), kThreads * kCalls);
  const auto c = shared->counters();
  EXPECT_LE(c.lanes_opened, 2u);
  EXPECT_GT(c.lane_calls, 0u) << "the lanes served calls";
  EXPECT_EQ(c.replies_ok, static_cast<std::uint64_t>(kThreads * kCalls));
  EXPECT_EQ(c.unmatched_replies, 0u);
}

TEST_F(ControlRoundTrip, LanesOffSendsBlockingCallsThroughTheIoThread) {
  ClientOptions o;
  o.max_lanes = 0;
  auto plain = testing::must(ControlClient::create(o));
  ASSERT_TRUE(plain->reserve_batch(address, {item("t-1")}, 2s).is_ok());
  const auto c = plain->counters();
  EXPECT_EQ(c.lane_calls, 0u);
  EXPECT_EQ(c.peers_opened, 1u);
}

TEST(ControlRestart, ARestartedServerIsReachedAgainBySameClient) {
  auto handler = std::make_shared<TestHandler>();
  auto first = testing::must(ControlServer::start(ServerOptions{}, handler));
  const int port = first->port();
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  ASSERT_TRUE(client->hello(local(port), 2s).is_ok());
  const std::string first_instance = first->instance();
  first.reset();

  ServerOptions again;
  again.port = port;
  auto second = ControlServer::start(again, handler);
  ASSERT_TRUE(second.is_ok()) << second.status().to_string();
  // A request written before the client's socket saw the old connection close goes
  // down with it and times out (the documented cost of a lost reply), so this asks
  // with a short deadline, a bounded number of times.
  Result<wire::HelloReply> hello = timeout_error("not asked yet");
  for (int attempt = 0; attempt < 10 && !hello.is_ok(); ++attempt) hello = client->hello(local(port), 1s);
  ASSERT_TRUE(hello.is_ok()) << hello.status().to_string();
  EXPECT_NE(hello->instance, first_instance);
}

TEST(ControlDiscovery, FindsEveryShardAndCachesOnSuccessOnly) {
  auto handler = std::make_shared<TestHandler>();
  auto shards = testing::start_shards(2, handler);
  ASSERT_EQ(shards.size(), 2u);
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  const std::string base = local(shards[0]->port());
  auto topology = client->discover(base, 2s);
  ASSERT_TRUE(topology.is_ok()) << topology.status().to_string();
  ASSERT_EQ(topology->shards.size(), 2u);
  for (std::uint32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(topology->shards[r].rank, r);
    EXPECT_EQ(topology->shards[r].control, local(shards[r]->port()));
    EXPECT_EQ(topology->shards[r].events, local(shards[r]->event_port()));
    EXPECT_EQ(topology->shards[r].hello.instance, shards[r]->instance());
  }
  const auto hellos = client->counters().sent[static_cast<int>(wire::Op::hello)];
  ASSERT_TRUE(client->discover(base, 2s).is_ok());
  EXPECT_EQ(client->counters().sent[static_cast<int>(wire::Op::hello)], hellos) << "served from the cache";

  // Shard 1 gone (hung: its port held by a peer that never answers, which no other
  // test's listener can then take): discovery fails after two attempts and nothing is
  // cached.
  client->forget_topology(base);
  const int gone_port = shards[1]->port();
  shards[1].reset();
  testing::HandDrivenRouter hung(gone_port);
  auto missing = client->discover(base, 1s);  // shard 0 must still answer in time
  EXPECT_EQ(missing.status().code(), StatusCode::unavailable);
  EXPECT_NE(missing.status().message().find("shard 1"), std::string::npos) << missing.status().message();
  EXPECT_FALSE(client->cached_topology(base).has_value());
  EXPECT_EQ(client->counters().discoveries_failed, 1u);
}

TEST(ControlDiscovery, ADiscoveryThatCloseEndsIsNotCountedAsAFailure) {
  HandDrivenRouter router;  // takes the hello and never answers
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  std::promise<Status> ended;
  client->discover_async(router.address, 60s,
                         [&ended](const Result<Topology>& topology) { ended.set_value(topology.status()); });
  ASSERT_TRUE(router.next_request().has_value()) << "the hello is in flight";
  client->close();
  auto outcome = ended.get_future();
  ASSERT_EQ(outcome.wait_for(10s), std::future_status::ready) << "close() ends the discovery, not its 60 s deadline";
  EXPECT_FALSE(outcome.get().is_ok());
  EXPECT_EQ(client->counters().discoveries_failed, 0u) << "a shutdown is no consumer's failure";
}

// A handler whose cancels may run on any thread, recording the thread each ran on.
// `hold` makes the next cancel wait (bounded) until released.
class AnywhereHandler : public TestHandler {
 public:
  bool cancel_runs_anywhere() const noexcept override { return true; }
  Result<wire::CancelReply> cancel(const RequestContext& context, const wire::CancelRequest& request) override {
    {
      std::unique_lock lock(mutex_);
      threads_.push_back(std::this_thread::get_id());
      entered_ = true;
      changed_.notify_all();
      changed_.wait_for(lock, 10s, [&] { return !hold_; });
    }
    auto reply = TestHandler::cancel(context, request);
    returned_.store(true);
    return reply;
  }
  std::vector<std::thread::id> threads() {
    std::lock_guard lock(mutex_);
    return threads_;
  }
  void hold() {
    std::lock_guard lock(mutex_);
    hold_ = true;
    entered_ = false;
  }
  bool wait_entered(std::chrono::milliseconds max_wait) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, max_wait, [&] { return entered_; });
  }
  void release() {
    std::lock_guard lock(mutex_);
    hold_ = false;
    changed_.notify_all();
  }
  std::atomic<bool> returned_{false};

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::thread::id> threads_;
  bool hold_ = false;
  bool entered_ = false;
};

std::vector<wire::CancelRequest> cancels(std::initializer_list<const char*> ids) {
  std::vector<wire::CancelRequest> out;
  for (const char* id : ids) out.push_back(wire::CancelRequest{id, {}, false, false});
  return out;
}

// One shard on loopback serving `Handler`, and a client of this process.
template <typename Handler>
struct ShardAndClient {
  std::shared_ptr<Handler> handler = std::make_shared<Handler>();
  std::vector<std::unique_ptr<ControlServer>> shards = testing::start_shards(1, handler);
  std::unique_ptr<ControlClient> client = testing::must(ControlClient::create(ClientOptions{}));
  std::string address = shards.empty() ? std::string() : local(shards[0]->port());

  // The shard discovered by the client (which then knows its instance), `t-1` reserved.
  void discover_and_reserve_one() {
    ASSERT_EQ(shards.size(), 1u);
    ASSERT_TRUE(client->discover(address, 2s).is_ok());
    ASSERT_TRUE(client->reserve_batch(address, {item("t-1")}, 2s).is_ok());
  }
};

TEST(InProcessCancels, ADiscoveredShardThatAllowsItCancelsOnTheCallersThread) {
  ShardAndClient<AnywhereHandler> s;
  ASSERT_EQ(s.shards.size(), 1u);
  auto& [handler, shards, client, address] = s;
  ASSERT_TRUE(client->reserve_batch(address, {item("t-1"), item("t-2"), item("t-3")}, 2s).is_ok());

  // Not discovered yet: the client does not know the server is in this process.
  auto networked = client->cancel_batch(address, cancels({"t-1"}), 2s);
  ASSERT_TRUE(networked.is_ok()) << networked.status().to_string();
  EXPECT_TRUE(networked->items[0].cancelled);
  EXPECT_EQ(client->counters().in_process_calls, 0u);
  ASSERT_EQ(handler->threads().size(), 1u);
  EXPECT_NE(handler->threads()[0], std::this_thread::get_id()) << "served on the server's thread";

  ASSERT_TRUE(client->discover(address, 2s).is_ok());
  const auto sent_before = client->counters().sent[static_cast<int>(wire::Op::cancel_batch)];
  auto reply = client->cancel_batch(address, cancels({"t-2", "boom", "refused", "t-9", "t-3"}), 2s);
  ASSERT_TRUE(reply.is_ok()) << reply.status().to_string();
  ASSERT_EQ(reply->items.size(), 5u);
  EXPECT_TRUE(reply->items[0].cancelled);
  EXPECT_EQ(reply->items[1].error.code(), StatusCode::internal);  // a throwing handler fails its item only
  EXPECT_EQ(reply->items[2].error.code(), StatusCode::conflict);
  EXPECT_FALSE(reply->items[3].cancelled);  // nothing held: not an error
  EXPECT_TRUE(reply->items[3].error.is_ok());
  EXPECT_TRUE(reply->items[4].cancelled);
  EXPECT_EQ(handler->reservation_count(), 0u);
  const auto threads = handler->threads();
  ASSERT_EQ(threads.size(), 6u);
  for (std::size_t i = 1; i < threads.size(); ++i) EXPECT_EQ(threads[i], std::this_thread::get_id());
  EXPECT_EQ(client->counters().in_process_calls, 1u);
  EXPECT_EQ(client->counters().sent[static_cast<int>(wire::Op::cancel_batch)], sent_before) << "nothing sent";
  const auto c = shards[0]->counters();
  EXPECT_EQ(c.in_process_cancels, 5u);
  EXPECT_EQ(c.requests[static_cast<int>(wire::Op::cancel_batch)][0], 2u);
  EXPECT_EQ(c.handler_exceptions, 1u);
}

TEST(InProcessCancels, AHandlerThatDoesNotAllowItIsAskedOverTheNetwork) {
  ShardAndClient<TestHandler> s;
  ASSERT_NO_FATAL_FAILURE(s.discover_and_reserve_one());
  auto& [handler, shards, client, address] = s;
  auto reply = client->cancel_batch(address, cancels({"t-1"}), 2s);
  ASSERT_TRUE(reply.is_ok()) << reply.status().to_string();
  EXPECT_TRUE(reply->items[0].cancelled);
  EXPECT_EQ(client->counters().in_process_calls, 0u);
  EXPECT_EQ(client->counters().sent[static_cast<int>(wire::Op::cancel_batch)], 1u);
  EXPECT_EQ(shards[0]->counters().in_process_cancels, 0u);
}

// A server stops only once the in-process cancels running on it returned (they read
// state the server's owner frees after it), and is never called in process after.
TEST(InProcessCancels, StoppingWaitsForTheCallsRunningAndEndsTheShortcut) {
  ShardAndClient<AnywhereHandler> s;
  ASSERT_NO_FATAL_FAILURE(s.discover_and_reserve_one());
  // References, not a structured binding: the lambdas below capture them (clang 14,
  // which clang-tidy uses, cannot capture a binding).
  auto& handler = s.handler;
  auto& shards = s.shards;
  auto& client = s.client;
  auto& address = s.address;

  handler->hold();
  auto running = std::async(std::launch::async, [&] { return client->cancel_batch(address, cancels({"t-1"}), 2s); });
  ASSERT_TRUE(handler->wait_entered(5s));
  std::atomic<bool> returned_before_stop_ended{false};
  auto stopping = std::async(std::launch::async, [&] {
    shards[0]->stop();
    returned_before_stop_ended.store(handler->returned_.load());
  });
  // Give the stop a chance to overtake the cancel it must wait for.
  EXPECT_EQ(stopping.wait_for(50ms), std::future_status::timeout);
  handler->release();
  ASSERT_EQ(stopping.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(returned_before_stop_ended.load());
  auto answered = running.get();
  ASSERT_TRUE(answered.is_ok()) << answered.status().to_string();
  EXPECT_TRUE(answered->items[0].cancelled);
  EXPECT_EQ(client->counters().in_process_calls, 1u);

  // Stopped: the client's cached topology still names it, but nothing in this
  // process serves it; the network has no answer either.
  auto after = client->cancel_batch(address, cancels({"t-1"}), 100ms);
  EXPECT_FALSE(after.is_ok());
  EXPECT_EQ(client->counters().in_process_calls, 1u);
}

TEST(ControlFanOut, EveryShardAnswersConcurrentlyAndFailuresStayPerShard) {
  auto handler = std::make_shared<TestHandler>();
  auto shards = testing::start_shards(1, handler);
  ASSERT_EQ(shards.size(), 1u);
  // Two shards that never answer (hung): asked one after the other they would cost two
  // deadlines. They keep their ports for the whole test: a shard stopped here would free
  // its port, and a listener of a test running beside this one could take it and answer.
  testing::HandDrivenRouter hung_1;
  testing::HandDrivenRouter hung_2;
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  const std::vector<std::string> addresses = {local(shards[0]->port()), local(hung_1.port()), local(hung_2.port())};
  // The deadline is one a loaded 2-core machine meets for the live shard's reply.
  constexpr auto kDeadline = 2s;
  const auto start = std::chrono::steady_clock::now();
  auto results = client->call_all(addresses, wire::StatusRequest{"t-1"}, kDeadline);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].is_ok() && results[0]->ok()) << results[0].status().to_string();
  EXPECT_EQ(results[1].status().code(), StatusCode::timeout);
  EXPECT_EQ(results[2].status().code(), StatusCode::timeout);
  // Concurrent, not one after the other: one deadline, not two.
  EXPECT_LT(elapsed, kDeadline * 7 / 4);
}

TEST(ControlTick, TheSweepRunsEveryIntervalOfTheInjectedClock) {
  auto clock = std::make_shared<ManualClock>();
  auto handler = std::make_shared<TestHandler>();
  ServerOptions o;
  o.clock = clock;
  auto server = testing::must(ControlServer::start(o, handler));
  EXPECT_EQ(server->counters().ticks, 0u);
  clock->advance(1s);
  EXPECT_TRUE(handler->wait_for_ticks(1, 5s));
  clock->advance(1s);
  EXPECT_TRUE(handler->wait_for_ticks(2, 5s));
  EXPECT_EQ(server->counters().ticks, 2u);
}

TEST(ControlServerStart, BindErrorsAreReturned) {
  auto handler = std::make_shared<TestHandler>();
  auto first = testing::must(ControlServer::start(ServerOptions{}, handler));
  ServerOptions clash;
  clash.port = first->port();
  auto second = ControlServer::start(clash, handler);
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), StatusCode::unavailable);
  EXPECT_NE(second.status().message().find("failed to bind"), std::string::npos);
}

TEST(ControlServerStart, Ipv6Loopback) {
  auto handler = std::make_shared<TestHandler>();
  ServerOptions o;
  o.host = "::1";
  auto server = ControlServer::start(o, handler);
  if (!server) GTEST_SKIP() << "no IPv6 loopback here: " << server.status().to_string();
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  auto hello = client->hello("tcp://[::1]:" + std::to_string((*server)->port()), 2s);
  EXPECT_TRUE(hello.is_ok()) << hello.status().to_string();
}

// A pool with room for `free` slots, filled and freed by the test: what reserve_hold
// waits on. Every reserve that finds no room is answered retry (5 ms).
class PoolHandler : public TestHandler {
 public:
  std::vector<wire::ReserveResult> reserve_batch(const RequestContext&,
                                                 std::span<const wire::ReserveItem> items) override {
    std::vector<wire::ReserveResult> out;
    for (std::size_t i = 0; i < items.size(); ++i) {
      attempts.fetch_add(1);
      int left = free.load();
      while (left > 0 && !free.compare_exchange_weak(left, left - 1)) {
      }
      out.push_back(left > 0 ? wire::ReserveResult::reserved(ReservationId(1, 1), 1, 64)
                             : wire::ReserveResult::retry(5));
    }
    return out;
  }
  std::atomic<int> free{0};
  std::atomic<int> attempts{0};
};

struct HeldReserves : ::testing::Test {
  void SetUp() override {
    clock = std::make_shared<ManualClock>();
    handler = std::make_shared<PoolHandler>();
    ServerOptions o;
    o.clock = clock;
    o.tick_interval = 1h;  // no sweep in these tests
    o.reserve_hold = 10s;
    server = testing::must(ControlServer::start(o, handler));
    client = testing::must(ControlClient::create(ClientOptions{}));
    address = local(server->port());
  }
  // Sends a reserve of `n` items; its reply lands in `reply`, and `latch` counts it down.
  void reserve_async(std::size_t n, std::optional<Result<wire::Reply>>& reply, Latch& latch) {
    wire::ReserveBatchRequest request;
    for (std::size_t i = 0; i < n; ++i) request.items.push_back(item("t-" + std::to_string(i)));
    client->call_async(address, request, 20s, [&reply, &latch](Result<wire::Reply> r) {
      reply.emplace(std::move(r));
      latch.count_down();
    });
  }
  // Polls (bounded) until the server holds `n` reserves: held ones answer nothing yet.
  bool until_held(std::uint64_t n) {
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (server->counters().reserves_held < n && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(1ms);
    }
    return server->counters().reserves_held >= n;
  }
  std::shared_ptr<ManualClock> clock;
  std::shared_ptr<PoolHandler> handler;
  std::unique_ptr<ControlServer> server;
  std::unique_ptr<ControlClient> client;
  std::string address;
};

wire::ReserveOutcome outcome_of(const std::optional<Result<wire::Reply>>& reply) {
  if (!reply || !reply->is_ok()) return wire::ReserveOutcome::error;
  const auto* batch = std::get_if<wire::ReserveBatchReply>(&(*reply)->body);
  return batch && batch->items.size() == 1 ? batch->items[0].outcome : wire::ReserveOutcome::error;
}

TEST_F(HeldReserves, AReserveThatDoesNotFitIsAnsweredWhenSpaceFreesNotRetried) {
  std::optional<Result<wire::Reply>> reply;
  Latch latch(1);
  reserve_async(1, reply, latch);
  ASSERT_TRUE(until_held(1));
  EXPECT_FALSE(latch.wait(0ms)) << "held, not answered retry";
  handler->free = 1;
  server->capacity_changed();
  ASSERT_TRUE(latch.wait(10s));
  EXPECT_EQ(outcome_of(reply), wire::ReserveOutcome::reserved);
  const auto c = server->counters();
  EXPECT_EQ(c.held_reserves_placed, 1u);
  EXPECT_EQ(c.held_reserves_expired, 0u);
  EXPECT_EQ(c.reserve_items[static_cast<int>(wire::ReserveOutcome::reserved)], 1u) << "counted once, as answered";
  EXPECT_EQ(c.reserve_items[static_cast<int>(wire::ReserveOutcome::retry)], 0u);
}

TEST_F(HeldReserves, TheOldestHeldReserveGetsTheFirstFreedSlot) {
  std::optional<Result<wire::Reply>> first, second;
  Latch first_done(1), second_done(1);
  reserve_async(1, first, first_done);
  ASSERT_TRUE(until_held(1));
  reserve_async(1, second, second_done);
  ASSERT_TRUE(until_held(2));
  handler->free = 1;
  server->capacity_changed();
  ASSERT_TRUE(first_done.wait(10s));
  EXPECT_EQ(outcome_of(first), wire::ReserveOutcome::reserved);
  EXPECT_FALSE(second_done.wait(0ms)) << "still held: nothing left for it";
  handler->free = 1;
  server->capacity_changed();
  ASSERT_TRUE(second_done.wait(10s));
  EXPECT_EQ(outcome_of(second), wire::ReserveOutcome::reserved);
}

TEST_F(HeldReserves, AHoldEndsWithRetryAfterAtItsDeadlineOrAtStop) {
  std::optional<Result<wire::Reply>> expired, stopped;
  Latch expired_done(1), stopped_done(1);
  reserve_async(1, expired, expired_done);
  ASSERT_TRUE(until_held(1));
  clock->advance(11s);         // past the 10 s hold
  server->capacity_changed();  // wakes the server, which finds the pool still full
  ASSERT_TRUE(expired_done.wait(10s));
  EXPECT_EQ(outcome_of(expired), wire::ReserveOutcome::retry);
  EXPECT_EQ(server->counters().held_reserves_expired, 1u);
  reserve_async(1, stopped, stopped_done);
  ASSERT_TRUE(until_held(2));
  server->stop();
  ASSERT_TRUE(stopped_done.wait(10s)) << "answered at stop, not left to the client's timeout";
  EXPECT_EQ(outcome_of(stopped), wire::ReserveOutcome::retry);
}

TEST_F(HeldReserves, ABatchWithAnItemThatFitsIsAnsweredAtOnce) {
  handler->free = 1;
  std::optional<Result<wire::Reply>> reply;
  Latch latch(1);
  reserve_async(2, reply, latch);
  ASSERT_TRUE(latch.wait(10s));
  ASSERT_TRUE(reply && reply->is_ok());
  const auto& items = std::get<wire::ReserveBatchReply>((*reply)->body).items;
  ASSERT_EQ(items.size(), 2u);
  EXPECT_EQ(items[0].outcome, wire::ReserveOutcome::reserved);
  EXPECT_EQ(items[1].outcome, wire::ReserveOutcome::retry);
  EXPECT_EQ(server->counters().reserves_held, 0u);
}

}  // namespace
}  // namespace ecx::control
