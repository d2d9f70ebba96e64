#include <unistd.h>

#include <chrono>
#include <ctime>
#include <limits>
#include <span>
#include <thread>

#include <gtest/gtest.h>
#include <msgpack.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "control_test_util.h"
#include "ecx/control/client.h"
#include "ecx/control/event_inbox.h"
#include "ecx/control/server.h"
#include "ecx/wire/codec.h"

namespace ecx::control {
namespace {

using namespace std::chrono_literals;
using testing::local;
using testing::TestHandler;

wire::Event ready_event(const std::string& transfer_id) {
  wire::Event e;
  e.kind = wire::EventKind::ready;
  e.transfer_id = transfer_id;
  e.mm_hash = "hash-1";
  e.reservation_id = ReservationId(1, 2);
  e.generation = 3;
  e.spec = testing::spec({4, 8});
  return e;
}

// Waits (bounded) until `count` events have arrived.
std::vector<wire::Event> collect(EventInbox& inbox, std::size_t count, std::chrono::milliseconds max_wait = 5000ms) {
  std::vector<wire::Event> out;
  const auto deadline = std::chrono::steady_clock::now() + max_wait;
  while (out.size() < count && std::chrono::steady_clock::now() < deadline) {
    inbox.wait_and_drain(out, std::chrono::duration_cast<Duration>(deadline - std::chrono::steady_clock::now()));
  }
  return out;
}

// Waits (bounded) until the inbox has installed its subscription.
bool wait_subscribed(EventInbox& inbox, std::vector<wire::Event>& out, std::chrono::milliseconds max_wait = 5000ms) {
  const auto deadline = std::chrono::steady_clock::now() + max_wait;
  while (!inbox.subscribed() && std::chrono::steady_clock::now() < deadline) inbox.wait_and_drain(out, 20ms);
  return inbox.subscribed();
}

std::unique_ptr<EventInbox> make_inbox(ControlClient& client, const std::string& base, const std::string& secret = "",
                                       bool in_process = true) {
  InboxOptions o;
  o.base_address = base;
  o.auth_secret = secret;
  o.in_process = in_process;
  o.discovery_timeout = 2s;
  return testing::must(EventInbox::create(client, o));
}

// One shard's control server, a client, and an inbox on that shard's events.
struct Subscribed {
  explicit Subscribed(bool in_process)
      : server(testing::must(ControlServer::start(ServerOptions{}, std::make_shared<TestHandler>()))),
        client(testing::must(ControlClient::create(ClientOptions{}))),
        inbox(make_inbox(*client, local(server->port()), "", in_process)) {}
  bool subscribe() { return wait_subscribed(*inbox, out); }
  // Publishes one event from another thread; true once inbox->wait(.., also) said it
  // came (bounded: 10 s only stops a broken build from hanging).
  bool publish_and_wait(const std::string& transfer_id, std::span<const WakeSource> also = {}) {
    std::thread publisher([&] { EXPECT_TRUE(server->publish(ready_event(transfer_id)).is_ok()); });
    bool arrived = false;
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!arrived && std::chrono::steady_clock::now() < deadline) arrived = inbox->wait(100ms, also);
    publisher.join();
    return arrived;
  }
  std::unique_ptr<ControlServer> server;
  std::unique_ptr<ControlClient> client;
  std::unique_ptr<EventInbox> inbox;
  std::vector<wire::Event> out;
};

TEST(ControlEvents, ReadinessFromEveryShardReachesTheInbox) {
  auto handler = std::make_shared<TestHandler>();
  auto shards = testing::start_shards(2, handler);
  ASSERT_EQ(shards.size(), 2u);
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  auto inbox = make_inbox(*client, local(shards[0]->port()));

  std::vector<wire::Event> none;
  EXPECT_EQ(inbox->drain(none), 0u) << "drain never waits for the discovery";
  ASSERT_TRUE(shards[0]->publish(ready_event("t-0")).is_ok());
  ASSERT_TRUE(shards[1]->publish(ready_event("t-1")).is_ok());
  auto events = collect(*inbox, 2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_TRUE(inbox->subscribed());
  EXPECT_EQ(inbox->shard_count(), 2u);
  std::sort(events.begin(), events.end(), [](auto& a, auto& b) { return a.shard < b.shard; });
  EXPECT_EQ(events[0].transfer_id, "t-0");
  EXPECT_EQ(events[0].shard, 0u);
  EXPECT_EQ(events[0].instance, shards[0]->instance());
  EXPECT_EQ(events[1].transfer_id, "t-1");
  EXPECT_EQ(events[1].shard, 1u);
  EXPECT_EQ(events[1].spec, testing::spec({4, 8}));
  EXPECT_EQ(inbox->counters().received[static_cast<int>(wire::EventKind::ready)], 2u);
  EXPECT_EQ(shards[0]->counters().events_sent, 1u);
}

TEST(ControlEvents, ShardsInThisProcessHandOverInMemoryAndTheNetworkPathStaysAvailable) {
  for (const bool in_process : {true, false}) {
    auto handler = std::make_shared<TestHandler>();
    auto shards = testing::start_shards(2, handler);
    ASSERT_EQ(shards.size(), 2u);
    auto client = testing::must(ControlClient::create(ClientOptions{}));
    auto inbox = make_inbox(*client, local(shards[0]->port()), "", in_process);
    std::vector<wire::Event> out;
    ASSERT_TRUE(wait_subscribed(*inbox, out));
    for (int i = 0; i < 6; ++i) ASSERT_TRUE(shards[i % 2]->publish(ready_event("t-" + std::to_string(i))).is_ok());
    auto events = collect(*inbox, 6);
    ASSERT_EQ(events.size(), 6u) << "in_process=" << in_process;
    std::vector<std::string> from_shard_0;
    for (const auto& e : events) {
      if (e.shard == 0) from_shard_0.push_back(e.transfer_id);
      EXPECT_EQ(e.instance, shards[e.shard]->instance());
    }
    EXPECT_EQ(from_shard_0, (std::vector<std::string>{"t-0", "t-2", "t-4"})) << "one shard's events keep their order";
    const auto c = inbox->counters();
    EXPECT_EQ(c.received[static_cast<int>(wire::EventKind::ready)], 6u);
    EXPECT_EQ(c.received_in_process, in_process ? 6u : 0u);
    EXPECT_EQ(shards[0]->counters().events_sent + shards[1]->counters().events_sent, 6u);
  }
}

// Shards of this process share one in-memory queue; each keeps the bound its own queue
// has on the network path, so one shard's backlog does not crowd out the other's.
TEST(ControlEvents, EachShardInThisProcessKeepsItsOwnEventBound) {
  auto handler = std::make_shared<TestHandler>();
  auto shards = testing::start_shards(2, handler);
  ASSERT_EQ(shards.size(), 2u);
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  InboxOptions o;
  o.base_address = local(shards[0]->port());
  o.discovery_timeout = 2s;
  o.max_events_per_drain = 4;  // the configured event_queue_max
  auto inbox = testing::must(EventInbox::create(*client, o));
  std::vector<wire::Event> out;
  ASSERT_TRUE(wait_subscribed(*inbox, out));
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(shards[i % 2]->publish(ready_event("t-" + std::to_string(i))).is_ok());
  auto events = collect(*inbox, 8);
  EXPECT_EQ(events.size(), 8u);
  EXPECT_EQ(shards[0]->counters().events_dropped + shards[1]->counters().events_dropped, 0u);
}

TEST(ControlEvents, EventsQueuedBeforeAnInProcessSubscriptionAreHandedOverWhenItComes) {
  auto handler = std::make_shared<TestHandler>();
  auto server = testing::must(ControlServer::start(ServerOptions{}, handler));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(server->publish(ready_event("early-" + std::to_string(i))).is_ok());
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  auto inbox = make_inbox(*client, local(server->port()));
  std::vector<wire::Event> out;
  ASSERT_TRUE(wait_subscribed(*inbox, out));
  ASSERT_TRUE(server->publish(ready_event("late")).is_ok());
  auto events = collect(*inbox, 4 - out.size());
  events.insert(events.begin(), out.begin(), out.end());
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].transfer_id, "early-0");
  EXPECT_EQ(events[2].transfer_id, "early-2");
  EXPECT_EQ(events[3].transfer_id, "late") << "nothing overtakes what waited";
  EXPECT_EQ(inbox->counters().received_in_process, 4u);
}

