#pragma once
// A trivial in-test handler and helpers for the control tests (real sockets on
// loopback, one process).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>

#include <zmq.hpp>

#include "ecx/control/handler.h"
#include "ecx/control/server.h"
#include "ecx/core/dtype.h"
#include "ecx/core/tensor_spec.h"

namespace ecx::control::testing {

// Remembers reservations by transfer id. Transfer ids steer the answer:
// "full-*" -> retry after 7 ms, "cached-*" -> ready, "boom" -> the handler throws,
// "refused" -> cancel answers a conflict.
class TestHandler : public ControlHandler {
 public:
  void describe(wire::HelloReply& reply) override {
    reply.data = wire::DataPlane{"ucx", std::string("\x01\x02\x03\x00", 4), "", 0};
    reply.pool_bytes = 1 << 30;
    reply.max_tensor_bytes = 64 << 20;
    reply.features = {std::string(wire::kFeatureReceiverLands)};
  }

  std::vector<wire::ReserveResult> reserve_batch(const RequestContext&,
                                                 std::span<const wire::ReserveItem> items) override {
    calls.fetch_add(1);
    std::vector<wire::ReserveResult> out;
    std::lock_guard lock(mutex_);
    for (const auto& item : items) {
      if (item.transfer_id == "boom") throw std::runtime_error("handler exploded");
      if (item.transfer_id.starts_with("full-")) {
        out.push_back(wire::ReserveResult::retry(7));
      } else if (item.transfer_id.starts_with("cached-")) {
        out.push_back(wire::ReserveResult::ready(ReservationId(9, 9), true));
      } else {
        const ReservationId id(1, ++next_);
        reservations_[item.transfer_id] = id;
        out.push_back(wire::ReserveResult::reserved(id, next_, item.spec.nbytes()));
      }
    }
    return out;
  }

  Result<wire::CancelReply> cancel(const RequestContext&, const wire::CancelRequest& request) override {
    calls.fetch_add(1);
    if (request.transfer_id == "boom") throw std::runtime_error("handler exploded");
    if (request.transfer_id == "refused") return conflict("this transfer is someone else's");
    std::lock_guard lock(mutex_);
    return wire::CancelReply{reservations_.erase(request.transfer_id) > 0};
  }

  // Echoes the transfer id in `state` so a test can check replies match requests.
  Result<wire::StatusReply> status(const RequestContext&, const wire::StatusRequest& request) override {
    calls.fetch_add(1);
    if (request.transfer_id == "missing") return not_found("no such transfer");
    wire::StatusReply reply;
    reply.found = true;
    reply.state = request.transfer_id;
    reply.mm_hash = "h";
    return reply;
  }

  void tick(TimePoint) override {
    {
      std::lock_guard lock(mutex_);
      ++ticks_;
    }
    tick_cv_.notify_all();
  }

  bool wait_for_ticks(int n, std::chrono::milliseconds max_wait) {
    std::unique_lock lock(mutex_);
    return tick_cv_.wait_for(lock, max_wait, [&] { return ticks_ >= n; });
  }

  std::size_t reservation_count() {
    std::lock_guard lock(mutex_);
    return reservations_.size();
  }

  std::atomic<int> calls{0};

 private:
  std::mutex mutex_;
  std::condition_variable tick_cv_;
  std::map<std::string, ReservationId> reservations_;
  std::uint64_t next_ = 0;
  int ticks_ = 0;
};

// The value of a Result that must hold one (fails the test otherwise).
template <typename T>
T must(Result<T> result) {
  if (!result.is_ok()) throw std::runtime_error("unexpected error: " + result.status().to_string());
  return std::move(result).value();
}

inline TensorSpec spec(std::vector<std::int64_t> shape) {
  return TensorSpec::make(shape, DType::bfloat16, 1ULL << 40).value();
}

inline wire::ReserveItem item(std::string transfer_id) {
  return wire::ReserveItem{std::move(transfer_id), "hash-1", spec({4, 8}), std::nullopt};
}

inline std::string local(int port) { return "tcp://127.0.0.1:" + std::to_string(port); }

// A tcp:// address on loopback that nothing listens on: a port bound, then closed.
inline std::string closed_address() {
  zmq::context_t context;
  zmq::socket_t probe(context, zmq::socket_type::router);
  probe.set(zmq::sockopt::linger, 0);
  probe.bind("tcp://127.0.0.1:*");
  return probe.get(zmq::sockopt::last_endpoint);
}

// Starts `count` shards on consecutive ports (retrying other bases if taken).
inline std::vector<std::unique_ptr<ControlServer>> start_shards(std::uint32_t count,
                                                                std::shared_ptr<ControlHandler> handler,
                                                                ServerOptions base_options = {}) {
  std::mt19937 rng(std::random_device{}());
  for (int attempt = 0; attempt < 50; ++attempt) {
    const int base = 20000 + static_cast<int>(rng() % 30000);
    std::vector<std::unique_ptr<ControlServer>> shards;
    for (std::uint32_t r = 0; r < count; ++r) {
      ServerOptions o = base_options;
      o.port = base + static_cast<int>(r);
      o.tp_rank = r;
      o.tp_size = count;
      auto server = ControlServer::start(o, handler);
      if (!server) break;
      shards.push_back(std::move(*server));
    }
    if (shards.size() == count) return shards;
  }
  return {};
}

// Counts completions and lets a test wait for them with a deadline.
class Latch {
 public:
  explicit Latch(std::size_t n) : left_(n) {}
  void count_down() {
    std::lock_guard lock(mutex_);
    if (left_ > 0 && --left_ == 0) cv_.notify_all();
  }
  bool wait(std::chrono::milliseconds max_wait) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, max_wait, [&] { return left_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::size_t left_;
};

}  // namespace ecx::control::testing
