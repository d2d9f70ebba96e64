#include "ecx/wire/auth.h"

#include <chrono>
#include <limits>
#include <random>

#include <fmt/format.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

namespace ecx::wire {
namespace {

constexpr std::string_view kDomain = "ECX1";

struct MacDeleter {
  void operator()(EVP_MAC* mac) const { EVP_MAC_free(mac); }
};
struct CtxDeleter {
  void operator()(EVP_MAC_CTX* ctx) const { EVP_MAC_CTX_free(ctx); }
};
using MacPtr = std::unique_ptr<EVP_MAC, MacDeleter>;
using CtxPtr = std::unique_ptr<EVP_MAC_CTX, CtxDeleter>;

std::uint64_t random_nonzero() {
  std::random_device device;
  for (;;) {
    const std::uint64_t v = (static_cast<std::uint64_t>(device()) << 32) ^ device();
    if (v != 0) return v;
  }
}

}  // namespace

WallClock system_wall_clock() {
  return [] {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count());
  };
}

struct FrameAuthenticator::Impl {
  MacPtr mac;
  CtxPtr keyed;  // initialised with the key; duplicated per call
};

FrameAuthenticator::FrameAuthenticator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FrameAuthenticator::~FrameAuthenticator() = default;

Result<std::unique_ptr<FrameAuthenticator>> FrameAuthenticator::create(std::string_view secret) {
  if (secret.empty()) return invalid_argument("the authentication secret is empty");
  auto impl = std::make_unique<Impl>();
  impl->mac.reset(EVP_MAC_fetch(nullptr, "HMAC", nullptr));
  if (!impl->mac) return internal_error("OpenSSL provides no HMAC");
  impl->keyed.reset(EVP_MAC_CTX_new(impl->mac.get()));
  if (!impl->keyed) return internal_error("EVP_MAC_CTX_new failed");
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_construct_end()};
  if (EVP_MAC_init(impl->keyed.get(), reinterpret_cast<const unsigned char*>(secret.data()), secret.size(), params) !=
      1) {
    return internal_error("HMAC-SHA256 initialisation failed");
  }
  return std::unique_ptr<FrameAuthenticator>(new FrameAuthenticator(std::move(impl)));
}

Mac FrameAuthenticator::sign(FrameKind kind, std::string_view body) const {
  Mac out{};
  CtxPtr ctx(EVP_MAC_CTX_dup(impl_->keyed.get()));
  const char kind_byte = static_cast<char>(kind);
  std::size_t length = 0;
  // A failure leaves an all-zero MAC, which verify() never accepts from a peer
  // because the peer computes a real one.
  if (!ctx || EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(kDomain.data()), kDomain.size()) != 1 ||
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(&kind_byte), 1) != 1 ||
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(body.data()), body.size()) != 1 ||
      EVP_MAC_final(ctx.get(), out.data(), &length, out.size()) != 1 || length != out.size()) {
    out.fill(0);
  }
  return out;
}

bool FrameAuthenticator::verify(FrameKind kind, std::string_view body, std::string_view mac) const {
  if (mac.size() != kMacBytes) return false;
  const Mac expected = sign(kind, body);
  Mac zero{};
  if (CRYPTO_memcmp(expected.data(), zero.data(), kMacBytes) == 0) return false;
  return CRYPTO_memcmp(expected.data(), mac.data(), kMacBytes) == 0;
}

StampIssuer::StampIssuer(WallClock wall_clock) : wall_clock_(std::move(wall_clock)), sender_(random_nonzero()) {}

AuthStamp StampIssuer::next() { return AuthStamp{sender_, ++seq_, wall_clock_()}; }

ReplayGuard::ReplayGuard(Options options, WallClock wall_clock)
    : options_(options), wall_clock_(std::move(wall_clock)) {}

Status ReplayGuard::check(const AuthStamp& stamp) {
  const std::uint64_t now = wall_clock_();
  const std::uint64_t skew = now > stamp.time_ms ? now - stamp.time_ms : stamp.time_ms - now;
  if (skew > options_.window_ms) {
    return protocol_error(
        fmt::format("frame time is {} ms away from this host's clock (window {} ms)", skew, options_.window_ms));
  }
  if (stamp.sender == 0 || stamp.seq == 0) return protocol_error("frame stamp has a zero sender or sequence");
  auto it = senders_.find(stamp.sender);
  if (it == senders_.end()) {
    if (senders_.size() >= options_.max_senders) evict_oldest();
    senders_.emplace(stamp.sender, SenderState{stamp.seq, 0, now});
    return Status::ok();
  }
  SenderState& s = it->second;
  if (stamp.seq > s.max_seq) {
    const std::uint64_t shift = stamp.seq - s.max_seq;
    // The old max becomes bit (shift - 1); older bits slide along with it.
    if (shift < 64) {
      s.seen_below = (s.seen_below << shift) | (std::uint64_t{1} << (shift - 1));
    } else {
      s.seen_below = shift == 64 ? std::uint64_t{1} << 63 : 0;
    }
    s.max_seq = stamp.seq;
    s.last_seen_ms = now;
    return Status::ok();
  }
  if (stamp.seq == s.max_seq) return protocol_error("replayed frame (sequence already seen)");
  const std::uint64_t behind = s.max_seq - stamp.seq;  // >= 1
  if (behind > 64) return protocol_error("frame sequence too far behind (replay or heavy reordering)");
  const std::uint64_t bit = std::uint64_t{1} << (behind - 1);
  if (s.seen_below & bit) return protocol_error("replayed frame (sequence already seen)");
  s.seen_below |= bit;
  s.last_seen_ms = now;
  return Status::ok();
}

void ReplayGuard::evict_oldest() {
  // O(n) but only when the table is full, i.e. after max_senders distinct
  // authenticated senders: rare by construction.
  auto oldest = senders_.begin();
  for (auto it = senders_.begin(); it != senders_.end(); ++it) {
    if (it->second.last_seen_ms < oldest->second.last_seen_ms) oldest = it;
  }
  if (oldest != senders_.end()) senders_.erase(oldest);
}

Result<FrameSecurity> FrameSecurity::from_secret(std::string_view secret) {
  FrameSecurity out;
  if (secret.empty()) return out;
  auto auth = FrameAuthenticator::create(secret);
  if (!auth) return auth.status();
  out.authenticator = std::move(*auth);
  return out;
}

}  // namespace ecx::wire
