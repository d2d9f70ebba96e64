#include "zmq_util.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>

#include <fmt/format.h>

namespace ecx::control::detail {

Wakeup::Wakeup() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

Wakeup::~Wakeup() {
  if (fd_ >= 0) ::close(fd_);
}

void Wakeup::notify() noexcept {
  if (pending_.exchange(true, std::memory_order_seq_cst)) return;
  const std::uint64_t one = 1;
  // EAGAIN only when the counter would overflow: already readable, nothing lost.
  [[maybe_unused]] const ssize_t n = ::write(fd_, &one, sizeof one);
}

void Wakeup::clear() noexcept {
  // Read first, then reopen the flag: the other order loses a wakeup when a notify
  // lands in between (its write would be swallowed by this read while the flag
  // stays set, silencing every later notify).
  std::uint64_t value = 0;
  [[maybe_unused]] const ssize_t n = ::read(fd_, &value, sizeof value);
  pending_.store(false, std::memory_order_seq_cst);
}

zmq::context_t tagged_context(ContextTag tag) {
  zmq::context_t context{1};
  // Best effort: a name is no reason to fail.
  (void)zmq_ctx_set(context.handle(), ZMQ_THREAD_NAME_PREFIX, static_cast<int>(tag));
  return context;
}

void set_common_options(zmq::socket_t& socket, const wire::Limits& limits) {
  socket.set(zmq::sockopt::linger, 0);
  socket.set(zmq::sockopt::ipv6, 1);
  // The MAC part is 32 bytes, so the body limit bounds every part.
  socket.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(std::max<std::size_t>(limits.max_frame_bytes, 64)));
}

std::optional<Message> receive(zmq::socket_t& socket, std::size_t keep) {
  zmq::message_t part;
  if (!socket.recv(part, zmq::recv_flags::dontwait)) return std::nullopt;
  Message message;
  for (;;) {
    ++message.total_parts;
    const bool more = part.more();
    if (message.parts.size() < keep) message.parts.push_back(std::move(part));
    if (!more) break;
    part = zmq::message_t();
    // The remaining parts of a message are already queued: this never waits.
    if (!socket.recv(part, zmq::recv_flags::dontwait)) break;
  }
  return message;
}

std::string_view view(const zmq::message_t& part) {
  return std::string_view(static_cast<const char*>(part.data()), part.size());
}

bool send_frames(zmq::socket_t& socket, const zmq::message_t* prefix, std::string_view body, const wire::Mac* mac) {
  const auto more = zmq::send_flags::dontwait | zmq::send_flags::sndmore;
  if (prefix) {
    zmq::message_t id(prefix->data(), prefix->size());
    if (!socket.send(id, more)) return false;
  }
  // Once the first part is queued the rest of the message always is (atomic delivery).
  zmq::message_t payload(body.data(), body.size());
  if (!socket.send(payload, mac ? more : zmq::send_flags::dontwait)) return false;
  if (mac) {
    zmq::message_t tag(mac->data(), mac->size());
    if (!socket.send(tag, zmq::send_flags::dontwait)) return false;
  }
  return true;
}

Result<TcpEndpoint> parse_tcp_endpoint(std::string_view endpoint) {
  constexpr std::string_view kScheme = "tcp://";
  if (!endpoint.starts_with(kScheme)) {
    return invalid_argument(fmt::format("'{}' is not a tcp://host:port address", endpoint));
  }
  const std::string_view rest = endpoint.substr(kScheme.size());
  const auto colon = rest.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return invalid_argument(fmt::format("'{}' has no host:port part", endpoint));
  }
  TcpEndpoint out;
  out.host = std::string(rest.substr(0, colon));
  const std::string_view port = rest.substr(colon + 1);
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), out.port);
  if (ec != std::errc{} || end != port.data() + port.size() || out.port < 1 || out.port > 65535) {
    return invalid_argument(fmt::format("'{}' has an invalid port", endpoint));
  }
  if (out.host.find(':') != std::string::npos && !out.host.starts_with('[')) {
    return invalid_argument(fmt::format("'{}': IPv6 hosts must be in brackets", endpoint));
  }
  return out;
}

std::string with_port(const TcpEndpoint& endpoint, int port) { return fmt::format("tcp://{}:{}", endpoint.host, port); }

std::string bind_address(std::string_view host, int port) {
  const bool v6 = host.find(':') != std::string_view::npos && !host.starts_with('[');
  const std::string h = v6 ? fmt::format("[{}]", host) : std::string(host);
  return port == 0 ? fmt::format("tcp://{}:*", h) : fmt::format("tcp://{}:{}", h, port);
}

long poll_timeout_ms(TimePoint now, std::optional<TimePoint> deadline, std::chrono::milliseconds cap) {
  if (!deadline) return static_cast<long>(cap.count());
  if (*deadline <= now) return 0;
  // Round up so that a deadline 0.3 ms away does not spin with timeout 0.
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - now);
  return static_cast<long>(std::min(left, cap).count());
}

int poll(std::vector<zmq_pollitem_t>& items, long timeout_ms) {
  const int rc = zmq_poll(items.data(), static_cast<int>(items.size()), timeout_ms);
  if (rc < 0) {
    for (auto& item : items) item.revents = 0;
    if (zmq_errno() == EINTR) return 0;
    return -1;
  }
  return rc;
}

}  // namespace ecx::control::detail
