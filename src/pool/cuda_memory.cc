// CUDA allocations for the pool; compiled only when the build has CUDA. Plain C++
// against the runtime API (no device code), so the host compiler builds it.
#include "pool/cuda_memory.h"

#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "core/logging.h"
#include "ecx/pool/slab.h"

namespace ecx::pool {

bool built_with_cuda() noexcept { return true; }

namespace detail {
namespace {

Status cuda_failure(std::string_view what, cudaError_t error) {
  // cudaErrorNoDevice / cudaErrorInsufficientDriver are what a GPU-less host reports.
  return unavailable(fmt::format("{} failed: {} ({})", what, cudaGetErrorString(error), cudaGetErrorName(error)));
}

}  // namespace

Result<std::byte*> cuda_alloc_pinned(std::uint64_t size, int device) {
  if (auto error = cudaSetDevice(device); error != cudaSuccess) return cuda_failure("cudaSetDevice", error);
  void* data = nullptr;
  if (auto error = cudaHostAlloc(&data, size, cudaHostAllocPortable); error != cudaSuccess) {
    return cuda_failure(fmt::format("cudaHostAlloc of {} bytes", size), error);
  }
  return static_cast<std::byte*>(data);
}

void cuda_free_pinned(std::byte* data) noexcept {
  if (auto error = cudaFreeHost(data); error != cudaSuccess) {
    log::get("pool")->error("cudaFreeHost failed: {}", cudaGetErrorString(error));
  }
}

Result<std::byte*> cuda_alloc_device(std::uint64_t size, int device) {
  if (auto error = cudaSetDevice(device); error != cudaSuccess) return cuda_failure("cudaSetDevice", error);
  void* data = nullptr;
  if (auto error = cudaMalloc(&data, size); error != cudaSuccess) {
    return cuda_failure(fmt::format("cudaMalloc of {} bytes", size), error);
  }
  return static_cast<std::byte*>(data);
}

void cuda_free_device(std::byte* data, int device) noexcept {
  cudaSetDevice(device);
  if (auto error = cudaFree(data); error != cudaSuccess) {
    log::get("pool")->error("cudaFree failed: {}", cudaGetErrorString(error));
  }
}

Status cuda_host_register(std::byte* data, std::uint64_t size) {
  if (auto error = cudaHostRegister(data, size, cudaHostRegisterPortable); error != cudaSuccess) {
    return cuda_failure(fmt::format("cudaHostRegister of {} bytes", size), error);
  }
  return Status::ok();
}

void cuda_host_unregister(std::byte* data) noexcept {
  if (auto error = cudaHostUnregister(data); error != cudaSuccess) {
    log::get("pool")->error("cudaHostUnregister failed: {}", cudaGetErrorString(error));
  }
}

}  // namespace detail
}  // namespace ecx::pool
