// `ecx bench e2e`: transfers through the whole engine — a consumer process
// (scheduler and worker coordinators stepped like an engine, ReservationManager,
// pool, ZeroMQ control, UCX) and a producer process (push engine, staging) — for
// fixed item sizes: transfers/s, GB/s and time-to-ready p50/p99, next to the raw
// UCX data plane (`ecx bench transport`, same sizes, same run) for the added
// latency.
//
// Each size runs two phases: `throughput` (many pushes in flight) and `latency`
// (one push at a time). Two hosts: `--role consumer --listen HOST:PORT` on one,
// `--role producer --connect HOST:PORT` on the other; phase k uses the ports
// PORT + k * (TP + 1) (the admit channel) and the TP control ports after it. The
// default role `all` runs both roles as child processes on 127.0.0.1 and adds the
// raw-transport baseline.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "commands.h"
#include "control/zmq_util.h"
#include "core/logging.h"
#include "data_link.h"
#include "ecx/control/client.h"
#include "ecx/core/config.h"
#include "ecx/core/stages.h"
#include "sim/engine_sim.h"
#include "sim/process.h"

namespace ecx::cli {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

struct E2eOptions {
  std::string role = "all";
  std::string listen;   // consumer: HOST:PORT
  std::string connect;  // producer: HOST:PORT
  std::string sizes_text = "64KiB,9MiB";
  std::uint64_t count = 0;          // items per throughput phase (0: automatic)
  std::uint64_t latency_count = 0;  // items per latency phase (0: automatic)
  int window = 32;                  // pushes in flight in the throughput phase
  int tp = 1;
  DataLink transport = DataLink::tcp;
  std::string pool_size = "1GiB";
  bool checksum = false;
  bool baseline = true;
  double phase_timeout_s = 300;
  int rounds = 1;  // role all: every phase, ECX's side and the raw plane's, this many times
  std::string json_file;
  std::string extra;  // a JSON object merged into ec_connector_extra_config (both roles)
  // Hidden (roles consumer and producer): hold for the go (bench_command.h) before
  // each phase's set-up, and the producer also before its first request; role all
  // passes it when it measures the raw plane.
  bool hold = false;
  // Role all, with the raw plane: how long every process of a phase sits set up and
  // idle before the first of its two measurements.
  double settle_s = 3;
};

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

struct Phase {
  std::uint64_t size = 0;
  std::string name;  // throughput | latency
  int window = 1;
  std::uint64_t items = 0;
};

// A role's hold (--hold) before phase `phase`'s `stage`: "setup" (before anything of
// the phase starts) or "start" (the producer, set up, before its first request). The
// other side may measure meanwhile, so the limit is two phases' worth. Without --hold,
// nothing to wait for.
Status hold_role(const E2eOptions& o, const char* stage, const Phase& phase) {
  if (!o.hold) return Status::ok();
  const json line{{"event", "holding"}, {"stage", stage}, {"phase", phase.name}, {"size_bytes", phase.size}};
  return hold_for_go(line.dump(),
                     std::chrono::milliseconds(static_cast<std::int64_t>(o.phase_timeout_s * 2000) + 60'000), &g_stop);
}

std::uint64_t auto_count(std::uint64_t size) { return std::clamp<std::uint64_t>((2ULL << 30) / size, 100, 3000); }
std::uint64_t auto_latency_count(std::uint64_t size) {
  return std::clamp<std::uint64_t>((256ULL << 20) / size, 30, 300);
}
// Items run ahead of a phase's measured ones and left out of its figures: the first
// pay for connecting (topology discovery, UCX endpoints) and the pipeline's filling.
// As many as `ecx bench transport` runs ahead of the raw plane's measured messages,
// so that both sides are measured alike (it was 10 items inside the count here, 64
// ahead of it there, for a 32-item window).
std::uint64_t warmup_items(std::uint64_t items, int window) {
  return std::max<std::uint64_t>(static_cast<std::uint64_t>(window) * 2, items / 10);
}

Result<std::vector<Phase>> plan(const E2eOptions& o) {
  auto sizes = parse_byte_sizes(o.sizes_text);
  if (!sizes) return sizes.status();
  std::vector<Phase> phases;
  for (const auto size : *sizes) {
    phases.push_back(Phase{size, "throughput", o.window, o.count ? o.count : auto_count(size)});
    phases.push_back(Phase{size, "latency", 1, o.latency_count ? o.latency_count : auto_latency_count(size)});
  }
  return phases;
}

Result<std::pair<std::string, int>> split_host_port(const std::string& text, const char* flag) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return invalid_argument(fmt::format("{} '{}': expected HOST:PORT", flag, text));
  }
  std::string host = text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = 0;
  try {
    port = std::stoi(text.substr(colon + 1));
  } catch (const std::exception&) {
    port = 0;
  }
  if (port <= 0 || port > 65535) return invalid_argument(fmt::format("{} '{}': the port must be 1..65535", flag, text));
  return std::pair{host, port};
}

int phase_port(int base, int tp, std::size_t phase) { return base + static_cast<int>(phase) * (tp + 1); }

Result<Config> e2e_config(const E2eOptions& o, Role role, const std::string& host, int control_port) {
  // Both pools are touched at start (what a deployment should do, see prefault in
  // docs/configuration.md): a landing's first touch of a pool page is no part of
  // what the bench measures. The simulated engines are host engines that share their
  // memory with ECX, as CPU engines can: the consumer keeps views of the landed slots
  // (zero_copy_loads), the producer lends its outputs (zero_copy_saves).
  json extra{{"checksum", o.checksum},        {"prefault", true},
             {"zero_copy_loads", true},       {"zero_copy_saves", true},
             {"push_wait_timeout_s", 60},     {"control_timeout_s", 10},
             {"shutdown_drain_timeout_s", 5}, {"ucx_peer_errors", ucx_peer_errors(o.transport)}};
  if (auto merged = merge_extra_config(extra, o.extra); !merged) return merged;
  json doc{{"ec_role", role_name(role)}, {"ec_ip", host},
           {"ec_port", control_port},    {"ec_buffer_size", o.pool_size},
           {"ec_buffer_device", "cpu"},  {"ec_connector_extra_config", extra}};
  ParallelLayout layout;
  if (role == Role::consumer) layout.tp_size = o.tp;
  return parse_config(doc.dump(), layout);
}

// ---------------------------------------------------------------- stages

using StageSnapshots = std::array<metrics::Histogram::Snapshot, stages::kStageCount>;

// What this process recorded of `which` stages since `before`: count, mean and the
// histogram's p50/p99 (interpolated inside 1-2.5-5 buckets: coarse, the mean is exact).
json stage_report(const StageSnapshots& before, std::initializer_list<stages::Stage> which) {
  const auto now = stages::snapshot();
  json out = json::object();
  for (auto stage : which) {
    const auto i = static_cast<std::size_t>(stage);
    const auto d = now[i].since(before[i]);
    out[std::string(stages::stage_name(stage))] = {
        {"count", d.count},
        {"mean_us", d.count > 0 ? d.sum / static_cast<double>(d.count) * 1e6 : 0.0},
        {"p50_us", d.quantile(0.5) * 1e6},
        {"p99_us", d.quantile(0.99) * 1e6}};
  }
  return out;
}

constexpr std::initializer_list<stages::Stage> kProducerStages = {stages::Stage::reserve, stages::Stage::source_wait,
                                                                  stages::Stage::staging_copy, stages::Stage::wire};
constexpr std::initializer_list<stages::Stage> kConsumerStages = {
    stages::Stage::landing, stages::Stage::event_delivery, stages::Stage::load_dispatch, stages::Stage::load_copy};

void print_stage_table(const std::vector<json>& phases) {
  const TextTable table(
      {{"size", 8}, {"phase", 10}, {"stage", 15}, {"count", 7}, {"mean us", 9}, {"p50 us", 9}, {"p99 us", 9}});
  std::cout << "\nper stage (ecx_transfer_stage_seconds after the warm-up; producer stages first, then the "
               "consumer's):\n";
  table.print_header(std::cout);
  for (const auto& e2e : phases) {
    if (!e2e.contains("stages")) continue;
    for (const auto& list : {kProducerStages, kConsumerStages}) {
      for (auto stage : list) {
        const auto name = std::string(stages::stage_name(stage));
        if (!e2e["stages"].contains(name)) continue;
        const auto& st = e2e["stages"][name];
        table.print_row(std::cout,
                        {byte_size_label(e2e.value("size_bytes", std::uint64_t{0})), e2e.value("phase", std::string()),
                         name, std::to_string(st.value("count", std::uint64_t{0})), cell(st, "mean_us", 1),
                         cell(st, "p50_us", 1), cell(st, "p99_us", 1)});
      }
    }
  }
}

// ---------------------------------------------------------------- CPU per item

// Each thread name's figure per item, times `scale`.
json per_item(const std::map<std::string, std::uint64_t>& by_thread, std::uint64_t items, double scale) {
  json out = json::object();
  if (items == 0) return out;
  for (const auto& [name, value] : by_thread) {
    out[name] = static_cast<double>(value) * scale / static_cast<double>(items);
  }
  return out;
}

// `ns` over `items`, in us; 0 without items.
double us_per_item(std::uint64_t ns, std::uint64_t items) {
  return items > 0 ? static_cast<double>(ns) / 1e3 / static_cast<double>(items) : 0.0;
}

// CPU time per item of each thread name, us.
json cpu_per_item(const std::map<std::string, std::uint64_t>& thread_cpu_ns, std::uint64_t items) {
  return per_item(thread_cpu_ns, items, 1e-3);
}

// Sleeps (hence wake-ups) per item of each thread name.
json sleeps_per_item(const std::map<std::string, std::uint64_t>& thread_sleeps, std::uint64_t items) {
  return per_item(thread_sleeps, items, 1.0);
}

// What a thread of ECX's is, by its name. The engine threads ("ecx-engine": the
// process's main thread and, with TP > 1, one per rank) run both ECX's calls and the
// simulator's own work, measured apart (sim_us_per_item); every other thread is ECX's.
std::string thread_label(const std::string& name) {
  static const std::map<std::string, std::string, std::less<>> ecx_threads = {
      {"ecx-ucx", "UCX progress"},
      {"ecx-push", "push dispatcher"},
      {"ecx-executor", "scheduler executor"},
      {"ecx-ctl-server", "control server"},
      {"ecx-ctl-client", "control client I/O"},
      {"async", "UCX async events"},
      {"ecx-metrics", "metrics endpoint"},
  };
  if (auto it = ecx_threads.find(name); it != ecx_threads.end()) return it->second;
  // ZeroMQ's "<tag>/ZMQbg/IO/0" and "<tag>/ZMQbg/Reaper" (control::detail::ContextTag).
  if (const auto slash = name.find("/ZMQbg/"); slash != std::string::npos) {
    using control::detail::ContextTag;
    static const std::map<std::string, std::string, std::less<>> contexts = {
        {std::to_string(static_cast<int>(ContextTag::control_client)), "control client"},
        {std::to_string(static_cast<int>(ContextTag::control_server)), "control server"},
        {std::to_string(static_cast<int>(ContextTag::event_inbox)), "event subscription"}};
    const std::string what = name.substr(slash + 7) == "Reaper" ? "reaper" : "I/O";
    if (auto it = contexts.find(name.substr(0, slash)); it != contexts.end()) {
      return "ZeroMQ " + what + ": " + it->second;
    }
  }
  return name;
}

// A sleeps/item cell.
std::string sleeps_text(std::optional<double> sleeps) {
  return sleeps ? fmt::format("{:.2f}", *sleeps) : std::string("-");
}

// The busiest single thread of ECX's two processes in a phase's row, as "<process>
// <thread name>" and its CPU per item: what a host with a CPU for every thread would be
// bound by. An engine thread counts with its simulator's share (one thread either way).
std::optional<std::pair<std::string, double>> busiest_ecx_thread(const json& e2e) {
  std::optional<std::pair<std::string, double>> busiest;
  for (const auto& [process, key] :
       {std::pair{"consumer", "cpu_us_per_item"}, std::pair{"producer", "producer_cpu_us_per_item"}}) {
    if (!e2e.contains(key)) continue;
    for (const auto& [name, value] : e2e[key].items()) {
      const double us = value.get<double>();
      if (!busiest || us > busiest->second) busiest = std::pair{fmt::format("{} {}", process, name), us};
    }
  }
  return busiest;
}

// "producer ecx-ucx" -> "producer UCX progress".
std::string busiest_label(const std::string& where) {
  const auto space = where.find(' ');
  return space == std::string::npos ? where : where.substr(0, space) + " " + thread_label(where.substr(space + 1));
}

// One phase's CPU per item, thread by thread, then ECX's, the simulated engine's and
// both: the machine's cost of an item, and the rate this host's CPUs allow at it.
void print_cpu_table(const std::vector<json>& phases, const std::vector<json>& raws) {
  const TextTable table(
      {{"size", 8}, {"phase", 10}, {"process", 8}, {"thread", 34}, {"us/item", 8}, {"sleeps/item", 11}});
  const unsigned cpus = std::max(1U, std::thread::hardware_concurrency());
  std::cout << "\nCPU per item (each process's threads during its phase after the warm-up, by name; the engine "
               "threads split into the simulator's own work and ECX's calls, their sleeps, waits in ECX's calls "
               "included, on the first); sleeps/item: how often the threads went to sleep per item, each a wake-up "
               "later:\n";
  table.print_header(std::cout);
  for (std::size_t k = 0; k < phases.size(); ++k) {
    const json& e2e = phases[k];
    if (!e2e.contains("cpu_us_per_item") || !e2e.contains("producer_cpu_us_per_item")) continue;
    const std::string size = byte_size_label(e2e.value("size_bytes", std::uint64_t{0}));
    const std::string phase = e2e.value("phase", std::string());
    double ecx = 0;
    double simulator = 0;
    auto row = [&](const char* process, const std::string& label, double us, bool is_sim,
                   std::optional<double> sleeps) {
      (is_sim ? simulator : ecx) += us;
      if (us < 0.05 && sleeps.value_or(0.0) < 0.005) return;
      table.print_row(std::cout, {size, phase, process, label, fmt::format("{:.1f}", us), sleeps_text(sleeps)});
    };
    auto total_row = [&](const char* process, const std::string& label, const std::string& value) {
      table.print_row(std::cout, {size, phase, process, label, value, "-"});
    };
    // A plane's busiest thread ("<side> <thread name>") and the rate it alone allows.
    auto busiest_rows = [&](const char* process, const json& figures) {
      const double us = figures.value("busiest_thread_us_per_item", 0.0);
      if (us <= 0) return;
      total_row(process, fmt::format("busiest: {}", busiest_label(figures.value("busiest_thread", std::string()))),
                fmt::format("{:.1f}", us));
      total_row(process, "items/s a CPU per thread allows", fmt::format("{:.0f}", 1e6 / us));
    };
    for (const auto& [process, cpu_key, sleeps_key, sim_key] :
         {std::tuple{"consumer", "cpu_us_per_item", "sleeps_per_item", "sim_us_per_item"},
          std::tuple{"producer", "producer_cpu_us_per_item", "producer_sleeps_per_item", "producer_sim_us_per_item"}}) {
      const json sleeps = e2e.value(sleeps_key, json::object());
      const auto sleeps_of = [&sleeps](const std::string& name) -> std::optional<double> {
        if (!sleeps.contains(name)) return std::nullopt;
        return sleeps[name].get<double>();
      };
      // The engine threads (every TP rank's) together: the simulator's own part is
      // measured for all of them at once.
      double engine_us = 0;
      std::optional<double> engine_sleeps;
      for (const auto& [name, value] : e2e[cpu_key].items()) {
        const double us = value.get<double>();
        if (sim::is_engine_thread(name)) {
          engine_us += us;
          if (const auto n = sleeps_of(name)) engine_sleeps = engine_sleeps.value_or(0.0) + *n;
          continue;
        }
        row(process, thread_label(name), us, false, sleeps_of(name));
      }
      const double sim_us = std::min(engine_us, e2e.value(sim_key, 0.0));
      row(process, "engine threads: ECX's calls", engine_us - sim_us, false, engine_sleeps);
      row(process, "engine threads: simulator", sim_us, true, std::nullopt);
    }
    const double all = ecx + simulator;
    total_row("both", "ECX", fmt::format("{:.1f}", ecx));
    total_row("both", "simulated engines", fmt::format("{:.1f}", simulator));
    total_row("both", "all", fmt::format("{:.1f}", all));
    const bool many = e2e.value("window", 1) > 1;  // many in flight: the CPUs, not a hand-back, set the pace
    if (all > 0 && many) {
      total_row("both", fmt::format("items/s {} CPUs allow at this cost", cpus),
                fmt::format("{:.0f}", static_cast<double>(cpus) * 1e6 / all));
    }
    if (many) busiest_rows("both", e2e);
    // The raw data plane's own cost per message, same round: sender and receiver.
    if (k < raws.size() && raws[k].is_object() && raws[k].contains("cpu_us_per_item")) {
      const json& r = raws[k];
      const double raw = r.value("cpu_us_per_item", 0.0);
      const auto sleeps = [&r](const char* key) -> std::optional<double> {
        if (!r.contains(key)) return std::nullopt;
        return r.value(key, 0.0);
      };
      table.print_row(std::cout, {size, phase, "raw", "the raw data plane", fmt::format("{:.1f}", raw),
                                  sleeps_text(sleeps("sleeps_per_message"))});
      for (const auto& [label, key] : {std::pair{"UCX progress, receiver", "receiver_progress_sleeps_per_message"},
                                       std::pair{"UCX progress, sender", "sender_progress_sleeps_per_message"}}) {
        if (const auto n = sleeps(key)) table.print_row(std::cout, {size, phase, "raw", label, "-", sleeps_text(n)});
      }
      if (raw > 0 && many) {
        total_row("raw", fmt::format("items/s {} CPUs allow at this cost", cpus),
                  fmt::format("{:.0f}", static_cast<double>(cpus) * 1e6 / raw));
      }
      if (many) busiest_rows("raw", r);
    }
  }
}

// ---------------------------------------------------------------- consumer role

// `same_host`: the producer's stamps (its steady clock) mean something here.
Result<json> consume_phase(const E2eOptions& o, const Phase& phase, const std::string& host, int port, bool same_host) {
  auto config = e2e_config(o, Role::consumer, host, port + 1);
  if (!config) return config.status();
  sim::ConsumerSimOptions options;
  options.config = *config;
  options.admit_bind = tcp_address(host, port);
  options.deadline = seconds_to_duration(o.phase_timeout_s);
  // The engine threads share the CPUs with ECX: every block's stamp of every item, and
  // every byte of one item in 16 (ecx demo and the tests check every byte).
  options.content_check = sim::ContentCheck::sampled;
  const std::uint64_t warmup = warmup_items(phase.items, phase.window);
  // The CPU and stage tables count the measured items only, as the raw plane's do.
  options.warm_up_requests = warmup;
  auto stages_before = stages::snapshot();
  options.on_warmed_up = [&stages_before] { stages_before = stages::snapshot(); };
  auto consumer = sim::ConsumerSim::start(std::move(options));
  if (!consumer) return consumer.status();
  std::cout << json{{"event", "listening"}, {"admit", (*consumer)->admit_endpoint()}}.dump() << std::endl;
  const auto run_started = std::chrono::steady_clock::now();  // what the result's ready_at_s count from (within us)
  const auto r = (*consumer)->run(&g_stop);
  // The throughput window: from the arrival of the first request after the warm-up to
  // the last ready. Counting from a ready instead would let a consumer that falls
  // behind and then finds a backlog ready at once report that burst as its rate.
  std::vector<double> ttr_us;
  std::vector<double> encoded_us;  // the encoder's hand-over -> ready
  double window_start = 0;
  double window_end = 0;
  for (std::size_t i = warmup; i < r.time_to_ready_ms.size(); ++i) {
    ttr_us.push_back(r.time_to_ready_ms[i] * 1000);
    if (same_host && i < r.encoded_to_ready_ms.size() && r.encoded_to_ready_ms[i] >= 0) {
      encoded_us.push_back(r.encoded_to_ready_ms[i] * 1000);
    }
    const double admitted_s = r.ready_at_s[i] - r.time_to_ready_ms[i] / 1000;
    window_start = i == warmup ? admitted_s : std::min(window_start, admitted_s);
    window_end = std::max(window_end, r.ready_at_s[i]);
  }
  const double seconds = window_end - window_start;
  const auto measured = static_cast<double>(ttr_us.size());
  const double per_s = seconds > 0 ? measured / seconds : 0;
  json out{{"event", "phase"},
           {"series", "ecx_e2e"},
           {"phase", phase.name},
           {"size_bytes", phase.size},
           {"window", phase.window},
           {"tp", o.tp},
           {"items", phase.items},
           {"items_ready", r.progress.requests_ready},
           {"items_failed", r.progress.requests_failed},
           {"warmup_items", warmup},
           {"per_s", per_s},
           {"gbps", per_s * static_cast<double>(phase.size) / 1e9},
           {"p50_us", sim::percentile(ttr_us, 50)},
           {"p99_us", sim::percentile(ttr_us, 99)},
           {"sim_us_per_item", us_per_item(r.sim_engine_ns, r.window_items)},
           {"cpu_us_per_item", cpu_per_item(r.thread_cpu_ns, r.window_items)},
           {"cpu_items", r.window_items},
           {"sleeps_per_item", sleeps_per_item(r.thread_sleeps, r.window_items)},
           {"leaked_pool_bytes", r.leaked_pool_bytes},
           {"checksum_mismatches", r.checksum_mismatches},
           {"content_mismatches", r.content_mismatches},
           {"invariant_error", r.invariant_error},
           {"stages", stage_report(stages_before, kConsumerStages)}};
  // The measured window on the host's monotonic clock, as the raw plane's row gives its own.
  const double run_started_s = std::chrono::duration<double>(run_started.time_since_epoch()).count();
  out["measured_from_s"] = run_started_s + window_start;
  out["measured_to_s"] = run_started_s + window_end;
  if (!encoded_us.empty()) {
    out["encoded_p50_us"] = sim::percentile(encoded_us, 50);
    out["encoded_p99_us"] = sim::percentile(encoded_us, 99);
  }
  out["ok"] = r.progress.requests_failed == 0 && r.progress.requests_ready == phase.items + warmup &&
              r.leaked_pool_bytes == 0 && r.checksum_mismatches == 0 && r.content_mismatches == 0 &&
              r.invariant_error.empty();
  return out;
}

const TextTable& results_table() {
  static const TextTable table({{"size", 8},
                                {"phase", 10},
                                {"series", 13},
                                {"window", 6},
                                {"transfers/s", 11},
                                {"GB/s", 7},
                                {"p50 us", 9},
                                {"p99 us", 9},
                                {"+p50 us", 9},
                                {"+p99 us", 9},
                                {"GB/s ratio", 10},
                                {"enc p50 us", 10},
                                {"lone ratio", 10},
                                {"sim cpu us", 11}});
  return table;
}

void print_row(const json& s) {
  results_table().print_row(
      std::cout,
      {byte_size_label(s.value("size_bytes", std::uint64_t{0})), s.value("phase", std::string()),
       s.value("series", std::string()), std::to_string(s.value("window", 0)), cell(s, "per_s", 0), cell(s, "gbps", 2),
       cell(s, "p50_us", 0), cell(s, "p99_us", 0), cell(s, "added_p50_us", 0), cell(s, "added_p99_us", 0),
       cell(s, "ratio_vs_transport_gbps", 2), cell(s, "encoded_p50_us", 0), cell(s, "lone_ratio_vs_transport", 2),
       s.contains("sim_us_per_item")
           ? fmt::format("{:.0f}+{:.0f}", s.value("sim_us_per_item", 0.0), s.value("producer_sim_us_per_item", 0.0))
           : std::string("-")});
}

int run_consumer_role(const E2eOptions& o) {
  auto address = split_host_port(o.listen, "--listen");
  auto phases = plan(o);
  if (!address || !phases) {
    std::cerr << "ecx bench e2e: " << (address ? phases.status() : address.status()).message() << "\n";
    return 2;
  }
  const bool human = o.role == "consumer";
  json all = json::array();
  bool ok = true;
  // Listening on loopback, the producer shares this host and its clock.
  const bool same_host = address->first.starts_with("127.") || address->first == "::1" || address->first == "[::1]" ||
                         address->first == "localhost";
  for (std::size_t k = 0; k < phases->size() && !g_stop.load(); ++k) {
    if (auto st = hold_role(o, "setup", (*phases)[k]); !st) {
      std::cerr << "ecx bench e2e consumer: " << st.message() << "\n";
      return 1;
    }
    auto result = consume_phase(o, (*phases)[k], address->first, phase_port(address->second, o.tp, k), same_host);
    if (!result) {
      std::cerr << "ecx bench e2e consumer: " << result.status().message() << "\n";
      return 1;
    }
    ok = ok && result->value("ok", false);
    std::cout << result->dump() << std::endl;
    all.push_back(std::move(*result));
  }
  if (human) {
    results_table().print_header(std::cout);
    for (const auto& s : all) print_row(s);
    if (!o.json_file.empty()) {
      if (auto st = write_json_file(o.json_file, all); !st) std::cerr << "ecx bench e2e: " << st.message() << "\n";
    }
  }
  return ok && all.size() == phases->size() ? 0 : 1;
}

// ---------------------------------------------------------------- producer role

// Phase k's consumer answers once the previous phase is over; wait for it.
Status wait_for_consumer(const std::string& address, std::chrono::seconds timeout) {
  auto client = control::ControlClient::create(control::ClientOptions{});
  if (!client) return client.status();
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  Status last;
  while (std::chrono::steady_clock::now() < give_up && !g_stop.load()) {
    // Every shard, not only the first: a consumer starts its ranks one after the
    // other (each prefaults its pool, seconds), and a producer that started when rank
    // 0 answered sent the phase's first requests to an engine still starting.
    auto topology = (*client)->discover(address, 1s);
    if (topology) return Status::ok();
    last = topology.status();
    std::this_thread::sleep_for(100ms);
  }
  return unavailable(fmt::format("no consumer answered at {}: {}", address, last.message()));
}

int run_producer_role(const E2eOptions& o) {
  auto address = split_host_port(o.connect, "--connect");
  auto phases = plan(o);
  if (!address || !phases) {
    std::cerr << "ecx bench e2e: " << (address ? phases.status() : address.status()).message() << "\n";
    return 2;
  }
  bool ok = true;
  for (std::size_t k = 0; k < phases->size() && !g_stop.load(); ++k) {
    const auto& phase = (*phases)[k];
    const int port = phase_port(address->second, o.tp, k);
    // (A producer binds nothing: its ec_ip and ec_port are unused.)
    auto config = e2e_config(o, Role::producer, "127.0.0.1", port + 1);
    if (!config) {
      std::cerr << "ecx bench e2e: " << config.status().message() << "\n";
      return 2;
    }
    const std::string control = tcp_address(address->first, port + 1);
    if (auto st = hold_role(o, "setup", phase); !st) {
      std::cerr << "ecx bench e2e producer: " << st.message() << "\n";
      return 1;
    }
    if (auto st = wait_for_consumer(control, std::chrono::seconds(static_cast<int>(o.phase_timeout_s))); !st) {
      std::cerr << "ecx bench e2e producer: " << st.message() << "\n";
      return 1;
    }
    sim::ProducerSimOptions options;
    options.config = *config;
    options.consumer_address = control;
    options.admit_connect = tcp_address(address->first, port);
    options.max_active_pushes = phase.window;
    // The latency phase sends one item at a time end to end: the next starts when the
    // consumer reports the previous one ready (not when its send completed).
    if (phase.window == 1) options.max_unresolved = 1;
    options.deadline = seconds_to_duration(o.phase_timeout_s);
    options.warm_up_requests = warmup_items(phase.items, phase.window);
    options.workload.requests = static_cast<int>(phase.items + options.warm_up_requests);
    auto stages_before = stages::snapshot();
    options.on_warmed_up = [&stages_before] { stages_before = stages::snapshot(); };
    options.workload.min_images = 1;
    options.workload.max_images = 1;
    options.workload.repeat_fraction = 0;
    options.workload.fixed_bytes = phase.size;
    options.workload.id_prefix = fmt::format("e2e{}-{}", k, ::getpid());
    if (o.hold) options.before_first_request = [&o, &phase] { return hold_role(o, "start", phase); };
    auto r = sim::run_producer(options, &g_stop);
    if (!r) {
      std::cerr << "ecx bench e2e producer: " << r.status().message() << "\n";
      return 1;
    }
    ok = ok && r->failed_saves == 0;
    std::cout << json{{"event", "produced"},
                      {"phase", phase.name},
                      {"size_bytes", phase.size},
                      {"items", r->items},
                      {"failed_saves", r->failed_saves},
                      {"retry_afters", r->retry_afters},
                      {"max_in_flight", r->max_in_flight},
                      {"sim_us_per_item", us_per_item(r->sim_ns, r->window_items)},
                      {"cpu_us_per_item", cpu_per_item(r->thread_cpu_ns, r->window_items)},
                      {"cpu_items", r->window_items},
                      {"sleeps_per_item", sleeps_per_item(r->thread_sleeps, r->window_items)},
                      {"wall_s", r->wall_s},
                      {"stages", stage_report(stages_before, kProducerStages)}}
                     .dump()
              << std::endl;
  }
  return ok ? 0 : 1;
}

// ---------------------------------------------------------------- both, and the baseline

// The pause between the raw plane's lone messages (latency phase): about the idle time
// between two of the engine's lone items (the hand-back to the next request).
constexpr std::uint32_t kLoneGapUs = 1000;

// The raw plane's run of one phase: `ecx bench transport`, ECX series only. It sets up
// and warms up, says "holding", and sends its measured messages on the go
// (bench_command.h).
class RawRun {
 public:
  static Result<RawRun> start(const E2eOptions& o, const Phase& phase) {
    RawRun run;
    run.file_ = std::filesystem::temp_directory_path() /
                fmt::format("ecx-e2e-transport-{}-{}-{}.json", ::getpid(), phase.size, phase.window);
    const std::uint64_t count = std::max<std::uint64_t>(phase.items, 20);
    run.size_ = phase.size;
    run.phase_ = phase.name;
    run.window_ = std::min(phase.window, 64);
    // Each item lands in a slot of the consumer's pool not touched since, and is sent
    // from a fresh staging slot: the raw data plane moves its bytes the same way (a ring
    // as large as the pool), not from and into one cache-warm window of slots.
    auto pool = parse_byte_size(o.pool_size);
    if (!pool) return pool.status();
    run.spread_ = std::max<std::uint64_t>(*pool, phase.size * static_cast<std::uint64_t>(run.window_) * 4);
    // A lone item starts on an idle plane: the engine's next request comes only after the
    // previous item was ready, so both progress threads have gone to sleep and the
    // sockets are quiet. Back to back, the raw plane's receiver would still be polling
    // from the message before (measured: a lone 9 MiB message's delivery p50 2.67 ms
    // back to back, 2.84-2.98 ms 1 ms apart).
    run.gap_us_ = run.window_ == 1 ? kLoneGapUs : 0;
    auto child = sim::ChildProcess::spawn({sim::self_executable(),
                                           "bench",
                                           "transport",
                                           "--transport",
                                           std::string(data_link_name(o.transport)),
                                           "--size",
                                           std::to_string(phase.size),
                                           "--window",
                                           std::to_string(run.window_),
                                           "--count",
                                           std::to_string(count),
                                           "--repeat",
                                           "1",
                                           "--no-perftest",
                                           "--spread",
                                           std::to_string(run.spread_),
                                           "--gap",
                                           std::to_string(run.gap_us_),
                                           "--hold",
                                           "--json",
                                           run.file_.string()});
    if (!child) return child.status();
    run.child_.emplace(std::move(*child));
    return run;
  }
  RawRun(RawRun&&) noexcept = default;
  RawRun& operator=(RawRun&&) noexcept = default;
  RawRun(const RawRun&) = delete;
  RawRun& operator=(const RawRun&) = delete;
  ~RawRun() {
    std::error_code error;
    if (!file_.empty()) std::filesystem::remove(file_, error);
  }

