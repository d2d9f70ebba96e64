#include "transport/ucx/endpoints.h"

#include <cstdio>
#include <cstdlib>
#include <exception>

#include <fmt/format.h>

#include "ecx/core/sanitizers.h"
#include "transport/address.h"

namespace ecx::transport::ucx {

using detail::format_host_port;

void Endpoints::on_endpoint_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* endpoint = static_cast<Endpoint*>(arg);
  endpoint->owner->failed_endpoints_.emplace_back(
      endpoint->id, ucx_error(fmt::format("peer {} failed", printable(endpoint->peer)), status));
}

void Endpoints::on_connection_request(ucp_conn_request_h request, void* arg) {
  static_cast<Endpoints*>(arg)->conn_requests_.push_back(request);
}

void Endpoints::set_error_handling(ucp_ep_params_t& params, Endpoint& endpoint) {
  params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.err_mode = options_.peer_error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (options_.peer_error_handling) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_handler.cb = &Endpoints::on_endpoint_error;
    params.err_handler.arg = &endpoint;
  }
}

Result<std::string> Endpoints::listen(const std::string& host, int port) {
  if (listener_ != nullptr) return conflict("this transport is already listening");
  auto address = detail::resolve(detail::HostPort{host, port});
  if (!address) return address.status();
  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = address->get();
  params.sockaddr.addrlen = address->length;
  params.conn_handler.cb = &Endpoints::on_connection_request;
  params.conn_handler.arg = this;
  if (auto st = ucp_listener_create(worker_.worker(), &params, &listener_); st != UCS_OK) {
    listener_ = nullptr;
    return ucx_error(fmt::format("listen on {}", format_host_port(host, port)), st);
  }
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (auto st = ucp_listener_query(listener_, &attr); st != UCS_OK) return ucx_error("ucp_listener_query", st);
  auto bound = detail::format_socket_address(reinterpret_cast<const sockaddr*>(&attr.sockaddr));
  if (!bound) return bound.status();
  // Advertise the host as given (a wildcard bind is the caller's choice) with the real port.
  auto bound_port = detail::split_host_port(*bound);
  if (!bound_port) return bound_port.status();
  listen_address_ = format_host_port(host, bound_port->port);
  if (options_.mode == UcxMode::am && options_.address_kind == UcxAddressKind::worker) {
    ucp_worker_attr_t worker_attr{};
    worker_attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    if (auto st = ucp_worker_query(worker_.worker(), &worker_attr); st != UCS_OK) {
      return ucx_error("worker address", st);
    }
    listen_address_ = detail::encode_worker_address(worker_attr.address, worker_attr.address_length);
    ucp_worker_release_address(worker_.worker(), worker_attr.address);
  }
  logger()->info("{} listening on {} ({} bytes of address)", transport_name(options_.mode),
                 format_host_port(host, bound_port->port), listen_address_.size());
  return listen_address_;
}

void Endpoints::accept(ucp_conn_request_h request) {
  auto endpoint = std::make_unique<Endpoint>();
  endpoint->owner = this;
  endpoint->id = ids_.next();
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  if (ucp_conn_request_query(request, &attr) == UCS_OK) {
    endpoint->peer = detail::format_socket_address(reinterpret_cast<const sockaddr*>(&attr.client_address))
                         .value_or(std::string("unknown"));
  }
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
  params.conn_request = request;
  set_error_handling(params, *endpoint);
  if (auto st = ucp_ep_create(worker_.worker(), &params, &endpoint->ep); st != UCS_OK) {
    logger()->warn("refused a connection from {}: {}", endpoint->peer, ucs_status_string(st));
    return;
  }
  logger()->debug("accepted a connection from {}", endpoint->peer);
  endpoint_by_ucp_.emplace(endpoint->ep, endpoint->id);
  endpoints_.emplace(endpoint->id, std::move(endpoint));
}