TEST(ControlEvents, AWaitingInboxWakesForAnInProcessEvent) {
  auto handler = std::make_shared<TestHandler>();
  auto server = testing::must(ControlServer::start(ServerOptions{}, handler));
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  auto inbox = make_inbox(*client, local(server->port()));
  std::vector<wire::Event> out;
  ASSERT_TRUE(wait_subscribed(*inbox, out));
  std::thread publisher([&] { EXPECT_TRUE(server->publish(ready_event("t-wake")).is_ok()); });
  // Returns with the event whether it was published before the wait began or during
  // it (the 10 s bound only stops a broken build from hanging).
  inbox->wait_and_drain(out, 10s);
  publisher.join();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].transfer_id, "t-wake");
}

// wait() tells an engine loop that an event came, without taking it: drain() then
// hands it on. With nothing published it returns false at its deadline.
TEST(ControlEvents, WaitReportsAnArrivedEventWithoutTakingIt) {
  for (const bool in_process : {true, false}) {
    Subscribed s(in_process);
    auto& inbox = s.inbox;
    auto& out = s.out;
    ASSERT_TRUE(s.subscribe());
    EXPECT_FALSE(inbox->wait(1ms)) << "nothing published; in_process=" << in_process;
    ASSERT_TRUE(s.publish_and_wait("t-waited")) << "in_process=" << in_process;
    EXPECT_TRUE(inbox->wait(0ms)) << "the event is still there until drained";
    ASSERT_EQ(inbox->drain(out), 1u);
    EXPECT_EQ(out[0].transfer_id, "t-waited");
    EXPECT_EQ(inbox->counters().received_in_process, in_process ? 1u : 0u);
  }
}

