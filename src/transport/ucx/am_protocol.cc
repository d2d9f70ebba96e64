#include "transport/ucx/am_protocol.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/byte_order.h"
#include "ecx/core/stages.h"
#include "transport/ucx/shared_sources.h"

namespace ecx::transport::ucx {
namespace {

// The active messages of `am` mode (put mode uses 18..20, see put_protocol.cc).
constexpr unsigned kDataAm = 17;
constexpr unsigned kConfirmedDataAm = 21;  // header: the send's id (u64 LE, bit 63 see below), the payload header
constexpr unsigned kVerdictAm = 22;        // header: the send's id (u64 LE), status code (u8), reason (UTF-8)
// header: verdicts, each the send's id (u64 LE), status code (u8), reason length (u16
// LE) and reason (UTF-8)
constexpr unsigned kVerdictBatchAm = 23;
// header: the send's id (as in 21), where the payload lies (shared_sources.h: host,
// pid, fd, inode, device, region offset and size, payload offset and length), the
// payload header. No data: the receiver copies the payload out of the sender's memory.
constexpr unsigned kSharedDataAm = 24;
// header: as 22 (the send's id, a status code, why): the receiver cannot map the
// sender's memory; the sender resends the payload as 21 and sends that peer bytes from
// then on.
constexpr unsigned kSharedRefusedAm = 25;
// header: pid, fd, inode, device of a file whose region the sender deregistered.
constexpr unsigned kSharedGoneAm = 26;
// How long a receiver has to copy a shared payload out: the send fails then, and its
// source is the sender's again. Short, because a shared send whose endpoint failed
// waits for it (the receiver may still be copying) rather than failing at once.
constexpr Duration kSharedCopyWindow = std::chrono::seconds(1);
// The smallest shared payload where the rendezvous threshold is left to UCX (0): the
// size from which ECX's own default sends rendezvous.
constexpr std::uint64_t kSharedFromBytesWhenUcxDecides = 128ULL * 1024;
// Taken off the receiver's copy-by time: the two clocks are read at different moments.
constexpr std::uint64_t kCopyByMarginNs = 1'000'000;
constexpr std::size_t kIdBytes = 8;
constexpr std::size_t kMaxVerdictReason = 256;
// Bit 63 of a confirmed send's id: its sender reads kVerdictBatchAm. Ids are counted
// from 1 and never reach it; a receiver that does not know the bit echoes it, so the
// sender masks it off every verdict.
constexpr std::uint64_t kBatchesWelcome = std::uint64_t{1} << 63;
// A batch larger than this goes as several messages (an eager header stays small).
constexpr std::size_t kMaxVerdictBatchBytes = 4096;
// A batch entry without its reason: the send's id, the status code, the reason's length.
constexpr std::size_t kBatchEntryBytes = kIdBytes + 1 + 2;
// A progress pass that keeps finding arrivals sends what it held at this count, so
// that no sender waits on a long pass (its window would stall).
constexpr std::size_t kMaxHeldVerdicts = 64;

using byte_order::get_le;
using byte_order::put_le;

std::string_view reason_of(const Status& verdict) {
  return std::string_view(verdict.message()).substr(0, kMaxVerdictReason);
}

std::vector<std::byte> encode_verdict(std::uint64_t op_id, const Status& verdict) {
  const std::string_view reason = reason_of(verdict);
  std::vector<std::byte> out(kIdBytes + 1 + reason.size());
  put_le(out.data(), op_id);
  out[kIdBytes] = static_cast<std::byte>(verdict.code());
  std::memcpy(out.data() + kIdBytes + 1, reason.data(), reason.size());
  return out;
}

void append_batch_entry(std::vector<std::byte>& out, std::uint64_t op_id, const Status& verdict) {
  const std::string_view reason = reason_of(verdict);
  const std::size_t at = out.size();
  out.resize(at + kBatchEntryBytes + reason.size());
  put_le(out.data() + at, op_id);
  out[at + kIdBytes] = static_cast<std::byte>(verdict.code());
  put_le(out.data() + at + kIdBytes + 1, static_cast<std::uint16_t>(reason.size()));
  std::memcpy(out.data() + at + kBatchEntryBytes, reason.data(), reason.size());
}

Status verdict_of(unsigned code, std::string_view reason) {
  return code == 0
             ? Status::ok()
             : Status(static_cast<StatusCode>(code), fmt::format("the receiver turned the payload away: {}", reason));
}

// What a receiver answers a refused rendezvous with, so the sender's on_sent sees it.
ucs_status_t refusal_status(const Status& status) {
  return status.code() == StatusCode::invalid_argument ? UCS_ERR_MESSAGE_TRUNCATED : UCS_ERR_REJECTED;
}

}  // namespace

Status AmProtocol::register_handlers() {
  ECX_RETURN_IF_ERROR(worker_.set_am_handler(kDataAm, &AmProtocol::on_data_am, this));
  ECX_RETURN_IF_ERROR(worker_.set_am_handler(kConfirmedDataAm, &AmProtocol::on_confirmed_data_am, this));
  ECX_RETURN_IF_ERROR(worker_.set_am_handler(kVerdictBatchAm, &AmProtocol::on_verdict_batch_am, this));
  ECX_RETURN_IF_ERROR(worker_.set_am_handler(kSharedDataAm, &AmProtocol::on_shared_data_am, this));
  ECX_RETURN_IF_ERROR(worker_.set_am_handler(kSharedRefusedAm, &AmProtocol::on_shared_refused_am, this));
  ECX_RETURN_IF_ERROR(worker_.set_am_handler(kSharedGoneAm, &AmProtocol::on_shared_gone_am, this));
  return worker_.set_am_handler(kVerdictAm, &AmProtocol::on_verdict_am, this);
}

// --- sending -------------------------------------------------------------------

void AmProtocol::post(SendOp& op, Endpoint& endpoint, Region& region) {
  if (post_shared(op, endpoint, region)) return;
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
  if (op.confirmed) {  // the receiver names the send in its verdict
    op.header.insert(op.header.begin(), kIdBytes, std::byte{0});
    put_le(op.header.data(), op.id | kBatchesWelcome);
  }
  void* request = ucp_am_send_nbx(endpoint.ep, op.confirmed ? kConfirmedDataAm : kDataAm, op.header.data(),
                                  op.header.size(), op.source, op.length, &params);
  complete_or_track(op, request, "ucp_am_send_nbx");
}

void AmProtocol::enable_shared_sources() {
  shared_sources_ = options_.shared_sources && worker_.shared_memory_allowed() && host_identity().has_value();
}

bool AmProtocol::post_shared(SendOp& op, Endpoint& endpoint, Region& region) {
  // Payloads that would go rendezvous: an eager one is already a single copy.
  const std::uint64_t from =
      options_.rndv_threshold_bytes != 0 ? options_.rndv_threshold_bytes : kSharedFromBytesWhenUcxDecides;
  if (!shared_sources_ || !region.shared || endpoint.shared_refused || op.length < from) return false;
  SharedSourceRef ref;
  ref.host = *host_identity();
  ref.file = region.shared->file;
  ref.fd_offset = region.shared->fd_offset;
  ref.region_size = region.size;
  ref.offset = op.offset;
  ref.length = op.length;
  const TimePoint now = options_.clock->now();
  const TimePoint cutoff = std::min(op.deadline, now + kSharedCopyWindow);
  op.deadline_before_shared = op.deadline;
  transfers_.move_deadline(op, cutoff);
  const auto left_ns = static_cast<std::uint64_t>(
      std::max<std::int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(cutoff - now).count()));
  ref.copy_by_ns = stages::monotonic_ns() + (left_ns > kCopyByMarginNs ? left_ns - kCopyByMarginNs : 0);
  std::vector<std::byte> message(kIdBytes + kSharedSourceRefBytes + op.header.size());
  put_le(message.data(), op.id | kBatchesWelcome);
  encode_shared_source(ref, message.data() + kIdBytes);
  std::memcpy(message.data() + kIdBytes + kSharedSourceRefBytes, op.header.data(), op.header.size());
  if (auto sent = send_message(endpoint.ep, kSharedDataAm, std::move(message)); !sent) {
    transfers_.finish_send(op.id, sent);
    return true;
  }
  op.shared = true;
  region.shared->endpoints.insert(endpoint.id);
  stats_.shared_sends.fetch_add(1);
  return true;
}

