// In-process tests of the proxy server's lifecycle and HTTP plumbing on loopback,
// meant for the sanitizer builds (the end-to-end behaviour is covered by the Node
// suite in tests/integration/proxy).
#include <future>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/this_coro.hpp>
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

// What the fake engines below received, for the test thread to inspect.
struct Received {
  std::mutex mutex;
  std::vector<json> bodies;
  void add(json body) {
    std::lock_guard lock(mutex);
    bodies.push_back(std::move(body));
  }
  std::vector<json> all() {
    std::lock_guard lock(mutex);
    return bodies;
  }
};

// A fake encoder (test double): keyed metadata per item; "stall" in an item's URL
// delays the answer, "fail" answers 500.
http::Task<void> fake_encoder(http::ServerRequest& req, http::Responder& res, Received* received) {
  if (req.path() == "/health") {
    (void)co_await res.send(200, http::content_type("application/json"), "{}");
    co_return;
  }
  const json body = json::parse(req.body);
  received->add(body);
  const auto& item = body["messages"][0]["content"][0];
  const std::string url = item["image_url"]["url"];
  if (url.find("stall") != std::string::npos) {
    net::steady_timer stall(co_await net::this_coro::executor);
    stall.expires_after(300ms);
    boost::system::error_code ec;
    co_await stall.async_wait(net::redirect_error(net::use_awaitable, ec));
  }
  if (url.find("fail") != std::string::npos) {
    (void)co_await res.send(500, http::content_type("application/json"), R"({"error":{"message":"boom"}})");
    co_return;
  }
  json params = {{"hash-" + item["uuid"].get<std::string>(), {{"metadata", {{"image_grid_thw", {{1, 2, 2}}}}}}}};
  json reply = {{"ec_transfer_params", params}};
  (void)co_await res.send(200, http::content_type("application/json"), reply.dump());
}

// A fake prefill (test double): returns kv_transfer_params.
http::Task<void> fake_prefill(http::ServerRequest& req, http::Responder& res, Received* received) {
  if (req.path() == "/health") {
    (void)co_await res.send(200, http::content_type("application/json"), "{}");
    co_return;
  }
  received->add(json::parse(req.body));
  json reply = {{"kv_transfer_params", {{"remote_engine_id", "prefill-1"}, {"remote_block_ids", {7}}}}};
  (void)co_await res.send(200, http::content_type("application/json"), reply.dump());
}

// A fake decode engine (test double): answers chat requests, streaming or not.
http::Task<void> fake_decode(http::ServerRequest& req, http::Responder& res, Received* received) {
  if (req.path() == "/health") {
    (void)co_await res.send(200, http::content_type("application/json"), "{}");
    co_return;
  }
  const json body = json::parse(req.body);
  received->add(body);
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
  Received decoded, encoded, prefilled;
  std::unique_ptr<http::Server> decode, encoder, prefill;
  std::unique_ptr<http::Client> client;

  void SetUp() override {
    const Status listening = loop.run([&] {
      decode = std::make_unique<http::Server>(
          loop.io(), [this](http::ServerRequest& q, http::Responder& r) { return fake_decode(q, r, &decoded); },
          http::ServerLimits{});
      encoder = std::make_unique<http::Server>(
          loop.io(), [this](http::ServerRequest& q, http::Responder& r) { return fake_encoder(q, r, &encoded); },
          http::ServerLimits{});
      prefill = std::make_unique<http::Server>(
          loop.io(), [this](http::ServerRequest& q, http::Responder& r) { return fake_prefill(q, r, &prefilled); },
          http::ServerLimits{});
      client = std::make_unique<http::Client>(loop.io(), http::ClientLimits{});
      Status status = decode->listen("127.0.0.1", 0);
      if (status) status = encoder->listen("127.0.0.1", 0);
      if (status) status = prefill->listen("127.0.0.1", 0);
      return status;
    });
    ASSERT_TRUE(listening) << listening.to_string();
  }
  void TearDown() override {
    loop.run([&] {
      client.reset();
      decode.reset();
      encoder.reset();
      prefill.reset();
      return 0;
    });
  }

  std::string decode_url() { return fmt::format("http://127.0.0.1:{}", decode->port()); }
  std::string encoder_url() { return fmt::format("http://127.0.0.1:{}", encoder->port()); }
  std::string prefill_url() { return fmt::format("http://127.0.0.1:{}", prefill->port()); }

  ProxyOptions options_for_epd(bool with_prefill) {
    ProxyOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.encode_urls = {encoder_url(), encoder_url() + "/"};  // one engine, listed twice
    options.decode_urls = {decode_url()};
    if (with_prefill) options.prefill_urls = {prefill_url()};
    options.ec_consumer_zmq_addrs = {"tcp://127.0.0.1:15999"};
    options.probe_interval = Duration::zero();
    return options;
  }

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
  // The roster shows the eviction before the prober counts it in the metrics (its
  // next statement, on the proxy's thread), so both are waited for.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (((*proxy)->roster().live_count(InstanceRole::decode) != 0 ||
          (*proxy)->metrics().value("ecx_proxy_evictions_total", {}) < 1) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ((*proxy)->roster().evicted_count(InstanceRole::decode), 1u);
  EXPECT_GE((*proxy)->metrics().value("ecx_proxy_evictions_total", {}), 1);
}

