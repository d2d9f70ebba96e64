// `ecx bench transport` as a user runs it: its ECX series between two real processes
// over UCX on loopback, with and without --spread, with --gap, held for the go
// (--hold), at the rendezvous threshold asked for (--rndv-thresh), and the refusals of
// a threshold that is no size and of a spread too small for the window (each message
// names the option).
#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "sim/process.h"

namespace ecx::sim {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

std::string ecx_binary() { return std::string(ECX_BINARY_DIR) + "/bin/ecx"; }

struct BenchRun {
  int exit_code = -1;
  std::string output;
  json series;
};

// `on_line` sees each line the bench prints, as it prints it.
BenchRun bench_transport(const std::string& tag, const std::vector<std::string>& extra,
                         const std::function<void(const std::string& line, ChildProcess& bench)>& on_line = {}) {
  const auto file = (std::filesystem::temp_directory_path() / ("ecx-bench-transport-" + tag + ".json")).string();
  std::filesystem::remove(file);
  // Through sh, so that what the bench says on stderr is read too.
  std::vector<std::string> argv = {"/bin/sh",     "-c",       "exec \"$0\" \"$@\" 2>&1",
                                   ecx_binary(),  "bench",    "transport",
                                   "--transport", "tcp",      "--sizes",
                                   "64KiB",       "--window", "2",
                                   "--count",     "40",       "--repeat",
                                   "1",           "--json",   file};
  // The ucx_perftest baselines only where a test asks for them (--perftest).
  if (std::find(extra.begin(), extra.end(), "--perftest") == extra.end()) argv.emplace_back("--no-perftest");
  argv.insert(argv.end(), extra.begin(), extra.end());
  BenchRun run;
  auto child = ChildProcess::spawn(argv);
  EXPECT_TRUE(child) << child.status().to_string();
  if (!child) return run;
  while (!child->eof()) {
    if (auto line = child->read_line(200ms)) {
      run.output += *line + "\n";
      if (on_line) on_line(*line, *child);
    }
  }
  run.exit_code = child->wait(60s).value_or(-1);
  std::ifstream in(file);
  if (in) run.series = json::parse(in, nullptr, false);
  std::filesystem::remove(file);
  return run;
}

double ecx_figure(const BenchRun& run, const char* key) {
  if (!run.series.is_array()) return 0;
  for (const auto& s : run.series) {
    if (s.value("series", "") == "ecx") return s.value(key, 0.0);
  }
  return 0;
}
double ecx_gbps(const BenchRun& run) { return ecx_figure(run, "gbps"); }

const json* find_series(const BenchRun& run, const std::string& name) {
  if (!run.series.is_array()) return nullptr;
  for (const auto& s : run.series) {
    if (s.value("series", "") == name) return &s;
  }
  return nullptr;
}

// The bench fails (exit 1) when the consumer did not land every message, so exit 0
// and a rate mean every payload of the run arrived, cache-warm or spread.
TEST(BenchTransport, MovesEveryMessageWithAndWithoutSpread) {
  const BenchRun warm = bench_transport("warm", {});
  EXPECT_EQ(warm.exit_code, 0) << warm.output;
  EXPECT_GT(ecx_gbps(warm), 0.0) << warm.output;
  // Both processes' CPU per message (what `ecx bench e2e` sets ECX's cost against).
  EXPECT_GT(ecx_figure(warm, "cpu_us_per_message"), 0.0) << warm.series.dump();
  // And its busiest single thread's, which cannot exceed both processes' together.
  EXPECT_GT(ecx_figure(warm, "busiest_thread_us_per_message"), 0.0) << warm.series.dump();
  EXPECT_LE(ecx_figure(warm, "busiest_thread_us_per_message"), ecx_figure(warm, "cpu_us_per_message"))
      << warm.series.dump();
  const BenchRun spread = bench_transport("spread", {"--spread", "4MiB"});
  EXPECT_EQ(spread.exit_code, 0) << spread.output;
  EXPECT_GT(ecx_gbps(spread), 0.0) << spread.output;
  EXPECT_NE(spread.output.find("ECX spread over 4194304 bytes"), std::string::npos) << spread.output;
}

TEST(BenchTransport, AGapSpacesTheSendsAndEveryMessageStillArrives) {
  const BenchRun run = bench_transport("gap", {"--gap", "500"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_GT(ecx_gbps(run), 0.0) << run.output;
  EXPECT_NE(run.output.find("each ECX send 500 us after one completed"), std::string::npos) << run.output;
  // 500 us apart, each message finds the receiver's progress thread asleep (it spins
  // for 50 us at most): its sleeps are counted, and are part of both processes' sleeps.
  const double receiver = ecx_figure(run, "receiver_progress_sleeps_per_message");
  EXPECT_GT(receiver, 0.0) << run.series.dump();
  EXPECT_GE(ecx_figure(run, "sleeps_per_message"), receiver) << run.series.dump();
  EXPECT_GE(ecx_figure(run, "sender_progress_sleeps_per_message"), 0.0) << run.series.dump();
  const BenchRun bad = bench_transport("bad-gap", {"--gap", "-5"});
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--gap"), std::string::npos) << bad.output;
}

// Over tcp ECX's endpoints run with peer error handling, so each ucx_perftest primitive
// runs both ways: as UCX at its best, and with -e (the same mode as ECX), each with its
// own ratio for the ECX series.
TEST(BenchTransport, OverTcpThePerftestBaselineAlsoRunsInEcxsEndpointMode) {
  const BenchRun run = bench_transport("perftest", {"--perftest", "am"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const json* plain = find_series(run, "ucx_perftest_am_bw");
  const json* same_mode = find_series(run, "ucx_perftest_am_bw_peer_errors");
  ASSERT_NE(plain, nullptr) << run.series.dump();
  ASSERT_NE(same_mode, nullptr) << run.series.dump();
  const double ecx = ecx_gbps(run);
  ASSERT_GT(ecx, 0.0) << run.output;
  EXPECT_NEAR(ecx_figure(run, "ratio_vs_ucx_perftest"), ecx / plain->value("gbps", 0.0), 1e-9) << run.series.dump();
  EXPECT_NEAR(ecx_figure(run, "ratio_vs_ucx_perftest_same_mode"), ecx / same_mode->value("gbps", 0.0), 1e-9)
      << run.series.dump();
  EXPECT_NE(run.output.find("same mode"), std::string::npos) << run.output;
}

// --hold (what ecx bench e2e uses to measure its two sides back to back): after the
// warm-up the bench says "holding" and sends its measured messages only on SIGUSR1.
// Until then it has measured nothing: it is still running and has written no series.
TEST(BenchTransport, AHeldRunMeasuresOnlyOnTheGo) {
  const auto file = std::filesystem::temp_directory_path() / "ecx-bench-transport-held.json";
  int holds = 0;
  bool written_while_held = true;
  std::optional<int> exit_while_held = -1;
  const BenchRun run = bench_transport("held", {"--hold"}, [&](const std::string& line, ChildProcess& bench) {
    if (line != "holding") return;
    ++holds;
    written_while_held = std::filesystem::exists(file);
    exit_while_held = bench.wait(0ms);
    bench.signal(SIGUSR1);
  });
  EXPECT_EQ(holds, 1) << run.output;
  EXPECT_FALSE(written_while_held);
  EXPECT_EQ(exit_while_held, std::nullopt);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const json* ecx = find_series(run, "ecx");
  ASSERT_NE(ecx, nullptr) << run.series.dump();
  EXPECT_GT(ecx->value("gbps", 0.0), 0.0);
  // Its measured window, on the host's monotonic clock (ecx bench e2e orders the two
  // sides' windows by it).
  EXPECT_LT(ecx->value("measured_from_s", 0.0), ecx->value("measured_to_s", 0.0)) << ecx->dump();
}

// --rndv-thresh picks the protocol of ECX's sends: 64 KiB payloads go rendezvous from
// 16 KiB, eagerly below the default 128 KiB, and as UCX decides with 0. Every payload
// arrives in each case (the bench exits 1 otherwise), and the header says which.
TEST(BenchTransport, TheRendezvousThresholdIsTheOneAskedForAndEveryMessageArrives) {
  const BenchRun by_default = bench_transport("rndv-default", {});
  EXPECT_EQ(by_default.exit_code, 0) << by_default.output;
  EXPECT_NE(by_default.output.find("ECX's sends rendezvous from 131072 bytes"), std::string::npos) << by_default.output;
  const BenchRun rendezvous = bench_transport("rndv-16k", {"--rndv-thresh", "16KiB"});
  EXPECT_EQ(rendezvous.exit_code, 0) << rendezvous.output;
  EXPECT_GT(ecx_gbps(rendezvous), 0.0) << rendezvous.output;
  EXPECT_NE(rendezvous.output.find("ECX's sends rendezvous from 16384 bytes"), std::string::npos) << rendezvous.output;
  const BenchRun ucx_decides = bench_transport("rndv-0", {"--rndv-thresh", "0"});
  EXPECT_EQ(ucx_decides.exit_code, 0) << ucx_decides.output;
  EXPECT_NE(ucx_decides.output.find("UCX picks eager or rendezvous"), std::string::npos) << ucx_decides.output;
}

TEST(BenchTransport, ARendezvousThresholdThatIsNoSizeIsRefusedNamingIt) {
  const BenchRun run = bench_transport("rndv-bad", {"--rndv-thresh", "lots"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("--rndv-thresh"), std::string::npos) << run.output;
  EXPECT_EQ(run.series, json()) << "a refused run measures nothing";
}

TEST(BenchTransport, ASpreadTooSmallForTheWindowIsRefusedNamingIt) {
  const BenchRun run = bench_transport("small", {"--spread", "256KiB"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("--spread 256KiB must hold at least 4 windows"), std::string::npos) << run.output;
}

}  // namespace
}  // namespace ecx::sim