// An engine loop waits for transfer events and for its own requests in one call:
// wait(max, also) returns true when a caller's source polls readable (a ZeroMQ
// socket or a plain fd) as well as for an event, whether the shard is in this
// process or not, and before the subscription exists.
TEST(ControlEvents, WaitAlsoWakesForTheCallersOwnSources) {
  for (const bool in_process : {true, false}) {
    Subscribed s(in_process);
    auto& inbox = s.inbox;
    auto& out = s.out;
    ASSERT_TRUE(s.subscribe());
    zmq::context_t context;
    zmq::socket_t requests(context, zmq::socket_type::pull);
    requests.bind("inproc://requests");
    zmq::socket_t sender(context, zmq::socket_type::push);
    sender.connect("inproc://requests");
    int pipe_fds[2] = {-1, -1};
    ASSERT_EQ(::pipe(pipe_fds), 0);
    const WakeSource sources[] = {WakeSource{requests.handle()}, WakeSource{nullptr, pipe_fds[0]}};
    const std::span<const WakeSource> also(sources);
    EXPECT_FALSE(inbox->wait(1ms, also)) << "nothing published, nothing sent; in_process=" << in_process;

    // The caller's socket: a wake with no event behind it. (Each bounded wait below
    // returns true only for what it waits for; at its 10 s deadline it says false.)
    std::thread request([&] { sender.send(zmq::str_buffer("request"), zmq::send_flags::none); });
    EXPECT_TRUE(inbox->wait(10s, also)) << "in_process=" << in_process;
    request.join();
    EXPECT_EQ(inbox->drain(out), 0u);
    zmq::message_t taken;
    ASSERT_TRUE(requests.recv(taken, zmq::recv_flags::dontwait));

    // A plain fd.
    std::thread writer([&] { EXPECT_EQ(::write(pipe_fds[1], "x", 1), 1); });
    EXPECT_TRUE(inbox->wait(10s, also)) << "in_process=" << in_process;
    writer.join();
    char byte = 0;
    ASSERT_EQ(::read(pipe_fds[0], &byte, 1), 1);

    // An event, with the caller's sources quiet.
    ASSERT_TRUE(s.publish_and_wait("t-also", also)) << "in_process=" << in_process;
    ASSERT_EQ(inbox->drain(out), 1u);
    EXPECT_EQ(out[0].transfer_id, "t-also");
    EXPECT_FALSE(inbox->wait(1ms, also)) << "everything taken; in_process=" << in_process;
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
  }
  // No subscription yet (nothing listens there): the caller's own source still wakes it.
  const std::string nobody = testing::closed_address();
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  auto inbox = make_inbox(*client, nobody);
  int pipe_fds[2] = {-1, -1};
  ASSERT_EQ(::pipe(pipe_fds), 0);
  ASSERT_EQ(::write(pipe_fds[1], "x", 1), 1);
  const WakeSource readable{nullptr, pipe_fds[0]};
  EXPECT_TRUE(inbox->wait(10s, std::span(&readable, 1)));
  EXPECT_FALSE(inbox->subscribed());
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
}

