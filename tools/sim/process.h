#pragma once
// Child processes for the demo, the benches and the multi-process tests: spawned
// with their stdout on a pipe read line by line, killed and reaped with deadlines.

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "ecx/core/status.h"

namespace ecx::sim {

class ChildProcess {
 public:
  // Runs argv[0] (a path) with argv and extra environment entries ("K=V").
  static Result<ChildProcess> spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  // Kills (SIGKILL) and reaps a child still running.
  ~ChildProcess();

  pid_t pid() const noexcept { return pid_; }
  // The next complete stdout line, waiting at most `timeout`; nullopt on timeout or EOF.
  std::optional<std::string> read_line(std::chrono::milliseconds timeout);
  bool eof() const noexcept { return eof_; }
  void signal(int sig) const;
  // Exit status (or 128 + signal), waiting at most `timeout`; nullopt if still running.
  std::optional<int> wait(std::chrono::milliseconds timeout);
  bool running();

 private:
  ChildProcess(pid_t pid, int stdout_fd) : pid_(pid), fd_(stdout_fd) {}
  void close_fd() noexcept;
  // Reads what is available (up to `timeout`) into the line buffer; true if it read.
  bool pump(std::chrono::milliseconds timeout);

  pid_t pid_ = -1;
  int fd_ = -1;
  std::string buffer_;
  bool eof_ = false;
  std::optional<int> status_;
};

// The path of the running executable.
std::string self_executable();

// The first port of a block of `count` consecutive free TCP ports on 127.0.0.1
// (probed by binding; another process may still take one before it is used); 0 when
// none was found.
int free_port_block(int count);

}  // namespace ecx::sim
