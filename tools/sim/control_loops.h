#pragma once
// Control-plane round trips on loopback, shared by `ecx bench control` and the
// bench_control microbenchmarks so both measure the same thing: a reserve_batch of
// one realistic item against a real ControlServer with a trivial handler, and the
// baseline, a bare ZeroMQ DEALER/ROUTER echo of a frame of the same size.
//
// Each loop does one unit of work per call (one round trip, or one window of
// pipelined requests); the caller times it.

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>

#include <zmq.hpp>

#include "ecx/control/client.h"
#include "ecx/control/server.h"
#include "ecx/core/status.h"

namespace ecx::sim {

// The encoded reserve_batch request of one item (what the echo sends).
std::string reserve_request_frame();

// A ROUTER thread echoing every frame, as fast as ZeroMQ goes.
class RawEchoServer {
 public:
  RawEchoServer();
  ~RawEchoServer();
  RawEchoServer(const RawEchoServer&) = delete;
  RawEchoServer& operator=(const RawEchoServer&) = delete;
  const std::string& address() const { return address_; }

 private:
  zmq::context_t context_;
  zmq::socket_t router_;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class RawEchoLoop {
 public:
  RawEchoLoop();
  // One frame there and back.
  void round_trip();
  // `window` frames sent, then their `window` echoes received.
  void pipelined(int window);
  std::size_t frame_bytes() const { return frame_.size(); }

 private:
  RawEchoServer server_;
  zmq::context_t context_;
  zmq::socket_t dealer_;
  std::string frame_;
  zmq::message_t reply_;
};

class ReserveLoop {
 public:
  // Starts the server and the client and connects them (hello) before any timing.
  // `lanes` false sends the blocking round trips through the client's I/O thread
  // (ClientOptions::max_lanes 0), as asynchronous callers' requests go.
  static Result<std::unique_ptr<ReserveLoop>> start(bool lanes = true);
  // One reserve_batch round trip; false when it failed.
  bool round_trip();
  // `window` reserve_batch requests in flight at once; returns how many failed.
  std::size_t pipelined(int window);

 private:
  ReserveLoop() = default;
  std::unique_ptr<control::ControlServer> server_;
  std::unique_ptr<control::ControlClient> client_;
  std::string address_;
};

}  // namespace ecx::sim
