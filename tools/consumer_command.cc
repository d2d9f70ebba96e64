// `ecx consumer --config FILE`: a standalone consumer — every TP shard of the
// configured replica in one process — serving until SIGTERM or SIGINT. For benches,
// tests and setups without vLLM. Landed payloads stay READY until their TTL (no
// engine takes them here), which is what a producer-side bench needs.
#include <signal.h>

#include <iostream>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "commands.h"
#include "ecx/consumer/consumer_shard.h"
#include "ecx/core/config.h"
#include "ecx/core/metrics.h"
#include "ecx/core/metrics_server.h"

namespace ecx::cli {
namespace {

struct ConsumerOptions {
  std::string file;
  ParallelLayout layout;
};

int run_consumer_service(const ConsumerOptions& o) {
  auto config = load_config_file(o.file, o.layout);
  if (!config) {
    std::cerr << "ecx consumer: " << config.status().message() << "\n";
    return 2;
  }
  if (!config->is_consumer()) {
    std::cerr << "ecx consumer: " << o.file << ": ec_role is " << role_name(config->role)
              << "; a consumer needs ec_consumer or ec_both\n";
    return 2;
  }
  // Block the stop signals before any thread starts so only sigtimedwait sees them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto& registry = metrics::Registry::global();
  std::vector<std::unique_ptr<consumer::ConsumerShard>> shards;
  for (int rank = 0; rank < config->layout.tp_size; ++rank) {
    Config shard_config = *config;
    shard_config.layout.tp_rank = rank;
    auto shard = consumer::ConsumerShard::start(shard_config);
    if (!shard) {
      std::cerr << "ecx consumer: " << shard.status().message() << "\n";
      return 1;
    }
    (*shard)->export_metrics(registry);
    std::cout << fmt::format("shard {}: control {} events {} data {}\n", rank, (*shard)->control_endpoint(),
                             (*shard)->event_endpoint(), (*shard)->data_address());
    shards.push_back(std::move(*shard));
  }
  std::unique_ptr<metrics::MetricsServer> metrics_server;
  if (config->metrics_port != 0) {
    auto server = metrics::MetricsServer::start(registry, config->ec_ip, config->metrics_port);
    if (!server) {
      std::cerr << "ecx consumer: " << server.status().message() << "\n";
      return 1;
    }
    metrics_server = std::move(*server);
    std::cout << fmt::format("metrics: http://{}:{}/metrics\n", config->ec_ip, metrics_server->port());
  }
  std::cout << "serving; stop with SIGTERM or SIGINT" << std::endl;
  const timespec tick{1, 0};
  int received = -1;
  while (received < 0) received = sigtimedwait(&stop_signals, nullptr, &tick);
  std::cout << "stopping (" << (received == SIGINT ? "SIGINT" : "SIGTERM") << ")" << std::endl;
  int code = 0;
  for (auto& shard : shards) {
    const auto report = shard->shutdown();
    if (!report.writers_finished) {
      std::cout << fmt::format("shard {}: {} writer(s) did not finish in time\n", shard->tp_rank(),
                               report.writers_remaining);
      code = 1;
    }
  }
  if (metrics_server) metrics_server->stop();
  std::cout << "stopped" << std::endl;
  return code;
}

void add_consumer_command(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("consumer", "Serve every TP shard of a consumer replica until SIGTERM/SIGINT");
  auto o = std::make_shared<ConsumerOptions>();
  cmd->add_option("--config", o->file, "JSON file holding the --ec-transfer-config value")->required();
  cmd->add_option("--tp-size", o->layout.tp_size, "tensor-parallel size (shards served here)")->capture_default_str();
  cmd->add_option("--dp-size", o->layout.dp_size, "data-parallel size")->capture_default_str();
  cmd->add_option("--dp-index", o->layout.dp_index, "data-parallel index of this replica")->capture_default_str();
  cmd->callback([&run, o] { run = [o] { return run_consumer_service(*o); }; });
}

}  // namespace

ECX_REGISTER_COMMAND(add_consumer_command);

}  // namespace ecx::cli
