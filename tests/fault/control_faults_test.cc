// Faults on the control plane of one consumer shard: a relay that drops, duplicates,
// reorders and corrupts ZeroMQ frames between the producer's control client and the
// shard (requests, replies and readiness events), and hostile requests sent straight
// to the shard's control socket. Real ZeroMQ and UCX over loopback; the shard's
// deadlines run on a manual clock.
#include <cstring>
#include <future>
#include <map>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include <xxhash.h>
#include <msgpack.hpp>

#include "ecx/consumer/consumer_shard.h"
#include "ecx/control/client.h"
#include "ecx/control/event_inbox.h"
#include "ecx/transport/ucx_transport.h"
#include "ecx/wire/payload_header.h"
#include "fault_support.h"
#include "frame_relay.h"
#include "sim/workload.h"

namespace ecx::fault {
namespace {

using namespace std::chrono_literals;
constexpr std::uint64_t kKiB = 1024;

TensorSpec bytes_spec(std::uint64_t n) {
  return TensorSpec::make({static_cast<std::int64_t>(n)}, DType::uint8, ~0ULL).value();
}

// The data plane of a producer: a UCX transport of its own sending payloads of
// deterministic content (sim::fill_content) to the shard, with honest headers.
class PayloadSender {
 public:
  explicit PayloadSender(const std::string& data_address, std::uint64_t capacity) : source_(capacity) {
    transport::UcxOptions ucx;
    ucx.resolver = [](std::span<const std::byte>, std::uint64_t) -> Result<transport::Landing> {
      return unavailable("the sender accepts no payloads");
    };
    ucx.on_landing = [](std::span<const std::byte>, const transport::Landing&, const Status&) {};
    auto sender = transport::create_ucx_transport(std::move(ucx));
    EXPECT_TRUE(sender) << sender.status().to_string();
    if (!sender) return;
    transport_ = std::move(*sender);
    auto region = transport_->register_region(source_.data(), source_.size(), transport::MemoryKind::host);
    EXPECT_TRUE(region) << region.status().to_string();
    region_ = region.value_or(transport::RegionHandle{});
    auto endpoint = transport_->connect(data_address);
    EXPECT_TRUE(endpoint) << endpoint.status().to_string();
    endpoint_ = endpoint.value_or(transport::EndpointHandle{});
  }

  Status send(const std::string& tid, const std::string& hash, const wire::ReserveResult& r, std::uint64_t n) {
    if (!transport_) return unavailable("no transport");
    sim::fill_content(hash, std::span<std::byte>(source_.data(), n));
    const wire::PayloadHeader header{tid, r.reservation_id, r.generation, n, XXH64(source_.data(), n, 0)};
    auto done = std::make_shared<std::promise<Status>>();
    auto future = done->get_future();
    const auto bytes = wire::encode_payload_header(header);
    auto s = transport_->send(endpoint_, bytes, region_, 0, n, SteadyClock::shared()->now() + 10s,
                              [done](Status status) { done->set_value(std::move(status)); });
    if (!s) return s;
    return future.get();
  }

