#include <atomic>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <nlohmann/json.hpp>

#include "core/logging.h"
#include "ecx/core/config.h"
#include "ecx/core/thread_name.h"
#include "ecx/proxy/metrics.h"
#include "ecx/proxy/proxy.h"
#include "ecx/proxy/roster.h"
#include "ecx/store/store_config.h"
#include "flow_json.h"
#include "http.h"
#include "roster_json.h"
#include "store_route.h"

namespace ecx::proxy {

using http::Fields;
using http::Task;
using nlohmann::json;
namespace net = boost::asio;
using Steady = std::chrono::steady_clock;

namespace {

constexpr std::string_view kJson = "application/json";
constexpr std::string_view kDpHeader = "X-data-parallel-rank";

double seconds_since(Steady::time_point start) { return std::chrono::duration<double>(Steady::now() - start).count(); }

std::string_view error_type(int status) {
  if (status == 401 || status == 403) return "authentication_error";
  if (status == 404) return "not_found_error";
  if (status < 500) return "invalid_request_error";
  return "proxy_error";
}

// A failed stage: what the client is told.
struct StageError {
  int status = 500;
  std::string stage;
  std::string message;
  json upstream = nullptr;  // the upstream's own error body, when it sent one
};

int status_for(const http::FetchError& error) { return error.kind == http::TransportError::timeout ? 504 : 502; }

json parse_or_text(const std::string& body) {
  json parsed = json::parse(body, nullptr, false);
  if (parsed.is_discarded()) return body.size() > 4096 ? json(body.substr(0, 4096)) : json(body);
  return parsed;
}

// The upstream's error message, when its body is an OpenAI-style error.
std::string upstream_message(const json& upstream) {
  if (upstream.is_object()) {
    if (const auto e = upstream.find("error"); e != upstream.end()) {
      if (e->is_object() && e->contains("message") && (*e)["message"].is_string()) return (*e)["message"];
      if (e->is_string()) return *e;
    }
    if (const auto m = upstream.find("message"); m != upstream.end() && m->is_string()) return *m;
  }
  if (upstream.is_string()) return upstream.get<std::string>();
  return {};
}

StageError upstream_status_error(std::string stage, std::string url, int status, const std::string& body) {
  StageError error;
  error.status = status;
  error.stage = stage;
  error.upstream = parse_or_text(body);
  const auto detail = upstream_message(error.upstream);
  error.message = fmt::format("{} instance {} answered {}{}{}", stage, url, status, detail.empty() ? "" : ": ", detail);
  return error;
}

struct Timings {
  Steady::time_point start = Steady::now();
  double encode = 0, rewrite = 0, prefill = 0, decode = 0, decode_ttfb = 0;
};

// State shared by the encoder sub-requests of one attempt; outlives a fail-fast return.
struct EncodeFanOut {
  http::WaitGroup wait;
  http::CancelGroup cancel;
  std::optional<StageError> error;
  std::vector<ItemReport> reports;
  explicit EncodeFanOut(net::io_context& io) : wait(io) {}
};

struct ProbeRound {
  http::WaitGroup wait;
  explicit ProbeRound(net::io_context& io) : wait(io) {}
};

}  // namespace

struct ProxyServer::Impl {
  net::io_context io{1};  // first member: destroyed last, after everything that uses it
  ProxyOptions options;
  std::shared_ptr<const Clock> clock;
  Roster roster;
  Metrics metrics;
  http::Client client;
  std::unique_ptr<http::Server> server;
  net::steady_timer probe_timer{io};
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  std::thread thread;
  std::mutex lifecycle_mutex;
  std::atomic<std::uint16_t> bound_port{0};
  bool stopping = false;  // I/O thread only
  std::shared_ptr<spdlog::logger> log = ecx::log::get("proxy");
  // The cross-encoder cache (null when --store-url is not given); I/O thread only.
  std::unique_ptr<StoreRoute> store;
  std::optional<std::uint64_t> store_collector;  // the presence index's series in `metrics`

  Impl(ProxyOptions o, std::shared_ptr<const Clock> c)
      : options(std::move(o)),
        clock(std::move(c)),
        roster(clock, RosterSettings{options.fail_threshold, options.evicted_ttl}),
        client(io, http::ClientLimits{options.connect_timeout, options.keep_alive_idle, options.max_idle_per_upstream,
                                      256u << 20}) {
    describe_metrics();
  }

