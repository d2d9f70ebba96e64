#include "ecx/core/metrics_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "core/logging.h"
#include "ecx/core/thread_name.h"

namespace ecx::metrics {
namespace {

constexpr int kPollMs = 100;             // stop() latency bound
constexpr int kClientDeadlineMs = 2000;  // a slow client cannot hold the thread longer
constexpr std::size_t kMaxRequestBytes = 8192;

bool send_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

}  // namespace

namespace {
std::atomic<int> g_global_servers{0};
}  // namespace

int MetricsServer::global_servers() noexcept { return g_global_servers.load(); }

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(const Registry& registry, const std::string& host, int port,
                                                            ServeOptions options) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return invalid_argument(
        fmt::format("metrics endpoint: '{}' is not a numeric IP address ({})", host, ::gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> info(found, ::freeaddrinfo);
  const int fd = ::socket(info->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return internal_error(fmt::format("metrics endpoint: socket(): {}", errno_text(errno)));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, info->ai_addr, info->ai_addrlen) != 0 || ::listen(fd, 16) != 0) {
    const int err = errno;
    ::close(fd);
    return unavailable(fmt::format("metrics endpoint: cannot listen on {}:{}: {}", host, port, errno_text(err)));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int bound_port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                                     : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return std::unique_ptr<MetricsServer>(  // NOLINT: private constructor
      new MetricsServer(registry, fd, bound_port, options));
}

MetricsServer::MetricsServer(const Registry& registry, int listen_fd, int port, ServeOptions options)
    : registry_(registry),
      options_(options),
      serves_global_(&registry == &Registry::global()),
      listen_fd_(listen_fd),
      port_(port),
      thread_([this] {
        name_this_thread("ecx-metrics");
        serve();
      }) {
  if (serves_global_) g_global_servers.fetch_add(1);
}

MetricsServer::~MetricsServer() { stop(); }

void MetricsServer::stop() {
  if (stopping_.exchange(true)) return;
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  if (serves_global_) g_global_servers.fetch_sub(1);
}

void MetricsServer::serve() {
  while (!stopping_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, kPollMs) <= 0) continue;
    const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    handle(client);
    ::close(client);
  }
}

void MetricsServer::handle(int client_fd) {
  std::string request;
  char buffer[1024];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    pollfd p{client_fd, POLLIN, 0};
    if (::poll(&p, 1, kClientDeadlineMs) <= 0) return;
    const ssize_t n = ::recv(client_fd, buffer, sizeof(buffer), 0);
    if (n <= 0) return;
    request.append(buffer, static_cast<std::size_t>(n));
  }
  const bool is_metrics = request.starts_with("GET /metrics ") || request.starts_with("GET /metrics?");
  std::string body;
  std::string status = "404 Not Found";
  std::string type = "text/plain";
  if (is_metrics) {
    body = registry_.prometheus_text();
    if (options_.global_when_unserved && !serves_global_ && global_servers() == 0) {
      body += Registry::global().prometheus_text();
    }
    status = "200 OK";
    type = "text/plain; version=0.0.4; charset=utf-8";
  } else {
    body = "only GET /metrics is served here\n";
  }
  send_all(client_fd, fmt::format("HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                                  status, type, body.size()));
  send_all(client_fd, body);
}

}  // namespace ecx::metrics
