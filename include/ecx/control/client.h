#pragma once
// The control client: one DEALER socket per peer address, any number of requests in
// flight per peer, matched to replies by request id, each with its own deadline. A
// lost or late reply costs only its own request (it times out); the socket stays
// usable and reconnects by itself when the peer restarts.
//
// One owned I/O thread does the sockets' work for asynchronous calls. Callbacks run
// on that thread: they must return quickly and must not wait for another reply
// (they may start new calls). Blocking wrappers must not be called from a callback.
//
// A blocking call goes over a lane instead: a DEALER socket of the client's that one
// caller uses at a time, so the request leaves and its reply is read on the caller's
// own thread. That saves the two thread hand-offs (caller -> I/O thread -> caller)
// that otherwise cost a blocking round trip about 1.4x a bare ZeroMQ echo. Lanes are
// bounded (`max_lanes`); when all are busy a blocking call takes the I/O thread's way.

#include <array>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/status.h"
#include "ecx/wire/auth.h"
#include "ecx/wire/messages.h"
#include "ecx/wire/protocol.h"

namespace ecx::control {

struct ClientOptions {
  Duration default_timeout = std::chrono::seconds(30);
  std::size_t max_in_flight = 16384;  // all peers together; beyond it calls fail at once
  std::size_t max_peers = 1024;       // idle peers are closed first when a new one needs room
  std::size_t max_lanes = 64;         // sockets for blocking calls; 0 = blocking calls use the I/O thread
  wire::Limits limits;
  std::string auth_secret;  // "" = authentication off
  std::shared_ptr<const Clock> clock = SteadyClock::shared();
  wire::WallClock wall_clock = wire::system_wall_clock();
  std::string name;  // sent in hello requests, for the server's logs

  // control_timeout_s, max_frame_bytes, auth_secret.
  static ClientOptions from_config(const Config& config);
};

// One shard of a consumer replica as discovery found it.
struct ShardEndpoint {
  std::uint32_t rank = 0;
  std::string control;  // tcp://host:port
  std::string events;   // tcp://host:event_port
  wire::HelloReply hello;
};

struct Topology {
  std::string base;                   // the address discovery started from
  std::vector<ShardEndpoint> shards;  // index = rank
  std::vector<std::string> control_addresses() const;
};

struct ClientCounters {
  std::array<std::uint64_t, wire::kOpCount> sent{};
  std::uint64_t replies_ok = 0;
  std::uint64_t replies_error = 0;  // the server answered with an error
  std::uint64_t timeouts = 0;
  std::uint64_t rejected_calls = 0;     // refused before sending (too many in flight, bad address, too large)
  std::uint64_t unmatched_replies = 0;  // late (after a timeout), duplicated or unknown id
  std::uint64_t malformed_replies = 0;
  std::uint64_t auth_failures = 0;  // bad MAC, stale or replayed stamp
  std::uint64_t peers_opened = 0;
  std::uint64_t peers_closed = 0;
  std::uint64_t discoveries_ok = 0;
  std::uint64_t discoveries_failed = 0;
  std::uint64_t lane_calls = 0;        // blocking calls that went over a lane
  std::uint64_t lanes_opened = 0;      // lane sockets opened (a lane is kept for the next call)
  std::uint64_t in_process_calls = 0;  // answered by a server of this process without the network
};

class ControlClient {
 public:
  using ReplyCallback = std::function<void(Result<wire::Reply>)>;
  using FanOutCallback = std::function<void(std::vector<Result<wire::Reply>>)>;
  using TopologyCallback = std::function<void(Result<Topology>)>;

  static Result<std::unique_ptr<ControlClient>> create(ClientOptions options);
  // Stops the I/O thread; calls still pending complete with `cancelled`.
  ~ControlClient();
  // The same, before destruction: every call in flight completes at once with
  // `cancelled` and later calls are refused. Idempotent; not from a callback.
  void close();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  // Sends one request. `done` gets the reply (an error reply is a Reply whose status
  // is not ok), or timeout / unavailable / cancelled / protocol errors. It runs on
  // the I/O thread, or inline when the call is refused before it is queued.
  // timeout <= 0 uses the default.
  void call_async(std::string address, wire::RequestBody body, Duration timeout, ReplyCallback done);
  std::future<Result<wire::Reply>> call(std::string address, wire::RequestBody body, Duration timeout = Duration{0});

  // Blocking: the same as call(...).get(), over a lane when one is free.
  Result<wire::Reply> call_blocking(std::string address, wire::RequestBody body, Duration timeout = Duration{0});

  // Blocking, typed: an error reply becomes its Status.
  Result<wire::HelloReply> hello(const std::string& address, Duration timeout = Duration{0});
  Result<wire::ReserveBatchReply> reserve_batch(const std::string& address, std::vector<wire::ReserveItem> items,
                                                Duration timeout = Duration{0});
  Result<wire::CancelReply> cancel(const std::string& address, wire::CancelRequest request,
                                   Duration timeout = Duration{0});
  // Many cancels in one frame, to a shard whose hello has kFeatureCancelBatch: one
  // result per item, in order (a reply of another length is a protocol error). A
  // discovered shard served by this process whose handler allows it
  // (ControlHandler::cancel_runs_anywhere) answers on this thread, without the network.
  Result<wire::CancelBatchReply> cancel_batch(const std::string& address, std::vector<wire::CancelRequest> items,
                                              Duration timeout = Duration{0});
  Result<wire::StatusReply> status(const std::string& address, std::string transfer_id, Duration timeout = Duration{0});

  // The same request to every address at once; results in address order.
  void call_all_async(std::vector<std::string> addresses, const wire::RequestBody& body, Duration timeout,
                      FanOutCallback done);
  std::vector<Result<wire::Reply>> call_all(std::vector<std::string> addresses, const wire::RequestBody& body,
                                            Duration timeout = Duration{0});

  // Asks `base` for its siblings, then every shard for its endpoints; all shards must
  // answer consistently. Two attempts; the result is cached only on success, so
  // an unconfirmed topology is never used. `timeout` bounds each request.
  void discover_async(const std::string& base, Duration timeout, const TopologyCallback& done);
  Result<Topology> discover(const std::string& base, Duration timeout = Duration{0});
  std::optional<Topology> cached_topology(const std::string& base) const;
  // Whether a confirmed topology of `base` is cached (cached_topology without the copy).
  bool has_topology(const std::string& base) const;
  // Drops the cached topology (e.g. after the consumer restarted).
  void forget_topology(const std::string& base);

  ClientCounters counters() const;
  const ClientOptions& options() const noexcept;

  struct State;

 private:
  explicit ControlClient(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

// Turns a reply into its typed body, or its error. Exposed for callers of call_async.
template <typename T>
Result<T> reply_body(Result<wire::Reply> reply) {
  if (!reply) return reply.status();
  if (!reply->ok()) return reply->status;
  if (auto* body = std::get_if<T>(&reply->body)) return std::move(*body);
  return protocol_error("the reply does not answer the request's op");
}

}  // namespace ecx::control