  ~Impl() {
    // The collector reads the index, which goes before the registry does.
    if (store_collector) metrics.registry().remove_collector(*store_collector);
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // Opens the presence index; the store need not be up (the index retries by itself).
  Status open_store() {
    auto index = store::open_presence_index(store_config(options));
    if (!index) return with_store_flag_names(index.status());
    store = std::make_unique<StoreRoute>(std::move(*index), options.store_learned_max);
    store_collector = store->index().export_metrics(metrics.registry());
    for (const auto result : {"hit", "miss", "unknown"})
      metrics.add("ecx_proxy_store_checks_total", {{"result", result}}, 0);
    metrics.add("ecx_proxy_encode_skipped_total", {}, 0);
    metrics.add("ecx_proxy_items_forwarded_total", {{"form", "store"}}, 0);
    metrics.add("ecx_proxy_store_learned_forgotten_total", {}, 0);
    metrics.set("ecx_proxy_store_learned_hashes", {}, 0);
    log->info("cross-encoder cache: images in {} (prefix '{}', model '{}') skip the encoders",
              redact_url_password(options.store_url), options.store_prefix, options.store_model);
    return Status::ok();
  }

  void describe_metrics() {
    metrics.describe("ecx_proxy_requests_total", "Client requests answered, by route and status");
    metrics.describe("ecx_proxy_upstream_requests_total", "Requests sent to upstream instances, by stage and outcome");
    metrics.describe("ecx_proxy_media_items_total", "Media items seen in chat requests, by modality");
    metrics.describe("ecx_proxy_items_forwarded_total",
                     "Media items forwarded to the consumer, rewritten into embeds or raw");
    metrics.describe("ecx_proxy_retries_total", "Whole-path retries after a decode 500");
    metrics.describe("ecx_proxy_stage_errors_total", "Requests failed, by stage and status");
    metrics.describe("ecx_proxy_stage_seconds",
                     "Time per stage of a request (encode, rewrite, prefill, decode, decode_ttfb, total)");
    metrics.describe("ecx_proxy_probes_total", "Liveness probes, by result");
    metrics.describe("ecx_proxy_evictions_total", "Instances evicted after failed probes");
    metrics.describe("ecx_proxy_readmissions_total", "Evicted instances re-admitted after a probe success");
    metrics.describe("ecx_proxy_instances", "Registered instances, by role and state");
    metrics.describe("ecx_proxy_inflight_requests", "Client requests being served");
    metrics.describe("ecx_proxy_store_checks_total",
                     "Images of all-image requests checked against the store: hit (in the store), miss (its engine "
                     "hash is not in the store), unknown (no engine hash learned yet)");
    metrics.describe("ecx_proxy_encode_skipped_total",
                     "Requests whose images were all in the store: no encoder was called");
    metrics.describe("ecx_proxy_store_learned_hashes", "Engine hashes learned from encoder answers");
    metrics.describe("ecx_proxy_store_learned_forgotten_total",
                     "Learned engine hashes forgotten to keep the map within --store-learned-max");
  }

  // ------------------------------------------------------------ replies

  Task<int> reply_json(http::Responder& res, int status, const json& body, Fields extra = {}) {
    extra.push_back(http::Field{"Content-Type", std::string(kJson)});
    (void)co_await res.send(status, std::move(extra), body.dump());
    co_return status;
  }

  Task<int> reply_error(http::Responder& res, const StageError& error) {
    json inner = {
        {"message", error.message}, {"type", error_type(error.status)}, {"code", error.status}, {"stage", error.stage}};
    if (!error.upstream.is_null()) inner["upstream_error"] = error.upstream;
    metrics.add("ecx_proxy_stage_errors_total", {{"stage", error.stage}, {"status", std::to_string(error.status)}});
    log->debug("answering {} ({}): {}", error.status, error.stage, error.message);
    json reply = {{"error", std::move(inner)}};
    co_return co_await reply_json(res, error.status, reply);
  }

  Task<int> reply_error(http::Responder& res, int status, std::string stage, std::string message) {
    // A named local: GCC 12 mishandles aggregate temporaries inside co_await expressions.
    const StageError error{status, std::move(stage), std::move(message), nullptr};
    co_return co_await reply_error(res, error);
  }

  void count_upstream(std::string_view stage, std::string_view outcome) {
    metrics.add("ecx_proxy_upstream_requests_total",
                {{"stage", std::string(stage)}, {"outcome", std::string(outcome)}});
  }

  static Fields forwarded_headers(const http::ServerRequest& req, std::string request_id) {
    Fields headers{{"Content-Type", std::string(kJson)}, {"x-request-id", std::move(request_id)}};
    if (const auto auth = req.header("authorization"); !auth.empty()) {
      headers.push_back({"Authorization", std::string(auth)});
    }
    return headers;
  }

  static UpstreamUrl url_of(const std::string& text) {
    auto parsed = parse_upstream_url(text);
    return parsed ? *parsed : UpstreamUrl{};
  }

  // ------------------------------------------------------------ encode

  Task<void> call_encoder(std::shared_ptr<EncodeFanOut> fan, std::string url, std::vector<std::size_t> items,
                          std::vector<MediaRef> media, std::vector<std::string> transfer_ids, json body,
                          Fields headers) {
    http::FetchError failure;
    count_upstream("encode", "sent");
    http::UpstreamRequest request{"POST", "/v1/chat/completions", std::move(headers), body.dump(),
                                  options.encode_timeout};
    auto response = co_await client.fetch(url_of(url), std::move(request), &fan->cancel, &failure);
    if (fan->error || fan->cancel.cancelled()) {  // another item already failed the request
      fan->wait.done();
      co_return;
    }
    std::optional<StageError> error;
    if (!response) {
      count_upstream("encode", http::transport_error_name(failure.kind));
      error = StageError{status_for(failure), "encode",
                         fmt::format("encoder {} failed: {}", url, response.status().message()), nullptr};
    } else if (response->status != 200) {
      count_upstream("encode", "http_error");
      error = upstream_status_error("encode", url, response->status, response->body);
    } else {
      const json parsed = json::parse(response->body, nullptr, false);
      auto reports = parsed.is_discarded() ? Result<std::vector<ItemReport>>(protocol_error("the response is not JSON"))
                                           : read_item_reports(parsed, media, items, transfer_ids);
      if (!reports) {
        count_upstream("encode", "bad_metadata");
        error = StageError{502, "encode",
                           fmt::format("encoder {} returned unusable metadata: {}", url, reports.status().message()),
                           nullptr};
      } else {
        count_upstream("encode", "ok");
        for (std::size_t i = 0; i < items.size(); ++i) fan->reports[items[i]] = std::move((*reports)[i]);
      }
    }
    if (error) {
      fan->error = std::move(error);
      fan->cancel.cancel();
      fan->wait.fail();
    }
    fan->wait.done();
  }

  // Sends the media items `to_encode` names to the encoders, concurrently; the first
  // failure wins. `reports` gets one entry per media item (empty for the others).
  Task<std::optional<StageError>> run_encoders(const http::ServerRequest& req, const json& body,
                                               const std::vector<MediaRef>& media,
                                               const std::vector<std::size_t>& to_encode,
                                               const std::vector<std::string>& transfer_ids,
                                               const std::string& consumer_zmq, const std::string& request_id,
                                               std::vector<ItemReport>& reports) {
    const auto groups = group_items(media, to_encode, options.encoder_max_batch);
    const auto encoders = roster.pick_many(InstanceRole::encode, groups.size());
    if (encoders.empty()) co_return StageError{503, "encode", "no live encode instance", nullptr};
    auto fan = std::make_shared<EncodeFanOut>(io);
    fan->reports.assign(media.size(), ItemReport{{}, json::object(), nullptr});
    fan->wait.add(groups.size());
    for (std::size_t g = 0; g < groups.size(); ++g) {
      json sub = build_encoder_body(body, media, groups[g], transfer_ids, consumer_zmq, options.rewrite);
      auto headers = forwarded_headers(req, fmt::format("{}:{}:{}", request_id, groups[g].front(), random_hex(6)));
      http::spawn(io,
                  call_encoder(fan, encoders[g], groups[g], media, transfer_ids, std::move(sub), std::move(headers)),
                  "encoder call");
    }
    co_await fan->wait.wait();
    if (fan->error) co_return fan->error;
    reports = fan->reports;
    co_return std::nullopt;
  }

  // ------------------------------------------------------------ prefill

  Task<Result<json>> run_prefill(const http::ServerRequest& req, const std::string& url, const json& consumer_body,
                                 const std::string& request_id, std::optional<int> dp_rank, StageError& error) {
    auto headers = forwarded_headers(req, request_id);
    if (dp_rank) headers.push_back({std::string(kDpHeader), std::to_string(*dp_rank)});
    http::FetchError failure;
    count_upstream("prefill", "sent");
    http::UpstreamRequest request{"POST", std::string(req.path()), std::move(headers),
                                  build_prefill_body(consumer_body).dump(), options.prefill_timeout};
    auto response = co_await client.fetch(url_of(url), std::move(request), nullptr, &failure);
    if (!response) {
      count_upstream("prefill", http::transport_error_name(failure.kind));
      error = StageError{status_for(failure), "prefill",
                         fmt::format("prefill {} failed: {}", url, response.status().message()), nullptr};
      co_return response.status();
    }
    if (response->status != 200) {
      count_upstream("prefill", "http_error");
      error = upstream_status_error("prefill", url, response->status, response->body);
      co_return unavailable(error.message);
    }
    const json parsed = json::parse(response->body, nullptr, false);
    auto decode_body = parsed.is_discarded() ? Result<json>(protocol_error("the prefill's response is not JSON"))
                                             : build_decode_body_after_prefill(consumer_body, parsed);
    if (!decode_body) {
      count_upstream("prefill", "bad_response");
      error = StageError{502, "prefill", fmt::format("prefill {}: {}", url, decode_body.status().message()), nullptr};
      co_return decode_body.status();
    }
    count_upstream("prefill", "ok");
    co_return decode_body;
  }

  // ------------------------------------------------------------ decode

  enum class DecodeOutcome { answered, retry };

  // Sends the body to the decode instance and relays its answer: a stream chunk by
  // chunk as it arrives, anything else whole. A 500 asks for a retry when allowed
  // (nothing has been sent to the client yet).
  Task<DecodeOutcome> run_decode(http::Responder& res, const std::string& url, std::string target, std::string body,
                                 Fields headers, bool may_retry, Timings& timings, int& answered) {
    const auto start = Steady::now();
    http::FetchError failure;
    count_upstream("decode", "sent");
    http::UpstreamRequest request{"POST", std::move(target), std::move(headers), std::move(body),
                                  options.decode_timeout};
    auto opened = co_await client.open(url_of(url), std::move(request), nullptr, &failure);
    if (!opened) {
      count_upstream("decode", http::transport_error_name(failure.kind));
      answered = co_await reply_error(res, status_for(failure), "decode",
                                      fmt::format("decode {} failed: {}", url, opened.status().message()));
      co_return DecodeOutcome::answered;
    }
    auto& upstream = **opened;
    const int status = upstream.status();
    std::string content_type(http::find_field(upstream.headers(), "content-type"));
    if (content_type.empty()) content_type = kJson;
    const bool event_stream = content_type.starts_with("text/event-stream");
    if (status == 200 && event_stream) {
      count_upstream("decode", "ok");
      Fields out = http::content_type(content_type);
      out.push_back(http::Field{"Cache-Control", "no-cache"});
      if (!(co_await res.begin_stream(200, std::move(out)))) co_return DecodeOutcome::answered;
      answered = 200;
      bool first = true;
      for (;;) {
        auto piece = co_await upstream.next(options.decode_timeout);
        if (!piece) {
          // Bytes are out already: the only honest signal left is an unterminated body.
          log->warn("decode {} stream broke after its head: {}", url, piece.status().message());
          count_upstream("decode", "stream_broken");
          co_return DecodeOutcome::answered;
        }
        if (piece->empty()) break;
        if (first) {
          timings.decode_ttfb = seconds_since(start);
          first = false;
        }
        if (!(co_await res.write_chunk(*piece))) co_return DecodeOutcome::answered;  // the client left
      }
      (void)co_await res.end_stream();
      timings.decode = seconds_since(start);
      co_return DecodeOutcome::answered;
    }
    auto whole = co_await upstream.read_all(options.decode_timeout, 256u << 20);
    if (!whole) {
      count_upstream("decode", "io");
      answered =
          co_await reply_error(res, 502, "decode", fmt::format("decode {} failed: {}", url, whole.status().message()));
      co_return DecodeOutcome::answered;
    }
    timings.decode_ttfb = timings.decode = seconds_since(start);
    if (status == 500 && may_retry) {
      count_upstream("decode", "http_error");
      co_return DecodeOutcome::retry;
    }
    if (status >= 200 && status < 300) {
      count_upstream("decode", "ok");
      (void)co_await res.send(status, http::content_type(content_type), std::move(*whole));
      answered = status;
      co_return DecodeOutcome::answered;
    }
    count_upstream("decode", "http_error");
    const auto error = upstream_status_error("decode", url, status, *whole);
    answered = co_await reply_error(res, error);
    co_return DecodeOutcome::answered;
  }

  // ------------------------------------------------------------ routes

  Task<int> chat(http::ServerRequest& req, http::Responder& res) {
    Timings timings;
    const json body = json::parse(req.body, nullptr, false);
    if (body.is_discarded() || !body.is_object()) {
      co_return co_await reply_error(res, 400, "request", "the request body must be a JSON object");
    }
    std::string request_id(req.header("x-request-id"));
    if (request_id.empty()) request_id = random_hex(32);
    auto found = find_media(body);
    if (!found) co_return co_await reply_error(res, 400, "request", found.status().message());
    const auto& media = *found;
    for (const auto& item : media)
      metrics.add("ecx_proxy_media_items_total", {{"modality", std::string(modality_name(item.modality))}});

    // Route: the consumer is the prefill when the deployment has one, else the decode.
    const bool has_prefill = roster.live_count(InstanceRole::prefill) + roster.evicted_count(InstanceRole::prefill) > 0;
    std::optional<std::string> prefill;
    if (has_prefill) {
      prefill = roster.pick(InstanceRole::prefill);
      if (!prefill) co_return co_await reply_error(res, 503, "prefill", "no live prefill instance");
    }
    const auto decode = roster.pick(InstanceRole::decode);
    if (!decode) co_return co_await reply_error(res, 503, "decode", "no live decode instance");
    const std::string& consumer_url = prefill ? *prefill : *decode;
    const ConsumerTarget target = roster.consumer_target(consumer_url).value_or(ConsumerTarget{});

    int answered = 0;
    for (int attempt = 0;; ++attempt) {
      const bool may_retry = attempt < options.decode_retries;
      Timings attempt_timings;
      std::vector<std::string> transfer_ids;
      if (!target.zmq_addr.empty()) {
        for (std::size_t i = 0; i < media.size(); ++i) transfer_ids.push_back(random_hex(32));
      }
      // Asked again on a retry: the store may have changed meanwhile.
      const StorePlan plan = store ? store->plan(body, media) : encode_everything(media);
      count_store_plan(plan, request_id);
      if (!plan.to_encode.empty() && roster.live_count(InstanceRole::encode) == 0) {
        co_return co_await reply_error(res, 503, "encode", "the request has media and no encode instance is live");
      }
      std::vector<ItemReport> reports;
      if (!plan.to_encode.empty()) {
        const auto start = Steady::now();
        if (auto error = co_await run_encoders(req, body, media, plan.to_encode, transfer_ids, target.zmq_addr,
                                               request_id, reports)) {
          co_return co_await reply_error(res, *error);
        }
        attempt_timings.encode = seconds_since(start);
        learn_engine_hashes(body, media, plan.to_encode, reports);
      }
      if (plan.checked) {
        reports.resize(media.size(), ItemReport{{}, json::object(), nullptr});
        for (std::size_t i = 0; i < media.size(); ++i) {
          if (!plan.store_hashes[i].empty()) reports[i] = store_item_report(plan.store_hashes[i]);
        }
      }
      const auto rewrite_start = Steady::now();
      ConsumerBodyStats stats;
      json decode_body = build_consumer_body(body, media, reports, transfer_ids, options.rewrite, &stats);
      attempt_timings.rewrite = seconds_since(rewrite_start);
      if (!media.empty()) {
        metrics.add("ecx_proxy_items_forwarded_total", {{"form", "embeds"}}, static_cast<double>(stats.rewritten));
        metrics.add("ecx_proxy_items_forwarded_total", {{"form", "raw"}}, static_cast<double>(stats.raw));
        if (stats.from_store > 0) {
          metrics.add("ecx_proxy_items_forwarded_total", {{"form", "store"}}, static_cast<double>(stats.from_store));
        }
      }
      if (prefill) {
        const auto start = Steady::now();
        StageError error;
        auto after = co_await run_prefill(req, *prefill, decode_body, request_id, target.dp_rank, error);
        if (!after) co_return co_await reply_error(res, error);
        decode_body = std::move(*after);
        attempt_timings.prefill = seconds_since(start);
      }
      auto headers = forwarded_headers(req, request_id);
      if (!prefill && target.dp_rank) headers.push_back({std::string(kDpHeader), std::to_string(*target.dp_rank)});
      const auto outcome = co_await run_decode(res, *decode, std::string(req.path()), decode_body.dump(),
                                               std::move(headers), may_retry, attempt_timings, answered);
      if (outcome == DecodeOutcome::retry) {
        metrics.add("ecx_proxy_retries_total");
        log->info("request {}: decode {} answered 500; retrying the whole path (attempt {})", request_id, *decode,
                  attempt + 2);
        continue;
      }
      attempt_timings.start = timings.start;
      // A request that skipped the encoders has no encode stage (not a 0 s one).
      record_timings(request_id, attempt_timings, attempt, !plan.to_encode.empty(), prefill.has_value());
      co_return answered;
    }
  }

  void count_store_plan(const StorePlan& plan, const std::string& request_id) {
    if (!plan.checked) return;
    metrics.add("ecx_proxy_store_checks_total", {{"result", "hit"}}, static_cast<double>(plan.hits));
    metrics.add("ecx_proxy_store_checks_total", {{"result", "miss"}}, static_cast<double>(plan.misses));
    metrics.add("ecx_proxy_store_checks_total", {{"result", "unknown"}}, static_cast<double>(plan.unknown));
    if (plan.skips_encoders()) {
      metrics.add("ecx_proxy_encode_skipped_total");
      log->debug("request {}: all {} image(s) are in the store; no encoder called", request_id, plan.hits);
    }
  }

  void learn_engine_hashes(const json& body, const std::vector<MediaRef>& media,
                           const std::vector<std::size_t>& encoded, const std::vector<ItemReport>& reports) {
    if (!store) return;
    const auto forgotten_before = store->learned().forgotten();
    store->learn(body, media, encoded, reports);
    metrics.add("ecx_proxy_store_learned_forgotten_total", {},
                static_cast<double>(store->learned().forgotten() - forgotten_before));
    metrics.set("ecx_proxy_store_learned_hashes", {}, static_cast<double>(store->learned().size()));
  }

  void record_timings(const std::string& request_id, const Timings& t, int attempt, bool encoded, bool has_prefill) {
    const double total = seconds_since(t.start);
    log->debug(
        "request {} encode={:.3f}ms rewrite={:.3f}ms prefill={:.3f}ms decode_ttfb={:.3f}ms decode={:.3f}ms "
        "total={:.3f}ms attempt={}",
        request_id, t.encode * 1e3, t.rewrite * 1e3, t.prefill * 1e3, t.decode_ttfb * 1e3, t.decode * 1e3, total * 1e3,
        attempt + 1);
    const auto stage = [](std::string_view name) { return ecx::metrics::Labels{{"stage", std::string(name)}}; };
    if (encoded) metrics.observe("ecx_proxy_stage_seconds", stage("encode"), t.encode);
    metrics.observe("ecx_proxy_stage_seconds", stage("rewrite"), t.rewrite);
    if (has_prefill) metrics.observe("ecx_proxy_stage_seconds", stage("prefill"), t.prefill);
    metrics.observe("ecx_proxy_stage_seconds", stage("decode_ttfb"), t.decode_ttfb);
    metrics.observe("ecx_proxy_stage_seconds", stage("decode"), t.decode);
    metrics.observe("ecx_proxy_stage_seconds", stage("total"), total);
  }

  // /v1/completions: no media, straight to a decode/PD instance (a 500 is retried).
  Task<int> completions(http::ServerRequest& req, http::Responder& res) {
    const auto decode = roster.pick(InstanceRole::decode);
    if (!decode) co_return co_await reply_error(res, 503, "decode", "no live decode instance");
    std::string request_id(req.header("x-request-id"));
    if (request_id.empty()) request_id = random_hex(32);
    int answered = 0;
    for (int attempt = 0;; ++attempt) {
      Timings timings;
      const auto outcome =
          co_await run_decode(res, *decode, std::string(req.path()), req.body, forwarded_headers(req, request_id),
                              attempt < options.decode_retries, timings, answered);
      if (outcome == DecodeOutcome::retry) {
        metrics.add("ecx_proxy_retries_total");
        continue;
      }
      record_timings(request_id, timings, attempt, false, false);
      co_return answered;
    }
  }

  Task<int> models(http::ServerRequest& req, http::Responder& res) {
    const auto decode = roster.pick(InstanceRole::decode);
    if (!decode) co_return co_await reply_error(res, 503, "models", "no live decode instance");
    Fields headers;
    if (const auto auth = req.header("authorization"); !auth.empty())
      headers.push_back({"Authorization", std::string(auth)});
    http::FetchError failure;
    http::UpstreamRequest request{"GET", "/v1/models", std::move(headers), "", options.prefill_timeout};
    auto response = co_await client.fetch(url_of(*decode), std::move(request), nullptr, &failure);
    if (!response) {
      co_return co_await reply_error(res, status_for(failure), "models",
                                     fmt::format("decode {} failed: {}", *decode, response.status().message()));
    }
    std::string content_type(http::find_field(response->headers, "content-type"));
    if (content_type.empty()) content_type = kJson;
    (void)co_await res.send(response->status, http::content_type(content_type), std::move(response->body));
    co_return response->status;
  }

  Task<int> health(http::Responder& res) {
    json counts = json::object();
    for (const auto role : {InstanceRole::encode, InstanceRole::prefill, InstanceRole::decode}) {
      counts[std::string(instance_role_name(role))] = {{"live", roster.live_count(role)},
                                                       {"evicted", roster.evicted_count(role)}};
    }
    json reply = {{"proxy", "healthy"}, {"instances", std::move(counts)}};
    co_return co_await reply_json(res, 200, reply);
  }

  Task<int> render_metrics(http::Responder& res) {
    for (const auto role : {InstanceRole::encode, InstanceRole::prefill, InstanceRole::decode}) {
      const std::string r(instance_role_name(role));
      metrics.set("ecx_proxy_instances", {{"role", r}, {"state", "live"}},
                  static_cast<double>(roster.live_count(role)));
      metrics.set("ecx_proxy_instances", {{"role", r}, {"state", "evicted"}},
                  static_cast<double>(roster.evicted_count(role)));
    }
    metrics.set("ecx_proxy_inflight_requests", {}, static_cast<double>(server ? server->active_requests() : 0));
    (void)co_await res.send(200, http::content_type("text/plain; version=0.0.4; charset=utf-8"), metrics.render());
    co_return 200;
  }

  bool admin_key_matches(const http::ServerRequest& req) const {
    std::string_view given = req.header("x-api-key");
    if (given.empty()) {
      const auto auth = req.header("authorization");
      if (auth.starts_with("Bearer ")) given = auth.substr(7);
    }
    const auto& key = options.admin_api_key;
    return given.size() == key.size() && CRYPTO_memcmp(given.data(), key.data(), key.size()) == 0;
  }

  static std::string query_value(std::string_view query, std::string_view name) {
    while (!query.empty()) {
      const auto amp = query.find('&');
      const auto pair = query.substr(0, amp);
      const auto eq = pair.find('=');
      if (pair.substr(0, eq) == name && eq != std::string_view::npos) {
        std::string value;
        const auto raw = pair.substr(eq + 1);
        for (std::size_t i = 0; i < raw.size(); ++i) {  // percent-decoding
          unsigned code = 0;
          if (raw[i] == '%' && i + 2 < raw.size() &&
              std::from_chars(raw.data() + i + 1, raw.data() + i + 3, code, 16).ptr == raw.data() + i + 3) {
            value += static_cast<char>(code);
            i += 2;
          } else {
            value += raw[i] == '+' ? ' ' : raw[i];
          }
        }
        return value;
      }
      if (amp == std::string_view::npos) break;
      query.remove_prefix(amp + 1);
    }
    return {};
  }

  Task<int> instances(http::ServerRequest& req, http::Responder& res) {
    if (options.admin_api_key.empty()) {
      co_return co_await reply_error(res, 403, "admin",
                                     "the admin API is disabled (start the proxy with an admin key)");
    }
    if (!admin_key_matches(req)) co_return co_await reply_error(res, 401, "admin", "missing or wrong X-API-Key");
    if (req.method == "GET") {
      const json snapshot = snapshot_json(roster.snapshot());
      co_return co_await reply_json(res, 200, snapshot);
    }
    json body = req.body.empty() ? json::object() : json::parse(req.body, nullptr, false);
    if (body.is_discarded()) co_return co_await reply_error(res, 400, "admin", "the body is not JSON");
    if (req.method == "POST") {
      auto spec = parse_instance_spec(body);
      if (!spec) co_return co_await reply_error(res, 400, "admin", spec.status().message());
      const std::string url = spec->url;
      const auto role = spec->role;
      if (auto added = roster.add(std::move(*spec)); !added) {
        co_return co_await reply_error(res, added.code() == StatusCode::conflict ? 409 : 400, "admin", added.message());
      }
      log->info("registered {} instance {}", instance_role_name(role), url);
      json reply = {{"registered", url}, {"role", instance_role_name(role)}};
      co_return co_await reply_json(res, 200, reply);
    }
    // DELETE
    std::string url = query_value(req.query(), "url");
    if (url.empty() && body.is_object() && body.contains("url") && body["url"].is_string()) url = body["url"];
    auto parsed = parse_upstream_url(url);
    if (!parsed) co_return co_await reply_error(res, 400, "admin", parsed.status().message());
    const bool found = roster.remove(parsed->text());
    if (found) log->info("unregistered instance {}", parsed->text());
    json reply = {{"unregistered", parsed->text()}, {"found", found}};
    co_return co_await reply_json(res, 200, reply);
  }

  Task<void> handle(http::ServerRequest& req, http::Responder& res) {
    const auto path = req.path();
    const auto& method = req.method;
    int status = 0;
    std::string route(path);
    if (path == "/v1/chat/completions" && method == "POST") {
      status = co_await chat(req, res);
    } else if (path == "/v1/completions" && method == "POST") {
      status = co_await completions(req, res);
    } else if (path == "/v1/models" && method == "GET") {
      status = co_await models(req, res);
    } else if (path == "/health" && method == "GET") {
      status = co_await health(res);
    } else if (path == "/metrics" && method == "GET") {
      status = co_await render_metrics(res);
    } else if (path == "/instances" && (method == "GET" || method == "POST" || method == "DELETE")) {
      status = co_await instances(req, res);
    } else {
      const bool known = path == "/v1/chat/completions" || path == "/v1/completions" || path == "/v1/models" ||
                         path == "/health" || path == "/metrics" || path == "/instances";
      route = "other";
      status = co_await reply_error(res, known ? 405 : 404, "request",
                                    fmt::format("{} {} is not served here", method, path));
    }
    metrics.add("ecx_proxy_requests_total", {{"route", std::string(route)}, {"status", std::to_string(status)}});
  }

  // ------------------------------------------------------------ liveness

  Task<void> probe_one(std::shared_ptr<ProbeRound> round, std::string url) {
    http::UpstreamRequest request{"GET", "/health", {}, "", options.probe_timeout};
    auto response = co_await client.fetch(url_of(url), std::move(request));
    const bool healthy = response && response->status == 200;
    metrics.add("ecx_proxy_probes_total", {{"result", healthy ? "ok" : "failed"}});
    const auto outcome = roster.record_probe(url, healthy);
    if (outcome.evicted) {
      metrics.add("ecx_proxy_evictions_total");
      log->warn("evicted {} after {} failed health probes", url, options.fail_threshold);
    }
    if (outcome.readmitted) {
      metrics.add("ecx_proxy_readmissions_total");
      log->info("re-admitted {} after a successful health probe", url);
    }
    round->wait.done();
  }

  Task<void> probe_loop() {
    while (!stopping) {
      probe_timer.expires_after(options.probe_interval);
      boost::system::error_code ec;
      co_await probe_timer.async_wait(net::redirect_error(net::use_awaitable, ec));
      if (stopping) break;
      const auto targets = roster.probe_targets();
      auto round = std::make_shared<ProbeRound>(io);
      round->wait.add(targets.size());
      for (const auto& url : targets) http::spawn(io, probe_one(round, url), "health probe");
      co_await round->wait.wait();
      for (const auto& url : roster.forget_expired()) log->info("forgot {}: evicted for longer than the TTL", url);
    }
  }

  Task<void> drain() {
    stopping = true;
    probe_timer.cancel();
    server->stop_accepting();
    const auto deadline = Steady::now() + options.shutdown_grace;
    net::steady_timer tick(io);
    while (server->active_requests() > 0 && Steady::now() < deadline) {
      tick.expires_after(std::chrono::milliseconds(5));
      boost::system::error_code ec;
      co_await tick.async_wait(net::redirect_error(net::use_awaitable, ec));
    }
    if (server->active_requests() > 0) {
      log->warn("shutdown grace of {:.1f}s over; closing {} request(s) still in flight",
                duration_to_seconds(options.shutdown_grace), server->active_requests());
    }
    server->close_all();
    client.close_idle();
    work.reset();
    io.stop();
  }
};

ProxyServer::ProxyServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<ProxyServer>> ProxyServer::create(ProxyOptions options, std::shared_ptr<const Clock> clock) {
  ECX_RETURN_IF_ERROR(validate(options));
  auto impl = std::make_unique<Impl>(std::move(options), std::move(clock));
  const auto& o = impl->options;
  const bool prefill_consumes = !o.prefill_urls.empty();
  const auto seed = [&](const std::vector<std::string>& urls, InstanceRole role, bool consumer) -> Status {
    for (std::size_t i = 0; i < urls.size(); ++i) {
      InstanceSpec spec;
      spec.role = role;
      spec.url = parse_upstream_url(urls[i])->text();
      spec.is_static = true;
      if (consumer) {
        spec.dp_size = o.ec_consumer_dp_size;
        const auto per = static_cast<std::size_t>(o.ec_consumer_dp_size);
        for (std::size_t r = 0; r < per && i * per + r < o.ec_consumer_zmq_addrs.size(); ++r) {
          spec.ec_zmq_addrs.push_back(o.ec_consumer_zmq_addrs[i * per + r]);
        }
      }
      ECX_RETURN_IF_ERROR(impl->roster.add(std::move(spec)));
    }
    return Status::ok();
  };
  ECX_RETURN_IF_ERROR(seed(o.encode_urls, InstanceRole::encode, false));
  ECX_RETURN_IF_ERROR(seed(o.prefill_urls, InstanceRole::prefill, prefill_consumes));
  ECX_RETURN_IF_ERROR(seed(o.decode_urls, InstanceRole::decode, !prefill_consumes));
  if (!o.store_url.empty()) ECX_RETURN_IF_ERROR(impl->open_store());
  return std::unique_ptr<ProxyServer>(new ProxyServer(std::move(impl)));
}

ProxyServer::~ProxyServer() { shutdown(); }

Status ProxyServer::start() {
  std::lock_guard lock(impl_->lifecycle_mutex);
  if (impl_->server) return conflict("the proxy was already started");
  auto* impl = impl_.get();
  impl->server = std::make_unique<http::Server>(
      impl->io, [impl](http::ServerRequest& req, http::Responder& res) { return impl->handle(req, res); },
      http::ServerLimits{impl->options.max_body_bytes, impl->options.client_timeout, impl->options.decode_timeout});
  ECX_RETURN_IF_ERROR(impl->server->listen(impl->options.host, impl->options.port));
  impl->bound_port = impl->server->port();
  if (impl->options.probe_interval > Duration::zero()) http::spawn(impl->io, impl->probe_loop(), "health prober");
  impl->work.emplace(impl->io.get_executor());
  impl->thread = std::thread([impl] {
    name_this_thread("ecx-proxy");
    try {
      impl->io.run();
    } catch (const std::exception& e) {
      impl->log->critical("the proxy's I/O loop stopped: {}", e.what());
    }
  });
  return Status::ok();
}

std::uint16_t ProxyServer::port() const { return impl_->bound_port.load(); }

void ProxyServer::shutdown() {
  std::lock_guard lock(impl_->lifecycle_mutex);
  if (!impl_->thread.joinable()) return;
  auto* impl = impl_.get();
  net::post(impl->io, [impl] { http::spawn(impl->io, impl->drain(), "proxy drain"); });
  impl_->thread.join();
}

Roster& ProxyServer::roster() { return impl_->roster; }
const Metrics& ProxyServer::metrics() const { return impl_->metrics; }

int run_proxy_until_signal(ProxyOptions options) {
  auto log = ecx::log::get("proxy");
  // Blocked before any thread starts, so only this thread ever sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  const std::string host = options.host;
  auto proxy = ProxyServer::create(std::move(options));
  if (!proxy) {
    std::fprintf(stderr, "ecx proxy: %s\n", proxy.status().message().c_str());
    return 2;
  }
  if (auto started = (*proxy)->start(); !started) {
    std::fprintf(stderr, "ecx proxy: %s\n", started.message().c_str());
    return 1;
  }
  std::printf("ecx proxy listening on http://%s:%u\n", host.c_str(), static_cast<unsigned>((*proxy)->port()));
  std::fflush(stdout);
  int received = 0;
  while (received <= 0) {
    const timespec wait{1, 0};  // wakes once a second; nothing else to do meanwhile
    received = sigtimedwait(&signals, nullptr, &wait);
  }
  log->info("signal {}: stopping to accept, finishing in-flight requests", received);
  (*proxy)->shutdown();
  log->info("stopped");
  return 0;
}

}  // namespace ecx::proxy