  // Reads what it printed, waiting at most `timeout`: whether it is holding.
  bool holding(std::chrono::milliseconds timeout) {
    if (auto line = child_->read_line(timeout); line && *line == "holding") holding_ = true;
    return holding_;
  }
  // It ended (output closed) before saying it holds: finish() says why.
  bool gone() const { return child_->eof(); }
  void go() const { child_->signal(kGoSignal); }

  // Waits for it to end (at most `limit`) and reads its series.
  Result<json> finish(std::chrono::milliseconds limit) {
    const auto give_up = std::chrono::steady_clock::now() + limit;
    while (!child_->eof() && std::chrono::steady_clock::now() < give_up) {
      (void)child_->read_line(std::chrono::milliseconds(200));
    }
    const auto exit = child_->wait(std::chrono::seconds(10));
    std::ifstream in(file_);
    json list = json::parse(in, nullptr, false);
    if (exit.value_or(-1) != 0 || !list.is_array()) {
      return unavailable(fmt::format("ecx bench transport failed (exit {})", exit.value_or(-1)));
    }
    for (const auto& s : list) {
      if (s.value("series", "") == "ecx") return row(s);
    }
    return unavailable("ecx bench transport printed no ecx series");
  }

 private:
  RawRun() = default;

  json row(const json& s) const {
    json out{{"series", "transport_raw"},
             {"phase", phase_},
             {"size_bytes", size_},
             {"window", window_},
             {"spread_bytes", spread_},
             {"gap_us", gap_us_},
             {"per_s", s.value("gbps", 0.0) * 1e9 / static_cast<double>(size_)},
             {"gbps", s.value("gbps", 0.0)}};
    // The raw latency is the delivery (send -> landed, stamped by the receiver): an
    // eager send completes at the sender before its bytes arrive, so its completion
    // would be a floor no receiver could reach. The completion stays in the JSON.
    if (s.contains("delivery_p50_us")) out["p50_us"] = s["delivery_p50_us"];
    if (s.contains("delivery_p99_us")) out["p99_us"] = s["delivery_p99_us"];
    if (s.contains("cpu_us_per_message")) out["cpu_us_per_item"] = s["cpu_us_per_message"];
    if (s.contains("busiest_thread_us_per_message")) {
      out["busiest_thread_us_per_item"] = s["busiest_thread_us_per_message"];
      out["busiest_thread"] = s.value("busiest_thread", std::string());
    }
    for (const char* key :
         {"sleeps_per_message", "receiver_progress_sleeps_per_message", "sender_progress_sleeps_per_message"}) {
      if (s.contains(key)) out[key] = s[key];
    }
    if (s.contains("p50_us")) out["completion_p50_us"] = s["p50_us"];
    if (s.contains("p99_us")) out["completion_p99_us"] = s["p99_us"];
    for (const char* key : {"measured_from_s", "measured_to_s"}) {
      if (s.contains(key)) out[key] = s[key];
    }
    return out;
  }

