// Control-plane round trips on loopback: one client, reserve_batch of one item
// against a real server with a trivial handler. Reports p50 / p99 latency and
// requests per second, and the same figures for a bare ZeroMQ DEALER/ROUTER echo of
// a frame of the same size measured in the same run (the baseline; `*_vs_raw` are
// the ratios). Targets: p50 <= 50 us, >= 20,000 requests/s.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>
#include <zmq.hpp>

#include "ecx/control/client.h"
#include "ecx/control/server.h"
#include "ecx/core/dtype.h"
#include "ecx/wire/codec.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

class TrivialHandler : public ecx::control::ControlHandler {
 public:
  void describe(ecx::wire::HelloReply& reply) override { reply.data.transport = "ucx"; }
  std::vector<ecx::wire::ReserveResult> reserve_batch(const ecx::control::RequestContext&,
                                                      std::span<const ecx::wire::ReserveItem> items) override {
    std::vector<ecx::wire::ReserveResult> out;
    out.reserve(items.size());
    for (const auto& item : items) {
      ++next_;
      out.push_back(ecx::wire::ReserveResult::reserved(ecx::ReservationId(1, next_), next_, item.spec.nbytes()));
    }
    return out;
  }
  ecx::Result<ecx::wire::CancelReply> cancel(const ecx::control::RequestContext&,
                                             const ecx::wire::CancelRequest&) override {
    return ecx::wire::CancelReply{true};
  }
  ecx::Result<ecx::wire::StatusReply> status(const ecx::control::RequestContext&,
                                             const ecx::wire::StatusRequest&) override {
    return ecx::wire::StatusReply{};
  }

 private:
  std::uint64_t next_ = 0;
};

ecx::wire::ReserveItem one_item() {
  return ecx::wire::ReserveItem{"req-123-image-0", "sha256:0123456789abcdef",
                                ecx::TensorSpec::make({1300, 3584}, ecx::DType::bfloat16, 1ULL << 40).value(),
                                std::nullopt};
}

struct Percentiles {
  double p50_us = 0;
  double p99_us = 0;
};

Percentiles percentiles(std::vector<double>& samples_us) {
  if (samples_us.empty()) return {};
  std::sort(samples_us.begin(), samples_us.end());
  auto at = [&](double q) {
    return samples_us[static_cast<std::size_t>(q * static_cast<double>(samples_us.size() - 1))];
  };
  return {at(0.50), at(0.99)};
}

// Same-run baseline figures, filled by the raw benchmarks (registered first).
std::atomic<double> g_raw_p50_us{0};
std::atomic<double> g_raw_rate{0};

