#pragma once
// The consumer's reservation manager: which transfer owns which slot of the receive
// slab, from reserve to take. Thread-safe (the control thread, the transport's
// progress thread and the worker all call it); every state change goes through one
// validated transition table.
//
// Central invariant: a slot a writer may still be writing into is never freed or
// reused — not on a timeout, not on a cancel. Only the end of that write (landed,
// failed, or the one-sided writer's own abandon) releases it.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/consumer/reservation_types.h"
#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/status.h"

namespace ecx::consumer {

namespace detail {
class ReservationCore;
}

struct ReservationOptions {
  std::byte* slab_base = nullptr;  // the registered receive slab (not owned)
  std::uint64_t slab_size = 0;
  std::uint64_t alignment = 256;
  LandingMode mode = LandingMode::receiver_chosen;
  Duration ttl = std::chrono::seconds(300);  // unfinished reservations, READY records, tombstones
  std::uint64_t tombstone_max = 65'536;
  std::uint64_t event_queue_max = 4'096;  // also bounds the reclaimed-hash list
  Duration retry_after = std::chrono::milliseconds(5);
  bool checksum = false;                      // verify xxHash64 of every landed payload
  std::uint64_t max_tensor_bytes = 0;         // 0 = slab size
  std::uint64_t resident_capacity_bytes = 0;  // 0 = slab size
  // A reserve the full pool has turned away for this long gets the next space: newer
  // reserves that would take it are told to retry (0 = first come, first served).
  // Without it a large tensor can starve while smaller ones keep taking what frees up.
  Duration starvation_after = std::chrono::seconds(15);
  // How long the control server holds a reserve that does not fit (reserve_hold_ms): a
  // held reserve is asked again only when space frees or its hold ends, so a waiter
  // counts as gone only after twice that without a retry.
  Duration reserve_hold = Duration::zero();
  // Called when a slot becomes free or reclaimable (a turned-away reserve may fit now),
  // on whichever thread released it, under the manager's lock: quick, no calls back.
  std::function<void()> space_freed;

  // From the config: ttl, tombstone_max, event_queue_max, retry_after_ms, checksum,
  // pool_alignment, max_tensor_bytes, resident_capacity_bytes, starvation_after (a
  // quarter of push_wait_timeout_s, how long a producer keeps retrying). `mode` stays
  // receiver_chosen: the shard sets it from its data plane's capabilities().
  static ReservationOptions from_config(const Config& config, std::byte* slab_base, std::uint64_t slab_size);
};

// A view of a landed slot. The bytes stay valid and unchanged until the lease is
// released (destroyed or release()d); then the slot stays resident (reusable by
// content) or is freed. Movable, not copyable. Safe to release after the manager is
// gone (the bookkeeping outlives it), but the slab itself must outlive every lease.
class SlotLease {
 public:
  SlotLease() = default;
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  SlotLease(SlotLease&& other) noexcept;
  SlotLease& operator=(SlotLease&& other) noexcept;
  ~SlotLease();

  bool valid() const noexcept { return core_ != nullptr; }
  explicit operator bool() const noexcept { return valid(); }
  std::byte* data() const noexcept { return data_; }
  std::uint64_t offset() const noexcept { return offset_; }
  std::uint64_t nbytes() const noexcept { return spec_ ? spec_->nbytes() : 0; }
  const TensorSpec& spec() const { return *spec_; }
  const std::string& mm_hash() const noexcept { return mm_hash_; }
  // Gives the slot back; idempotent.
  void release() noexcept;

 private:
  friend class detail::ReservationCore;
  SlotLease(std::shared_ptr<detail::ReservationCore> core, std::uint64_t entry_id, std::byte* data,
            std::uint64_t offset, TensorSpec spec, std::string mm_hash);

  std::shared_ptr<detail::ReservationCore> core_;
  std::uint64_t entry_id_ = 0;
  std::byte* data_ = nullptr;
  std::uint64_t offset_ = 0;
  std::optional<TensorSpec> spec_;
  std::string mm_hash_;
};

// What a shutdown drain found.
struct DrainReport {
  bool writers_finished = false;  // no slot may still be written: the pool may be unregistered
  std::uint64_t writers_remaining = 0;
  std::uint64_t leases_outstanding = 0;
};

class ReservationManager {
 public:
  ReservationManager(const ReservationOptions& options, std::shared_ptr<const Clock> clock);
  ~ReservationManager();
  ReservationManager(const ReservationManager&) = delete;
  ReservationManager& operator=(const ReservationManager&) = delete;

