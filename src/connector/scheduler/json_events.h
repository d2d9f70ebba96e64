#pragma once
// A JSON reader that hands a nlohmann SAX handler the events nlohmann's own
// sax_parse would, for every text that parser accepts, and refuses what it refuses.
// The consumer's scheduler reads each request's ec_transfer_params from text:
// nlohmann's character-at-a-time lexer took about 2 us of a 200-byte document, most
// of the params read on the engine thread. This one scans plain runs of a string in
// one pass and appends them at once.
//
// Accepted: one value (RFC 8259) between optional whitespace, after an optional
// UTF-8 byte order mark, and ended by the end of the text or by a NUL byte (nlohmann
// reads one there as the end of its input); strings of well-formed UTF-8 (RFC 3629), escapes decoded
// (\u pairs joined, a lone surrogate refused), control characters refused;
// integers that fit reported as integers (negative: number_integer, else
// number_unsigned), the rest as number_float with their text; a finite float only.
// Nesting is bounded by memory, not by the stack.
//
// On a malformed text it returns false without calling parse_error (the scheduler's
// reader needs no position). A handler that returns false stops the read.

#include <string_view>

#include <nlohmann/json.hpp>

namespace ecx::scheduler::detail {

bool read_json_events(std::string_view text, nlohmann::json_sax<nlohmann::json>& handler);

}  // namespace ecx::scheduler::detail
