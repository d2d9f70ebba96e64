#include "transport/ucx/regions.h"

#include <iterator>

#include <fmt/format.h>

namespace ecx::transport::ucx {

Result<RegionHandle> Regions::add(void* base, std::uint64_t size, MemoryKind kind) {
  return map(ids_.next(), base, size, kind);
}

Result<RegionHandle> Regions::add_shared(void* base, std::uint64_t size, SharedBacking backing) {
  auto file = describe_shared_file(backing.fd, backing.fd_offset, size);
  if (!file) return file.status();
  auto handle = map(ids_.next(), base, size, MemoryKind::host);
  if (handle) find(handle->id)->shared = Region::Shared{*file, backing.fd_offset, {}};
  return handle;
}

void Regions::add_deferred(std::uint64_t id, void* base, std::uint64_t size, MemoryKind kind) {
  if (auto added = map(id, base, size, kind); !added) failed_.emplace(id, added.status());
}

const Status* Regions::failed_registration(std::uint64_t id) const {
  auto found = failed_.find(id);
  return found == failed_.end() ? nullptr : &found->second;
}

Result<RegionHandle> Regions::map(std::uint64_t id, void* base, std::uint64_t size, MemoryKind kind) {
  ucp_context_h context = worker_.context();
  auto region = std::make_unique<Region>();
  region->id = id;
  region->base = static_cast<std::byte*>(base);
  region->size = size;
  region->kind = kind;
  ucp_mem_map_params_t params{};
  params.field_mask =
      UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = base;
  params.length = size;
  params.memory_type = kind == MemoryKind::cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  if (kind == MemoryKind::cuda) {
    ucp_context_attr_t attr{};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(context, &attr) != UCS_OK || (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) == 0) {
      return unavailable(
          "this UCX library has no CUDA memory support; stage device tensors through pinned host memory");
    }
  }
  if (auto st = ucp_mem_map(context, &params, &region->memh); st != UCS_OK) {
    return ucx_error(fmt::format("ucp_mem_map of {} bytes", size), st);
  }
  if (options_.mode == UcxMode::put) {
    void* packed = nullptr;
    std::size_t packed_size = 0;
    if (auto st = ucp_rkey_pack(context, region->memh, &packed, &packed_size); st != UCS_OK) {
      ucp_mem_unmap(context, region->memh);
      return ucx_error("ucp_rkey_pack", st);
    }
    const auto* bytes = static_cast<const std::byte*>(packed);
    region->packed_rkey.assign(bytes, bytes + packed_size);
    ucp_rkey_buffer_release(packed);
  }
  const RegionHandle handle{region->id};
  regions_by_base_.emplace(reinterpret_cast<std::uintptr_t>(base), region->id);
  regions_.emplace(region->id, std::move(region));
  return handle;
}

Status Regions::remove(RegionHandle handle) {
  if (failed_.erase(handle.id) != 0) return Status::ok();  // never mapped
  auto found = regions_.find(handle.id);
  if (found == regions_.end()) return not_found(fmt::format("no registered region {}", handle.id));
  if (found->second->in_flight != 0) {
    return conflict(fmt::format("region {} still has {} sends in flight", handle.id, found->second->in_flight));
  }
  ucp_mem_unmap(worker_.context(), found->second->memh);
  regions_by_base_.erase(reinterpret_cast<std::uintptr_t>(found->second->base));
  regions_.erase(found);
  return Status::ok();
}

Region* Regions::find(std::uint64_t id) {
  auto found = regions_.find(id);
  return found == regions_.end() ? nullptr : found->second.get();
}

Region* Regions::holding(const std::byte* pointer, std::uint64_t length) {
  auto after = regions_by_base_.upper_bound(reinterpret_cast<std::uintptr_t>(pointer));
  if (after == regions_by_base_.begin()) return nullptr;
  Region* region = regions_.at(std::prev(after)->second).get();
  const auto end = reinterpret_cast<std::uintptr_t>(region->base) + region->size;
  return reinterpret_cast<std::uintptr_t>(pointer) + length <= end ? region : nullptr;
}

void Regions::unmap_all() {
  for (auto& [id, region] : regions_) ucp_mem_unmap(worker_.context(), region->memh);
  regions_.clear();
  regions_by_base_.clear();
}

}  // namespace ecx::transport::ucx
