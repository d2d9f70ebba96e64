// Two hosts on one machine: the test creates two network namespaces joined by a
// veth pair, runs `ecx bench e2e --role consumer --listen` in one and `--role
// producer --connect` in the other, and checks that every item of every phase was
// delivered with nothing leaked. The namespaces go away at the end of the test,
// whatever happened. Skipped where namespaces cannot be created (not root, no
// iproute2, no CAP_SYS_ADMIN in a container).
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "sim/process.h"

namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

std::string find_ip_tool() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(path, X_OK) == 0) return path;
  }
  return {};
}

struct CommandResult {
  int exit = -1;
  std::string output;
};

// Runs a short command to completion (bounded), its stdout collected.
CommandResult run(const std::vector<std::string>& argv) {
  CommandResult result;
  auto child = ecx::sim::ChildProcess::spawn(argv);
  if (!child) {
    result.output = child.status().message();
    return result;
  }
  const auto give_up = std::chrono::steady_clock::now() + 30s;
  while (!child->eof() && std::chrono::steady_clock::now() < give_up) {
    if (auto line = child->read_line(100ms)) result.output += *line + "\n";
  }
  result.exit = child->wait(5s).value_or(-1);
  return result;
}

// Two namespaces, a veth pair between them, an address on each end; all removed on
// destruction (deleting a namespace deletes the veth end inside it, and with it the pair).
class NamespacePair {
 public:
  static constexpr const char* kConsumerAddress = "10.213.77.1";
  static constexpr const char* kProducerAddress = "10.213.77.2";

  NamespacePair() : ip_(find_ip_tool()) {
    const auto id = std::to_string(::getpid());
    consumer_ns_ = "ecx-c-" + id;
    producer_ns_ = "ecx-p-" + id;
    consumer_if_ = "ecxc" + id;  // interface names: at most 15 characters
    producer_if_ = "ecxp" + id;
  }
  ~NamespacePair() {
    if (ip_.empty()) return;
    if (veth_in_root_) (void)run({ip_, "link", "del", consumer_if_});  // the pair, if it never moved
    if (consumer_created_) (void)run({ip_, "netns", "del", consumer_ns_});
    if (producer_created_) (void)run({ip_, "netns", "del", producer_ns_});
  }
  NamespacePair(const NamespacePair&) = delete;
  NamespacePair& operator=(const NamespacePair&) = delete;

  // Why the namespaces cannot be created here, or nullopt once they exist.
  std::optional<std::string> create_namespaces() {
    if (ip_.empty()) return "no `ip` tool (iproute2) found";
    auto c = run({ip_, "netns", "add", consumer_ns_});
    if (c.exit != 0) return fmt::format("`ip netns add` failed (exit {}): needs root or CAP_SYS_ADMIN", c.exit);
    consumer_created_ = true;
    auto p = run({ip_, "netns", "add", producer_ns_});
    if (p.exit != 0) return fmt::format("`ip netns add` failed (exit {})", p.exit);
    producer_created_ = true;
    return std::nullopt;
  }

  // The veth pair and addresses; an error message on failure.
  std::optional<std::string> connect() {
    const std::vector<std::vector<std::string>> steps = {
        {ip_, "link", "add", consumer_if_, "type", "veth", "peer", "name", producer_if_},
        {ip_, "link", "set", consumer_if_, "netns", consumer_ns_},
        {ip_, "link", "set", producer_if_, "netns", producer_ns_},
        {ip_, "-n", consumer_ns_, "addr", "add", std::string(kConsumerAddress) + "/24", "dev", consumer_if_},
        {ip_, "-n", producer_ns_, "addr", "add", std::string(kProducerAddress) + "/24", "dev", producer_if_},
        {ip_, "-n", consumer_ns_, "link", "set", "lo", "up"},
        {ip_, "-n", producer_ns_, "link", "set", "lo", "up"},
        {ip_, "-n", consumer_ns_, "link", "set", consumer_if_, "up"},
        {ip_, "-n", producer_ns_, "link", "set", producer_if_, "up"},
    };
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const auto& step = steps[i];
      const auto r = run(step);
      if (i == 0) veth_in_root_ = r.exit == 0;
      if (i == 1 && r.exit == 0) veth_in_root_ = false;
      if (r.exit != 0) {
        std::string command;
        for (const auto& word : step) command += word + " ";
        return fmt::format("`{}` failed (exit {})", command, r.exit);
      }
    }
    return std::nullopt;
  }

  std::vector<std::string> in_consumer(std::vector<std::string> argv) const {
    return in(consumer_ns_, std::move(argv));
  }
  std::vector<std::string> in_producer(std::vector<std::string> argv) const {
    return in(producer_ns_, std::move(argv));
  }
  // Whether the kernel lets a namespace be entered at all (some sandboxes allow the
  // mount but not setns).
  bool can_enter() const { return run(in(consumer_ns_, {"/bin/true"})).exit == 0; }

 private:
  std::vector<std::string> in(const std::string& ns, std::vector<std::string> argv) const {
    std::vector<std::string> full = {ip_, "netns", "exec", ns};
    full.insert(full.end(), argv.begin(), argv.end());
    return full;
  }

  std::string ip_;
  std::string consumer_ns_, producer_ns_, consumer_if_, producer_if_;
  bool consumer_created_ = false;
  bool producer_created_ = false;
  bool veth_in_root_ = false;
};

