#pragma once
// The control server of one consumer shard: a ROUTER socket answering hello,
// reserve_batch, cancel, status (and complete in the one-sided mode), and a PUSH
// socket sending readiness events. One owned thread does all socket work.

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ecx/control/handler.h"
#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/status.h"
#include "ecx/wire/auth.h"
#include "ecx/wire/messages.h"
#include "ecx/wire/protocol.h"

namespace ecx::control {

struct ServerOptions {
  std::string host = "127.0.0.1";  // IPv6 literals without brackets are fine
  int port = 0;                    // this shard's control port; 0 = ephemeral (tests)
  int event_port = 0;              // 0 = ephemeral
  std::uint32_t tp_rank = 0;
  std::uint32_t tp_size = 1;
  // Every shard's control port (index = rank). Empty: bound port - tp_rank + r.
  std::vector<std::uint32_t> control_ports;
  std::size_t event_queue_max = 4096;
  wire::Limits limits;
  std::string auth_secret;  // "" = authentication off
  Duration tick_interval = std::chrono::seconds(1);
  // A reserve batch none of whose items can be placed (every one retry_after) is held
  // this long, at most half the client's timeout, and answered as soon as
  // capacity_changed() lets an item be placed: the producer waits once instead of
  // retrying blind. Zero answers retry_after at once.
  Duration reserve_hold = Duration::zero();
  std::size_t max_held_reserves = 1024;  // requests held at most; beyond it, answered at once
  std::size_t max_held_items = 16'384;   // their items at most (a request may carry many)
  std::shared_ptr<const Clock> clock = SteadyClock::shared();
  wire::WallClock wall_clock = wire::system_wall_clock();  // replay window of authenticated frames

  // ec_ip, control_port() + tp_rank, event_port (+ tp_rank when set), layout,
  // event_queue_max, max_frame_bytes, auth_secret, reserve_hold_ms.
  static ServerOptions from_config(const Config& config);
};

// A snapshot; every field only grows.
struct ServerCounters {
  // requests[op][0] answered ok, [1] answered with an error by the handler.
  std::array<std::array<std::uint64_t, 2>, wire::kOpCount> requests{};
  std::array<std::uint64_t, wire::kReserveOutcomeCount> reserve_items{};  // per-item outcomes
  std::uint64_t malformed_frames = 0;  // undecodable, wrong types, empty, wrong part count
  std::uint64_t oversized_frames = 0;
  std::uint64_t unknown_ops = 0;
  std::uint64_t version_mismatches = 0;
  std::uint64_t auth_failures = 0;  // missing/bad MAC, replayed or stale stamp
  std::uint64_t handler_exceptions = 0;
  std::uint64_t replies_unsent = 0;  // the peer's queue was full or it left
  std::uint64_t events_published = 0;
  std::uint64_t events_sent = 0;
  std::uint64_t events_dropped = 0;  // oldest dropped from a full queue
  std::uint64_t ticks = 0;
  std::uint64_t reserves_held = 0;          // reserve batches held for space (reserve_hold)
  std::uint64_t held_reserves_placed = 0;   // of those, answered once space freed
  std::uint64_t held_reserves_expired = 0;  // of those, answered retry_after at the end of their hold
  // Cancels a client of this process ran here without the network (also counted in
  // requests, as cancel_batch requests answered ok).
  std::uint64_t in_process_cancels = 0;
};

class ControlServer {
 public:
  // Binds both sockets on the caller's thread (a bind error is returned here), then
  // starts the server thread. The handler must outlive the server.
  static Result<std::unique_ptr<ControlServer>> start(ServerOptions options, std::shared_ptr<ControlHandler> handler);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // Prompt (linger 0) and idempotent; joins the thread. Queued events are dropped.
  void stop();

  // Callable from any thread. Fills shard and instance; refuses an event the codec
  // could not send (e.g. ready without a spec). When the queue is full the oldest
  // event is dropped, counted and logged.
  Status publish(wire::Event event);
  // Callable from any thread: space may have freed, so held reserves are tried again.
  // An atomic exchange; a wake-up syscall only when reserves are held.
  void capacity_changed() noexcept;

  int port() const noexcept;
  int event_port() const noexcept;
  std::string control_endpoint() const;  // tcp://host:port as bound
  std::string event_endpoint() const;
  const std::string& instance() const noexcept;
  ServerCounters counters() const;

  struct State;

 private:
  explicit ControlServer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace ecx::control