Result<EndpointHandle> Endpoints::connect(const std::string& address) {
  if (auto known = connected(address)) return *known;
  auto endpoint = std::make_unique<Endpoint>();
  endpoint->owner = this;
  endpoint->id = ids_.next();
  endpoint->peer = address;
  endpoint->outgoing = true;
  ucp_ep_params_t params{};
  params.field_mask = 0;
  detail::SocketAddress socket_address;
  const auto worker_address = detail::decode_worker_address(address);
  if (worker_address) {
    if (options_.mode == UcxMode::put) return invalid_argument("put mode connects to host:port addresses only");
    params.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = reinterpret_cast<const ucp_address_t*>(worker_address->data());
  } else if (address.starts_with(detail::kWorkerAddressPrefix)) {
    return invalid_argument("malformed UCX worker address");
  } else {
    auto host_port = detail::split_host_port(address);
    if (!host_port) return host_port.status();
    auto resolved = detail::resolve(*host_port);
    if (!resolved) return resolved.status();
    socket_address = *resolved;
    params.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = socket_address.get();
    params.sockaddr.addrlen = socket_address.length;
  }
  set_error_handling(params, *endpoint);
  if (auto st = ucp_ep_create(worker_.worker(), &params, &endpoint->ep); st != UCS_OK) {
    return ucx_error(fmt::format("connect to {}", printable(address)), st);
  }
  const EndpointHandle handle{endpoint->id};
  {
    std::lock_guard lock(peers_mutex_);
    endpoints_by_peer_.emplace(address, endpoint->id);
  }
  endpoint_by_ucp_.emplace(endpoint->ep, endpoint->id);
  endpoints_.emplace(endpoint->id, std::move(endpoint));
  return handle;
}

std::optional<EndpointHandle> Endpoints::connected(const std::string& address) const {
  std::lock_guard lock(peers_mutex_);
  const auto found = endpoints_by_peer_.find(address);
  if (found == endpoints_by_peer_.end()) return std::nullopt;
  return EndpointHandle{found->second};
}

Endpoint* Endpoints::find(std::uint64_t id) {
  auto found = endpoints_.find(id);
  return found == endpoints_.end() ? nullptr : found->second.get();
}

std::uint64_t Endpoints::id_of(ucp_ep_h ep) const {
  auto found = ep != nullptr ? endpoint_by_ucp_.find(ep) : endpoint_by_ucp_.end();
  return found != endpoint_by_ucp_.end() ? found->second : 0;
}

void Endpoints::fail(std::uint64_t id, const Status& status, bool peer_failed, bool graceful) {
  auto found = endpoints_.find(id);
  if (found == endpoints_.end() || found->second->failed) return;
  Endpoint& endpoint = *found->second;
  const std::string peer = endpoint.peer;  // the endpoint may be gone once closed
  endpoint.failed = true;
  if (peer_failed) {
    stats_.peer_failures.fetch_add(1);
    // A peer that goes away while nothing is in flight (a clean restart or shutdown
    // of the other side) costs nothing; only lost operations are worth a warning.
    if (endpoint.sends.empty() && endpoint.landings.empty()) {
      logger()->info("endpoint to {} closed while idle: {}", printable(endpoint.peer), status.to_string());
    } else {
      logger()->warn("endpoint to {} failed with {} sends and {} landings in flight: {}", printable(endpoint.peer),
                     endpoint.sends.size(), endpoint.landings.size(), status.to_string());
    }
  } else {
    logger()->debug("closing the endpoint to {}: {}", printable(endpoint.peer), status.message());
  }
  if (endpoint.outgoing) {
    std::lock_guard lock(peers_mutex_);
    endpoints_by_peer_.erase(endpoint.peer);
  }
  endpoint_by_ucp_.erase(endpoint.ep);

  observer_->on_endpoint_failed(endpoint, status);
  // Rendezvous payloads still being fetched from this peer fail once the close has
  // completed: from then on no fragment of theirs can reach the landing.
  endpoint.failure = status;

  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = graceful ? 0U : static_cast<std::uint32_t>(UCP_EP_CLOSE_FLAG_FORCE);
  void* request = ucp_ep_close_nbx(endpoint.ep, &params);
  if (UCS_PTR_IS_PTR(request)) {
    closing_.emplace_back(id, request);
  } else {
    closed(id);
  }
  if (peer_failed && options_.on_peer_failure) {
    try {
      options_.on_peer_failure(EndpointHandle{id}, peer, status);
    } catch (const std::exception& e) {
      logger()->error("on_peer_failure threw: {}", e.what());
    }
  }
}

