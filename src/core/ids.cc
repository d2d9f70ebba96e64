#include "ecx/core/ids.h"

#include <algorithm>
#include <iterator>
#include <random>

#include <fmt/format.h>

namespace ecx {
namespace {

bool is_id_char(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  switch (c) {
    case '-':
    case '_':
    case '.':
    case ':':
    case '/':
    case '@':
    case '+':
    case '=':
    case '#':
    case '~':
      return true;
    default:
      return false;
  }
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

Status validate_id(std::string_view id, std::string_view what) {
  if (id.empty()) return invalid_argument(fmt::format("{} must not be empty", what));
  if (id.size() > kMaxIdLength) {
    return invalid_argument(fmt::format("{} is {} characters long; the maximum is {}", what, id.size(), kMaxIdLength));
  }
  for (std::size_t i = 0; i < id.size(); ++i) {
    if (!is_id_char(id[i])) {
      return invalid_argument(
          fmt::format("{} has an invalid character (code {}) at position {}; allowed: letters, digits and -_.:/@+=#~",
                      what, static_cast<int>(static_cast<unsigned char>(id[i])), i));
    }
  }
  return Status::ok();
}

std::string id_from_text(std::string_view text, std::size_t max_length) {
  max_length = std::min(max_length, kMaxIdLength);
  std::string id;
  id.reserve(text.size());
  for (const char c : text) {
    if (is_id_char(c) && c != '~') {
      id.push_back(c);
    } else {
      fmt::format_to(std::back_inserter(id), "~{:02x}", static_cast<unsigned char>(c));
    }
    if (id.size() > max_length) break;
  }
  if (!id.empty() && id.size() <= max_length) return id;
  // FNV-1a, twice from different offsets: 128 bits, the same in every process (unlike
  // std::hash, which no standard fixes). 'h' is no hex digit: no escaped text reads so.
  auto fnv1a = [&](std::uint64_t h) {
    for (const char c : text) {
      h ^= static_cast<unsigned char>(c);
      h *= 0x100000001b3ULL;
    }
    return h;
  };
  return fmt::format("~h{:016x}{:016x}", fnv1a(0xcbf29ce484222325ULL), fnv1a(0x84222325cbf29ce4ULL));
}

ReservationId ReservationId::random() {
  thread_local std::mt19937_64 generator{[] {
    std::random_device device;
    std::seed_seq seed{device(), device(), device(), device()};
    return std::mt19937_64(seed);
  }()};
  for (;;) {
    const ReservationId id(generator(), generator());
    if (!id.is_none()) return id;
  }
}

Result<ReservationId> ReservationId::parse(std::string_view hex) {
  if (hex.size() != 32) {
    return invalid_argument(fmt::format("reservation_id must be 32 hex digits, got {} characters", hex.size()));
  }
  std::uint64_t parts[2] = {0, 0};
  for (std::size_t i = 0; i < 32; ++i) {
    const int v = hex_value(hex[i]);
    if (v < 0) return invalid_argument("reservation_id must be 32 hex digits");
    parts[i / 16] = (parts[i / 16] << 4) | static_cast<std::uint64_t>(v);
  }
  return ReservationId(parts[0], parts[1]);
}

std::string ReservationId::to_string() const { return fmt::format("{:016x}{:016x}", hi_, lo_); }

}  // namespace ecx
