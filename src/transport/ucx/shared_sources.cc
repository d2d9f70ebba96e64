#include "transport/ucx/shared_sources.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "core/byte_order.h"

namespace ecx::transport::ucx {
namespace {

using byte_order::get_le;
using byte_order::put_le;

std::optional<HostIdentity> read_host_identity() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string text;
  if (!(in >> text)) return std::nullopt;
  HostIdentity id{};
  std::size_t filled = 0;
  int high = -1;
  for (const char c : text) {
    if (c == '-') continue;
    int nibble = -1;
    if (c >= '0' && c <= '9') nibble = c - '0';
    if (c >= 'a' && c <= 'f') nibble = c - 'a' + 10;
    if (nibble < 0 || filled == id.size()) return std::nullopt;
    if (high < 0) {
      high = nibble;
    } else {
      id[filled++] = static_cast<std::byte>((high << 4) | nibble);
      high = -1;
    }
  }
  if (filled != id.size()) return std::nullopt;
  return id;
}

std::uint64_t page_size() { return static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE)); }

std::string fd_path(const SharedFile& file) { return fmt::format("/proc/{}/fd/{}", file.pid, file.fd); }

// Whether `file`'s process still holds the file under that fd.
bool still_held(const SharedFile& file) {
  struct stat st {};
  return ::stat(fd_path(file).c_str(), &st) == 0 && st.st_ino == file.inode && st.st_dev == file.device;
}

}  // namespace

const std::optional<HostIdentity>& host_identity() {
  static const std::optional<HostIdentity> identity = read_host_identity();
  return identity;
}

Result<SharedFile> describe_shared_file(int fd, std::uint64_t fd_offset, std::uint64_t size) {
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) return invalid_argument(fmt::format("shared region: fd {} is not open", fd));
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return invalid_argument(fmt::format("shared region: fd {} is not a memfd sealed against shrinking", fd));
  }
  if (fd_offset > static_cast<std::uint64_t>(st.st_size) || size > static_cast<std::uint64_t>(st.st_size) - fd_offset) {
    return invalid_argument(fmt::format("shared region of {} bytes at offset {} overruns its file of {} bytes", size,
                                        fd_offset, st.st_size));
  }
  return SharedFile{static_cast<std::uint32_t>(::getpid()), fd, static_cast<std::uint64_t>(st.st_ino),
                    static_cast<std::uint64_t>(st.st_dev)};
}

void encode_shared_file(const SharedFile& file, std::byte* out) {
  put_le(out, file.pid);
  put_le(out + 4, static_cast<std::uint32_t>(file.fd));
  put_le(out + 8, file.inode);
  put_le(out + 16, file.device);
}

std::optional<SharedFile> decode_shared_file(std::span<const std::byte> bytes) {
  if (bytes.size() < kSharedFileBytes) return std::nullopt;
  SharedFile file;
  file.pid = get_le<std::uint32_t>(bytes.data());
  file.fd = static_cast<std::int32_t>(get_le<std::uint32_t>(bytes.data() + 4));
  file.inode = get_le<std::uint64_t>(bytes.data() + 8);
  file.device = get_le<std::uint64_t>(bytes.data() + 16);
  return file;
}

void encode_shared_source(const SharedSourceRef& ref, std::byte* out) {
  std::memcpy(out, ref.host.data(), ref.host.size());
  encode_shared_file(ref.file, out + 16);
  std::byte* at = out + 16 + kSharedFileBytes;
  for (const std::uint64_t v : {ref.fd_offset, ref.region_size, ref.offset, ref.length, ref.copy_by_ns}) {
    put_le(at, v);
    at += 8;
  }
}

