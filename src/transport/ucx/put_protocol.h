#pragma once
// Mode `put`: one-sided put + flush into a landing the receiver granted.
//   sender: request (header)  ->  receiver: resolves, grants (address, rkey) or refuses
//   sender: put, flush, done  ->  receiver: on_landing
// The three control messages are small eager active messages.

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "ecx/core/status.h"
#include "ecx/transport/ucx_transport.h"
#include "transport/ucx/common.h"
#include "transport/ucx/endpoints.h"
#include "transport/ucx/regions.h"
#include "transport/ucx/transfers.h"
#include "transport/ucx/worker.h"

namespace ecx::transport::ucx {

// Put-mode control headers (both ends run the same build and byte order).
struct PutRequest {
  std::uint64_t op_id;
  std::uint64_t length;
};
struct PutGrant {
  std::uint64_t op_id;
  std::uint64_t grant_id;
  std::uint64_t remote_address;
  std::int32_t status;  // 0 = granted; otherwise the StatusCode of the refusal
  std::uint32_t reserved;
};
struct PutDone {
  std::uint64_t grant_id;
};

class PutProtocol final : public SendProtocol {
 public:
  PutProtocol(UcxWorker& worker, AtomicStats& stats, Regions& regions, Endpoints& endpoints, Transfers& transfers)
      : worker_(worker), stats_(stats), regions_(regions), endpoints_(endpoints), transfers_(transfers) {}

  // Before the worker starts.
  Status register_handlers();

  // Sends the request; the op then waits for the receiver's grant (or refusal).
  void post(SendOp& op, Endpoint& endpoint, Region& region) override;
  // The flush after the put finished: every byte is at the target; tells the receiver.
  void request_done(SendOp& op) override;

  // Before the worker goes.
  void drop_control_messages() { control_in_flight_.clear(); }

 private:
  // A small control message; UCX may still read its bytes after ucp_am_send_nbx
  // returns (e.g. while the endpoint is wiring up), so it lives until its completion
  // callback.
  struct ControlMessage {
    PutProtocol* owner = nullptr;
    std::vector<std::byte> header;
    std::vector<std::byte> payload;
  };

  Status send_control(ucp_ep_h ep, unsigned id, std::vector<std::byte> header, std::vector<std::byte> payload,
                      std::uint32_t flags);
  static void on_control_sent(void* request, ucs_status_t status, void* user_data);

  static ucs_status_t on_put_request_am(void* arg, const void* header, std::size_t header_length, void* data,
                                        std::size_t length, const ucp_am_recv_param_t* param);
  void grant(const PutRequest& request, std::span<const std::byte> header, ucp_ep_h reply_ep);
  static ucs_status_t on_put_grant_am(void* arg, const void* header, std::size_t header_length, void* data,
                                      std::size_t length, const ucp_am_recv_param_t* param);
  void write_granted(const PutGrant& grant, std::span<const std::byte> rkey_bytes);
  static ucs_status_t on_put_done_am(void* arg, const void* header, std::size_t header_length, void* data,
                                     std::size_t length, const ucp_am_recv_param_t* param);

  UcxWorker& worker_;
  AtomicStats& stats_;
  Regions& regions_;
  Endpoints& endpoints_;
  Transfers& transfers_;
  std::unordered_map<ControlMessage*, std::unique_ptr<ControlMessage>> control_in_flight_;
};

}  // namespace ecx::transport::ucx
