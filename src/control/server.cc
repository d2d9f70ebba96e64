#include "ecx/control/server.h"

#include <algorithm>
#include <array>
#include <deque>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <zmq.hpp>

#include "control/counters.h"
#include "control/local_calls.h"
#include "control/local_events.h"
#include "control/zmq_util.h"
#include "core/logging.h"
#include "ecx/core/thread_name.h"
#include "ecx/wire/codec.h"

namespace ecx::control {

using detail::Counter;

namespace {

constexpr std::size_t kMaxRequestsPerTurn = 1024;
constexpr std::chrono::milliseconds kMaxPollWait{100};
// Warn about the first dropped events, then about every 1000th.
bool should_log_drop(std::uint64_t dropped) { return dropped <= 5 || dropped % 1000 == 0; }

template <typename... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};
template <typename... Ts>
Overloaded(Ts...) -> Overloaded<Ts...>;

}  // namespace

ServerOptions ServerOptions::from_config(const Config& config) {
  ServerOptions o;
  o.host = config.ec_ip;
  o.tp_rank = static_cast<std::uint32_t>(config.layout.tp_rank);
  o.tp_size = static_cast<std::uint32_t>(config.layout.tp_size);
  o.port = config.control_port() + config.layout.tp_rank;
  o.event_port = config.event_port == 0 ? 0 : config.event_port + config.layout.tp_rank;
  for (int r = 0; r < config.layout.tp_size; ++r)
    o.control_ports.push_back(static_cast<std::uint32_t>(config.control_port() + r));
  o.event_queue_max = static_cast<std::size_t>(config.event_queue_max);
  o.limits.max_frame_bytes = static_cast<std::size_t>(config.max_frame_bytes);
  o.auth_secret = config.auth_secret;
  o.reserve_hold = std::chrono::milliseconds(config.reserve_hold_ms);
  return o;
}

struct ControlServer::State {
  ServerOptions options;
  std::shared_ptr<ControlHandler> handler;
  wire::FrameSecurity security;
  std::shared_ptr<spdlog::logger> log = ecx::log::get("control");

  zmq::context_t context = detail::tagged_context(detail::ContextTag::control_server);
  zmq::socket_t router{context, zmq::socket_type::router};
  zmq::socket_t push{context, zmq::socket_type::push};
  detail::Wakeup wakeup;
  int port = 0;
  int event_port = 0;
  std::string control_endpoint;
  std::string event_endpoint;
  std::string instance = ReservationId::random().to_string();
  std::vector<std::uint32_t> control_ports;

  // Server thread only.
  std::optional<wire::StampIssuer> stamps;
  std::optional<wire::ReplayGuard> replay;
  std::string scratch;
  TimePoint next_tick;

  std::atomic<bool> stopping{false};
  std::thread thread;

  std::mutex events_mutex;
  std::deque<wire::Event> events;  // guarded by events_mutex; bounded by event_queue_max

  std::array<std::array<Counter, 2>, wire::kOpCount> requests;
  std::array<Counter, wire::kReserveOutcomeCount> reserve_items;
  Counter malformed, oversized, unknown_ops, version_mismatches, auth_failures, handler_exceptions, replies_unsent,
      events_published, events_sent, events_dropped, ticks, reserves_held, held_placed, held_expired,
      in_process_cancels;

  // Reserve batches waiting for space (reserve_hold), oldest first. Server thread only,
  // except `holding` and `capacity_freed`, which capacity_changed() reads and sets.
  struct HeldReserve {
    zmq::message_t identity;
    bool sign = false;
    wire::DecodedRequest decoded;
    wire::Reply reply;  // the latest answer: every item retry_after
    TimePoint until;
  };
  static std::size_t item_count(const HeldReserve& h) {
    const auto* r = std::get_if<wire::ReserveBatchRequest>(&h.decoded.request.body);
    return r != nullptr ? r->items.size() : 0;
  }
  std::deque<HeldReserve> held;
  std::size_t held_items = 0;  // items of the requests in `held`
  std::atomic<bool> holding{false};
  std::atomic<bool> capacity_freed{false};

