#pragma once
// Optional authentication of control frames with a shared secret.
//
// An authenticated message is two ZeroMQ frames: the msgpack body, which carries an
// AuthStamp (sid, seq, ts), and HMAC-SHA256(secret, "ECX1" || kind || body), 32
// bytes. The MAC proves the sender holds the secret and that no byte was changed;
// the stamp, checked by a ReplayGuard, makes a captured frame useless: its time
// must be within the window and its (sid, seq) pair must not have been seen.

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <unordered_map>

#include "ecx/core/status.h"
#include "ecx/wire/codec.h"
#include "ecx/wire/protocol.h"

namespace ecx::wire {

inline constexpr std::size_t kMacBytes = 32;
using Mac = std::array<unsigned char, kMacBytes>;

// Milliseconds since the Unix epoch; replaceable in tests.
using WallClock = std::function<std::uint64_t()>;
WallClock system_wall_clock();

class FrameAuthenticator {
 public:
  // Fails for an empty secret or when OpenSSL cannot provide HMAC-SHA256.
  static Result<std::unique_ptr<FrameAuthenticator>> create(std::string_view secret);
  ~FrameAuthenticator();
  FrameAuthenticator(const FrameAuthenticator&) = delete;
  FrameAuthenticator& operator=(const FrameAuthenticator&) = delete;

  // Thread-safe: each call works on its own copy of the keyed context.
  Mac sign(FrameKind kind, std::string_view body) const;
  // Constant-time comparison; false for a MAC of the wrong length.
  bool verify(FrameKind kind, std::string_view body, std::string_view mac) const;

 private:
  struct Impl;
  explicit FrameAuthenticator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Hands out stamps for one sending socket: a random sender id and a sequence that
// only grows. Not thread-safe; one per socket owner.
class StampIssuer {
 public:
  explicit StampIssuer(WallClock wall_clock = system_wall_clock());
  AuthStamp next();
  std::uint64_t sender() const noexcept { return sender_; }

 private:
  WallClock wall_clock_;
  std::uint64_t sender_;
  std::uint64_t seq_ = 0;
};

// Refuses stamps outside the time window and (sender, seq) pairs already seen. Per
// sender it keeps the highest seq and a 64-entry bitmap below it, so reordering of up
// to 64 frames is tolerated; senders are forgotten least-recently-seen first beyond
// max_senders. Not thread-safe; one per receiving socket owner.
class ReplayGuard {
 public:
  struct Options {
    std::uint64_t window_ms = 60'000;
    std::size_t max_senders = 65'536;
  };
  explicit ReplayGuard(Options options, WallClock wall_clock = system_wall_clock());
  ReplayGuard() : ReplayGuard(Options{}) {}

  // Records the stamp when it is accepted.
  Status check(const AuthStamp& stamp);
  std::size_t tracked_senders() const noexcept { return senders_.size(); }

 private:
  struct SenderState {
    std::uint64_t max_seq = 0;
    std::uint64_t seen_below = 0;  // bit i set: max_seq - 1 - i was seen
    std::uint64_t last_seen_ms = 0;
  };
  void evict_oldest();

  Options options_;
  WallClock wall_clock_;
  std::unordered_map<std::uint64_t, SenderState> senders_;
};

// Everything one socket owner needs: nullptr members when authentication is off.
struct FrameSecurity {
  std::shared_ptr<const FrameAuthenticator> authenticator;  // shared, thread-safe
  // Builds one from Config::auth_secret ("" = authentication off).
  static Result<FrameSecurity> from_secret(std::string_view secret);
  bool enabled() const noexcept { return authenticator != nullptr; }
};

}  // namespace ecx::wire
