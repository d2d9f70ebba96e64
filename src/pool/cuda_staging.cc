// The CUDA staging path; compiled only when the build has CUDA.
#include "ecx/pool/cuda_staging.h"

#include <cuda_runtime_api.h>

#include <unordered_map>

#include <fmt/format.h>

#include "core/logging.h"

namespace ecx::pool {
namespace {

Status cuda_failure(std::string_view what, cudaError_t error) {
  return unavailable(fmt::format("{} failed: {} ({})", what, cudaGetErrorString(error), cudaGetErrorName(error)));
}

class CudaStagerImpl final : public CudaStager {
 public:
  CudaStagerImpl(int device, cudaStream_t stream) : device_(device), stream_(stream) {}

  ~CudaStagerImpl() override {
    cudaSetDevice(device_);
    // Copies still in flight must finish before their buffers can be reused by anyone.
    cudaStreamSynchronize(stream_);
    for (auto& [id, event] : events_) cudaEventDestroy(event);
    cudaStreamDestroy(stream_);
  }

  Result<Copy> copy_to_host(const void* device_src, void* host_dst, std::uint64_t nbytes) override {
    return enqueue(host_dst, device_src, nbytes, cudaMemcpyDeviceToHost);
  }

  Result<Copy> copy_to_device(const void* host_src, void* device_dst, std::uint64_t nbytes) override {
    return enqueue(device_dst, host_src, nbytes, cudaMemcpyHostToDevice);
  }

  Result<bool> poll(Copy copy) override {
    auto found = events_.find(copy.id);
    if (found == events_.end()) return not_found(fmt::format("no staging copy {}", copy.id));
    const cudaError_t state = cudaEventQuery(found->second);
    if (state == cudaErrorNotReady) return false;
    cudaEventDestroy(found->second);
    events_.erase(found);
    if (state != cudaSuccess) return cuda_failure("staging copy", state);
    return true;
  }

  std::uint64_t in_flight() const noexcept override { return events_.size(); }

 private:
  Result<Copy> enqueue(void* dst, const void* src, std::uint64_t nbytes, cudaMemcpyKind kind) {
    if (auto error = cudaSetDevice(device_); error != cudaSuccess) return cuda_failure("cudaSetDevice", error);
    cudaEvent_t event = nullptr;
    if (auto error = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); error != cudaSuccess) {
      return cuda_failure("cudaEventCreate", error);
    }
    if (auto error = cudaMemcpyAsync(dst, src, nbytes, kind, stream_); error != cudaSuccess) {
      cudaEventDestroy(event);
      return cuda_failure(fmt::format("cudaMemcpyAsync of {} bytes", nbytes), error);
    }
    if (auto error = cudaEventRecord(event, stream_); error != cudaSuccess) {
      cudaEventDestroy(event);
      return cuda_failure("cudaEventRecord", error);
    }
    const Copy copy{next_id_++};
    events_.emplace(copy.id, event);
    return copy;
  }

  int device_;
  cudaStream_t stream_;
  std::uint64_t next_id_ = 1;
  std::unordered_map<std::uint64_t, cudaEvent_t> events_;
};

}  // namespace

Result<std::unique_ptr<CudaStager>> CudaStager::create(int device) {
  int count = 0;
  if (auto error = cudaGetDeviceCount(&count); error != cudaSuccess) return cuda_failure("cudaGetDeviceCount", error);
  if (device < 0 || device >= count) {
    return unavailable(fmt::format("CUDA device {} does not exist ({} visible)", device, count));
  }
  if (auto error = cudaSetDevice(device); error != cudaSuccess) return cuda_failure("cudaSetDevice", error);
  cudaStream_t stream = nullptr;
  if (auto error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); error != cudaSuccess) {
    return cuda_failure("cudaStreamCreate", error);
  }
  return std::unique_ptr<CudaStager>(std::make_unique<CudaStagerImpl>(device, stream));
}

}  // namespace ecx::pool