  void run() noexcept;
  void serve();
  void handle(detail::Message& message);
  void reject(const zmq::message_t& identity, std::uint64_t id, wire::RejectReason reason, std::string text, bool sign);
  void count_reject(wire::RejectReason reason);
  wire::Reply dispatch(wire::DecodedRequest& decoded);
  // One cancel result per request, as the handler answers it (a throwing handler fails
  // that item only). The server's thread, or an in-process caller's when the handler
  // allows it (cancel_runs_anywhere).
  wire::CancelResult cancel_item(const RequestContext& request_context, const wire::CancelRequest& item);
  // Serves an in-process caller's cancel_batch (see LocalCancelRegistry).
  wire::CancelBatchReply cancel_in_process(std::span<const wire::CancelRequest> items);
  void send_reply(const zmq::message_t& identity, const wire::Reply& reply, bool sign);
  bool flush_events();
  // Moves the queued events to an in-process subscriber; false when none is queued or
  // there is no such subscriber.
  bool hand_over_locally();
  void note_dropped(std::uint64_t dropped, const std::string& transfer_id) const;
  void maybe_tick();
  // Whether `reply` may be held: a reserve batch whose every item is retry_after.
  bool should_hold(const wire::DecodedRequest& decoded, const wire::Reply& reply) const;
  void revisit_held(TimePoint now);
  void answer(const zmq::message_t& identity, const wire::Reply& reply, bool sign);
};

Result<std::unique_ptr<ControlServer>> ControlServer::start(ServerOptions options,
                                                            std::shared_ptr<ControlHandler> handler) {
  if (!handler) return invalid_argument("ControlServer needs a handler");
  if (options.tp_size == 0 || options.tp_rank >= options.tp_size) {
    return invalid_argument(fmt::format("tp_rank {} is outside tp_size {}", options.tp_rank, options.tp_size));
  }
  if (options.event_queue_max == 0) return invalid_argument("event_queue_max must be at least 1");
  if (!options.clock) return invalid_argument("ControlServer needs a clock");
  auto security = wire::FrameSecurity::from_secret(options.auth_secret);
  if (!security) return security.status();

  auto state = std::make_unique<State>();
  State& s = *state;
  s.options = std::move(options);
  s.handler = std::move(handler);
  s.security = std::move(*security);
  if (!s.wakeup.valid()) return internal_error("eventfd failed");
  const std::string bind_control = detail::bind_address(s.options.host, s.options.port);
  const std::string bind_events = detail::bind_address(s.options.host, s.options.event_port);
  try {
    detail::set_common_options(s.router, s.options.limits);
    detail::set_common_options(s.push, s.options.limits);
    // Replies to a peer that stopped reading are dropped instead of blocking the loop.
    s.router.set(zmq::sockopt::sndhwm, 65536);
    s.router.set(zmq::sockopt::rcvhwm, 65536);
    s.router.bind(bind_control);
  } catch (const zmq::error_t& e) {
    return unavailable(fmt::format("control channel failed to bind {}: {}", bind_control, e.what()));
  }
  try {
    s.push.bind(bind_events);
  } catch (const zmq::error_t& e) {
    return unavailable(fmt::format("event channel failed to bind {}: {}", bind_events, e.what()));
  }
  auto endpoint_port = [](zmq::socket_t& socket) -> Result<detail::TcpEndpoint> {
    std::string last = socket.get(zmq::sockopt::last_endpoint);
    return detail::parse_tcp_endpoint(last);
  };
  auto control = endpoint_port(s.router);
  auto events = endpoint_port(s.push);
  if (!control) return control.status();
  if (!events) return events.status();
  s.port = control->port;
  s.event_port = events->port;
  s.control_endpoint = detail::with_port(*control, s.port);
  s.event_endpoint = detail::with_port(*events, s.event_port);
  s.control_ports = s.options.control_ports;
  if (s.control_ports.empty()) {
    const int base = s.port - static_cast<int>(s.options.tp_rank);
    for (std::uint32_t r = 0; r < s.options.tp_size; ++r)
      s.control_ports.push_back(static_cast<std::uint32_t>(base) + r);
  }
  if (s.control_ports.size() != s.options.tp_size) {
    return invalid_argument(
        fmt::format("control_ports lists {} ports for tp_size {}", s.control_ports.size(), s.options.tp_size));
  }
  if (s.security.enabled()) {
    s.stamps.emplace(s.options.wall_clock);
    s.replay.emplace(wire::ReplayGuard::Options{}, s.options.wall_clock);
  }
  s.next_tick = s.options.clock->now() + s.options.tick_interval;
  s.log->info("control channel listening on {} (events {}), shard {}/{}{}", s.control_endpoint, s.event_endpoint,
              s.options.tp_rank, s.options.tp_size, s.security.enabled() ? ", authenticated" : "");
  s.thread = std::thread([&s] {
    name_this_thread("ecx-ctl-server");
    s.run();
  });
  detail::LocalEventRegistry::instance().add_publisher(s.instance, s.options.auth_secret, [&s] { s.wakeup.notify(); });
  if (s.handler->cancel_runs_anywhere()) {
    detail::LocalCancelRegistry::instance().add(
        s.instance, s.options.auth_secret,
        [&s](std::span<const wire::CancelRequest> items) { return s.cancel_in_process(items); });
  }
  return std::unique_ptr<ControlServer>(new ControlServer(std::move(state)));
}

