#pragma once
// Identifiers that cross process boundaries. Transfer ids and mm_hashes come from
// requests, so they are validated before they index anything.

#include <array>
#include <compare>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "ecx/core/status.h"

namespace ecx {

inline constexpr std::size_t kMaxIdLength = 256;

// 1..256 characters from [A-Za-z0-9] and "-_.:/@+=#~". `what` names the field in the
// error ("transfer_id", "mm_hash").
Status validate_id(std::string_view id, std::string_view what);
inline Status validate_transfer_id(std::string_view id) { return validate_id(id, "transfer_id"); }
inline Status validate_mm_hash(std::string_view id) { return validate_id(id, "mm_hash"); }

// An id made from any text, at most `max_length` (<= kMaxIdLength, >= 34) characters,
// the same for the same text in every process: the text with each character outside
// the alphabet, and '~', written as "~" and two hex digits; or, where that is empty or
// longer than `max_length`, "~h" and 32 hex digits of a 128-bit hash of the text.
// Distinct texts give distinct ids (but for a hash collision). For names ECX makes
// up from a caller's text, such as a request id.
std::string id_from_text(std::string_view text, std::size_t max_length = kMaxIdLength);

// A random 128-bit reservation id; the zero value means "none".
class ReservationId {
 public:
  constexpr ReservationId() = default;
  constexpr ReservationId(std::uint64_t hi, std::uint64_t lo) : hi_(hi), lo_(lo) {}

  // Cryptographically unpredictable is not needed; uniqueness is. Uses a per-thread
  // generator seeded from std::random_device.
  static ReservationId random();
  // 32 lowercase hex digits.
  static Result<ReservationId> parse(std::string_view hex);

  bool is_none() const noexcept { return hi_ == 0 && lo_ == 0; }
  std::uint64_t hi() const noexcept { return hi_; }
  std::uint64_t lo() const noexcept { return lo_; }
  std::string to_string() const;

  // NOLINTNEXTLINE(modernize-use-nullptr): clang-tidy 14 misreads a defaulted comparison
  friend constexpr auto operator<=>(const ReservationId&, const ReservationId&) = default;

 private:
  std::uint64_t hi_ = 0;
  std::uint64_t lo_ = 0;
};

struct ReservationIdHash {
  std::size_t operator()(const ReservationId& id) const noexcept {
    return std::hash<std::uint64_t>{}(id.hi() ^ (id.lo() * 0x9e3779b97f4a7c15ULL));
  }
};

}  // namespace ecx
