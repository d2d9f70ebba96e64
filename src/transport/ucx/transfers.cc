#include "transport/ucx/transfers.h"

#include <exception>

#include <fmt/format.h>

namespace ecx::transport::ucx {

// --- sending -------------------------------------------------------------------

void Transfers::start_send(std::unique_ptr<SendOp> op) {
  op->id = ids_.next();
  op->owner = this;
  Region* region = regions_.find(op->region);
  if (region == nullptr) {
    const Status* failed = regions_.failed_registration(op->region);
    const Status why = failed == nullptr
                           ? not_found(fmt::format("send from unregistered region {}", op->region))
                           : Status(failed->code(), fmt::format("send from region {}, whose registration failed: {}",
                                                                op->region, failed->message()));
    finish_unstarted(*op, why);
    return;
  }
  if (op->offset > region->size || op->length > region->size - op->offset) {
    finish_unstarted(*op, invalid_argument(fmt::format("send of {} bytes at offset {} overruns region of {} bytes",
                                                       op->length, op->offset, region->size)));
    return;
  }
  op->source = region->base + op->offset;
  Endpoint* endpoint = endpoints_.find(op->endpoint);
  if (endpoint == nullptr || endpoint->failed) {
    finish_unstarted(*op, unavailable("send on a closed or failed endpoint; connect again"));
    return;
  }
  if (options_.clock->now() >= op->deadline) {
    finish_unstarted(*op, timeout_error("send deadline passed before it started"));
    return;
  }
  region->in_flight += 1;
  endpoint_entry_nodes_.insert(endpoint->sends, op->id);
  deadline_nodes_.insert(deadlines_, std::pair{op->deadline, op->id});
  stats_.sends_started.fetch_add(1);
  SendOp& ref = *op;
  const std::uint64_t id = op->id;
  send_nodes_.insert(sends_, id, std::move(op));
  protocol_->post(ref, *endpoint, *region);
}

void Transfers::move_deadline(SendOp& op, TimePoint deadline) {
  deadline_nodes_.erase_key(deadlines_, std::pair{op.deadline, op.id});
  op.deadline = deadline;
  deadline_nodes_.insert(deadlines_, std::pair{deadline, op.id});
}

void Transfers::finish_unstarted(SendOp& op, const Status& status) {
  stats_.sends_failed.fetch_add(1);
  invoke_sent(op.on_sent, status);
}

void Transfers::finish_send(std::uint64_t op_id, const Status& status) {
  auto found = sends_.find(op_id);
  if (found == sends_.end()) return;
  std::unique_ptr<SendOp> op = std::move(found->second);
  send_nodes_.erase(sends_, found);
  deadline_nodes_.erase_key(deadlines_, std::pair{op->deadline, op->id});
  if (Region* region = regions_.find(op->region)) region->in_flight -= 1;
  if (Endpoint* endpoint = endpoints_.find(op->endpoint)) endpoint_entry_nodes_.erase_key(endpoint->sends, op->id);
  if (op->rkey != nullptr) ucp_rkey_destroy(op->rkey);
  if (op->abandoned) {  // its owner already heard
    --abandoned_sends_;
    return;
  }
  if (status.is_ok()) {
    stats_.sends_ok.fetch_add(1);
    stats_.bytes_sent.fetch_add(op->length);
    endpoints_.describe_once(op->endpoint);
  } else {
    stats_.sends_failed.fetch_add(1);
  }
  invoke_sent(op->on_sent, status);
}

SendOp* Transfers::find_send(std::uint64_t op_id) {
  auto found = sends_.find(op_id);
  return found == sends_.end() ? nullptr : found->second.get();
}

void Transfers::on_request_done(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<SendOp*>(user_data);
  Transfers* self = op->owner;
  ucp_request_free(request);
  op->request = nullptr;
  if (status == UCS_OK) {
    self->protocol_->request_done(*op);
  } else {
    self->finish_send(op->id, op->expired ? timeout_error("send did not complete before its deadline")
                                          : ucx_error("send failed", status));
  }
}

// Without peer error handling UCX can neither cancel the request nor force-close
// its endpoint (the close would wait for it), so the owner hears `timeout` now and
// the op lingers until UCX lets go of it. Its region stays in use meanwhile (a stuck
// peer may still read the source once it resumes).
void Transfers::abandon_send(SendOp& op, const Status& status) {
  if (op.request == nullptr) {
    finish_send(op.id, status);
    return;
  }
  if (op.abandoned) return;
  op.abandoned = true;
  ++abandoned_sends_;
  if (Endpoint* endpoint = endpoints_.find(op.endpoint)) endpoint->sends.erase(op.id);
  stats_.sends_failed.fetch_add(1);
  invoke_sent(op.on_sent, status);
}

void Transfers::invoke_sent(SendCallback& on_sent, const Status& status) {
  try {
    on_sent(status);
  } catch (const std::exception& e) {
    logger()->error("on_sent threw: {}", e.what());
  }
}

// --- receiving -----------------------------------------------------------------

Result<Landing> Transfers::resolve_landing(std::span<const std::byte> header, std::uint64_t length) {
  if (!options_.resolver) return unavailable("this transport does not receive (no landing resolver)");
  Result<Landing> landing = unavailable("landing resolver failed");
  try {
    landing = options_.resolver(header, length);
  } catch (const std::exception& e) {
    logger()->error("landing resolver threw: {}", e.what());
    return internal_error(fmt::format("landing resolver threw: {}", e.what()));
  }
  return landing;
}

std::unique_ptr<PendingLanding> Transfers::new_landing(std::span<const std::byte> header, const Landing& landing) {
  auto pending = std::make_unique<PendingLanding>();
  pending->owner = this;
  pending->id = ids_.next();
  pending->header.assign(header.begin(), header.end());
  pending->landing = landing;
  return pending;
}

void Transfers::track_landing(std::unique_ptr<PendingLanding> pending, std::uint64_t endpoint_id, bool watched) {
  if (endpoint_id != 0) {
    pending->endpoint = endpoint_id;
    endpoint_entry_nodes_.insert(endpoints_.find(endpoint_id)->landings, pending->id);
  }
  if (watched && options_.landing_timeout > Duration::zero()) {
    pending->deadline = options_.clock->now() + options_.landing_timeout;
    deadline_nodes_.insert(landing_deadlines_, std::pair{*pending->deadline, pending->id});
  }
  const std::uint64_t id = pending->id;
  landing_nodes_.insert(landings_, id, std::move(pending));
}

void Transfers::finish_landing(std::uint64_t id, const Status& status) {
  auto found = landings_.find(id);
  if (found == landings_.end()) return;
  std::unique_ptr<PendingLanding> pending = std::move(found->second);
  landing_nodes_.erase(landings_, found);
  if (pending->deadline) deadline_nodes_.erase_key(landing_deadlines_, std::pair{*pending->deadline, id});
  if (pending->endpoint != 0) {
    if (Endpoint* endpoint = endpoints_.find(pending->endpoint))
      endpoint_entry_nodes_.erase_key(endpoint->landings, id);
  }
  report_landing(*pending, status);
}

void Transfers::report_landing(const PendingLanding& pending, const Status& status, bool counted) {
  if (counted) {
    if (status.is_ok()) {
      stats_.landings_ok.fetch_add(1);
      stats_.bytes_landed.fetch_add(pending.landing.length);
    } else {
      stats_.landings_failed.fetch_add(1);
    }
  }
  if (!options_.on_landing) return;
  try {
    options_.on_landing(pending.header, pending.landing, status);
  } catch (const std::exception& e) {
    logger()->error("on_landing threw: {}", e.what());
  }
}

// Reports a landing failed while UCX may still hold its receive request: the
// bookkeeping stays until UCX lets go of the request (or the worker is destroyed).
void Transfers::abandon_landing(std::uint64_t id, const Status& status) {
  auto found = landings_.find(id);
  if (found == landings_.end()) return;
  std::unique_ptr<PendingLanding> pending = std::move(found->second);
  landings_.erase(found);
  if (pending->deadline) landing_deadlines_.erase({*pending->deadline, id});
  report_landing(*pending, status);
  if (pending->request != nullptr) abandoned_landings_.emplace(id, std::move(pending));
}

bool Transfers::release_abandoned_landing(std::uint64_t id) { return abandoned_landings_.erase(id) != 0; }

// --- deadlines and shutdown ------------------------------------------------------

void Transfers::expire_deadlines() {
  const auto now = options_.clock->now();
  std::vector<std::uint64_t> expired_endpoints;
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    const auto op_id = deadlines_.begin()->second;
    deadlines_.erase(deadlines_.begin());
    auto found = sends_.find(op_id);
    if (found == sends_.end()) continue;
    if (found->second->request == nullptr && protocol_->retry_expired(*found->second)) continue;
    if (auto failure = found->second->connection_failure) {
      finish_send(op_id, *failure);
      continue;
    }
    found->second->expired = true;
    stats_.deadline_expiries.fetch_add(1);
    // A shared send has no UCX request to cancel: it ends here, its endpoint stays.
    if (options_.peer_error_handling && !found->second->shared) {
      expired_endpoints.push_back(found->second->endpoint);
    } else {
      abandon_send(*found->second);
    }
  }
  // UCX 1.13 cannot cancel one send: closing the endpoint fails every send on it,
  // each callback then reporting `timeout` for the expired ones.
  for (const auto id : expired_endpoints) {
    endpoints_.fail(id, timeout_error("a send on this endpoint passed its deadline"));
  }
  // Landing watchdog: a payload still arriving at its deadline (its sender stopped
  // or vanished without UCX noticing) can only be cut off by closing the
  // connection it arrives on; the landing fails once that close has completed.
  std::vector<std::uint64_t> stalled_peers;
  while (!landing_deadlines_.empty() && landing_deadlines_.begin()->first <= now) {
    const auto landing_id = landing_deadlines_.begin()->second;
    landing_deadlines_.erase(landing_deadlines_.begin());
    auto found = landings_.find(landing_id);
    if (found == landings_.end()) continue;
    found->second->deadline.reset();
    stats_.deadline_expiries.fetch_add(1);
    if (found->second->endpoint != 0) {
      stalled_peers.push_back(found->second->endpoint);
    } else {
      logger()->warn(
          "a payload of {} bytes is still landing past its deadline; its sender's connection is not "
          "ours to close (worker-address peer), so the landing stays open",
          found->second->landing.length);
    }
  }
  for (const auto id : stalled_peers) {
    endpoints_.fail(id, timeout_error("a payload from this peer did not finish landing before its deadline"));
  }
}

