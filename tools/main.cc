// The `ecx` command line: one binary, one subcommand per job.
#include <exception>
#include <iostream>

#include "commands.h"
#include "ecx/core/version.h"

int main(int argc, char** argv) {
  CLI::App app{"ECX: encoder-cache exchange for disaggregated multimodal serving"};
  app.set_version_flag("--version", std::string(ecx::kVersion));
  app.require_subcommand(1);
  ecx::cli::Runner run;
  ecx::cli::add_config_command(app, run);
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