// A caller's source that cannot be polled (an fd that is not open) is dropped from
// the wait: an event still wakes it, and the wait does not spin a core until its
// deadline (polling such an fd returns at once, every time).
TEST(ControlEvents, ACallersSourceInErrorIsDroppedFromTheWait) {
  const auto thread_cpu = [] {
    timespec t{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return std::chrono::seconds(t.tv_sec) + std::chrono::nanoseconds(t.tv_nsec);
  };
  for (const bool in_process : {true, false}) {
    Subscribed s(in_process);
    ASSERT_TRUE(s.subscribe());
    const WakeSource not_open{nullptr, std::numeric_limits<int>::max()};
    const std::span<const WakeSource> also(&not_open, 1);
    const auto cpu_before = thread_cpu();
    EXPECT_FALSE(s.inbox->wait(300ms, also)) << "in_process=" << in_process;
    EXPECT_LT(thread_cpu() - cpu_before, 100ms) << "the wait spun; in_process=" << in_process;
    ASSERT_TRUE(s.publish_and_wait("t-despite", also)) << "in_process=" << in_process;
    ASSERT_EQ(s.inbox->drain(s.out), 1u);
    EXPECT_EQ(s.out[0].transfer_id, "t-despite");
  }
}

TEST(ControlEvents, AShardOfThisProcessThatRestartsIsFoundAgain) {
  auto handler = std::make_shared<TestHandler>();
  auto server = testing::must(ControlServer::start(ServerOptions{}, handler));
  const int port = server->port();
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  auto inbox = make_inbox(*client, local(port));
  std::vector<wire::Event> out;
  ASSERT_TRUE(wait_subscribed(*inbox, out));
  ASSERT_TRUE(server->publish(ready_event("before")).is_ok());
  server.reset();  // its event, already handed over, is not lost
  EXPECT_EQ(collect(*inbox, 1).at(0).transfer_id, "before");
  EXPECT_FALSE(inbox->subscribed()) << "a stopped shard's successor is a new instance: discovered again";
  ServerOptions again;
  again.port = port;
  auto successor = testing::must(ControlServer::start(again, handler));
  ASSERT_TRUE(wait_subscribed(*inbox, out));
  ASSERT_TRUE(successor->publish(ready_event("after")).is_ok());
  const auto events = collect(*inbox, 1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].transfer_id, "after");
  EXPECT_EQ(events[0].instance, successor->instance());
  EXPECT_EQ(inbox->counters().received_in_process, 2u);
}

