#pragma once
// Each `ecx` subcommand registers itself on the root app and sets `run` to the
// function the dispatcher calls after parsing. Exit codes: 0 ok, 1 failure, 2 bad
// input or configuration.

#include <functional>

#include <CLI/CLI.hpp>

namespace ecx::cli {

using Runner = std::function<int()>;

// Adds the subcommand to `app`; stores in `run` what to execute when it is chosen.
void add_config_command(CLI::App& app, Runner& run);

}  // namespace ecx::cli