void AmProtocol::resend_refused(std::uint64_t op_id, ucp_ep_h arrived_on, std::string_view reason) {
  SendOp* op = transfers_.find_send(op_id);
  if (op == nullptr || !op->shared || arrived_on == nullptr || endpoints_.id_of(arrived_on) != op->endpoint) return;
  Endpoint* endpoint = endpoints_.find(op->endpoint);
  if (endpoint == nullptr) return;
  endpoint->shared_answered = true;
  resend_as_bytes(*op, *endpoint, reason);
}

bool AmProtocol::retry_expired(SendOp& op) {
  if (!op.shared) return false;
  Endpoint* endpoint = endpoints_.find(op.endpoint);
  if (endpoint == nullptr || endpoint->failed || endpoint->shared_answered) return false;
  resend_as_bytes(op, *endpoint,
                  "no answer to a payload sent as its place in shared memory within 1 s: a peer without shared "
                  "sources drops that message");
  return true;
}

void AmProtocol::resend_as_bytes(SendOp& op, Endpoint& endpoint, std::string_view reason) {
  Region* region = regions_.find(op.region);
  if (region == nullptr) {
    transfers_.finish_send(op.id, unavailable("the payload's region went while it was resent"));
    return;
  }
  if (!endpoint.shared_refused) {
    logger()->info("peer {} cannot copy payloads out of this process's shared memory ({}); it is sent bytes instead",
                   printable(endpoint.peer), reason);
  }
  endpoint.shared_refused = true;
  op.shared = false;
  transfers_.move_deadline(op, op.deadline_before_shared);
  stats_.shared_fallbacks.fetch_add(1);
  post(op, endpoint, *region);
}