TEST(ControlEvents, PublishRefusesAnEventThatCannotBeSent) {
  auto handler = std::make_shared<TestHandler>();
  auto server = testing::must(ControlServer::start(ServerOptions{}, handler));
  wire::Event e = ready_event("t-1");
  e.spec.reset();
  EXPECT_EQ(server->publish(e).code(), StatusCode::invalid_argument);
  EXPECT_EQ(server->publish(ready_event("bad id")).code(), StatusCode::invalid_argument);
}

TEST(ControlEvents, AFullQueueDropsTheOldestAndCountsThem) {
  auto handler = std::make_shared<TestHandler>();
  ServerOptions o;
  o.event_queue_max = 4;
  auto server = testing::must(ControlServer::start(o, handler));
  // Nobody is connected yet, so nothing can leave the queue.
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(server->publish(ready_event("t-" + std::to_string(i))).is_ok());
  // The server's thread may hold the oldest event outside the queue while it finds
  // that no puller takes it; it drops that one as soon as it sees the queue full.
  const auto settle_by = std::chrono::steady_clock::now() + 5s;
  while (server->counters().events_dropped < 6 && std::chrono::steady_clock::now() < settle_by) {
    std::this_thread::yield();
  }
  EXPECT_EQ(server->counters().events_dropped, 6u);
  EXPECT_EQ(server->counters().events_published, 10u);

  auto client = testing::must(ControlClient::create(ClientOptions{}));
  auto inbox = make_inbox(*client, local(server->port()));
  auto events = collect(*inbox, 4);
  ASSERT_EQ(events.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(events[i].transfer_id, "t-" + std::to_string(6 + i)) << "the newest survive";
}

TEST(ControlEvents, UndiscoverableConsumerLeavesTheInboxEmptyAndRetriesLater) {
  const std::string address = testing::closed_address();
  auto clock = std::make_shared<ManualClock>();
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  InboxOptions o;
  o.base_address = address;
  o.discovery_timeout = 50ms;
  o.retry_interval = 10s;
  o.clock = clock;
  auto inbox = testing::must(EventInbox::create(*client, o));
  std::vector<wire::Event> out;
  EXPECT_EQ(inbox->wait_and_drain(out, 5s), 0u);  // both discovery attempts time out
  EXPECT_FALSE(inbox->subscribed());
  EXPECT_EQ(inbox->drain(out), 0u);  // records the failure
  EXPECT_EQ(inbox->counters().discoveries_failed, 1u);
  EXPECT_EQ(inbox->drain(out), 0u);
  EXPECT_EQ(inbox->counters().discoveries_started, 1u) << "no new attempt before the retry interval";
  clock->advance(10s);
  EXPECT_EQ(inbox->drain(out), 0u);
  EXPECT_EQ(inbox->counters().discoveries_started, 2u);
}

// A fake shard: answers hello by hand and pushes whatever bytes the test wants.
struct FakeShard {
  FakeShard() : router(ctx, zmq::socket_type::router), push(ctx, zmq::socket_type::push) {
    router.set(zmq::sockopt::linger, 0);
    push.set(zmq::sockopt::linger, 0);
    router.bind("tcp://127.0.0.1:*");
    push.bind("tcp://127.0.0.1:*");
    port = std::stoi(router.get(zmq::sockopt::last_endpoint).substr(16));
    event_port = std::stoi(push.get(zmq::sockopt::last_endpoint).substr(16));
  }
  // Answers `n` hello requests (bounded wait for each).
  bool answer_hellos(int n) {
    for (int i = 0; i < n; ++i) {
      zmq::pollitem_t item{router.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::chrono::milliseconds(5000)) != 1) return false;
      std::vector<zmq::message_t> parts;
      (void)zmq::recv_multipart(router, std::back_inserter(parts));
      auto request = wire::decode_request(parts.at(1).to_string_view(), wire::Limits{});
      if (!request) return false;
      wire::HelloReply hello;
      hello.control_ports = {static_cast<std::uint32_t>(port)};
      hello.event_port = static_cast<std::uint32_t>(event_port);
      hello.instance = "fake";
      wire::Reply reply;
      reply.id = request->request.id;
      reply.op = wire::Op::hello;
      reply.body = hello;
      std::string frame;
      wire::encode_reply(reply, nullptr, frame);
      router.send(zmq::buffer(parts[0].to_string_view()), zmq::send_flags::sndmore);
      router.send(zmq::buffer(frame), zmq::send_flags::none);
    }
    return true;
  }
  zmq::context_t ctx;
  zmq::socket_t router;
  zmq::socket_t push;
  int port = 0;
  int event_port = 0;
};

