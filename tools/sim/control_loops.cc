#include "sim/control_loops.h"

#include <condition_variable>
#include <mutex>
#include <vector>

#include "ecx/core/dtype.h"
#include "ecx/wire/codec.h"

namespace ecx::sim {
namespace {

using namespace std::chrono_literals;

// Answers every reserve at once; no pool, no transport: the control plane alone.
class TrivialHandler : public control::ControlHandler {
 public:
  void describe(wire::HelloReply& reply) override { reply.data.transport = "ucx"; }
  std::vector<wire::ReserveResult> reserve_batch(const control::RequestContext&,
                                                 std::span<const wire::ReserveItem> items) override {
    std::vector<wire::ReserveResult> out;
    out.reserve(items.size());
    for (const auto& item : items) {
      ++next_;
      out.push_back(wire::ReserveResult::reserved(ReservationId(1, next_), next_, item.spec.nbytes()));
    }
    return out;
  }
  Result<wire::CancelReply> cancel(const control::RequestContext&, const wire::CancelRequest&) override {
    return wire::CancelReply{true};
  }
  Result<wire::StatusReply> status(const control::RequestContext&, const wire::StatusRequest&) override {
    return wire::StatusReply{};
  }

 private:
  std::uint64_t next_ = 0;
};

// A Qwen2.5-VL-7B-like image: 1,300 tokens x 3,584, bf16.
wire::ReserveItem one_item() {
  return wire::ReserveItem{"req-123-image-0", "sha256:0123456789abcdef",
                           TensorSpec::make({1300, 3584}, DType::bfloat16, 1ULL << 40).value(), std::nullopt};
}

}  // namespace

std::string reserve_request_frame() {
  std::string frame;
  wire::encode_request(wire::Request{1, 1000, wire::ReserveBatchRequest{{one_item()}}}, nullptr, frame);
  return frame;
}

RawEchoServer::RawEchoServer() : router_(context_, zmq::socket_type::router) {
  router_.set(zmq::sockopt::linger, 0);
  router_.bind("tcp://127.0.0.1:*");
  address_ = router_.get(zmq::sockopt::last_endpoint);
  thread_ = std::thread([this] {
    zmq::pollitem_t item{router_.handle(), 0, ZMQ_POLLIN, 0};
    while (!stop_.load()) {
      if (zmq::poll(&item, 1, 50ms) <= 0) continue;
      zmq::message_t id;
      zmq::message_t body;
      while (router_.recv(id, zmq::recv_flags::dontwait)) {
        (void)router_.recv(body, zmq::recv_flags::none);
        router_.send(id, zmq::send_flags::sndmore);
        router_.send(body, zmq::send_flags::none);
      }
    }
  });
}

RawEchoServer::~RawEchoServer() {
  stop_.store(true);
  thread_.join();
}

RawEchoLoop::RawEchoLoop() : dealer_(context_, zmq::socket_type::dealer), frame_(reserve_request_frame()) {
  dealer_.set(zmq::sockopt::linger, 0);
  dealer_.connect(server_.address());
}

void RawEchoLoop::round_trip() {
  dealer_.send(zmq::buffer(frame_), zmq::send_flags::none);
  (void)dealer_.recv(reply_, zmq::recv_flags::none);
}

void RawEchoLoop::pipelined(int window) {
  for (int i = 0; i < window; ++i) dealer_.send(zmq::buffer(frame_), zmq::send_flags::none);
  for (int i = 0; i < window; ++i) (void)dealer_.recv(reply_, zmq::recv_flags::none);
}

Result<std::unique_ptr<ReserveLoop>> ReserveLoop::start(bool lanes) {
  std::unique_ptr<ReserveLoop> loop(new ReserveLoop());  // NOLINT: private constructor
  auto server = control::ControlServer::start(control::ServerOptions{}, std::make_shared<TrivialHandler>());
  if (!server) return server.status();
  loop->server_ = std::move(*server);
  control::ClientOptions client_options;
  if (!lanes) client_options.max_lanes = 0;
  auto client = control::ControlClient::create(client_options);
  if (!client) return client.status();
  loop->client_ = std::move(*client);
  loop->address_ = "tcp://127.0.0.1:" + std::to_string(loop->server_->port());
  if (auto hello = loop->client_->hello(loop->address_, 5s); !hello) return hello.status();
  return loop;
}

bool ReserveLoop::round_trip() { return client_->reserve_batch(address_, {one_item()}, 5s).is_ok(); }

std::size_t ReserveLoop::pipelined(int window) {
  // Shared with the callbacks, so a window that misses its deadline leaves them
  // nothing dangling.
  struct Window {
    std::mutex mutex;
    std::condition_variable done;
    int left = 0;
    std::size_t failures = 0;
  };
  auto state = std::make_shared<Window>();
  state->left = window;
  for (int i = 0; i < window; ++i) {
    client_->call_async(address_, wire::ReserveBatchRequest{{one_item()}}, 5s, [state](Result<wire::Reply> reply) {
      std::lock_guard lock(state->mutex);
      if (!reply || !reply->ok()) ++state->failures;
      if (--state->left == 0) state->done.notify_one();
    });
  }
  std::unique_lock lock(state->mutex);
  state->done.wait_for(lock, 10s, [&] { return state->left == 0; });
  return state->failures + static_cast<std::size_t>(state->left);
}

}  // namespace ecx::sim
