// In-process tests of the proxy server's lifecycle and HTTP plumbing on loopback,
// meant for the sanitizer builds (the end-to-end behaviour is covered by the Node
// suite in tests/integration/proxy).
#include <future>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <boost/asio/executor_work_guard.hpp>
#include <nlohmann/json.hpp>

#include "ecx/proxy/metrics.h"
#include "ecx/proxy/proxy.h"
#include "ecx/proxy/roster.h"
#include "proxy/http.h"

namespace ecx::proxy {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;
namespace net = boost::asio;

// An io_context on its own thread for the test's fake engine and client.
class Loop {
 public:
  Loop() : work_(io_.get_executor()), thread_([this] { io_.run(); }) {}
  ~Loop() {
    work_.reset();
    io_.stop();
    thread_.join();
  }
  net::io_context& io() { return io_; }
  template <typename Fn>
  auto run(Fn fn) {
    std::promise<decltype(fn())> done;
    net::post(io_, [&] { done.set_value(fn()); });
    return done.get_future().get();
  }

 private:
  net::io_context io_{1};
  net::executor_work_guard<net::io_context::executor_type> work_;
  std::thread thread_;
};

// A fake decode engine (test double): answers chat requests, streaming or not.
http::Task<void> fake_decode(http::ServerRequest& req, http::Responder& res) {
  if (req.path() == "/health") {
    (void)co_await res.send(200, http::content_type("application/json"), "{}");
    co_return;
  }
  const json body = json::parse(req.body);
  if (body.value("stream", false)) {
    (void)co_await res.begin_stream(200, http::content_type("text/event-stream"));
    (void)co_await res.write_chunk("data: {\"n\":1}\n\n");
    (void)co_await res.write_chunk("data: [DONE]\n\n");
    (void)co_await res.end_stream();
    co_return;
  }
  json reply = {{"echo_request_id", std::string(req.header("x-request-id"))}};
  (void)co_await res.send(200, http::content_type("application/json"), reply.dump());
}

struct Fetched {
  int status = 0;
  std::string body;
};

http::Task<void> do_fetch(http::Client& client, UpstreamUrl url, http::UpstreamRequest request,
                          std::promise<Fetched>* out) {
  auto response = co_await client.fetch(url, std::move(request));
  out->set_value(response ? Fetched{response->status, response->body} : Fetched{0, response.status().message()});
}

class ProxyServerTest : public ::testing::Test {
 protected:
  Loop loop;
  std::unique_ptr<http::Server> decode;
  std::unique_ptr<http::Client> client;

  void SetUp() override {
    const Status listening = loop.run([&] {
      decode = std::make_unique<http::Server>(loop.io(), fake_decode, http::ServerLimits{});
      client = std::make_unique<http::Client>(loop.io(), http::ClientLimits{});
      return decode->listen("127.0.0.1", 0);
    });
    ASSERT_TRUE(listening) << listening.to_string();
  }
  void TearDown() override {
    loop.run([&] {
      client.reset();
      decode.reset();
      return 0;
    });
  }

  std::string decode_url() { return fmt::format("http://127.0.0.1:{}", decode->port()); }

  Fetched fetch(std::uint16_t port, std::string method, std::string target, std::string body = "") {
    std::promise<Fetched> result;
    auto future = result.get_future();
    net::post(loop.io(), [&] {
      http::UpstreamRequest request{std::move(method), std::move(target), http::content_type("application/json"),
                                    std::move(body), 5s};
      http::spawn(loop.io(), do_fetch(*client, UpstreamUrl{"127.0.0.1", port}, std::move(request), &result), "fetch");
    });
    return future.get();
  }
};

TEST_F(ProxyServerTest, ServesAChatThroughTheDecodeAndShutsDownCleanly) {
  ProxyOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.decode_urls = {decode_url()};
  options.probe_interval = 5ms;  // the prober runs many rounds during the test
  auto proxy = ProxyServer::create(options);
  ASSERT_TRUE(proxy) << proxy.status().to_string();
  ASSERT_TRUE((*proxy)->start());
  const auto port = (*proxy)->port();
  ASSERT_NE(port, 0);

  const json chat = {{"model", "m"}, {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}};
  for (int i = 0; i < 3; ++i) {
    const auto answer = fetch(port, "POST", "/v1/chat/completions", chat.dump());
    ASSERT_EQ(answer.status, 200) << answer.body;
    EXPECT_EQ(json::parse(answer.body)["echo_request_id"].get<std::string>().size(), 32u);
  }
  json streaming = chat;
  streaming["stream"] = true;
  const auto streamed = fetch(port, "POST", "/v1/chat/completions", streaming.dump());
  EXPECT_EQ(streamed.status, 200);
  EXPECT_EQ(streamed.body, "data: {\"n\":1}\n\ndata: [DONE]\n\n");
  EXPECT_EQ(fetch(port, "GET", "/health").status, 200);
  EXPECT_EQ(fetch(port, "GET", "/instances").status, 403);
  EXPECT_EQ((*proxy)->roster().live_count(InstanceRole::decode), 1u);
  (*proxy)->shutdown();
  EXPECT_EQ(fetch(port, "GET", "/health").status, 0);  // refused once shut down
  (*proxy)->shutdown();                                // idempotent
}

TEST_F(ProxyServerTest, ProbesEvictAnInstanceThatStopsAnswering) {
  ProxyOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.decode_urls = {decode_url()};
  options.probe_interval = 2ms;
  options.probe_timeout = 1s;
  auto proxy = ProxyServer::create(options);
  ASSERT_TRUE(proxy);
  ASSERT_TRUE((*proxy)->start());
  loop.run([&] {
    decode.reset();  // the decode goes away: connections refused
    return 0;
  });
  // Waits for the prober's verdict (bounded): three refused probes evict the decode.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while ((*proxy)->roster().live_count(InstanceRole::decode) != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ((*proxy)->roster().evicted_count(InstanceRole::decode), 1u);
  EXPECT_GE((*proxy)->metrics().value("ecx_proxy_evictions_total", ""), 1);
}

TEST(ProxyServerCreate, RejectsInvalidOptions) {
  ProxyOptions options;
  options.decode_urls = {"not a url"};
  EXPECT_EQ(ProxyServer::create(options).status().code(), StatusCode::invalid_argument);
}

}  // namespace
}  // namespace ecx::proxy
