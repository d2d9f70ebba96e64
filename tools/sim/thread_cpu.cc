#include "sim/thread_cpu.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
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
    out.threads_.emplace(tid, std::move(thread));
  }
  return out;
}

std::map<std::string, std::uint64_t> ThreadCpu::used_since(const ThreadCpu& before) const {
  std::map<std::string, std::uint64_t> out;
  for (const auto& [tid, thread] : threads_) {
    std::uint64_t used = thread.cpu_ns;
    // A thread id reused by a newer thread of another name is a new thread.
    if (auto it = before.threads_.find(tid); it != before.threads_.end() && it->second.name == thread.name) {
      used -= std::min(used, it->second.cpu_ns);
    }
    out[thread.name] += used;
  }
  return out;
}

}  // namespace ecx::sim