ControlServer::ControlServer(std::unique_ptr<State> state) : state_(std::move(state)) {}

ControlServer::~ControlServer() { stop(); }

void ControlServer::stop() {
  if (!state_->thread.joinable()) return;
  detail::LocalEventRegistry::instance().remove_publisher(state_->instance);
  detail::LocalCancelRegistry::instance().remove(state_->instance);
  state_->stopping.store(true, std::memory_order_release);
  state_->wakeup.notify();
  state_->thread.join();
}

int ControlServer::port() const noexcept { return state_->port; }
int ControlServer::event_port() const noexcept { return state_->event_port; }
std::string ControlServer::control_endpoint() const { return state_->control_endpoint; }
std::string ControlServer::event_endpoint() const { return state_->event_endpoint; }
const std::string& ControlServer::instance() const noexcept { return state_->instance; }

Status ControlServer::publish(wire::Event event) {
  State& s = *state_;
  if (event.kind == wire::EventKind::ready && (!event.spec || event.reservation_id.is_none())) {
    return invalid_argument("a ready event needs a spec and a reservation id");
  }
  if (Status v = validate_transfer_id(event.transfer_id); !v) return v;
  event.shard = s.options.tp_rank;
  event.instance = s.instance;
  std::uint64_t dropped = 0;
  std::optional<std::string> dropped_id;
  const auto local = detail::LocalEventRegistry::instance().subscriber(s.instance);
  bool delivered = false;
  {
    std::lock_guard lock(s.events_mutex);
    if (local && s.events.empty()) {
      // A subscriber in this process, nothing older still queued: straight to it.
      dropped_id = local->push(std::move(event));
      delivered = true;
    } else {
      if (s.events.size() >= s.options.event_queue_max) {
        dropped_id = std::move(s.events.front().transfer_id);
        s.events.pop_front();
      }
      s.events.push_back(std::move(event));
    }
    if (dropped_id) {
      s.events_dropped.add();
      dropped = s.events_dropped.get();
    }
  }
  s.events_published.add();
  if (delivered) s.events_sent.add();
  if (dropped_id) s.note_dropped(dropped, *dropped_id);
  if (!delivered) s.wakeup.notify();
  return Status::ok();
}

void ControlServer::State::note_dropped(std::uint64_t dropped, const std::string& transfer_id) const {
  if (!should_log_drop(dropped)) return;
  log->warn("event backlog full ({} events): dropped the oldest, for transfer_id={} ({} dropped so far)",
            options.event_queue_max, transfer_id, dropped);
}

void ControlServer::capacity_changed() noexcept {
  State& s = *state_;
  // Already flagged: the server sees it before it sleeps again (serve's wait is 0 then).
  if (s.capacity_freed.exchange(true, std::memory_order_acq_rel)) return;
  if (s.holding.load(std::memory_order_acquire)) s.wakeup.notify();
}

ServerCounters ControlServer::counters() const {
  const State& s = *state_;
  ServerCounters c;
  for (std::size_t op = 0; op < wire::kOpCount; ++op) {
    c.requests[op][0] = s.requests[op][0].get();
    c.requests[op][1] = s.requests[op][1].get();
  }
  for (std::size_t i = 0; i < wire::kReserveOutcomeCount; ++i) c.reserve_items[i] = s.reserve_items[i].get();
  c.malformed_frames = s.malformed.get();
  c.oversized_frames = s.oversized.get();
  c.unknown_ops = s.unknown_ops.get();
  c.version_mismatches = s.version_mismatches.get();
  c.auth_failures = s.auth_failures.get();
  c.handler_exceptions = s.handler_exceptions.get();
  c.replies_unsent = s.replies_unsent.get();
  c.events_published = s.events_published.get();
  c.events_sent = s.events_sent.get();
  c.events_dropped = s.events_dropped.get();
  c.ticks = s.ticks.get();
  c.reserves_held = s.reserves_held.get();
  c.held_reserves_placed = s.held_placed.get();
  c.held_reserves_expired = s.held_expired.get();
  c.in_process_cancels = s.in_process_cancels.get();
  return c;
}

