#include "transport/ucx/put_protocol.h"

#include <cstring>

#include <fmt/format.h>

namespace ecx::transport::ucx {
namespace {

// The active messages of `put` mode (am mode uses 17, see am_protocol.cc).
constexpr unsigned kPutRequestAm = 18;
constexpr unsigned kPutGrantAm = 19;
constexpr unsigned kPutDoneAm = 20;

template <typename T>
std::vector<std::byte> bytes_of(const T& value) {
  std::vector<std::byte> bytes(sizeof value);
  std::memcpy(bytes.data(), &value, sizeof value);
  return bytes;
}

}  // namespace

Status PutProtocol::register_handlers() {
  ECX_RETURN_IF_ERROR(worker_.set_am_handler(kPutRequestAm, &PutProtocol::on_put_request_am, this));
  ECX_RETURN_IF_ERROR(worker_.set_am_handler(kPutGrantAm, &PutProtocol::on_put_grant_am, this));
  ECX_RETURN_IF_ERROR(worker_.set_am_handler(kPutDoneAm, &PutProtocol::on_put_done_am, this));
  return Status::ok();
}

Status PutProtocol::send_control(ucp_ep_h ep, unsigned id, std::vector<std::byte> header,
                                 std::vector<std::byte> payload, std::uint32_t flags) {
  auto message = std::make_unique<ControlMessage>();
  message->owner = this;
  message->header = std::move(header);
  message->payload = std::move(payload);
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = flags | UCP_AM_SEND_FLAG_EAGER;
  params.cb.send = &PutProtocol::on_control_sent;
  params.user_data = message.get();
  void* request =
      ucp_am_send_nbx(ep, id, message->header.data(), message->header.size(),
                      message->payload.empty() ? nullptr : message->payload.data(), message->payload.size(), &params);
  if (request == nullptr) return Status::ok();
  if (UCS_PTR_IS_ERR(request)) return ucx_error("control message", UCS_PTR_STATUS(request));
  ControlMessage* key = message.get();
  control_in_flight_.emplace(key, std::move(message));
  return Status::ok();
}

void PutProtocol::on_control_sent(void* request, ucs_status_t /*status*/, void* user_data) {
  auto* message = static_cast<ControlMessage*>(user_data);
  ucp_request_free(request);
  message->owner->control_in_flight_.erase(message);
}

// --- sender: request ---------------------------------------------------------------

void PutProtocol::post(SendOp& op, Endpoint& endpoint, Region& /*region*/) {
  std::vector<std::byte> wire = bytes_of(PutRequest{op.id, op.length});
  wire.insert(wire.end(), op.header.begin(), op.header.end());
  // The op now waits for the receiver's grant (or refusal).
  if (auto st = send_control(endpoint.ep, kPutRequestAm, std::move(wire), {}, UCP_AM_SEND_FLAG_REPLY); !st) {
    transfers_.finish_send(op.id, st);
  }
}

// --- receiver: grant -------------------------------------------------------------

ucs_status_t PutProtocol::on_put_request_am(void* arg, const void* header, std::size_t header_length, void* /*data*/,
                                            std::size_t /*length*/, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<PutProtocol*>(arg);
  if (header_length < sizeof(PutRequest) || (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
    logger()->warn("dropped a malformed put request");
    return UCS_OK;
  }
  PutRequest request;
  std::memcpy(&request, header, sizeof request);
  self->grant(request,
              std::span(static_cast<const std::byte*>(header) + sizeof request, header_length - sizeof request),
              param->reply_ep);
  return UCS_OK;
}

void PutProtocol::grant(const PutRequest& request, std::span<const std::byte> header, ucp_ep_h reply_ep) {
  const std::uint64_t endpoint_id = endpoints_.id_of(reply_ep);
  PutGrant answer{request.op_id, 0, 0, 0, 0};
  const std::vector<std::byte>* rkey = nullptr;
  auto landing = transfers_.resolve_landing(header, request.length);
  if (!landing) {
    stats_.landings_rejected.fetch_add(1);
    answer.status = static_cast<std::int32_t>(landing.status().code());
  } else {
    auto pending = transfers_.new_landing(header, *landing);
    Region* region =
        landing->destination == nullptr ? nullptr : regions_.holding(landing->destination, landing->length);
    if (landing->length != request.length || region == nullptr || endpoint_id == 0) {
      stats_.landings_rejected.fetch_add(1);
      const auto refusal =
          landing->length != request.length
              ? invalid_argument(
                    fmt::format("payload of {} bytes for a landing of {} bytes", request.length, landing->length))
              : invalid_argument("put mode needs landings inside a region registered with this transport");
      transfers_.report_landing(*pending, refusal, /*counted=*/false);
      answer.status = static_cast<std::int32_t>(refusal.code());
    } else {
      answer.grant_id = pending->id;
      answer.remote_address = reinterpret_cast<std::uint64_t>(landing->destination);
      rkey = &region->packed_rkey;
      transfers_.track_landing(std::move(pending), endpoint_id, /*watched=*/false);
    }
  }
  // The rkey travels as the payload; the header carries the rest.
  if (auto st = send_control(reply_ep, kPutGrantAm, bytes_of(answer), rkey ? *rkey : std::vector<std::byte>{}, 0);
      !st) {
    logger()->warn("could not answer a put request: {}", st.to_string());
    if (answer.grant_id != 0) transfers_.finish_landing(answer.grant_id, st);
  }
}

// --- sender: put, flush, done --------------------------------------------------------

ucs_status_t PutProtocol::on_put_grant_am(void* arg, const void* header, std::size_t header_length, void* data,
                                          std::size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<PutProtocol*>(arg);
  if (header_length != sizeof(PutGrant) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    logger()->warn("dropped a malformed put grant");
    return UCS_OK;
  }
  PutGrant grant;
  std::memcpy(&grant, header, sizeof grant);
  self->write_granted(grant, std::span(static_cast<const std::byte*>(data), length));
  return UCS_OK;
}

void PutProtocol::write_granted(const PutGrant& grant, std::span<const std::byte> rkey_bytes) {
  SendOp* found = transfers_.find_send(grant.op_id);
  if (found == nullptr) return;  // expired meanwhile; its endpoint is being closed
  SendOp& op = *found;
  if (grant.status != 0) {
    const auto code = static_cast<StatusCode>(grant.status);
    transfers_.finish_send(op.id, Status(code, "the receiver refused the payload"));
    return;
  }
  Endpoint* endpoint = endpoints_.find(op.endpoint);
  if (endpoint == nullptr || endpoint->failed) return;  // failed with the endpoint
  op.grant_id = grant.grant_id;
  if (auto st = ucp_ep_rkey_unpack(endpoint->ep, rkey_bytes.data(), &op.rkey); st != UCS_OK) {
    op.rkey = nullptr;
    transfers_.finish_send(op.id, ucx_error("ucp_ep_rkey_unpack", st));
    return;
  }
  ucp_request_param_t put_params{};
  void* put = ucp_put_nbx(endpoint->ep, op.source, op.length, grant.remote_address, op.rkey, &put_params);
  if (UCS_PTR_IS_ERR(put)) {
    transfers_.finish_send(op.id, ucx_error("ucp_put_nbx", UCS_PTR_STATUS(put)));
    return;
  }
  if (put != nullptr) ucp_request_free(put);  // the flush below covers its completion
  ucp_request_param_t flush_params{};
  flush_params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  flush_params.cb.send = &Transfers::on_request_done;
  flush_params.user_data = &op;
  void* flush = ucp_ep_flush_nbx(endpoint->ep, &flush_params);
  if (flush == nullptr) {
    request_done(op);
  } else if (UCS_PTR_IS_ERR(flush)) {
    transfers_.finish_send(op.id, ucx_error("ucp_ep_flush_nbx", UCS_PTR_STATUS(flush)));
  } else {
    op.request = flush;
  }
}

void PutProtocol::request_done(SendOp& op) {
  ucp_rkey_destroy(op.rkey);
  op.rkey = nullptr;
  Endpoint* endpoint = endpoints_.find(op.endpoint);
  if (endpoint != nullptr && !endpoint->failed) {
    // The flush finished: every byte is at the target. Tell the receiver.
    if (auto st = send_control(endpoint->ep, kPutDoneAm, bytes_of(PutDone{op.grant_id}), {}, 0); !st) {
      // The bytes are at the target, but the receiver will not hear so; its landing
      // fails when this endpoint does.
      logger()->warn("could not confirm a put: {}", st.to_string());
    }
  }
  transfers_.finish_send(op.id, Status::ok());
}

// --- receiver: done --------------------------------------------------------------

ucs_status_t PutProtocol::on_put_done_am(void* arg, const void* header, std::size_t header_length, void* /*data*/,
                                         std::size_t /*length*/, const ucp_am_recv_param_t* /*param*/) {
  if (header_length != sizeof(PutDone)) return UCS_OK;
  PutDone done;
  std::memcpy(&done, header, sizeof done);
  static_cast<PutProtocol*>(arg)->transfers_.finish_landing(done.grant_id, Status::ok());
  return UCS_OK;
}

}  // namespace ecx::transport::ucx
