// A stand-alone control server with a trivial handler, for multi-process tests:
//   ecx_control_test_server [--port P] [--secret S]
// Prints "READY <control port> <event port>" once listening and serves until its
// standard input closes (or it is killed).

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "ecx/control/server.h"

namespace {

class EchoHandler : public ecx::control::ControlHandler {
 public:
  void describe(ecx::wire::HelloReply& reply) override {
    reply.data = ecx::wire::DataPlane{"ucx", "test-address", "", 0};
    reply.pool_bytes = 1 << 20;
    reply.max_tensor_bytes = 1 << 20;
  }
  std::vector<ecx::wire::ReserveResult> reserve_batch(const ecx::control::RequestContext&,
                                                      std::span<const ecx::wire::ReserveItem> items) override {
    std::vector<ecx::wire::ReserveResult> out;
    for (const auto& item : items) {
      ++next_;
      out.push_back(ecx::wire::ReserveResult::reserved(ecx::ReservationId(0, next_), next_, item.spec.nbytes()));
    }
    return out;
  }
  ecx::Result<ecx::wire::CancelReply> cancel(const ecx::control::RequestContext&,
                                             const ecx::wire::CancelRequest&) override {
    return ecx::wire::CancelReply{true};
  }
  ecx::Result<ecx::wire::StatusReply> status(const ecx::control::RequestContext&,
                                             const ecx::wire::StatusRequest& request) override {
    ecx::wire::StatusReply reply;
    reply.found = true;
    reply.state = request.transfer_id;
    return reply;
  }

 private:
  std::uint64_t next_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  ecx::control::ServerOptions options;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--port") == 0) options.port = std::stoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--secret") == 0) options.auth_secret = argv[i + 1];
  }
  auto server = ecx::control::ControlServer::start(options, std::make_shared<EchoHandler>());
  if (!server) {
    std::fprintf(stderr, "%s\n", server.status().to_string().c_str());
    return 2;
  }
  std::printf("READY %d %d\n", (*server)->port(), (*server)->event_port());
  std::fflush(stdout);
  char buffer[64];
  while (::read(STDIN_FILENO, buffer, sizeof buffer) > 0) {
  }
  return 0;
}