  // Reserve a slot for one transfer (control thread). Runs an expiry sweep first.
  ReserveOutcome reserve(const ReserveRequest& request);

  // Cancel from the consumer's scheduler (abandon = false) or from the producer
  // (abandon = true; refresh = true when it re-reserves right after).
  CancelOutcome cancel(const CancelRequest& request);

  // --- receiver-chosen landing (transport progress thread)
  // Accepts a payload only for a live writer reservation whose ids and size match;
  // the record becomes LANDING, so cancels and expiry defer until complete_landing.
  // generation 0 = not checked.
  LandingResolution resolve_landing(std::string_view transfer_id, const ReservationId& reservation_id,
                                    std::uint64_t nbytes, std::uint64_t generation = 0);
  // A direct payload (sent without a reservation, docs/protocol.md "Direct payloads"):
  // reserves for it as reserve() would, and accepts the landing only when that makes it
  // the writer of a fresh slot. Anything else (a known transfer, content resident or
  // landing, no space, a refusal) turns it away without a record: its producer then
  // reserves the usual way and learns the outcome from that reply.
  DirectLandingResolution resolve_direct_landing(const ReserveRequest& request);
  // Exactly once per accepted landing. ok = the whole payload arrived. With checksums
  // on, the landed bytes must hash to `checksum` (or to the reserve's checksum).
  CompletionOutcome complete_landing(std::string_view transfer_id, const ReservationId& reservation_id, bool ok,
                                     std::optional<std::uint64_t> checksum = std::nullopt);

  // --- one-sided mode: the producer wrote (put + flush) and says so.
  // A `generation` other than the reservation's is rejected like a wrong reservation id.
  CompletionOutcome writer_completed(std::string_view transfer_id, const ReservationId& reservation_id,
                                     std::optional<std::uint64_t> checksum = std::nullopt,
                                     std::optional<std::uint64_t> generation = std::nullopt);
  // The one-sided writer stopped without completing (also what a failed endpoint
  // reports for each of its reservations). Same as cancel with abandon.
  CancelOutcome writer_abandoned(std::string_view transfer_id, const ReservationId& reservation_id);

  // --- worker
  // Hands over a READY transfer's slot; the record is gone afterwards.
  Result<SlotLease> take(std::string_view transfer_id, std::string_view mm_hash);
  // A resident copy by content (a local reload), if it has this spec.
  Result<SlotLease> take_resident(std::string_view mm_hash, const TensorSpec& spec);

  // Expires what is due: O(due + log n), never a scan of live records. Called every
  // second by the server tick and before every reserve.
  void expire();

  // Events (ready, abandoned, failed) in publication order, at most `max`.
  std::vector<ReservationEvent> drain_events(std::size_t max = SIZE_MAX);
  // mm_hashes whose resident copy was reclaimed since the last call.
  std::vector<std::string> drain_reclaimed();

  // Refuse new reservations; cancel followers and READY records; defer writers that
  // may still be written, release the others.
  void begin_shutdown();
  // Waits (real time, at most `timeout`) until no slot may still be written.
  DrainReport wait_for_writers(Duration timeout);

  ReservationCounters counters() const;
  // The state of a transfer's record (tombstones included), for diagnostics and tests.
  std::optional<ReservationState> state_of(std::string_view transfer_id) const;
  // The whole record, as the control plane's `status` reports it.
  struct RecordView {
    ReservationState state;
    std::string mm_hash;
    ReservationId reservation_id;
    std::uint64_t generation = 0;
    std::optional<TensorSpec> spec;  // absent on tombstones left before any reservation
  };
  std::optional<RecordView> describe(std::string_view transfer_id) const;
  // Checks the internal bookkeeping (pool bytes = slots held, indexes consistent);
  // an error names the first inconsistency. For tests and debug tooling.
  Status check_invariants() const;

 private:
  std::shared_ptr<detail::ReservationCore> core_;
};

}  // namespace ecx::consumer
