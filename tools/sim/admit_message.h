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

#include <zmq.hpp>

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

// One ZeroMQ message of the admit channel, read off the consumer's ROUTER socket
// without waiting: the producer's routing id, then one admit message per part (a
// producer sends a step's requests as the parts of one message, so that the channel
// wakes once per step). nullopt when none is queued.
struct AdmitBatch {
  std::string sender;                                                 // the producer's routing id: where answers go
  std::vector<Result<std::variant<AdmitRequest, AdmitDone>>> admits;  // in order; an unreadable part: why
};
std::optional<AdmitBatch> receive_admits(zmq::socket_t& router);
Result<AdmitAnswer> decode_answer(std::string_view message);

}  // namespace ecx::sim
