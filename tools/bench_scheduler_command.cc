// `ecx bench scheduler`: the scheduler's hot paths at 100, 10,000 and 100,000 live
// records, timed here on the workloads of bench_scheduler and scheduler_opcount
// (tools/sim/scheduler_fixtures.h). The figure that matters is the flatness ratio:
// per-call cost at 100,000 records divided by that at 100, from the same run.
#include <algorithm>
#include <array>
#include <chrono>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "commands.h"
#include "core/logging.h"
#include "sim/engine_sim.h"
#include "sim/scheduler_fixtures.h"

namespace ecx::cli {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace sb = scheduler::bench;

struct SchedulerBenchOptions {
  double seconds = 0.25;  // per operation and table size
  int repeat = 5;
  std::string json_file;
  std::string plot_file;
};

constexpr std::array<std::int64_t, 3> kSizes = {100, 10'000, 100'000};

// A workload: built for a table size, then one call per invocation.
using Step = std::function<void()>;
struct Operation {
  std::string name;
  std::function<std::shared_ptr<void>(std::int64_t live, Step& step)> build;
};

template <typename Loop, typename Call>
std::shared_ptr<void> hold(std::shared_ptr<Loop> loop, Step& step, Call call) {
  step = [raw = loop.get(), call] { call(*raw); };
  return loop;
}

std::vector<Operation> operations() {
  return {
      {"has_cache_item",
       [](std::int64_t live, Step& step) {
         return hold(std::make_shared<sb::HasCacheItemLoop>(live), step,
                     [](sb::HasCacheItemLoop& l) { sb::keep(l.step()); });
       }},
      {"ensure_available/1",
       [](std::int64_t live, Step& step) {
         return hold(std::make_shared<sb::EnsureLoop>(live, 1), step, [](sb::EnsureLoop& l) { sb::keep(l.step()); });
       }},
      {"ensure_available/8",
       [](std::int64_t live, Step& step) {
         return hold(std::make_shared<sb::EnsureLoop>(live, 8), step, [](sb::EnsureLoop& l) { sb::keep(l.step()); });
       }},
      {"observe_ready+cancel",
       [](std::int64_t live, Step& step) {
         return hold(std::make_shared<sb::ObserveReadyLoop>(live), step, [](sb::ObserveReadyLoop& l) { l.step(); });
       }},
      {"expire/nothing_due",
       [](std::int64_t live, Step& step) {
         return hold(std::make_shared<sb::ExpireLoop>(live), step, [](sb::ExpireLoop& l) { l.nothing_due(); });
       }},
      {"expire/one_due",
       [](std::int64_t live, Step& step) {
         return hold(std::make_shared<sb::ExpireLoop>(live), step, [](sb::ExpireLoop& l) { l.one_due(); });
       }},
  };
}

// Median nanoseconds per call over `repeat` batches of about `seconds / repeat` each.
double time_per_call_ns(const Step& step, double seconds, int repeat) {
  // Steady state first: more calls than the fixtures' tombstone bound.
  for (std::uint64_t i = 0; i < 4 * sb::kTombstoneBound; ++i) step();
  std::uint64_t batch = 1024;
  for (;;) {  // calibrate: a batch of at least a tenth of a run
    const auto start = Clock::now();
    for (std::uint64_t i = 0; i < batch; ++i) step();
    const double took = std::chrono::duration<double>(Clock::now() - start).count();
    if (took >= seconds / repeat / 10 || batch >= (1ULL << 30)) {
      batch = std::max<std::uint64_t>(
          batch, static_cast<std::uint64_t>(static_cast<double>(batch) * (seconds / repeat) / took));
      break;
    }
    batch *= 4;
  }
  std::vector<double> per_call;
  for (int r = 0; r < repeat; ++r) {
    const auto start = Clock::now();
    for (std::uint64_t i = 0; i < batch; ++i) step();
    per_call.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count() /
                       static_cast<double>(batch));
  }
  return sim::percentile(per_call, 50);
}

int run_scheduler_bench(const SchedulerBenchOptions& o) {
  // The expire workload fails a waiting record per call; its warning would time the terminal.
  log::set_level(spdlog::level::off);
  std::string load = "?";
  if (std::ifstream loadavg("/proc/loadavg"); loadavg) loadavg >> load;
  std::cout << fmt::format(
      "ecx bench scheduler: per-call cost at 100 / 10,000 / 100,000 live records ({} distinct keys touched at every "
      "size), median of {} batches, load average {} on {} CPUs\n",
      sb::kWorkingSet, o.repeat, load, std::thread::hardware_concurrency());
  const TextTable table({{"operation", 22}, {"ns @100", 9}, {"ns @10k", 9}, {"ns @100k", 9}, {"100k/100", 8}});
  table.print_header(std::cout);
  json series = json::array();
  PlotSpec plot;
  plot.png = o.plot_file;
  plot.title = "ecx bench scheduler: per-call cost against table size";
  plot.x_label = "live records";
  plot.y_label = "ns per call";
  plot.log_x = true;
  for (const auto& op : operations()) {
    std::vector<double> ns;
    PlotLine line{op.name, {}, false};
    for (const auto live : kSizes) {
      Step step;
      auto keep_alive = op.build(live, step);
      ns.push_back(time_per_call_ns(step, o.seconds, o.repeat));
      line.points.emplace_back(static_cast<double>(live), ns.back());
      json row{{"series", op.name},
               {"records", live},
               {"ns_per_call", ns.back()},
               {"per_s", 1e9 / ns.back()},
               {"ratio_vs_100_records", ns.back() / ns.front()}};
      series.push_back(std::move(row));
    }
    plot.lines.push_back(std::move(line));
    table.print_row(std::cout, {op.name, fmt::format("{:.0f}", ns[0]), fmt::format("{:.0f}", ns[1]),
                                fmt::format("{:.0f}", ns[2]), fmt::format("{:.2f}", ns[2] / ns[0])});
    std::cout << std::flush;
  }
  std::cout << "100k/100: per-call cost at 100,000 records divided by that at 100 (flat = 1; cache misses of a "
               "larger table alone typically cost up to ~2-3x)\n";
  if (!o.json_file.empty()) {
    if (auto st = write_json_file(o.json_file, series); !st) {
      std::cerr << "ecx bench scheduler: " << st.message() << "\n";
      return 1;
    }
  }
  if (!o.plot_file.empty()) {
    if (auto st = write_plot(plot); !st) {
      std::cerr << "ecx bench scheduler: " << st.message() << "\n";
      return 1;
    }
  }
  return 0;
}

void add_bench_scheduler_command(CLI::App& app, Runner& run) {
  auto* cmd = bench_subcommand(app)->add_subcommand(
      "scheduler", "Scheduler hot paths at 100 / 10k / 100k live records: per-call cost and its flatness");
  auto o = std::make_shared<SchedulerBenchOptions>();
  cmd->add_option("--seconds", o->seconds, "timed seconds per operation and table size")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 60.0));
  cmd->add_option("--repeat", o->repeat, "timed batches per figure; the median is reported")
      ->capture_default_str()
      ->check(CLI::Range(1, 50));
  cmd->add_option("--json", o->json_file, "write the series as a JSON list to FILE");
  cmd->add_option("--plot", o->plot_file, "draw ns per call against table size into FILE.png (gnuplot)");
  cmd->callback([&run, o] { run = [o] { return run_scheduler_bench(*o); }; });
}

}  // namespace

ECX_REGISTER_COMMAND(add_bench_scheduler_command);

}  // namespace ecx::cli