// ---------------------------------------------------------------- server thread

void ControlServer::State::run() noexcept {
  try {
    serve();
  } catch (const std::exception& e) {
    log->error("control channel on port {} stopped serving: {}", port, e.what());
  } catch (...) {
    log->error("control channel on port {} stopped serving", port);
  }
}

void ControlServer::State::serve() {
  bool events_blocked = false;
  std::array<zmq_pollitem_t, 3> items{};
  while (!stopping.load(std::memory_order_acquire)) {
    bool have_events = false;
    {
      std::lock_guard lock(events_mutex);
      have_events = !events.empty();
    }
    // The event socket asks for nothing unless its queue is full (detail::poll then
    // leaves it alone).
    items = {{{router.handle(), 0, ZMQ_POLLIN, 0},
              {nullptr, wakeup.fd(), ZMQ_POLLIN, 0},
              {push.handle(), 0, static_cast<short>(have_events && events_blocked ? ZMQ_POLLOUT : 0), 0}}};
    // Wake for the tick, or for the end of the first hold (the oldest ends first).
    TimePoint wake_at = next_tick;
    if (!held.empty()) wake_at = std::min(wake_at, held.front().until);
    const bool held_may_fit = !held.empty() && capacity_freed.load(std::memory_order_acquire);
    const long wait = (have_events && !events_blocked) || held_may_fit
                          ? 0
                          : detail::poll_timeout_ms(options.clock->now(), wake_at, kMaxPollWait);
    if (detail::poll(items, wait) < 0) {
      log->error("control channel poll failed: {}", zmq_strerror(zmq_errno()));
      break;
    }
    if (items[1].revents & ZMQ_POLLIN) wakeup.clear();
    // Before new requests: what frees up goes to the reserves that waited.
    revisit_held(options.clock->now());
    for (std::size_t n = 0; n < kMaxRequestsPerTurn; ++n) {
      auto message = detail::receive(router, 3);  // identity, body, mac
      if (!message) break;
      handle(*message);
    }
    events_blocked = !flush_events();
    maybe_tick();
  }
  // Stopping: a held reserve is answered now (retry_after), not left to its client's timeout.
  for (auto& h : held) {
    held_expired.add();
    answer(h.identity, h.reply, h.sign);
  }
  held.clear();
  held_items = 0;
  holding.store(false, std::memory_order_release);
}

bool ControlServer::State::should_hold(const wire::DecodedRequest& decoded, const wire::Reply& reply) const {
  const auto* batch = std::get_if<wire::ReserveBatchReply>(&reply.body);
  if (batch == nullptr || batch->items.empty() || !decoded.item_errors.empty()) return false;
  return std::all_of(batch->items.begin(), batch->items.end(),
                     [](const wire::ReserveResult& r) { return r.outcome == wire::ReserveOutcome::retry; });
}

void ControlServer::State::revisit_held(TimePoint now) {
  if (held.empty()) return;
  const bool freed = capacity_freed.exchange(false, std::memory_order_acq_rel);
  for (auto it = held.begin(); it != held.end();) {
    if (freed) {
      wire::Reply again = dispatch(it->decoded);
      if (!should_hold(it->decoded, again)) {
        held_placed.add();
        answer(it->identity, again, it->sign);
        held_items -= item_count(*it);
        it = held.erase(it);
        continue;
      }
      it->reply = std::move(again);
    }
    if (now >= it->until) {
      held_expired.add();
      answer(it->identity, it->reply, it->sign);
      held_items -= item_count(*it);
      it = held.erase(it);
      continue;
    }
    ++it;
  }
  holding.store(!held.empty(), std::memory_order_release);
}

