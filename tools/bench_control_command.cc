// `ecx bench control`: the control plane's reserve round trip on loopback (a real
// ControlServer and ControlClient, one realistic item per reserve_batch), blocking
// and pipelined, next to a bare ZeroMQ DEALER/ROUTER echo of a frame of the same
// size measured in the same run. The loops are those of bench_control
// (tools/sim/control_loops.h).
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "commands.h"
#include "core/logging.h"
#include "sim/control_loops.h"
#include "sim/engine_sim.h"

namespace ecx::cli {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct ControlBenchOptions {
  double seconds = 2;
  int window = 64;
  int repeat = 3;
  std::string json_file;
};

struct Figures {
  double per_s = 0;
  double p50_us = 0;
  double p99_us = 0;
  std::uint64_t failures = 0;
};

// Round trips for `seconds`, each timed.
template <typename Once>
Figures blocking(double seconds, Once&& once) {
  std::vector<double> samples;
  samples.reserve(500'000);
  Figures f;
  const auto start = Clock::now();
  const auto until = start + std::chrono::duration<double>(seconds);
  for (auto now = start; now < until;) {
    f.failures += once() ? 0 : 1;
    const auto after = Clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(after - now).count());
    now = after;
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  f.per_s = static_cast<double>(samples.size()) / elapsed;
  f.p50_us = sim::percentile(samples, 50);
  f.p99_us = sim::percentile(samples, 99);
  return f;
}

// Windows of `window` requests for `seconds`; the rate only.
template <typename Window>
Figures pipelined(double seconds, int window, Window&& run_window) {
  Figures f;
  std::uint64_t requests = 0;
  const auto start = Clock::now();
  const auto until = start + std::chrono::duration<double>(seconds);
  while (Clock::now() < until) {
    f.failures += run_window(window);
    requests += static_cast<std::uint64_t>(window);
  }
  f.per_s = static_cast<double>(requests) / std::chrono::duration<double>(Clock::now() - start).count();
  return f;
}

Figures median(std::vector<Figures> runs) {
  std::sort(runs.begin(), runs.end(), [](const Figures& a, const Figures& b) { return a.per_s < b.per_s; });
  Figures m = runs[runs.size() / 2];
  for (const auto& r : runs) m.failures = std::max(m.failures, r.failures);
  return m;
}

int run_control_bench(const ControlBenchOptions& o) {
  log::set_level(spdlog::level::warn);
  auto reserve = sim::ReserveLoop::start();
  auto reserve_io_thread = sim::ReserveLoop::start(/*lanes=*/false);
  for (const auto* loop : {&reserve, &reserve_io_thread}) {
    if (!*loop) {
      std::cerr << "ecx bench control: " << loop->status().to_string() << "\n";
      return 1;
    }
  }
  sim::RawEchoLoop echo;
  std::string load = "?";
  if (std::ifstream loadavg("/proc/loadavg"); loadavg) loadavg >> load;
  std::cout << fmt::format(
      "ecx bench control: reserve_batch of one item ({} B frame) over ZeroMQ on 127.0.0.1 vs a bare DEALER/ROUTER "
      "echo; {} s per run, median of {} interleaved runs, pipelined window {}, load average {} on {} CPUs\n",
      echo.frame_bytes(), o.seconds, o.repeat, o.window, load, std::thread::hardware_concurrency());

  std::vector<Figures> echo_blocking, ecx_blocking, ecx_blocking_io_thread, echo_pipelined, ecx_pipelined;
  for (int r = 0; r < o.repeat; ++r) {
    // Interleaved, so load from anything else on the machine hits both.
    echo_blocking.push_back(blocking(o.seconds, [&] {
      echo.round_trip();
      return true;
    }));
    ecx_blocking.push_back(blocking(o.seconds, [&] { return (*reserve)->round_trip(); }));
    ecx_blocking_io_thread.push_back(blocking(o.seconds, [&] { return (*reserve_io_thread)->round_trip(); }));
    echo_pipelined.push_back(pipelined(o.seconds, o.window, [&](int w) {
      echo.pipelined(w);
      return std::size_t{0};
    }));
    ecx_pipelined.push_back(pipelined(o.seconds, o.window, [&](int w) { return (*reserve)->pipelined(w); }));
  }
  const Figures zb = median(echo_blocking), eb = median(ecx_blocking), ei = median(ecx_blocking_io_thread);
  const Figures zp = median(echo_pipelined), ep = median(ecx_pipelined);

  json series = json::array();
  series.push_back({{"series", "zmq_echo_blocking"},
                    {"size_bytes", echo.frame_bytes()},
                    {"window", 1},
                    {"per_s", zb.per_s},
                    {"p50_us", zb.p50_us},
                    {"p99_us", zb.p99_us}});
  auto blocking_series = [&](const char* name, const Figures& f) {
    series.push_back({{"series", name},
                      {"size_bytes", echo.frame_bytes()},
                      {"window", 1},
                      {"per_s", f.per_s},
                      {"p50_us", f.p50_us},
                      {"p99_us", f.p99_us},
                      {"failures", f.failures},
                      {"ratio_vs_zmq_per_s", f.per_s / zb.per_s},
                      {"ratio_vs_zmq_p50", f.p50_us / zb.p50_us},
                      {"ratio_vs_zmq_p99", f.p99_us / zb.p99_us}});
  };
  blocking_series("ecx_reserve_blocking", eb);
  // The same blocking calls handed to the client's I/O thread and back (no lane):
  // what the two thread hand-offs cost, which asynchronous callers still pay.
  blocking_series("ecx_reserve_blocking_io_thread", ei);
  series.push_back({{"series", "zmq_echo_pipelined"},
                    {"size_bytes", echo.frame_bytes()},
                    {"window", o.window},
                    {"per_s", zp.per_s}});
  series.push_back({{"series", "ecx_reserve_pipelined"},
                    {"size_bytes", echo.frame_bytes()},
                    {"window", o.window},
                    {"per_s", ep.per_s},
                    {"failures", ep.failures},
                    {"ratio_vs_zmq_per_s", ep.per_s / zp.per_s}});

  const TextTable table({{"series", 30},
                         {"window", 6},
                         {"req/s", 10},
                         {"p50 us", 8},
                         {"p99 us", 8},
                         {"rate/zmq", 8},
                         {"p50/zmq", 8},
                         {"failures", 8}});
  table.print_header(std::cout);
  for (const auto& s : series) {
    table.print_row(std::cout, {s["series"].get<std::string>(), std::to_string(s["window"].get<int>()),
                                cell(s, "per_s", 0), cell(s, "p50_us", 1), cell(s, "p99_us", 1),
                                cell(s, "ratio_vs_zmq_per_s", 2), cell(s, "ratio_vs_zmq_p50", 2),
                                s.contains("failures") ? std::to_string(s["failures"].get<std::uint64_t>()) : "-"});
  }
  std::cout << "rate/zmq: requests per second divided by the echo's (higher is better); p50/zmq: latency divided by "
               "the echo's (lower is better)\n";
  if (!o.json_file.empty()) {
    if (auto st = write_json_file(o.json_file, series); !st) {
      std::cerr << "ecx bench control: " << st.message() << "\n";
      return 1;
    }
  }
  return eb.failures + ei.failures + ep.failures == 0 ? 0 : 1;
}

void add_bench_control_command(CLI::App& app, Runner& run) {
  auto* cmd = bench_subcommand(app)->add_subcommand(
      "control", "Control plane: reserve round trip p50/p99 and requests/s vs a bare ZeroMQ echo");
  auto o = std::make_shared<ControlBenchOptions>();
  cmd->add_option("--seconds", o->seconds, "seconds per run of each series")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 600.0));
  cmd->add_option("--window", o->window, "requests in flight in the pipelined series")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--repeat", o->repeat, "interleaved runs per series; the median is reported")
      ->capture_default_str()
      ->check(CLI::Range(1, 20));
  cmd->add_option("--json", o->json_file, "write the series as a JSON list to FILE");
  cmd->callback([&run, o] { run = [o] { return run_control_bench(*o); }; });
}

}  // namespace

ECX_REGISTER_COMMAND(add_bench_control_command);

}  // namespace ecx::cli
