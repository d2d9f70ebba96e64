// Real processes over loopback: a control server process is killed and started
// again on the same port; the same client reaches it again.

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "ecx/control/client.h"

namespace ecx::control {
namespace {

using namespace std::chrono_literals;

// A child process running ecx_control_test_server, killed when this goes away.
class ServerProcess {
 public:
  explicit ServerProcess(int port) {
    int out[2];
    int in[2];
    if (::pipe(out) != 0 || ::pipe(in) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    posix_spawn_file_actions_addclose(&actions, in[1]);
    const std::string binary = std::string(ECX_BINARY_DIR) + "/bin/ecx_control_test_server";
    const std::string port_text = std::to_string(port);
    char* const args[] = {const_cast<char*>(binary.c_str()), const_cast<char*>("--port"),
                          const_cast<char*>(port_text.c_str()), nullptr};
    const int rc = posix_spawn(&pid_, binary.c_str(), &actions, nullptr, args, environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    ::close(in[0]);
    stdin_ = in[1];
    if (rc != 0) {
      pid_ = -1;
      ::close(out[0]);
      return;
    }
    // The child prints one line once it listens; a dead child closes the pipe (EOF),
    // so this read cannot wait forever. ctest's timeout bounds a wedged child.
    FILE* reader = ::fdopen(out[0], "r");
    char line[128] = {};
    if (reader && std::fgets(line, sizeof line, reader)) std::sscanf(line, "READY %d", &port_);
    if (reader) std::fclose(reader);  // NOLINT(cppcoreguidelines-owning-memory): fdopen's stream
  }
  ~ServerProcess() { kill(); }
  void kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
    if (stdin_ >= 0) ::close(stdin_);
    stdin_ = -1;
  }
  int port() const { return port_; }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  int port_ = 0;
};

TEST(ControlProcesses, KilledServerRestartedOnTheSamePortIsReachedAgain) {
  auto created = ControlClient::create(ClientOptions{});
  ASSERT_TRUE(created.is_ok());
  std::unique_ptr<ControlClient> client = std::move(created).value();

  auto first = std::make_unique<ServerProcess>(0);
  ASSERT_GT(first->port(), 0);
  const int port = first->port();
  const std::string address = "tcp://127.0.0.1:" + std::to_string(port);
  auto hello = client->hello(address, 5s);
  ASSERT_TRUE(hello.is_ok()) << hello.status().to_string();
  const std::string first_instance = hello->instance;

  first->kill();  // no goodbye: the connection just breaks
  // While it is down, a request fails by its deadline and leaves the client usable.
  EXPECT_EQ(client->status(address, "t-down", 200ms).status().code(), StatusCode::timeout);

  ServerProcess second(port);
  ASSERT_EQ(second.port(), port);
  auto again = client->hello(address, 10s);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_NE(again->instance, first_instance);
  auto reserved = client->reserve_batch(
      address, {wire::ReserveItem{"t-1", "h-1", TensorSpec::make({2, 2}, DType::float32, 1 << 20).value(), {}}}, 5s);
  ASSERT_TRUE(reserved.is_ok()) << reserved.status().to_string();
  EXPECT_EQ(reserved->items.at(0).outcome, wire::ReserveOutcome::reserved);
}

}  // namespace
}  // namespace ecx::control
