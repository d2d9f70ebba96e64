#pragma once
// CUDA allocation primitives behind the pool. Implemented by cuda_memory.cc when
// the build has CUDA and by cuda_memory_absent.cc otherwise, so callers compile
// identically either way and get a clear Status at run time.

#include <cstddef>
#include <cstdint>

#include "ecx/core/status.h"

namespace ecx::pool::detail {

Result<std::byte*> cuda_alloc_pinned(std::uint64_t size, int device);
void cuda_free_pinned(std::byte* data) noexcept;
Result<std::byte*> cuda_alloc_device(std::uint64_t size, int device);
void cuda_free_device(std::byte* data, int device) noexcept;
Status cuda_host_register(std::byte* data, std::uint64_t size);
void cuda_host_unregister(std::byte* data) noexcept;

}  // namespace ecx::pool::detail