void AmProtocol::shared_region_gone(const Region::Shared& shared) {
  for (const std::uint64_t id : shared.endpoints) {
    const Endpoint* endpoint = endpoints_.find(id);
    if (endpoint == nullptr || endpoint->failed) continue;
    std::vector<std::byte> message(kSharedFileBytes);
    encode_shared_file(shared.file, message.data());
    static_cast<void>(send_message(endpoint->ep, kSharedGoneAm, std::move(message)));  // a lost one: the sweep
  }
}

void AmProtocol::complete_or_track(SendOp& op, void* request, std::string_view what) {
  if (request == nullptr) {
    request_done(op);
  } else if (UCS_PTR_IS_ERR(request)) {
    transfers_.finish_send(op.id, ucx_error(what, UCS_PTR_STATUS(request)));
  } else {
    op.request = request;
  }
}

// A confirmed send whose verdict has not come yet waits for it (or for its deadline,
// or its endpoint's failure); one its owner already gave up on ends now.
void AmProtocol::request_done(SendOp& op) {
  if (!op.confirmed || op.abandoned) {
    transfers_.finish_send(op.id, Status::ok());
  } else if (op.verdict) {
    transfers_.finish_send(op.id, *op.verdict);
  }
}

void AmProtocol::take_verdict(std::uint64_t op_id, ucp_ep_h arrived_on, Status verdict) {
  op_id &= ~kBatchesWelcome;  // echoed by a receiver that does not know the bit
  SendOp* op = transfers_.find_send(op_id);
  // Only the peer the send went to may answer it; a late verdict finds its send gone.
  if (op == nullptr || !(op->confirmed || op->shared) || arrived_on == nullptr ||
      endpoints_.id_of(arrived_on) != op->endpoint) {
    logger()->debug("ignored a verdict for send {} (unknown, finished or from another peer)", op_id);
    return;
  }
  if (op->shared) {
    if (Endpoint* endpoint = endpoints_.find(op->endpoint)) endpoint->shared_answered = true;
  }
  if (op->request != nullptr) {
    op->verdict = std::move(verdict);  // the request's completion finishes it
  } else {
    transfers_.finish_send(op_id, verdict);
  }
}

ucs_status_t AmProtocol::on_verdict_am(void* arg, const void* header, std::size_t header_length, void* /*data*/,
                                       std::size_t /*length*/, const ucp_am_recv_param_t* param) {
  const auto* bytes = static_cast<const std::byte*>(header);
  const auto code = header_length > kIdBytes ? static_cast<unsigned>(bytes[kIdBytes]) : 0xffU;
  if (code > static_cast<unsigned>(StatusCode::internal)) {
    logger()->debug("ignored a malformed verdict of {} bytes", header_length);
    return UCS_OK;
  }
  const std::string_view reason(reinterpret_cast<const char*>(bytes + kIdBytes + 1), header_length - kIdBytes - 1);
  const ucp_ep_h peer = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  static_cast<AmProtocol*>(arg)->take_verdict(get_le<std::uint64_t>(bytes), peer, verdict_of(code, reason));
  return UCS_OK;
}

