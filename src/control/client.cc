#include "ecx/control/client.h"

#include <array>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>
#include <zmq.hpp>

#include "control/counters.h"
#include "control/local_calls.h"
#include "control/zmq_util.h"
#include "core/logging.h"
#include "ecx/core/thread_name.h"
#include "ecx/wire/codec.h"

namespace ecx::control {

using detail::Counter;

namespace {

constexpr int kDiscoveryAttempts = 2;
constexpr std::chrono::milliseconds kMaxPollWait{100};
// The longest a blocking call waits for its reply before it looks again at its
// deadline (the injected clock's) and at close().
constexpr std::chrono::milliseconds kLaneSlice{10};
constexpr std::size_t kMaxRepliesPerTurn = 4096;

long long as_ms(Duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

}  // namespace

ClientOptions ClientOptions::from_config(const Config& config) {
  ClientOptions o;
  o.default_timeout = config.control_timeout();
  o.limits.max_frame_bytes = static_cast<std::size_t>(config.max_frame_bytes);
  o.auth_secret = config.auth_secret;
  o.name = config.engine_id.empty() ? std::string(role_name(config.role)) : config.engine_id;
  return o;
}

std::vector<std::string> Topology::control_addresses() const {
  std::vector<std::string> out;
  out.reserve(shards.size());
  for (const auto& shard : shards) out.push_back(shard.control);
  return out;
}

struct ControlClient::State {
  struct Pending {
    wire::Op op = wire::Op::hello;
    std::string address;
    TimePoint deadline;
    Duration timeout{};
    ReplyCallback done;
    std::string frame;  // until sent
    std::optional<wire::Mac> mac;
    bool sent = false;
  };
  // One DEALER to one server address. A blocking call uses one alone, as a lane (see
  // the header); the I/O thread's Peer adds its queue of requests.
  struct Connection {
    std::string address;
    zmq::socket_t socket;
    std::optional<wire::StampIssuer> stamps;
    std::optional<wire::ReplayGuard> replay;
    // A lane's encoded request: its capacity is kept from call to call (encoding into
    // a fresh string grew it four times per reserve).
    std::string frame;
  };
  using Lane = Connection;
  struct Peer : Connection {
    std::deque<std::uint64_t> outbox;  // ids in send order
    std::size_t in_flight = 0;
    TimePoint last_used;
  };
  struct Submission {
    std::uint64_t id = 0;
    std::string address;
    wire::Request request;
    Duration timeout{};
    ReplyCallback done;
  };
  // A reply message once its MAC, encoding and freshness are checked; what is
  // dropped was counted and logged.
  struct CheckedReply {
    std::optional<wire::Reply> reply;  // nullopt: dropped
    std::uint64_t undecodable_id = 0;  // the body did not decode but named this request (authentication off)
    std::string undecodable_why;
  };

  ClientOptions options;
  wire::FrameSecurity security;
  std::shared_ptr<spdlog::logger> log = ecx::log::get("control");
  zmq::context_t context = detail::tagged_context(detail::ContextTag::control_client);
  detail::Wakeup wakeup;
  detail::Wakeup closing;  // notified once by close() and never cleared: ends a lane's wait to send
  std::atomic<std::uint64_t> next_id{1};
  std::atomic<std::size_t> admitted{0};  // calls accepted and not yet completed
  std::atomic<bool> stopping{false};
  std::mutex close_mutex;  // one joiner of `thread`
  std::mutex submit_mutex;
  std::vector<Submission> submissions;  // guarded by submit_mutex; bounded by max_in_flight
  bool closed = false;                  // guarded by submit_mutex: no submission is taken any more
  std::thread thread;

  // I/O thread only.
  std::unordered_map<std::string, std::unique_ptr<Peer>> peers;
  std::unordered_map<std::uint64_t, Pending> pending;
  std::set<std::pair<TimePoint, std::uint64_t>> deadlines;

  // Lanes: declared after `context`, so their sockets close before it terminates.
  std::mutex lanes_mutex;
  std::condition_variable lanes_returned;
  std::vector<std::unique_ptr<Lane>> idle_lanes;  // guarded by lanes_mutex; most recently used last
  std::size_t lanes_out = 0;                      // guarded by lanes_mutex: in callers' hands

  mutable std::mutex topology_mutex;
  std::unordered_map<std::string, Topology> topologies;  // guarded by topology_mutex
  // The server instance a discovered topology names at `address` (its hello), if any.
  std::optional<std::string> discovered_instance(const std::string& address) const;

  std::array<Counter, wire::kOpCount> sent;
  Counter replies_ok, replies_error, timeouts, rejected_calls, unmatched_replies, malformed_replies, auth_failures,
      peers_opened, peers_closed, discoveries_ok, discoveries_failed, lane_calls, lanes_opened, in_process_calls;

  void submit(std::string address, wire::RequestBody body, Duration timeout, ReplyCallback done);
  void fan_out(std::vector<std::string> addresses, const wire::RequestBody& body, Duration timeout,
               FanOutCallback done);
  void discover(const std::string& base, Duration timeout, const TopologyCallback& done, int attempt);

