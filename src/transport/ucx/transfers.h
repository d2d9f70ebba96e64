#pragma once
// The core both protocols share: the sends and landings in flight, how each one
// finishes (exactly one on_sent per accepted send, one on_landing per resolved
// landing), the landing resolver, and the watchdog that fails what passed its
// deadline. How a send's bytes travel is its SendProtocol's business (am or put).
// Progress thread only.

#include <ucp/api/ucp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/node_stash.h"
#include "ecx/core/status.h"
#include "ecx/transport/transport.h"
#include "ecx/transport/ucx_transport.h"
#include "transport/ucx/common.h"
#include "transport/ucx/endpoints.h"
#include "transport/ucx/regions.h"

namespace ecx::transport::ucx {

class Transfers;

struct SendOp {
  Transfers* owner = nullptr;
  std::uint64_t id = 0;
  std::uint64_t endpoint = 0;
  std::uint64_t region = 0;
  std::uint64_t offset = 0;
  const std::byte* source = nullptr;  // region base + offset, set on the progress thread
  std::uint64_t length = 0;
  TimePoint deadline{};
  std::vector<std::byte> header;
  SendCallback on_sent;
  void* request = nullptr;     // the UCX request whose callback will finish this op
  ucp_rkey_h rkey = nullptr;   // put mode
  std::uint64_t grant_id = 0;  // put mode
  bool expired = false;
  // send_confirmed(): the op finishes when both its UCX request completed and the
  // receiver's verdict came, in either order; `verdict` holds one that came first.
  bool confirmed = false;
  std::optional<Status> verdict;
  // Sent as a place in a shared region (shared_sources.h): no UCX request, it finishes
  // with the receiver's verdict (or falls back to a plain send when the peer refuses).
  bool shared = false;
  TimePoint deadline_before_shared{};  // restored when it falls back to bytes
  // A shared send whose connection failed: reported with this at its copy-by time.
  std::optional<Status> connection_failure;
  // Reported to its owner (deadline) while UCX still holds the request; see abandon_send().
  bool abandoned = false;
};

struct PendingLanding {
  Transfers* owner = nullptr;
  std::uint64_t id = 0;
  std::vector<std::byte> header;
  Landing landing;
  std::uint64_t endpoint = 0;  // the writing peer (0: unknown, a worker-address peer)
  void* request = nullptr;     // am mode: the UCX receive still fetching into the landing
  std::optional<TimePoint> deadline;
  // am mode: runs once the bytes are in and the landing was reported, with its result
  // (a confirmed send's verdict; not run for a landing cut off with its peer).
  std::function<void(const Status&)> after_landing;
};

// How a started send's bytes reach the peer.
class SendProtocol {
 public:
  virtual ~SendProtocol() = default;
  // The op is tracked (deadline, region and endpoint use); send its bytes.
  virtual void post(SendOp& op, Endpoint& endpoint, Region& region) = 0;
  // A UCX request of `op` finished well: the whole send (am) or its flush (put).
  virtual void request_done(SendOp& op) = 0;
  // `op` (no UCX request held) reached its deadline: true when the protocol sent it
  // again another way (with a deadline of its own), false to let it fail.
  virtual bool retry_expired(SendOp& /*op*/) { return false; }
};

class Transfers final : public EndpointObserver {
 public:
  Transfers(const UcxOptions& options, AtomicStats& stats, IdSource& ids, Regions& regions, Endpoints& endpoints)
      : options_(options), stats_(stats), ids_(ids), regions_(regions), endpoints_(endpoints) {}

  void set_protocol(SendProtocol& protocol) noexcept { protocol_ = &protocol; }

  // --- sending -------------------------------------------------------------------

  // Checks the op against its region, endpoint and deadline, tracks it and hands it to the protocol.
  void start_send(std::unique_ptr<SendOp> op);
  // A send that never started (refused, or the transport shut down before it ran).
  void finish_unstarted(SendOp& op, const Status& status);
  void finish_send(std::uint64_t op_id, const Status& status);
  SendOp* find_send(std::uint64_t op_id);
  // Moves a tracked op's deadline.
  void move_deadline(SendOp& op, TimePoint deadline);
  // The UCX completion callback of an op's request (user_data: the SendOp).
  static void on_request_done(void* request, ucs_status_t status, void* user_data);

  // --- receiving -----------------------------------------------------------------

  // The resolver's verdict (the caller checks its length); never throws.
  Result<Landing> resolve_landing(std::span<const std::byte> header, std::uint64_t length);
  // A resolved landing, not yet tracked (it gets its id here).
  std::unique_ptr<PendingLanding> new_landing(std::span<const std::byte> header, const Landing& landing);
  // Tracks a landing that is being written: on `endpoint_id`'s landings (0: a
  // worker-address peer), watched by the landing watchdog when `watched`.
  void track_landing(std::unique_ptr<PendingLanding> pending, std::uint64_t endpoint_id, bool watched);
  void finish_landing(std::uint64_t id, const Status& status);
  void report_landing(const PendingLanding& pending, const Status& status, bool counted = true);
  // A receive UCX let go of belonged to a landing already reported failed: true, and it is forgotten.
  bool release_abandoned_landing(std::uint64_t id);

  // --- deadlines and shutdown --------------------------------------------------------

  // The watchdog: sends past their deadline, landings past the landing timeout.
  void expire_deadlines();
  std::optional<TimePoint> next_send_deadline() const;
  bool busy() const noexcept { return !sends_.empty() || !landings_.empty(); }
  // Shutdown waits for these: sends whose owner has not heard yet, landings.
  bool unfinished() const noexcept { return sends_.size() > abandoned_sends_ || !landings_.empty(); }
  // Shutdown: every owner hears `status` now; what UCX still holds stays until it lets go.
  void abandon_all(const Status& status);

  // --- EndpointObserver ----------------------------------------------------------

  void on_endpoint_failed(Endpoint& endpoint, const Status& status) override;
  void on_endpoint_closed(const std::set<std::uint64_t>& landings, const Status& status) override;

 private:
  void abandon_send(SendOp& op, const Status& status = timeout_error(
                                    "send did not complete before its deadline (the peer is not answering)"));
  void abandon_landing(std::uint64_t id, const Status& status);
  static void invoke_sent(SendCallback& on_sent, const Status& status);

  const UcxOptions& options_;
  AtomicStats& stats_;
  IdSource& ids_;
  Regions& regions_;
  Endpoints& endpoints_;
  SendProtocol* protocol_ = nullptr;
  using DeadlineIndex = std::set<std::pair<TimePoint, std::uint64_t>>;
  std::unordered_map<std::uint64_t, std::unique_ptr<SendOp>> sends_;
  DeadlineIndex deadlines_;
  std::unordered_map<std::uint64_t, std::unique_ptr<PendingLanding>> landings_;
  DeadlineIndex landing_deadlines_;
  // These indexes gain and lose an entry per send and per landing, on the progress
  // thread: their nodes are reused rather than allocated each time.
  NodeStash<decltype(sends_)> send_nodes_;
  NodeStash<decltype(landings_)> landing_nodes_;
  NodeStash<DeadlineIndex> deadline_nodes_;                  // both deadline indexes
  NodeStash<std::set<std::uint64_t>> endpoint_entry_nodes_;  // the endpoints' send and landing sets
  // Reported failed (their peer was cut off) while UCX still holds their receive.
  std::unordered_map<std::uint64_t, std::unique_ptr<PendingLanding>> abandoned_landings_;
  std::uint64_t abandoned_sends_ = 0;
};

}  // namespace ecx::transport::ucx