TEST(ControlEvents, MalformedAndUnknownEventsAreCountedAndDropped) {
  FakeShard shard;
  auto client = testing::must(ControlClient::create(ClientOptions{}));
  auto inbox = make_inbox(*client, local(shard.port));
  std::vector<wire::Event> out;
  inbox->drain(out);                    // starts the discovery
  ASSERT_TRUE(shard.answer_hellos(2));  // base, then every shard
  ASSERT_TRUE(wait_subscribed(*inbox, out));
  shard.push.set(zmq::sockopt::sndtimeo, 5000);  // a broken test fails instead of hanging

  std::string good;
  wire::Event e = ready_event("t-good");
  e.instance = "fake";
  wire::encode_event(e, nullptr, good);
  msgpack::sbuffer unknown;
  {
    msgpack::packer<msgpack::sbuffer> pk(unknown);
    pk.pack_map(5);
    pk.pack(std::string("v"));
    pk.pack(1);
    pk.pack(std::string("ev"));
    pk.pack(std::string("teleported"));
    pk.pack(std::string("shard"));
    pk.pack(0);
    pk.pack(std::string("instance"));
    pk.pack(std::string("fake"));
    pk.pack(std::string("body"));
    pk.pack_map(0);
  }
  const std::vector<std::string> frames = {std::string("\x93\x01", 2), "", good.substr(0, good.size() / 2),
                                           std::string(unknown.data(), unknown.size()), good};
  for (const auto& f : frames) shard.push.send(zmq::buffer(f), zmq::send_flags::none);
  shard.push.send(zmq::str_buffer("two"), zmq::send_flags::sndmore);
  shard.push.send(zmq::str_buffer("parts"), zmq::send_flags::none);
  shard.push.send(zmq::buffer(good), zmq::send_flags::none);

  auto events = collect(*inbox, 2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].transfer_id, "t-good");
  const auto c = inbox->counters();
  EXPECT_EQ(c.malformed, 4u);
  EXPECT_EQ(c.unknown, 1u);
}

TEST(ControlEvents, AuthenticatedEventsNeedTheRightKey) {
  // One inbox per server: a PUSH socket only sends to pullers that are connected, so
  // each inbox deterministically sees every event of its own server.
  for (const std::string inbox_secret : {"shared", "not-shared"}) {
    auto handler = std::make_shared<TestHandler>();
    ServerOptions so;
    so.auth_secret = "shared";
    auto server = testing::must(ControlServer::start(so, handler));
    ClientOptions co;
    co.auth_secret = "shared";  // discovery itself is authenticated by the client
    auto client = testing::must(ControlClient::create(co));
    auto inbox = make_inbox(*client, local(server->port()), inbox_secret);
    std::vector<wire::Event> out;
    ASSERT_TRUE(wait_subscribed(*inbox, out)) << inbox_secret;
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(server->publish(ready_event("t-" + std::to_string(i))).is_ok());
    if (inbox_secret == "shared") {
      EXPECT_EQ(collect(*inbox, 10).size(), 10u);
      EXPECT_EQ(inbox->counters().auth_failures, 0u);
      continue;
    }
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (inbox->counters().auth_failures < 10 && std::chrono::steady_clock::now() < deadline) {
      inbox->wait_and_drain(out, 50ms);
    }
    EXPECT_TRUE(out.empty());
    EXPECT_EQ(inbox->counters().auth_failures, 10u);
    EXPECT_EQ(inbox->counters().received_in_process, 0u) << "another key never takes the in-memory path";
  }
}

}  // namespace
}  // namespace ecx::control
