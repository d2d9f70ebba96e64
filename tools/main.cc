// The `ecx` command line: one binary, one subcommand per job.
#include <exception>
#include <iostream>
#include <vector>

#include "commands.h"
#include "ecx/core/version.h"

namespace ecx::cli {
namespace {
std::vector<CommandAdder>& adders() {
  static std::vector<CommandAdder> list;
  return list;
}
}  // namespace

bool register_command(CommandAdder adder) noexcept {
  adders().push_back(adder);  // only out of memory at start-up could throw: terminating is right
  return true;
}

void add_registered_commands(CLI::App& app, Runner& run) {
  for (auto adder : adders()) adder(app, run);
}
}  // namespace ecx::cli

int main(int argc, char** argv) {
  CLI::App app{"ECX: encoder-cache exchange for disaggregated multimodal serving"};
  app.set_version_flag("--version", std::string(ecx::kVersion));
  app.require_subcommand(1);
  ecx::cli::Runner run;
  ecx::cli::add_registered_commands(app, run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    return run ? run() : 2;
  } catch (const std::exception& e) {
    std::cerr << "ecx: " << e.what() << "\n";
    return 1;
  }
}
