#pragma once
// CPU time of this process's threads over a span of a run, by thread name: what an
// item costs the machine thread by thread (what `top -H` shows), so a bench can say
// how much of it is ECX's and how much the simulated engine's, and what rate the
// machine's CPUs allow at that cost. Linux: /proc/self/task.

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>

namespace ecx::sim {

class ThreadCpu {
 public:
  // Every thread of this process now: its name and CPU time so far.
  static ThreadCpu now();

  // CPU time each thread name used since `before`, ns. A thread started since counts
  // whole; one that ended since is not seen (its time since `before` is lost).
  std::map<std::string, std::uint64_t> used_since(const ThreadCpu& before) const;
  // How often each thread name went to sleep since `before` (voluntary context
  // switches: a wait on a socket, a condition variable, a timer), counted as
  // used_since() counts. Each sleep is a wake-up later, and on a VM each costs the CPU
  // tens of us, so wakes per item explain CPU that no profile attributes to code.
  std::map<std::string, std::uint64_t> sleeps_since(const ThreadCpu& before) const;

 private:
  struct Thread {
    std::string name;
    std::uint64_t cpu_ns = 0;
    std::uint64_t sleeps = 0;
  };
  std::map<pid_t, Thread> threads_;
};

// CPU time of the calling thread so far, ns (CLOCK_THREAD_CPUTIME_ID).
std::uint64_t thread_cpu_ns();

// Times the simulator's own regions of work on one thread (content stamping, its
// admit channel, encoder-cache allocation, its waits for the admit channel), reading
// the thread's CPU clock for a random 1 in `every` regions and counting each region
// it read `every` times: an unbiased estimate of their total. Reading that clock is a
// system call (0.6-0.8 us on the 2-CPU host); read around every region it cost both
// simulators about 6 us per 64 KiB item, and what fell outside a region was charged
// to ECX. A read region also holds part of the two reads' own cost (0.5 us there),
// which `every` multiplied into the estimate: the median of back-to-back reads, taken
// at construction, is taken off each read region. One per thread.
class SampledCpuTime {
 public:
  using Clock = std::function<std::uint64_t()>;
  explicit SampledCpuTime(std::uint32_t seed, std::uint32_t every = 8, Clock clock = thread_cpu_ns);

  class Region {
   public:
    // Adds the region's estimated CPU time to `total_ns` (once; later calls add nothing).
    void stop(std::uint64_t& total_ns);

   private:
    friend class SampledCpuTime;
    const SampledCpuTime* sampler_ = nullptr;  // null: this region is not read
    std::uint64_t started_ns_ = 0;
    std::uint32_t weight_ = 0;
  };
  // A region of work over at least this many bytes is read every time and counted
  // once: two clock reads are nothing next to it, and sampled, a few such regions
  // among many small ones made the estimate swing (a 150-item 9 MiB phase, whose
  // every 16th item gets a full content check: 8 to 100 us per item from one run to
  // the next).
  static constexpr std::uint64_t kAlwaysReadBytes = 1 << 20;
  // A region of work over `bytes` (0: small or unknown: sampled).
  Region start(std::uint64_t bytes = 0);
  // A region read every time and counted once: a wait, whose CPU time varies too
  // widely from one to the next for a sample to stand for the rest.
  Region start_always() { return read(1); }

  std::uint64_t clock_reads() const noexcept { return clock_reads_; }
  // What an empty read region measures: taken off each read region.
  std::uint64_t overhead_ns() const noexcept { return overhead_ns_; }

 private:
  Region read(std::uint32_t weight);

  std::minstd_rand random_;
  std::uint32_t every_;
  Clock clock_;
  std::uint64_t overhead_ns_ = 0;
  std::uint64_t clock_reads_ = 0;
};

}  // namespace ecx::sim