 private:
  std::vector<std::byte> source_;
  std::unique_ptr<transport::Transport> transport_;
  transport::RegionHandle region_;
  transport::EndpointHandle endpoint_;
};

// Polls (bounded, real time) until `done` holds; the shard's expiry sweep runs on its
// control thread's one-second tick.
template <typename F>
bool eventually(F done, std::chrono::milliseconds limit = 5s) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return done();
}

// 7. Every control frame and event between a producer and a shard may be dropped,
// duplicated, held back behind the next one, or have bytes flipped (authentication
// off, so a corrupted frame may even decode as a different, valid request). The
// producer retries as the real one does (reserve is idempotent); the consumer takes
// whatever its events announce. Nothing crashes, every delivery is bit-exact
// (checksums on), and once the reservation TTL has passed the pool holds only
// resident copies: nothing leaked, no live record left, every transfer resolved.
TEST(ControlChaos, MangledFramesNeverCorruptADeliveryOrLeakThePool) {
  const int port = free_port_block(1);
  ASSERT_NE(port, 0);
  constexpr double kTtl = 2.0;
  auto clock = std::make_shared<ManualClock>();
  auto config = consumer_config(1, port, "32MiB", {{"reservation_ttl_s", kTtl}});
  auto shard = consumer::ConsumerShard::start(config, clock);
  ASSERT_TRUE(shard) << shard.status().to_string();
  auto& s = **shard;

  FrameRelay relay(s.control_endpoint(), s.event_endpoint(),
                   FrameFaults{.drop = 0.1, .duplicate = 0.1, .reorder = 0.1, .corrupt = 0.1}, /*seed=*/7);
  auto client_options = control::ClientOptions::from_config(config);
  client_options.default_timeout = 300ms;
  auto client = control::ControlClient::create(client_options);
  ASSERT_TRUE(client) << client.status().to_string();
  control::InboxOptions inbox_options;
  inbox_options.base_address = relay.control_endpoint();
  inbox_options.discovery_timeout = 300ms;
  inbox_options.retry_interval = 100ms;
  auto inbox = control::EventInbox::create(**client, inbox_options);
  ASSERT_TRUE(inbox) << inbox.status().to_string();
  PayloadSender sender(s.data_address(), 1 << 20);

  // 40 transfers of 24 contents (some repeat: followers and resident hits), 4 KiB
  // (eager) to 256 KiB (rendezvous).
  struct Transfer {
    std::string hash;
    std::uint64_t bytes = 0;
    bool announced = false;  // the producer saw reserved or ready
  };
  std::map<std::string, Transfer> transfers;
  for (int i = 0; i < 40; ++i) {
    const int content = i % 24;
    transfers["chaos-" + std::to_string(i)] =
        Transfer{"chaos-h" + std::to_string(content), (content % 5 == 0 ? 4 : 16 + 24 * (content % 10)) * kKiB};
  }
  std::vector<wire::Event> events;
  for (auto& [tid, t] : transfers) {
    for (int attempt = 0; attempt < 8; ++attempt) {
      auto reply = (*client)->reserve_batch(relay.control_endpoint(),
                                            {wire::ReserveItem{tid, t.hash, bytes_spec(t.bytes), std::nullopt}}, 300ms);
      if (!reply || reply->items.size() != 1) continue;  // lost, late or mangled: ask again
      const auto& r = reply->items[0];
      if (r.outcome == wire::ReserveOutcome::retry) {
        std::this_thread::sleep_for(std::chrono::milliseconds(r.retry_after_ms));
        continue;
      }
      if (r.outcome == wire::ReserveOutcome::reserved && r.write) {
        // A refused payload (e.g. a duplicate reserve raced it) is retried too.
        if (!sender.send(tid, t.hash, r, t.bytes)) continue;
      }
      t.announced = r.outcome == wire::ReserveOutcome::reserved || r.outcome == wire::ReserveOutcome::ready;
      break;
    }
    (*inbox)->drain(events);
  }
  // Collect the readiness events that make it through (bounded wait).
  const auto until = std::chrono::steady_clock::now() + 3s;
  while (std::chrono::steady_clock::now() < until) (*inbox)->wait_and_drain(events, 100ms);

  std::set<std::string> served;
  std::uint64_t corrupted_deliveries = 0;
  for (const auto& event : events) {
    if (event.kind != wire::EventKind::ready || served.count(event.transfer_id) != 0) continue;
    auto lease = s.take(event.transfer_id, event.mm_hash);
    if (!lease) continue;  // a mangled event names a transfer or hash that is not READY
    const auto it = transfers.find(event.transfer_id);
    const bool intact = it != transfers.end() && lease->nbytes() == it->second.bytes &&
                        sim::content_matches(event.mm_hash, std::span<const std::byte>(lease->data(), lease->nbytes()));
    if (!intact) ++corrupted_deliveries;
    served.insert(event.transfer_id);
  }
  EXPECT_EQ(corrupted_deliveries, 0U);
  EXPECT_GT(served.size(), 0U) << "no transfer got through at all";

  // Past every deadline: READY records nobody took expire, so do phantom
  // reservations a corrupted frame created; the pool keeps only resident copies.
  relay.calm();
  clock->advance(seconds_to_duration(kTtl) + 1s);
  EXPECT_TRUE(eventually([&] { return s.counters().reservations.live_records == 0; }))
      << s.counters().reservations.live_records << " records still live";
  const auto c = s.counters();
  EXPECT_EQ(c.reservations.writers, 0U);
  EXPECT_EQ(c.reservations.pool_used_bytes, c.reservations.resident_bytes) << "pool bytes leaked";
  EXPECT_EQ(c.reservations.checksum_mismatches, 0U);
  EXPECT_TRUE(s.check_invariants()) << s.check_invariants().to_string();
  // Every transfer resolved: served, or terminal (or forgotten) on the consumer.
  for (const auto& [tid, t] : transfers) {
    if (served.count(tid) != 0) continue;
    auto reply = (*client)->status(s.control_endpoint(), tid, 2s);
    ASSERT_TRUE(reply) << reply.status().to_string();
    if (reply->found) {
      EXPECT_TRUE(reply->state == "expired" || reply->state == "cancelled" || reply->state == "failed")
          << tid << " is " << reply->state;
    }
  }
  // The relay did all four things to the traffic.
  EXPECT_GT(relay.counters().dropped.load(), 0U);
  EXPECT_GT(relay.counters().duplicated.load(), 0U);
  EXPECT_GT(relay.counters().reordered.load(), 0U);
  EXPECT_GT(relay.counters().corrupted.load(), 0U);
  // The shard still answers.
  EXPECT_TRUE((*client)->hello(s.control_endpoint(), 2s));
  s.shutdown();
}

// A reserve_batch frame built by hand, so it can say what no honest encoder would.
std::string raw_reserve(std::uint64_t id, const std::string& tid, const std::string& hash, std::int64_t nbytes,
                        const std::vector<std::int64_t>& shape, const std::string& dtype) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(4);
  pk.pack(std::string("v"));
  pk.pack(wire::kProtocolVersion);
  pk.pack(std::string("id"));
  pk.pack(id);
  pk.pack(std::string("op"));
  pk.pack(std::string(wire::op_name(wire::Op::reserve_batch)));
  pk.pack(std::string("body"));
  pk.pack_map(1);
  pk.pack(std::string("items"));
  pk.pack_array(1);
  pk.pack_map(5);
  pk.pack(std::string("transfer_id"));
  pk.pack(tid);
  pk.pack(std::string("mm_hash"));
  pk.pack(hash);
  pk.pack(std::string("nbytes"));
  pk.pack(nbytes);
  pk.pack(std::string("shape"));
  pk.pack(shape);
  pk.pack(std::string("dtype"));
  pk.pack(dtype);
  return std::string(buffer.data(), buffer.size());
}

