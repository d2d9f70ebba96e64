#include "staging_area.h"

#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <xxhash.h>

#include "core/logging.h"
#include "ecx/core/stages.h"

namespace ecx::producer {

Result<std::unique_ptr<StagingArea>> StagingArea::create(const Config& config, std::shared_ptr<const Clock> clock,
                                                         bool shared) {
  pool::SlabOptions slab_options;
  slab_options.huge_pages = config.huge_pages;
  slab_options.lock = config.mlock;
  slab_options.prefault = config.prefault;
  const auto kind = config.buffer_device == "cpu" ? pool::MemoryKind::host : pool::MemoryKind::cuda_pinned;
  // Where a same-host consumer may copy payloads out of it (see ucx_shared_sources).
  slab_options.shared = shared && kind == pool::MemoryKind::host;
  auto slab = pool::Slab::allocate(kind, config.buffer_size, slab_options);
  if (!slab) return Status(slab.status().code(), "staging pool: " + slab.status().message());
  return std::unique_ptr<StagingArea>(  // NOLINT: private constructor
      new StagingArea(config, std::move(clock), std::move(*slab), kind));
}

StagingArea::StagingArea(const Config& config, std::shared_ptr<const Clock> clock, pool::Slab slab,
                         pool::MemoryKind kind)
    : config_(config),
      clock_(std::move(clock)),
      slab_(std::move(slab)),
      kind_(kind),
      allocator_(slab_.size(), config.pool_alignment) {}

Result<SourceId> StagingArea::stage(const void* data, std::uint64_t nbytes, SourceMemory memory) {
  pool::Slot slot;
  {
    std::lock_guard lock(mutex_);
    auto allocated = allocator_.allocate(nbytes);
    if (!allocated) {
      return Status(allocated.status().code(),
                    fmt::format("staging pool ({} in use of {}): {}", format_bytes(allocator_.used_bytes()),
                                format_bytes(slab_.size()), allocated.status().message()));
    }
    slot = *allocated;
  }
  std::byte* destination = slab_.at(slot);
  const TimePoint copy_started = clock_->now();
  if (memory == SourceMemory::host) {
    std::memcpy(destination, data, nbytes);
  } else if (Status copied = copy_from_device(data, destination, nbytes); !copied) {
    std::lock_guard lock(mutex_);
    (void)allocator_.free(slot);
    return copied;
  }
  std::optional<std::uint64_t> checksum;
  if (config_.checksum) checksum = XXH64(destination, nbytes, 0);
  stages::record(stages::Stage::staging_copy, clock_->now() - copy_started);
  const SourceId id = slot.offset + 1;
  std::lock_guard lock(mutex_);
  sources_[id] = Source{slot, nbytes, checksum};
  return id;
}

SourceId StagingArea::lend(const void* data, std::uint64_t nbytes, transport::RegionHandle region,
                           std::function<void()> on_release) {
  const auto* bytes = static_cast<const std::byte*>(data);
  std::optional<std::uint64_t> checksum;
  if (config_.checksum) checksum = XXH64(bytes, nbytes, 0);
  std::lock_guard lock(mutex_);
  const SourceId id = kLentBit | ++lent_ids_;
  sources_[id] = Source{pool::Slot{}, nbytes, checksum, bytes, region};
  lent_releases_[id] = std::move(on_release);
  return id;
}

std::optional<std::uint64_t> StagingArea::checksum(SourceId id) {
  Source source;
  {
    std::lock_guard lock(mutex_);
    auto it = sources_.find(id);
    if (it == sources_.end()) return std::nullopt;
    if (it->second.checksum) return it->second.checksum;
    source = it->second;
  }
  const std::uint64_t value = XXH64(source.lent ? source.lent : slab_.at(source.slot), source.nbytes, 0);
  std::lock_guard lock(mutex_);
  if (auto it = sources_.find(id); it != sources_.end()) it->second.checksum = value;
  return value;
}

Status StagingArea::copy_from_device(const void* data, std::byte* destination, std::uint64_t nbytes) {
  std::lock_guard lock(mutex_);  // one stager, one stream: device copies go one at a time
  if (!stager_) {
    const int device = config_.buffer_device.size() > 5 ? std::stoi(config_.buffer_device.substr(5)) : 0;
    auto stager = pool::CudaStager::create(device);
    if (!stager) return stager.status();
    stager_ = std::move(*stager);
  }
  auto copy = stager_->copy_to_host(data, destination, nbytes);
  if (!copy) return copy.status();
  return stager_->wait(*copy, clock_->now() + config_.push_wait_timeout(), *clock_);
}

std::optional<StagingArea::Source> StagingArea::find(SourceId id) const {
  std::lock_guard lock(mutex_);
  auto it = sources_.find(id);
  if (it == sources_.end()) return std::nullopt;
  return it->second;
}

std::optional<StagingArea::LentRelease> StagingArea::release(SourceId id) {
  std::lock_guard lock(mutex_);
  auto it = sources_.find(id);
  if (it == sources_.end()) return std::nullopt;
  std::optional<LentRelease> lent;
  if (it->second.lent) {
    lent = take_lent(id, it->second);
  } else {
    (void)allocator_.free(it->second.slot);
  }
  sources_.erase(it);
  return lent;
}

StagingArea::LentRelease StagingArea::take_lent(SourceId id, const Source& source) {
  auto callback = lent_releases_.extract(id);
  return LentRelease{source.lent_region, callback.empty() ? nullptr : std::move(callback.mapped())};
}

std::vector<StagingArea::LentRelease> StagingArea::release_all_lent() {
  std::vector<LentRelease> out;
  std::lock_guard lock(mutex_);
  for (auto it = sources_.begin(); it != sources_.end();) {
    if (!it->second.lent) {
      ++it;
      continue;
    }
    out.push_back(take_lent(it->first, it->second));
    it = sources_.erase(it);
  }
  return out;
}

std::uint64_t StagingArea::used_bytes() const {
  std::lock_guard lock(mutex_);
  return allocator_.used_bytes();
}

}  // namespace ecx::producer
