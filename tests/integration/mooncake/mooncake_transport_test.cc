// The Mooncake backend on its own: how it reports a missing or wrong library (always
// runs), and one-sided writes between two engines in this process (needs
// ECX_MOONCAKE_LIB; runs inside a private network namespace).
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <future>
#include <vector>

#include <gtest/gtest.h>

#include "ecx/transport/mooncake_transport.h"
#include "mooncake_test_support.h"

namespace ecx::transport {
namespace {

using namespace std::chrono_literals;

TEST(MooncakeLibrary, MissingLibraryNamesThePathAndHowToSetIt) {
  MooncakeOptions options;
  options.library_path = "/nonexistent/dir/libtransfer_engine.so";
  auto created = create_mooncake_transport(options);
  ASSERT_FALSE(created);
  EXPECT_EQ(created.status().code(), StatusCode::not_found);
  EXPECT_NE(created.status().message().find("/nonexistent/dir/libtransfer_engine.so"), std::string::npos);
  EXPECT_NE(created.status().message().find("ECX_MOONCAKE_LIB"), std::string::npos);
  EXPECT_NE(created.status().message().find("mooncake_lib"), std::string::npos);
}

TEST(MooncakeLibrary, LibraryWithoutTheCInterfaceNamesTheMissingSymbol) {
  // A library that certainly loads and certainly lacks Mooncake's functions: the C
  // math library this test links.
  Dl_info info{};
  ASSERT_NE(::dladdr(reinterpret_cast<void*>(static_cast<double (*)(double)>(&::cos)), &info), 0);
  ASSERT_NE(info.dli_fname, nullptr);
  const auto status = mooncake_library_available(info.dli_fname);
  ASSERT_FALSE(status);
  EXPECT_NE(status.message().find("createTransferEngine"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find(info.dli_fname), std::string::npos) << status.message();
}

TEST(MooncakeLibrary, PathComesFromConfigThenEnvironmentThenSearchPath) {
  EXPECT_EQ(mooncake_library_path("/opt/a/libtransfer_engine.so"), "/opt/a/libtransfer_engine.so");
  const char* env = std::getenv("ECX_MOONCAKE_LIB");  // NOLINT(concurrency-mt-unsafe): no thread sets it
  EXPECT_EQ(mooncake_library_path(""), env != nullptr && *env != '\0' ? env : "libtransfer_engine.so");
}

TEST(MooncakeLibrary, ProtocolIsTcpOrRdma) {
  EXPECT_TRUE(parse_mooncake_protocol("tcp"));  // also in transport_test, which needs no library
  EXPECT_TRUE(parse_mooncake_protocol("rdma"));
  auto bad = parse_mooncake_protocol("nvlink");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("tcp or rdma"), std::string::npos);
}

// Two engines in this process: a receiver with a registered pool and a sender with
// a registered source region.
class MooncakePair : public ::testing::Test {
 protected:
  static constexpr std::uint64_t kPool = 1 << 20;

  void SetUp() override {
    ECX_REQUIRE_MOONCAKE();
    auto receiver = create_mooncake_transport(MooncakeOptions{});
    ASSERT_TRUE(receiver) << receiver.status().to_string();
    receiver_ = std::move(*receiver);
    auto sender = create_mooncake_transport(MooncakeOptions{});
    ASSERT_TRUE(sender) << sender.status().to_string();
    sender_ = std::move(*sender);
    pool_.assign(kPool, std::byte{0});
    source_.resize(kPool);
    for (std::size_t i = 0; i < source_.size(); ++i) source_[i] = static_cast<std::byte>((i * 131 + 7) & 0xff);
    auto pool_region = receiver_->register_region(pool_.data(), pool_.size(), MemoryKind::host);
    ASSERT_TRUE(pool_region) << pool_region.status().to_string();
    auto source_region = sender_->register_region(source_.data(), source_.size(), MemoryKind::host);
    ASSERT_TRUE(source_region) << source_region.status().to_string();
    source_region_ = *source_region;
    auto segment = receiver_->listen("127.0.0.1", 0);
    ASSERT_TRUE(segment) << segment.status().to_string();
    EXPECT_EQ(*segment, receiver_->segment_name());
    // One-sided: the sender names the destination, so the layers above write().
    EXPECT_EQ(receiver_->capabilities().landing, LandingChoice::sender);
    EXPECT_TRUE(receiver_->capabilities().one_sided);
    auto endpoint = sender_->connect(*segment);
    ASSERT_TRUE(endpoint) << endpoint.status().to_string();
    endpoint_ = *endpoint;
  }

