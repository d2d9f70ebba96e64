#pragma once
// The admin API's JSON for the roster: the body that registers an instance and the
// rendering of a snapshot. Private to the proxy: the public header
// (ecx/proxy/roster.h) exposes no JSON type.

#include <nlohmann/json.hpp>

#include "ecx/core/status.h"
#include "ecx/proxy/roster.h"

namespace ecx::proxy {

// Parses an admin API body {role, url, ec_zmq_addrs?, dp_size?, dp_rank?}.
Result<InstanceSpec> parse_instance_spec(const nlohmann::json& body);

// {"encode": {"live": [...], "evicted": [...]}, "prefill": ..., "decode": ...}
nlohmann::json snapshot_json(const RosterSnapshot& snapshot);

}  // namespace ecx::proxy
