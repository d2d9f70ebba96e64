#pragma once
// The shared `ecx bench` parent: every benchmark command adds itself under it.

#include <CLI/CLI.hpp>

namespace ecx::cli {

// Returns the existing `bench` subcommand or adds it. (CLI11 2.1 has no
// get_subcommand_no_throw, hence the filter.)
inline CLI::App* bench_subcommand(CLI::App& app) {
  const auto found = app.get_subcommands([](CLI::App* sub) { return sub->get_name() == "bench"; });
  if (!found.empty()) return found.front();
  auto* bench = app.add_subcommand("bench", "Measure ECX components");
  bench->require_subcommand(1);
  return bench;
}

}  // namespace ecx::cli