  // Writes and waits (bounded) for the write to settle.
  Status write_and_wait(std::uint64_t offset, std::uint64_t length, std::uint64_t remote) {
    std::promise<Status> done;
    auto future = done.get_future();
    auto status = sender_->write(endpoint_, source_region_, offset, length, remote, SteadyClock::shared()->now() + 30s,
                                 [&done](Status s) { done.set_value(std::move(s)); });
    if (!status) return status;
    if (future.wait_for(30s) != std::future_status::ready) return timeout_error("the write never settled");
    return future.get();
  }

  std::uint64_t pool_base() const { return reinterpret_cast<std::uint64_t>(pool_.data()); }

  std::vector<std::byte> pool_;
  std::vector<std::byte> source_;
  std::unique_ptr<MooncakeTransport> receiver_;
  std::unique_ptr<MooncakeTransport> sender_;
  RegionHandle source_region_;
  EndpointHandle endpoint_;
};

TEST_F(MooncakePair, WriteLandsExactlyAtTheNamedAddressAndNowhereElse) {
  constexpr std::uint64_t kAt = 4096;
  constexpr std::uint64_t kLength = 300'000;
  ASSERT_TRUE(write_and_wait(512, kLength, pool_base() + kAt));
  EXPECT_TRUE(std::equal(pool_.begin() + kAt, pool_.begin() + kAt + kLength, source_.begin() + 512));
  EXPECT_TRUE(std::all_of(pool_.begin(), pool_.begin() + kAt, [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_TRUE(std::all_of(pool_.begin() + kAt + kLength, pool_.end(), [](std::byte b) { return b == std::byte{0}; }));
  const auto stats = sender_->stats();
  EXPECT_EQ(stats.sends_ok, 1U);
  EXPECT_EQ(stats.bytes_sent, kLength);
}

TEST_F(MooncakePair, WriteBeyondTheRegisteredPoolFailsAndWritesNothing) {
  const auto status = write_and_wait(0, 8192, pool_base() + kPool - 4096);  // half of it past the end
  EXPECT_FALSE(status);
  EXPECT_TRUE(std::all_of(pool_.begin(), pool_.end(), [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_EQ(sender_->stats().sends_ok, 0U);
}

TEST_F(MooncakePair, ReceiverChosenSendIsRefusedAndSourceRangeIsChecked) {
  std::array<std::byte, 4> header{};
  EXPECT_FALSE(sender_->send(endpoint_, header, source_region_, 0, 16, SteadyClock::shared()->now() + 1s,
                             [](const Status&) { ADD_FAILURE() << "a refused send must not call back"; }));
  EXPECT_FALSE(sender_->write(endpoint_, source_region_, kPool - 8, 16, pool_base(), SteadyClock::shared()->now() + 1s,
                              [](const Status&) { ADD_FAILURE() << "a refused write must not call back"; }));
}

TEST_F(MooncakePair, ManyConcurrentWritesAllLand) {
  constexpr int kWrites = 64;
  constexpr std::uint64_t kLength = kPool / kWrites;
  std::vector<std::promise<Status>> done(kWrites);
  std::vector<std::future<Status>> settled;
  settled.reserve(done.size());
  for (auto& d : done) settled.push_back(d.get_future());
  for (int i = 0; i < kWrites; ++i) {
    const std::uint64_t at = static_cast<std::uint64_t>(kWrites - 1 - i) * kLength;  // reversed order
    ASSERT_TRUE(sender_->write(endpoint_, source_region_, static_cast<std::uint64_t>(i) * kLength, kLength,
                               pool_base() + at, SteadyClock::shared()->now() + 30s,
                               [&done, i](Status s) { done[static_cast<std::size_t>(i)].set_value(std::move(s)); }));
  }
  for (auto& f : settled) {
    ASSERT_EQ(f.wait_for(30s), std::future_status::ready);
    EXPECT_TRUE(f.get());
  }
  for (int i = 0; i < kWrites; ++i) {
    const auto at = static_cast<std::ptrdiff_t>(static_cast<std::uint64_t>(kWrites - 1 - i) * kLength);
    const auto from = static_cast<std::ptrdiff_t>(static_cast<std::uint64_t>(i) * kLength);
    EXPECT_TRUE(std::equal(pool_.begin() + at, pool_.begin() + at + static_cast<std::ptrdiff_t>(kLength),
                           source_.begin() + from))
        << "write " << i;
  }
}

}  // namespace
}  // namespace ecx::transport