  // Sockets and replies, for the I/O thread and the lanes alike.
  std::optional<zmq::socket_t> open_dealer(const std::string& address, Status& error);
  // A Peer or a Lane: its socket, and its stamps and replay guard when authenticating.
  template <typename T>
  std::unique_ptr<T> open_connection(const std::string& address, Status& error) {
    auto socket = open_dealer(address, error);
    if (!socket) return nullptr;
    auto connection = std::make_unique<T>();
    connection->address = address;
    connection->socket = std::move(*socket);
    if (security.enabled()) {
      connection->stamps.emplace(options.wall_clock);
      connection->replay.emplace(wire::ReplayGuard::Options{}, options.wall_clock);
    }
    return connection;
  }
  CheckedReply check_reply(const std::string& address, std::optional<wire::ReplayGuard>& replay,
                           detail::Message& message);
  Result<wire::Reply> accept_reply(const std::string& address, wire::Op op, wire::Reply reply);
  std::string timeout_text(const std::string& address, wire::Op op, Duration timeout, bool was_sent) const;

  // Lanes (caller threads).
  // A lane for `address`; nullptr when lanes are off or all busy, the client is
  // stopping or the address is not one (the I/O thread's way answers those).
  std::unique_ptr<Lane> take_lane(const std::string& address);
  void return_lane(std::unique_ptr<Lane> lane);
  // The whole blocking call over `lane`, which it returns when done.
  Result<wire::Reply> call_on_lane(std::unique_ptr<Lane> lane, wire::RequestBody body, Duration timeout);
  Result<wire::Reply> exchange_on_lane(Lane& lane, wire::RequestBody body, Duration timeout);
  // A blocking call's operation, timeout and deadline (on the injected clock).
  struct LaneCall {
    wire::Op op;
    Duration timeout;
    TimePoint deadline;
  };
  // How a call ends before its reply, where it does by `now`: cancelled when closing,
  // its timeout error (counted) at its deadline.
  std::optional<Status> lane_call_ended(const Lane& lane, const LaneCall& call, bool was_sent, TimePoint now);
  // Ok once the lane's socket takes a request (its peer is connected); cancelled when
  // closing; at the deadline the call's timeout error.
  Status wait_until_writable(Lane& lane, const LaneCall& call);
  void close_lanes();

