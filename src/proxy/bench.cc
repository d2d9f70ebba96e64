#include "ecx/proxy/bench.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <future>
#include <thread>

#include <fmt/format.h>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/this_coro.hpp>
#include <nlohmann/json.hpp>

#include "ecx/proxy/proxy.h"
#include "http.h"

namespace ecx::proxy {

using nlohmann::json;
using Steady = std::chrono::steady_clock;
namespace net = boost::asio;

namespace {

// An io_context on its own thread, joined on destruction.
class LoopThread {
 public:
  LoopThread() : work_(io_.get_executor()), thread_([this] { io_.run(); }) {}
  ~LoopThread() { stop(); }
  LoopThread(const LoopThread&) = delete;
  LoopThread& operator=(const LoopThread&) = delete;
  net::io_context& io() { return io_; }
  void stop() {
    work_.reset();
    io_.stop();
    if (thread_.joinable()) thread_.join();
  }

 private:
  net::io_context io_{1};
  net::executor_work_guard<net::io_context::executor_type> work_;
  std::thread thread_;
};

// Runs `fn` on the loop's thread and waits for it (setup and teardown only).
template <typename Fn>
auto on_loop(net::io_context& io, Fn fn) {
  std::promise<decltype(fn())> done;
  auto result = done.get_future();
  net::post(io, [&] { done.set_value(fn()); });
  return result.get();
}

// The bench's fake engines (test doubles answering like vLLM, without a model).
http::Task<void> fake_engine(const http::ServerRequest& req, http::Responder& res, int chunks,
                             Duration token_interval) {
  if (req.path() == "/health") {
    (void)co_await res.send(200, http::content_type("application/json"), "{}");
    co_return;
  }
  const json body = json::parse(req.body, nullptr, false);
  if (body.is_object() && body.contains("ec_transfer_params") && body["ec_transfer_params"].contains("consumer_zmq")) {
    // Encoder: one keyed metadata entry per item.
    json params = json::object();
    const auto& items = body["ec_transfer_params"]["ec_items"];
    for (std::size_t i = 0; i < items.size(); ++i) {
      params[fmt::format("bench-hash-{}", items[i]["transfer_id"].get<std::string>())] = {
          {"metadata", {{"image_grid_thw", json::array({json::array({1, 16, 16})})}}}};
    }
    json reply = {{"id", "enc"}, {"choices", json::array()}, {"ec_transfer_params", params}};
    (void)co_await res.send(200, http::content_type("application/json"), reply.dump());
    co_return;
  }
  if (!(co_await res.begin_stream(200, http::content_type("text/event-stream")))) co_return;
  for (int i = 0; i < chunks; ++i) {
    const auto event = fmt::format(
        "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,"
        "\"delta\":{{\"content\":\"token{} \"}}}}]}}\n\n",
        i);
    if (!(co_await res.write_chunk(event))) co_return;
    if (token_interval > Duration::zero()) {  // an engine's pace between two tokens
      net::steady_timer pace(co_await net::this_coro::executor);
      pace.expires_after(token_interval);
      boost::system::error_code ec;
      co_await pace.async_wait(net::redirect_error(net::use_awaitable, ec));
    }
  }
  if (!(co_await res.write_chunk("data: [DONE]\n\n"))) co_return;
  (void)co_await res.end_stream();
}

struct LoadState {
  std::vector<double> latencies_us;
  std::size_t errors = 0;
  int next = 0;
  int total = 0;
  http::WaitGroup wait;
  explicit LoadState(net::io_context& io) : wait(io) {}
};

http::Task<void> worker(http::Client& client, UpstreamUrl url, std::string body, std::shared_ptr<LoadState> state) {
  while (state->next < state->total) {
    ++state->next;
    const auto start = Steady::now();
    http::UpstreamRequest request{"POST", "/v1/chat/completions", http::content_type("application/json"), body,
                                  std::chrono::seconds(30)};
    auto stream = co_await client.open(url, std::move(request));
    bool ok = stream && (*stream)->status() == 200;
    if (ok) {
      auto all = co_await (*stream)->read_all(std::chrono::seconds(30), 1u << 20);
      ok = all && all->find("[DONE]") != std::string::npos;
    }
    if (ok) {
      state->latencies_us.push_back(std::chrono::duration<double, std::micro>(Steady::now() - start).count());
    } else {
      ++state->errors;
    }
  }
  state->wait.done();
}

http::Task<void> signal_when_done(std::shared_ptr<LoadState> state, std::promise<void>* done) {
  co_await state->wait.wait();
  done->set_value();
}

double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto index = static_cast<std::size_t>(std::llround(q * static_cast<double>(values.size() - 1)));
  return values[std::min(index, values.size() - 1)];
}

// Measurements of one series, accumulated over rounds.
struct SeriesSamples {
  std::string name;
  UpstreamUrl url;
  std::string body;
  std::vector<double> latencies_us;
  std::size_t errors = 0;
  double seconds = 0;
  double cpu_seconds = 0;  // CPU time of the whole process (clients, fakes, proxy)
};

double process_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

// One batch of `total` requests with `concurrency` clients in flight.
struct Batch {
  std::shared_ptr<LoadState> state;
  double seconds = 0;
  double cpu_seconds = 0;
};

Batch run_batch(LoopThread& load, http::Client& client, const SeriesSamples& series, int total, int concurrency) {
  auto state = on_loop(load.io(), [&] {
    auto s = std::make_shared<LoadState>(load.io());
    s->total = total;
    s->latencies_us.reserve(static_cast<std::size_t>(total));
    return s;
  });
  std::promise<void> finished;
  const auto start = Steady::now();
  const double cpu_start = process_cpu_seconds();
  net::post(load.io(), [&] {
    state->wait.add(static_cast<std::size_t>(concurrency));
    for (int i = 0; i < concurrency; ++i) {
      http::spawn(load.io(), worker(client, series.url, series.body, state), "bench worker");
    }
    http::spawn(load.io(), signal_when_done(state, &finished), "bench waiter");
  });
  finished.get_future().wait();
  return {state, std::chrono::duration<double>(Steady::now() - start).count(), process_cpu_seconds() - cpu_start};
}

}  // namespace

