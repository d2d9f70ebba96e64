#include "zmq_util.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <limits>

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

namespace {

// The message whose first part is `part`: its other parts are queued already
// (atomic delivery), so reading them never waits.
Message rest_of(zmq::socket_t& socket, zmq::message_t part, std::size_t keep) {
  Message message;
  message.parts.reserve(keep);  // one allocation, not one per part kept
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

}  // namespace

std::optional<Message> receive(zmq::socket_t& socket, std::size_t keep) {
  zmq::message_t part;
  if (!socket.recv(part, zmq::recv_flags::dontwait)) return std::nullopt;
  return rest_of(socket, std::move(part), keep);
}

std::optional<Message> receive_waiting(zmq::socket_t& socket, std::size_t keep, std::chrono::milliseconds wait,
                                       int& error) {
  error = 0;
  const int timeout_ms = static_cast<int>(std::clamp<std::int64_t>(wait.count(), 0, std::numeric_limits<int>::max()));
  if (zmq_setsockopt(socket.handle(), ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms) != 0) {
    error = zmq_errno();
    return std::nullopt;
  }
  // The C call, not cppzmq's: a signal (EINTR) is no failure here, and nothing throws
  // out of a caller's blocking call.
  zmq::message_t part;
  if (zmq_msg_recv(part.handle(), socket.handle(), 0) < 0) {
    if (const int e = zmq_errno(); e != EAGAIN && e != EINTR) error = e;
    return std::nullopt;
  }
  return rest_of(socket, std::move(part), keep);
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

namespace {

// A socket's ready events among `wanted` (ZMQ_EVENTS: processes its pending commands),
// or -1 with errno set.
int socket_events(void* socket, short wanted) {
  int events = 0;
  std::size_t size = sizeof events;
  if (zmq_getsockopt(socket, ZMQ_EVENTS, &events, &size) != 0) return -1;
  return events & wanted & (ZMQ_POLLIN | ZMQ_POLLOUT);
}

short to_poll_events(short zmq_events) {
  short out = 0;
  if ((zmq_events & ZMQ_POLLIN) != 0) out |= POLLIN;
  if ((zmq_events & ZMQ_POLLOUT) != 0) out |= POLLOUT;
  if ((zmq_events & ZMQ_POLLPRI) != 0) out |= POLLPRI;
  return out;
}

short from_poll_events(short revents) {
  short out = 0;
  if ((revents & POLLIN) != 0) out |= ZMQ_POLLIN;
  if ((revents & POLLOUT) != 0) out |= ZMQ_POLLOUT;
  if ((revents & POLLPRI) != 0) out |= ZMQ_POLLPRI;
  if ((revents & ~(POLLIN | POLLOUT | POLLPRI)) != 0) out |= ZMQ_POLLERR;
  return out;
}

int failed_poll(std::span<zmq_pollitem_t> items) {
  for (auto& item : items) item.revents = 0;
  return errno == EINTR ? 0 : -1;
}

}  // namespace

int poll(std::span<zmq_pollitem_t> items, long timeout_ms) {
  // zmq_poll's contract, with fewer system calls on the way to a wake: zmq_poll reads
  // every socket's state (a getpid and a zero-timeout poll of its mailbox each) in a
  // first zero-timeout pass of its own and again after the wait. Here each socket's
  // state is read once before the one poll(2) over the sockets' ZMQ_FDs and the plain
  // fds, and after it only for a socket whose ZMQ_FD fired. ZMQ_FD only says "look
  // again" (a wake whose commands made nothing ready waits on, as zmq_poll does).
  thread_local std::vector<pollfd> fds;
  fds.resize(items.size());
  timeout_ms = std::min<long>(timeout_ms, std::numeric_limits<int>::max());
  const auto until = timeout_ms < 0 ? std::chrono::steady_clock::time_point::max()
                                    : std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  bool first = true;
  for (;;) {
    int ready = 0;
    for (std::size_t i = 0; i < items.size(); ++i) {
      zmq_pollitem_t& item = items[i];
      item.revents = 0;
      if (item.socket == nullptr) {
        fds[i] = {item.fd, to_poll_events(item.events), 0};
        continue;
      }
      fds[i] = {-1, 0, 0};             // a negative fd is skipped by poll(2)
      if (item.events == 0) continue;  // asks for nothing: neither read nor polled
      if (first) {
        const int events = socket_events(item.socket, item.events);
        if (events < 0) return failed_poll(items);
        item.revents = static_cast<short>(events);
        if (events != 0) ++ready;
      }
      int fd = -1;
      std::size_t size = sizeof fd;
      if (zmq_getsockopt(item.socket, ZMQ_FD, &fd, &size) != 0) return failed_poll(items);
      fds[i] = {fd, POLLIN, 0};
    }
    first = false;
    long wait_ms = 0;
    if (ready == 0 && until != std::chrono::steady_clock::time_point::max()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      wait_ms = std::max<long>(0, static_cast<long>(left.count()));
    } else if (ready == 0) {
      wait_ms = -1;
    }
    if (::poll(fds.data(), fds.size(), static_cast<int>(wait_ms)) < 0) return failed_poll(items);
    ready = 0;
    for (std::size_t i = 0; i < items.size(); ++i) {
      zmq_pollitem_t& item = items[i];
      if (item.socket == nullptr) {
        item.revents = static_cast<short>(from_poll_events(fds[i].revents) & (item.events | ZMQ_POLLERR));
      } else if (item.revents == 0 && (fds[i].revents & POLLIN) != 0) {
        const int events = socket_events(item.socket, item.events);
        if (events < 0) return failed_poll(items);
        item.revents = static_cast<short>(events);
      }
      if (item.revents != 0) ++ready;
    }
    if (ready > 0 || wait_ms == 0) return ready;
  }
}

}  // namespace ecx::control::detail
