// `ecx bench store`: the cross-encoder cache's load time for one hit (EmbeddingStore::
// get_into on a redis-server of its own) next to a plain Redis GET of the very same
// key's bytes on a connection of its own, and next to ECX's push path for the same
// bytes (the data plane from the default configuration, UCX over TCP loopback,
// between a sender and a receiver in this process). The three series run
// interleaved, one operation of each in turn, so load on the machine hits them alike.
#include <unistd.h>

#include <hiredis/hiredis.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "commands.h"
#include "core/logging.h"
#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/tensor_spec.h"
#include "ecx/pool/slab.h"
#include "ecx/store/embedding_store.h"
#include "ecx/transport/factory.h"
#include "sim/engine_sim.h"
#include "sim/redis_server.h"

namespace ecx::cli {
namespace {

using json = nlohmann::json;
using BenchClock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct StoreBenchOptions {
  std::string sizes_text = "1MiB,9MiB";
  int iterations = 30;
  int repeat = 3;
  std::string json_file;
};

constexpr const char* kModel = "ecx-bench-model@1";
constexpr int kWarmup = 3;  // untimed operations per series and size before each repeat

double micros_since(BenchClock::time_point start) {
  return std::chrono::duration<double, std::micro>(BenchClock::now() - start).count();
}

// A plain hiredis connection, apart from the store's.
class RawRedis {
 public:
  static Result<RawRedis> connect(int port) {
    RawRedis r;
    r.context_.reset(redisConnectWithTimeout("127.0.0.1", port, {2, 0}));
    if (!r.context_ || r.context_->err) {
      return unavailable(fmt::format("cannot connect to redis-server on 127.0.0.1:{}: {}", port,
                                     r.context_ ? r.context_->errstr : "out of memory"));
    }
    // Every reply is bounded: a stuck server fails the run instead of hanging it.
    if (redisSetTimeout(r.context_.get(), {5, 0}) != REDIS_OK) return unavailable("cannot set the hiredis timeout");
    return r;
  }

  // GET of `key`, timed from the send to the complete reply (freed outside the time).
  Result<double> timed_get(const std::string& key, std::uint64_t expected_bytes) {
    const auto start = BenchClock::now();
    std::unique_ptr<redisReply, void (*)(void*)> reply(
        static_cast<redisReply*>(redisCommand(context_.get(), "GET %b", key.data(), key.size())), freeReplyObject);
    const double us = micros_since(start);
    if (!reply) return unavailable(fmt::format("GET {} failed: {}", key, context_->errstr));
    if (reply->type != REDIS_REPLY_STRING || reply->len != expected_bytes) {
      return internal_error(fmt::format("GET {} answered type {} with {} bytes, expected a string of {}", key,
                                        reply->type, reply->len, expected_bytes));
    }
    return us;
  }

 private:
  RawRedis() = default;
  std::unique_ptr<redisContext, void (*)(redisContext*)> context_{nullptr, redisFree};
};

// ECX's data plane between two endpoints of this process: a receiver with one
// registered landing buffer and a sender with one registered source buffer. One
// payload at a time, timed from send() to the receiver's on_landing (every byte in
// place); the next send waits for the sender's completion too.
class PushPath {
 public:
  PushPath() = default;  // use start(); not movable (the callbacks hold `this`)
  PushPath(const PushPath&) = delete;
  PushPath& operator=(const PushPath&) = delete;

