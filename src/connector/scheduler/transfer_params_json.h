#pragma once
// ec_transfer_params from an already parsed JSON value, for the callers that hold
// one (the engine simulators, tests, fuzzers), and the string writer of the callers
// that write params as text. The public headers take JSON text
// (parse_ec_transfer_params_text, RequestView::set_ec_transfer_params_text) so that
// they expose no JSON library; the rules are the same.

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ecx/connector/scheduler/transfer_params.h"
#include "ecx/connector/scheduler/types.h"
#include "ecx/core/status.h"

namespace ecx::scheduler {

// `value` must be a JSON object (callers map JSON null to "no params" themselves).
Result<EcTransferParams> parse_ec_transfer_params(const nlohmann::json& value);

// Parses and stores `request`'s ec_transfer_params (JSON null = none). Never
// throws; a malformed value is recorded in request.ec_transfer_params_error.
void set_ec_transfer_params(RequestView& request, const nlohmann::json& value);

// Appends `text` to `out` as a JSON string, for params written as text directly: a
// JSON tree built and dumped once per request cost more than the work around it (the
// producer's request_finished, the engine simulator's params). Printable ASCII with
// no quote or backslash (every validated id, ids.h) goes in as it is; anything else
// through nlohmann's escaping, bytes that are not UTF-8 as U+FFFD (never a throw).
void append_json_string(std::string& out, std::string_view text);

}  // namespace ecx::scheduler
