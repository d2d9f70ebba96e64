#pragma once
// Little-endian fields of ECX's binary headers (the data plane's payload header, the
// UCX backend's confirmed-send messages), written byte by byte: independent of the
// host's byte order and of alignment.

#include <cstddef>
#include <cstdint>

namespace ecx::byte_order {

template <typename T>
void put_le(std::byte* at, T v) noexcept {
  for (std::size_t i = 0; i < sizeof(T); ++i) at[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

template <typename T>
T get_le(const std::byte* at) noexcept {
  T v = 0;
  for (std::size_t i = sizeof(T); i-- > 0;) v = static_cast<T>((v << 8) | static_cast<T>(at[i]));
  return v;
}

}  // namespace ecx::byte_order
