#pragma once
// The shared `ecx bench` parent (every benchmark command adds itself under it) and
// what the bench commands print and write alike: size and duration parsing, the
// table, the JSON list of series and the gnuplot picture (tools/bench_support.cc).

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "ecx/core/status.h"

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

// "9MiB", "64K", "4096" (K, M, G are binary).
Result<std::uint64_t> parse_byte_size(std::string_view text);
// As parse_byte_size, but "0" is 0: for an option where 0 means off, or left to
// another part.
Result<std::uint64_t> parse_byte_size_or_zero(std::string_view text);
// A comma-separated list of sizes.
Result<std::vector<std::uint64_t>> parse_byte_sizes(std::string_view text);
// "64 KiB", "9 MiB".
std::string byte_size_label(std::uint64_t bytes);
// "90", "90s", "10m", "1.5h" in seconds.
Result<double> parse_duration_seconds(std::string_view text);

// Fixed-width text table: right-aligned columns, the first one left-aligned.
class TextTable {
 public:
  struct Column {
    std::string title;
    int width;
  };
  explicit TextTable(std::vector<Column> columns) : columns_(std::move(columns)) {}
  void print_header(std::ostream& out) const;
  void print_row(std::ostream& out, const std::vector<std::string>& cells) const;

 private:
  std::vector<Column> columns_;
};
// "-" for a missing figure, else `value` with `decimals` decimals.
std::string cell(const nlohmann::json& row, const char* key, int decimals);

// Writes `series` (a JSON list of series objects) to `path`, indented.
Status write_json_file(const std::string& path, const nlohmann::json& series);

// `--extra TEXT` of ecx demo and ecx bench e2e: merges the JSON object TEXT into
// `extra` (an ec_connector_extra_config); an error, naming the flag, when TEXT is not
// an object. parse_config then names any key it does not accept. Empty TEXT: nothing.
Status merge_extra_config(nlohmann::json& extra, const std::string& text);

struct PlotLine {
  std::string title;
  std::vector<std::pair<double, double>> points;
  bool right_axis = false;  // drawn against the second y axis
};
struct PlotSpec {
  std::string png;
  std::string title;
  std::string x_label;
  std::string y_label;
  std::string y2_label;  // set when a line uses the right axis
  bool log_x = false;
  bool x_bytes = false;  // with log_x: base 2, labelled as byte sizes
  std::vector<PlotLine> lines;
};
// Draws the lines with gnuplot (pngcairo). The Debian package is gnuplot-nox.
Status write_plot(const PlotSpec& spec);

// Holding for a go. `ecx bench e2e` starts the raw plane's processes and ECX's, lets
// each set up and warm up, and then measures one the moment the other has finished:
// this host's copy speed changes from one few seconds to the next, and measurements
// that start seconds apart meet different hosts. The go is this signal.
inline constexpr int kGoSignal = SIGUSR1;
// Blocks the go in this thread and every thread it starts later, so that only
// hold_for_go() takes it: call it before the process starts any thread (a go that
// reached an unblocked thread would end the process).
void block_go_signal();
// Prints `line` on stdout (the parent waits for it), then waits for the go: at most
// `limit`, less when `stop` turns true. A timeout or a stop is an error naming it.
Status hold_for_go(std::string_view line, std::chrono::milliseconds limit, const std::atomic<bool>* stop = nullptr);

}  // namespace ecx::cli
