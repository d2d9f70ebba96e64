#pragma once
// What a ControlServer asks of the component behind it (the consumer worker).
// Every method runs on the server's thread, one call at a time, so an
// implementation needs no locking for state only these methods touch. Methods must
// not block for long: the next request waits behind them. An exception thrown by a
// method becomes an `internal` error reply (and is counted); it never stops the server.

#include <cstdint>
#include <span>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"
#include "ecx/wire/messages.h"

namespace ecx::control {

struct RequestContext {
  std::uint64_t request_id = 0;
  TimePoint received_at;    // by the server's clock
  Duration client_timeout;  // how long the client waits for this reply (0 = not said)
};

class ControlHandler {
 public:
  virtual ~ControlHandler() = default;

  // Fills the shard's data-plane description, pool sizes and features. The server
  // sets shard, tp_size, control_ports, event_port, instance and versions itself.
  virtual void describe(wire::HelloReply& reply) = 0;

  // One result per item, in order. A wrong count is answered for the missing items
  // with `internal` errors (and logged); one bad item never fails the others.
  virtual std::vector<wire::ReserveResult> reserve_batch(const RequestContext& context,
                                                         std::span<const wire::ReserveItem> items) = 0;

  virtual Result<wire::CancelReply> cancel(const RequestContext& context, const wire::CancelRequest& request) = 0;
  // Whether cancel() may also run on another thread of this process, concurrently
  // with the server's: then a ControlClient of this process cancels here without the
  // network (a release per loaded item costs the scheduler's process four thread
  // hand-offs and a loopback round trip otherwise). Default: no.
  virtual bool cancel_runs_anywhere() const noexcept { return false; }

  virtual Result<wire::StatusReply> status(const RequestContext& context, const wire::StatusRequest& request) = 0;

  // One-sided mode only (feature "put"): the producer's write has landed.
  virtual Result<wire::CompleteReply> complete(const RequestContext& context, const wire::CompleteRequest& request) {
    (void)context;
    (void)request;
    return protocol_error("this shard does not accept 'complete' (it lands payloads itself)");
  }

  // Called every ServerOptions::tick_interval (by the server's clock) for the
  // reservation expiry sweep.
  virtual void tick(TimePoint now) { (void)now; }
};

}  // namespace ecx::control
