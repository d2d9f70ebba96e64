#include "transport/address.h"

#include <netdb.h>
#include <netinet/in.h>

#include <charconv>
#include <cstring>

#include <fmt/format.h>

namespace ecx::transport::detail {

Result<HostPort> split_host_port(std::string_view address) {
  const auto colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
    return invalid_argument(fmt::format("address '{}' is not host:port", address));
  }
  std::string_view host = address.substr(0, colon);
  const std::string_view port_text = address.substr(colon + 1);
  if (host.front() == '[') {
    if (host.back() != ']' || host.size() < 3)
      return invalid_argument(fmt::format("address '{}': bad IPv6 brackets", address));
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string_view::npos) {
    return invalid_argument(fmt::format("address '{}': put an IPv6 host in brackets", address));
  }
  int port = -1;
  const auto [end, error] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (error != std::errc{} || end != port_text.data() + port_text.size() || port < 0 || port > 65535) {
    return invalid_argument(fmt::format("address '{}': port must be 0..65535", address));
  }
  return HostPort{std::string(host), port};
}

Result<SocketAddress> resolve(const HostPort& host_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(host_port.port);
  if (const int rc = ::getaddrinfo(host_port.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return unavailable(fmt::format("cannot resolve '{}': {}", host_port.host, ::gai_strerror(rc)));
  }
  SocketAddress result;
  std::memcpy(&result.storage, found->ai_addr, found->ai_addrlen);
  result.length = found->ai_addrlen;
  ::freeaddrinfo(found);
  return result;
}

std::string format_host_port(std::string_view host, int port) {
  if (host.find(':') != std::string_view::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

Result<std::string> format_socket_address(const sockaddr* address) {
  char host[NI_MAXHOST];
  char port[NI_MAXSERV];
  const socklen_t length = address->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  if (const int rc =
          ::getnameinfo(address, length, host, sizeof host, port, sizeof port, NI_NUMERICHOST | NI_NUMERICSERV);
      rc != 0) {
    return internal_error(fmt::format("getnameinfo: {}", ::gai_strerror(rc)));
  }
  return format_host_port(host, std::atoi(port));
}

std::string encode_worker_address(const void* data, std::size_t size) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string text(kWorkerAddressPrefix);
  text.reserve(text.size() + 2 * size);
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < size; ++i) {
    text.push_back(kHex[bytes[i] >> 4]);
    text.push_back(kHex[bytes[i] & 0xf]);
  }
  return text;
}

std::optional<std::vector<std::byte>> decode_worker_address(std::string_view address) {
  if (!address.starts_with(kWorkerAddressPrefix)) return std::nullopt;
  const std::string_view hex = address.substr(kWorkerAddressPrefix.size());
  if (hex.empty() || hex.size() % 2 != 0) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::vector<std::byte> bytes(hex.size() / 2);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const int high = nibble(hex[2 * i]);
    const int low = nibble(hex[2 * i + 1]);
    if (high < 0 || low < 0) return std::nullopt;
    bytes[i] = static_cast<std::byte>((high << 4) | low);
  }
  return bytes;
}

}  // namespace ecx::transport::detail
