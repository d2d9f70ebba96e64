#include "ecx/core/status.h"

#include <array>
#include <cstring>

namespace ecx {
namespace {
constexpr std::array<std::string_view, 10> kNames = {
    "ok",      "invalid_argument",   "not_found", "conflict", "unavailable",
    "timeout", "resource_exhausted", "cancelled", "protocol", "internal",
};
}  // namespace

std::string_view status_code_name(StatusCode code) noexcept {
  const auto index = static_cast<std::size_t>(code);
  return index < kNames.size() ? kNames[index] : std::string_view("unknown");
}

std::optional<StatusCode> parse_status_code(std::string_view name) noexcept {
  for (std::size_t i = 0; i < kNames.size(); ++i) {
    if (kNames[i] == name) return static_cast<StatusCode>(i);
  }
  return std::nullopt;
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  std::string out(status_code_name(code_));
  out += ": ";
  out += message_;
  return out;
}

Status invalid_argument(std::string message) { return {StatusCode::invalid_argument, std::move(message)}; }
Status not_found(std::string message) { return {StatusCode::not_found, std::move(message)}; }
Status conflict(std::string message) { return {StatusCode::conflict, std::move(message)}; }
Status unavailable(std::string message) { return {StatusCode::unavailable, std::move(message)}; }
Status timeout_error(std::string message) { return {StatusCode::timeout, std::move(message)}; }
Status resource_exhausted(std::string message) { return {StatusCode::resource_exhausted, std::move(message)}; }
Status cancelled(std::string message) { return {StatusCode::cancelled, std::move(message)}; }
Status protocol_error(std::string message) { return {StatusCode::protocol, std::move(message)}; }
Status internal_error(std::string message) { return {StatusCode::internal, std::move(message)}; }

std::string errno_text(int err) {
  std::array<char, 256> buffer{};
  // glibc's GNU strerror_r: returns the message, in `buffer` or a static string.
  return ::strerror_r(err, buffer.data(), buffer.size());
}

}  // namespace ecx
