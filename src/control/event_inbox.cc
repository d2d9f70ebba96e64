#include "ecx/control/event_inbox.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>

#include <fmt/format.h>
#include <zmq.hpp>

#include "control/counters.h"
#include "control/local_events.h"
#include "control/zmq_util.h"
#include "core/logging.h"
#include "ecx/wire/auth.h"
#include "ecx/wire/codec.h"

namespace ecx::control {

using detail::Counter;

namespace {

// Where a discovery running on the client's thread leaves its answer.
struct DiscoverySlot {
  std::mutex mutex;
  std::condition_variable finished;
  std::optional<Result<Topology>> result;  // guarded by mutex
};

}  // namespace

struct EventInbox::State {
  ControlClient& client;
  InboxOptions options;
  wire::FrameSecurity security;
  std::optional<wire::ReplayGuard> replay;
  std::shared_ptr<spdlog::logger> log = ecx::log::get("control");
  zmq::context_t context = detail::tagged_context(detail::ContextTag::event_inbox);
  std::optional<zmq::socket_t> pull;
  std::shared_ptr<DiscoverySlot> discovery;  // running or finished, not yet installed
  TimePoint next_attempt{};
  std::atomic<bool> is_subscribed{false};
  std::atomic<std::size_t> shards{0};
  // Shards served in this process deliver here instead of through `pull`.
  std::shared_ptr<detail::LocalEventQueue> local;
  std::vector<std::string> local_instances;
  std::size_t remote_shards = 0;

  std::array<Counter, wire::kEventKindCount> received;
  Counter malformed, unknown, auth_failures, discoveries_started, discoveries_failed, received_in_process;

  State(ControlClient& c, InboxOptions o) : client(c), options(std::move(o)) {}
  ~State() { leave_local(); }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  void leave_local();
  void reset();
  void advance();
  void install(const Topology& topology);
  std::size_t receive(std::vector<wire::Event>& out);
  void accept(detail::Message& message, std::vector<wire::Event>& out);
};

Result<std::unique_ptr<EventInbox>> EventInbox::create(ControlClient& client, InboxOptions options) {
  if (auto endpoint = detail::parse_tcp_endpoint(options.base_address); !endpoint) return endpoint.status();
  if (!options.clock) return invalid_argument("EventInbox needs a clock");
  auto security = wire::FrameSecurity::from_secret(options.auth_secret);
  if (!security) return security.status();
  auto state = std::make_unique<State>(client, std::move(options));
  state->security = std::move(*security);
  if (state->security.enabled()) state->replay.emplace(wire::ReplayGuard::Options{}, state->options.wall_clock);
  return std::unique_ptr<EventInbox>(new EventInbox(std::move(state)));
}

EventInbox::EventInbox(std::unique_ptr<State> state) : state_(std::move(state)) {}
EventInbox::~EventInbox() = default;

bool EventInbox::subscribed() const noexcept { return state_->is_subscribed.load(std::memory_order_acquire); }
std::size_t EventInbox::shard_count() const noexcept { return state_->shards.load(std::memory_order_acquire); }

void EventInbox::resubscribe() { state_->reset(); }

void EventInbox::State::leave_local() {
  for (const auto& instance : local_instances)
    detail::LocalEventRegistry::instance().unsubscribe(instance, local.get());
  local_instances.clear();
  local.reset();
}

void EventInbox::State::reset() {
  leave_local();
  pull.reset();
  remote_shards = 0;
  is_subscribed.store(false, std::memory_order_release);
  shards.store(0, std::memory_order_release);
  discovery.reset();  // a discovery still running finishes into an orphaned slot
  client.forget_topology(options.base_address);
  next_attempt = TimePoint{};
}

InboxCounters EventInbox::counters() const {
  const State& s = *state_;
  InboxCounters c;
  for (std::size_t i = 0; i < wire::kEventKindCount; ++i) c.received[i] = s.received[i].get();
  c.malformed = s.malformed.get();
  c.unknown = s.unknown.get();
  c.auth_failures = s.auth_failures.get();
  c.discoveries_started = s.discoveries_started.get();
  c.discoveries_failed = s.discoveries_failed.get();
  c.received_in_process = s.received_in_process.get();
  return c;
}

std::size_t EventInbox::drain(std::vector<wire::Event>& out) {
  State& s = *state_;
  s.advance();
  return s.receive(out);
}

std::size_t EventInbox::wait_and_drain(std::vector<wire::Event>& out, Duration max_wait) {
  const auto deadline = std::chrono::steady_clock::now() + max_wait;
  for (;;) {
    if (const std::size_t n = drain(out); n > 0) return n;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline || !wait(deadline - now)) return drain(out);
  }
}

