#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "ecx/wire/auth.h"

namespace ecx::wire {
namespace {

std::string as_string(const Mac& mac) { return std::string(reinterpret_cast<const char*>(mac.data()), mac.size()); }

TEST(WireAuth, SignAndVerify) {
  auto a = FrameAuthenticator::create("secret-one");
  ASSERT_TRUE(a.is_ok());
  const std::string body = "hello frame";
  const Mac mac = (*a)->sign(FrameKind::request, body);
  EXPECT_TRUE((*a)->verify(FrameKind::request, body, as_string(mac)));
  // Known answer: HMAC-SHA256("secret-one", "ECX1" "Q" "hello frame").
  EXPECT_EQ(mac, (*a)->sign(FrameKind::request, body));
}

TEST(WireAuth, TamperWrongKeyAndWrongDirectionAreRejected) {
  auto a = FrameAuthenticator::create("secret-one");
  auto b = FrameAuthenticator::create("secret-two");
  const std::string body = "hello frame";
  const std::string mac = as_string((*a)->sign(FrameKind::request, body));
  std::string altered = body;
  altered[0] ^= 1;
  EXPECT_FALSE((*a)->verify(FrameKind::request, altered, mac));
  EXPECT_FALSE((*b)->verify(FrameKind::request, body, mac));
  EXPECT_FALSE((*a)->verify(FrameKind::reply, body, mac)) << "a request cannot pass as a reply";
  EXPECT_FALSE((*a)->verify(FrameKind::request, body, mac.substr(0, 31)));
  EXPECT_FALSE((*a)->verify(FrameKind::request, body, ""));
  EXPECT_FALSE(FrameAuthenticator::create("").is_ok());
}

TEST(WireAuth, MacIsHmacSha256OverDomainKindAndBody) {
  // docs/protocol.md: MAC = HMAC-SHA256(secret, "ECX1" || kind || body). Computed
  // here independently with OpenSSL's one-shot HMAC, so a peer written from the
  // document alone agrees with us.
  const std::string secret = "Jefe";
  const std::string body = "what do ya want for nothing?";
  auto a = FrameAuthenticator::create(secret);
  for (auto [kind, letter] : {std::pair{FrameKind::request, 'Q'}, {FrameKind::reply, 'R'}, {FrameKind::event, 'E'}}) {
    const std::string data = std::string("ECX1") + letter + body;
    Mac expected{};
    unsigned int length = 0;
    HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
         reinterpret_cast<const unsigned char*>(data.data()), data.size(), expected.data(), &length);
    ASSERT_EQ(length, kMacBytes);
    EXPECT_EQ((*a)->sign(kind, body), expected) << letter;
  }
}

struct FakeWall {
  std::uint64_t now = 1'700'000'000'000;
  WallClock fn() {
    return [this] { return now; };
  }
};

TEST(WireAuth, ReplayGuardRefusesRepeatsAndStaleFrames) {
  FakeWall wall;
  ReplayGuard guard(ReplayGuard::Options{60'000, 4}, wall.fn());
  StampIssuer issuer(wall.fn());
  const AuthStamp s1 = issuer.next();
  const AuthStamp s2 = issuer.next();
  const AuthStamp s3 = issuer.next();
  EXPECT_TRUE(guard.check(s1).is_ok());
  EXPECT_TRUE(guard.check(s3).is_ok());
  EXPECT_TRUE(guard.check(s2).is_ok()) << "reordering within the window is fine";
  EXPECT_FALSE(guard.check(s1).is_ok());
  EXPECT_FALSE(guard.check(s2).is_ok());
  EXPECT_FALSE(guard.check(s3).is_ok());

  AuthStamp old = issuer.next();
  wall.now += 61'000;
  EXPECT_FALSE(guard.check(old).is_ok()) << "older than the window";
  AuthStamp future{old.sender, old.seq + 1, wall.now + 61'000};
  EXPECT_FALSE(guard.check(future).is_ok()) << "too far in the future";
  EXPECT_FALSE(guard.check(AuthStamp{0, 1, wall.now}).is_ok());
}

TEST(WireAuth, ReplayGuardWindowSlides) {
  FakeWall wall;
  ReplayGuard guard(ReplayGuard::Options{}, wall.fn());
  const std::uint64_t sender = 99;
  EXPECT_TRUE(guard.check({sender, 1, wall.now}).is_ok());
  EXPECT_TRUE(guard.check({sender, 200, wall.now}).is_ok());
  EXPECT_FALSE(guard.check({sender, 1, wall.now}).is_ok()) << "far behind the newest";
  EXPECT_TRUE(guard.check({sender, 199, wall.now}).is_ok());
  EXPECT_TRUE(guard.check({sender, 137, wall.now}).is_ok()) << "63 behind";
  EXPECT_FALSE(guard.check({sender, 137, wall.now}).is_ok());
  EXPECT_TRUE(guard.check({sender, 264, wall.now}).is_ok()) << "a jump of exactly 64";
  EXPECT_FALSE(guard.check({sender, 200, wall.now}).is_ok()) << "the old max is remembered as bit 63";
}

TEST(WireAuth, ReplayGuardForgetsTheLeastRecentSenderWhenFull) {
  FakeWall wall;
  ReplayGuard guard(ReplayGuard::Options{60'000, 2}, wall.fn());
  EXPECT_TRUE(guard.check({1, 1, wall.now}).is_ok());
  wall.now += 1;
  EXPECT_TRUE(guard.check({2, 1, wall.now}).is_ok());
  wall.now += 1;
  EXPECT_TRUE(guard.check({3, 1, wall.now}).is_ok());
  EXPECT_EQ(guard.tracked_senders(), 2u);
  EXPECT_FALSE(guard.check({2, 1, wall.now}).is_ok()) << "sender 2 is still tracked";
}

}  // namespace
}  // namespace ecx::wire
