#pragma once
// CPU time of this process's threads over a span of a run, by thread name: what an
// item costs the machine thread by thread (what `top -H` shows), so a bench can say
// how much of it is ECX's and how much the simulated engine's, and what rate the
// machine's CPUs allow at that cost. Linux: /proc/self/task.

#include <sys/types.h>

#include <cstdint>
#include <map>
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

}  // namespace ecx::sim
