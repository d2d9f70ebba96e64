#pragma once
// One contiguous slab of memory per side (the consumer's receive pool, the
// producer's staging pool), allocated once and registered once with the transport.
// Slots are carved out of it by an OffsetAllocator.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ecx/core/status.h"
#include "ecx/pool/offset_allocator.h"

namespace ecx::pool {

enum class MemoryKind : std::uint8_t {
  host,         // anonymous mmap (transparent huge pages when offered)
  cuda_pinned,  // page-locked host memory from cudaHostAlloc (needs a CUDA build and device)
  cuda_device,  // device memory from cudaMalloc (needs a CUDA build and device)
};
std::string_view memory_kind_name(MemoryKind kind) noexcept;

// True when this build compiled the CUDA paths (a device may still be missing at run time).
bool built_with_cuda() noexcept;

struct SlabOptions {
  bool huge_pages = true;           // host: madvise(MADV_HUGEPAGE); silently skipped when refused
  bool lock = false;                // host: mlock the slab (fails when RLIMIT_MEMLOCK is too low)
  bool prefault = false;            // host: touch every page now instead of on first use
  bool register_with_cuda = false;  // host: cudaHostRegister so CUDA copies run at full speed
  // host: backed by a memfd instead of anonymous memory, so a receiver on the same host
  // can map it and copy a payload out itself (the transport's shared sources).
  bool shared = false;
  int cuda_device = 0;  // cuda_*: the device to allocate on
};

// Move-only owner of the memory; frees it in the destructor.
class Slab {
 public:
  static Result<Slab> allocate(MemoryKind kind, std::uint64_t size, const SlabOptions& options = {});

  Slab(Slab&& other) noexcept;
  Slab& operator=(Slab&& other) noexcept;
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;
  ~Slab();

  std::byte* data() const noexcept { return data_; }
  std::uint64_t size() const noexcept { return size_; }
  MemoryKind kind() const noexcept { return kind_; }
  bool huge_pages() const noexcept { return huge_pages_; }
  bool locked() const noexcept { return locked_; }
  bool cuda_registered() const noexcept { return cuda_registered_; }
  // The memfd behind a shared slab (it starts at the fd's offset 0); -1 otherwise.
  int shared_fd() const noexcept { return shared_fd_; }
  // Host-addressable kinds may be read and written by the CPU.
  bool host_accessible() const noexcept { return kind_ != MemoryKind::cuda_device; }

  // The first byte of a slot carved from this slab (the caller's allocator checks bounds).
  std::byte* at(const Slot& slot) const noexcept { return data_ + slot.offset; }

 private:
  Slab() = default;
  void release() noexcept;

  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;         // usable bytes (what was asked for)
  std::uint64_t mapped_size_ = 0;  // host: bytes mapped (rounded up to the huge page size)
  MemoryKind kind_ = MemoryKind::host;
  bool huge_pages_ = false;
  bool locked_ = false;
  bool cuda_registered_ = false;
  int cuda_device_ = 0;
  int shared_fd_ = -1;  // owned
};

}  // namespace ecx::pool
