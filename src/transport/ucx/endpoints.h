#pragma once
// Connections: the endpoints this transport made (connect(), cached by peer address)
// and the ones its listener accepted, their failure (peer error, or closed on
// purpose) and their close. The sends and landings travelling on an endpoint are
// known here only by id; what becomes of them the EndpointObserver decides.
// Progress thread only.

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ecx/core/status.h"
#include "ecx/transport/transport.h"
#include "ecx/transport/ucx_transport.h"
#include "transport/ucx/common.h"
#include "transport/ucx/worker.h"

namespace ecx::transport::ucx {

class Endpoints;

struct Endpoint {
  Endpoints* owner = nullptr;
  std::uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  std::string peer;
  bool outgoing = false;
  bool failed = false;
  bool described = false;
  // The peer said it cannot map this side's shared sources: send it bytes instead.
  bool shared_refused = false;
  // The peer answered a shared payload (a verdict or a refusal): it knows message 24.
  bool shared_answered = false;
  std::set<std::uint64_t> sends;  // op ids using this endpoint
  // Receiving side: landings this peer is writing (put mode: granted; am mode: a
  // rendezvous payload being fetched from it).
  std::set<std::uint64_t> landings;
  Status failure;  // why it failed; reported to its landings once its close completed
};

// The unit that tracks the operations on endpoints (implemented above this one).
class EndpointObserver {
 public:
  virtual ~EndpointObserver() = default;
  // `endpoint` has just failed: finish its work that UCX holds no request for
  // (sends waiting for a grant, landings granted but not yet written).
  virtual void on_endpoint_failed(Endpoint& endpoint, const Status& status) = 0;
  // An endpoint's close completed: UCX delivers nothing more into these landings.
  virtual void on_endpoint_closed(const std::set<std::uint64_t>& landings, const Status& status) = 0;
};

class Endpoints {
 public:
  Endpoints(UcxWorker& worker, const UcxOptions& options, IdSource& ids, AtomicStats& stats)
      : worker_(worker), options_(options), ids_(ids), stats_(stats) {}

  void set_observer(EndpointObserver& observer) noexcept { observer_ = &observer; }

  Result<std::string> listen(const std::string& host, int port);
  Result<EndpointHandle> connect(const std::string& address);
  // Any thread: the endpoint connect() made to `address`, while it has not failed.
  // Spares a sender the round trip to the progress thread before every send.
  std::optional<EndpointHandle> connected(const std::string& address) const;

  Endpoint* find(std::uint64_t id);
  // The id of the endpoint behind `ep`, when it is one of ours and has not failed; 0 otherwise.
  std::uint64_t id_of(ucp_ep_h ep) const;

  // Marks an endpoint failed, drops it from the cache, force-closes it (UCX then
  // completes its requests with errors) and lets the observer fail what UCX does not
  // know about. `graceful`: close after UCX flushed the endpoint and told the peer
  // (shutdown); otherwise at once (a failed peer, a send past its deadline).
  void fail(std::uint64_t id, const Status& status, bool peer_failed = true, bool graceful = false);
  // Shutdown: closes every endpoint that has not failed.
  void close_all(const Status& status, bool graceful);

  // Accepts connection requests, fails endpoints UCX reported, finishes completed
  // closes (work UCX callbacks queue rather than do); true if there was any.
  bool handle_deferred();
  bool closing() const noexcept { return !closing_.empty(); }
  std::size_t closing_count() const noexcept { return closing_.size(); }

  // Which transports and lanes UCX picked, once per endpoint after wire-up (debug level).
  void describe_once(std::uint64_t id);

  // Shutdown: connection requests are rejected from now on (the listener stays: see
  // destroy_listener).
  void refuse_connections();
  // Right before the worker goes, with nothing in between that lets time pass. UCX
  // 1.13's tcp connection manager keeps, per connection it accepted but whose request
  // has not arrived yet, a pointer to the listener that it follows when the request
  // does arrive: a listener destroyed before the worker leaves that pointer dangling
  // (a segfault in ucp_cm_server_conn_request_cb). Closing the worker frees those
  // connections, so the gap must be as short as possible.
  void destroy_listener();
  // The worker is left to the process's exit (a peer that never answered): so is the
  // listener, whose connections then wait unanswered rather than crash the process.
  void leave_listener_to_exit();
  void free_closing();

 private:
  static void on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void on_connection_request(ucp_conn_request_h request, void* arg);
  void set_error_handling(ucp_ep_params_t& params, Endpoint& endpoint);
  void accept(ucp_conn_request_h request);
  void reject_waiting_connections();
  // An endpoint's close completed.
  void closed(std::uint64_t endpoint_id);

  UcxWorker& worker_;
  const UcxOptions& options_;
  IdSource& ids_;
  AtomicStats& stats_;
  EndpointObserver* observer_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  std::string listen_address_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Endpoint>> endpoints_;
  // Written on the progress thread, read by connected() on any thread.
  mutable std::mutex peers_mutex_;
  std::unordered_map<std::string, std::uint64_t> endpoints_by_peer_;  // guarded by peers_mutex_
  std::unordered_map<ucp_ep_h, std::uint64_t> endpoint_by_ucp_;
  std::deque<ucp_conn_request_h> conn_requests_;
  bool refusing_connections_ = false;  // shutting down
  std::deque<std::pair<std::uint64_t, Status>> failed_endpoints_;
  std::vector<std::pair<std::uint64_t, void*>> closing_;  // endpoint id, close request
};

}  // namespace ecx::transport::ucx
