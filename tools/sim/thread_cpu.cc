#include "sim/thread_cpu.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string_view>
#include <system_error>

namespace ecx::sim {
namespace {

// schedstat's first field is the thread's time on a CPU in ns; without
// CONFIG_SCHED_INFO, stat's utime + stime in clock ticks.
std::optional<std::uint64_t> cpu_ns_of(const std::filesystem::path& task) {
  if (std::ifstream in(task / "schedstat"); in) {
    std::uint64_t run_ns = 0;
    if (in >> run_ns) return run_ns;
  }
  std::ifstream in(task / "stat");
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  // The name in parentheses may hold spaces: fields count from after its ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream fields(line.substr(close + 1));
  std::string field;
  std::uint64_t utime = 0;
  std::uint64_t stime = 0;
  // After the name: state (3), ..., utime (14), stime (15).
  for (int index = 3; index <= 15 && fields >> field; ++index) {
    if (index == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (index == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  const long ticks = ::sysconf(_SC_CLK_TCK);
  return (utime + stime) * (1'000'000'000ULL / static_cast<std::uint64_t>(ticks > 0 ? ticks : 100));
}

// status's "voluntary_ctxt_switches:" line; 0 where the kernel has none.
std::uint64_t sleeps_of(const std::filesystem::path& task) {
  std::ifstream in(task / "status");
  constexpr std::string_view kKey = "voluntary_ctxt_switches:";
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with(kKey)) return std::strtoull(line.c_str() + kKey.size(), nullptr, 10);
  }
  return 0;
}

// Per thread name, `field` since `before`; a thread id reused by a newer thread of
// another name is a new thread.
template <typename Thread, typename Field>
std::map<std::string, std::uint64_t> since(const std::map<pid_t, Thread>& now, const std::map<pid_t, Thread>& before,
                                           Field field) {
  std::map<std::string, std::uint64_t> out;
  for (const auto& [tid, thread] : now) {
    std::uint64_t used = thread.*field;
    if (auto it = before.find(tid); it != before.end() && it->second.name == thread.name) {
      used -= std::min(used, it->second.*field);
    }
    out[thread.name] += used;
  }
  return out;
}

}  // namespace

ThreadCpu ThreadCpu::now() {
  ThreadCpu out;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task", error)) {
    const auto tid = static_cast<pid_t>(std::strtol(entry.path().filename().c_str(), nullptr, 10));
    std::ifstream comm(entry.path() / "comm");
    Thread thread;
    if (tid <= 0 || !std::getline(comm, thread.name)) continue;  // ended meanwhile
    const auto cpu = cpu_ns_of(entry.path());
    if (!cpu) continue;
    thread.cpu_ns = *cpu;
    thread.sleeps = sleeps_of(entry.path());
    out.threads_.emplace(tid, std::move(thread));
  }
  return out;
}

std::map<std::string, std::uint64_t> ThreadCpu::used_since(const ThreadCpu& before) const {
  return since(threads_, before.threads_, &Thread::cpu_ns);
}

std::map<std::string, std::uint64_t> ThreadCpu::sleeps_since(const ThreadCpu& before) const {
  return since(threads_, before.threads_, &Thread::sleeps);
}

std::uint64_t thread_cpu_ns() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<std::uint64_t>(t.tv_sec) * 1'000'000'000ULL + static_cast<std::uint64_t>(t.tv_nsec);
}

SampledCpuTime::SampledCpuTime(std::uint32_t seed, std::uint32_t every, Clock clock)
    : random_(seed == 0 ? 1 : seed), every_(every == 0 ? 1 : every), clock_(std::move(clock)) {
  // The median of back-to-back reads: what a read region holds of the reads' own cost
  // (a preempted pair reads long; the median leaves it out).
  std::array<std::uint64_t, 31> empty{};
  for (auto& ns : empty) {
    const std::uint64_t first = clock_();
    ns = clock_() - first;
  }
  std::nth_element(empty.begin(), empty.begin() + empty.size() / 2, empty.end());
  overhead_ns_ = empty[empty.size() / 2];
}

SampledCpuTime::Region SampledCpuTime::start(std::uint64_t bytes) {
  if (bytes >= kAlwaysReadBytes) return start_always();
  if (random_() % every_ != 0) return Region{};
  return read(every_);
}

SampledCpuTime::Region SampledCpuTime::read(std::uint32_t weight) {
  Region region;
  region.sampler_ = this;
  region.weight_ = weight;
  ++clock_reads_;
  region.started_ns_ = clock_();
  return region;
}

void SampledCpuTime::Region::stop(std::uint64_t& total_ns) {
  if (sampler_ == nullptr) return;
  const std::uint64_t elapsed = sampler_->clock_() - started_ns_;
  total_ns += (elapsed - std::min(elapsed, sampler_->overhead_ns_)) * weight_;
  sampler_ = nullptr;
}

}  // namespace ecx::sim
