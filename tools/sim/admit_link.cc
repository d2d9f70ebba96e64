#include "sim/admit_link.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/byte_order.h"
#include "transport/address.h"

namespace ecx::sim {
namespace {

constexpr std::string_view kScheme = "tcp://";
constexpr std::size_t kLengthBytes = sizeof(std::uint32_t);

Result<transport::detail::SocketAddress> resolve_endpoint(std::string_view endpoint) {
  if (!endpoint.starts_with(kScheme)) {
    return invalid_argument(fmt::format("admit endpoint '{}': expected tcp://HOST:PORT", endpoint));
  }
  auto host_port = transport::detail::split_host_port(endpoint.substr(kScheme.size()));
  if (!host_port) return host_port.status();
  return transport::detail::resolve(*host_port);
}

Status set_non_blocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return internal_error(fmt::format("fcntl(O_NONBLOCK): {}", errno_text(errno)));
  }
  return Status::ok();
}

// A frame's length, little-endian.
void append_length(std::string& out, std::uint32_t length) {
  std::byte bytes[kLengthBytes];
  byte_order::put_le(bytes, length);
  out.append(reinterpret_cast<const char*>(bytes), kLengthBytes);
}

std::uint32_t read_length(const char* bytes) {
  return byte_order::get_le<std::uint32_t>(reinterpret_cast<const std::byte*>(bytes));
}

