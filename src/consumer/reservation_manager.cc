// ReservationManager's public surface: its options from the config, SlotLease, and the
// facade that forwards to the reservation machine (reservation_core.h).

#include "ecx/consumer/reservation_manager.h"

#include <memory>
#include <utility>

#include "consumer/reservation_core.h"

namespace ecx::consumer {

ReservationOptions ReservationOptions::from_config(const Config& config, std::byte* slab_base,
                                                   std::uint64_t slab_size) {
  ReservationOptions o;
  o.slab_base = slab_base;
  o.slab_size = slab_size;
  o.alignment = config.pool_alignment;
  o.ttl = config.reservation_ttl();
  o.tombstone_max = config.tombstone_max;
  o.event_queue_max = config.event_queue_max;
  o.retry_after = std::chrono::milliseconds(config.retry_after_ms);
  o.checksum = config.checksum;
  o.max_tensor_bytes = config.max_tensor_bytes;
  o.resident_capacity_bytes = config.resident_capacity_bytes;
  o.starvation_after = config.push_wait_timeout() / 4;
  o.reserve_hold = std::chrono::milliseconds(config.reserve_hold_ms);
  return o;
}

// ---------------------------------------------------------------- SlotLease

SlotLease::SlotLease(std::shared_ptr<detail::ReservationCore> core, std::uint64_t entry_id, std::byte* data,
                     std::uint64_t offset, TensorSpec spec, std::string mm_hash)
    : core_(std::move(core)),
      entry_id_(entry_id),
      data_(data),
      offset_(offset),
      spec_(spec),
      mm_hash_(std::move(mm_hash)) {}

SlotLease::SlotLease(SlotLease&& other) noexcept
    : core_(std::move(other.core_)),
      entry_id_(other.entry_id_),
      data_(other.data_),
      offset_(other.offset_),
      spec_(other.spec_),
      mm_hash_(std::move(other.mm_hash_)) {
  other.core_.reset();
  other.data_ = nullptr;
}

SlotLease& SlotLease::operator=(SlotLease&& other) noexcept {
  if (this != &other) {
    release();
    core_ = std::move(other.core_);
    entry_id_ = other.entry_id_;
    data_ = other.data_;
    offset_ = other.offset_;
    spec_ = other.spec_;
    mm_hash_ = std::move(other.mm_hash_);
    other.core_.reset();
    other.data_ = nullptr;
  }
  return *this;
}

SlotLease::~SlotLease() { release(); }

void SlotLease::release() noexcept {
  if (!core_) return;
  core_->release_lease(entry_id_);
  core_.reset();
  data_ = nullptr;
}

// ---------------------------------------------------------------- ReservationManager

ReservationManager::ReservationManager(const ReservationOptions& options, std::shared_ptr<const Clock> clock)
    : core_(std::make_shared<detail::ReservationCore>(options, std::move(clock))) {}

ReservationManager::~ReservationManager() = default;

ReserveOutcome ReservationManager::reserve(const ReserveRequest& request) { return core_->reserve(request); }
CancelOutcome ReservationManager::cancel(const CancelRequest& request) { return core_->cancel(request); }

LandingResolution ReservationManager::resolve_landing(std::string_view transfer_id, const ReservationId& reservation_id,
                                                      std::uint64_t nbytes, std::uint64_t generation) {
  return core_->resolve_landing(transfer_id, reservation_id, nbytes, generation);
}

DirectLandingResolution ReservationManager::resolve_direct_landing(const ReserveRequest& request) {
  return core_->resolve_direct_landing(request);
}

CompletionOutcome ReservationManager::complete_landing(std::string_view transfer_id,
                                                       const ReservationId& reservation_id, bool ok,
                                                       std::optional<std::uint64_t> checksum) {
  return core_->complete_write(transfer_id, reservation_id, ok, checksum, false);
}

CompletionOutcome ReservationManager::writer_completed(std::string_view transfer_id,
                                                       const ReservationId& reservation_id,
                                                       std::optional<std::uint64_t> checksum,
                                                       std::optional<std::uint64_t> generation) {
  return core_->complete_write(transfer_id, reservation_id, true, checksum, true, generation);
}

CancelOutcome ReservationManager::writer_abandoned(std::string_view transfer_id, const ReservationId& reservation_id) {
  return core_->cancel(CancelRequest{std::string(transfer_id), reservation_id, true, false});
}

Result<SlotLease> ReservationManager::take(std::string_view transfer_id, std::string_view mm_hash) {
  return core_->take(transfer_id, mm_hash);
}

Result<SlotLease> ReservationManager::take_resident(std::string_view mm_hash, const TensorSpec& spec) {
  return core_->take_resident(mm_hash, spec);
}

void ReservationManager::expire() { core_->expire(); }
std::vector<ReservationEvent> ReservationManager::drain_events(std::size_t max) { return core_->drain_events(max); }
std::vector<std::string> ReservationManager::drain_reclaimed() { return core_->drain_reclaimed(); }
void ReservationManager::begin_shutdown() { core_->begin_shutdown(); }
DrainReport ReservationManager::wait_for_writers(Duration timeout) { return core_->wait_for_writers(timeout); }
ReservationCounters ReservationManager::counters() const { return core_->counters(); }
std::optional<ReservationState> ReservationManager::state_of(std::string_view transfer_id) const {
  return core_->state_of(transfer_id);
}
std::optional<ReservationManager::RecordView> ReservationManager::describe(std::string_view transfer_id) const {
  return core_->describe(transfer_id);
}
Status ReservationManager::check_invariants() const { return core_->check_invariants(); }

}  // namespace ecx::consumer
