#pragma once
// Shared sources. A payload sent from a region in a memfd (register_shared_region)
// travels to a receiver on the same host as its place in that file, not as bytes: the
// receiver maps the file through /proc/<pid>/fd/<fd> and copies the payload into its
// landing itself. That is one memcpy at memory speed, where UCX 1.13 moves a
// rendezvous over shared memory with process_vm_readv (measured on one host: 26 GB/s
// against 17 for 9 MiB) and over tcp through the socket. The receiver still chooses
// the landing and does the only write into it.
//
// A receiver maps only what it can prove is the sender's file: the same boot of the
// same host (boot id), the file the sender named (inode and device checked after
// opening it) and sealed against shrinking (so no page can vanish under a copy). A
// receiver that cannot (another host, another pid namespace, no permission to open
// the sender's fds) says so and the sender sends that peer its payloads the usual way.
//
// Progress thread only, apart from the pure functions.

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <tuple>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"

namespace ecx::transport::ucx {

using HostIdentity = std::array<std::byte, 16>;

// This boot of this host (/proc/sys/kernel/random/boot_id); nullopt where it cannot be
// read, and then this side neither sends nor takes shared sources.
const std::optional<HostIdentity>& host_identity();

// The file behind a shared region, as the sender checked it when it was registered.
struct SharedFile {
  std::uint32_t pid = 0;
  std::int32_t fd = -1;
  std::uint64_t inode = 0;
  std::uint64_t device = 0;
  friend bool operator==(const SharedFile&, const SharedFile&) = default;
};

// Checks `fd` (a sealed memfd holding [fd_offset, fd_offset + size)) and names it.
Result<SharedFile> describe_shared_file(int fd, std::uint64_t fd_offset, std::uint64_t size);

// What a shared payload's message carries in place of its bytes.
struct SharedSourceRef {
  HostIdentity host{};
  SharedFile file;
  std::uint64_t fd_offset = 0;    // the region's first byte in the file
  std::uint64_t region_size = 0;  // the region's bytes from there
  std::uint64_t offset = 0;       // the payload within the region
  std::uint64_t length = 0;
  // CLOCK_MONOTONIC ns (one clock on one host): a copy that ends later may have read a
  // source the sender already reused (its send failed at its deadline), so it fails.
  std::uint64_t copy_by_ns = 0;
};
inline constexpr std::size_t kSharedSourceRefBytes = 16 + 4 + 4 + 8 * 7;
void encode_shared_source(const SharedSourceRef& ref, std::byte* out);
// nullopt when `bytes` is shorter than kSharedSourceRefBytes or the payload does not lie in the region.
std::optional<SharedSourceRef> decode_shared_source(std::span<const std::byte> bytes);

inline constexpr std::size_t kSharedFileBytes = 4 + 4 + 8 + 8;
void encode_shared_file(const SharedFile& file, std::byte* out);
std::optional<SharedFile> decode_shared_file(std::span<const std::byte> bytes);

// The receiver's mappings of its senders' files, kept for the next payload from the
// same region (mapping per payload would fault every page in again).
class SharedMappings {
 public:
  explicit SharedMappings(std::size_t max_mappings = 64) : max_mappings_(max_mappings) {}
  ~SharedMappings();
  SharedMappings(const SharedMappings&) = delete;
  SharedMappings& operator=(const SharedMappings&) = delete;

  // The payload's first byte, mapped read-only; an error saying why this side cannot
  // reach it (the sender then resends the usual way).
  Result<const std::byte*> source(const SharedSourceRef& ref);
  // The sender deregistered a region of `file`: its mappings go.
  void forget(const SharedFile& file);
  // Drops the mappings whose sender no longer holds the file (it exited or closed it),
  // at most once per `every`: a sender that died cannot say so itself.
  void sweep(TimePoint now, Duration every = std::chrono::seconds(1));

  std::size_t size() const noexcept { return mappings_.size(); }
  std::uint64_t mapped_bytes() const noexcept { return mapped_bytes_; }

 private:
  using Key = std::tuple<std::uint32_t, std::int32_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t>;
  struct Mapping {
    SharedFile file;
    void* base = nullptr;      // page-aligned start of the mapping
    std::uint64_t mapped = 0;  // bytes mapped
    std::uint64_t lead = 0;    // from base to the region's first byte
    std::uint64_t last_use = 0;
  };
  void unmap(std::map<Key, Mapping>::iterator it);

  std::size_t max_mappings_;
  std::map<Key, Mapping> mappings_;
  std::uint64_t uses_ = 0;
  std::uint64_t mapped_bytes_ = 0;
  std::optional<TimePoint> last_sweep_;
};

}  // namespace ecx::transport::ucx