bool EventInbox::wait(Duration max_wait, std::span<const WakeSource> also) {
  State& s = *state_;
  const auto deadline = std::chrono::steady_clock::now() + max_wait;
  s.advance();
  if (!s.pull && s.discovery && also.empty()) {
    std::unique_lock lock(s.discovery->mutex);
    s.discovery->finished.wait_until(lock, deadline, [&] { return s.discovery->result.has_value(); });
    lock.unlock();
    s.advance();
  }
  if (!s.pull && also.empty()) return false;
  if (s.pull && s.remote_shards == 0 && also.empty()) {
    // Every shard is in this process: woken by the publish itself, to the nanosecond.
    if (s.local) s.local->wait_until(deadline);
    return s.local && s.local->ready();
  }
  // One poll over the network shards' socket, the in-process queue's eventfd (armed
  // only while this thread polls) and the caller's sources.
  const int local_fd = s.pull && s.local ? s.local->arm() : -1;
  if (s.pull && s.local && local_fd < 0) return true;  // already queued
  std::vector<zmq_pollitem_t> items;
  items.reserve(also.size() + 2);
  if (s.pull && s.remote_shards > 0) items.push_back({s.pull->handle(), 0, ZMQ_POLLIN, 0});
  if (local_fd >= 0) items.push_back({nullptr, local_fd, ZMQ_POLLIN, 0});
  for (const WakeSource& source : also) {
    if (source.zmq_socket != nullptr || source.fd >= 0) items.push_back({source.zmq_socket, source.fd, ZMQ_POLLIN, 0});
  }
  const auto has = [&items](short event) {
    return std::any_of(items.begin(), items.end(),
                       [event](const zmq_pollitem_t& i) { return (i.revents & event) != 0; });
  };
  bool woken = false;
  int failure = 0;  // errno of a failed poll, or -1: a source in error (a closed fd, say)
  for (;;) {
    const auto left = std::max<Duration>(Duration::zero(), deadline - std::chrono::steady_clock::now());
    const auto timeout = std::chrono::ceil<std::chrono::milliseconds>(left);
    const int ready = detail::poll(items, static_cast<long>(timeout.count()));
    if (ready < 0) failure = zmq_errno();  // a caller's handle that is no socket, say
    woken = ready > 0 && has(ZMQ_POLLIN);
    if (!woken && ready > 0 && has(ZMQ_POLLERR)) failure = -1;
    if (woken || failure != 0 || std::chrono::steady_clock::now() >= deadline) break;
  }
  if (local_fd >= 0) s.local->disarm();
  if (failure != 0 && !also.empty()) {
    // Polling again would return at once: wait for the events alone, not spin the
    // caller's loop until its deadline.
    s.log->debug("cannot wait on the caller's sources ({}); waiting for events alone",
                 failure > 0 ? zmq_strerror(failure) : "a source in error");
    return wait(std::max<Duration>(Duration::zero(), deadline - std::chrono::steady_clock::now()), {});
  }
  return woken;
}

void EventInbox::State::advance() {
  if (pull) return;
  if (!discovery) {
    if (options.clock->now() < next_attempt) return;
    discovery = std::make_shared<DiscoverySlot>();
    discoveries_started.add();
    client.discover_async(options.base_address, options.discovery_timeout,
                          [slot = discovery](Result<Topology> topology) {
                            {
                              std::lock_guard lock(slot->mutex);
                              slot->result.emplace(std::move(topology));
                            }
                            slot->finished.notify_all();
                          });
  }
  std::optional<Result<Topology>> result;
  {
    std::lock_guard lock(discovery->mutex);
    if (!discovery->result) return;
    result = std::move(discovery->result);
  }
  discovery.reset();
  if (!*result) {
    discoveries_failed.add();
    next_attempt = options.clock->now() + options.retry_interval;
    log->warn("event channel of {} not subscribed yet: {}", options.base_address, result->status().message());
    return;
  }
  install(**result);
}