std::optional<TimePoint> Transfers::next_send_deadline() const {
  if (deadlines_.empty()) return std::nullopt;
  return deadlines_.begin()->first;
}

void Transfers::abandon_all(const Status& status) {
  std::vector<std::uint64_t> leftover;
  for (const auto& [id, op] : sends_) leftover.push_back(id);
  // A send whose endpoint did not finish closing (a stopped peer never answers the
  // graceful close) may still be completed by UCX, even inside ucp_worker_destroy:
  // its owner hears now, the op stays until UCX lets go of it.
  for (const auto id : leftover) abandon_send(*sends_.at(id), status);
  leftover.clear();
  for (const auto& [id, landing] : landings_) leftover.push_back(id);
  for (const auto id : leftover) abandon_landing(id, status);
}

// --- EndpointObserver ----------------------------------------------------------

void Transfers::on_endpoint_failed(Endpoint& endpoint, const Status& status) {
  // Sends with no UCX request outstanding (put mode, waiting for a grant). A shared one
  // waits for its copy-by time and fails then, with this status: a failed connection
  // does not prove its peer stopped copying (this side closed it on a deadline, or the
  // peer dropped it while a resolver still held the copy), and its source is not the
  // sender's before.
  std::vector<std::uint64_t> unstarted;
  for (const auto op_id : endpoint.sends) {
    auto op = sends_.find(op_id);
    if (op == sends_.end() || op->second->request != nullptr) continue;
    if (op->second->shared) {
      op->second->connection_failure = status;
    } else {
      unstarted.push_back(op_id);
    }
  }
  for (const auto op_id : unstarted) finish_send(op_id, status);
  // Landings granted to this peer (put mode) will never be written now.
  std::vector<std::uint64_t> granted;
  for (const auto landing_id : endpoint.landings) {
    if (auto pending = landings_.find(landing_id); pending != landings_.end() && pending->second->request == nullptr)
      granted.push_back(landing_id);
  }
  for (const auto landing_id : granted) finish_landing(landing_id, status);
}

void Transfers::on_endpoint_closed(const std::set<std::uint64_t>& landings, const Status& status) {
  for (const auto landing_id : landings) abandon_landing(landing_id, status);
}

}  // namespace ecx::transport::ucx
