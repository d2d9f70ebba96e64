#pragma once
// Device -> pinned host staging, so a UCX built without CUDA support (Debian's) can
// still move GPU tensors: the copy runs on a dedicated stream and is tracked by an
// event, and the transport only ever sees host memory. Compiled in every build; in
// a build without CUDA, or on a machine without a device, create() returns a clear
// `unavailable` Status.
//
// Thread-safety: one CudaStager per thread (it owns one stream); copies it issued
// may be polled only through it.

#include <cstdint>
#include <memory>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"

namespace ecx::pool {

class CudaStager {
 public:
  // A copy in flight; waiting on it or polling it until done releases its event.
  struct Copy {
    std::uint64_t id = 0;
  };

  static Result<std::unique_ptr<CudaStager>> create(int device);
  virtual ~CudaStager() = default;

  // Enqueues `nbytes` from device memory `device_src` into pinned host memory
  // `host_dst` and records an event behind it.
  virtual Result<Copy> copy_to_host(const void* device_src, void* host_dst, std::uint64_t nbytes) = 0;
  // Enqueues the reverse direction (host -> device), e.g. to load a landed slot.
  virtual Result<Copy> copy_to_device(const void* host_src, void* device_dst, std::uint64_t nbytes) = 0;
  // ok(true) once the copy has landed (its event is then released), ok(false) while
  // it runs, an error when the copy failed or `copy` is unknown.
  virtual Result<bool> poll(Copy copy) = 0;
  // Polls until the copy landed or `deadline` (read from `clock`) passed (timeout).
  Status wait(Copy copy, TimePoint deadline, const Clock& clock);
  virtual std::uint64_t in_flight() const noexcept = 0;
};

}  // namespace ecx::pool
