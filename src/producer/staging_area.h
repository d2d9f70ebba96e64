#pragma once
// The producer's staging pool: encoder outputs are copied here (from host or device
// memory) and stay until every push that sends them has finished. One mutex guards
// the allocator and the source table: bind_source runs on the engine's thread,
// lookups and releases on the dispatcher. A source is hashed (xxHash64) while it is
// staged when this producer's `checksum` is on, else the first time a consumer shard
// that verifies checksums needs it: hashing 9 MiB costs about a millisecond of CPU
// that nobody uses where no consumer verifies.

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/status.h"
#include "ecx/pool/cuda_staging.h"
#include "ecx/pool/offset_allocator.h"
#include "ecx/pool/slab.h"
#include "ecx/producer/push_engine.h"
#include "ecx/producer/push_manager.h"
#include "ecx/transport/transport.h"

namespace ecx::producer {

class StagingArea {
 public:
  struct Source {
    pool::Slot slot;  // in the staging pool, unless lent
    std::uint64_t nbytes = 0;
    std::optional<std::uint64_t> checksum;  // xxHash64, once computed
    // A lent source (PushEngine::lend_source): the engine's own memory, registered
    // with the data plane on its own, sent from in place.
    const std::byte* lent = nullptr;
    transport::RegionHandle lent_region{};
  };
  // What giving back a lent source takes, done by the caller outside the lock:
  // deregister the region, then tell the engine its memory is free.
  struct LentRelease {
    transport::RegionHandle region;
    std::function<void()> on_release;
    void give_back() {
      if (on_release) on_release();
    }
  };

  // `shared`: host staging in a memfd, for a data plane whose same-host receivers copy
  // payloads out themselves (Capabilities::shared_sources).
  static Result<std::unique_ptr<StagingArea>> create(const Config& config, std::shared_ptr<const Clock> clock,
                                                     bool shared = false);

  // Copies `nbytes` from `data` into a fresh slot (and hashes it when `checksum` is
  // on). resource_exhausted when the pool has no room (the message says how full it is).
  Result<SourceId> stage(const void* data, std::uint64_t nbytes, SourceMemory memory);
  // Records the engine's own memory as a source, already registered as `region`
  // (hashed now when `checksum` is on); `on_release` runs once it is given back.
  SourceId lend(const void* data, std::uint64_t nbytes, transport::RegionHandle region,
                std::function<void()> on_release);
  std::optional<Source> find(SourceId id) const;
  // The region and offset a send of this source names.
  std::pair<transport::RegionHandle, std::uint64_t> location(const Source& source,
                                                             transport::RegionHandle staging_region) const {
    return source.lent ? std::pair{source.lent_region, std::uint64_t{0}}
                       : std::pair{staging_region, source.slot.offset};
  }
  // The source's xxHash64, computed now if it was not while staging; nullopt for an
  // unknown source. Called by the dispatcher, the only thread that releases sources,
  // so the bytes stay put while they are hashed (outside the lock).
  std::optional<std::uint64_t> checksum(SourceId id);
  // A staged source's slot is freed here; a lent one's release is returned.
  std::optional<LentRelease> release(SourceId id);
  // Every lent source still held (shutdown: the data plane is gone, nothing reads them).
  std::vector<LentRelease> release_all_lent();

  std::byte* base() noexcept { return slab_.data(); }
  std::uint64_t capacity() const noexcept { return slab_.size(); }
  // The memfd behind the pool when it is shared (ucx_shared_sources), else -1.
  int shared_fd() const noexcept { return slab_.shared_fd(); }
  std::uint64_t used_bytes() const;
  pool::MemoryKind memory_kind() const noexcept { return kind_; }

 private:
  StagingArea(const Config& config, std::shared_ptr<const Clock> clock, pool::Slab slab, pool::MemoryKind kind);
  Status copy_from_device(const void* data, std::byte* destination, std::uint64_t nbytes);
  // Under mutex_: the lent source's release, its callback taken out of the table.
  LentRelease take_lent(SourceId id, const Source& source);

  static constexpr SourceId kLentBit = SourceId{1} << 63;

  const Config config_;
  std::shared_ptr<const Clock> clock_;
  pool::Slab slab_;
  pool::MemoryKind kind_;
  mutable std::mutex mutex_;
  pool::OffsetAllocator allocator_;
  std::unordered_map<SourceId, Source> sources_;
  std::unordered_map<SourceId, std::function<void()>> lent_releases_;
  SourceId lent_ids_ = 0;                     // lent sources are numbered apart from staged ones (slot offset + 1)
  std::unique_ptr<pool::CudaStager> stager_;  // created on the first device copy
};

}  // namespace ecx::producer
