#include "sim/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <thread>

#include <fmt/format.h>

namespace ecx::sim {

std::string self_executable() {
  char path[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return {};
  return std::string(path, static_cast<std::size_t>(n));
}

namespace {
// The lowest port the kernel hands out for bind(0): a listener started with port 0
// (UCX's data plane) can take any port from there up, including one probed free here
// a moment earlier.
int ephemeral_port_low() {
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0;
  int high = 0;
  return range >> low >> high ? low : 32768;
}
}  // namespace

int free_port_block(int count) {
  // Below the ephemeral range when it leaves room (the usual 32768 does), so no
  // port-0 listener of the processes under test can take the block meanwhile.
  constexpr int kLow = 10000;
  const int ephemeral = ephemeral_port_low();
  const int high = ephemeral - count > kLow + 1000 ? ephemeral - count : 55000;
  const auto span = static_cast<unsigned>(high - kLow);
  for (int attempt = 0; attempt < 200; ++attempt) {
    // Spread by pid so concurrent test processes start their search apart.
    const int base =
        kLow +
        static_cast<int>((static_cast<unsigned>(::getpid()) * 7919U + static_cast<unsigned>(attempt) * 104729U) % span);
    bool ok = true;
    for (int p = base; p < base + count && ok; ++p) {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<std::uint16_t>(p));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
      if (fd >= 0) ::close(fd);
    }
    if (ok) return base;
  }
  return 0;
}

Result<ChildProcess> ChildProcess::spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  if (argv.empty()) return invalid_argument("no program to run");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return internal_error(fmt::format("pipe: {}", errno_text(errno)));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) env_storage.emplace_back(*e);
  for (const auto& e : env) env_storage.push_back(e);
  std::vector<char*> envp;
  envp.reserve(env_storage.size() + 1);
  for (auto& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    return internal_error(fmt::format("cannot start {}: {}", argv[0], errno_text(rc)));
  }
  return ChildProcess(pid, fds[0]);
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(other.pid_), fd_(other.fd_), buffer_(std::move(other.buffer_)), eof_(other.eof_), status_(other.status_) {
  other.pid_ = -1;
  other.fd_ = -1;
}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    this->~ChildProcess();
    new (this) ChildProcess(std::move(other));
  }
  return *this;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !status_) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  close_fd();
}

void ChildProcess::close_fd() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::optional<std::string> ChildProcess::read_line(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (auto pos = buffer_.find('\n'); pos != std::string::npos) {
      std::string line = buffer_.substr(0, pos);
      buffer_.erase(0, pos + 1);
      return line;
    }
    if (eof_ || fd_ < 0) return std::nullopt;
    // Rounded up and polled at least once: a short timeout (1 ms) must still see
    // what is ready, EOF included.
    const auto left = std::max<std::int64_t>(
        0, std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) {
      if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      continue;
    }
    char chunk[4096];
    const ssize_t n = ::read(fd_, chunk, sizeof(chunk));
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      eof_ = true;
      continue;
    }
    buffer_.append(chunk, static_cast<std::size_t>(n));
  }
}

void ChildProcess::signal(int sig) const {
  if (pid_ > 0 && !status_) ::kill(pid_, sig);
}

std::optional<int> ChildProcess::wait(std::chrono::milliseconds timeout) {
  if (status_) return status_;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return status_;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    // Keep reading output meanwhile (kept for read_line) so a chatty child never
    // blocks on a full pipe.
    if (!pump(std::chrono::milliseconds(5)) || eof_) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

bool ChildProcess::pump(std::chrono::milliseconds timeout) {
  if (eof_ || fd_ < 0) return false;
  pollfd p{fd_, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return false;
  char chunk[4096];
  const ssize_t n = ::read(fd_, chunk, sizeof(chunk));
  if (n <= 0) {
    if (!(n < 0 && errno == EINTR)) eof_ = true;
    return false;
  }
  buffer_.append(chunk, static_cast<std::size_t>(n));
  return true;
}

bool ChildProcess::running() { return !wait(std::chrono::milliseconds(0)).has_value(); }

}  // namespace ecx::sim