void Endpoints::close_all(const Status& status, bool graceful) {
  std::vector<std::uint64_t> ids;
  for (const auto& [id, endpoint] : endpoints_) {
    if (!endpoint->failed) ids.push_back(id);
  }
  for (const auto id : ids) fail(id, status, /*peer_failed=*/false, graceful);
}

bool Endpoints::handle_deferred() {
  bool worked = false;
  while (!conn_requests_.empty()) {
    auto request = conn_requests_.front();
    conn_requests_.pop_front();
    if (refusing_connections_) {
      ucp_listener_reject(listener_, request);
    } else {
      accept(request);
    }
    worked = true;
  }
  while (!failed_endpoints_.empty()) {
    auto [id, status] = std::move(failed_endpoints_.front());
    failed_endpoints_.pop_front();
    fail(id, status);
    worked = true;
  }
  for (auto it = closing_.begin(); it != closing_.end();) {
    if (ucp_request_check_status(it->second) != UCS_INPROGRESS) {
      ucp_request_free(it->second);
      const auto id = it->first;
      it = closing_.erase(it);
      closed(id);
      worked = true;
    } else {
      ++it;
    }
  }
  return worked;
}

// UCX will deliver nothing more from that peer, so the landings it was still writing
// fail now (their UCX receives may never finish: UCX 1.13 does not always complete a
// rendezvous receive cut off by a peer failure).
void Endpoints::closed(std::uint64_t endpoint_id) {
  auto found = endpoints_.find(endpoint_id);
  if (found == endpoints_.end()) return;
  const std::set<std::uint64_t> cut_off = std::move(found->second->landings);
  const Status status =
      found->second->failure.is_ok() ? unavailable("the connection to the sender was closed") : found->second->failure;
  endpoints_.erase(found);
  observer_->on_endpoint_closed(cut_off, status);
}

void Endpoints::describe_once(std::uint64_t id) {
  if (!logger()->should_log(spdlog::level::debug)) return;
  auto found = endpoints_.find(id);
  if (found == endpoints_.end() || found->second->described) return;
  found->second->described = true;
  // UCX prints only to a FILE*: an in-memory stream, freed right after (C
  // resources, so no owner types).
  char* text = nullptr;
  std::size_t size = 0;
  if (FILE* stream = ::open_memstream(&text, &size)) {
    ucp_ep_print_info(found->second->ep, stream);
    std::fclose(stream);  // NOLINT(cppcoreguidelines-owning-memory): fills text and size
    logger()->debug("endpoint to {}:\n{}", printable(found->second->peer), std::string(text, size));
    std::free(text);  // NOLINT(cppcoreguidelines-owning-memory,cppcoreguidelines-no-malloc): open_memstream's buffer
  }
}

void Endpoints::reject_waiting_connections() {
  for (auto request : conn_requests_) ucp_listener_reject(listener_, request);
  conn_requests_.clear();
}

void Endpoints::refuse_connections() {
  refusing_connections_ = true;
  reject_waiting_connections();
}

void Endpoints::destroy_listener() {
  if (listener_ == nullptr) return;
  reject_waiting_connections();
  ucp_listener_destroy(listener_);
  listener_ = nullptr;
}

void Endpoints::leave_listener_to_exit() {
  // Nothing progresses the worker any more, so UCX queues the requests of new
  // connections and never calls on_connection_request (whose `this` is going).
  keep_until_exit(listener_);
  listener_ = nullptr;
}

void Endpoints::free_closing() {
  for (auto& [id, request] : closing_) ucp_request_free(request);
  closing_.clear();
}

}  // namespace ecx::transport::ucx
