#pragma once
// Small ZeroMQ helpers shared by the server, the client and the event inbox.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <zmq.hpp>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"
#include "ecx/wire/auth.h"
#include "ecx/wire/protocol.h"

namespace ecx::control::detail {

// An eventfd another thread writes to wake a poll loop (detail::poll). Redundant notifications
// collapse into one (the flag avoids a syscall per publish while one is pending).
class Wakeup {
 public:
  Wakeup();
  ~Wakeup();
  Wakeup(const Wakeup&) = delete;
  Wakeup& operator=(const Wakeup&) = delete;
  bool valid() const noexcept { return fd_ >= 0; }
  int fd() const noexcept { return fd_; }
  void notify() noexcept;
  void clear() noexcept;  // by the polling thread once the fd polls readable, before it reads its queues

 private:
  int fd_ = -1;
  std::atomic<bool> pending_{false};
};

// libzmq names a context's threads "<tag>/ZMQbg/IO/0" (libzmq 4.3 takes a number):
// the tag says which of ECX's contexts a busy I/O thread serves, in `top -H` and in
// the CPU table of `ecx bench e2e` (docs/operations.md lists them).
enum class ContextTag : int { control_client = 1, control_server = 2, event_inbox = 3 };
// One I/O thread, tagged. Set before the first socket starts the context's threads.
zmq::context_t tagged_context(ContextTag tag);

// Linger 0 (shutdown never waits for peers), IPv6 on, frames above the limit
// refused by libzmq before they are buffered.
void set_common_options(zmq::socket_t& socket, const wire::Limits& limits);

// One message off a socket: at most `keep` parts are kept; the rest are read and
// counted so that the next message starts clean.
struct Message {
  std::vector<zmq::message_t> parts;
  std::size_t total_parts = 0;
};
// Non-blocking; nullopt when nothing is queued.
std::optional<Message> receive(zmq::socket_t& socket, std::size_t keep);
// Waits up to `wait` for a message, in ZeroMQ's own blocking receive (the socket's
// ZMQ_RCVTIMEO is set to it). nullopt when none came in time or a signal cut the wait
// short (`error` 0), or when the socket failed (`error` its errno).
std::optional<Message> receive_waiting(zmq::socket_t& socket, std::size_t keep, std::chrono::milliseconds wait,
                                       int& error);

std::string_view view(const zmq::message_t& part);

// Sends [prefix?] body [mac?] without blocking. False when the socket would block.
bool send_frames(zmq::socket_t& socket, const zmq::message_t* prefix, std::string_view body, const wire::Mac* mac);

// tcp://host:port -> host (brackets kept for IPv6) and port.
struct TcpEndpoint {
  std::string host;
  int port = 0;
};
Result<TcpEndpoint> parse_tcp_endpoint(std::string_view endpoint);
std::string with_port(const TcpEndpoint& endpoint, int port);
// tcp://host:* (ephemeral) or tcp://host:port, IPv6 hosts in brackets.
std::string bind_address(std::string_view host, int port);

// Milliseconds until `deadline`, clamped to [0, cap].
long poll_timeout_ms(TimePoint now, std::optional<TimePoint> deadline, std::chrono::milliseconds cap);

// zmq_poll's contract (revents set, the count of ready items returned, -1 on an
// error, EINTR read as "nothing ready"), with fewer system calls per wait.
int poll(std::span<zmq_pollitem_t> items, long timeout_ms);

}  // namespace ecx::control::detail
