#include "ecx/pool/slab.h"

#include <gtest/gtest.h>

#include <cstring>

#include "ecx/core/clock.h"
#include "ecx/pool/cuda_staging.h"

namespace ecx::pool {
namespace {

TEST(Slab, HostSlabIsWritableAndFreedOnDestruction) {
  auto slab = Slab::allocate(MemoryKind::host, 3 << 20, SlabOptions{.huge_pages = true, .prefault = true});
  ASSERT_TRUE(slab) << slab.status().to_string();
  EXPECT_EQ(slab->size(), 3u << 20);
  EXPECT_TRUE(slab->host_accessible());
  std::memset(slab->data(), 0xab, slab->size());
  EXPECT_EQ(slab->data()[slab->size() - 1], std::byte{0xab});
  Slab moved = std::move(*slab);
  EXPECT_EQ(slab->data(), nullptr);
  EXPECT_EQ(moved.at(Slot{4096, 256})[0], std::byte{0xab});
}

TEST(Slab, ZeroBytesIsInvalid) {
  EXPECT_EQ(Slab::allocate(MemoryKind::host, 0).status().code(), StatusCode::invalid_argument);
}

TEST(Slab, CudaKindsFailClearlyWithoutADevice) {
  // On a machine with a GPU this allocates; without one (or without CUDA in the
  // build) it must be a clean `unavailable`, never a crash.
  auto pinned = Slab::allocate(MemoryKind::cuda_pinned, 1 << 20);
  if (!pinned) {
    EXPECT_EQ(pinned.status().code(), StatusCode::unavailable);
    EXPECT_FALSE(pinned.status().message().empty());
  }
  auto stager = CudaStager::create(0);
  if (!stager) {
    EXPECT_EQ(stager.status().code(), StatusCode::unavailable);
    if (!built_with_cuda()) {
      EXPECT_NE(stager.status().message().find("without a CUDA toolkit"), std::string::npos);
    }
  }
}

TEST(Slab, StagingRoundTripWhenADeviceIsPresent) {
  auto stager = CudaStager::create(0);
  if (!stager) GTEST_SKIP() << stager.status().to_string();
  auto device = Slab::allocate(MemoryKind::cuda_device, 1 << 20);
  auto pinned = Slab::allocate(MemoryKind::cuda_pinned, 2 << 20);
  ASSERT_TRUE(device && pinned);
  for (std::size_t i = 0; i < (1 << 20); ++i) pinned->data()[i] = static_cast<std::byte>(i * 7);
  SteadyClock clock;
  auto up = (*stager)->copy_to_device(pinned->data(), device->data(), 1 << 20);
  ASSERT_TRUE(up);
  ASSERT_TRUE((*stager)->wait(*up, clock.now() + std::chrono::seconds(10), clock));
  auto down = (*stager)->copy_to_host(device->data(), pinned->data() + (1 << 20), 1 << 20);
  ASSERT_TRUE(down);
  ASSERT_TRUE((*stager)->wait(*down, clock.now() + std::chrono::seconds(10), clock));
  EXPECT_EQ(std::memcmp(pinned->data(), pinned->data() + (1 << 20), 1 << 20), 0);
  EXPECT_EQ((*stager)->in_flight(), 0u);
}

}  // namespace
}  // namespace ecx::pool
