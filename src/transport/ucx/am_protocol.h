#pragma once
// Mode `am`: one active message per payload, carrying the header. Small payloads go
// eagerly and are copied into the landing; larger ones use rendezvous, so the
// receiver resolves the landing first and UCX fetches the payload straight into it.
// A confirmed send travels as its own message whose header starts with the send's
// id; the receiver answers it with a verdict message (accepted, or turned away and
// why), which the sender needs because an eager send completes without the receiver.
// A rendezvous payload from one of our endpoints is answered once it has landed, not
// when it arrives: a verdict sent back while the payload streamed in slowed the stream
// (a lone 9 MiB payload over tcp took 0.6-1 ms longer).
// A sender that reads verdict batches says so in its sends' ids (kBatchesWelcome);
// the verdicts for its payloads over one of our endpoints are then held until the
// progress pass that decided them ends and go as one message per endpoint: one
// message per 64 KiB payload cost the receiver a send and the sender a receive each.
// A payload from a shared region (shared_sources.h) goes as its place in the region,
// always answered with a verdict: its source is in use until the receiver copied it.

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "ecx/core/status.h"
#include "ecx/transport/ucx_transport.h"
#include "transport/ucx/common.h"
#include "transport/ucx/endpoints.h"
#include "transport/ucx/regions.h"
#include "transport/ucx/transfers.h"
#include "transport/ucx/worker.h"

namespace ecx::transport::ucx {

class AmProtocol final : public SendProtocol {
 public:
  AmProtocol(UcxWorker& worker, const UcxOptions& options, AtomicStats& stats, Regions& regions, Endpoints& endpoints,
             Transfers& transfers)
      : worker_(worker),
        options_(options),
        stats_(stats),
        regions_(regions),
        endpoints_(endpoints),
        transfers_(transfers) {}

  // Before the worker starts.
  Status register_handlers();

  void post(SendOp& op, Endpoint& endpoint, Region& region) override;
  void request_done(SendOp& op) override;
  // A shared payload that an endpoint never answered within the copy window: a peer
  // without shared sources (an older build drops message 24 unread) is sent bytes.
  bool retry_expired(SendOp& op) override;

  // Progress thread, after each progress pass: sends the verdicts it held, one message
  // per endpoint (an endpoint that failed meanwhile gets none: its sender's sends fail
  // with it). Returns whether there were any.
  bool send_held_verdicts();

  // Progress thread: whether this side sends and takes shared sources (after the worker opened).
  void enable_shared_sources();
  bool shared_sources() const noexcept { return shared_sources_; }
  // A shared region was deregistered: the peers that were sent a place in it unmap it.
  void shared_region_gone(const Region::Shared& shared);
  // Unmaps what senders no longer hold (a sender that died cannot say so); see SharedMappings::sweep.
  // Called after every progress pass: costs nothing while no sender's memory is mapped.
  void sweep_shared_mappings() {
    if (mappings_.size() == 0) return;
    mappings_.sweep(options_.clock->now());
    publish_mapped_bytes();
  }

 private:
  static ucs_status_t on_data_am(void* arg, const void* header, std::size_t header_length, void* data,
                                 std::size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_confirmed_data_am(void* arg, const void* header, std::size_t header_length, void* data,
                                           std::size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_verdict_am(void* arg, const void* header, std::size_t header_length, void* data,
                                    std::size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_shared_data_am(void* arg, const void* header, std::size_t header_length, void* data,
                                        std::size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_shared_refused_am(void* arg, const void* header, std::size_t header_length, void* data,
                                           std::size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_shared_gone_am(void* arg, const void* header, std::size_t header_length, void* data,
                                        std::size_t length, const ucp_am_recv_param_t* param);
  // TransportStats::shared_mapped_bytes, after the mappings changed.
  void publish_mapped_bytes() { stats_.shared_mapped_bytes.store(mappings_.mapped_bytes()); }
  // Sends `op` as its place in the shared region; false when it must go as bytes.
  bool post_shared(SendOp& op, Endpoint& endpoint, Region& region);
  // The receiver could not map the region: this peer gets bytes from now on.
  void resend_refused(std::uint64_t op_id, ucp_ep_h arrived_on, std::string_view reason);
  void resend_as_bytes(SendOp& op, Endpoint& endpoint, std::string_view reason);
  static ucs_status_t on_verdict_batch_am(void* arg, const void* header, std::size_t header_length, void* data,
                                          std::size_t length, const ucp_am_recv_param_t* param);
  struct Confirms {
    std::uint64_t op_id;
    bool batches;  // the sender reads verdict batches
  };
  // `confirms` (a confirmed send): its sender is answered, see the file comment.
  // `copy_by_ns`: a shared payload (data: the sender's memory), see SharedSourceRef.
  ucs_status_t receive_data(std::span<const std::byte> header, void* data, std::uint64_t length, bool rendezvous,
                            ucp_ep_h sender, std::optional<Confirms> confirms = std::nullopt,
                            std::optional<std::uint64_t> copy_by_ns = std::nullopt);
  void send_verdict(ucp_ep_h receiver_side, std::uint64_t op_id, const Status& verdict);
  // Answers over endpoint `sender_endpoint` (ours): held for send_held_verdicts() when
  // the sender reads batches, else sent now.
  void answer_endpoint(std::uint64_t sender_endpoint, std::uint64_t op_id, bool batches, const Status& verdict);
  Status send_message(ucp_ep_h ep, unsigned am_id, std::vector<std::byte> message);
  void take_verdict(std::uint64_t op_id, ucp_ep_h arrived_on, Status verdict);
  static void on_verdict_sent(void* request, ucs_status_t status, void* user_data);
  static void on_receive_done(void* request, ucs_status_t status, std::size_t length, void* user_data);
  void complete_or_track(SendOp& op, void* request, std::string_view what);

  UcxWorker& worker_;
  const UcxOptions& options_;
  AtomicStats& stats_;
  Regions& regions_;
  Endpoints& endpoints_;
  Transfers& transfers_;

  struct HeldVerdict {
    std::uint64_t endpoint;
    std::uint64_t op_id;
    Status verdict;
  };
  std::vector<HeldVerdict> held_verdicts_;   // progress thread only
  std::vector<HeldVerdict> spare_verdicts_;  // empty; its capacity is the next pass's (send_held_verdicts)
  bool shared_sources_ = false;              // set before any payload moves
  SharedMappings mappings_;                  // receiving side
};

}  // namespace ecx::transport::ucx