  std::optional<sim::ChildProcess> child_;
  std::filesystem::path file_;
  std::string phase_;
  std::uint64_t size_ = 0;
  int window_ = 1;
  std::uint64_t spread_ = 0;
  std::uint32_t gap_us_ = 0;
  bool holding_ = false;
};

// What the two role processes printed so far: the consumer's phase results, the
// producer's reports, and how far each has come in holding for the go.
struct RoleLines {
  std::vector<json> results;        // the consumer's row of each phase, in order
  std::vector<json> produced;       // the producer's report of each phase, in order
  std::size_t consumer_setups = 0;  // phases whose set-up the consumer holds for (or held for)
  std::size_t producer_setups = 0;
  std::size_t producer_starts = 0;  // phases whose first request the producer holds for (or held for)

  // Reads the consumer's next line (waiting at most `wait`; the producer's, once the
  // consumer's output has closed) and whatever else the producer printed.
  void pump(sim::ChildProcess& consumer, sim::ChildProcess& producer, std::chrono::milliseconds wait) {
    if (!consumer.eof()) {
      if (auto line = consumer.read_line(wait)) take(*line, true);
    } else if (auto line = producer.read_line(wait)) {
      take(*line, false);
    }
    while (auto line = producer.read_line(std::chrono::milliseconds(0))) take(*line, false);
  }

