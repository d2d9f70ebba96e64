// libFuzzer target for the control-frame decoders and the data plane's payload
// header (reserved and direct). Any input must come back as a
// value (never a crash, an exception, a leak or undefined behaviour), and whatever
// decodes must survive encode -> decode unchanged.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>

#include "ecx/wire/codec.h"
#include "ecx/wire/payload_header.h"

namespace {

void check(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view frame(reinterpret_cast<const char*>(data), size);
  const ecx::wire::Limits limits;
  std::string again;

  ecx::wire::Envelope envelope;
  if (auto request = ecx::wire::decode_request(frame, limits, &envelope)) {
    check(envelope.reason == ecx::wire::RejectReason::none);
    ecx::wire::encode_request(request->request, envelope.stamp ? &*envelope.stamp : nullptr, again);
    auto back = ecx::wire::decode_request(again, ecx::wire::Limits{.max_frame_bytes = 64 << 20});
    check(back.is_ok());
    check(back->item_errors.empty());
    check(back->request.id == request->request.id);
    check(back->request.body == request->request.body);
  } else {
    check(envelope.reason != ecx::wire::RejectReason::none);
  }

  if (auto reply = ecx::wire::decode_reply(frame, limits)) {
    ecx::wire::encode_reply(*reply, nullptr, again);
    auto back = ecx::wire::decode_reply(again, ecx::wire::Limits{.max_frame_bytes = 64 << 20});
    check(back.is_ok());
    check(back->id == reply->id && back->status == reply->status && back->body == reply->body);
  }

  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  if (auto header = ecx::wire::decode_payload_header(bytes)) {
    auto back = ecx::wire::decode_payload_header(ecx::wire::encode_payload_header(*header));
    check(back.is_ok());
    check(*back == *header);
  }

  if (auto event = ecx::wire::decode_event(frame, limits)) {
    ecx::wire::encode_event(*event, nullptr, again);
    auto back = ecx::wire::decode_event(again, ecx::wire::Limits{.max_frame_bytes = 64 << 20});
    check(back.is_ok());
    check(*back == *event);
  }
  return 0;
}
