// `ecx proxy`: the EPD front door; `ecx bench proxy`: its added latency.
#ifdef ECX_WITH_PROXY

#include <fstream>
#include <iostream>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "commands.h"
#include "core/logging.h"
#include "ecx/proxy/bench.h"
#include "ecx/proxy/proxy.h"

namespace ecx::cli {
namespace {

struct ProxyFlags {
  proxy::ProxyOptions options;
  double connect_timeout = 5, encode_timeout = 300, prefill_timeout = 600, decode_timeout = 600, client_timeout = 60;
  double keep_alive_idle = 2, probe_interval = 5, probe_timeout = 2, evicted_ttl = 900, shutdown_grace = 30;
  double store_ttl = 3600, store_io_timeout = 0.5;
  bool no_rewrite = false;
  std::string log_level;
};

// "none" / "disable" (as the reference proxy accepts) mean an empty list.
void drop_disabled(std::vector<std::string>& urls) {
  if (urls.size() == 1 && (urls[0] == "none" || urls[0] == "disable" || urls[0] == "disabled")) urls.clear();
}

int run_proxy(ProxyFlags& flags) {
  if (!flags.log_level.empty()) {
    auto level = log::parse_level(flags.log_level);
    if (!level) {
      std::cerr << "ecx proxy: " << level.status().message() << "\n";
      return 2;
    }
    log::set_level(*level);
  }
  auto& o = flags.options;
  drop_disabled(o.prefill_urls);
  drop_disabled(o.encode_urls);
  o.rewrite = !flags.no_rewrite;
  o.connect_timeout = seconds_to_duration(flags.connect_timeout);
  o.encode_timeout = seconds_to_duration(flags.encode_timeout);
  o.prefill_timeout = seconds_to_duration(flags.prefill_timeout);
  o.decode_timeout = seconds_to_duration(flags.decode_timeout);
  o.client_timeout = seconds_to_duration(flags.client_timeout);
  o.keep_alive_idle = seconds_to_duration(flags.keep_alive_idle);
  o.probe_interval = seconds_to_duration(flags.probe_interval);
  o.probe_timeout = seconds_to_duration(flags.probe_timeout);
  o.evicted_ttl = seconds_to_duration(flags.evicted_ttl);
  o.shutdown_grace = seconds_to_duration(flags.shutdown_grace);
  o.store_ttl = seconds_to_duration(flags.store_ttl);
  o.store_io_timeout = seconds_to_duration(flags.store_io_timeout);
  return proxy::run_proxy_until_signal(o);
}

void add_proxy_command(CLI::App& app, Runner& run) {
  auto* cmd =
      app.add_subcommand("proxy", "Run the EPD proxy: encoders, then prefill/decode, for OpenAI-style requests");
  auto flags = std::make_shared<ProxyFlags>();
  auto& o = flags->options;
  cmd->add_option("--host", o.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", o.port, "port to listen on (0: any free port, printed at start)")->capture_default_str();
  cmd->add_option("--encode,--encode-servers-urls", o.encode_urls, "encoder instance URLs (http://host:port)")
      ->delimiter(',');
  cmd->add_option("--prefill,--prefill-servers-urls", o.prefill_urls,
                  "prefill instance URLs (E+P+D); none or disable for E+PD")
      ->delimiter(',');
  cmd->add_option("--decode,--decode-servers-urls", o.decode_urls, "decode or prefill+decode (PD) instance URLs")
      ->delimiter(',');
  cmd->add_option("--ec-consumer-zmq-addrs", o.ec_consumer_zmq_addrs,
                  "EC consumer control addresses, one per consumer instance x DP replica (c0r0,c0r1,c1r0,...); the "
                  "consumers are the prefill instances if any, else the decode instances")
      ->delimiter(',');
  cmd->add_option("--ec-consumer-dp-size", o.ec_consumer_dp_size, "DP replicas per consumer instance")
      ->capture_default_str();
  cmd->add_option("--admin-api-key", o.admin_api_key,
                  "key for the admin API (/instances), sent as X-API-Key; unset disables the admin API")
      ->envname("ECX_PROXY_ADMIN_KEY");
  cmd->add_option("--decode-retries", o.decode_retries, "whole-path retries after a decode 500 (before any byte)")
      ->capture_default_str();
  cmd->add_flag("--no-rewrite", flags->no_rewrite, "forward media raw instead of rewriting it into its embeds form");
  cmd->add_option("--encoder-max-batch", o.encoder_max_batch,
                  "images per encoder sub-request (1: one request per item; 0: no limit)")
      ->capture_default_str();
  cmd->add_option("--max-body-bytes", o.max_body_bytes, "largest accepted request body")->capture_default_str();
  cmd->add_option("--connect-timeout", flags->connect_timeout, "seconds to connect to an upstream")
      ->capture_default_str();
  cmd->add_option("--encode-timeout", flags->encode_timeout, "seconds for an encoder sub-request")
      ->capture_default_str();
  cmd->add_option("--prefill-timeout", flags->prefill_timeout, "seconds for the prefill hop")->capture_default_str();
  cmd->add_option("--decode-timeout", flags->decode_timeout,
                  "seconds to the decode's response head, and the longest gap inside a stream")
      ->capture_default_str();
  cmd->add_option("--client-timeout", flags->client_timeout, "seconds to read a client's request (and keep-alive idle)")
      ->capture_default_str();
  cmd->add_option("--keep-alive-idle", flags->keep_alive_idle,
                  "seconds an idle upstream connection is kept for reuse (0: no reuse)")
      ->capture_default_str();
  cmd->add_option("--probe-interval", flags->probe_interval, "seconds between /health probes (0: no probing)")
      ->capture_default_str();
  cmd->add_option("--probe-timeout", flags->probe_timeout, "seconds for one probe")->capture_default_str();
  cmd->add_option("--fail-threshold", o.fail_threshold, "consecutive failed probes that evict an instance")
      ->capture_default_str();
  cmd->add_option("--evicted-ttl", flags->evicted_ttl,
                  "seconds an evicted (registered) instance is kept before it is forgotten (0: forever)")
      ->capture_default_str();
  cmd->add_option("--shutdown-grace", flags->shutdown_grace, "seconds in-flight requests get to finish after SIGTERM")
      ->capture_default_str();
  cmd->add_option("--store-url", o.store_url,
                  "the encoders' shared store (their store_url: redis://[:password@]host[:port][/db] or "
                  "mooncake://...): images already in it skip the encoder hop; unset turns this off")
      ->envname("ECX_PROXY_STORE_URL");
  cmd->add_option("--store-prefix", o.store_prefix, "the encoders' store_prefix (first part of every store key)")
      ->capture_default_str();
  cmd->add_option("--store-model", o.store_model,
                  "the encoders' store_model (the model identity store entries are filed under); required with "
                  "--store-url");
  cmd->add_option("--store-ttl", flags->store_ttl,
                  "the encoders' store_ttl_s: seconds after which a known entry is taken to have expired")
      ->capture_default_str();
  cmd->add_option("--store-io-timeout", flags->store_io_timeout,
                  "seconds one store round trip may take (presence lookups, off the request path)")
      ->capture_default_str();
  cmd->add_option("--store-presence-max", o.store_presence_max, "store entries the presence index remembers")
      ->capture_default_str();
  cmd->add_option("--store-learned-max", o.store_learned_max,
                  "engine hashes learned from encoder answers that are remembered (the oldest are forgotten)")
      ->capture_default_str();
  cmd->add_option("--log-level", flags->log_level,
                  "trace|debug|info|warn|error (debug prints a timing line per request)");
  cmd->callback([&run, flags] { run = [flags] { return run_proxy(*flags); }; });
}

struct BenchFlags {
  proxy::ProxyBenchOptions options;
  std::string json_file;
};

int run_bench_proxy(const BenchFlags& flags) {
  auto results = proxy::run_proxy_bench(flags.options);
  if (!results) {
    std::cerr << "ecx bench proxy: " << results.status().message() << "\n";
    return 1;
  }
  std::cout << fmt::format(
      "streaming chat completions, {} in flight, {} SSE events each {} us apart, {} requests per series\n",
      flags.options.concurrency, flags.options.chunks, flags.options.token_interval_us, flags.options.requests);
  std::cout << fmt::format("{:<12} {:>10} {:>10} {:>12} {:>12} {:>10} {:>7} {:>10} {:>7}\n", "series", "p50_us",
                           "p99_us", "added_p50", "added_p99", "per_s", "ratio", "cpu_us/req", "errors");
  nlohmann::json out = nlohmann::json::array();
  for (const auto& s : *results) {
    std::cout << fmt::format("{:<12} {:>10.0f} {:>10.0f} {:>12.0f} {:>12.0f} {:>10.0f} {:>7.2f} {:>10.1f} {:>7}\n",
                             s.series, s.p50_us, s.p99_us, s.added_p50_us, s.added_p99_us, s.per_s, s.ratio_vs_direct,
                             s.cpu_us_per_request, s.errors);
    out.push_back({{"series", s.series},
                   {"p50_us", s.p50_us},
                   {"p99_us", s.p99_us},
                   {"per_s", s.per_s},
                   {"ratio_vs_direct", s.ratio_vs_direct},
                   {"added_p50_us", s.added_p50_us},
                   {"added_p99_us", s.added_p99_us},
                   {"cpu_us_per_request", s.cpu_us_per_request},
                   {"requests", s.requests},
                   {"errors", s.errors},
                   {"concurrency", flags.options.concurrency}});
  }
  if (!flags.json_file.empty()) {
    std::ofstream file(flags.json_file);
    file << out.dump(2) << "\n";
    if (!file) {
      std::cerr << "ecx bench proxy: cannot write " << flags.json_file << "\n";
      return 1;
    }
  }
  for (const auto& s : *results) {
    if (s.errors > 0) return 1;
  }
  return 0;
}

void add_bench_proxy_command(CLI::App& app, Runner& run) {
  auto* cmd = bench_subcommand(app)->add_subcommand(
      "proxy", "Added latency and throughput of the EPD proxy over calling a fake decode engine directly");
  auto flags = std::make_shared<BenchFlags>();
  cmd->add_option("--concurrency", flags->options.concurrency, "requests in flight")->capture_default_str();
  cmd->add_option("--requests", flags->options.requests, "requests per series")->capture_default_str();
  cmd->add_option("--rounds", flags->options.rounds, "rounds in which the series take turns")->capture_default_str();
  cmd->add_option("--warmup", flags->options.warmup, "warm-up requests per series")->capture_default_str();
  cmd->add_option("--chunks", flags->options.chunks, "SSE events per streamed answer")->capture_default_str();
  cmd->add_option("--token-interval-us", flags->options.token_interval_us,
                  "the fake decode's pause between two SSE events (0: as fast as possible)")
      ->capture_default_str();
  cmd->add_option("--json", flags->json_file, "also write the series as JSON to this file");
  cmd->callback([&run, flags] { run = [flags] { return run_bench_proxy(*flags); }; });
}

}  // namespace

ECX_REGISTER_COMMAND(add_proxy_command);
ECX_REGISTER_COMMAND(add_bench_proxy_command);

}  // namespace ecx::cli

#endif  // ECX_WITH_PROXY
