// `ecx demo`: the main job on an embedded default. Starts a consumer (TP = 2) and a
// producer as two processes on loopback and drives a realistic synthetic workload
// through the real scheduler and worker coordinators, ZeroMQ and UCX; prints live
// progress and a summary, and fails when any check fails.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "commands.h"
#include "core/logging.h"
#include "data_link.h"
#include "ecx/core/config.h"
#include "ecx/transport/ucx_transport.h"
#include "sim/engine_sim.h"
#include "sim/process.h"
#include "sim/redis_server.h"

namespace ecx::cli {
namespace {

using json = nlohmann::json;

struct DemoOptions {
  std::string role = "all";
  int requests = 200;
  int min_images = 1;
  int max_images = 4;
  int min_tokens = 256;
  int max_tokens = 2500;
  int hidden = 3584;
  double repeat = 0.2;
  bool log_sizes = false;
  std::uint64_t item_bytes = 0;
  int tp = 2;
  DataLink transport = DataLink::tcp;
  std::string ucx_mode = "am";
  std::string pool_size = "1GiB";
  std::uint64_t seed = 1;
  std::string duration_text = "0";
  double duration_s = 0;  // from duration_text
  double deadline_s = 600;
  // Soak sampling: RSS of both processes, pool occupancy and tombstones.
  double sample_interval_s = 0;  // 0: duration / 120, within 1..30 s
  double soak_warmup_s = -1;     // < 0: a quarter of the duration
  double soak_rss_tolerance_mib = 32;
  double soak_pool_tolerance = 0.05;  // of the pool capacity
  std::string plot_file;
  int port = 0;
  bool checksum = true;
  std::string json_file;
  bool quiet = false;
  int encoders = 1;  // producer processes, each serving its share of the requests
  bool cross_encoder_cache = false;
  bool zero_copy = false;           // engines keep views of landed slots and lend their outputs
  std::string extra;                // a JSON object merged into every role's ec_connector_extra_config
  bool skip_encoder_hop = false;    // requests whose images are all stored go straight to the consumer
  double store_io_timeout_s = 0.5;  // store_io_timeout_s of every role
  // internal (child roles)
  std::string admit;
  std::string consumer;
  int encoder_index = 0;
  std::string store_url;
};

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

Result<Config> demo_config(const DemoOptions& o, Role role) {
  json extra{{"checksum", o.checksum},
             {"push_wait_timeout_s", 60},
             {"control_timeout_s", 10},
             {"shutdown_drain_timeout_s", 5}};
  extra["transport"] = config_transport(o.transport);  // Mooncake's library: ECX_MOONCAKE_LIB
  if (uses_ucx(o.transport)) {
    extra["ucx_mode"] = o.ucx_mode;
    extra["ucx_peer_errors"] = ucx_peer_errors(o.transport);
  }
  // A soak judges growth: pool pages touched for the first time late in the run (a
  // best-fit allocator reaches the far end of a pool only now and then) are not one.
  if (o.duration_s > 0) extra["prefault"] = true;
  if (o.zero_copy) {
    extra["zero_copy_loads"] = true;
    extra["zero_copy_saves"] = true;
  }
  if (o.cross_encoder_cache && (role == Role::producer || o.skip_encoder_hop)) {
    extra["cross_encoder_cache"] = true;
    extra["store_url"] = o.store_url.empty() ? std::string("redis://127.0.0.1:6379/0") : o.store_url;
    extra["store_prefix"] = "ecxdemo";
    extra["store_model"] = "ecx-demo-model@1";
    extra["store_io_timeout_s"] = o.store_io_timeout_s;
  }
  if (auto merged = merge_extra_config(extra, o.extra); !merged) return merged;
  json doc{{"ec_role", role_name(role)},    {"ec_ip", "127.0.0.1"},      {"ec_port", o.port},
           {"ec_buffer_size", o.pool_size}, {"ec_buffer_device", "cpu"}, {"ec_connector_extra_config", extra}};
  ParallelLayout layout;
  if (role == Role::consumer) layout.tp_size = o.tp;
  return parse_config(doc.dump(), layout);
}

std::uint64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::uint64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

json progress_json(const sim::Progress& p) {
  return json{{"event", "progress"},
              {"requests_total", p.requests_total},
              {"requests_admitted", p.requests_admitted},
              {"requests_ready", p.requests_ready},
              {"requests_failed", p.requests_failed},
              {"bytes_moved", p.bytes_moved},
              {"in_flight", p.in_flight},
              {"pool_used_bytes", p.pool_used_bytes},
              {"pool_capacity", p.pool_capacity},
              {"resident_bytes", p.resident_bytes},
              {"records_writing", p.records_writing},
              {"records_ready", p.records_ready},
              {"tombstones", p.tombstones},
              {"tombstone_bound", p.tombstone_bound},
              {"encoder_cache_bytes", p.encoder_cache_bytes},
              {"elapsed_s", p.elapsed_s},
              {"rss_bytes", rss_bytes()}};
}

sim::WorkloadOptions workload_of(const DemoOptions& o, int round) {
  sim::WorkloadOptions w;
  w.requests = o.requests;
  w.min_images = o.min_images;
  w.max_images = o.max_images;
  w.min_tokens = o.min_tokens;
  w.max_tokens = o.max_tokens;
  w.hidden = o.hidden;
  w.repeat_fraction = o.repeat;
  w.log_uniform_tokens = o.log_sizes;
  w.fixed_bytes = o.item_bytes;
  w.seed = o.seed + static_cast<std::uint64_t>(round);
  w.id_prefix = fmt::format("demo{}", round);
  return w;
}

int run_consumer(const DemoOptions& o) {
  auto config = demo_config(o, Role::consumer);
  if (!config) {
    std::cerr << "ecx demo: " << config.status().message() << "\n";
    return 2;
  }
  sim::ConsumerSimOptions options;
  options.config = *config;
  options.producers = o.encoders;
  options.deadline = seconds_to_duration(o.deadline_s);
  options.on_progress = [](const sim::Progress& p) { std::cout << progress_json(p).dump() << std::endl; };
  auto consumer = sim::ConsumerSim::start(std::move(options));
  if (!consumer) {
    std::cerr << "ecx demo consumer: " << consumer.status().message() << "\n";
    return 1;
  }
  std::cout << json{{"event", "ready"},
                    {"admit", (*consumer)->admit_endpoint()},
                    {"control", (*consumer)->control_address()}}
                   .dump()
            << std::endl;
  const auto r = (*consumer)->run(&g_stop);
  json out = progress_json(r.progress);
  out["event"] = "result";
  out["items_ready"] = r.items_ready;
  out["content_mismatches"] = r.content_mismatches;
  out["checksum_mismatches"] = r.checksum_mismatches;
  out["leaked_pool_bytes"] = r.leaked_pool_bytes;
  out["live_reservations"] = r.live_reservations;
  out["reserves_held"] = r.reserves_held;
  out["held_reserves_placed"] = r.held_reserves_placed;
  out["held_reserves_expired"] = r.held_reserves_expired;
  out["resident_bytes"] = r.resident_bytes;
  out["time_to_ready_ms"] = r.time_to_ready_ms;
  out["failed_requests"] = r.failed_requests;
  out["invariant_error"] = r.invariant_error;
  out["store_loads"] = r.store_loads;
  out["local_encodes"] = r.local_encodes;
  out["store_prefetch_failures"] = r.store_prefetch_failures;
  out["store_prefetch_timeouts"] = r.store_prefetch_timeouts;
  out["producer_done"] = r.producer_done;
  out["wall_s"] = r.wall_s;
  std::cout << out.dump() << std::endl;
  return 0;
}

int run_producer(const DemoOptions& o) {
  auto config = demo_config(o, Role::producer);
  if (!config) {
    std::cerr << "ecx demo: " << config.status().message() << "\n";
    return 2;
  }
  sim::ProducerSimOptions options;
  options.config = *config;
  options.consumer_address = o.consumer;
  options.admit_connect = o.admit;
  options.deadline = seconds_to_duration(o.deadline_s);
  // One long-lived producer runs round after round for --duration (a soak), so its
  // RSS is that of one encoder instance, and the consumer sees one "done".
  options.workload = workload_of(o, 0);
  options.encoder_index = o.encoder_index;
  options.encoder_count = o.encoders;
  options.run_for = seconds_to_duration(o.duration_s);
  options.skip_encoder_hop = o.skip_encoder_hop;
  auto r = sim::run_producer(options, &g_stop);
  if (!r) {
    std::cerr << "ecx demo producer: " << r.status().message() << "\n";
    return 1;
  }
  const json total{{"event", "result"},
                   {"requests", r->requests},
                   {"items", r->items},
                   {"bytes", r->bytes},
                   {"failed_saves", r->failed_saves},
                   {"retry_afters", r->retry_afters},
                   {"yields", r->yields},
                   {"pushes_done", r->pushes_done},
                   {"direct_sent", r->direct_sent},
                   {"direct_turned_away", r->direct_turned_away},
                   {"rounds", r->rounds},
                   {"encoder_runs", r->encoder_runs},
                   {"outputs_lent", r->outputs_lent},
                   {"outputs_not_given_back", r->outputs_not_given_back},
                   {"encoder_hops_skipped", r->encoder_hops_skipped},
                   {"cross_encoder_lookups", r->store_lookups},
                   {"cross_encoder_hits", r->store_hits},
                   {"store_prefetched", r->store.prefetched},
                   {"store_prefetch_failures", r->store.prefetch_failures},
                   {"store_prefetch_dropped", r->store.prefetch_dropped},
                   {"store_prefetch_timeouts", r->store_prefetch_timeouts},
                   {"store_loads", r->store.loads},
                   {"store_load_failures", r->store.load_failures},
                   {"store_bytes_loaded", r->store.bytes_loaded},
                   {"store_published", r->store.published},
                   {"store_bytes_published", r->store.bytes_published},
                   {"store_publish_dropped", r->store.publish_dropped},
                   {"store_publish_failed", r->store.publish_failed},
                   {"store_errors", r->store.store_errors},
                   {"store_rejected", r->store.rejected},
                   {"wall_s", r->wall_s}};
  std::cout << total.dump() << std::endl;
  if (r->outputs_not_given_back > 0) {
    std::cerr << "ecx demo producer: " << r->outputs_not_given_back
              << " lent output(s) were never given back by ECX (a leak)\n";
    return 1;
  }
  return 0;
}

}  // namespace

// The orchestrator: both roles as child processes, live progress, the summary.
int run_demo(const DemoOptions& o);

namespace {

std::string human_bytes(double b) { return format_bytes(static_cast<std::uint64_t>(std::max(0.0, b))); }

// Resident set of another process (0 once it has gone).
std::uint64_t rss_of(pid_t pid) {
  std::ifstream statm(fmt::format("/proc/{}/statm", pid));
  std::uint64_t pages = 0, resident = 0;
  if (!(statm >> pages >> resident)) return 0;
  return resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

// One soak sample from a consumer progress line and the producer's RSS. The
// consumer's RSS is the one its line reports: read in the same step as the size of
// the simulated engine's encoder caches, so the difference is what ECX holds.
json soak_sample(const json& progress, std::uint64_t producer_rss) {
  const auto consumer_rss = progress.value("rss_bytes", std::uint64_t{0});
  const auto engine_cache = progress.value("encoder_cache_bytes", std::uint64_t{0});
  return json{{"t_s", progress.value("elapsed_s", 0.0)},
              {"consumer_rss_bytes", consumer_rss},
              {"consumer_ecx_rss_bytes", consumer_rss - std::min(consumer_rss, engine_cache)},
              {"producer_rss_bytes", producer_rss},
              {"pool_used_bytes", progress.value("pool_used_bytes", std::uint64_t{0})},
              {"pool_capacity", progress.value("pool_capacity", std::uint64_t{0})},
              {"resident_bytes", progress.value("resident_bytes", std::uint64_t{0})},
              {"tombstones", progress.value("tombstones", std::uint64_t{0})},
              {"tombstone_bound", progress.value("tombstone_bound", std::uint64_t{0})},
              {"encoder_cache_bytes", engine_cache},
              {"requests_ready", progress.value("requests_ready", std::uint64_t{0})},
              {"bytes_moved", progress.value("bytes_moved", std::uint64_t{0})}};
}

double median_of(const std::vector<json>& samples, std::size_t from, std::size_t to, const char* key) {
  std::vector<double> values;
  for (std::size_t i = from; i < to; ++i) values.push_back(samples[i].value(key, 0.0));
  return sim::percentile(values, 50);
}

// Pool bytes held by something other than the resident cache (writers, landed
// payloads not yet taken): a leak raises the floor of this sawtooth.
double held_floor(const std::vector<json>& samples, std::size_t from, std::size_t to) {
  double floor = 0;
  for (std::size_t i = from; i < to; ++i) {
    const double held = samples[i].value("pool_used_bytes", 0.0) - samples[i].value("resident_bytes", 0.0);
    floor = i == from ? held : std::min(floor, held);
  }
  return floor;
}

// Growth after warm-up: the median of the last third of the samples taken after
// warm-up minus that of the first third (pool: also the floor of the bytes held
// outside the resident cache); tombstones against their bound over the whole run.
json evaluate_soak(const std::vector<json>& samples, const DemoOptions& o) {
  const double warmup = o.soak_warmup_s >= 0 ? o.soak_warmup_s : o.duration_s / 4;
  std::vector<json> after;
  for (const auto& s : samples) {
    if (s.value("t_s", 0.0) >= warmup) after.push_back(s);
  }
  std::uint64_t tombstones_max = 0, tombstone_bound = 0, capacity = 0;
  for (const auto& s : samples) {
    tombstones_max = std::max(tombstones_max, s.value("tombstones", std::uint64_t{0}));
    tombstone_bound = std::max(tombstone_bound, s.value("tombstone_bound", std::uint64_t{0}));
    capacity = std::max(capacity, s.value("pool_capacity", std::uint64_t{0}));
  }
  const double rss_tolerance = o.soak_rss_tolerance_mib * 1024 * 1024;
  const double pool_tolerance = o.soak_pool_tolerance * static_cast<double>(capacity);
  json soak{{"warmup_s", warmup},
            {"samples_after_warmup", after.size()},
            {"rss_tolerance_bytes", rss_tolerance},
            {"pool_tolerance_bytes", pool_tolerance},
            {"tombstones_max", tombstones_max},
            {"tombstone_bound", tombstone_bound}};
  const bool tombstones_ok = tombstones_max <= tombstone_bound;
  soak["tombstones_ok"] = tombstones_ok;
  if (after.size() < 6) {
    soak["judged"] = false;
    soak["passed"] = tombstones_ok;
    return soak;
  }
  const std::size_t third = after.size() / 3;
  const std::size_t last = after.size() - third;
  auto growth = [&](const char* key) {
    return median_of(after, last, after.size(), key) - median_of(after, 0, third, key);
  };
  const double consumer_rss = growth("consumer_ecx_rss_bytes");
  const double producer_rss = growth("producer_rss_bytes");
  const double pool_used = growth("pool_used_bytes");
  const double pool_held_floor = held_floor(after, last, after.size()) - held_floor(after, 0, third);
  soak["judged"] = true;
  soak["consumer_rss_start_bytes"] = median_of(after, 0, third, "consumer_ecx_rss_bytes");
  soak["producer_rss_start_bytes"] = median_of(after, 0, third, "producer_rss_bytes");
  soak["consumer_rss_growth_bytes"] = consumer_rss;
  soak["producer_rss_growth_bytes"] = producer_rss;
  soak["pool_used_start_bytes"] = median_of(after, 0, third, "pool_used_bytes");
  soak["pool_used_growth_bytes"] = pool_used;
  soak["pool_held_floor_growth_bytes"] = pool_held_floor;
  const bool rss_ok = consumer_rss <= rss_tolerance && producer_rss <= rss_tolerance;
  const bool pool_ok = pool_used <= pool_tolerance && pool_held_floor <= pool_tolerance;
  soak["rss_ok"] = rss_ok;
  soak["pool_ok"] = pool_ok;
  soak["passed"] = rss_ok && pool_ok && tombstones_ok;
  return soak;
}

Status plot_soak(const std::string& png, const std::vector<json>& samples) {
  PlotSpec spec;
  spec.png = png;
  spec.title = "ecx demo: memory and pool over time";
  spec.x_label = "seconds";
  spec.y_label = "MiB";
  spec.y2_label = "tombstones";
  const std::vector<std::pair<std::string, std::string>> keys = {
      {"consumer RSS", "consumer_rss_bytes"},
      {"consumer RSS less the engine's encoder cache", "consumer_ecx_rss_bytes"},
      {"producer RSS", "producer_rss_bytes"},
      {"consumer pool used", "pool_used_bytes"},
      {"of which resident", "resident_bytes"},
      {"engine encoder cache (sim, all ranks)", "encoder_cache_bytes"}};
  for (const auto& [title, key] : keys) {
    PlotLine line{title, {}, false};
    for (const auto& s : samples) line.points.emplace_back(s.value("t_s", 0.0), s.value(key, 0.0) / (1 << 20));
    spec.lines.push_back(std::move(line));
  }
  PlotLine tombstones{"tombstones (right axis)", {}, true};
  for (const auto& s : samples) tombstones.points.emplace_back(s.value("t_s", 0.0), s.value("tombstones", 0.0));
  spec.lines.push_back(std::move(tombstones));
  return write_plot(spec);
}

void render_progress(const json& p, bool tty) {
  const auto line = fmt::format(
      "requests {}/{} ready, {} failed | {} moved | in flight {} | pool {} / {} ({} being written, {} "
      "landed and not loaded, {} resident) | {:.1f} s",
      p.value("requests_ready", 0),
      std::max<std::uint64_t>(p.value("requests_total", 0ULL), p.value("requests_admitted", 0ULL)),
      p.value("requests_failed", 0), human_bytes(p.value("bytes_moved", 0.0)), p.value("in_flight", 0),
      human_bytes(p.value("pool_used_bytes", 0.0)), human_bytes(p.value("pool_capacity", 0.0)),
      p.value("records_writing", 0), p.value("records_ready", 0), human_bytes(p.value("resident_bytes", 0.0)),
      p.value("elapsed_s", 0.0));
  if (tty) {
    std::cout << "\r\033[K" << line << std::flush;
  } else {
    std::cout << line << "\n" << std::flush;
  }
}

}  // namespace

int run_demo(const DemoOptions& options) {
  DemoOptions o = options;
  if (o.port == 0) o.port = sim::free_port_block(o.tp);
  if (o.port == 0) {
    std::cerr << "ecx demo: no free block of ports on 127.0.0.1\n";
    return 1;
  }
  if (auto c = demo_config(o, Role::consumer); !c) {
    std::cerr << "ecx demo: " << c.status().message() << "\n";
    return 2;
  }
  const bool tty = ::isatty(STDOUT_FILENO) != 0 && !o.quiet;
  const std::string self = sim::self_executable();
  auto common = [&](const std::string& role) {
    std::vector<std::string> argv = {self,
                                     "demo",
                                     "--role",
                                     role,
                                     "--requests",
                                     std::to_string(o.requests),
                                     "--min-images",
                                     std::to_string(o.min_images),
                                     "--max-images",
                                     std::to_string(o.max_images),
                                     "--min-tokens",
                                     std::to_string(o.min_tokens),
                                     "--max-tokens",
                                     std::to_string(o.max_tokens),
                                     "--hidden",
                                     std::to_string(o.hidden),
                                     "--repeat",
                                     fmt::format("{}", o.repeat),
                                     "--tp",
                                     std::to_string(o.tp),
                                     "--pool-size",
                                     o.pool_size,
                                     "--seed",
                                     std::to_string(o.seed),
                                     "--duration",
                                     fmt::format("{}", o.duration_s),
                                     "--deadline",
                                     fmt::format("{}", o.deadline_s),
                                     "--port",
                                     std::to_string(o.port),
                                     o.checksum ? "--checksum" : "--no-checksum"};
    if (o.log_sizes) argv.emplace_back("--log-sizes");
    if (o.zero_copy) argv.emplace_back("--zero-copy");
    if (!o.extra.empty()) argv.insert(argv.end(), {"--extra", o.extra});
    argv.insert(argv.end(), {"--encoders", std::to_string(o.encoders)});
    if (o.item_bytes > 0) argv.insert(argv.end(), {"--item-bytes", std::to_string(o.item_bytes)});
    argv.insert(argv.end(), {"--transport", std::string(data_link_name(o.transport))});
    argv.insert(argv.end(), {"--ucx-mode", o.ucx_mode});
    return argv;
  };
  const std::vector<std::string> env = {"UCX_TLS=" + std::string(ucx_tls(o.transport))};
  // The cross-encoder cache's store: a redis-server of the demo's own on loopback.
  std::optional<sim::RedisServer> redis;
  std::string store_url = o.store_url;
  if (o.cross_encoder_cache && store_url.empty()) {
    auto started = sim::RedisServer::start();
    if (!started) {
      std::cerr << "ecx demo: --cross-encoder-cache needs a redis-server: " << started.status().message() << "\n";
      return 1;
    }
    redis.emplace(std::move(*started));
    store_url = redis->url();
    std::cout << fmt::format("ecx demo: cross-encoder cache on {} (started for the demo)\n", store_url);
  } else if (o.cross_encoder_cache) {
    std::cout << fmt::format("ecx demo: cross-encoder cache on {}\n", store_url);
  }
  std::cout << fmt::format(
      "ecx demo: consumer (TP={}) and {} on 127.0.0.1 over {} | {} requests of {}-{} images, "
      "{}-{} tokens x {} bf16, {:.0f}% repeated | pools {} | checksums {}\n",
      o.tp, o.encoders == 1 ? std::string("producer") : fmt::format("{} producers", o.encoders),
      uses_ucx(o.transport) ? fmt::format("UCX {} ({})", data_link_name(o.transport), o.ucx_mode)
                            : std::string("Mooncake tcp"),
      o.requests, o.min_images, o.max_images, o.min_tokens, o.max_tokens, o.hidden, o.repeat * 100, o.pool_size,
      o.checksum ? "on" : "off");
  auto consumer_argv = common("consumer");
  if (o.skip_encoder_hop) {
    // The consumer loads what the store holds: it needs the cache and the store too.
    consumer_argv.insert(consumer_argv.end(), {"--cross-encoder-cache", "--store-url", store_url, "--skip-encoder-hop",
                                               "--store-io-timeout", fmt::format("{}", o.store_io_timeout_s)});
  }
  auto consumer = sim::ChildProcess::spawn(consumer_argv, env);
  if (!consumer) {
    std::cerr << "ecx demo: " << consumer.status().message() << "\n";
    return 1;
  }
  std::optional<json> ready;
  const auto start_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!ready && std::chrono::steady_clock::now() < start_deadline && !consumer->eof()) {
    if (auto line = consumer->read_line(std::chrono::milliseconds(200))) {
      auto doc = json::parse(*line, nullptr, false);
      if (!doc.is_discarded() && doc.value("event", "") == "ready") ready = doc;
    }
  }
  if (!ready) {
    std::cerr << "ecx demo: the consumer did not start (see its messages above)\n";
    return 1;
  }
  std::vector<sim::ChildProcess> producers;
  for (int e = 0; e < o.encoders; ++e) {
    auto argv = common("producer");
    argv.insert(argv.end(), {"--admit", ready->at("admit").get<std::string>(), "--consumer",
                             ready->at("control").get<std::string>(), "--encoder-index", std::to_string(e)});
    if (o.cross_encoder_cache) {
      argv.insert(argv.end(), {"--cross-encoder-cache", "--store-url", store_url, "--store-io-timeout",
                               fmt::format("{}", o.store_io_timeout_s)});
    }
    if (o.skip_encoder_hop) argv.emplace_back("--skip-encoder-hop");
    auto producer = sim::ChildProcess::spawn(argv, env);
    if (!producer) {
      std::cerr << "ecx demo: " << producer.status().message() << "\n";
      return 1;
    }
    producers.push_back(std::move(*producer));
  }
  auto producers_rss = [&] {
    std::uint64_t sum = 0;
    for (const auto& p : producers) sum += rss_of(p.pid());
    return sum;
  };
  auto all_ended = [&] {
    return std::all_of(producers.begin(), producers.end(), [](const sim::ChildProcess& p) { return p.eof(); });
  };
  std::optional<json> consumer_result;
  std::vector<std::optional<json>> producer_results(producers.size());
  auto producers_answered = [&] {
    return std::all_of(producer_results.begin(), producer_results.end(), [](const auto& r) { return r.has_value(); });
  };
  std::vector<json> samples;
  const double sample_interval =
      o.sample_interval_s > 0 ? o.sample_interval_s : std::clamp(o.duration_s / 120, 1.0, 30.0);
  auto sample = [&](const json& progress) {
    if (!samples.empty() && progress.value("elapsed_s", 0.0) < samples.back().value("t_s", 0.0) + sample_interval) {
      return;
    }
    samples.push_back(soak_sample(progress, producers_rss()));
  };
  const auto deadline = std::chrono::steady_clock::now() + seconds_to_duration(o.deadline_s + 60);
  while ((!consumer_result || !producers_answered()) && std::chrono::steady_clock::now() < deadline) {
    if (g_stop.load()) {
      consumer->signal(SIGINT);
      for (const auto& p : producers) p.signal(SIGINT);
    }
    if (!consumer_result) {
      if (auto line = consumer->read_line(std::chrono::milliseconds(100))) {
        auto doc = json::parse(*line, nullptr, false);
        if (!doc.is_discarded()) {
          if (doc.value("event", "") == "progress") {
            sample(doc);
            if (!o.quiet) render_progress(doc, tty);
          }
          if (doc.value("event", "") == "result") consumer_result = doc;
        }
      } else if (consumer->eof()) {
        break;
      }
    }
    for (std::size_t e = 0; e < producers.size(); ++e) {
      if (producer_results[e] || producers[e].eof()) continue;
      if (auto line = producers[e].read_line(std::chrono::milliseconds(1))) {
        auto doc = json::parse(*line, nullptr, false);
        if (!doc.is_discarded() && doc.value("event", "") == "result") producer_results[e] = doc;
      }
    }
    if (consumer_result && all_ended()) break;  // the producers ended (their summaries, if any, were read)
  }
  if (tty) std::cout << "\n";
  // The last picture, from the consumer's own final figures. Producers that have
  // already exited keep their last RSS reading.
  if (consumer_result) {
    auto producer_rss = producers_rss();
    if (producer_rss == 0 && !samples.empty())
      producer_rss = samples.back().value("producer_rss_bytes", std::uint64_t{0});
    samples.push_back(soak_sample(*consumer_result, producer_rss));
  }
  const auto consumer_exit = consumer->wait(std::chrono::seconds(30));
  std::optional<int> producer_exit = 0;
  for (auto& p : producers) {
    const auto exit = p.wait(std::chrono::seconds(30));
    if (!exit || *exit != 0) producer_exit = exit ? exit : std::optional<int>();
  }
  if (!consumer_result) {
    std::cerr << "ecx demo: the consumer ended without a summary (exit " << consumer_exit.value_or(-1) << ")\n";
    return 1;
  }
  // The producers' figures, summed.
  std::optional<json> producer_result;
  for (const auto& r : producer_results) {
    if (!r) continue;
    if (!producer_result) {
      producer_result = *r;
      continue;
    }
    for (const auto& [key, value] : r->items()) {
      if (value.is_number_unsigned() && (*producer_result)[key].is_number_unsigned()) {
        (*producer_result)[key] = (*producer_result)[key].get<std::uint64_t>() + value.get<std::uint64_t>();
      }
    }
  }
  if (producer_result && !producers_answered()) producer_result.reset();  // a producer ended without its figures
  const auto& r = *consumer_result;
  std::vector<double> ttr = r.value("time_to_ready_ms", std::vector<double>{});
  const double wall = r.value("wall_s", 0.0);
  const auto bytes = r.value("bytes_moved", std::uint64_t{0});
  const double gbps = wall > 0 ? static_cast<double>(bytes) / wall / 1e9 : 0.0;
  const auto total = producer_result ? producer_result->value("requests", std::uint64_t{0})
                                     : r.value("requests_admitted", std::uint64_t{0});
  json summary{
      {"requests_total", total},
      {"requests_ready", r.value("requests_ready", 0ULL)},
      {"requests_failed",
       r.value("requests_failed", 0ULL) + (total - std::min<std::uint64_t>(total, r.value("requests_admitted", 0ULL)))},
      {"items_ready", r.value("items_ready", 0ULL)},
      {"bytes_moved", bytes},
      {"gbps", gbps},
      {"wall_s", wall},
      {"time_to_ready_p50_ms", sim::percentile(ttr, 50)},
      {"time_to_ready_p90_ms", sim::percentile(ttr, 90)},
      {"time_to_ready_p99_ms", sim::percentile(ttr, 99)},
      {"leaked_pool_bytes", r.value("leaked_pool_bytes", 0ULL)},
      {"checksum_mismatches", r.value("checksum_mismatches", 0ULL)},
      {"content_mismatches", r.value("content_mismatches", 0ULL)},
      {"live_reservations", r.value("live_reservations", 0ULL)},
      {"consumer_reserves_held", r.value("reserves_held", 0ULL)},
      {"consumer_held_reserves_placed", r.value("held_reserves_placed", 0ULL)},
      {"consumer_held_reserves_expired", r.value("held_reserves_expired", 0ULL)},
      {"resident_bytes", r.value("resident_bytes", 0ULL)},
      {"invariant_error", r.value("invariant_error", std::string())},
      {"producer_failed_saves", producer_result ? producer_result->value("failed_saves", 0ULL) : 0ULL},
      {"producer_retry_afters", producer_result ? producer_result->value("retry_afters", 0ULL) : 0ULL},
      {"producer_yields", producer_result ? producer_result->value("yields", 0ULL) : 0ULL},
      {"producer_direct_sent", producer_result ? producer_result->value("direct_sent", 0ULL) : 0ULL},
      {"producer_direct_turned_away", producer_result ? producer_result->value("direct_turned_away", 0ULL) : 0ULL},
      {"tp", o.tp},
      {"encoders", o.encoders},
      {"cross_encoder_cache", o.cross_encoder_cache},
      {"images_requested", producer_result ? producer_result->value("items", 0ULL) : 0ULL},
      {"encoder_runs", producer_result ? producer_result->value("encoder_runs", 0ULL) : 0ULL},
      {"skip_encoder_hop", o.skip_encoder_hop},
      {"transport", data_link_name(o.transport)},
      {"ucx_mode", uses_ucx(o.transport) ? o.ucx_mode : ""},
      {"consumer_exit", consumer_exit.value_or(-1)},
      {"producer_exit", producer_exit.value_or(-1)}};
  const bool passed = summary["requests_failed"] == 0 && summary["requests_ready"] == total && total > 0 &&
                      summary["leaked_pool_bytes"] == 0 && summary["checksum_mismatches"] == 0 &&
                      summary["content_mismatches"] == 0 && summary["invariant_error"].get<std::string>().empty() &&
                      consumer_exit.value_or(-1) == 0 && producer_exit.value_or(-1) == 0;
  if (o.cross_encoder_cache && producer_result) {
    const auto lookups = producer_result->value("cross_encoder_lookups", 0ULL);
    const auto hits = producer_result->value("cross_encoder_hits", 0ULL);
    summary["cross_encoder_lookups"] = lookups;
    summary["cross_encoder_hits"] = hits;
    summary["cross_encoder_hit_rate"] = lookups > 0 ? static_cast<double>(hits) / static_cast<double>(lookups) : 0.0;
    for (const char* key :
         {"store_prefetched", "store_prefetch_failures", "store_prefetch_dropped", "store_prefetch_timeouts",
          "store_loads", "store_load_failures", "store_bytes_loaded", "store_published", "store_bytes_published",
          "store_publish_dropped", "store_publish_failed", "store_errors", "store_rejected"}) {
      summary[key] = producer_result->value(key, 0ULL);
    }
  }
  if (o.skip_encoder_hop) {
    summary["encoder_hops_skipped"] = producer_result ? producer_result->value("encoder_hops_skipped", 0ULL) : 0ULL;
    summary["consumer_store_loads"] = r.value("store_loads", 0ULL);
    summary["consumer_local_encodes"] = r.value("local_encodes", 0ULL);
    summary["consumer_store_prefetch_failures"] = r.value("store_prefetch_failures", 0ULL);
    summary["consumer_store_prefetch_timeouts"] = r.value("store_prefetch_timeouts", 0ULL);
  }
  const bool soak_run = o.duration_s > 0;
  json soak = evaluate_soak(samples, o);
  summary["samples"] = samples;
  if (soak_run) summary["soak"] = soak;
  const bool soak_passed = !soak_run || soak.value("passed", false);
  summary["passed"] = passed && soak_passed;
  auto row = [](std::string_view label, const std::string& value, std::string_view check = "") {
    std::cout << fmt::format("  {:<28}{:>16}  {}\n", label, value, check);
  };
  auto mark = [](bool ok) { return ok ? "ok" : "FAILED"; };
  std::cout << "\nsummary\n";
  row("requests ready", fmt::format("{} / {}", summary["requests_ready"].get<std::uint64_t>(), total),
      mark(summary["requests_ready"] == total && total > 0));
  row("requests failed", std::to_string(summary["requests_failed"].get<std::uint64_t>()),
      mark(summary["requests_failed"] == 0));
  row("images delivered (x TP)", fmt::format("{} x {}", summary["items_ready"].get<std::uint64_t>(), o.tp));
  row("bytes moved (per rank)", format_bytes(bytes));
  row("throughput (per rank)", fmt::format("{:.2f} GB/s", gbps));
  row("time to ready p50", fmt::format("{:.1f} ms", summary["time_to_ready_p50_ms"].get<double>()));
  row("time to ready p90", fmt::format("{:.1f} ms", summary["time_to_ready_p90_ms"].get<double>()));
  row("time to ready p99", fmt::format("{:.1f} ms", summary["time_to_ready_p99_ms"].get<double>()));
  row("leaked pool bytes", std::to_string(summary["leaked_pool_bytes"].get<std::uint64_t>()),
      mark(summary["leaked_pool_bytes"] == 0));
  row("checksum mismatches", std::to_string(summary["checksum_mismatches"].get<std::uint64_t>()),
      mark(summary["checksum_mismatches"] == 0));
  row("content mismatches", std::to_string(summary["content_mismatches"].get<std::uint64_t>()),
      mark(summary["content_mismatches"] == 0));
  const bool consistent = summary["invariant_error"].get<std::string>().empty();
  row("pool bookkeeping", consistent ? "consistent" : "INCONSISTENT", mark(consistent));
  row("producer retry-afters", std::to_string(summary["producer_retry_afters"].get<std::uint64_t>()),
      fmt::format("{} reserved slots given back while a sibling shard waited",
                  summary["producer_yields"].get<std::uint64_t>()));
  row("payloads sent unreserved", std::to_string(summary["producer_direct_sent"].get<std::uint64_t>()),
      fmt::format("{} turned away by a full or already-holding shard, then reserved",
                  summary["producer_direct_turned_away"].get<std::uint64_t>()));
  row("reserves held for space", fmt::format("{}", summary["consumer_reserves_held"].get<std::uint64_t>()),
      fmt::format("{} placed when space freed, {} answered retry at the end of the hold",
                  summary["consumer_held_reserves_placed"].get<std::uint64_t>(),
                  summary["consumer_held_reserves_expired"].get<std::uint64_t>()));
  row("images encoded",
      fmt::format("{} of {}", summary["encoder_runs"].get<std::uint64_t>(),
                  summary["images_requested"].get<std::uint64_t>()),
      o.encoders > 1 ? fmt::format("({} encoders)", o.encoders) : std::string());
  if (summary.contains("cross_encoder_hits")) {
    row("cross-encoder cache hits",
        fmt::format("{} / {}", summary["cross_encoder_hits"].get<std::uint64_t>(),
                    summary["cross_encoder_lookups"].get<std::uint64_t>()),
        fmt::format("hit rate {:.1f}%, {} loaded, {} load failures, {} published, {} not published",
                    100 * summary["cross_encoder_hit_rate"].get<double>(),
                    format_bytes(summary["store_bytes_loaded"].get<std::uint64_t>()),
                    summary["store_load_failures"].get<std::uint64_t>(),
                    summary["store_published"].get<std::uint64_t>(),
                    summary["store_publish_dropped"].get<std::uint64_t>()));
  }
  if (summary.contains("encoder_hops_skipped")) {
    row("encoder hops skipped", std::to_string(summary["encoder_hops_skipped"].get<std::uint64_t>()),
        fmt::format("requests sent straight to the consumer: {} images loaded there from the store, {} encoded "
                    "there",
                    summary["consumer_store_loads"].get<std::uint64_t>(),
                    summary["consumer_local_encodes"].get<std::uint64_t>()));
  }
  row("wall time", fmt::format("{:.1f} s", wall));
  if (soak_run) {
    row("producer rounds", std::to_string(producer_result ? producer_result->value("rounds", 0ULL) : 0ULL));
    std::cout << fmt::format(
        "\nsoak: {} samples, {} after a {:.0f} s warm-up (growth: median of the last third "
        "minus the first)\n",
        samples.size(), soak.value("samples_after_warmup", 0), soak.value("warmup_s", 0.0));
    const double tolerance_mib = soak.value("rss_tolerance_bytes", 0.0) / (1 << 20);
    auto mib = [](const json& j, const char* key) { return fmt::format("{:+.1f} MiB", j.value(key, 0.0) / (1 << 20)); };
    if (soak.value("judged", false)) {
      const bool pool_ok = soak.value("pool_ok", false);
      const double tolerance = soak.value("rss_tolerance_bytes", 0.0);
      for (const auto& [label, key, what] :
           {std::tuple{"consumer RSS growth", "consumer_rss_growth_bytes", ", less the engine's encoder cache"},
            std::tuple{"producer RSS growth", "producer_rss_growth_bytes", ""}}) {
        row(label, mib(soak, key),
            fmt::format("{} (tolerance {:.0f} MiB{})", mark(soak.value(key, 0.0) <= tolerance), tolerance_mib, what));
      }
      const auto pool_note =
          fmt::format("{} (tolerance {:.0f} MiB)", mark(pool_ok), soak.value("pool_tolerance_bytes", 0.0) / (1 << 20));
      row("pool used growth", mib(soak, "pool_used_growth_bytes"), pool_note);
      row("pool held-floor growth", mib(soak, "pool_held_floor_growth_bytes"), pool_note);
    } else {
      row("growth", "not judged", "(too few samples after warm-up)");
    }
    row("tombstones (max / bound)",
        fmt::format("{} / {}", soak.value("tombstones_max", 0ULL), soak.value("tombstone_bound", 0ULL)),
        mark(soak.value("tombstones_ok", false)));
  }
  std::cout << (summary["passed"].get<bool>() ? "\nPASSED\n" : "\nFAILED\n");
  if (!o.json_file.empty()) {
    std::ofstream(o.json_file) << summary.dump(2) << "\n";
  }
  if (!o.plot_file.empty()) {
    if (auto st = plot_soak(o.plot_file, samples); !st) std::cerr << "ecx demo: " << st.message() << "\n";
  }
  return summary["passed"].get<bool>() ? 0 : 1;
}

namespace {

void add_demo_command(CLI::App& app, Runner& run) {
  auto* demo =
      app.add_subcommand("demo", "Run a consumer (TP=2) and a producer on loopback through a realistic workload");
  auto o = std::make_shared<DemoOptions>();
  demo->add_option("--requests", o->requests, "requests per round")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  demo->add_option("--min-images", o->min_images, "fewest images per request")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  demo->add_option("--max-images", o->max_images, "most images per request")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  demo->add_option("--min-tokens", o->min_tokens, "fewest embedding rows per image")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  demo->add_option("--max-tokens", o->max_tokens, "most embedding rows per image")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  demo->add_option("--hidden", o->hidden, "embedding width")->capture_default_str()->check(CLI::Range(1, 65536));
  demo->add_option("--repeat", o->repeat, "share of images repeated across requests")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  demo->add_option("--item-bytes", o->item_bytes,
                   "every image exactly this many bytes (benches; 0 = token-based sizes)")
      ->capture_default_str();
  demo->add_flag("--log-sizes", o->log_sizes, "draw token counts log-uniformly (many small images, few large)");
  demo->add_option("--tp", o->tp, "consumer tensor-parallel size")->capture_default_str()->check(CLI::Range(1, 16));
  demo->add_option("--encoders", o->encoders, "producer (encoder) processes, requests shared round robin")
      ->capture_default_str()
      ->check(CLI::Range(1, 8));
  demo->add_flag("--zero-copy", o->zero_copy,
                 "the simulated engines keep views of the landed slots (zero_copy_loads) and lend their outputs "
                 "(zero_copy_saves) instead of copying");
  demo->add_option("--extra", o->extra,
                   "JSON object merged into every role's ec_connector_extra_config, e.g. "
                   "'{\"direct_payload_max_bytes\": 0}'");
  demo->add_flag("--cross-encoder-cache", o->cross_encoder_cache,
                 "encoders share outputs through a redis-server the demo starts on loopback");
  demo->add_option("--encoder-index", o->encoder_index, "internal: this producer's index")->group("");
  demo->add_flag("--skip-encoder-hop", o->skip_encoder_hop,
                 "with --cross-encoder-cache: send a request whose images are all in the store straight to the "
                 "consumer, which loads them from it (what ecx proxy --store-url does)");
  demo->add_option("--store-io-timeout", o->store_io_timeout_s,
                   "with --cross-encoder-cache: seconds one store round trip may take (store_io_timeout_s)")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 600.0));
  demo->add_option("--store-url", o->store_url,
                   "with --cross-encoder-cache: use this Redis (redis://host:port/db) instead of starting one");
  add_data_link_option(demo, o->transport, "data plane: UCX over tcp or shm, or mooncake (its tcp)");
  demo->add_option("--ucx-mode", o->ucx_mode, "UCX protocol (ucx_mode): am, or put (one-sided put + flush)")
      ->capture_default_str()
      ->check([](const std::string& mode) {
        auto parsed = transport::parse_ucx_mode(mode);  // the data plane's own list of modes
        return parsed ? std::string() : parsed.status().message();
      });
  demo->add_option("--pool-size", o->pool_size, "each pool's size (consumer shard, producer staging)")
      ->capture_default_str();
  demo->add_option("--seed", o->seed, "workload seed")->capture_default_str();
  demo->add_option("--duration", o->duration_text,
                   "keep running new rounds for this long (a soak): seconds, or with s, m, h (10m)")
      ->capture_default_str();
  demo->add_option("--sample-interval", o->sample_interval_s,
                   "seconds between soak samples (0: duration / 120, within 1..30)")
      ->capture_default_str();
  demo->add_option("--soak-warmup", o->soak_warmup_s, "seconds of warm-up before growth counts (<0: duration / 4)")
      ->capture_default_str();
  demo->add_option("--soak-rss-tolerance", o->soak_rss_tolerance_mib,
                   "MiB a process's RSS may grow after warm-up before the soak fails")
      ->capture_default_str();
  demo->add_option("--soak-pool-tolerance", o->soak_pool_tolerance,
                   "share of the pool its occupancy may grow after warm-up before the soak fails")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  demo->add_option("--plot", o->plot_file, "draw RSS, pool use and tombstones over time into FILE.png (gnuplot)");
  demo->add_option("--deadline", o->deadline_s, "give up after this many seconds")->capture_default_str();
  demo->add_option("--port", o->port, "consumer base control port (0 = pick free ports)")->capture_default_str();
  demo->add_flag("--checksum,!--no-checksum", o->checksum, "verify xxHash64 checksums on landing")
      ->capture_default_str();
  demo->add_option("--json", o->json_file, "write the summary as JSON to this file");
  demo->add_flag("--quiet", o->quiet, "no progress lines");
  demo->add_option("--role", o->role, "internal: all | consumer | producer")
      ->capture_default_str()
      ->group("")
      ->check(CLI::IsMember({"all", "consumer", "producer"}));
  demo->add_option("--admit", o->admit, "internal: the consumer's admit endpoint")->group("");
  demo->add_option("--consumer", o->consumer, "internal: the consumer's control address")->group("");
  demo->callback([&run, o] {
    run = [o] {
      std::signal(SIGINT, on_signal);
      std::signal(SIGTERM, on_signal);
      if (o->min_images > o->max_images || o->min_tokens > o->max_tokens) {
        std::cerr << "ecx demo: --min-* must not exceed --max-*\n";
        return 2;
      }
      auto duration = parse_duration_seconds(o->duration_text);
      if (!duration || *duration < 0) {
        std::cerr << "ecx demo: --duration: "
                  << (duration ? std::string("must not be negative") : duration.status().message()) << "\n";
        return 2;
      }
      o->duration_s = *duration;
      if (o->skip_encoder_hop && !o->cross_encoder_cache) {
        std::cerr << "ecx demo: --skip-encoder-hop needs --cross-encoder-cache (the store it consults)\n";
        return 2;
      }
      // A soak must not run into the deadline meant for one round.
      if (o->role == "all") o->deadline_s = std::max(o->deadline_s, o->duration_s + 300);
      if (o->role == "consumer") return run_consumer(*o);
      if (o->role == "producer") return run_producer(*o);
      return run_demo(*o);
    };
  });
}

}  // namespace

ECX_REGISTER_COMMAND(add_demo_command);

}  // namespace ecx::cli
