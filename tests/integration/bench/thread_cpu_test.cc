// The per-thread CPU accounting behind `ecx bench e2e`'s CPU table (sim/thread_cpu.h),
// with real threads of this process: a busy one, an idle one, and one started after
// the first snapshot.
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include <gtest/gtest.h>

#include "sim/engine_sim.h"
#include "sim/thread_cpu.h"

namespace ecx::sim {
namespace {

using namespace std::chrono_literals;

// Spins until this thread has used `cpu` of CPU time (not wall time: the machine may
// be loaded).
void burn(std::chrono::nanoseconds cpu) {
  const std::uint64_t begin = thread_cpu_ns();
  // The clock call itself is the work.
  while (thread_cpu_ns() - begin < static_cast<std::uint64_t>(cpu.count())) {
  }
}

TEST(ThreadCpu, CountsEachNamedThreadsTimeSinceTheSnapshot) {
  std::atomic<bool> go{false};
  std::atomic<bool> done{false};
  std::atomic<int> settled{0};  // threads named (and the busy one through its first burn)
  std::thread busy([&] {
    ::pthread_setname_np(::pthread_self(), "tcpu-busy");
    burn(20ms);  // before the snapshot: not counted
    ++settled;
    while (!go.load()) std::this_thread::yield();
    burn(60ms);
    while (!done.load()) std::this_thread::sleep_for(1ms);
  });
  std::thread idle([&] {
    ::pthread_setname_np(::pthread_self(), "tcpu-idle");
    ++settled;
    while (!done.load()) std::this_thread::sleep_for(5ms);
  });
  const auto settle_by = std::chrono::steady_clock::now() + 30s;  // a loaded machine is slow, not wrong
  while (settled.load() < 2 && std::chrono::steady_clock::now() < settle_by) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(settled.load(), 2);  // (no ASSERT: the threads must still be joined)
  const auto before = ThreadCpu::now();
  go.store(true);
  std::thread late([] {
    ::pthread_setname_np(::pthread_self(), "tcpu-late");
    burn(30ms);
  });
  late.join();
  // The busy thread's 60 ms (of its own CPU time), however loaded the machine.
  const auto give_up = std::chrono::steady_clock::now() + 30s;
  std::map<std::string, std::uint64_t> used;
  do {
    std::this_thread::sleep_for(10ms);
    used = ThreadCpu::now().used_since(before);
  } while (used["tcpu-busy"] < 60'000'000 && std::chrono::steady_clock::now() < give_up);
  done.store(true);
  busy.join();
  idle.join();

  EXPECT_GE(used["tcpu-busy"], 60'000'000U);
  EXPECT_LT(used["tcpu-busy"], 78'000'000U);  // the 20 ms before the snapshot are not in it
  EXPECT_LT(used["tcpu-idle"], 10'000'000U);
  // Ended before this snapshot: its time is lost, as the header says.
  EXPECT_EQ(used.count("tcpu-late"), 0U);
}

TEST(ThreadCpu, AThreadStartedSinceTheSnapshotCountsWhole) {
  const auto before = ThreadCpu::now();
  std::atomic<bool> done{false};
  std::atomic<bool> burnt{false};
  std::thread late([&] {
    ::pthread_setname_np(::pthread_self(), "tcpu-new");
    burn(30ms);
    burnt.store(true);
    while (!done.load()) std::this_thread::sleep_for(1ms);
  });
  while (!burnt.load()) std::this_thread::sleep_for(1ms);
  const auto used = ThreadCpu::now().used_since(before);
  done.store(true);
  late.join();
  ASSERT_EQ(used.count("tcpu-new"), 1U);
  EXPECT_GE(used.at("tcpu-new"), 30'000'000U);
}

// The CPU table adds up every TP rank's engine thread by these names, and nothing else.
TEST(ThreadCpu, EngineThreadsAreKnownByName) {
  for (const char* name : {"ecx-engine", "ecx-engine-r1", "ecx-engine-r7"}) EXPECT_TRUE(is_engine_thread(name)) << name;
  for (const char* name : {"ecx", "ecx-ucx", "ecx-engineer", "ecx-engine-x", "engine"}) {
    EXPECT_FALSE(is_engine_thread(name)) << name;
  }
}

// Times `count` regions of `work_ns` each on `sampler`, whose clock reads `fake_ns`;
// returns the estimate.
std::uint64_t time_regions(SampledCpuTime& sampler, std::uint64_t& fake_ns, int count, std::uint64_t work_ns) {
  std::uint64_t total = 0;
  for (int i = 0; i < count; ++i) {
    auto region = sampler.start();
    fake_ns += work_ns;
    region.stop(total);
  }
  return total;
}

// The simulators' sampled region timer: it reads its clock for about 1 in `every`
// regions and counts each one it read `every` times, so the estimate of regions of one
// cost is exact in expectation and close over many. A fake clock that advances 100 ns
// per region stands in for the thread's CPU clock.
TEST(SampledCpuTime, ReadsTheClockForOneRegionInEveryAndScalesWhatItRead) {
  std::uint64_t fake_ns = 0;
  SampledCpuTime sampler(7, 8, [&] { return fake_ns; });
  std::uint64_t total = 0;
  constexpr int kRegions = 80'000;
  for (int i = 0; i < kRegions; ++i) {
    auto region = sampler.start();
    fake_ns += 100;  // the region's work
    region.stop(total);
    region.stop(total);  // a second stop adds nothing
    fake_ns += 1'000;    // work outside any region is never counted
  }
  EXPECT_NEAR(static_cast<double>(sampler.clock_reads()), kRegions / 8.0, kRegions / 8.0 * 0.05);
  EXPECT_EQ(total, sampler.clock_reads() * 8 * 100);
  EXPECT_NEAR(static_cast<double>(total), kRegions * 100.0, kRegions * 100.0 * 0.05);

  SampledCpuTime every_region(7, 1, [&] { return fake_ns; });
  EXPECT_EQ(time_regions(every_region, fake_ns, 10, 100), 1000u);
  EXPECT_EQ(every_region.clock_reads(), 10u);
}

// A read region holds the clock's own cost (a system call for the thread's CPU clock):
// the sampler measures it once, from back-to-back reads, and takes it off each read
// region before scaling, or 1 in 8 read regions of 100 ns would count 8 x 600. A
// fake clock that costs 500 ns per read stands in.
TEST(SampledCpuTime, TakesTheClocksOwnCostOffEachReadRegion) {
  std::uint64_t fake_ns = 0;
  const SampledCpuTime::Clock costly = [&] {
    fake_ns += 500;
    return fake_ns;
  };
  SampledCpuTime every_region(7, 1, costly);
  EXPECT_EQ(every_region.overhead_ns(), 500u);
  EXPECT_EQ(time_regions(every_region, fake_ns, 10, 100), 1000u);

  SampledCpuTime sampler(7, 8, costly);
  constexpr int kRegions = 80'000;
  const std::uint64_t total = time_regions(sampler, fake_ns, kRegions, 100);
  EXPECT_EQ(total, sampler.clock_reads() * 8 * 100);
  EXPECT_NEAR(static_cast<double>(total), kRegions * 100.0, kRegions * 100.0 * 0.05);
}

// A wait is read every time and counted once.
TEST(SampledCpuTime, AWaitIsReadEveryTime) {
  std::uint64_t fake_ns = 0;
  SampledCpuTime sampler(7, 8, [&] { return fake_ns; });
  std::uint64_t waited = 0;
  for (int i = 0; i < 5; ++i) {
    auto region = sampler.start_always();
    fake_ns += 7'000;
    region.stop(waited);
  }
  EXPECT_EQ(waited, 35'000u);
  EXPECT_EQ(sampler.clock_reads(), 5u);
}

// A region of large work is read every time and counted once, among sampled small ones.
TEST(SampledCpuTime, ARegionOfLargeWorkIsReadEveryTimeAndCountedOnce) {
  std::uint64_t fake_ns = 0;
  SampledCpuTime sampler(7, 8, [&] { return fake_ns; });
  std::uint64_t large = 0;
  for (int i = 0; i < 10; ++i) {
    auto small = sampler.start();
    fake_ns += 100;
    std::uint64_t ignored = 0;
    small.stop(ignored);
    auto region = sampler.start(SampledCpuTime::kAlwaysReadBytes);
    fake_ns += 50'000;
    region.stop(large);
    region.stop(large);  // once
  }
  EXPECT_EQ(large, 10u * 50'000u);
}

}  // namespace
}  // namespace ecx::sim