  static Result<std::unique_ptr<PushPath>> start(std::uint64_t max_bytes) {
    auto p = std::make_unique<PushPath>();
    auto rx = pool::Slab::allocate(pool::MemoryKind::host, max_bytes, pool::SlabOptions{.prefault = true});
    if (!rx) return rx.status();
    auto tx = pool::Slab::allocate(pool::MemoryKind::host, max_bytes, pool::SlabOptions{.prefault = true});
    if (!tx) return tx.status();
    p->rx_.emplace(std::move(*rx));
    p->tx_.emplace(std::move(*tx));
    const Config config;  // the data plane every ECX role gets by default
    p->describe_ = transport::describe_data_plane(config);
    PushPath* self = p.get();
    transport::ReceiverHooks hooks;
    hooks.resolver = [self](std::span<const std::byte>, std::uint64_t bytes) -> Result<transport::Landing> {
      if (bytes > self->rx_->size()) return resource_exhausted("payload larger than the landing buffer");
      return transport::Landing{self->rx_->data(), bytes, 0};
    };
    hooks.on_landing = [self](std::span<const std::byte>, const transport::Landing&, const Status& status) {
      std::lock_guard lock(self->mutex_);
      self->landed_ = true;
      self->landing_status_ = status;
      self->changed_.notify_all();
    };
    auto receiver =
        transport::create_data_plane(config, p->clock_, transport::DataPlaneRole::receiver, std::move(hooks));
    if (!receiver) return receiver.status();
    p->receiver_ = std::move(*receiver);
    auto rx_region = p->receiver_->register_region(p->rx_->data(), p->rx_->size(), transport::MemoryKind::host);
    if (!rx_region) return rx_region.status();
    auto address = p->receiver_->listen("127.0.0.1", 0);
    if (!address) return address.status();
    auto sender = transport::create_data_plane(config, p->clock_, transport::DataPlaneRole::sender);
    if (!sender) return sender.status();
    p->sender_ = std::move(*sender);
    auto tx_region = p->sender_->register_region(p->tx_->data(), p->tx_->size(), transport::MemoryKind::host);
    if (!tx_region) return tx_region.status();
    p->tx_region_ = *tx_region;
    auto endpoint = p->sender_->connect(*address);
    if (!endpoint) return endpoint.status();
    p->endpoint_ = *endpoint;
    return p;
  }

  std::byte* source() { return tx_->data(); }
  const std::byte* landed_bytes() const { return rx_->data(); }
  const std::string& describe() const { return describe_; }

  Result<double> timed_push(std::uint64_t bytes) {
    {
      std::lock_guard lock(mutex_);
      landed_ = sent_ = false;
    }
    const std::byte header[64] = {};
    const auto start = BenchClock::now();
    auto accepted = sender_->send(endpoint_, header, tx_region_, 0, bytes, clock_->now() + 10s, [this](Status s) {
      std::lock_guard lock(mutex_);
      sent_ = true;
      sent_status_ = std::move(s);
      changed_.notify_all();
    });
    if (!accepted) return accepted;
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, 15s, [&] { return landed_; })) return timeout_error("push never landed");
    const double us = micros_since(start);
    if (!changed_.wait_for(lock, 15s, [&] { return sent_; })) return timeout_error("push never completed");
    if (!landing_status_) return landing_status_;
    if (!sent_status_) return sent_status_;
    return us;
  }

 private:
  const std::shared_ptr<const ecx::Clock> clock_ = SteadyClock::shared();
  std::mutex mutex_;
  std::condition_variable changed_;
  bool landed_ = false;
  bool sent_ = false;
  Status landing_status_;
  Status sent_status_;
  std::optional<pool::Slab> rx_, tx_;
  std::string describe_;
  transport::RegionHandle tx_region_;
  transport::EndpointHandle endpoint_;
  // Last, so both transports stop (and their callbacks with them) before the buffers go.
  std::unique_ptr<transport::Transport> receiver_;
  std::unique_ptr<transport::Transport> sender_;
};

struct Figures {
  double p50_us = 0;
  double p99_us = 0;
  double gbps = 0;
};

Figures figures(const std::vector<double>& samples_us, std::uint64_t bytes) {
  double total_us = 0;
  for (double s : samples_us) total_us += s;
  return {sim::percentile(samples_us, 50), sim::percentile(samples_us, 99),
          total_us > 0 ? static_cast<double>(bytes) * static_cast<double>(samples_us.size()) / (total_us * 1e3) : 0};
}

// The median run by p50; its p99 and GB/s come with it.
Figures median(std::vector<Figures> runs) {
  std::sort(runs.begin(), runs.end(), [](const Figures& a, const Figures& b) { return a.p50_us < b.p50_us; });
  return runs[runs.size() / 2];
}

constexpr const char* kSeries[] = {"store_get", "redis_get", "push_path"};

int fail(const std::string& message) {
  std::cerr << "ecx bench store: " << message << "\n";
  return 1;
}