class HostileInput : public ::testing::Test {
 protected:
  void start(const json& overrides) {
    const int port = free_port_block(1);
    ASSERT_NE(port, 0);
    config_ = consumer_config(1, port, "16MiB", overrides);
    auto shard = consumer::ConsumerShard::start(config_);
    ASSERT_TRUE(shard) << shard.status().to_string();
    shard_ = std::move(*shard);
    socket_.set(zmq::sockopt::linger, 0);
    socket_.connect(shard_->control_endpoint());
  }
  void TearDown() override {
    if (shard_) shard_->shutdown();
  }

  // Sends one raw frame and returns the decoded reply, or nullopt after `timeout`.
  std::optional<wire::Reply> exchange(const std::string& frame, std::chrono::milliseconds timeout = 2s) {
    zmq::message_t message(frame.data(), frame.size());
    if (!socket_.send(message, zmq::send_flags::none)) return std::nullopt;
    zmq::pollitem_t item{static_cast<void*>(socket_), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, timeout) <= 0) return std::nullopt;
    zmq::message_t reply;
    if (!socket_.recv(reply, zmq::recv_flags::dontwait)) return std::nullopt;
    auto decoded = wire::decode_reply(reply.to_string_view(), wire::Limits{});
    if (!decoded) return std::nullopt;
    return *decoded;
  }

  // Nothing reserved, nothing held: what every refused request must leave behind.
  void expect_untouched() {
    const auto c = shard_->counters().reservations;
    EXPECT_EQ(c.live_records, 0U);
    EXPECT_EQ(c.pool_used_bytes, 0U);
    EXPECT_EQ(c.bytes_reserved, 0U);
    EXPECT_EQ(c.reserved_writer, 0U);
    EXPECT_TRUE(shard_->check_invariants()) << shard_->check_invariants().to_string();
  }

  Config config_;
  std::unique_ptr<consumer::ConsumerShard> shard_;
  zmq::context_t context_{1};
  zmq::socket_t socket_{context_, zmq::socket_type::dealer};
};

