#pragma once
// Shared pieces of the fault tests: free loopback ports, consumer configurations,
// the producer process (`ecx demo --role producer`) and its result line, and an
// admit channel for tests that play the proxy themselves.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "ecx/core/config.h"
#include "sim/admit_link.h"
#include "sim/admit_message.h"
#include "sim/process.h"

namespace ecx::fault {

using json = nlohmann::json;
using sim::free_port_block;

// The --ec-transfer-config document of a CPU-pool consumer on 127.0.0.1.
inline json consumer_document(int port, const std::string& pool, const json& extra_overrides = json::object()) {
  json extra{
      {"checksum", true}, {"push_wait_timeout_s", 30}, {"control_timeout_s", 5}, {"shutdown_drain_timeout_s", 2}};
  extra.update(extra_overrides);
  return json{{"ec_role", "ec_consumer"}, {"ec_ip", "127.0.0.1"},      {"ec_port", port},
              {"ec_buffer_size", pool},   {"ec_buffer_device", "cpu"}, {"ec_connector_extra_config", extra}};
}

inline Config consumer_config(int tp, int port, const std::string& pool, const json& extra_overrides = json::object()) {
  ParallelLayout layout;
  layout.tp_size = tp;
  auto config = parse_config(consumer_document(port, pool, extra_overrides).dump(), layout);
  EXPECT_TRUE(config) << config.status().to_string();
  return config ? *config : Config{};
}

struct ProducerArgs {
  std::string consumer;  // base control address
  std::string admit;     // where admit messages go
  int port = 0;          // the consumer's base control port
  int requests = 20;
  int min_images = 1;
  int max_images = 1;
  int min_tokens = 32;
  int max_tokens = 32;
  int hidden = 1024;
  double repeat = 0.0;
  std::uint64_t seed = 11;
  std::string pool = "128MiB";  // the producer's staging pool
  double deadline_s = 30;
  std::string extra;  // ec_connector_extra_config overrides (JSON object), if any
};

inline std::vector<std::string> producer_argv(const ProducerArgs& a) {
  std::vector<std::string> argv{std::string(ECX_BINARY_DIR) + "/bin/ecx",
                                "demo",
                                "--role",
                                "producer",
                                "--consumer",
                                a.consumer,
                                "--admit",
                                a.admit,
                                "--requests",
                                std::to_string(a.requests),
                                "--min-images",
                                std::to_string(a.min_images),
                                "--max-images",
                                std::to_string(a.max_images),
                                "--min-tokens",
                                std::to_string(a.min_tokens),
                                "--max-tokens",
                                std::to_string(a.max_tokens),
                                "--hidden",
                                std::to_string(a.hidden),
                                "--repeat",
                                std::to_string(a.repeat),
                                "--seed",
                                std::to_string(a.seed),
                                "--pool-size",
                                a.pool,
                                "--port",
                                std::to_string(a.port),
                                "--deadline",
                                std::to_string(a.deadline_s)};
  if (!a.extra.empty()) argv.insert(argv.end(), {"--extra", a.extra});
  return argv;
}

// The producer's final JSON line ({"event":"result", "failed_saves": ..., ...}), read
// until its stdout closes or `timeout` passes.
inline std::optional<json> producer_result(sim::ChildProcess& producer, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  std::optional<json> result;
  while (!producer.eof() && std::chrono::steady_clock::now() < until) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    auto line = producer.read_line(std::max(left, std::chrono::milliseconds(1)));
    if (!line) continue;
    auto doc = json::parse(*line, nullptr, false);
    if (doc.is_object() && doc.value("event", "") == "result") result = doc;
  }
  return result;
}

// Waits (bounded) for `ecx consumer`'s "serving" line.
inline bool wait_serving(sim::ChildProcess& consumer) {
  for (int i = 0; i < 20; ++i) {
    auto line = consumer.read_line(std::chrono::seconds(1));
    if (line && line->find("serving") != std::string::npos) return true;
    if (consumer.eof()) return false;
  }
  return false;
}

