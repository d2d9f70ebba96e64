#pragma once
// Each `ecx` subcommand lives in its own tools/<name>_command.cc and registers itself
// with ECX_REGISTER_COMMAND, so adding a command never edits a shared file.
// A command adds its CLI11 subcommand and, in the subcommand's callback, stores in
// `run` what the dispatcher executes after parsing. Exit codes: 0 ok, 1 failure,
// 2 bad input or configuration.

#include <functional>

#include <CLI/CLI.hpp>

namespace ecx::cli {

using Runner = std::function<int()>;
using CommandAdder = void (*)(CLI::App& app, Runner& run);

// Returns true so it can initialise a namespace-scope constant.
bool register_command(CommandAdder adder) noexcept;
void add_registered_commands(CLI::App& app, Runner& run);

}  // namespace ecx::cli

#define ECX_CLI_CONCAT_INNER(a, b) a##b
#define ECX_CLI_CONCAT(a, b) ECX_CLI_CONCAT_INNER(a, b)
#define ECX_REGISTER_COMMAND(adder)                                                      \
  [[maybe_unused]] static const bool ECX_CLI_CONCAT(ecx_registered_command_, __LINE__) = \
      ::ecx::cli::register_command(adder)