void ControlServer::State::answer(const zmq::message_t& identity, const wire::Reply& reply, bool sign) {
  if (const auto* batch = std::get_if<wire::ReserveBatchReply>(&reply.body)) {
    for (const auto& item : batch->items) reserve_items[static_cast<std::size_t>(item.outcome)].add();
  }
  requests[static_cast<std::size_t>(reply.op)][reply.ok() ? 0 : 1].add();
  send_reply(identity, reply, sign);
}

void ControlServer::State::maybe_tick() {
  const TimePoint now = options.clock->now();
  if (now < next_tick) return;
  ticks.add();
  try {
    handler->tick(now);
  } catch (const std::exception& e) {
    handler_exceptions.add();
    log->error("reservation sweep failed: {}", e.what());
  } catch (...) {
    handler_exceptions.add();
    log->error("reservation sweep failed");
  }
  next_tick += options.tick_interval;
  if (next_tick <= now) next_tick = now + options.tick_interval;
}

bool ControlServer::State::hand_over_locally() {
  {
    std::lock_guard lock(events_mutex);
    if (events.empty()) return false;  // nothing to move: spare the registry's lock on every turn
  }
  const auto local = detail::LocalEventRegistry::instance().subscriber(instance);
  if (!local) return false;
  std::lock_guard lock(events_mutex);
  while (!events.empty()) {
    events_sent.add();
    if (auto dropped_id = local->push(std::move(events.front()))) {
      events_dropped.add();
      note_dropped(events_dropped.get(), *dropped_id);
    }
    events.pop_front();
  }
  return true;
}

// True when the queue is empty; false when the PUSH socket would block.
bool ControlServer::State::flush_events() {
  if (hand_over_locally()) return true;
  for (;;) {
    wire::Event event;
    {
      std::lock_guard lock(events_mutex);
      if (events.empty()) return true;
      event = std::move(events.front());
      events.pop_front();
    }
    std::optional<wire::AuthStamp> stamp;
    if (stamps) stamp = stamps->next();
    wire::encode_event(event, stamp ? &*stamp : nullptr, scratch);
    std::optional<wire::Mac> mac;
    if (security.enabled()) mac = security.authenticator->sign(wire::FrameKind::event, scratch);
    // Counted before it leaves: whoever receives the event may read the counter at
    // once, and must find it counted. A send that fails takes the count back.
    events_sent.add();
    if (detail::send_frames(push, nullptr, scratch, mac ? &*mac : nullptr)) continue;
    events_sent.take_back();
    // No connected puller, or its queue is full: keep the event, unless the queue
    // filled up meanwhile, in which case this (the oldest) one is the one dropped.
    std::lock_guard lock(events_mutex);
    if (events.size() >= options.event_queue_max) {
      events_dropped.add();
    } else {
      events.push_front(std::move(event));
    }
    return false;
  }
}

void ControlServer::State::count_reject(wire::RejectReason reason) {
  switch (reason) {
    case wire::RejectReason::too_large:
      oversized.add();
      break;
    case wire::RejectReason::unknown_op:
      unknown_ops.add();
      break;
    case wire::RejectReason::version_mismatch:
      version_mismatches.add();
      break;
    case wire::RejectReason::unauthenticated:
      auth_failures.add();
      break;
    case wire::RejectReason::none:
    case wire::RejectReason::malformed:
      malformed.add();
      break;
  }
}

void ControlServer::State::reject(const zmq::message_t& identity, std::uint64_t id, wire::RejectReason reason,
                                  std::string text, bool sign) {
  count_reject(reason);
  if (reason == wire::RejectReason::unauthenticated) {
    log->warn("rejected an unauthenticated control frame: {}", text);
  } else {
    log->debug("rejected a control frame ({}): {}", wire::reject_reason_name(reason), text);
  }
  send_reply(identity, wire::make_reject_reply(id, reason, std::move(text)), sign);
}

