#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "ecx/core/config.h"

namespace ecx::cli {
namespace {

struct ConfigCheckOptions {
  std::string file;
  ParallelLayout layout;
};

int run_config_check(const ConfigCheckOptions& options) {
  auto config = load_config_file(options.file, options.layout);
  if (!config) {
    std::cerr << "ecx config check: " << config.status().message() << "\n";
    return 2;
  }
  std::cout << "configuration is valid: " << options.file << "\n" << describe_config(*config);
  return 0;
}

// Markdown tables of every key, the source of docs/configuration.md's tables.
int run_config_keys() {
  std::string_view section = "-";
  for (const auto& key : config_keys()) {
    if (key.section != section) {
      section = key.section;
      std::cout << "\n## " << (section.empty() ? std::string_view("Top-level keys (vLLM's ECTransferConfig)") : section)
                << "\n\n| key | type | default | meaning |\n|---|---|---|---|\n";
    }
    std::cout << "| `" << key.name << "` | " << key.type << " | `" << key.default_text << "` | " << key.meaning
              << " |\n";
  }
  return 0;
}

}  // namespace

namespace {
void add_config_command(CLI::App& app, Runner& run) {
  auto* config = app.add_subcommand("config", "Inspect ECX configuration files");
  config->require_subcommand(1);
  auto* check = config->add_subcommand(
      "check", "Validate a vLLM --ec-transfer-config JSON file and print the resolved configuration");
  auto options = std::make_shared<ConfigCheckOptions>();
  check->add_option("FILE", options->file, "JSON file holding the --ec-transfer-config value")->required();
  check->add_option("--tp-size", options->layout.tp_size, "tensor-parallel size of the engine")->capture_default_str();
  check->add_option("--tp-rank", options->layout.tp_rank, "this worker's tensor-parallel rank")->capture_default_str();
  check->add_option("--pp-size", options->layout.pp_size, "pipeline-parallel size")->capture_default_str();
  check->add_option("--pp-rank", options->layout.pp_rank, "pipeline-parallel rank")->capture_default_str();
  check->add_option("--dp-size", options->layout.dp_size, "data-parallel size")->capture_default_str();
  check->add_option("--dp-index", options->layout.dp_index, "data-parallel index of this replica")
      ->capture_default_str();
  check->callback([&run, options] { run = [options] { return run_config_check(*options); }; });
  auto* keys =
      config->add_subcommand("keys", "Print every configuration key as Markdown tables (type, default, meaning)");
  keys->callback([&run] { run = run_config_keys; });
}

}  // namespace

ECX_REGISTER_COMMAND(add_config_command);

}  // namespace ecx::cli