json chat_with_images(const std::vector<std::string>& urls, bool stream) {
  json content = json::array();
  for (const auto& url : urls) content.push_back({{"type", "image_url"}, {"image_url", {{"url", url}}}});
  return {{"model", "m"}, {"stream", stream}, {"messages", json::array({{{"role", "user"}, {"content", content}}})}};
}

TEST_F(ProxyServerTest, EncodesEveryImageAndBindsTheSameTransferIdsOnBothHops) {
  auto options = options_for_epd(true);
  auto proxy = ProxyServer::create(options);
  ASSERT_TRUE(proxy) << proxy.status().to_string();
  ASSERT_TRUE((*proxy)->start());
  const auto answer = fetch((*proxy)->port(), "POST", "/v1/chat/completions",
                            chat_with_images({"http://i/a", "http://i/b", "http://i/a"}, true).dump());
  ASSERT_EQ(answer.status, 200) << answer.body;
  EXPECT_EQ(answer.body, "data: {\"n\":1}\n\ndata: [DONE]\n\n");
  (*proxy)->shutdown();

  const auto encodes = encoded.all();
  ASSERT_EQ(encodes.size(), 3u);
  std::set<std::string> ids;
  for (const auto& body : encodes) {
    EXPECT_EQ(body["ec_transfer_params"]["consumer_zmq"], "tcp://127.0.0.1:15999");
    ids.insert(body["ec_transfer_params"]["ec_items"][0]["transfer_id"].get<std::string>());
  }
  EXPECT_EQ(ids.size(), 3u);
  const auto prefills = prefilled.all();
  const auto decodes = decoded.all();
  ASSERT_EQ(prefills.size(), 1u);
  ASSERT_EQ(decodes.size(), 1u);
  std::set<std::string> prefill_ids, decode_ids;
  for (const auto& item : prefills[0]["ec_transfer_params"]["ec_items"])
    prefill_ids.insert(item["transfer_id"].get<std::string>());
  for (const auto& item : decodes[0]["ec_transfer_params"]["ec_items"])
    decode_ids.insert(item["transfer_id"].get<std::string>());
  EXPECT_EQ(prefill_ids, ids);
  EXPECT_EQ(decode_ids, ids);
  EXPECT_EQ(decodes[0]["kv_transfer_params"]["remote_engine_id"], "prefill-1");
  EXPECT_EQ(decodes[0]["messages"][0]["content"][0]["type"], "image_embeds");
  EXPECT_EQ((*proxy)->metrics().observations("ecx_proxy_stage_seconds", {{"stage", "prefill"}}), 1u);
}

TEST_F(ProxyServerTest, AFailedEncodeAnswersAtOnceAndShutdownFindsNoDanglingWork) {
  auto proxy = ProxyServer::create(options_for_epd(false));
  ASSERT_TRUE(proxy);
  ASSERT_TRUE((*proxy)->start());
  // One item fails at once while its sibling stalls: the client is answered without
  // waiting, the sibling is cancelled, and nothing reaches the decode.
  const auto answer = fetch((*proxy)->port(), "POST", "/v1/chat/completions",
                            chat_with_images({"http://i/fail", "http://i/stall"}, false).dump());
  EXPECT_EQ(answer.status, 500);
  EXPECT_EQ(json::parse(answer.body)["error"]["stage"], "encode");
  EXPECT_TRUE(decoded.all().empty());
  (*proxy)->shutdown();
}

TEST(ProxyServerCreate, RejectsInvalidOptions) {
  ProxyOptions options;
  options.decode_urls = {"not a url"};
  EXPECT_EQ(ProxyServer::create(options).status().code(), StatusCode::invalid_argument);
}

}  // namespace
}  // namespace ecx::proxy