std::optional<SharedSourceRef> decode_shared_source(std::span<const std::byte> bytes) {
  if (bytes.size() < kSharedSourceRefBytes) return std::nullopt;
  SharedSourceRef ref;
  std::memcpy(ref.host.data(), bytes.data(), ref.host.size());
  ref.file = *decode_shared_file(bytes.subspan(16));
  const std::byte* at = bytes.data() + 16 + kSharedFileBytes;
  ref.fd_offset = get_le<std::uint64_t>(at);
  ref.region_size = get_le<std::uint64_t>(at + 8);
  ref.offset = get_le<std::uint64_t>(at + 16);
  ref.length = get_le<std::uint64_t>(at + 24);
  ref.copy_by_ns = get_le<std::uint64_t>(at + 32);
  const auto max = std::numeric_limits<std::uint64_t>::max();
  if (ref.file.fd < 0 || ref.region_size > max - ref.fd_offset || ref.offset > ref.region_size ||
      ref.length > ref.region_size - ref.offset) {
    return std::nullopt;
  }
  return ref;
}

SharedMappings::~SharedMappings() {
  while (!mappings_.empty()) unmap(mappings_.begin());
}

Result<const std::byte*> SharedMappings::source(const SharedSourceRef& ref) {
  const auto& host = host_identity();
  if (!host || *host != ref.host) return unavailable("the sender runs on another host (or boot)");
  const Key key{ref.file.pid, ref.file.fd, ref.file.inode, ref.file.device, ref.fd_offset, ref.region_size};
  auto found = mappings_.find(key);
  if (found == mappings_.end()) {
    const std::string path = fd_path(ref.file);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return unavailable(fmt::format("cannot open {}: {}", path, errno_text(errno)));
    struct stat st {};
    const bool same = ::fstat(fd, &st) == 0 && static_cast<std::uint64_t>(st.st_ino) == ref.file.inode &&
                      static_cast<std::uint64_t>(st.st_dev) == ref.file.device;
    const int seals = same ? ::fcntl(fd, F_GET_SEALS) : 0;
    const bool covers = same && static_cast<std::uint64_t>(st.st_size) >= ref.fd_offset + ref.region_size;
    if (!same || seals < 0 || (seals & F_SEAL_SHRINK) == 0 || !covers) {
      ::close(fd);
      return unavailable(
          fmt::format("{} is not the sealed file of {} bytes the sender named", path, ref.fd_offset + ref.region_size));
    }
    const std::uint64_t lead = ref.fd_offset % page_size();
    const std::uint64_t length = lead + ref.region_size;
    void* base = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(ref.fd_offset - lead));
    const int err = errno;
    ::close(fd);  // the mapping keeps the file
    if (base == MAP_FAILED) return unavailable(fmt::format("cannot map {}: {}", path, errno_text(err)));
    if (mappings_.size() >= max_mappings_) {
      auto oldest = mappings_.begin();
      for (auto it = mappings_.begin(); it != mappings_.end(); ++it) {
        if (it->second.last_use < oldest->second.last_use) oldest = it;
      }
      unmap(oldest);
    }
    found = mappings_.emplace(key, Mapping{ref.file, base, length, lead, 0}).first;
    mapped_bytes_ += length;
  }
  found->second.last_use = ++uses_;
  return static_cast<const std::byte*>(found->second.base) + found->second.lead + ref.offset;
}

void SharedMappings::forget(const SharedFile& file) {
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    auto next = std::next(it);
    if (it->second.file == file) unmap(it);
    it = next;
  }
}

void SharedMappings::sweep(TimePoint now, Duration every) {
  if (mappings_.empty() || (last_sweep_ && now - *last_sweep_ < every)) return;
  last_sweep_ = now;
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    auto next = std::next(it);
    if (!still_held(it->second.file)) unmap(it);
    it = next;
  }
}

void SharedMappings::unmap(std::map<Key, Mapping>::iterator it) {
  ::munmap(it->second.base, it->second.mapped);
  mapped_bytes_ -= it->second.mapped;
  mappings_.erase(it);
}

}  // namespace ecx::transport::ucx
