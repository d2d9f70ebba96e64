#include "ecx/pool/slab.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <unistd.h>

#include "core/logging.h"
#include "pool/cuda_memory.h"

namespace ecx::pool {
namespace {

constexpr std::uint64_t kHugePageBytes = 2ULL << 20;

std::uint64_t round_up(std::uint64_t value, std::uint64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace

std::string_view memory_kind_name(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::host:
      return "host";
    case MemoryKind::cuda_pinned:
      return "cuda_pinned";
    case MemoryKind::cuda_device:
      return "cuda_device";
  }
  return "unknown";
}

Result<Slab> Slab::allocate(MemoryKind kind, std::uint64_t size, const SlabOptions& options) {
  if (size == 0) return invalid_argument("a slab needs at least one byte");
  Slab slab;
  slab.kind_ = kind;
  slab.size_ = size;
  if (kind == MemoryKind::cuda_pinned) {
    auto data = detail::cuda_alloc_pinned(size, options.cuda_device);
    if (!data) return data.status();
    slab.data_ = *data;
    return slab;
  }
  if (kind == MemoryKind::cuda_device) {
    auto data = detail::cuda_alloc_device(size, options.cuda_device);
    if (!data) return data.status();
    slab.data_ = *data;
    slab.cuda_device_ = options.cuda_device;
    return slab;
  }

  // Mapping a multiple of the huge page size lets the kernel back the whole slab with
  // huge pages; the tail beyond `size` is never handed out.
  slab.mapped_size_ = options.huge_pages ? round_up(size, kHugePageBytes)
                                         : round_up(size, static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE)));
  if (options.shared) {
    slab.shared_fd_ = ::memfd_create("ecx-slab", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (slab.shared_fd_ < 0) {
      return resource_exhausted(fmt::format("memfd_create for a shared slab failed: {}", errno_text(errno)));
    }
    if (::ftruncate(slab.shared_fd_, static_cast<off_t>(slab.mapped_size_)) != 0) {
      return resource_exhausted(
          fmt::format("sizing a shared slab of {} bytes failed: {}", slab.mapped_size_, errno_text(errno)));
    }
    // Sealed against shrinking: a peer that maps it can then never fault on a page
    // cut off under its copy (SIGBUS); peers refuse a memfd without the seal.
    if (::fcntl(slab.shared_fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
      return resource_exhausted(fmt::format("sealing a shared slab failed: {}", errno_text(errno)));
    }
  }
  void* mapped = options.shared
                     ? ::mmap(nullptr, slab.mapped_size_, PROT_READ | PROT_WRITE, MAP_SHARED, slab.shared_fd_, 0)
                     : ::mmap(nullptr, slab.mapped_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) {
    const int err = errno;
    slab.mapped_size_ = 0;
    return resource_exhausted(fmt::format("mmap of {} bytes failed: {}", size, errno_text(err)));
  }
  slab.data_ = static_cast<std::byte*>(mapped);
  if (options.huge_pages) {
    slab.huge_pages_ = ::madvise(mapped, slab.mapped_size_, MADV_HUGEPAGE) == 0;
    if (!slab.huge_pages_) log::get("pool")->debug("slab: transparent huge pages refused: {}", errno_text(errno));
  }
  if (options.lock) {
    if (::mlock(mapped, slab.mapped_size_) != 0) {
      const int err = errno;
      return resource_exhausted(fmt::format("mlock of {} bytes failed: {} (raise RLIMIT_MEMLOCK or set mlock=false)",
                                            slab.mapped_size_, errno_text(err)));
    }
    slab.locked_ = true;
  }
  if (options.prefault) {
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    for (std::uint64_t offset = 0; offset < slab.mapped_size_; offset += page) slab.data_[offset] = std::byte{0};
  }
  if (options.register_with_cuda) {
    ECX_RETURN_IF_ERROR(detail::cuda_host_register(slab.data_, slab.mapped_size_));
    slab.cuda_registered_ = true;
  }
  return slab;
}

Slab::Slab(Slab&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_size_(std::exchange(other.mapped_size_, 0)),
      kind_(other.kind_),
      huge_pages_(other.huge_pages_),
      locked_(other.locked_),
      cuda_registered_(std::exchange(other.cuda_registered_, false)),
      cuda_device_(other.cuda_device_),
      shared_fd_(std::exchange(other.shared_fd_, -1)) {}

Slab& Slab::operator=(Slab&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_size_ = std::exchange(other.mapped_size_, 0);
    kind_ = other.kind_;
    huge_pages_ = other.huge_pages_;
    locked_ = other.locked_;
    cuda_registered_ = std::exchange(other.cuda_registered_, false);
    cuda_device_ = other.cuda_device_;
    shared_fd_ = std::exchange(other.shared_fd_, -1);
  }
  return *this;
}

Slab::~Slab() { release(); }

void Slab::release() noexcept {
  if (shared_fd_ >= 0) ::close(std::exchange(shared_fd_, -1));
  if (data_ == nullptr) return;
  switch (kind_) {
    case MemoryKind::host:
      if (cuda_registered_) detail::cuda_host_unregister(data_);
      ::munmap(data_, mapped_size_);  // also drops an mlock
      break;
    case MemoryKind::cuda_pinned:
      detail::cuda_free_pinned(data_);
      break;
    case MemoryKind::cuda_device:
      detail::cuda_free_device(data_, cuda_device_);
      break;
  }
  data_ = nullptr;
}

}  // namespace ecx::pool
