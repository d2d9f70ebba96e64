#pragma once
// What every unit of the UCX backend shares: its logger, the translation of UCX
// statuses into ECX ones, the counters behind TransportStats and the one source of
// ids. The bottom of the backend: it includes none of its siblings.
//
// Units, each including only those before it:
//   common -> worker -> shared_sources -> regions, endpoints -> transfers -> am_protocol,
//   put_protocol
//   -> ucx_transport.cc (the UcxTransport facade that wires them).

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "core/logging.h"
#include "ecx/core/status.h"
#include "ecx/transport/ucx_transport.h"

namespace ecx::transport::ucx {

std::shared_ptr<spdlog::logger> logger();

// Worker addresses are hundreds of hex digits; logs show their start.
std::string printable(std::string_view peer);

Status ucx_error(std::string_view what, ucs_status_t status);

// "ucx-am" / "ucx-put": Transport::name() and the listener's log line.
std::string_view transport_name(UcxMode mode) noexcept;

struct AtomicStats {
  std::atomic<std::uint64_t> sends_started{0}, sends_ok{0}, sends_failed{0}, bytes_sent{0};
  std::atomic<std::uint64_t> landings_ok{0}, landings_failed{0}, landings_rejected{0}, bytes_landed{0};
  std::atomic<std::uint64_t> peer_failures{0}, deadline_expiries{0};
  std::atomic<std::uint64_t> shared_sends{0}, shared_landings{0}, shared_fallbacks{0}, shared_mapped_bytes{0};
};

// Regions, endpoints, sends and landings draw their ids from one counter, so no
// two things of one transport share an id (0 stays "none"). Progress thread only.
class IdSource {
 public:
  std::uint64_t next() noexcept { return next_++; }

 private:
  std::uint64_t next_ = 1;
};

}  // namespace ecx::transport::ucx
