#pragma once
// The data plane: moves one payload from a registered local region into memory the
// RECEIVER chooses. The sender passes a small opaque header with every payload;
// on the receiving side a landing resolver turns that header into a destination
// (or rejects it) before any payload byte is written, so data can only land where
// the receiver currently wants it. Headers are bytes to the transport; the layer
// above defines their content.
//
// Lifecycle of one payload:
//   sender:   send(endpoint, header, region, offset, length, deadline, on_sent)
//   receiver: resolver(header, length) -> Landing{destination, length, token} | error
//             ... payload written into destination ...
//             on_landing(header, landing, ok | error)      (only for resolved landings)
//   sender:   on_sent(ok | error)                         (exactly once per accepted send)
//
// Threading. Each transport owns one progress thread; every callback (resolver,
// on_landing, on_sent, on_peer_failure) runs on it, one at a time, and must not
// block. All public member functions are thread-safe and may be called from any
// thread, including from inside a callback. register_region, deregister_region,
// listen and connect wait for the progress thread (bounded by the call timeout);
// send, and the deferred (de)registration where a backend has it, only enqueue
// (bounded queue: resource_exhausted when full).
//
// Memory. A region is registered once and may be the source of any number of
// sends; it must stay registered (and allocated) until every send from it has
// completed. Destinations returned by the resolver should lie inside a region
// registered with the same transport (faster: no per-transfer registration), and
// must stay valid until on_landing ran for them.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"

namespace ecx::transport {

inline constexpr std::size_t kMaxHeaderBytes = 1024;

enum class MemoryKind : std::uint8_t {
  host,  // any CPU-addressable memory, including CUDA pinned host memory
  cuda,  // device memory; only with a transport built with CUDA support (Debian's UCX is not)
};

struct RegionHandle {
  std::uint64_t id = 0;  // 0: none
  bool valid() const noexcept { return id != 0; }
  friend bool operator==(const RegionHandle&, const RegionHandle&) = default;
};

struct EndpointHandle {
  std::uint64_t id = 0;  // 0: none
  bool valid() const noexcept { return id != 0; }
  friend bool operator==(const EndpointHandle&, const EndpointHandle&) = default;
};

// Where an incoming payload goes. `length` must equal the payload length: a payload
// of any other length is refused and never written (on_landing reports the error).
struct Landing {
  std::byte* destination = nullptr;
  std::uint64_t length = 0;
  std::uint64_t token = 0;  // opaque to the transport; handed back to on_landing
};

// Runs on the progress thread for every incoming payload, before any byte is
// written. An error rejects the payload: nothing is written and on_landing is not
// called. With a rendezvous payload the sender's on_sent then reports the error
// too (an eagerly sent small payload is already on the wire: its sender sees ok).
using LandingResolver = std::function<Result<Landing>(std::span<const std::byte> header, std::uint64_t payload_bytes)>;
// Exactly once per resolved landing: ok = every byte is in place; an error = the
// payload did not (fully) arrive, e.g. the sender died; the destination may then
// hold partial data and is the receiver's again.
using LandingCallback = std::function<void(std::span<const std::byte> header, const Landing& landing, Status status)>;
// Exactly once per send that send() accepted. ok = the source bytes may be reused
// and the payload was handed to the receiver (a rendezvous payload: fetched into
// its landing). An error = it was not delivered (peer failure, rejection, deadline,
// shutdown); the source may be reused once this callback runs.
using SendCallback = std::function<void(Status status)>;
// An endpoint (outgoing or incoming) failed; its pending sends fail with `status`.
// For an outgoing endpoint `peer` is the address it was connected to.
using PeerFailureCallback = std::function<void(EndpointHandle endpoint, std::string_view peer, const Status& status)>;

// What a backend can do; the layers above ask this instead of the backend's name.
enum class LandingChoice : std::uint8_t {
  receiver,  // send(): the receiver's resolver picks the destination from the payload's header
  sender,    // write(): the sender writes to an address the receiver granted beforehand
};

struct Capabilities {
  LandingChoice landing = LandingChoice::receiver;
  // The bytes move without the receiving side's progress: it learns of a payload only
  // when the sender says so on the control plane (`complete`).
  bool one_sided = false;
  bool device_memory = false;  // register_region accepts MemoryKind::cuda
  // send_confirmed() is available: its on_sent carries the receiver's verdict even for a
  // payload small enough to go eagerly.
  bool confirmed_sends = false;
  // register_shared_region pays off: a same-host receiver may copy payloads out of
  // shared memory itself (elsewhere it is an ordinary registration).
  bool shared_sources = false;
};
std::string_view landing_choice_name(LandingChoice choice) noexcept;

// One-sided writes (LandingChoice::sender): the write settled, or its deadline passed
// while it was still in flight (a submitted write cannot be cancelled).
using WriteCallback = std::function<void(Status status)>;
using OverdueCallback = std::function<void()>;

struct TransportStats {
  std::uint64_t sends_started = 0;
  std::uint64_t sends_ok = 0;
  std::uint64_t sends_failed = 0;
  std::uint64_t bytes_sent = 0;
  std::uint64_t landings_ok = 0;
  std::uint64_t landings_failed = 0;
  std::uint64_t landings_rejected = 0;  // the resolver refused, or the length did not match
  std::uint64_t bytes_landed = 0;
  std::uint64_t peer_failures = 0;
  std::uint64_t deadline_expiries = 0;
  // Shared sources (see register_shared_region): payloads this side sent as a place
  // in its shared memory, and payloads it copied out of a sender's shared memory.
  std::uint64_t shared_sends = 0;
  std::uint64_t shared_landings = 0;
  std::uint64_t shared_fallbacks = 0;     // sent as shared, refused by the receiver, resent the usual way
  std::uint64_t shared_mapped_bytes = 0;  // of senders' shared memory this side holds mapped now
};

// Host memory a same-host receiver can map: `fd` (a memfd, owned by the caller and
// open while the region is registered) holds the region's first byte at `fd_offset`.
struct SharedBacking {
  int fd = -1;
  std::uint64_t fd_offset = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Registers [base, base + size) once; the handle names it in send().
  virtual Result<RegionHandle> register_region(void* base, std::uint64_t size, MemoryKind kind) = 0;
  // register_region for host memory that `backing` shares. A backend that can lets a
  // receiver on the same host copy a payload straight out of it (one memcpy, no
  // socket or kernel copy); elsewhere it is an ordinary region. Default: the latter.
  virtual Result<RegionHandle> register_shared_region(void* base, std::uint64_t size, SharedBacking backing) {
    static_cast<void>(backing);
    return register_region(base, size, MemoryKind::host);
  }
  // conflict while a send from the region is still in flight.
  virtual Status deregister_region(RegionHandle region) = 0;

