// Built when CMake found no CUDA toolkit (or ECX_CUDA=OFF): every CUDA path answers
// with a clear `unavailable` Status instead of being missing at link time.
#include "ecx/pool/cuda_staging.h"
#include "ecx/pool/slab.h"
#include "pool/cuda_memory.h"

namespace ecx::pool {
namespace {
Status no_cuda() { return unavailable("this ECX build has no CUDA support (configured without a CUDA toolkit)"); }
}  // namespace

bool built_with_cuda() noexcept { return false; }

Result<std::unique_ptr<CudaStager>> CudaStager::create(int /*device*/) { return no_cuda(); }

namespace detail {
Result<std::byte*> cuda_alloc_pinned(std::uint64_t /*size*/, int /*device*/) { return no_cuda(); }
void cuda_free_pinned(std::byte* /*data*/) noexcept {}
Result<std::byte*> cuda_alloc_device(std::uint64_t /*size*/, int /*device*/) { return no_cuda(); }
void cuda_free_device(std::byte* /*data*/, int /*device*/) noexcept {}
Status cuda_host_register(std::byte* /*data*/, std::uint64_t /*size*/) { return no_cuda(); }
void cuda_host_unregister(std::byte* /*data*/) noexcept {}
}  // namespace detail

}  // namespace ecx::pool