  void run() noexcept;
  void loop();
  void admit(Submission& submission);
  Peer* peer_for(const std::string& address, Status& error);
  void flush(Peer& peer);
  void read(Peer& peer);
  void on_reply(Peer& peer, detail::Message& message);
  void expire();
  void complete(std::uint64_t id, Result<wire::Reply> result);
  void shutdown();
};

// ---------------------------------------------------------------- caller side

Result<std::unique_ptr<ControlClient>> ControlClient::create(ClientOptions options) {
  if (!options.clock) return invalid_argument("ControlClient needs a clock");
  if (options.max_in_flight == 0 || options.max_peers == 0) {
    return invalid_argument("max_in_flight and max_peers must be at least 1");
  }
  auto security = wire::FrameSecurity::from_secret(options.auth_secret);
  if (!security) return security.status();
  auto state = std::make_shared<State>();
  if (!state->wakeup.valid()) return internal_error("eventfd failed");
  state->options = std::move(options);
  state->security = std::move(*security);
  State* raw = state.get();
  state->thread = std::thread([raw] {
    name_this_thread("ecx-ctl-client");
    raw->run();
  });
  return std::unique_ptr<ControlClient>(new ControlClient(std::move(state)));
}

ControlClient::ControlClient(std::shared_ptr<State> state) : state_(std::move(state)) {}

ControlClient::~ControlClient() { close(); }

void ControlClient::close() {
  std::lock_guard lock(state_->close_mutex);
  state_->stopping.store(true, std::memory_order_release);
  state_->wakeup.notify();
  state_->closing.notify();
  if (state_->thread.joinable()) state_->thread.join();
  state_->close_lanes();
}

const ClientOptions& ControlClient::options() const noexcept { return state_->options; }

void ControlClient::State::submit(std::string address, wire::RequestBody body, Duration timeout, ReplyCallback done) {
  if (timeout <= Duration::zero()) timeout = options.default_timeout;
  if (stopping.load(std::memory_order_acquire)) {
    rejected_calls.add();
    done(cancelled("the control client is shutting down"));
    return;
  }
  if (auto endpoint = detail::parse_tcp_endpoint(address); !endpoint) {
    rejected_calls.add();
    done(endpoint.status());
    return;
  }
  if (admitted.fetch_add(1, std::memory_order_acq_rel) >= options.max_in_flight) {
    admitted.fetch_sub(1, std::memory_order_acq_rel);
    rejected_calls.add();
    done(resource_exhausted(fmt::format("{} control requests already in flight", options.max_in_flight)));
    return;
  }
  Submission s;
  s.id = next_id.fetch_add(1, std::memory_order_relaxed);
  s.address = std::move(address);
  s.request.id = s.id;
  s.request.timeout_ms = static_cast<std::uint32_t>(std::clamp<long long>(as_ms(timeout), 1, 0xffffffffLL));
  s.request.body = std::move(body);
  s.timeout = timeout;
  s.done = std::move(done);
  {
    std::unique_lock lock(submit_mutex);
    if (closed) {
      lock.unlock();
      admitted.fetch_sub(1, std::memory_order_acq_rel);
      rejected_calls.add();
      s.done(cancelled("the control client is shutting down"));
      return;
    }
    submissions.push_back(std::move(s));
  }
  wakeup.notify();
}

void ControlClient::call_async(std::string address, wire::RequestBody body, Duration timeout, ReplyCallback done) {
  state_->submit(std::move(address), std::move(body), timeout, std::move(done));
}

std::future<Result<wire::Reply>> ControlClient::call(std::string address, wire::RequestBody body, Duration timeout) {
  auto promise = std::make_shared<std::promise<Result<wire::Reply>>>();
  auto future = promise->get_future();
  state_->submit(std::move(address), std::move(body), timeout,
                 [promise](Result<wire::Reply> reply) { promise->set_value(std::move(reply)); });
  return future;
}

Result<wire::Reply> ControlClient::call_blocking(std::string address, wire::RequestBody body, Duration timeout) {
  if (timeout <= Duration::zero()) timeout = state_->options.default_timeout;
  auto lane = state_->take_lane(address);
  if (!lane) return call(std::move(address), std::move(body), timeout).get();
  return state_->call_on_lane(std::move(lane), std::move(body), timeout);
}

Result<wire::HelloReply> ControlClient::hello(const std::string& address, Duration timeout) {
  return reply_body<wire::HelloReply>(call_blocking(address, wire::HelloRequest{state_->options.name}, timeout));
}

namespace {

// A batch reply must answer every item of its request, in order.
template <typename BatchReply>
Result<BatchReply> answering_every_item(Result<BatchReply> reply, const std::string& address, std::size_t count,
                                        std::string_view what) {
  if (reply && reply->items.size() != count) {
    return protocol_error(fmt::format("{} answered {} of {} {} items", address, reply->items.size(), count, what));
  }
  return reply;
}

}  // namespace

Result<wire::ReserveBatchReply> ControlClient::reserve_batch(const std::string& address,
                                                             std::vector<wire::ReserveItem> items, Duration timeout) {
  const std::size_t count = items.size();
  return answering_every_item(
      reply_body<wire::ReserveBatchReply>(call_blocking(address, wire::ReserveBatchRequest{std::move(items)}, timeout)),
      address, count, "reservation");
}

Result<wire::CancelReply> ControlClient::cancel(const std::string& address, wire::CancelRequest request,
                                                Duration timeout) {
  return reply_body<wire::CancelReply>(call_blocking(address, std::move(request), timeout));
}

Result<wire::CancelBatchReply> ControlClient::cancel_batch(const std::string& address,
                                                           std::vector<wire::CancelRequest> items, Duration timeout) {
  const std::size_t count = items.size();
  // A shard of this process that lets its cancels run here (see LocalCancelRegistry),
  // known by the instance its discovery reported for this address.
  if (const auto instance = state_->discovered_instance(address)) {
    if (auto answered =
            detail::LocalCancelRegistry::instance().cancel_batch(*instance, state_->options.auth_secret, items)) {
      state_->in_process_calls.add();
      return answering_every_item(Result<wire::CancelBatchReply>(std::move(*answered)), address, count, "cancel");
    }
  }
  return answering_every_item(
      reply_body<wire::CancelBatchReply>(call_blocking(address, wire::CancelBatchRequest{std::move(items)}, timeout)),
      address, count, "cancel");
}

Result<wire::StatusReply> ControlClient::status(const std::string& address, std::string transfer_id, Duration timeout) {
  return reply_body<wire::StatusReply>(call_blocking(address, wire::StatusRequest{std::move(transfer_id)}, timeout));
}

void ControlClient::State::fan_out(std::vector<std::string> addresses, const wire::RequestBody& body, Duration timeout,
                                   FanOutCallback done) {
  struct Gather {
    std::mutex mutex;
    std::vector<std::optional<Result<wire::Reply>>> results;
    std::size_t remaining = 0;
    FanOutCallback done;
  };
  if (addresses.empty()) {
    done({});
    return;
  }
  auto gather = std::make_shared<Gather>();
  gather->results.resize(addresses.size());
  gather->remaining = addresses.size();
  gather->done = std::move(done);
  for (std::size_t i = 0; i < addresses.size(); ++i) {
    submit(std::move(addresses[i]), body, timeout, [gather, i](Result<wire::Reply> reply) {
      bool last = false;
      {
        std::lock_guard lock(gather->mutex);
        gather->results[i].emplace(std::move(reply));
        last = --gather->remaining == 0;
      }
      if (!last) return;
      std::vector<Result<wire::Reply>> out;
      out.reserve(gather->results.size());
      for (auto& r : gather->results) out.push_back(std::move(*r));
      gather->done(std::move(out));
    });
  }
}

void ControlClient::call_all_async(std::vector<std::string> addresses, const wire::RequestBody& body, Duration timeout,
                                   FanOutCallback done) {
  state_->fan_out(std::move(addresses), body, timeout, std::move(done));
}

std::vector<Result<wire::Reply>> ControlClient::call_all(std::vector<std::string> addresses,
                                                         const wire::RequestBody& body, Duration timeout) {
  auto promise = std::make_shared<std::promise<std::vector<Result<wire::Reply>>>>();
  auto future = promise->get_future();
  state_->fan_out(std::move(addresses), body, timeout,
                  [promise](std::vector<Result<wire::Reply>> results) { promise->set_value(std::move(results)); });
  return future.get();
}

void ControlClient::State::discover(const std::string& base, Duration timeout, const TopologyCallback& done,
                                    int attempt) {
  auto endpoint = detail::parse_tcp_endpoint(base);
  if (!endpoint) {
    done(endpoint.status());
    return;
  }
  auto fail_or_retry = [this, base, timeout, done, attempt](const Status& why) {
    // A client that is shutting down cancels its calls: no point asking again.
    if (attempt < kDiscoveryAttempts && !stopping.load(std::memory_order_acquire)) {
      log->info("discovery of {} failed ({}); retrying", base, why.message());
      discover(base, timeout, done, attempt + 1);
      return;
    }
    if (stopping.load(std::memory_order_acquire)) {
      // Closed while asking: expected at shutdown, and no fault of the consumer's.
      log->info("discovery of {} ended: the control client is closing", base);
    } else {
      discoveries_failed.add();
      log->warn("EC consumer at {} did not report its shards: {}", base, why.message());
    }
    done(unavailable(fmt::format("could not discover every EC consumer shard at {}: {}", base, why.message())));
  };
  submit(base, wire::HelloRequest{options.name}, timeout,
         [this, base, timeout, done, fail_or_retry, host = *endpoint](Result<wire::Reply> reply) {
           auto first = reply_body<wire::HelloReply>(std::move(reply));
           if (!first) return fail_or_retry(first.status());
           const std::vector<std::uint32_t> ports = first->control_ports;
           if (first->tp_size == 0 || ports.size() != first->tp_size) {
             return fail_or_retry(
                 protocol_error(fmt::format("it lists {} control ports for tp_size {}", ports.size(), first->tp_size)));
           }
           std::vector<std::string> addresses;
           for (std::uint32_t port : ports) {
             if (port == 0 || port > 65535) return fail_or_retry(protocol_error("it lists an invalid port"));
             addresses.push_back(detail::with_port(host, static_cast<int>(port)));
           }
           fan_out(
               addresses, wire::HelloRequest{options.name}, timeout,
               [this, base, done, fail_or_retry, host, ports, addresses](std::vector<Result<wire::Reply>> results) {
                 Topology topology;
                 topology.base = base;
                 for (std::size_t r = 0; r < results.size(); ++r) {
                   auto hello = reply_body<wire::HelloReply>(std::move(results[r]));
                   auto shard_error = [&](const std::string& why) {
                     return fail_or_retry(protocol_error(fmt::format("shard {} ({}): {}", r, addresses[r], why)));
                   };
                   if (!hello) return shard_error(hello.status().message());
                   if (hello->shard != r) return shard_error(fmt::format("it says it is shard {}", hello->shard));
                   if (hello->control_ports != ports) return shard_error("it lists different shard ports");
                   if (hello->min_version > wire::kProtocolVersion || hello->max_version < wire::kMinProtocolVersion) {
                     return shard_error(fmt::format("it speaks versions {}..{}, this side {}..{}", hello->min_version,
                                                    hello->max_version, wire::kMinProtocolVersion,
                                                    wire::kProtocolVersion));
                   }
                   if (hello->event_port == 0) return shard_error("it has no event port");
                   ShardEndpoint shard;
                   shard.rank = static_cast<std::uint32_t>(r);
                   shard.control = addresses[r];
                   shard.events = detail::with_port(host, static_cast<int>(hello->event_port));
                   shard.hello = std::move(*hello);
                   topology.shards.push_back(std::move(shard));
                 }
                 {
                   std::lock_guard lock(topology_mutex);
                   if (topologies.size() >= options.max_peers) topologies.clear();
                   topologies[base] = topology;
                 }
                 discoveries_ok.add();
                 done(std::move(topology));
               });
         });
}

void ControlClient::discover_async(const std::string& base, Duration timeout, const TopologyCallback& done) {
  if (auto cached = cached_topology(base)) {
    done(std::move(*cached));
    return;
  }
  state_->discover(base, timeout, done, 1);
}

Result<Topology> ControlClient::discover(const std::string& base, Duration timeout) {
  auto promise = std::make_shared<std::promise<Result<Topology>>>();
  auto future = promise->get_future();
  discover_async(base, timeout, [promise](Result<Topology> t) { promise->set_value(std::move(t)); });
  return future.get();
}

std::optional<std::string> ControlClient::State::discovered_instance(const std::string& address) const {
  std::lock_guard lock(topology_mutex);
  for (const auto& [base, topology] : topologies) {
    for (const auto& shard : topology.shards) {
      if (shard.control == address) return shard.hello.instance;
    }
  }
  return std::nullopt;
}

std::optional<Topology> ControlClient::cached_topology(const std::string& base) const {
  std::lock_guard lock(state_->topology_mutex);
  auto it = state_->topologies.find(base);
  if (it == state_->topologies.end()) return std::nullopt;
  return it->second;
}

bool ControlClient::has_topology(const std::string& base) const {
  std::lock_guard lock(state_->topology_mutex);
  return state_->topologies.contains(base);
}

void ControlClient::forget_topology(const std::string& base) {
  std::lock_guard lock(state_->topology_mutex);
  state_->topologies.erase(base);
}

ClientCounters ControlClient::counters() const {
  const State& s = *state_;
  ClientCounters c;
  for (std::size_t i = 0; i < wire::kOpCount; ++i) c.sent[i] = s.sent[i].get();
  c.replies_ok = s.replies_ok.get();
  c.replies_error = s.replies_error.get();
  c.timeouts = s.timeouts.get();
  c.rejected_calls = s.rejected_calls.get();
  c.unmatched_replies = s.unmatched_replies.get();
  c.malformed_replies = s.malformed_replies.get();
  c.auth_failures = s.auth_failures.get();
  c.peers_opened = s.peers_opened.get();
  c.peers_closed = s.peers_closed.get();
  c.discoveries_ok = s.discoveries_ok.get();
  c.discoveries_failed = s.discoveries_failed.get();
  c.lane_calls = s.lane_calls.get();
  c.lanes_opened = s.lanes_opened.get();
  c.in_process_calls = s.in_process_calls.get();
  return c;
}

// ---------------------------------------------------------------- I/O thread

void ControlClient::State::run() noexcept {
  try {
    loop();
  } catch (const std::exception& e) {
    log->error("control client stopped: {}", e.what());
  } catch (...) {
    log->error("control client stopped");
  }
  try {
    shutdown();
  } catch (...) {
    log->error("control client shutdown failed");
  }
}

void ControlClient::State::loop() {
  std::vector<Submission> batch;
  std::vector<zmq_pollitem_t> items;
  std::vector<Peer*> polled;
  while (!stopping.load(std::memory_order_acquire)) {
    {
      std::lock_guard lock(submit_mutex);
      batch.swap(submissions);
    }
    for (auto& s : batch) admit(s);
    batch.clear();
    for (auto& [address, peer] : peers) {
      if (!peer->outbox.empty()) flush(*peer);
    }

    items.clear();
    polled.clear();
    items.push_back({nullptr, wakeup.fd(), ZMQ_POLLIN, 0});
    for (auto& [address, peer] : peers) {
      const short events = static_cast<short>(ZMQ_POLLIN | (peer->outbox.empty() ? 0 : ZMQ_POLLOUT));
      items.push_back({peer->socket.handle(), 0, events, 0});
      polled.push_back(peer.get());
    }
    std::optional<TimePoint> earliest;
    if (!deadlines.empty()) earliest = deadlines.begin()->first;
    const long wait = detail::poll_timeout_ms(options.clock->now(), earliest, kMaxPollWait);
    if (detail::poll(items, wait) < 0) {
      log->error("control client poll failed: {}", zmq_strerror(zmq_errno()));
      return;
    }
    if (items[0].revents & ZMQ_POLLIN) wakeup.clear();
    for (std::size_t i = 0; i < polled.size(); ++i) {
      if (items[i + 1].revents & ZMQ_POLLIN) read(*polled[i]);
      if ((items[i + 1].revents & ZMQ_POLLOUT) && !polled[i]->outbox.empty()) flush(*polled[i]);
    }
    expire();
  }
}

ControlClient::State::Peer* ControlClient::State::peer_for(const std::string& address, Status& error) {
  if (auto it = peers.find(address); it != peers.end()) return it->second.get();
  if (peers.size() >= options.max_peers) {
    // Close the least recently used idle peer to make room.
    auto victim = peers.end();
    for (auto it = peers.begin(); it != peers.end(); ++it) {
      if (it->second->in_flight != 0 || !it->second->outbox.empty()) continue;
      if (victim == peers.end() || it->second->last_used < victim->second->last_used) victim = it;
    }
    if (victim == peers.end()) {
      error = resource_exhausted(fmt::format("{} control peers are all busy", peers.size()));
      return nullptr;
    }
    peers.erase(victim);
    peers_closed.add();
  }
  auto peer = open_connection<Peer>(address, error);
  if (!peer) return nullptr;
  peers_opened.add();
  Peer* raw = peer.get();
  peers.emplace(address, std::move(peer));
  return raw;
}

void ControlClient::State::admit(Submission& s) {
  const TimePoint now = options.clock->now();
  Pending p;
  p.op = s.request.op();
  p.address = s.address;
  p.deadline = now + s.timeout;
  p.timeout = s.timeout;
  p.done = std::move(s.done);
  const std::uint64_t id = s.id;
  auto refuse = [&](Status why) {
    rejected_calls.add();
    admitted.fetch_sub(1, std::memory_order_acq_rel);
    try {
      p.done(std::move(why));
    } catch (...) {
      log->error("a control reply callback threw");
    }
  };
  Status error;
  Peer* peer = peer_for(s.address, error);
  if (!peer) return refuse(error);
  std::optional<wire::AuthStamp> stamp;
  if (peer->stamps) stamp = peer->stamps->next();
  wire::encode_request(s.request, stamp ? &*stamp : nullptr, p.frame);
  if (p.frame.size() > options.limits.max_frame_bytes) {
    return refuse(invalid_argument(fmt::format("{} request of {} bytes exceeds the frame limit of {} bytes",
                                               wire::op_name(p.op), p.frame.size(), options.limits.max_frame_bytes)));
  }
  if (security.enabled()) p.mac = security.authenticator->sign(wire::FrameKind::request, p.frame);
  peer->outbox.push_back(id);
  peer->in_flight++;
  peer->last_used = now;
  deadlines.emplace(p.deadline, id);
  pending.emplace(id, std::move(p));
}

void ControlClient::State::flush(Peer& peer) {
  while (!peer.outbox.empty()) {
    const std::uint64_t id = peer.outbox.front();
    auto it = pending.find(id);
    if (it == pending.end()) {  // timed out before it could be sent
      peer.outbox.pop_front();
      continue;
    }
    Pending& p = it->second;
    if (!detail::send_frames(peer.socket, nullptr, p.frame, p.mac ? &*p.mac : nullptr)) return;
    p.sent = true;
    std::string().swap(p.frame);
    sent[static_cast<std::size_t>(p.op)].add();
    peer.outbox.pop_front();
  }
}

void ControlClient::State::read(Peer& peer) {
  for (std::size_t n = 0; n < kMaxRepliesPerTurn; ++n) {
    auto message = detail::receive(peer.socket, 2);
    if (!message) return;
    on_reply(peer, *message);
  }
}

std::optional<zmq::socket_t> ControlClient::State::open_dealer(const std::string& address, Status& error) {
  try {
    zmq::socket_t socket(context, zmq::socket_type::dealer);
    detail::set_common_options(socket, options.limits);
    // Queue only to a live connection: a request written while the peer is down
    // waits in our outbox (bounded by its deadline) instead of reaching a restarted
    // peer long after its caller gave up.
    socket.set(zmq::sockopt::immediate, 1);
    const int hwm = static_cast<int>(std::min<std::size_t>(options.max_in_flight + 16, 1 << 30));
    socket.set(zmq::sockopt::sndhwm, hwm);
    socket.set(zmq::sockopt::rcvhwm, hwm);
    socket.set(zmq::sockopt::reconnect_ivl, 100);
    socket.set(zmq::sockopt::reconnect_ivl_max, 1000);
    // Detects a peer that vanished without closing its connection.
    socket.set(zmq::sockopt::heartbeat_ivl, 1000);
    socket.set(zmq::sockopt::heartbeat_timeout, 5000);
    socket.connect(address);
    return socket;
  } catch (const zmq::error_t& e) {
    error = unavailable(fmt::format("cannot connect to {}: {}", address, e.what()));
    return std::nullopt;
  }
}

ControlClient::State::CheckedReply ControlClient::State::check_reply(const std::string& address,
                                                                     std::optional<wire::ReplayGuard>& replay,
                                                                     detail::Message& message) {
  CheckedReply out;
  if (message.parts.empty()) return out;
  const std::string_view body = detail::view(message.parts[0]);
  bool signed_ok = false;
  if (security.enabled() && message.total_parts == 2) {
    signed_ok = security.authenticator->verify(wire::FrameKind::reply, body, detail::view(message.parts[1]));
    if (!signed_ok) {
      auth_failures.add();
      log->warn("dropped a reply from {} with a bad MAC", address);
      return out;
    }
  } else if (message.total_parts != 1) {
    malformed_replies.add();
    return out;
  }
  wire::Envelope envelope;
  auto reply = wire::decode_reply(body, options.limits, &envelope);
  if (!reply) {
    malformed_replies.add();
    log->warn("undecodable reply from {}: {}", address, reply.status().message());
    if (!security.enabled()) {
      out.undecodable_id = envelope.id;
      out.undecodable_why = fmt::format("undecodable reply from {}: {}", address, reply.status().message());
    }
    return out;
  }
  if (security.enabled()) {
    if (signed_ok) {
      Status fresh = envelope.stamp ? replay->check(*envelope.stamp) : protocol_error("the reply has no stamp");
      if (!fresh) {
        auth_failures.add();
        log->warn("dropped a reply from {}: {}", address, fresh.message());
        return out;
      }
    } else if (reply->ok() || (reply->reason != wire::RejectReason::unauthenticated &&
                               reply->reason != wire::RejectReason::malformed)) {
      // Unsigned frames are believed only when they refuse us: a forged refusal
      // costs one request, which a man in the middle could cost anyway.
      auth_failures.add();
      log->warn("dropped an unsigned reply from {}", address);
      return out;
    }
  }
  out.reply = std::move(*reply);
  return out;
}

Result<wire::Reply> ControlClient::State::accept_reply(const std::string& address, wire::Op op, wire::Reply reply) {
  if (reply.ok() && reply.op != op) {
    malformed_replies.add();
    return protocol_error(
        fmt::format("{} answered a {} request as {}", address, wire::op_name(op), wire::op_name(reply.op)));
  }
  if (reply.ok()) {
    replies_ok.add();
  } else {
    replies_error.add();
    if (reply.reason == wire::RejectReason::unauthenticated) {
      log->warn("{} refused authentication: {}", address, reply.status.message());
    }
  }
  return reply;
}

std::string ControlClient::State::timeout_text(const std::string& address, wire::Op op, Duration timeout,
                                               bool was_sent) const {
  return was_sent
             ? fmt::format("no reply from {} to {} within {} ms", address, wire::op_name(op), as_ms(timeout))
             : fmt::format("could not reach {} within {} ms ({} not sent)", address, as_ms(timeout), wire::op_name(op));
}

void ControlClient::State::on_reply(Peer& peer, detail::Message& message) {
  CheckedReply checked = check_reply(peer.address, peer.replay, message);
  if (!checked.reply) {
    auto it = pending.find(checked.undecodable_id);
    if (checked.undecodable_id != 0 && it != pending.end() && it->second.address == peer.address) {
      complete(checked.undecodable_id, protocol_error(std::move(checked.undecodable_why)));
    }
    return;
  }
  auto it = pending.find(checked.reply->id);
  if (it == pending.end() || it->second.address != peer.address || !it->second.sent) {
    unmatched_replies.add();
    return;
  }
  const std::uint64_t id = checked.reply->id;
  const wire::Op op = it->second.op;
  complete(id, accept_reply(peer.address, op, std::move(*checked.reply)));
}

void ControlClient::State::expire() {
  const TimePoint now = options.clock->now();
  while (!deadlines.empty() && deadlines.begin()->first <= now) {
    const std::uint64_t id = deadlines.begin()->second;
    auto it = pending.find(id);
    if (it == pending.end()) {
      deadlines.erase(deadlines.begin());
      continue;
    }
    timeouts.add();
    const Pending& p = it->second;
    complete(id, timeout_error(timeout_text(p.address, p.op, p.timeout, p.sent)));
  }
}

void ControlClient::State::complete(std::uint64_t id, Result<wire::Reply> result) {
  auto it = pending.find(id);
  if (it == pending.end()) return;
  Pending p = std::move(it->second);
  pending.erase(it);
  deadlines.erase({p.deadline, id});
  if (auto peer = peers.find(p.address); peer != peers.end() && peer->second->in_flight > 0) {
    peer->second->in_flight--;
  }
  admitted.fetch_sub(1, std::memory_order_acq_rel);
  try {
    p.done(std::move(result));
  } catch (const std::exception& e) {
    log->error("a control reply callback threw: {}", e.what());
  } catch (...) {
    log->error("a control reply callback threw");
  }
}

void ControlClient::State::shutdown() {
  // Callbacks may submit again while we fail the pending calls; those are refused
  // at once because `stopping` is set, so this loop ends.
  for (;;) {
    std::vector<Submission> batch;
    {
      std::lock_guard lock(submit_mutex);
      batch.swap(submissions);
      if (pending.empty()) closed = true;  // the last round: later submits are refused inline
    }
    for (auto& s : batch) {
      admitted.fetch_sub(1, std::memory_order_acq_rel);
      try {
        s.done(cancelled("the control client is shutting down"));
      } catch (...) {
        log->error("a control reply callback threw");
      }
    }
    if (pending.empty() && batch.empty()) break;
    std::vector<std::uint64_t> ids;
    ids.reserve(pending.size());
    for (const auto& [id, p] : pending) ids.push_back(id);
    for (std::uint64_t id : ids) complete(id, cancelled("the control client is shutting down"));
  }
  peers.clear();
}

// ---------------------------------------------------------------- lanes (caller threads)

Result<wire::Reply> ControlClient::State::call_on_lane(std::unique_ptr<Lane> lane, wire::RequestBody body,
                                                       Duration timeout) {
  if (admitted.fetch_add(1, std::memory_order_acq_rel) >= options.max_in_flight) {
    admitted.fetch_sub(1, std::memory_order_acq_rel);
    rejected_calls.add();
    return_lane(std::move(lane));
    return resource_exhausted(fmt::format("{} control requests already in flight", options.max_in_flight));
  }
  lane_calls.add();
  auto result = exchange_on_lane(*lane, std::move(body), timeout);
  admitted.fetch_sub(1, std::memory_order_acq_rel);
  return_lane(std::move(lane));
  return result;
}

std::unique_ptr<ControlClient::State::Lane> ControlClient::State::take_lane(const std::string& address) {
  if (options.max_lanes == 0 || stopping.load(std::memory_order_acquire) || !detail::parse_tcp_endpoint(address)) {
    return nullptr;
  }
  std::unique_lock lock(lanes_mutex);
  if (stopping.load(std::memory_order_acquire)) return nullptr;
  for (auto it = idle_lanes.rbegin(); it != idle_lanes.rend(); ++it) {
    if ((*it)->address != address) continue;
    std::unique_ptr<Lane> lane = std::move(*it);
    idle_lanes.erase(std::next(it).base());
    ++lanes_out;
    return lane;
  }
  if (lanes_out >= options.max_lanes) return nullptr;
  // Room for a new lane: the least recently used idle one (of another peer) goes.
  if (lanes_out + idle_lanes.size() >= options.max_lanes) idle_lanes.erase(idle_lanes.begin());
  ++lanes_out;  // counted before the socket exists, so close() waits for it too
  lock.unlock();

  Status error;
  auto lane = open_connection<Lane>(address, error);
  if (!lane) {
    return_lane(nullptr);
    return nullptr;  // the I/O thread's way reports the error
  }
  lanes_opened.add();
  return lane;
}

void ControlClient::State::return_lane(std::unique_ptr<Lane> lane) {
  // All under the lock, the notify too: once lanes_out reaches 0, close() may go on
  // and the client may be destroyed.
  std::lock_guard lock(lanes_mutex);
  if (lane && !stopping.load(std::memory_order_acquire)) idle_lanes.push_back(std::move(lane));
  lane.reset();
  --lanes_out;
  lanes_returned.notify_all();
}

void ControlClient::State::close_lanes() {
  std::unique_lock lock(lanes_mutex);
  // Every lane in use comes back within one slice (kLaneSlice) of `stopping`, or at once
  // from a wait to send (`closing`); the bound only keeps a stuck caller from holding
  // close() for ever.
  if (!lanes_returned.wait_for(lock, std::chrono::seconds(30), [this] { return lanes_out == 0; })) {
    log->error("{} blocking control calls did not return within 30 s of close", lanes_out);
  }
  idle_lanes.clear();
}

std::optional<Status> ControlClient::State::lane_call_ended(const Lane& lane, const LaneCall& call, bool was_sent,
                                                            TimePoint now) {
  if (stopping.load(std::memory_order_acquire)) return cancelled("the control client is shutting down");
  if (now < call.deadline) return std::nullopt;
  timeouts.add();
  return timeout_error(timeout_text(lane.address, call.op, call.timeout, was_sent));
}

Status ControlClient::State::wait_until_writable(Lane& lane, const LaneCall& call) {
  std::array<zmq_pollitem_t, 2> items{
      {{lane.socket.handle(), 0, ZMQ_POLLOUT, 0}, {nullptr, closing.fd(), ZMQ_POLLIN, 0}}};
  for (;;) {
    const TimePoint now = options.clock->now();
    if (auto ended = lane_call_ended(lane, call, /*was_sent=*/false, now)) return *ended;
    if (detail::poll(items, detail::poll_timeout_ms(now, call.deadline, kMaxPollWait)) < 0) {
      return internal_error(fmt::format("control client poll failed: {}", zmq_strerror(zmq_errno())));
    }
    if (items[1].revents & ZMQ_POLLIN) return cancelled("the control client is shutting down");
    if (items[0].revents & ZMQ_POLLOUT) return Status::ok();
  }
}

Result<wire::Reply> ControlClient::State::exchange_on_lane(Lane& lane, wire::RequestBody body, Duration timeout) {
  wire::Request request;
  request.id = next_id.fetch_add(1, std::memory_order_relaxed);
  request.timeout_ms = static_cast<std::uint32_t>(std::clamp<long long>(as_ms(timeout), 1, 0xffffffffLL));
  request.body = std::move(body);
  const wire::Op op = request.op();
  const LaneCall call{op, timeout, options.clock->now() + timeout};

  std::optional<wire::AuthStamp> stamp;
  if (lane.stamps) stamp = lane.stamps->next();
  std::string& frame = lane.frame;
  wire::encode_request(request, stamp ? &*stamp : nullptr, frame);
  if (frame.size() > options.limits.max_frame_bytes) {
    rejected_calls.add();
    return invalid_argument(fmt::format("{} request of {} bytes exceeds the frame limit of {} bytes", wire::op_name(op),
                                        frame.size(), options.limits.max_frame_bytes));
  }
  std::optional<wire::Mac> mac;
  if (security.enabled()) mac = security.authenticator->sign(wire::FrameKind::request, frame);

  // A lane whose peer is down takes no frame (immediate): the request waits here,
  // as it would in the I/O thread's outbox, until it can go or its deadline passes.
  while (!detail::send_frames(lane.socket, nullptr, frame, mac ? &*mac : nullptr)) {
    if (Status ready = wait_until_writable(lane, call); !ready) return ready;
  }
  sent[static_cast<std::size_t>(op)].add();

  // The reply is waited for in ZeroMQ's own blocking receive, in slices, so that a
  // close is seen within one. A poll of the socket and of `closing` made two more
  // system calls per round trip (the socket's readiness read before and after the
  // wait): 1.6 us of the p50 in `ecx bench control`.
  for (;;) {
    const TimePoint now = options.clock->now();
    if (auto ended = lane_call_ended(lane, call, /*was_sent=*/true, now)) return *ended;
    int error = 0;
    auto message = detail::receive_waiting(
        lane.socket, 2, std::chrono::milliseconds(detail::poll_timeout_ms(now, call.deadline, kLaneSlice)), error);
    if (error != 0) return internal_error(fmt::format("control client receive failed: {}", zmq_strerror(error)));
    if (!message) continue;
    CheckedReply checked = check_reply(lane.address, lane.replay, *message);
    if (checked.reply && checked.reply->id == request.id) {
      return accept_reply(lane.address, op, std::move(*checked.reply));
    }
    if (!checked.reply && checked.undecodable_id == request.id) {
      return protocol_error(std::move(checked.undecodable_why));
    }
    // A late reply to an earlier call of this lane, which timed out.
    if (checked.reply) unmatched_replies.add();
  }
}

}  // namespace ecx::control