double us_since(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// ---------------------------------------------------------------- baseline

// A ROUTER thread echoing every frame, as fast as ZeroMQ goes.
class RawEcho {
 public:
  RawEcho() : router_(ctx_, zmq::socket_type::router) {
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
  ~RawEcho() {
    stop_.store(true);
    thread_.join();
  }
  const std::string& address() const { return address_; }

 private:
  zmq::context_t ctx_;
  zmq::socket_t router_;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

std::string request_frame() {
  std::string frame;
  ecx::wire::encode_request(ecx::wire::Request{1, 1000, ecx::wire::ReserveBatchRequest{{one_item()}}}, nullptr, frame);
  return frame;
}

void BM_RawZmqEcho(benchmark::State& state) {
  RawEcho echo;
  zmq::context_t ctx;
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(echo.address());
  const std::string frame = request_frame();
  std::vector<double> samples;
  samples.reserve(200'000);
  zmq::message_t reply;
  for (auto _ : state) {
    const auto start = Clock::now();
    dealer.send(zmq::buffer(frame), zmq::send_flags::none);
    (void)dealer.recv(reply, zmq::recv_flags::none);
    samples.push_back(us_since(start));
  }
  const auto p = percentiles(samples);
  g_raw_p50_us.store(p.p50_us);
  state.counters["p50_us"] = p.p50_us;
  state.counters["p99_us"] = p.p99_us;
  state.counters["req_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["frame_bytes"] = static_cast<double>(frame.size());
}
BENCHMARK(BM_RawZmqEcho)->UseRealTime()->MinTime(2.0);

void BM_RawZmqEchoPipelined(benchmark::State& state) {
  const int window = static_cast<int>(state.range(0));
  RawEcho echo;
  zmq::context_t ctx;
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(echo.address());
  const std::string frame = request_frame();
  zmq::message_t reply;
  const auto start = Clock::now();
  for (auto _ : state) {
    for (int i = 0; i < window; ++i) dealer.send(zmq::buffer(frame), zmq::send_flags::none);
    for (int i = 0; i < window; ++i) (void)dealer.recv(reply, zmq::recv_flags::none);
  }
  const double total = static_cast<double>(state.iterations()) * window;
  g_raw_rate.store(total / (us_since(start) / 1e6));
  state.counters["req_per_s"] = benchmark::Counter(total, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_RawZmqEchoPipelined)->Arg(64)->UseRealTime()->MinTime(2.0);

// ---------------------------------------------------------------- ECX control plane

struct Loopback {
  Loopback() {
    server = std::move(
        ecx::control::ControlServer::start(ecx::control::ServerOptions{}, std::make_shared<TrivialHandler>()).value());
    client = std::move(ecx::control::ControlClient::create(ecx::control::ClientOptions{}).value());
    address = "tcp://127.0.0.1:" + std::to_string(server->port());
    (void)client->hello(address, 5s);  // connect before timing
  }
  std::unique_ptr<ecx::control::ControlServer> server;
  std::unique_ptr<ecx::control::ControlClient> client;
  std::string address;
};

void BM_ReserveBatchRoundTrip(benchmark::State& state) {
  Loopback loop;
  std::vector<double> samples;
  samples.reserve(200'000);
  std::size_t failures = 0;
  for (auto _ : state) {
    const auto start = Clock::now();
    auto reply = loop.client->reserve_batch(loop.address, {one_item()}, 5s);
    samples.push_back(us_since(start));
    failures += reply.is_ok() ? 0 : 1;
  }
  const auto p = percentiles(samples);
  state.counters["p50_us"] = p.p50_us;
  state.counters["p99_us"] = p.p99_us;
  state.counters["req_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["failures"] = static_cast<double>(failures);
  if (g_raw_p50_us.load() > 0) state.counters["p50_vs_raw"] = p.p50_us / g_raw_p50_us.load();
}
BENCHMARK(BM_ReserveBatchRoundTrip)->UseRealTime()->MinTime(2.0);

void BM_ReserveBatchPipelined(benchmark::State& state) {
  const int window = static_cast<int>(state.range(0));
  Loopback loop;
  std::mutex mutex;
  std::condition_variable cv;
  std::size_t failures = 0;
  const auto start = Clock::now();
  for (auto _ : state) {
    int left = window;
    for (int i = 0; i < window; ++i) {
      loop.client->call_async(loop.address, ecx::wire::ReserveBatchRequest{{one_item()}}, 5s,
                              [&](ecx::Result<ecx::wire::Reply> reply) {
                                std::lock_guard lock(mutex);
                                if (!reply || !reply->ok()) ++failures;
                                if (--left == 0) cv.notify_one();
                              });
    }
    std::unique_lock lock(mutex);
    cv.wait_for(lock, 10s, [&] { return left == 0; });
  }
  const double total = static_cast<double>(state.iterations()) * window;
  const double rate = total / (us_since(start) / 1e6);
  state.counters["req_per_s"] = benchmark::Counter(total, benchmark::Counter::kIsRate);
  state.counters["failures"] = static_cast<double>(failures);
  if (g_raw_rate.load() > 0) state.counters["rate_vs_raw"] = rate / g_raw_rate.load();
}
BENCHMARK(BM_ReserveBatchPipelined)->Arg(64)->UseRealTime()->MinTime(2.0);

// Encoding and decoding alone, to see where the time goes.
void BM_CodecReserveOneItem(benchmark::State& state) {
  const ecx::wire::Request request{1, 1000, ecx::wire::ReserveBatchRequest{{one_item()}}};
  std::string frame;
  for (auto _ : state) {
    ecx::wire::encode_request(request, nullptr, frame);
    auto decoded = ecx::wire::decode_request(frame, ecx::wire::Limits{});
    benchmark::DoNotOptimize(decoded);
  }
}
BENCHMARK(BM_CodecReserveOneItem);

}  // namespace

BENCHMARK_MAIN();
