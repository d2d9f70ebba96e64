#pragma once
// "host:port" addresses of transport listeners ("[::1]:port" for IPv6).

#include <sys/socket.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/core/status.h"

namespace ecx::transport::detail {

struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const noexcept { return reinterpret_cast<const sockaddr*>(&storage); }
};

struct HostPort {
  std::string host;
  int port = 0;
};

// Splits "host:port" / "[v6]:port"; the port must be 0..65535.
Result<HostPort> split_host_port(std::string_view address);
// Resolves a numeric or named host (getaddrinfo) into a socket address.
Result<SocketAddress> resolve(const HostPort& host_port);
// "host:port" with brackets around IPv6 hosts; numeric form of a socket address.
std::string format_host_port(std::string_view host, int port);
Result<std::string> format_socket_address(const sockaddr* address);

// Worker addresses travel as "ucx:" + lowercase hex of UCX's packed address.
inline constexpr std::string_view kWorkerAddressPrefix = "ucx:";
std::string encode_worker_address(const void* data, std::size_t size);
// nullopt unless `address` is a well-formed "ucx:<hex>".
std::optional<std::vector<std::byte>> decode_worker_address(std::string_view address);

}  // namespace ecx::transport::detail