 private:
  void take(const std::string& line, bool from_consumer) {
    auto doc = json::parse(line, nullptr, false);
    if (doc.is_discarded() || !doc.is_object()) return;
    const std::string event = doc.value("event", "");
    if (event == "holding") {
      const bool setup = doc.value("stage", "") == "setup";
      ++(from_consumer ? consumer_setups : setup ? producer_setups : producer_starts);
    } else if (from_consumer && event == "phase") {
      std::cerr << fmt::format("  {} {}: {:.0f} transfers/s, time to ready p50 {:.0f} us\n",
                               byte_size_label(doc.value("size_bytes", std::uint64_t{0})),
                               doc.value("phase", std::string()), doc.value("per_s", 0.0), doc.value("p50_us", 0.0));
      results.push_back(std::move(doc));
    } else if (!from_consumer && event == "produced") {
      produced.push_back(std::move(doc));
    }
  }
};

// One round: both role processes through every phase and the raw plane's baseline of
// each phase, the raw plane first when `raw_first` (rounds alternate).
//
// Phase by phase, the two sides are measured back to back: this host's copy speed
// changes from one few seconds to the next (the raw plane alone read 1.8-5.2 GB/s at
// 9 MiB within a minute), and two measurements that began seconds apart (a process's
// set-up and prefault take seconds) met different hosts: one round's ratio read
// 0.3 where the other side met the fast host and 2.5 where it met the slow one. So
// every process sets up and warms up first, holds, and is measured on the go, the
// second side the moment the first has ended and torn down. Nothing else runs while
// either is measured: ECX's processes hold before setting up their next phase, and a
// raw plane that measures after ECX's last phase waits for ECX's processes to end.
struct Round {
  std::vector<json> phases;  // the ECX rows, in phase order
  std::vector<json> raws;    // the raw plane's row of each phase (null: not measured)
  bool ok = false;
};

Result<Round> run_round(const E2eOptions& o, const std::vector<Phase>& phases, bool raw_first) {
  Round round;
  const int port = sim::free_port_block(static_cast<int>(phases.size()) * (o.tp + 1));
  if (port == 0) return unavailable("no free block of ports on 127.0.0.1");
  auto role_args = [&](const std::string& role, const std::string& flag) {
    std::vector<std::string> argv = {sim::self_executable(),
                                     "bench",
                                     "e2e",
                                     "--role",
                                     role,
                                     flag,
                                     fmt::format("127.0.0.1:{}", port),
                                     "--transport",
                                     std::string(data_link_name(o.transport)),
                                     "--sizes",
                                     o.sizes_text,
                                     "--window",
                                     std::to_string(o.window),
                                     "--tp",
                                     std::to_string(o.tp),
                                     "--pool-size",
                                     o.pool_size,
                                     "--phase-timeout",
                                     fmt::format("{}", o.phase_timeout_s),
                                     o.checksum ? "--checksum" : "--no-checksum"};
    if (o.count) argv.insert(argv.end(), {"--count", std::to_string(o.count)});
    if (o.latency_count) argv.insert(argv.end(), {"--latency-count", std::to_string(o.latency_count)});
    if (!o.extra.empty()) argv.insert(argv.end(), {"--extra", o.extra});
    // Without the raw plane there is nothing to pair: the roles run straight through.
    if (o.baseline) argv.emplace_back("--hold");
    return argv;
  };
  const std::vector<std::string> env = {"UCX_TLS=" + std::string(ucx_tls(o.transport))};
  auto consumer = sim::ChildProcess::spawn(role_args("consumer", "--listen"), env);
  if (!consumer) return consumer.status();
  auto producer = sim::ChildProcess::spawn(role_args("producer", "--connect"), env);
  if (!producer) return producer.status();
  RoleLines lines;
  const auto phase_limit = seconds_to_duration(o.phase_timeout_s);
  const auto deadline = std::chrono::steady_clock::now() +
                        seconds_to_duration(o.phase_timeout_s * 2 * static_cast<double>(phases.size()) + 60);
  // Pumps the roles' lines until `done` holds; false when a role ended first or the
  // round ran out of time.
  auto wait_until = [&](auto&& done) {
    while (!done()) {
      if ((consumer->eof() && producer->eof()) || std::chrono::steady_clock::now() >= deadline) return false;
      if (g_stop.load()) {
        consumer->signal(SIGINT);
        producer->signal(SIGINT);
      }
      lines.pump(*consumer, *producer, std::chrono::milliseconds(20));
    }
    return true;
  };
  auto fail = [&](std::string_view what) {
    // A role still holding for its go would wait out its hold: stop both first.
    consumer->signal(SIGTERM);
    producer->signal(SIGTERM);
    return internal_error(fmt::format(
        "{} ({} of {} phases finished; consumer exit {}, producer exit {})", what, lines.results.size(), phases.size(),
        consumer->wait(std::chrono::seconds(10)).value_or(-1), producer->wait(std::chrono::seconds(10)).value_or(-1)));
  };
  for (std::size_t k = 0; k < phases.size() && !g_stop.load(); ++k) {
    std::optional<RawRun> raw;
    if (o.baseline) {
      // Both roles hold before setting phase k up; the raw plane sets up beside them.
      if (!wait_until([&] { return lines.consumer_setups > k && lines.producer_setups > k; })) {
        return fail("the roles did not reach the set-up of a phase");
      }
      if (auto started = RawRun::start(o, phases[k])) {
        raw.emplace(std::move(*started));
      } else {
        std::cerr << "ecx bench e2e: baseline: " << started.status().message() << "\n";
      }
      consumer->signal(kGoSignal);
      producer->signal(kGoSignal);
      // Both set up and warmed up: ECX's producer holds before its first request.
      if (!wait_until([&] {
            if (raw && !raw->holding(std::chrono::milliseconds(0)) && !raw->gone()) return false;
            return lines.producer_starts > k;
          })) {
        return fail("ECX did not reach its phase's first request");
      }
    }
    auto measure_ecx = [&] {
      if (o.baseline) producer->signal(kGoSignal);
      return wait_until([&] { return lines.results.size() > k && lines.produced.size() > k; });
    };
    auto measure_raw = [&] {
      if (!raw) {
        round.raws.emplace_back();
        return;
      }
      raw->go();
      auto measured = raw->finish(std::chrono::duration_cast<std::chrono::milliseconds>(phase_limit));
      if (!measured) std::cerr << "ecx bench e2e: baseline: " << measured.status().message() << "\n";
      round.raws.push_back(measured ? std::move(*measured) : json());
    };
    // Everything of the phase is set up and idle; let the host settle first (--settle).
    if (o.baseline && o.settle_s > 0) std::this_thread::sleep_for(seconds_to_duration(o.settle_s));
    if (raw_first) measure_raw();
    if (!measure_ecx()) return fail("a phase did not finish");
    if (!raw_first) {
      // Before the raw plane measures, ECX's processes are quiet: holding before the
      // next phase's set-up, or ended.
      const bool last = k + 1 == phases.size();
      if (raw && last) {
        (void)wait_until([&] { return !consumer->running() && !producer->running(); });
      } else if (raw && !wait_until([&] { return lines.consumer_setups > k + 1 && lines.producer_setups > k + 1; })) {
        return fail("the roles did not reach the set-up of the next phase");
      }
      measure_raw();
    }
  }
  // Read the producer's output to its end, so that nothing it prints on its way out
  // blocks it (every report it gives was taken above).
  while (producer->read_line(std::chrono::milliseconds(200))) {
  }
  const auto consumer_exit = consumer->wait(std::chrono::seconds(30));
  const auto producer_exit = producer->wait(std::chrono::seconds(30));
  std::vector<json>& results = lines.results;
  const std::vector<json>& produced = lines.produced;
  if (results.size() != phases.size()) {
    return internal_error(fmt::format("{} of {} phases finished (consumer exit {}, producer exit {})", results.size(),
                                      phases.size(), consumer_exit.value_or(-1), producer_exit.value_or(-1)));
  }
  round.ok = consumer_exit.value_or(-1) == 0 && producer_exit.value_or(-1) == 0;
  results_table().print_header(std::cout);
  for (std::size_t k = 0; k < phases.size(); ++k) {
    auto& e2e = results[k];
    round.ok = round.ok && e2e.value("ok", false);
    e2e.erase("event");
    if (k < produced.size()) {
      e2e["retry_afters"] = produced[k].value("retry_afters", std::uint64_t{0});
      e2e["max_in_flight"] = produced[k].value("max_in_flight", std::uint64_t{0});
      e2e["producer_sim_us_per_item"] = produced[k].value("sim_us_per_item", 0.0);
      if (produced[k].contains("cpu_us_per_item")) e2e["producer_cpu_us_per_item"] = produced[k]["cpu_us_per_item"];
      if (produced[k].contains("sleeps_per_item")) e2e["producer_sleeps_per_item"] = produced[k]["sleeps_per_item"];
      e2e["producer_cpu_items"] = produced[k].value("cpu_items", std::uint64_t{0});
      if (produced[k].contains("stages")) e2e["stages"].update(produced[k]["stages"]);
    }
    if (const auto busiest = busiest_ecx_thread(e2e)) {
      e2e["busiest_thread"] = busiest->first;
      e2e["busiest_thread_us_per_item"] = busiest->second;
    }
    const json* raw = round.raws[k].is_null() ? nullptr : &round.raws[k];
    if (o.baseline && raw == nullptr) round.ok = false;
    if (raw) {
      // One item at a time both sides pause between items (the hand-back, the raw
      // plane's gap), so their GB/s say little: the lone ratio below compares them.
      if (phases[k].window != 1) {
        e2e["ratio_vs_transport_gbps"] = e2e.value("gbps", 0.0) / std::max(raw->value("gbps", 0.0), 1e-12);
        // With a CPU per thread each plane would run at its busiest thread's pace: the
        // ratio of those rates (a projection; docs/operations.md, "Where the CPU goes").
        const double ecx_busiest = e2e.value("busiest_thread_us_per_item", 0.0);
        const double raw_busiest = raw->value("busiest_thread_us_per_item", 0.0);
        if (ecx_busiest > 0 && raw_busiest > 0) e2e["busiest_thread_ratio_vs_transport"] = raw_busiest / ecx_busiest;
      }
      if (raw->contains("p50_us")) {
        e2e["added_p50_us"] = e2e.value("p50_us", 0.0) - raw->value("p50_us", 0.0);
        e2e["added_p99_us"] = e2e.value("p99_us", 0.0) - raw->value("p99_us", 0.0);
        // One item at a time: its GB/s from the encoder's hand-over to ready, against
        // the raw plane's size over its delivery.
        if (phases[k].window == 1 && e2e.value("encoded_p50_us", 0.0) > 0) {
          e2e["lone_ratio_vs_transport"] = raw->value("p50_us", 0.0) / e2e.value("encoded_p50_us", 0.0);
        }
      }
    }
    print_row(e2e);
    round.phases.push_back(e2e);
    if (raw) print_row(*raw);
  }
  return round;
}

// The rounds' spread, phase by phase: medians, and each ratio's range.
void print_round_summary(const std::vector<Phase>& phases, const std::vector<Round>& rounds) {
  const TextTable table({{"size", 8},
                         {"phase", 10},
                         {"rounds", 6},
                         {"ecx /s", 9},
                         {"ecx", 12},
                         {"raw", 12},
                         {"unit", 12},
                         {"ratio p50", 9},
                         {"ratio min", 9},
                         {"ratio max", 9},
                         {"+p50 us p50", 11}});
  std::cout << fmt::format(
      "\nover {} rounds (ECX's phases first in odd rounds, the raw plane's in even ones; medians; throughput: "
      "transfers/s, GB/s and the "
      "GB/s ratio; latency: enc p50 against the raw delivery p50, the lone ratio, and time to ready over the raw "
      "delivery p50):\n",
      rounds.size());
  table.print_header(std::cout);
  std::string projections;
  for (std::size_t k = 0; k < phases.size(); ++k) {
    const bool lone = phases[k].window == 1;
    const char* ratio_key = lone ? "lone_ratio_vs_transport" : "ratio_vs_transport_gbps";
    const char* value_key = lone ? "encoded_p50_us" : "gbps";
    const char* raw_key = lone ? "p50_us" : "gbps";
    std::vector<double> per_s, ecx, raw, ratio, added, projected;
    for (const auto& round : rounds) {
      if (k >= round.phases.size()) continue;
      const auto& e2e = round.phases[k];
      per_s.push_back(e2e.value("per_s", 0.0));
      if (e2e.contains("busiest_thread_ratio_vs_transport")) {
        projected.push_back(e2e.value("busiest_thread_ratio_vs_transport", 0.0));
      }
      if (e2e.contains(value_key)) ecx.push_back(e2e.value(value_key, 0.0));
      if (e2e.contains(ratio_key)) ratio.push_back(e2e.value(ratio_key, 0.0));
      if (e2e.contains("added_p50_us")) added.push_back(e2e.value("added_p50_us", 0.0));
      if (round.raws[k].contains(raw_key)) raw.push_back(round.raws[k].value(raw_key, 0.0));
    }
    auto median = [](const std::vector<double>& v, int decimals) {
      return v.empty() ? std::string("-") : fmt::format("{:.{}f}", sim::percentile(v, 50), decimals);
    };
    const auto [lo, hi] = std::minmax_element(ratio.begin(), ratio.end());
    table.print_row(std::cout,
                    {byte_size_label(phases[k].size), phases[k].name, std::to_string(rounds.size()),
                     lone ? std::string("-") : median(per_s, 0), median(ecx, lone ? 0 : 2), median(raw, lone ? 0 : 2),
                     lone ? "us" : "GB/s", median(ratio, 2), ratio.empty() ? "-" : fmt::format("{:.2f}", *lo),
                     ratio.empty() ? "-" : fmt::format("{:.2f}", *hi), lone ? median(added, 0) : std::string("-")});
    // The projection for a host with a CPU per thread, where the raw plane was measured:
    // under the table, so that its columns stay the measured figures.
    if (!projected.empty()) {
      const auto [p_lo, p_hi] = std::minmax_element(projected.begin(), projected.end());
      projections += fmt::format(
          "{} {}: with a CPU per thread (a projection: each plane at its busiest thread's rate), ECX over the raw "
          "plane {} (median; {:.2f}-{:.2f})\n",
          byte_size_label(phases[k].size), phases[k].name, median(projected, 2), *p_lo, *p_hi);
    }
  }
  std::cout << projections;
}

int run_all(const E2eOptions& o) {
  auto phases = plan(o);
  if (!phases) {
    std::cerr << "ecx bench e2e: " << phases.status().message() << "\n";
    return 2;
  }
  // A bad --extra is reported here, once, not by each role process.
  auto config = e2e_config(o, Role::consumer, "127.0.0.1", 1);
  if (!config) {
    std::cerr << "ecx bench e2e: " << config.status().message() << "\n";
    return 2;
  }
  std::string load = "?";
  if (std::ifstream loadavg("/proc/loadavg"); loadavg) loadavg >> load;
  // Every process inherits it, and it moves the 64 KiB figures (docs/operations.md):
  // a reader comparing runs needs to know it was set.
  const char* tunables = std::getenv("GLIBC_TUNABLES");  // NOLINT(concurrency-mt-unsafe): nothing sets the environment
  std::cout << fmt::format(
      "ecx bench e2e: consumer (TP={}) and producer processes on 127.0.0.1 over UCX {}, checksums {}, loads {}, "
      "outputs {}, sizes {}; load average {} on {} CPUs{}\n",
      o.tp, data_link_name(o.transport), o.checksum ? "on" : "off",
      config->zero_copy_loads ? "as views of the landed slots" : "copied",
      config->zero_copy_saves ? "sent from the encoder's memory" : "staged", o.sizes_text, load,
      std::thread::hardware_concurrency(),
      tunables != nullptr && *tunables != '\0' ? fmt::format("; every process with GLIBC_TUNABLES={}", tunables)
                                               : std::string());
  std::vector<Round> rounds;
  json series = json::array();
  bool ok = true;
  for (int r = 0; r < o.rounds && !g_stop.load(); ++r) {
    const bool raw_first = r % 2 == 1;
    if (o.rounds > 1) {
      std::cout << fmt::format("round {} of {} ({} first):\n", r + 1, o.rounds, raw_first ? "the raw plane" : "ECX");
    }
    auto round = run_round(o, *phases, raw_first);
    if (!round) {
      std::cerr << "ecx bench e2e: " << round.status().message() << "\n";
      return 1;
    }
    ok = ok && round->ok;
    // Each phase's ECX row, then its raw row.
    for (std::size_t k = 0; k < round->phases.size(); ++k) {
      for (json row : {round->phases[k], round->raws[k]}) {
        if (row.is_null()) continue;
        if (o.rounds > 1) {
          row["round"] = r + 1;
          row["raw_first"] = raw_first;
        }
        series.push_back(std::move(row));
      }
    }
    rounds.push_back(std::move(*round));
  }
  std::cout
      << "ecx_e2e p50/p99: time to ready (the consumer receives the request -> the engine finds its item "
         "loaded); transport_raw p50/p99: send to landed at the receiver of one message (ECX's UCX data plane alone, "
         "its "
         "messages spread over a ring as large as the pool, as ECX's landings are; in the latency phase each sent "
         "1 ms after the previous one landed, on an idle plane, as the engine's lone items are); +p50/+p99: the "
         "difference; GB/s "
         "ratio: ecx_e2e divided by transport_raw (throughput phase only: in the latency phase ECX's transfers/s "
         "also count the bench's own hand-back between items, the consumer telling the producer, and the raw plane's "
         "its 1 ms gap); enc p50: "
         "the encoder hands its last output to ECX -> the engine finds it loaded (the producer's stamp, same host); "
         "lone ratio: a lone item's GB/s by that p50 over the raw plane's by its delivery p50; sim us: the simulator's "
         "own CPU time per item, consumer engine "
         "threads (encoder-cache allocation, content check after the ready stamp: every block's stamp, every "
         "byte of 1 item in 16; the admit channel's messages and the waits for them) + producer (stamping the "
         "content, admit messages, waits for the consumer's answers), no part of ECX, sampled (the CPU clock read "
         "around a random 1 in 8 of those regions, each counted 8 times less the clock's own cost; every wait "
         "read)\n";
  if (!rounds.empty()) {
    print_stage_table(rounds.back().phases);
    print_cpu_table(rounds.back().phases, rounds.back().raws);
  }
  if (rounds.size() > 1 && o.baseline) print_round_summary(*phases, rounds);
  if (!ok) std::cout << "FAILED: a phase lost items, leaked pool bytes, mismatched or a process failed\n";
  if (!o.json_file.empty()) {
    if (auto st = write_json_file(o.json_file, series); !st) {
      std::cerr << "ecx bench e2e: " << st.message() << "\n";
      return 1;
    }
  }
  return ok ? 0 : 1;
}

void add_bench_e2e_command(CLI::App& app, Runner& run) {
  auto* cmd = bench_subcommand(app)->add_subcommand(
      "e2e", "Consumer and producer processes end to end: transfers/s, time to ready, added latency over raw UCX");
  auto o = std::make_shared<E2eOptions>();
  cmd->add_option("--role", o->role, "all (both on 127.0.0.1), consumer (--listen) or producer (--connect)")
      ->capture_default_str()
      ->check(CLI::IsMember({"all", "consumer", "producer"}));
  cmd->add_option("--listen", o->listen, "consumer: HOST:PORT to listen on (admit channel; control ports follow)");
  cmd->add_option("--connect", o->connect, "producer: the consumer's HOST:PORT");
  cmd->add_option("--sizes", o->sizes_text, "comma-separated item sizes")->capture_default_str();
  cmd->add_option("--count", o->count,
                  "items measured per throughput phase, after a warm-up of max(2 x window, count / 10) (0: automatic)")
      ->capture_default_str();
  cmd->add_option("--latency-count", o->latency_count,
                  "items measured per latency phase, after a warm-up of max(2, count / 10) (0: automatic)")
      ->capture_default_str();
  cmd->add_option("--window", o->window, "pushes in flight in the throughput phase")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--tp", o->tp, "consumer tensor-parallel size")->capture_default_str()->check(CLI::Range(1, 16));
  add_data_link_option(cmd, o->transport,
                       "UCX transport: with --role all it sets UCX_TLS (tcp or shm); with --role consumer or producer "
                       "UCX_TLS comes from the environment and shm turns ucx_peer_errors off",
                       /*ucx_only=*/true);
  cmd->add_option("--pool-size", o->pool_size, "each pool's size (consumer shard, producer staging)")
      ->capture_default_str();
  cmd->add_flag("--checksum,!--no-checksum", o->checksum, "verify xxHash64 checksums on landing")
      ->capture_default_str();
  cmd->add_flag("--baseline,!--no-baseline", o->baseline, "measure the raw transport in the same run (role all)")
      ->capture_default_str();
  cmd->add_option("--phase-timeout", o->phase_timeout_s, "seconds each phase may take")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 86400.0));
  cmd->add_option("--rounds", o->rounds,
                  "role all: run everything this many times, ECX first in odd rounds and the raw plane in even ones "
                  "(what runs first meets memory the host has not touched yet), and summarise the "
                  "rounds (medians, each ratio's range): on a shared machine one round's ratio moves with the load")
      ->capture_default_str()
      ->check(CLI::Range(1, 20));
  cmd->add_option("--settle", o->settle_s,
                  "role all, with the raw plane: seconds every process of a phase sits set up and idle before the "
                  "first of the phase's two measurements (ECX's, the raw plane's); the set-ups touch gigabytes of new "
                  "memory, and on a VM the side measured right after them can meet a slower host")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 600.0));
  cmd->add_option("--json", o->json_file, "write the series as a JSON list to FILE");
  cmd->add_option("--extra", o->extra,
                  "JSON object merged into both roles' ec_connector_extra_config, e.g. '{\"ucx_rndv_thresh\": 262144}' "
                  "(the transport_raw baseline keeps its defaults)");
  cmd->add_flag("--hold", o->hold,
                "consumer and producer: hold for SIGUSR1 before each phase's set-up, and the producer also before its "
                "first request (internal)")
      ->group("");
  cmd->callback([&run, o] {
    run = [o] {
      if (o->hold) block_go_signal();  // before any thread starts
      std::signal(SIGINT, on_signal);
      std::signal(SIGTERM, on_signal);
      log::set_level(spdlog::level::warn);
      if (o->role == "consumer") {
        if (o->listen.empty()) {
          std::cerr << "ecx bench e2e: --role consumer needs --listen HOST:PORT\n";
          return 2;
        }
        return run_consumer_role(*o);
      }
      if (o->role == "producer") {
        if (o->connect.empty()) {
          std::cerr << "ecx bench e2e: --role producer needs --connect HOST:PORT\n";
          return 2;
        }
        return run_producer_role(*o);
      }
      return run_all(*o);
    };
  });
}

}  // namespace

ECX_REGISTER_COMMAND(add_bench_e2e_command);

}  // namespace ecx::cli
