#pragma once
// What the transport tests and their helper process (transport_peer) agree on: the
// header the test layer puts on every payload, and the byte pattern payloads carry.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

namespace ecx::transport::testing {

enum HeaderFlags : std::uint32_t {
  kReject = 1,      // the receiver's resolver refuses it
  kStall = 2,       // the receiver's resolver never returns (a hung peer)
  kKillSender = 4,  // the receiving test kills the sender from inside its resolver
  kConfirm = 8,     // the sender uses send_confirmed(): it hears the receiver's verdict
  kHold = 16,       // the receiving test's resolver waits until the test lets it go
};

struct TestHeader {
  std::uint64_t index = 0;
  std::uint64_t source_offset = 0;   // where in the pattern the payload starts
  std::uint64_t landing_length = 0;  // what the receiver reserves
  std::uint32_t flags = 0;
  std::uint32_t padding = 0;
};

inline std::span<const std::byte> as_bytes(const TestHeader& header) {
  return {reinterpret_cast<const std::byte*>(&header), sizeof header};
}

inline std::optional<TestHeader> parse_header(std::span<const std::byte> bytes) {
  if (bytes.size() != sizeof(TestHeader)) return std::nullopt;
  TestHeader header;
  std::memcpy(&header, bytes.data(), sizeof header);
  return header;
}

// Both processes build the same pattern; a payload must land equal to
// pattern[source_offset, source_offset + length).
inline std::vector<std::byte> make_pattern(std::size_t size) {
  std::vector<std::byte> pattern(size);
  std::uint64_t state = 0x9e3779b97f4a7c15ULL;
  for (std::size_t i = 0; i < size; i += 8) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    std::memcpy(pattern.data() + i, &state, std::min<std::size_t>(8, size - i));
  }
  return pattern;
}

inline constexpr std::size_t kPatternBytes = 64ULL << 20;
inline constexpr std::uint64_t kMaxRandomPayload = 32ULL << 20;

}  // namespace ecx::transport::testing
