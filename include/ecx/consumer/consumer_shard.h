#pragma once
// One consumer TP shard, assembled: the receive pool (one slab, registered once with
// the transport), the reservation manager over it, the control server (reserve,
// cancel, status, hello) and the data-plane endpoint whose landing resolver asks the
// reservation manager where each payload goes. Readiness events leave through the
// control server as soon as a payload has landed.
//
// Threads: the control server's thread, the transport's progress thread, and the
// caller's (take / take_resident / drain_reclaimed / counters). All public methods
// are thread-safe.

#include <memory>
#include <string>
#include <vector>

#include "ecx/consumer/reservation_manager.h"
#include "ecx/control/server.h"
#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/metrics.h"
#include "ecx/core/status.h"
#include "ecx/transport/transport.h"

namespace ecx::consumer {

struct ShardCounters {
  ReservationCounters reservations;
  control::ServerCounters control;
  transport::TransportStats transport;
  std::uint64_t headers_rejected = 0;  // payloads whose header did not decode
};

class ConsumerShard {
 public:
  // Starts shard config.layout.tp_rank of the configured replica: allocates and
  // registers the pool, listens on the data plane, binds the control port.
  static Result<std::unique_ptr<ConsumerShard>> start(const Config& config,
                                                      std::shared_ptr<const Clock> clock = SteadyClock::shared());
  // Shuts down (see shutdown()).
  ~ConsumerShard();
  ConsumerShard(const ConsumerShard&) = delete;
  ConsumerShard& operator=(const ConsumerShard&) = delete;

  // The landed payload of a READY transfer; valid until the lease is released.
  Result<SlotLease> take(std::string_view transfer_id, std::string_view mm_hash);
  // A resident copy (a local reload of content that landed before).
  Result<SlotLease> take_resident(std::string_view mm_hash, const TensorSpec& spec);
  // mm_hashes whose resident copy was reclaimed since the last call.
  std::vector<std::string> drain_reclaimed();

  // Refuses new reservations, cancels what no writer holds, waits for writers up to
  // `drain` (shutdown_drain_timeout_s without one), then stops the control server and
  // the transport. The pool stays allocated (leaked on purpose, and logged) if a
  // writer did not finish, so a late payload can never land in freed memory.
  // Idempotent: a second call returns the first call's report.
  DrainReport shutdown();
  DrainReport shutdown(Duration drain);

  int tp_rank() const noexcept;
  std::string control_endpoint() const;
  std::string event_endpoint() const;
  std::string data_address() const;
  std::uint64_t pool_capacity() const noexcept;
  ShardCounters counters() const;
  Status check_invariants() const;
  // Exports this shard's counters as `ecx_consumer_*` samples labelled shard=<rank>.
  std::uint64_t export_metrics(metrics::Registry& registry) const;

  struct State;

 private:
  explicit ConsumerShard(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace ecx::consumer