void ControlServer::State::handle(detail::Message& message) {
  if (message.parts.empty()) return;
  const zmq::message_t& identity = message.parts[0];
  const std::size_t body_parts = message.total_parts - 1;
  const bool authenticated = security.enabled();
  const std::string_view body = message.parts.size() > 1 ? detail::view(message.parts[1]) : std::string_view{};

  // Best effort: read the id so that even a refused request gets a prompt answer.
  auto peek_id = [&]() -> std::uint64_t {
    wire::Envelope envelope;
    (void)wire::decode_request(body, options.limits, &envelope);
    return envelope.id;
  };

  if (authenticated) {
    if (body_parts != 2) {
      const std::uint64_t id = body_parts == 1 ? peek_id() : 0;
      return reject(identity, id, wire::RejectReason::unauthenticated,
                    fmt::format("authentication is required: expected 2 parts (body, mac), got {}", body_parts), false);
    }
    if (!security.authenticator->verify(wire::FrameKind::request, body, detail::view(message.parts[2]))) {
      return reject(identity, peek_id(), wire::RejectReason::unauthenticated, "bad MAC (wrong key or altered frame)",
                    false);
    }
  } else if (body_parts != 1) {
    return reject(identity, body_parts == 2 ? peek_id() : 0, wire::RejectReason::malformed,
                  body_parts == 2 ? "the frame carries a MAC part but authentication is off on this server"
                                  : fmt::format("expected 1 part, got {}", body_parts),
                  false);
  }

  wire::Envelope envelope;
  auto decoded = wire::decode_request(body, options.limits, &envelope);
  if (authenticated) {
    // Only a frame with a valid MAC gets here; its stamp must be fresh and unseen.
    Status fresh = envelope.stamp ? replay->check(*envelope.stamp) : protocol_error("the frame has no stamp");
    if (!fresh) return reject(identity, envelope.id, wire::RejectReason::unauthenticated, fresh.message(), false);
  }
  if (!decoded) {
    return reject(identity, envelope.id, envelope.reason, decoded.status().message(), authenticated);
  }
  wire::Reply reply = dispatch(*decoded);
  const auto* reserve = std::get_if<wire::ReserveBatchRequest>(&decoded->request.body);
  const std::size_t items = reserve != nullptr ? reserve->items.size() : 0;
  if (options.reserve_hold > Duration::zero() && held.size() < options.max_held_reserves &&
      held_items + items <= options.max_held_items && should_hold(*decoded, reply)) {
    const TimePoint now = options.clock->now();
    Duration hold = options.reserve_hold;
    const auto client_timeout = std::chrono::milliseconds(decoded->request.timeout_ms);
    if (client_timeout > Duration::zero()) hold = std::min<Duration>(hold, client_timeout / 2);
    zmq::message_t held_identity(identity.data(), identity.size());
    // A release racing this hold sets capacity_freed, which serve sees before it sleeps.
    held.push_back(
        HeldReserve{std::move(held_identity), authenticated, std::move(*decoded), std::move(reply), now + hold});
    held_items += items;
    reserves_held.add();
    holding.store(true, std::memory_order_release);
    return;
  }
  answer(identity, reply, authenticated);
}

void ControlServer::State::send_reply(const zmq::message_t& identity, const wire::Reply& reply, bool sign) {
  std::optional<wire::AuthStamp> stamp;
  if (sign && stamps) stamp = stamps->next();
  wire::encode_reply(reply, stamp ? &*stamp : nullptr, scratch);
  std::optional<wire::Mac> mac;
  if (stamp) mac = security.authenticator->sign(wire::FrameKind::reply, scratch);
  if (!detail::send_frames(router, &identity, scratch, mac ? &*mac : nullptr)) replies_unsent.add();
}

namespace {

// A batch request's items in their order: `on_error(error)` for one that did not
// decode (decoding recorded it by index), `on_valid(k)` for the k-th one that did.
template <typename OnError, typename OnValid>
void for_each_batch_item(std::size_t valid, const std::vector<wire::ItemError>& errors, OnError on_error,
                         OnValid on_valid) {
  std::size_t next_valid = 0;
  std::size_t next_error = 0;
  for (std::size_t i = 0; i < valid + errors.size(); ++i) {
    if (next_error < errors.size() && errors[next_error].index == i) {
      on_error(errors[next_error++].error);
    } else {
      on_valid(next_valid++);
    }
  }
}

}  // namespace

wire::CancelResult ControlServer::State::cancel_item(const RequestContext& request_context,
                                                     const wire::CancelRequest& item) {
  wire::CancelResult out;
  try {
    auto answered = handler->cancel(request_context, item);
    if (answered) {
      out.cancelled = answered->cancelled;
    } else {
      out.error = answered.status();
    }
  } catch (const std::exception& e) {
    handler_exceptions.add();
    log->error("cancel handler failed for {}: {}", item.transfer_id, e.what());
    out.error = internal_error(fmt::format("cancel failed on the server: {}", e.what()));
  }
  return out;
}

