#include "transport/ucx/am_protocol.h"

#include <cstring>

#include <fmt/format.h>

namespace ecx::transport::ucx {
namespace {

// The active message of `am` mode (put mode uses 18..20, see put_protocol.cc).
constexpr unsigned kDataAm = 17;

// What a receiver answers a refused rendezvous with, so the sender's on_sent sees it.
ucs_status_t refusal_status(const Status& status) {
  return status.code() == StatusCode::invalid_argument ? UCS_ERR_MESSAGE_TRUNCATED : UCS_ERR_REJECTED;
}

}  // namespace

Status AmProtocol::register_handlers() { return worker_.set_am_handler(kDataAm, &AmProtocol::on_data_am, this); }

// --- sending -------------------------------------------------------------------

void AmProtocol::post(SendOp& op, Endpoint& endpoint, Region& region) {
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS |
                        UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  params.cb.send = &Transfers::on_request_done;
  params.user_data = &op;
  params.memh = region.memh;
  params.memory_type = region.kind == MemoryKind::cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  // REPLY: the receiver learns which endpoint the payload arrives on, so a peer
  // failure (or its landing watchdog) can cut off exactly that peer's landings.
  params.flags = UCP_AM_SEND_FLAG_REPLY;
  if (options_.rndv_threshold_bytes != 0) {
    params.flags |= op.length >= options_.rndv_threshold_bytes ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
  }
  void* request =
      ucp_am_send_nbx(endpoint.ep, kDataAm, op.header.data(), op.header.size(), op.source, op.length, &params);
  complete_or_track(op, request, "ucp_am_send_nbx");
}

void AmProtocol::complete_or_track(SendOp& op, void* request, std::string_view what) {
  if (request == nullptr) {
    transfers_.finish_send(op.id, Status::ok());
  } else if (UCS_PTR_IS_ERR(request)) {
    transfers_.finish_send(op.id, ucx_error(what, UCS_PTR_STATUS(request)));
  } else {
    op.request = request;
  }
}

void AmProtocol::request_done(SendOp& op) { transfers_.finish_send(op.id, Status::ok()); }

// --- receiving -----------------------------------------------------------------

ucs_status_t AmProtocol::on_data_am(void* arg, const void* header, std::size_t header_length, void* data,
                                    std::size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<AmProtocol*>(arg)->receive_data(
      std::span(static_cast<const std::byte*>(header), header_length), data, length,
      (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0,
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr);
}

ucs_status_t AmProtocol::receive_data(std::span<const std::byte> header, void* data, std::uint64_t length,
                                      bool rendezvous, ucp_ep_h sender) {
  // The endpoint the payload arrives on, when it is one of ours (socket-address
  // listeners accept every sender as an endpoint with peer-failure handling).
  const std::uint64_t sender_endpoint = endpoints_.id_of(sender);
  if (rendezvous && sender_endpoint != 0 && endpoints_.find(sender_endpoint)->failed) {
    stats_.landings_rejected.fetch_add(1);
    return UCS_ERR_REJECTED;
  }
  auto landing = transfers_.resolve_landing(header, length);
  if (!landing) {
    stats_.landings_rejected.fetch_add(1);
    logger()->debug("rejected a payload of {} bytes: {}", length, landing.status().to_string());
    return rendezvous ? refusal_status(landing.status()) : UCS_OK;  // eager bytes are simply dropped
  }
  auto pending = transfers_.new_landing(header, *landing);
  if (landing->length != length || landing->destination == nullptr) {
    stats_.landings_rejected.fetch_add(1);
    const auto refusal =
        invalid_argument(fmt::format("payload of {} bytes for a landing of {} bytes", length, landing->length));
    transfers_.report_landing(*pending, refusal, /*counted=*/false);
    return rendezvous ? refusal_status(refusal) : UCS_OK;
  }
  if (!rendezvous) {
    std::memcpy(landing->destination, data, length);
    transfers_.report_landing(*pending, Status::ok());
    return UCS_OK;
  }
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  params.cb.recv_am = &AmProtocol::on_receive_done;
  params.user_data = pending.get();
  params.memory_type = UCS_MEMORY_TYPE_HOST;
  if (Region* region = regions_.holding(landing->destination, length)) {
    params.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    params.memh = region->memh;
    params.memory_type = region->kind == MemoryKind::cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  }
  void* request = ucp_am_recv_data_nbx(worker_.worker(), data, landing->destination, length, &params);
  if (request == nullptr) {
    transfers_.report_landing(*pending, Status::ok());
  } else if (UCS_PTR_IS_ERR(request)) {
    transfers_.report_landing(*pending, ucx_error("ucp_am_recv_data_nbx", UCS_PTR_STATUS(request)));
  } else {
    pending->request = request;
    transfers_.track_landing(std::move(pending), sender_endpoint, /*watched=*/true);
  }
  return UCS_INPROGRESS;
}

void AmProtocol::on_receive_done(void* request, ucs_status_t status, std::size_t /*length*/, void* user_data) {
  auto* pending = static_cast<PendingLanding*>(user_data);
  Transfers* transfers = pending->owner;
  const std::uint64_t id = pending->id;
  ucp_request_free(request);
  if (transfers->release_abandoned_landing(id)) return;  // already reported failed
  pending->request = nullptr;
  transfers->finish_landing(id, status == UCS_OK ? Status::ok() : ucx_error("payload receive failed", status));
}

}  // namespace ecx::transport::ucx
