#pragma once
// The Mooncake Transfer Engine backend of the data plane.
//
// Mooncake writes one-sidedly into memory a peer registered, and a write cannot be
// cancelled once submitted. So this backend does not resolve landings on the
// receiver (send() is refused); the sender names the destination itself:
//   receiver: register_region(pool) once, listen() -> segment name; the consumer
//             publishes segment name + pool base address in its topology reply and
//             the slot offset in every reserve reply;
//   sender:   connect(segment name) -> endpoint;
//             write(endpoint, region, offset, length, base + slot offset, deadline,
//                   on_done, on_overdue)
//             and, once on_done reports ok, tells the consumer over the control
//             plane (`complete`, carrying the reservation id).
//
// on_done runs exactly once per accepted write, when Mooncake reports the write
// finished (completed or failed): only then may the source be reused, and only then
// is the remote slot certainly no longer written. A write still unfinished at its
// deadline calls on_overdue once (the caller fails its push) and keeps running;
// on_done follows whenever Mooncake settles it.
//
// The library is loaded at run time (dlopen), so ECX builds and ships without it:
// `library_path`, else $ECX_MOONCAKE_LIB, else the loader's search path for
// libtransfer_engine.so. Metadata goes through Mooncake's peer-to-peer handshake
// (P2PHANDSHAKE): no metadata service is needed. Mooncake's listeners bind every
// interface; `host` is only the address it advertises.
//
// Threading: one progress thread polls the writes in flight and runs every
// callback, one at a time; callbacks must not block. Public methods are thread-safe.

#include <memory>
#include <string>
#include <string_view>

#include "ecx/core/clock.h"
#include "ecx/transport/transport.h"

namespace ecx::transport {

inline constexpr std::string_view kMooncakeLibraryEnv = "ECX_MOONCAKE_LIB";
inline constexpr std::string_view kMooncakeDefaultLibrary = "libtransfer_engine.so";

struct MooncakeOptions {
  std::string library_path;            // "" = $ECX_MOONCAKE_LIB, then libtransfer_engine.so from the search path
  std::string protocol = "tcp";        // tcp | rdma
  std::string host = "127.0.0.1";      // the address peers reach this engine at
  std::shared_ptr<const Clock> clock;  // null = SteadyClock::shared()

  std::size_t max_writes_in_flight = 4096;  // write() refuses with resource_exhausted beyond this
  // While writes are in flight the progress thread polls their status this often.
  Duration poll_interval = std::chrono::microseconds(20);
  // Longest sleep of an idle progress thread.
  Duration max_idle_sleep = std::chrono::milliseconds(20);
  // How long destruction waits for writes in flight to settle.
  Duration call_timeout = std::chrono::seconds(10);
};

// Runs once when the write settled: ok = every byte is in the remote memory.
class MooncakeTransport : public Transport {
 public:
  // One-sided: the sender writes (write()) into a region whose segment_name() and
  // address the receiver published.
  Capabilities capabilities() const noexcept override;

  // Refused: Mooncake cannot let the receiver choose where a payload lands.
  Status send(EndpointHandle endpoint, std::span<const std::byte> header, RegionHandle region, std::uint64_t offset,
              std::uint64_t length, TimePoint deadline, SendCallback on_sent) override;
};

// Loads the library (once per path per process), creates the engine and installs
// the protocol. Errors name the library path, the missing symbol, or the step that
// failed, and say how to point ECX at the library.
Result<std::unique_ptr<MooncakeTransport>> create_mooncake_transport(MooncakeOptions options);

// The library path create_mooncake_transport would load for `configured`.
std::string mooncake_library_path(std::string_view configured);

// Whether the library at mooncake_library_path(configured) loads and has every
// symbol ECX calls; the error says what is missing. Loads it (and keeps it loaded).
Status mooncake_library_available(std::string_view configured = {});

// A Mooncake protocol ECX can install: tcp or rdma.
struct MooncakeProtocol {
  std::string name;                // what the engine's install_transport takes
  bool discover_topology = false;  // RDMA: find the devices before installing
};
Result<MooncakeProtocol> parse_mooncake_protocol(std::string_view name);

}  // namespace ecx::transport
