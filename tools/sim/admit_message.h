#pragma once
// The simulators' admit channel (the stand-in for a proxy between encoder and PD
// instance), in msgpack: a producer forwards each finished request, then says it is
// done; the consumer answers each resolved request to a producer that asked. Binary
// rather than JSON because the channel's cost is the simulator's, charged against the
// CPU ECX has on a small host: JSON documents cost both simulators about 15 us per
// item at 64 KiB, 32 in flight, on 2 CPUs.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ecx/core/status.h"
#include "sim/workload.h"

namespace ecx::sim {

struct AdmitRequest {
  std::string request_id;
  std::optional<std::int64_t> encoded_at_ns;  // the encoder handed its last output to ECX (steady clock)
  bool wants_answer = false;                  // the producer paces itself by the answers
  std::vector<Item> items;                    // transfer_id empty for an item the proxy found in the store
  // The encoder's ec_transfer_params as JSON text, whose "ec_items" a proxy forwards;
  // empty: none.
  std::string ec_transfer_params;
};

// What encode_admit writes, borrowed from the producer's own request (no copy of
// its items per message).
struct AdmitRequestView {
  std::string_view request_id;
  std::optional<std::int64_t> encoded_at_ns;
  bool wants_answer = false;
  std::span<const Item> items;
  std::string_view ec_transfer_params;
};

struct AdmitDone {
  std::uint64_t requests = 0;  // how many requests this producer forwarded in all
};

struct AdmitAnswer {
  std::string request_id;
  bool ready = false;
};

std::string encode_admit(const AdmitRequestView& request);
std::string encode_admit(const AdmitDone& done);
std::string encode_answer(const AdmitAnswer& answer);

// invalid_argument naming what is wrong for anything else (a message of a peer that
// is not a simulator, or of another version).
Result<std::variant<AdmitRequest, AdmitDone>> decode_admit(std::string_view message);

// What one producer's connection held when the consumer read it (admit_link.h): the
// producer's name there (where answers go), then its admit messages in order. A producer
// writes a step's requests at once, so that the consumer wakes once per step.
struct AdmitBatch {
  std::string sender;                                                 // where answers go
  std::vector<Result<std::variant<AdmitRequest, AdmitDone>>> admits;  // in order; an unreadable one: why
};
Result<AdmitAnswer> decode_answer(std::string_view message);

}  // namespace ecx::sim