ucs_status_t AmProtocol::on_verdict_batch_am(void* arg, const void* header, std::size_t header_length, void* /*data*/,
                                             std::size_t /*length*/, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<AmProtocol*>(arg);
  const ucp_ep_h peer = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  const auto* bytes = static_cast<const std::byte*>(header);
  std::size_t at = 0;
  // Entries up to the first malformed one (whose sends then time out, as unanswered).
  while (header_length - at >= kIdBytes + 3) {
    const auto code = static_cast<unsigned>(bytes[at + kIdBytes]);
    const auto reason_length = get_le<std::uint16_t>(bytes + at + kIdBytes + 1);
    if (code > static_cast<unsigned>(StatusCode::internal) || header_length - at - kIdBytes - 3 < reason_length) break;
    const std::string_view reason(reinterpret_cast<const char*>(bytes + at + kIdBytes + 3), reason_length);
    self->take_verdict(get_le<std::uint64_t>(bytes + at), peer, verdict_of(code, reason));
    at += kIdBytes + 3 + reason_length;
  }
  if (at != header_length) logger()->debug("ignored the malformed end of a verdict batch of {} bytes", header_length);
  return UCS_OK;
}

// --- receiving -----------------------------------------------------------------

ucs_status_t AmProtocol::on_data_am(void* arg, const void* header, std::size_t header_length, void* data,
                                    std::size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<AmProtocol*>(arg)->receive_data(
      std::span(static_cast<const std::byte*>(header), header_length), data, length,
      (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0,
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr);
}

ucs_status_t AmProtocol::on_confirmed_data_am(void* arg, const void* header, std::size_t header_length, void* data,
                                              std::size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<AmProtocol*>(arg);
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const ucp_ep_h sender = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  if (header_length < kIdBytes || sender == nullptr) {  // nobody to answer: its sender times out
    self->stats_.landings_rejected.fetch_add(1);
    return rendezvous ? UCS_ERR_REJECTED : UCS_OK;
  }
  const auto* bytes = static_cast<const std::byte*>(header);
  const auto id = get_le<std::uint64_t>(bytes);
  return self->receive_data(std::span(bytes + kIdBytes, header_length - kIdBytes), data, length, rendezvous, sender,
                            Confirms{id & ~kBatchesWelcome, (id & kBatchesWelcome) != 0});
}

ucs_status_t AmProtocol::on_shared_data_am(void* arg, const void* header, std::size_t header_length, void* /*data*/,
                                           std::size_t /*length*/, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<AmProtocol*>(arg);
  const ucp_ep_h sender = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  const auto bytes = std::span(static_cast<const std::byte*>(header), header_length);
  const auto ref = bytes.size() >= kIdBytes ? decode_shared_source(bytes.subspan(kIdBytes)) : std::nullopt;
  if (!ref || sender == nullptr) {  // nobody to answer, or nothing to copy: its sender times out
    logger()->debug("ignored a malformed shared payload message of {} bytes", header_length);
    self->stats_.landings_rejected.fetch_add(1);
    return UCS_OK;
  }
  const auto id = get_le<std::uint64_t>(bytes.data());
  auto source = self->shared_sources_ ? self->mappings_.source(*ref)
                                      : Result<const std::byte*>(unavailable("shared sources are off on this side"));
  self->publish_mapped_bytes();
  if (!source) {  // laid out as a verdict, under its own message id
    static_cast<void>(
        self->send_message(sender, kSharedRefusedAm, encode_verdict(id & ~kBatchesWelcome, source.status())));
    return UCS_OK;
  }
  // As an eager payload: resolved, copied (from the sender's memory), answered.
  static_cast<void>(self->receive_data(bytes.subspan(kIdBytes + kSharedSourceRefBytes),
                                       // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): only read (eager path)
                                       const_cast<std::byte*>(*source), ref->length, /*rendezvous=*/false, sender,
                                       Confirms{id & ~kBatchesWelcome, (id & kBatchesWelcome) != 0}, ref->copy_by_ns));
  return UCS_OK;
}

ucs_status_t AmProtocol::on_shared_refused_am(void* arg, const void* header, std::size_t header_length, void* /*data*/,
                                              std::size_t /*length*/, const ucp_am_recv_param_t* param) {
  if (header_length <= kIdBytes) return UCS_OK;
  const auto* bytes = static_cast<const std::byte*>(header);
  const ucp_ep_h peer = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  const std::string_view reason(reinterpret_cast<const char*>(bytes + kIdBytes + 1), header_length - kIdBytes - 1);
  static_cast<AmProtocol*>(arg)->resend_refused(get_le<std::uint64_t>(bytes), peer, reason);
  return UCS_OK;
}

ucs_status_t AmProtocol::on_shared_gone_am(void* arg, const void* header, std::size_t header_length, void* /*data*/,
                                           std::size_t /*length*/, const ucp_am_recv_param_t* /*param*/) {
  if (auto file = decode_shared_file(std::span(static_cast<const std::byte*>(header), header_length))) {
    auto* self = static_cast<AmProtocol*>(arg);
    self->mappings_.forget(*file);
    self->publish_mapped_bytes();
  }
  return UCS_OK;
}

void AmProtocol::send_verdict(ucp_ep_h receiver_side, std::uint64_t op_id, const Status& verdict) {
  static_cast<void>(
      send_message(receiver_side, kVerdictAm, encode_verdict(op_id, verdict)));  // unanswered: its deadline
}

Status AmProtocol::send_message(ucp_ep_h ep, unsigned am_id, std::vector<std::byte> message) {
  // The header must outlive the send (UCX 1.13 has no flag to copy it): the request's
  // callback frees it when UCX did not send it at once.
  auto held = std::make_unique<std::vector<std::byte>>(std::move(message));
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  params.cb.send = &AmProtocol::on_verdict_sent;
  params.user_data = held.get();
  params.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  void* request = ucp_am_send_nbx(ep, am_id, held->data(), held->size(), nullptr, 0, &params);
  if (request == nullptr) return Status::ok();
  if (UCS_PTR_IS_ERR(request)) {
    logger()->debug("could not send message {}: {}", am_id, ucs_status_string(UCS_PTR_STATUS(request)));
    return ucx_error(fmt::format("ucp_am_send_nbx (message {})", am_id), UCS_PTR_STATUS(request));
  }
  static_cast<void>(held.release());  // on_verdict_sent owns it now
  return Status::ok();
}

void AmProtocol::answer_endpoint(std::uint64_t sender_endpoint, std::uint64_t op_id, bool batches,
                                 const Status& verdict) {
  if (batches) {
    held_verdicts_.push_back(HeldVerdict{sender_endpoint, op_id, verdict});
    if (held_verdicts_.size() >= kMaxHeldVerdicts) send_held_verdicts();
    return;
  }
  if (const Endpoint* endpoint = endpoints_.find(sender_endpoint); endpoint != nullptr && !endpoint->failed) {
    send_verdict(endpoint->ep, op_id, verdict);
  }
}

bool AmProtocol::send_held_verdicts() {
  if (held_verdicts_.empty()) return false;
  // The two buffers take turns, so that neither is grown again from empty each pass:
  // at 64 KiB items a pass holds tens of verdicts, and regrowing past 1 KiB made glibc
  // sweep its fast bins on this thread every pass.
  std::vector<HeldVerdict> held = std::exchange(held_verdicts_, std::move(spare_verdicts_));
  held_verdicts_.clear();
  // Almost always one endpoint: each pass takes the first endpoint's verdicts, in
  // order, and keeps the others for the next.
  while (!held.empty()) {
    const std::uint64_t endpoint_id = held.front().endpoint;
    const Endpoint* endpoint = endpoints_.find(endpoint_id);
    const bool usable = endpoint != nullptr && !endpoint->failed;
    std::vector<std::byte> message;
    message.reserve(std::min(kMaxVerdictBatchBytes, held.size() * kBatchEntryBytes));
    auto keep = held.begin();
    for (auto it = held.begin(); it != held.end(); ++it) {
      if (it->endpoint != endpoint_id) {
        if (keep != it) *keep = std::move(*it);
        ++keep;
        continue;
      }
      if (!usable) continue;
      if (message.size() >= kMaxVerdictBatchBytes) {
        static_cast<void>(send_message(endpoint->ep, kVerdictBatchAm, std::move(message)));
        message.clear();
      }
      append_batch_entry(message, it->op_id, it->verdict);
    }
    if (usable && !message.empty()) static_cast<void>(send_message(endpoint->ep, kVerdictBatchAm, std::move(message)));
    held.erase(keep, held.end());
  }
  spare_verdicts_ = std::move(held);  // empty, its capacity kept
  return true;
}

void AmProtocol::on_verdict_sent(void* request, ucs_status_t /*status*/, void* user_data) {
  const std::unique_ptr<std::vector<std::byte>> message(static_cast<std::vector<std::byte>*>(user_data));
  ucp_request_free(request);
}

ucs_status_t AmProtocol::receive_data(std::span<const std::byte> header, void* data, std::uint64_t length,
                                      bool rendezvous, ucp_ep_h sender, std::optional<Confirms> confirms,
                                      std::optional<std::uint64_t> copy_by_ns) {
  // The endpoint the payload arrives on, when it is one of ours (socket-address
  // listeners accept every sender as an endpoint with peer-failure handling).
  const std::uint64_t sender_endpoint = endpoints_.id_of(sender);
  auto answer = [&](const Status& verdict) {
    if (!confirms) return;
    if (sender_endpoint != 0) {
      answer_endpoint(sender_endpoint, confirms->op_id, confirms->batches, verdict);
    } else {
      send_verdict(sender, confirms->op_id, verdict);  // UCX's reply endpoint, used while it is given
    }
  };
  auto turn_away = [&](const Status& why, ucs_status_t rendezvous_answer) {
    stats_.landings_rejected.fetch_add(1);
    answer(why);
    return rendezvous ? rendezvous_answer : UCS_OK;  // eager bytes are simply dropped
  };
  if (rendezvous && sender_endpoint != 0 && endpoints_.find(sender_endpoint)->failed) {
    return turn_away(unavailable("the sender's connection failed"), UCS_ERR_REJECTED);
  }
  auto landing = transfers_.resolve_landing(header, length);
  if (!landing) {
    logger()->debug("rejected a payload of {} bytes: {}", length, landing.status().to_string());
    return turn_away(landing.status(), refusal_status(landing.status()));
  }
  auto pending = transfers_.new_landing(header, *landing);
  if (landing->length != length || landing->destination == nullptr) {
    const auto refusal =
        invalid_argument(fmt::format("payload of {} bytes for a landing of {} bytes", length, landing->length));
    transfers_.report_landing(*pending, refusal, /*counted=*/false);
    return turn_away(refusal, refusal_status(refusal));
  }
  if (!rendezvous) {
    std::memcpy(landing->destination, data, length);
    if (copy_by_ns && stages::monotonic_ns() >= *copy_by_ns) {
      const auto late =
          timeout_error("copied out of the sender's shared memory after its deadline (it may have reused it)");
      transfers_.report_landing(*pending, late);
      answer(late);
      return UCS_OK;
    }
    if (copy_by_ns) stats_.shared_landings.fetch_add(1);
    transfers_.report_landing(*pending, Status::ok());
    answer(Status::ok());
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
    answer(Status::ok());
  } else if (UCS_PTR_IS_ERR(request)) {
    const Status failed = ucx_error("ucp_am_recv_data_nbx", UCS_PTR_STATUS(request));
    transfers_.report_landing(*pending, failed);
    answer(failed);
  } else {
    pending->request = request;
    if (confirms && sender_endpoint != 0) {
      // Looked up again when it has landed: the endpoint may have failed meanwhile (its
      // landings are then cut off, and this never runs).
      pending->after_landing = [this, sender_endpoint, confirmed = *confirms](const Status& landed) {
        answer_endpoint(sender_endpoint, confirmed.op_id, confirmed.batches, landed);
      };
    } else {
      answer(Status::ok());  // a worker-address peer: its reply endpoint is UCX's, used while it is given
    }
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
  auto after_landing = std::move(pending->after_landing);  // finish_landing destroys the landing
  const Status landed = status == UCS_OK ? Status::ok() : ucx_error("payload receive failed", status);
  transfers->finish_landing(id, landed);
  if (after_landing) after_landing(landed);
}

}  // namespace ecx::transport::ucx