  // For memory registered per payload (an engine's output sent from where it lies):
  // the same two calls without waiting for the progress thread, where the backend
  // can defer them. register_region_deferred checks its arguments and returns the
  // handle at once; the registration is made before any send queued after it runs,
  // and if it fails those sends fail (on_sent), naming the reason.
  // deregister_region_then runs `done` (on any thread, exactly once) with what
  // deregister_region would have returned. Defaults: the waiting calls.
  virtual Result<RegionHandle> register_region_deferred(void* base, std::uint64_t size, MemoryKind kind) {
    return register_region(base, size, kind);
  }
  virtual void deregister_region_then(RegionHandle region, const std::function<void(Status)>& done) {
    done(deregister_region(region));
  }

  // Starts accepting connections on host:port (port 0 = any free port) and returns
  // the address peers pass to connect() (a backend-defined string, e.g.
  // "127.0.0.1:40123"); the consumer puts it in its topology reply.
  virtual Result<std::string> listen(std::string_view host, int port) = 0;
  // The endpoint for a peer address, created on first use and cached; a failed
  // endpoint is dropped from the cache, so the next connect() makes a fresh one.
  virtual Result<EndpointHandle> connect(std::string_view address) = 0;

  // Sends `length` bytes at `offset` of `region` with `header` (at most
  // kMaxHeaderBytes) to the peer. A send still pending at `deadline` fails with
  // `timeout`. An error returned here means on_sent will not be called.
  virtual Status send(EndpointHandle endpoint, std::span<const std::byte> header, RegionHandle region,
                      std::uint64_t offset, std::uint64_t length, TimePoint deadline, SendCallback on_sent) = 0;

  // send() whose on_sent is the receiver's verdict at every payload size: ok = its
  // resolver accepted the payload and every byte is in place; an error = it was turned
  // away (nothing landed; the status carries the resolver's reason) or did not arrive.
  // A plain send() of a small payload completes once the bytes are on their way, so a
  // sender that lets the receiver decide whether to take a payload needs this.
  // Backends without Capabilities::confirmed_sends refuse it.
  virtual Status send_confirmed(EndpointHandle endpoint, std::span<const std::byte> header, RegionHandle region,
                                std::uint64_t offset, std::uint64_t length, TimePoint deadline, SendCallback on_sent);

  // LandingChoice::sender: writes `length` bytes at `offset` of `region` to
  // `remote_address` of the segment `endpoint` names. An error returned here means
  // neither callback will run. Backends whose receiver chooses refuse it.
  virtual Status write(EndpointHandle endpoint, RegionHandle region, std::uint64_t offset, std::uint64_t length,
                       std::uint64_t remote_address, TimePoint deadline, WriteCallback on_done,
                       OverdueCallback on_overdue = {});
  // LandingChoice::sender: the name peers connect() to in order to write into this
  // side's regions; empty for a backend whose receiver chooses.
  virtual std::string segment_name() const;

  // The default: the receiver chooses, two-sided, host memory only.
  virtual Capabilities capabilities() const noexcept;
  virtual TransportStats stats() const = 0;
  // The backend's name: what the hello reply's data plane says, for peers to compare.
  virtual std::string_view name() const noexcept = 0;
};

// A data plane owned by a component whose counters other threads read (a metrics
// collector, a counters() call): release() lets it go under a lock that stats()
// takes, so a reader never sees it half gone. Everything else is the owner's, on its
// own threads, as with a plain unique_ptr.
class OwnedTransport {
 public:
  OwnedTransport& operator=(std::unique_ptr<Transport> transport) {
    std::lock_guard lock(mutex_);
    transport_ = std::move(transport);
    return *this;
  }
  Transport* operator->() const noexcept { return transport_.get(); }
  explicit operator bool() const noexcept { return transport_ != nullptr; }

  // Its counters; none once released. Any thread.
  std::optional<TransportStats> stats() const {
    std::lock_guard lock(mutex_);
    if (!transport_) return std::nullopt;
    return transport_->stats();
  }
  // Destroys it (its threads stop) outside the lock, once readers can no longer reach it.
  void release() {
    std::unique_ptr<Transport> gone;
    {
      std::lock_guard lock(mutex_);
      gone = std::move(transport_);
    }
  }

 private:
  mutable std::mutex mutex_;
  std::unique_ptr<Transport> transport_;
};

}  // namespace ecx::transport