wire::CancelBatchReply ControlServer::State::cancel_in_process(std::span<const wire::CancelRequest> items) {
  const RequestContext request_context{0, options.clock->now(), Duration{0}};
  wire::CancelBatchReply batch;
  batch.items.reserve(items.size());
  for (const auto& item : items) batch.items.push_back(cancel_item(request_context, item));
  requests[static_cast<std::size_t>(wire::Op::cancel_batch)][0].add();
  in_process_cancels.add(items.size());
  return batch;
}

wire::Reply ControlServer::State::dispatch(wire::DecodedRequest& decoded) {
  wire::Request& request = decoded.request;
  wire::Reply reply;
  reply.id = request.id;
  reply.op = request.op();
  const RequestContext request_context{request.id, options.clock->now(), std::chrono::milliseconds(request.timeout_ms)};
  auto settle = [&reply](auto result) {
    if (result) {
      reply.body = std::move(*result);
    } else {
      reply.status = result.status();
    }
  };
  try {
    std::visit(Overloaded{
                   [&](const wire::HelloRequest& r) {
                     wire::HelloReply hello;
                     handler->describe(hello);
                     hello.shard = options.tp_rank;
                     hello.tp_size = options.tp_size;
                     hello.control_ports = control_ports;
                     hello.event_port = static_cast<std::uint32_t>(event_port);
                     hello.instance = instance;
                     hello.min_version = wire::kMinProtocolVersion;
                     hello.max_version = wire::kProtocolVersion;
                     if (security.enabled() && !hello.has_feature(wire::kFeatureAuth)) {
                       hello.features.emplace_back(wire::kFeatureAuth);
                     }
                     // Answered here, item by item through the handler's cancel.
                     if (!hello.has_feature(wire::kFeatureCancelBatch)) {
                       hello.features.emplace_back(wire::kFeatureCancelBatch);
                     }
                     if (!r.client.empty()) log->debug("hello from {}", r.client);
                     reply.body = std::move(hello);
                   },
                   [&](const wire::ReserveBatchRequest& r) {
                     std::vector<wire::ReserveResult> answered = handler->reserve_batch(request_context, r.items);
                     if (answered.size() != r.items.size()) {
                       log->error("reservation handler answered {} of {} items", answered.size(), r.items.size());
                       answered.resize(r.items.size(),
                                       wire::ReserveResult::failed(internal_error("no answer for this item")));
                     }
                     wire::ReserveBatchReply batch;
                     batch.items.reserve(r.items.size() + decoded.item_errors.size());
                     for_each_batch_item(
                         r.items.size(), decoded.item_errors,
                         [&](const Status& error) { batch.items.push_back(wire::ReserveResult::failed(error)); },
                         [&](std::size_t k) { batch.items.push_back(std::move(answered[k])); });
                     reply.body = std::move(batch);
                   },
                   [&](const wire::CancelRequest& r) { settle(handler->cancel(request_context, r)); },
                   [&](const wire::CancelBatchRequest& r) {
                     // Each item as its own cancel would be (a throwing handler fails
                     // that item only); malformed items keep their place with their error.
                     wire::CancelBatchReply batch;
                     batch.items.reserve(r.items.size() + decoded.item_errors.size());
                     for_each_batch_item(
                         r.items.size(), decoded.item_errors,
                         [&](const Status& error) {
                           batch.items.push_back(wire::CancelResult{false, error});
                         },
                         [&](std::size_t k) { batch.items.push_back(cancel_item(request_context, r.items[k])); });
                     reply.body = std::move(batch);
                   },
                   [&](const wire::StatusRequest& r) { settle(handler->status(request_context, r)); },
                   [&](const wire::CompleteRequest& r) { settle(handler->complete(request_context, r)); },
               },
               request.body);
  } catch (const std::exception& e) {
    handler_exceptions.add();
    log->error("{} handler failed: {}", wire::op_name(reply.op), e.what());
    reply.body = std::monostate{};
    reply.status = internal_error(fmt::format("{} failed on the server: {}", wire::op_name(reply.op), e.what()));
  } catch (...) {
    handler_exceptions.add();
    reply.body = std::monostate{};
    reply.status = internal_error(fmt::format("{} failed on the server", wire::op_name(reply.op)));
  }
  return reply;
}

}  // namespace ecx::control
