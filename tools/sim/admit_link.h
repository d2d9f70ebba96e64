#pragma once
// The simulators' admit channel on the wire: one TCP connection per producer,
// length-prefixed frames (4 bytes little-endian, then one admit_message.h message),
// read and written by the engine threads themselves.
//
// Why not ZeroMQ, as ECX's control plane: a ZeroMQ socket hands every message to its
// context's I/O thread, which the kernel must wake. At 64 KiB, 32 in flight, on 2 CPUs
// those two threads (one per simulator) cost 8-9 us of CPU per item, mostly their
// wake-ups: half of what the simulated engines cost in all, taken from the CPUs that
// ECX and its data plane share with them. Here the engine thread's own write is the
// send and its own read the receive: no third thread wakes.
//
// A step's frames go out in one write (queue, then flush), so the reader wakes once per
// step, as the ZeroMQ multipart message did. Nothing blocks: writes the socket does not
// take wait in the sender's buffer for the next flush, except the producer's last
// flush, which waits a bounded time (what ZeroMQ's linger did).

#include <poll.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"
#include "ecx/core/wake_source.h"
#include "sim/admit_message.h"

namespace ecx::sim {

// The largest frame either side reads: an admit message names a request's items, a
// few hundred bytes each. A longer length means the peer speaks something else.
inline constexpr std::uint32_t kMaxAdmitFrameBytes = 16U << 20;

namespace detail {
// A file descriptor, owned: closed when its owner goes, moved, never copied.
class OwnedFd {
 public:
  OwnedFd() = default;
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  OwnedFd& operator=(OwnedFd&& other) noexcept;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd();
  int get() const { return fd_; }

 private:
  int fd_ = -1;
};
}  // namespace detail

// One connected stream socket, owned: frames in and out.
class FrameStream {
 public:
  explicit FrameStream(int fd) : fd_(fd) {}  // takes `fd` (non-blocking) and closes it

  int fd() const { return fd_.get(); }
  // Whether the stream still works: false once the peer closed it, a read or write
  // failed, or a frame could not be read.
  bool open() const { return fd_.get() >= 0 && !broken_; }
  // Why it does not (empty while open).
  const std::string& why_closed() const { return why_closed_; }

  // Reads what the socket holds, never waiting, and appends each whole frame to
  // `frames`. A frame longer than kMaxAdmitFrameBytes closes the stream.
  void read_available(std::vector<std::string>& frames);
  // Adds one frame to what the next flush writes.
  void queue(std::string_view frame);
  // Writes what is queued, never waiting; what the socket does not take stays queued.
  void flush();
  // Writes what is queued, waiting up to `timeout` for the socket to take it.
  Status flush_within(Duration timeout);
  bool has_queued() const { return written_ < out_.size(); }

 private:
  void fail(std::string why);

  detail::OwnedFd fd_;
  bool broken_ = false;
  std::string why_closed_;
  std::string in_;   // bytes read, not yet a whole frame
  std::string out_;  // frames queued; written_ of them sent
  std::size_t written_ = 0;
};

// The consumer's end: listens, accepts producers, reads their admit messages and
// answers each on its own connection.
class AdmitListener {
 public:
  // `endpoint`: "tcp://HOST:PORT" (HOST numeric or a name, IPv6 in brackets; port 0:
  // any free one).
  static Result<std::unique_ptr<AdmitListener>> bind(std::string_view endpoint);

  // Where producers connect: "tcp://HOST:PORT" with the port bound.
  const std::string& endpoint() const { return endpoint_; }

  // The admit messages every producer has sent since the last call, one batch per
  // producer that sent any (its sender names it for answers); accepts producers that
  // connected and drops those that left. Never waits: one poll of every socket, then
  // reads of those it names (each empty read is a system call, and the consumer's
  // engine asks at every step).
  std::vector<AdmitBatch> receive();
  // Queues `frame` to the producer `sender` and writes it without waiting; a producer
  // that left is skipped.
  void send(std::string_view sender, std::string_view frame);
  // What to poll to learn that a producer connected, sent something or left (a
  // connection that broke reads at once, and the next receive() drops it).
  std::vector<WakeSource> wake_sources() const;
  // Waits up to `timeout` for one of them, and accepts a producer that connected;
  // true only when a producer's connection has something to read (a producer that
  // connects has sent nothing yet: the consumer's CPU window opens with the first
  // request, not with the producer's start).
  bool wait(Duration timeout);

 private:
  AdmitListener() = default;
  void accept_waiting();
  // poll_fds_ for the listening socket (first), then every connection in order.
  void fill_poll_fds();

  struct Connection {
    std::string sender;
    FrameStream stream;
  };
  detail::OwnedFd listen_fd_;
  std::string endpoint_;
  std::uint64_t next_sender_ = 0;
  std::vector<Connection> connections_;
  // Reused at every call: receive() runs at every step of the consumer's engine.
  std::vector<pollfd> poll_fds_;
  std::vector<std::string> frames_;
};

// A producer's end: one connection to the consumer's listener.
class AdmitConnection {
 public:
  // Connects within `timeout` (the listener may still be starting: refused
  // connections are retried until then).
  static Result<std::unique_ptr<AdmitConnection>> connect(std::string_view endpoint, Duration timeout);

  // Adds one frame to the next flush.
  void queue(std::string_view frame) { stream_.queue(frame); }
  // Writes what is queued without waiting; a consumer that left is logged once by the
  // caller through `open()`.
  void flush() { stream_.flush(); }
  Status flush_within(Duration timeout) { return stream_.flush_within(timeout); }
  bool has_queued() const { return stream_.has_queued(); }
  // The consumer's answers read so far (never waits).
  std::vector<std::string> receive();
  bool open() const { return stream_.open(); }
  const std::string& why_closed() const { return stream_.why_closed(); }
  // Waits up to `timeout` for an answer; true when one is readable. Once the
  // connection is closed, waits the whole `timeout` and answers false.
  bool wait(Duration timeout) const;

 private:
  explicit AdmitConnection(FrameStream stream) : stream_(std::move(stream)) {}
  FrameStream stream_;
};

}  // namespace ecx::sim