// 8a. Authentication on: a reserve or a cancel without the key (or with the wrong
// one) is refused before the handler sees it, and changes nothing; the right key
// still works afterwards.
TEST_F(HostileInput, UnauthenticatedReserveAndCancelAreRejectedAndChangeNothing) {
  start({{"auth_secret", "the-right-secret"}});
  for (const std::string& key : {std::string(), std::string("a-wrong-secret")}) {
    auto options = control::ClientOptions::from_config(config_);
    options.auth_secret = key;
    auto intruder = control::ControlClient::create(options);
    ASSERT_TRUE(intruder) << intruder.status().to_string();
    auto reserved = (*intruder)->reserve_batch(
        shard_->control_endpoint(), {wire::ReserveItem{"t-intruder", "h-intruder", bytes_spec(4096), {}}}, 2s);
    EXPECT_FALSE(reserved.is_ok() && !reserved->items.empty() &&
                 reserved->items[0].outcome == wire::ReserveOutcome::reserved)
        << "an unauthenticated reserve was served";
    auto cancelled =
        (*intruder)->cancel(shard_->control_endpoint(), wire::CancelRequest{"t-any", {}, false, false}, 2s);
    EXPECT_FALSE(cancelled.is_ok() && cancelled->cancelled) << "an unauthenticated cancel was accepted";
  }
  EXPECT_GE(shard_->counters().control.auth_failures, 4U);
  expect_untouched();
  // An unauthenticated cancel left no tombstone: the right key reserves normally.
  auto client = control::ControlClient::create(control::ClientOptions::from_config(config_));
  ASSERT_TRUE(client);
  auto reply = (*client)->reserve_batch(shard_->control_endpoint(),
                                        {wire::ReserveItem{"t-any", "h-any", bytes_spec(4096), {}}}, 2s);
  ASSERT_TRUE(reply) << reply.status().to_string();
  ASSERT_EQ(reply->items.size(), 1U);
  EXPECT_EQ(reply->items[0].outcome, wire::ReserveOutcome::reserved) << reply->items[0].error.to_string();
}

// 8b. Requests no honest producer sends: more than the pool, a negative or huge
// shape, rank 100, a 100 MB string. Each is answered with an error (or, for a frame
// over max_frame_bytes, dropped) and changes nothing; the shard answers afterwards.
TEST_F(HostileInput, OutOfBoundsReservesAreRefusedAndChangeNothing) {
  start(json::object());
  const std::uint64_t pool = shard_->pool_capacity();
  auto refused = [](const std::optional<wire::Reply>& reply) {
    if (!reply) return false;
    if (!reply->ok()) return true;  // the whole frame refused
    const auto* body = std::get_if<wire::ReserveBatchReply>(&reply->body);
    return body != nullptr && body->items.size() == 1 && body->items[0].outcome == wire::ReserveOutcome::error;
  };
  const auto big = static_cast<std::int64_t>(pool + 1);
  EXPECT_TRUE(refused(exchange(raw_reserve(1, "t-big", "h-big", big, {big}, "uint8")))) << "more than the pool";
  EXPECT_TRUE(refused(exchange(raw_reserve(2, "t-neg", "h-neg", -4096, {-4096}, "uint8")))) << "negative shape";
  EXPECT_TRUE(refused(exchange(raw_reserve(3, "t-neg2", "h-neg2", 4096, {-1, -4096}, "uint8")))) << "negative dims";
  constexpr std::int64_t kHuge = std::int64_t{1} << 62;
  EXPECT_TRUE(refused(exchange(raw_reserve(4, "t-huge", "h-huge", kHuge, {kHuge}, "uint8")))) << "huge shape";
  EXPECT_TRUE(refused(exchange(raw_reserve(5, "t-ovf", "h-ovf", 0, {kHuge, kHuge, 16}, "float32"))))
      << "a shape whose byte count overflows";
  EXPECT_TRUE(refused(exchange(raw_reserve(6, "t-rank", "h-rank", 1, std::vector<std::int64_t>(100, 1), "uint8"))))
      << "rank 100";
  EXPECT_TRUE(refused(exchange(raw_reserve(7, "t-dtype", "h-dtype", 4096, {4096}, "no-such-type")))) << "bad dtype";
  EXPECT_TRUE(refused(exchange(raw_reserve(8, std::string(300, 'x'), "h-long", 4096, {4096}, "uint8"))))
      << "an over-long transfer id";
  // 100 MB in one string: over max_frame_bytes, so the frame never reaches the
  // decoder (that connection is dropped); either way nothing may change.
  const auto flood = exchange(raw_reserve(9, std::string(100 << 20, 'y'), "h-flood", 4096, {4096}, "uint8"), 3s);
  EXPECT_TRUE(!flood || refused(flood));
  expect_untouched();
  // The shard still serves an honest client.
  auto client = control::ControlClient::create(control::ClientOptions::from_config(config_));
  ASSERT_TRUE(client);
  auto reply = (*client)->reserve_batch(shard_->control_endpoint(),
                                        {wire::ReserveItem{"t-ok", "h-ok", bytes_spec(pool), {}}}, 2s);
  ASSERT_TRUE(reply) << reply.status().to_string();
  ASSERT_EQ(reply->items.size(), 1U);
  EXPECT_EQ(reply->items[0].outcome, wire::ReserveOutcome::reserved) << reply->items[0].error.to_string();
  EXPECT_EQ(shard_->counters().reservations.pool_used_bytes, pool);
}

}  // namespace
}  // namespace ecx::fault