void EventInbox::State::install(const Topology& topology) {
  try {
    zmq::socket_t socket(context, zmq::socket_type::pull);
    detail::set_common_options(socket, options.limits);
    socket.set(zmq::sockopt::reconnect_ivl, 100);
    socket.set(zmq::sockopt::reconnect_ivl_max, 1000);
    // One queue for every shard served in this process: each keeps the bound its own
    // queue has on the network path (at TP 2 a shared bound of one shard's overflowed
    // and lost READY events, which nothing resends).
    local = std::make_shared<detail::LocalEventQueue>(options.max_events_per_drain * topology.shards.size());
    for (const ShardEndpoint& shard : topology.shards) {
      if (options.in_process && !shard.hello.instance.empty() &&
          detail::LocalEventRegistry::instance().subscribe(shard.hello.instance, options.auth_secret, local)) {
        local_instances.push_back(shard.hello.instance);
      } else {
        socket.connect(shard.events);
        ++remote_shards;
      }
    }
    if (local_instances.empty()) local.reset();
    pull.emplace(std::move(socket));
  } catch (const std::exception& e) {  // zmq::error_t, or std::system_error from the local queue's eventfd
    leave_local();
    remote_shards = 0;
    discoveries_failed.add();
    next_attempt = options.clock->now() + options.retry_interval;
    log->warn("event channel of {} could not connect: {}", options.base_address, e.what());
    return;
  }
  shards.store(topology.shards.size(), std::memory_order_release);
  is_subscribed.store(true, std::memory_order_release);
  log->info("subscribed to the events of {} shard(s) of {} ({} in this process)", topology.shards.size(),
            options.base_address, local_instances.size());
}

std::size_t EventInbox::State::receive(std::vector<wire::Event>& out) {
  if (!pull) return 0;
  const std::size_t before = out.size();
  if (local) {
    // In-process events were checked by their publisher; no frame, no signature.
    received_in_process.add(local->take(out, options.max_events_per_drain));
    for (std::size_t i = before; i < out.size(); ++i) received[static_cast<std::size_t>(out[i].kind)].add();
  }
  // With every shard in this process nothing reaches the socket: asking it would cost
  // libzmq's fork check and mailbox poll (two system calls) at every drain.
  for (std::size_t n = out.size() - before; remote_shards > 0 && n < options.max_events_per_drain; ++n) {
    std::optional<detail::Message> message;
    try {
      message = detail::receive(*pull, 2);
    } catch (const zmq::error_t& e) {
      log->error("event channel failed: {}", e.what());
      break;
    }
    if (!message) break;
    accept(*message, out);
  }
  if (local && local->take_publisher_left()) {
    // A shard of this process stopped; a successor is a new instance. What it
    // handed over before it stopped was taken above.
    log->info("a shard of {} in this process stopped; discovering its shards again", options.base_address);
    reset();
  }
  return out.size() - before;
}

void EventInbox::State::accept(detail::Message& message, std::vector<wire::Event>& out) {
  const std::size_t expected = security.enabled() ? 2 : 1;
  if (message.total_parts != expected || message.parts.empty()) {
    (security.enabled() ? auth_failures : malformed).add();
    return;
  }
  const std::string_view body = detail::view(message.parts[0]);
  if (security.enabled() &&
      !security.authenticator->verify(wire::FrameKind::event, body, detail::view(message.parts[1]))) {
    auth_failures.add();
    return;
  }
  wire::Envelope envelope;
  auto event = wire::decode_event(body, options.limits, &envelope);
  if (!event) {
    (envelope.reason == wire::RejectReason::unknown_op ? unknown : malformed).add();
    log->debug("dropped an event: {}", event.status().message());
    return;
  }
  if (replay) {
    Status fresh = envelope.stamp ? replay->check(*envelope.stamp) : protocol_error("the event has no stamp");
    if (!fresh) {
      auth_failures.add();
      return;
    }
  }
  received[static_cast<std::size_t>(event->kind)].add();
  out.push_back(std::move(*event));
}

}  // namespace ecx::control