int poll_timeout_ms(Duration timeout) {
  // Rounded up: a wait of 200 us is a wait, not a spin.
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(std::max(timeout, Duration::zero())).count();
  return static_cast<int>(std::min<std::int64_t>(ms, 60'000));
}

bool poll_readable(std::vector<pollfd>& fds, Duration timeout) {
  const int rc = ::poll(fds.data(), fds.size(), poll_timeout_ms(timeout));
  return rc > 0;
}

}  // namespace

// ---------------------------------------------------------------- OwnedFd

namespace detail {

OwnedFd& OwnedFd::operator=(OwnedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace detail

// ---------------------------------------------------------------- FrameStream

void FrameStream::fail(std::string why) {
  if (broken_) return;
  broken_ = true;
  why_closed_ = std::move(why);
  out_.clear();
  written_ = 0;
}

void FrameStream::read_available(std::vector<std::string>& frames) {
  if (!open()) return;
  char chunk[64 * 1024];
  for (;;) {
    const ssize_t n = ::recv(fd(), chunk, sizeof chunk, 0);
    if (n > 0) {
      in_.append(chunk, static_cast<std::size_t>(n));
      if (static_cast<std::size_t>(n) < sizeof chunk) break;  // drained: save the call that says so
      continue;
    }
    if (n == 0) {
      fail("the peer closed the connection");
      break;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) fail(fmt::format("recv: {}", errno_text(errno)));
    break;
  }
  std::size_t at = 0;
  while (in_.size() - at >= kLengthBytes) {
    const std::uint32_t length = read_length(in_.data() + at);
    if (length > kMaxAdmitFrameBytes) {
      fail(fmt::format("a frame of {} bytes (at most {}): not an admit channel peer", length, kMaxAdmitFrameBytes));
      in_.clear();
      return;
    }
    if (in_.size() - at - kLengthBytes < length) break;
    frames.emplace_back(in_, at + kLengthBytes, length);
    at += kLengthBytes + length;
  }
  in_.erase(0, at);
}

void FrameStream::queue(std::string_view frame) {
  if (!open()) return;
  append_length(out_, static_cast<std::uint32_t>(frame.size()));
  out_.append(frame);
}

void FrameStream::flush() {
  while (open() && has_queued()) {
    const ssize_t n = ::send(fd(), out_.data() + written_, out_.size() - written_, MSG_NOSIGNAL);
    if (n > 0) {
      written_ += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    fail(fmt::format("send: {}", n < 0 ? errno_text(errno) : std::string("wrote nothing")));
  }
  if (!has_queued()) {
    out_.clear();
    written_ = 0;
  }
}

Status FrameStream::flush_within(Duration timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    flush();
    if (!open()) return unavailable(why_closed_);
    if (!has_queued()) return Status::ok();
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= Duration::zero()) {
      return timeout_error(fmt::format("{} bytes not taken by the peer in {} ms", out_.size() - written_,
                                       std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()));
    }
    pollfd item{fd(), POLLOUT, 0};
    (void)::poll(&item, 1, poll_timeout_ms(left));
  }
}

// ---------------------------------------------------------------- AdmitListener

Result<std::unique_ptr<AdmitListener>> AdmitListener::bind(std::string_view endpoint) {
  auto address = resolve_endpoint(endpoint);
  if (!address) return address.status();
  std::unique_ptr<AdmitListener> listener(new AdmitListener());  // NOLINT: private constructor
  listener->listen_fd_ =
      detail::OwnedFd(::socket(address->get()->sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  const int fd = listener->listen_fd_.get();
  if (fd < 0) return unavailable(fmt::format("admit channel socket: {}", errno_text(errno)));
  const int on = 1;
  (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  if (::bind(fd, address->get(), address->length) != 0 || ::listen(fd, 64) != 0) {
    return unavailable(fmt::format("cannot bind the admit channel {}: {}", endpoint, errno_text(errno)));
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    return internal_error(fmt::format("getsockname: {}", errno_text(errno)));
  }
  auto text = transport::detail::format_socket_address(reinterpret_cast<const sockaddr*>(&bound));
  if (!text) return text.status();
  listener->endpoint_ = std::string(kScheme) + *text;
  return listener;
}

void AdmitListener::accept_waiting() {
  for (;;) {
    const int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;  // none waiting (EAGAIN), or one that reset before it was taken
    const int on = 1;
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
    connections_.push_back(Connection{fmt::format("producer-{}", next_sender_++), FrameStream(fd)});
  }
}

void AdmitListener::fill_poll_fds() {
  poll_fds_.clear();
  poll_fds_.push_back(pollfd{listen_fd_.get(), POLLIN, 0});
  for (const auto& c : connections_) poll_fds_.push_back(pollfd{c.stream.fd(), POLLIN, 0});
}

std::vector<AdmitBatch> AdmitListener::receive() {
  std::vector<AdmitBatch> batches;
  for (auto& c : connections_) c.stream.flush();  // answers the socket did not take at once
  fill_poll_fds();
  if (::poll(poll_fds_.data(), poll_fds_.size(), 0) <= 0) return batches;
  for (std::size_t k = 0; k < connections_.size(); ++k) {
    if (poll_fds_[k + 1].revents == 0) continue;
    Connection& c = connections_[k];
    frames_.clear();
    c.stream.read_available(frames_);
    if (frames_.empty()) continue;
    AdmitBatch batch{c.sender, {}};
    batch.admits.reserve(frames_.size());
    for (const auto& frame : frames_) batch.admits.push_back(decode_admit(frame));
    batches.push_back(std::move(batch));
  }
  // After the reads: a producer's last frames are taken before its closed connection goes.
  std::erase_if(connections_, [](const Connection& c) { return !c.stream.open(); });
  if (poll_fds_[0].revents != 0) accept_waiting();
  return batches;
}

void AdmitListener::send(std::string_view sender, std::string_view frame) {
  for (auto& c : connections_) {
    if (c.sender != sender) continue;
    c.stream.queue(frame);
    c.stream.flush();
    return;
  }
}

std::vector<WakeSource> AdmitListener::wake_sources() const {
  std::vector<WakeSource> sources;
  sources.reserve(connections_.size() + 1);
  sources.push_back(WakeSource{nullptr, listen_fd_.get()});
  for (const auto& c : connections_) sources.push_back(WakeSource{nullptr, c.stream.fd()});
  return sources;
}

bool AdmitListener::wait(Duration timeout) {
  fill_poll_fds();
  if (!poll_readable(poll_fds_, timeout)) return false;
  if (poll_fds_[0].revents != 0) accept_waiting();
  return std::any_of(poll_fds_.begin() + 1, poll_fds_.end(), [](const pollfd& p) { return p.revents != 0; });
}

// ---------------------------------------------------------------- AdmitConnection

Result<std::unique_ptr<AdmitConnection>> AdmitConnection::connect(std::string_view endpoint, Duration timeout) {
  auto address = resolve_endpoint(endpoint);
  if (!address) return address.status();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const int fd = ::socket(address->get()->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return unavailable(fmt::format("admit channel socket: {}", errno_text(errno)));
    if (::connect(fd, address->get(), address->length) == 0) {
      const int on = 1;
      (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
      if (Status s = set_non_blocking(fd); !s) {
        ::close(fd);
        return s;
      }
      return std::unique_ptr<AdmitConnection>(new AdmitConnection(FrameStream(fd)));  // NOLINT: private constructor
    }
    const int error = errno;
    ::close(fd);
    if (error != ECONNREFUSED || std::chrono::steady_clock::now() >= deadline) {
      return unavailable(fmt::format("cannot connect the admit channel {}: {}", endpoint, errno_text(error)));
    }
    // The consumer binds before it announces the endpoint; this covers one started by
    // hand in the other order.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<std::string> AdmitConnection::receive() {
  std::vector<std::string> frames;
  stream_.read_available(frames);
  return frames;
}

bool AdmitConnection::wait(Duration timeout) const {
  if (!stream_.open()) {
    // No answer can come: the consumer's closed socket would read as ready at once,
    // and a producer waiting for answers would spin until its deadline.
    std::this_thread::sleep_for(timeout);
    return false;
  }
  std::vector<pollfd> fds{pollfd{stream_.fd(), POLLIN, 0}};
  return poll_readable(fds, timeout);
}

}  // namespace ecx::sim