Result<std::vector<ProxyBenchSeries>> run_proxy_bench(const ProxyBenchOptions& options) {
  if (options.concurrency < 1 || options.requests < 1 || options.warmup < 0 || options.chunks < 0 ||
      options.token_interval_us < 0) {
    return invalid_argument("concurrency and requests must be positive; warm-up and chunks not negative");
  }
  LoopThread fakes;
  const int chunks = options.chunks;
  const auto pace = std::chrono::duration_cast<Duration>(std::chrono::microseconds(options.token_interval_us));
  auto decode = std::make_unique<http::Server>(
      fakes.io(),
      [chunks, pace](http::ServerRequest& req, http::Responder& res) { return fake_engine(req, res, chunks, pace); },
      http::ServerLimits{});
  auto encoder = std::make_unique<http::Server>(
      fakes.io(),
      [chunks, pace](http::ServerRequest& req, http::Responder& res) { return fake_engine(req, res, chunks, pace); },
      http::ServerLimits{});
  ECX_RETURN_IF_ERROR(on_loop(fakes.io(), [&] { return decode->listen("127.0.0.1", 0); }));
  ECX_RETURN_IF_ERROR(on_loop(fakes.io(), [&] { return encoder->listen("127.0.0.1", 0); }));
  const UpstreamUrl decode_url{"127.0.0.1", decode->port()};
  const UpstreamUrl encoder_url{"127.0.0.1", encoder->port()};

  ProxyOptions proxy_options;
  proxy_options.host = "127.0.0.1";
  proxy_options.port = 0;
  proxy_options.encode_urls = {encoder_url.text()};
  proxy_options.decode_urls = {decode_url.text()};
  proxy_options.ec_consumer_zmq_addrs = {"tcp://127.0.0.1:14579"};
  proxy_options.probe_interval = Duration::zero();
  proxy_options.max_idle_per_upstream = 1024;
  auto proxy = ProxyServer::create(proxy_options);
  if (!proxy) return proxy.status();
  ECX_RETURN_IF_ERROR((*proxy)->start());
  const UpstreamUrl proxy_url{"127.0.0.1", (*proxy)->port()};

  LoopThread load;
  auto client = std::make_unique<http::Client>(
      load.io(), http::ClientLimits{std::chrono::seconds(5), std::chrono::seconds(30), 1024, 16u << 20});

  const json text = {{"model", "bench"},
                     {"stream", true},
                     {"max_tokens", options.chunks},
                     {"messages", json::array({{{"role", "user"}, {"content", "Say something."}}})}};
  json image = text;
  image["messages"][0]["content"] =
      json::array({{{"type", "text"}, {"text", "Describe the image."}},
                   {{"type", "image_url"}, {"image_url", {{"url", "https://example.invalid/bench.png"}}}}});

  std::vector<SeriesSamples> samples = {
      {"direct", decode_url, text.dump(), {}, 0, 0},
      {"proxy", proxy_url, text.dump(), {}, 0, 0},
      {"proxy_image", proxy_url, image.dump(), {}, 0, 0},
  };
  for (auto& series : samples) (void)run_batch(load, *client, series, options.warmup, options.concurrency);
  // The series take turns, round after round, so a noisy neighbour on the machine
  // weighs on all of them alike.
  const int rounds = std::max(1, options.rounds);
  for (int round = 0; round < rounds; ++round) {
    const int share = options.requests / rounds + (round < options.requests % rounds ? 1 : 0);
    for (auto& series : samples) {
      const auto batch = run_batch(load, *client, series, share, options.concurrency);
      series.latencies_us.insert(series.latencies_us.end(), batch.state->latencies_us.begin(),
                                 batch.state->latencies_us.end());
      series.errors += batch.state->errors;
      series.seconds += batch.seconds;
      series.cpu_seconds += batch.cpu_seconds;
    }
  }
  std::vector<ProxyBenchSeries> results;
  for (const auto& series : samples) {
    ProxyBenchSeries out;
    out.series = series.name;
    out.requests = series.latencies_us.size();
    out.errors = series.errors;
    out.p50_us = percentile(series.latencies_us, 0.50);
    out.p99_us = percentile(series.latencies_us, 0.99);
    out.per_s = series.seconds > 0 ? static_cast<double>(out.requests) / series.seconds : 0;
    out.cpu_us_per_request = out.requests > 0 ? series.cpu_seconds * 1e6 / static_cast<double>(out.requests) : 0;
    results.push_back(out);
  }

  on_loop(load.io(), [&] {
    client.reset();
    return 0;
  });
  load.stop();
  (*proxy)->shutdown();
  on_loop(fakes.io(), [&] {
    decode.reset();
    encoder.reset();
    return 0;
  });
  fakes.stop();

  const auto& direct = results.front();
  for (auto& series : results) {
    series.ratio_vs_direct = direct.p50_us > 0 ? series.p50_us / direct.p50_us : 0;
    series.added_p50_us = series.p50_us - direct.p50_us;
    series.added_p99_us = series.p99_us - direct.p99_us;
  }
  return results;
}

}  // namespace ecx::proxy
