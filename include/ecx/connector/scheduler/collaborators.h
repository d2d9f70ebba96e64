#pragma once
// The two collaborators of the SchedulerCoordinator, as small value-typed
// interfaces. Production wires them to the ZeroMQ control client and event inbox;
// unit tests use in-process fakes.

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/ids.h"
#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"
#include "ecx/core/wake_source.h"

namespace ecx::scheduler {

// One event from a consumer shard about one transfer.
struct TransferEvent {
  enum class Kind : unsigned char {
    ready,      // the payload landed in this shard's reservation
    abandoned,  // no producer will ever write this reservation
    failed,     // the shard gave up on the transfer (e.g. a checksum mismatch)
  };
  Kind kind = Kind::ready;
  std::string transfer_id;
  std::string mm_hash;
  // The shard's tag (its TP index or control port); every shard of one consumer
  // uses the same kind of tag. -1 = untagged, accepted only from an unsharded consumer.
  int shard = -1;
  std::optional<TensorSpec> spec;  // ready only: the landed tensor
  ReservationId reservation_id;    // ready only: this shard's reservation (diagnostic)
  std::string reason;              // failed only
};

// Readiness events of the consumer this scheduler belongs to.
// What an event subscription turned away or went through besides the events it
// delivered: the counts an operator needs when readiness stops arriving.
struct SubscriptionCounters {
  std::uint64_t malformed = 0;            // messages that did not decode
  std::uint64_t unknown_kind = 0;         // an event kind this release does not know
  std::uint64_t auth_failures = 0;        // messages whose signature did not verify
  std::uint64_t discoveries_started = 0;  // topology discoveries of the consumer's shards
  std::uint64_t discoveries_failed = 0;
};

class EventSource {
 public:
  virtual ~EventSource() = default;
  // Never blocks: appends at most `max_events` queued events to `out` and returns
  // how many it appended. Subscription and topology discovery happen elsewhere
  // (no events until they are done).
  virtual std::size_t drain(std::vector<TransferEvent>& out, std::size_t max_events) = 0;
  // Blocks up to `max_wait` until drain() would have something or one of `also`
  // polls readable; true when either may. For an engine loop that has nothing to do
  // until a transfer lands or a request comes (a simulator, a tool), never for a
  // step. A source that cannot wait answers false at once.
  virtual bool wait(Duration /*max_wait*/, std::span<const WakeSource> /*also*/) { return false; }
  // Consumer shards whose events this source delivers; 0 while not subscribed.
  // A transfer is loadable only when this many distinct shards reported it.
  virtual int shard_count() const = 0;
  // Idempotent. No drain() after close().
  virtual void close() = 0;
  // The subscription's own counts, kept after close(); zeros for a source that keeps
  // none. Same thread as drain().
  virtual SubscriptionCounters subscription_counters() const { return {}; }
};

// Control RPCs to consumer shards. Calls block (each bounded by the client's own
// deadline), so the coordinator makes them only from its executor threads,
// concurrently: implementations must be thread-safe.
class ConsumerControl {
 public:
  virtual ~ConsumerControl() = default;
  // The control address of every TP shard of the consumer whose first shard
  // listens at `base_address` (in shard order). An error when the topology cannot
  // be confirmed; never a guess such as the base address alone.
  virtual Result<std::vector<std::string>> discover_shards(const std::string& base_address) = 0;
  // Asks one shard to cancel its reservation for `transfer_id`; true when the
  // shard cancelled something, false when it had nothing to cancel.
  virtual Result<bool> cancel(const std::string& shard_address, const std::string& transfer_id) = 0;
  // The same for several transfers: one answer per id, in order. A collaborator that
  // can send them together (the control protocol's cancel_batch) overrides this; the
  // default asks one at a time.
  virtual std::vector<Result<bool>> cancel_many(const std::string& shard_address,
                                                const std::vector<std::string>& transfer_ids) {
    std::vector<Result<bool>> answers;
    answers.reserve(transfer_ids.size());
    for (const auto& id : transfer_ids) answers.push_back(cancel(shard_address, id));
    return answers;
  }
  // What one shard holds for `transfer_id` (the diagnostic `status` request): the
  // readiness recheck asks this of every shard for a transfer whose readiness event
  // has not come. A collaborator that cannot ask answers unavailable.
  struct ShardTransfer {
    bool found = false;
    std::string state;  // the shard's reservation state, e.g. "writing", "ready"
    std::string mm_hash;
    std::optional<TensorSpec> spec;
    ReservationId reservation_id;
  };
  virtual Result<ShardTransfer> transfer_status(const std::string& /*shard_address*/,
                                                const std::string& /*transfer_id*/) {
    return unavailable("this control collaborator cannot ask shards about transfers");
  }
  // Idempotent; called after every executor thread has stopped.
  virtual void close() = 0;
};

// Producer, cross-encoder cache: what the shared embedding store holds, answered
// locally (a presence index kept current off the scheduler thread).
class StorePresence {
 public:
  virtual ~StorePresence() = default;
  // Whether mm_hash can be loaded from the store. Must not block.
  virtual bool present(std::string_view mm_hash) = 0;
  // A worker could not load it: not present until the store says so again.
  virtual void forget(std::string_view mm_hash) = 0;
};

}  // namespace ecx::scheduler
