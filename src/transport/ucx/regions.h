#pragma once
// Registered memory: the regions sends read from and landings should lie in, each
// mapped with the worker's context (and, in put mode, with its packed rkey ready to
// hand to a writer). Progress thread only.

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <unordered_map>
#include <vector>

#include "ecx/transport/transport.h"
#include "ecx/transport/ucx_transport.h"
#include "transport/ucx/common.h"
#include "transport/ucx/shared_sources.h"
#include "transport/ucx/worker.h"

namespace ecx::transport::ucx {

struct Region {
  std::uint64_t id = 0;
  std::byte* base = nullptr;
  std::uint64_t size = 0;
  MemoryKind kind = MemoryKind::host;
  ucp_mem_h memh = nullptr;
  std::vector<std::byte> packed_rkey;  // put mode only
  std::uint64_t in_flight = 0;         // sends reading from it
  // register_shared_region: the file behind it, and the endpoints that were sent a
  // payload as a place in it (told when the region goes, so they unmap it).
  struct Shared {
    SharedFile file;
    std::uint64_t fd_offset = 0;
    std::set<std::uint64_t> endpoints;
  };
  std::optional<Shared> shared;
};

class Regions {
 public:
  Regions(UcxWorker& worker, const UcxOptions& options, IdSource& ids)
      : worker_(worker), options_(options), ids_(ids) {}

  Result<RegionHandle> add(void* base, std::uint64_t size, MemoryKind kind);
  // add() for host memory in a memfd (see shared_sources.h).
  Result<RegionHandle> add_shared(void* base, std::uint64_t size, SharedBacking backing);
  // add() under an id chosen off the progress thread (DeferredIds); a failure is kept,
  // so a send from the region can say why it has none, until remove().
  void add_deferred(std::uint64_t id, void* base, std::uint64_t size, MemoryKind kind);
  // conflict while a send from the region is still in flight.
  Status remove(RegionHandle handle);
  // Why a deferred registration under `id` failed, if it did.
  const Status* failed_registration(std::uint64_t id) const;

  Region* find(std::uint64_t id);
  // The registered region holding [pointer, pointer + length), if any.
  Region* holding(const std::byte* pointer, std::uint64_t length);

  // Before the context goes.
  void unmap_all();

 private:
  Result<RegionHandle> map(std::uint64_t id, void* base, std::uint64_t size, MemoryKind kind);

  UcxWorker& worker_;
  const UcxOptions& options_;
  IdSource& ids_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Region>> regions_;
  std::map<std::uintptr_t, std::uint64_t> regions_by_base_;
  std::unordered_map<std::uint64_t, Status> failed_;  // deferred registrations that failed, until removed
};

// Ids for deferred registrations, taken on the caller's thread: a range of their own,
// apart from the progress thread's IdSource.
class DeferredIds {
 public:
  std::uint64_t next() noexcept { return kFirst + next_.fetch_add(1, std::memory_order_relaxed); }

 private:
  static constexpr std::uint64_t kFirst = std::uint64_t{1} << 62;
  std::atomic<std::uint64_t> next_{0};
};

}  // namespace ecx::transport::ucx