TEST(NetnsE2e, ConsumerAndProducerInTwoNamespacesDeliverEveryItem) {
  NamespacePair pair;
  if (auto why = pair.create_namespaces()) GTEST_SKIP() << "network namespaces unavailable: " << *why;
  if (!pair.can_enter()) GTEST_SKIP() << "network namespaces unavailable: `ip netns exec` cannot enter them";
  if (auto error = pair.connect()) FAIL() << "cannot wire the namespaces: " << *error;

  const std::string ecx = std::string(ECX_BINARY_DIR) + "/bin/ecx";
  ASSERT_TRUE(std::filesystem::exists(ecx)) << ecx;
  const std::string listen = fmt::format("{}:24000", NamespacePair::kConsumerAddress);
  const std::vector<std::string> common = {
      "--sizes",     "64KiB,1MiB", "--count",  "40", "--latency-count", "12", "--checksum", "--tp", "2",
      "--pool-size", "64MiB",      "--window", "8",  "--phase-timeout", "60"};
  auto consumer_argv =
      pair.in_consumer({"/usr/bin/env", "UCX_TLS=tcp", ecx, "bench", "e2e", "--role", "consumer", "--listen", listen});
  consumer_argv.insert(consumer_argv.end(), common.begin(), common.end());
  auto producer_argv =
      pair.in_producer({"/usr/bin/env", "UCX_TLS=tcp", ecx, "bench", "e2e", "--role", "producer", "--connect", listen});
  producer_argv.insert(producer_argv.end(), common.begin(), common.end());

  auto consumer = ecx::sim::ChildProcess::spawn(consumer_argv);
  ASSERT_TRUE(consumer.is_ok()) << consumer.status().message();
  auto producer = ecx::sim::ChildProcess::spawn(producer_argv);
  ASSERT_TRUE(producer.is_ok()) << producer.status().message();

  std::vector<json> phases;
  const auto give_up = std::chrono::steady_clock::now() + 240s;
  while (!consumer->eof() && std::chrono::steady_clock::now() < give_up) {
    if (auto line = consumer->read_line(100ms)) {
      auto doc = json::parse(*line, nullptr, false);
      if (!doc.is_discarded() && doc.value("event", "") == "phase") phases.push_back(std::move(doc));
    }
    while (producer->read_line(0ms)) {
    }
  }
  const auto consumer_exit = consumer->wait(30s);
  const auto producer_exit = producer->wait(30s);
  EXPECT_EQ(consumer_exit, std::optional<int>(0));
  EXPECT_EQ(producer_exit, std::optional<int>(0));
  ASSERT_EQ(phases.size(), 4U) << "two sizes x (throughput, latency)";
  for (const auto& phase : phases) {
    SCOPED_TRACE(phase.dump());
    // The measured items and the warm-up run ahead of them all arrive.
    EXPECT_GT(phase.value("warmup_items", 0), 0);
    EXPECT_EQ(phase.value("items_ready", 0), phase.value("items", -1) + phase.value("warmup_items", 0));
    EXPECT_EQ(phase.value("items_failed", -1), 0);
    EXPECT_EQ(phase.value("leaked_pool_bytes", -1), 0);
    EXPECT_EQ(phase.value("checksum_mismatches", -1), 0);
    EXPECT_EQ(phase.value("content_mismatches", -1), 0);
    EXPECT_GT(phase.value("per_s", 0.0), 0.0);
    EXPECT_TRUE(phase.value("ok", false));
  }
}

}  // namespace
