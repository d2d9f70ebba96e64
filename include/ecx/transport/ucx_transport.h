#pragma once
// The UCX backend of Transport (Debian's libucx 1.13).
//
// Mode `am` (default): one active message per payload carrying the header.
// Payloads below `rndv_threshold_bytes` go eagerly (the bytes arrive with the
// header and are copied into the landing); larger ones use rendezvous, so the
// receiver's handler resolves the landing and UCX fetches the payload straight into
// it (zero copy where the transport allows). Works on tcp, shared memory and verbs.
//
// Mode `put`: one-sided put + flush into a landing the receiver granted:
// request (header) -> grant (address, rkey) -> put, flush -> done -> on_landing.
// Meant for RC verbs, where a put is one RDMA write; on TCP UCX 1.13 emulates put
// slowly (tens to hundreds of MB/s), so keep `am` there.
//
// UCX reads its usual environment (UCX_TLS, UCX_NET_DEVICES, UCX_RNDV_THRESH, ...);
// `tls` below, when set, overrides UCX_TLS for this transport only.
// Peer failures are detected with UCP_ERR_HANDLING_MODE_PEER. A send still pending
// at its deadline fails with `timeout`: UCX 1.13 cannot cancel a single send, so
// its endpoint is closed (its other pending sends fail too) and the next connect()
// to that peer makes a fresh one.

#include <memory>
#include <string>

#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/transport/transport.h"

namespace ecx::transport {

enum class UcxMode : std::uint8_t { am, put };

// What listen() advertises.
enum class UcxAddressKind : std::uint8_t {
  // "ucx:<hex>": the worker's packed address. Peers connect with it directly and UCX
  // picks the best transport, including shared memory when both run on one host
  // (UCX 1.13 never uses shared memory for a socket-address connection).
  worker,
  // "host:port": a socket-address listener (UCX connection manager). Put mode uses
  // it, because the receiver needs an endpoint per sender to fail the landings it
  // granted when that sender dies; so do am-mode receivers that want the same (and
  // the landing watchdog, see landing_timeout).
  socket,
};

struct UcxOptions {
  UcxMode mode = UcxMode::am;
  UcxAddressKind address_kind = UcxAddressKind::worker;  // put mode always advertises `socket`
  // UCP_ERR_HANDLING_MODE_PEER: a dead peer fails its endpoint's operations promptly.
  // UCX 1.13's shared-memory transports (posix, sysv, cma) cannot run in that mode, so
  // with it a same-host peer is reached over tcp loopback. Turning it off lets UCX use
  // shared memory; a dead peer is then noticed only through send deadlines.
  bool peer_error_handling = true;
  std::string tls;  // "" = UCX_TLS from the environment (or UCX's default)
  // Payloads of at least this many bytes are sent with rendezvous (0 = UCX decides).
  // Below it a payload goes eagerly: one message instead of a rendezvous handshake
  // (about 200 us less per 64 KiB item on loopback tcp), at the price of one copy on
  // landing, which costs throughput from 128 KiB on (measured, docs/configuration.md).
  std::uint64_t rndv_threshold_bytes = 128ULL * 1024;
  // UCX's TCP transport moves rendezvous data in segments of this size (UCX's own
  // default is 64 KiB: one send and one receive call per 64 KiB). 0 = UCX's default.
  // UCX_TCP_RX_SEG_SIZE / UCX_TCP_TX_SEG_SIZE in the environment take precedence.
  std::uint64_t tcp_seg_size_bytes = 256ULL * 1024;
  // Mode am: a payload of at least rndv_threshold_bytes sent from a shared region
  // (register_shared_region) goes to a receiver on this host as its place in the
  // region, and the receiver copies it out itself: one memcpy instead of a socket or
  // process_vm_readv. Both sides need it on and a transport list that allows shared
  // memory (`tls`, else UCX_TLS: empty, all, or naming sm/posix/sysv); a receiver that
  // cannot map the sender's memory answers so, and the sender sends that peer bytes.
  bool shared_sources = true;
  std::shared_ptr<const Clock> clock;  // null = SteadyClock::shared()

  LandingResolver resolver;             // required to receive
  LandingCallback on_landing;           // required to receive
  PeerFailureCallback on_peer_failure;  // optional

  // Receiving side: a rendezvous payload still landing this long after it started
  // fails (on_landing reports `timeout`), and so does everything else its sender was
  // sending here: the only way to make sure no late fragment reaches the landing is
  // to close the connection it arrives on. Needs a connection the receiver owns, i.e.
  // address_kind `socket` with peer error handling; a landing from a worker-address
  // peer is left open (and logged). Zero = no watchdog.
  Duration landing_timeout = Duration::zero();

  std::size_t command_queue_capacity = 4096;  // sends and calls waiting for the progress thread
  // How long blocking calls (register, listen, connect) wait for the progress thread.
  Duration call_timeout = std::chrono::seconds(10);
  // Longest sleep of an idle progress thread; bounds how late a deadline is noticed.
  Duration max_idle_sleep = std::chrono::milliseconds(20);
  // While operations are in flight the progress thread polls this long before it
  // sleeps on the event fd: waking from epoll per fragment would cost more than it saves.
  Duration spin_before_sleep = std::chrono::microseconds(50);
};

std::string_view ucx_mode_name(UcxMode mode) noexcept;
Result<UcxMode> parse_ucx_mode(std::string_view name);

// What an ECX receiver advertises. With peer error handling every sender becomes an
// endpoint of its own (through UCX's connection manager): a sender's death fails what
// it was still sending, and the landing watchdog can cut off exactly that sender.
// That also decides the lanes: UCX 1.13 gives a worker-address endpoint with peer
// error handling no rma_bw lane over tcp (it would need memory invalidation), so its
// rendezvous would move as active-message fragments, 30-40% slower into memory not in
// the CPU cache. Without peer errors a worker address lets UCX use shared memory.
constexpr UcxAddressKind receiver_address_kind(bool peer_error_handling) noexcept {
  return peer_error_handling ? UcxAddressKind::socket : UcxAddressKind::worker;
}

// The options every ECX role takes from its configuration (mode, peer-failure
// handling, TCP segment size, rendezvous threshold, shared sources) and its clock; the caller adds
// what is its own (the receiving side's resolver and landing callbacks).
Result<UcxOptions> ucx_options_from_config(const Config& config, std::shared_ptr<const Clock> clock);

// Creates the UCX context and worker and starts the progress thread.
Result<std::unique_ptr<Transport>> create_ucx_transport(UcxOptions options);

// "1.13.1"-style version of the UCX library loaded at run time.
std::string ucx_library_version();

}  // namespace ecx::transport