// The unlabelled-by-outcome samples of a Prometheus text page at
// http://127.0.0.1:<port>/metrics, by name (first sample of each name); empty when
// the page could not be read.
inline std::map<std::string, double> scrape_metrics(int port) {
  std::map<std::string, double> samples;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return samples;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  std::string page;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = ::recv(fd, buffer, sizeof buffer, 0)) > 0;) page.append(buffer, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
  std::istringstream lines(page);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    const auto name_end = line.find_first_of("{ ");
    const auto value_start = line.rfind(' ');
    if (name_end == std::string::npos || value_start == std::string::npos) continue;
    samples.emplace(line.substr(0, name_end), std::strtod(line.c_str() + value_start + 1, nullptr));
  }
  return samples;
}

// The admit channel a proxy would own: the producer forwards every finished request
// here (sim::AdmitRequest: request_id, items with mm_hash, transfer_id and spec, ...),
// then sim::AdmitDone, on its admit connection (it reads the consumer's answers on the
// same connection); this channel answers nothing.
class AdmitChannel {
 public:
  AdmitChannel() {
    auto bound = sim::AdmitListener::bind("tcp://127.0.0.1:0");
    EXPECT_TRUE(bound) << bound.status().to_string();
    if (bound) listener_ = std::move(*bound);
  }
  std::string endpoint() const { return listener_ ? listener_->endpoint() : std::string(); }
  using Admit = std::variant<sim::AdmitRequest, sim::AdmitDone>;
  // The next admit message, or nullopt after `timeout` (or for one it cannot read).
  std::optional<Admit> next(std::chrono::milliseconds timeout) {
    if (queued_.empty()) receive(timeout);
    if (queued_.empty()) return std::nullopt;
    Admit next = std::move(queued_.front());
    queued_.pop_front();
    return next;
  }

 private:
  // What the producers sent, as the consumer simulator reads it.
  void receive(std::chrono::milliseconds timeout) {
    if (!listener_) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // A wake-up may be a producer connecting, with nothing to read yet.
    while (queued_.empty()) {
      for (auto& batch : listener_->receive()) {
        for (auto& decoded : batch.admits) {
          if (decoded) queued_.push_back(std::move(*decoded));
        }
      }
      const auto left = deadline - std::chrono::steady_clock::now();
      if (!queued_.empty() || left <= std::chrono::steady_clock::duration::zero()) return;
      (void)listener_->wait(std::chrono::duration_cast<Duration>(left));
    }
  }

  std::deque<Admit> queued_;
  std::unique_ptr<sim::AdmitListener> listener_;
};

// A producer's arguments for the consumer whose first shard listens at
// `consumer` (base control port `port`), forwarding finished requests to the
// admit endpoint `admit`; each test sets the workload on top.
inline ProducerArgs producer_args(const std::string& consumer, int port, const std::string& admit) {
  ProducerArgs args;
  args.consumer = consumer;
  args.admit = admit;
  args.port = port;
  return args;
}

// A consumer configuration file for `ecx consumer --config`, removed again when the
// test is done with it.
class ConsumerConfigFile {
 public:
  ConsumerConfigFile(const std::string& name, const json& document)
      : path_(::testing::TempDir() + "/" + name + "_" + std::to_string(::getpid()) + ".json") {
    std::ofstream(path_) << document.dump();
  }
  ~ConsumerConfigFile() { std::remove(path_.c_str()); }
  ConsumerConfigFile(const ConsumerConfigFile&) = delete;
  ConsumerConfigFile& operator=(const ConsumerConfigFile&) = delete;

  std::vector<std::string> consumer_argv() const {
    return {std::string(ECX_BINARY_DIR) + "/bin/ecx", "consumer", "--config", path_};
  }

 private:
  std::string path_;
};

// `ecx consumer` started from `config`, once it serves; nullopt (with the test
// failed) when it does not start or does not get to serving.
inline std::optional<sim::ChildProcess> spawn_serving_consumer(const ConsumerConfigFile& config) {
  auto consumer = sim::ChildProcess::spawn(config.consumer_argv());
  if (!consumer) {
    ADD_FAILURE() << "ecx consumer did not start: " << consumer.status().to_string();
    return std::nullopt;
  }
  if (!wait_serving(*consumer)) {
    ADD_FAILURE() << "ecx consumer did not get to serving";
    return std::nullopt;
  }
  return std::optional<sim::ChildProcess>(std::move(*consumer));
}

}  // namespace ecx::fault