int run_store_bench(const StoreBenchOptions& o) {
  log::set_level(spdlog::level::warn);
  auto sizes = parse_byte_sizes(o.sizes_text);
  if (!sizes || sizes->empty()) {
    std::cerr << "ecx bench store: --sizes: " << (sizes ? "no size given" : sizes.status().message()) << "\n";
    return 2;
  }
  if (::access(sim::kRedisServerPath, X_OK) != 0) {
    std::cerr << "ecx bench store: " << sim::kRedisServerPath
              << " is missing; install the Debian package redis-server\n";
    return 2;
  }
  auto redis = sim::RedisServer::start();
  if (!redis) return fail(redis.status().to_string());
  const std::uint64_t max_bytes = *std::max_element(sizes->begin(), sizes->end());

  store::RedisOptions ro;
  ro.port = redis->port();
  ro.keys.prefix = "ecxbench";
  ro.keys.model = kModel;
  ro.max_entry_bytes = std::max<std::uint64_t>(max_bytes, 1ULL << 20);
  ro.io_timeout_s = 5;  // a 9 MiB entry on a loaded machine; the bench reports, it does not fall back
  auto opened = store::open_redis_store(ro);
  if (!opened) return fail(opened.status().to_string());
  auto& store = *opened;
  auto raw = RawRedis::connect(redis->port());
  if (!raw) return fail(raw.status().to_string());
  auto push = PushPath::start(max_bytes);
  if (!push) return fail("push path: " + push.status().to_string());
  PushPath& pusher = **push;

  // One entry per size, written once; the push source holds the same bytes.
  struct Item {
    std::uint64_t bytes;
    std::string mm_hash;
    std::string key;
    std::vector<std::byte> payload;
    std::vector<std::byte> landing;
    std::uint64_t value_bytes = 0;  // the entry as Redis holds it: header, model, payload
  };
  std::vector<Item> items;
  for (const auto bytes : *sizes) {
    Item item{bytes, fmt::format("bench-{}", bytes), "", std::vector<std::byte>(bytes), std::vector<std::byte>(bytes)};
    for (std::uint64_t i = 0; i < bytes; ++i) item.payload[i] = static_cast<std::byte>((i * 131 + bytes) & 0xff);
    auto spec = TensorSpec::make({static_cast<std::int64_t>(bytes)}, DType::uint8, ro.max_entry_bytes);
    if (!spec) return fail(spec.status().to_string());
    if (auto st = store->put(item.mm_hash, *spec, item.payload); !st) return fail("put: " + st.to_string());
    auto key = ro.keys.key(item.mm_hash);
    if (!key) return fail(key.status().to_string());
    item.key = *key;
    auto strlen = redis->raw({"STRLEN", item.key});
    if (!strlen || strlen->type != REDIS_REPLY_INTEGER) return fail("STRLEN of the entry failed");
    item.value_bytes = static_cast<std::uint64_t>(strlen->integer);
    items.push_back(std::move(item));
  }

  std::string load = "?";
  if (std::ifstream loadavg("/proc/loadavg"); loadavg) loadavg >> load;
  std::cout << fmt::format(
      "ecx bench store: redis-server on 127.0.0.1:{} (started for the bench), push path {} on 127.0.0.1; {} "
      "interleaved operations per series and size, median of {} runs, load average {} on {} CPUs\n",
      redis->port(), pusher.describe(), o.iterations, o.repeat, load, std::thread::hardware_concurrency());

  // runs[size index][series] = one Figures per repeat
  std::vector<std::map<std::string, std::vector<Figures>>> runs(items.size());
  for (int r = 0; r < o.repeat; ++r) {
    for (std::size_t s = 0; s < items.size(); ++s) {
      Item& item = items[s];
      const store::EmbeddingStore::Landing land = [&item](const TensorSpec&) -> Result<std::span<std::byte>> {
        return std::span<std::byte>(item.landing);
      };
      std::memcpy(pusher.source(), item.payload.data(), item.bytes);
      std::map<std::string, std::vector<double>> samples;
      for (int i = -kWarmup; i < o.iterations; ++i) {
        const auto start = BenchClock::now();
        auto entry = store->get_into(item.mm_hash, land);
        const double store_us = micros_since(start);
        if (!entry) return fail("store get_into: " + entry.status().to_string());
        auto redis_us = raw->timed_get(item.key, item.value_bytes);
        if (!redis_us) return fail("redis GET: " + redis_us.status().to_string());
        auto push_us = pusher.timed_push(item.bytes);
        if (!push_us) return fail("push path: " + push_us.status().to_string());
        if (i < 0) continue;
        samples["store_get"].push_back(store_us);
        samples["redis_get"].push_back(*redis_us);
        samples["push_path"].push_back(*push_us);
      }
      // Outside the timing: both paths delivered the very bytes that were written.
      if (std::memcmp(item.landing.data(), item.payload.data(), item.bytes) != 0) {
        return fail(fmt::format("store_get of {} landed bytes that differ from the entry", item.mm_hash));
      }
      if (std::memcmp(pusher.landed_bytes(), item.payload.data(), item.bytes) != 0) {
        return fail(fmt::format("push_path of {} landed bytes that differ from the source", item.mm_hash));
      }
      for (const char* name : kSeries) runs[s][name].push_back(figures(samples[name], item.bytes));
    }
  }
  const auto counters = store->counters();
  if (counters.rejected != 0 || counters.errors != 0) {
    return fail(fmt::format("the store rejected {} entries and had {} errors", counters.rejected, counters.errors));
  }

  json series = json::array();
  const TextTable table({{"size", 9}, {"series", 10}, {"p50 us", 9}, {"p99 us", 9}, {"GB/s", 7}, {"ratio", 6}});
  table.print_header(std::cout);
  for (std::size_t s = 0; s < items.size(); ++s) {
    const Figures store_fig = median(runs[s]["store_get"]);
    for (const char* name : kSeries) {
      const Figures f = median(runs[s][name]);
      json row = {{"series", name},     {"size_bytes", items[s].bytes}, {"iterations", o.iterations},
                  {"repeat", o.repeat}, {"p50_us", f.p50_us},           {"p99_us", f.p99_us},
                  {"gbps", f.gbps}};
      if (std::string(name) == "redis_get") {
        row["value_bytes"] = items[s].value_bytes;
        row["ratio_store_get_p50"] = store_fig.p50_us / f.p50_us;
      } else if (std::string(name) == "push_path") {
        row["transport"] = pusher.describe();
        row["ratio_store_get_p50"] = store_fig.p50_us / f.p50_us;
      }
      table.print_row(std::cout, {std::string(name) == "store_get" ? byte_size_label(items[s].bytes) : "", name,
                                  cell(row, "p50_us", 1), cell(row, "p99_us", 1), cell(row, "gbps", 2),
                                  cell(row, "ratio_store_get_p50", 2)});
      series.push_back(std::move(row));
    }
  }
  std::cout << "ratio: store_get p50 divided by this series' p50 (lower is better for store_get). Against "
               "redis_get it is what the store adds over a bare GET (STRLEN + GETRANGE pipelined, header and "
               "xxHash64 checks, one copy into the landing); against push_path it is a hit's load next to pushing "
               "the same bytes. GB/s: payload bytes over the series' summed operation time\n";
  if (!o.json_file.empty()) {
    if (auto st = write_json_file(o.json_file, series); !st) return fail(st.message());
  }
  return 0;
}

void add_bench_store_command(CLI::App& app, Runner& run) {
  auto* cmd = bench_subcommand(app)->add_subcommand(
      "store",
      "Cross-encoder cache: a hit's load (EmbeddingStore::get_into, checks included) vs a plain Redis GET of the "
      "same bytes and ECX's push path (default data plane, UCX over TCP loopback in-process), p50/p99 and GB/s");
  auto o = std::make_shared<StoreBenchOptions>();
  cmd->add_option("--sizes", o->sizes_text, "comma-separated item sizes, e.g. 1MiB,9MiB")->capture_default_str();
  cmd->add_option("--iterations", o->iterations, "timed operations per series, size and run")
      ->capture_default_str()
      ->check(CLI::Range(1, 100'000));
  cmd->add_option("--repeat", o->repeat, "interleaved runs per series; the median is reported")
      ->capture_default_str()
      ->check(CLI::Range(1, 20));
  cmd->add_option("--json", o->json_file, "write the series as a JSON list to FILE");
  cmd->callback([&run, o] { run = [o] { return run_store_bench(*o); }; });
}

}  // namespace

ECX_REGISTER_COMMAND(add_bench_store_command);

}  // namespace ecx::cli
