// What the `ecx bench` commands (and `ecx demo`'s soak picture) share: parsing,
// the text table, the JSON series list and the gnuplot picture.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <ostream>
#include <string_view>

#include <fmt/format.h>

#include "bench_command.h"

namespace ecx::cli {

namespace {

// The leading number of `text` and the rest, lower-cased.
Result<std::pair<double, std::string>> split_number(std::string_view text) {
  std::size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  if (digits == 0) return invalid_argument(fmt::format("'{}' does not start with a number", text));
  char* end = nullptr;
  const std::string number_text(text.substr(0, digits));
  const double number = std::strtod(number_text.c_str(), &end);
  if (end != number_text.c_str() + number_text.size()) return invalid_argument(fmt::format("'{}': bad number", text));
  std::string unit(text.substr(digits));
  unit.erase(std::remove_if(unit.begin(), unit.end(), [](unsigned char c) { return std::isspace(c); }), unit.end());
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::tolower(c); });
  return std::pair{number, unit};
}

}  // namespace

Result<std::uint64_t> parse_byte_size(std::string_view text) {
  auto parts = split_number(text);
  if (!parts) return invalid_argument(fmt::format("size {}", parts.status().message()));
  const auto& [number, unit] = *parts;
  double scale = 1;
  if (unit.empty() || unit == "b") {
    scale = 1;
  } else if (unit == "k" || unit == "kib" || unit == "kb") {
    scale = 1024.0;
  } else if (unit == "m" || unit == "mib" || unit == "mb") {
    scale = 1024.0 * 1024;
  } else if (unit == "g" || unit == "gib" || unit == "gb") {
    scale = 1024.0 * 1024 * 1024;
  } else {
    return invalid_argument(fmt::format("size '{}': unknown unit '{}' (K, M, G are binary)", text, unit));
  }
  const auto bytes = static_cast<std::uint64_t>(std::llround(number * scale));
  if (bytes == 0) return invalid_argument(fmt::format("size '{}' is zero", text));
  return bytes;
}

Result<std::uint64_t> parse_byte_size_or_zero(std::string_view text) {
  if (text == "0") return std::uint64_t{0};
  return parse_byte_size(text);
}

Result<std::vector<std::uint64_t>> parse_byte_sizes(std::string_view text) {
  std::vector<std::uint64_t> sizes;
  std::size_t start = 0;
  while (start <= text.size()) {
    const auto comma = std::min(text.find(',', start), text.size());
    auto size = parse_byte_size(text.substr(start, comma - start));
    if (!size) return size.status();
    sizes.push_back(*size);
    start = comma + 1;
  }
  return sizes;
}

std::string byte_size_label(std::uint64_t bytes) {
  if (bytes >= (1ULL << 20) && bytes % (1ULL << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= (1ULL << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
  if (bytes >= 1024 && bytes % 1024 == 0) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

Result<double> parse_duration_seconds(std::string_view text) {
  auto parts = split_number(text);
  if (!parts) return invalid_argument(fmt::format("duration {}", parts.status().message()));
  const auto& [number, unit] = *parts;
  if (unit.empty() || unit == "s") return number;
  if (unit == "m" || unit == "min") return number * 60;
  if (unit == "h") return number * 3600;
  return invalid_argument(fmt::format("duration '{}': unknown unit '{}' (s, m, h)", text, unit));
}

void TextTable::print_header(std::ostream& out) const {
  std::vector<std::string> titles;
  for (const auto& c : columns_) titles.push_back(c.title);
  print_row(out, titles);
}

void TextTable::print_row(std::ostream& out, const std::vector<std::string>& cells) const {
  std::string line;
  for (std::size_t i = 0; i < columns_.size(); ++i) {
    const std::string& text = i < cells.size() ? cells[i] : std::string("-");
    if (i == 0) {
      line += fmt::format("{:<{}}", text, columns_[i].width);
    } else {
      line += fmt::format(" {:>{}}", text, columns_[i].width);
    }
  }
  out << line << "\n";
}

std::string cell(const nlohmann::json& row, const char* key, int decimals) {
  const auto found = row.find(key);
  if (found == row.end() || !found->is_number()) return "-";
  return fmt::format("{:.{}f}", found->get<double>(), decimals);
}

Status merge_extra_config(nlohmann::json& extra, const std::string& text) {
  if (text.empty()) return Status::ok();
  nlohmann::json overrides = nlohmann::json::parse(text, nullptr, false);
  if (overrides.is_discarded() || !overrides.is_object()) {
    return invalid_argument(
        fmt::format("--extra '{}': expected a JSON object of ec_connector_extra_config keys, e.g. "
                    "'{{\"direct_payload_max_bytes\": 0}}'",
                    text));
  }
  extra.update(overrides);
  return Status::ok();
}

Status write_json_file(const std::string& path, const nlohmann::json& series) {
  std::ofstream out(path);
  out << series.dump(2) << "\n";
  if (!out) return unavailable(fmt::format("cannot write {}", path));
  return Status::ok();
}

namespace {
// A gnuplot single-quoted string: a quote inside is written twice.
std::string gnuplot_string(std::string_view text) {
  std::string out = "'";
  for (const char c : text) {
    out += c;
    if (c == '\'') out += '\'';
  }
  return out + "'";
}
}  // namespace

Status write_plot(const PlotSpec& spec) {
  std::error_code error;
  const auto dir = std::filesystem::temp_directory_path(error) / fmt::format("ecx-plot-{}", ::getpid());
  if (error || !std::filesystem::create_directories(dir, error)) {
    return unavailable(fmt::format("cannot create a scratch folder for the plot: {}", error.message()));
  }
  // The script's path goes through the shell in single quotes.
  if (dir.string().find('\'') != std::string::npos) {
    std::filesystem::remove_all(dir, error);
    return invalid_argument(fmt::format("the temp folder {} has a quote in its name", dir.string()));
  }
  std::string plot_lines;
  for (std::size_t i = 0; i < spec.lines.size(); ++i) {
    const auto& line = spec.lines[i];
    if (line.points.empty()) continue;
    const auto data = dir / fmt::format("line{}.dat", i);
    std::ofstream out(data);
    for (const auto& [x, y] : line.points) out << fmt::format("{} {}\n", x, y);
    if (!plot_lines.empty()) plot_lines += ", ";
    plot_lines += fmt::format("{} using 1:2 axes {} with linespoints title {}", gnuplot_string(data.string()),
                              line.right_axis ? "x1y2" : "x1y1", gnuplot_string(line.title));
  }
  {
    std::ofstream script(dir / "plot.gp");
    script << "set terminal pngcairo size 1000,600 noenhanced\n"
           << "set output " << gnuplot_string(spec.png) << "\n"
           << "set title " << gnuplot_string(spec.title) << "\n"
           << "set xlabel " << gnuplot_string(spec.x_label) << "\nset ylabel " << gnuplot_string(spec.y_label)
           << "\nset yrange [0:*]\n";
    if (spec.log_x) script << (spec.x_bytes ? "set logscale x 2\nset format x '%.0b %BB'\n" : "set logscale x 10\n");
    if (!spec.y2_label.empty())
      script << "set y2label " << gnuplot_string(spec.y2_label) << "\nset y2tics\nset y2range [0:*]\n";
    script << "set key below\nset grid\nplot " << plot_lines << "\n";
  }
  const std::string command = fmt::format("gnuplot '{}' 2>&1", (dir / "plot.gp").string());
  // NOLINTNEXTLINE(concurrency-mt-unsafe): the CLI draws its plots from its main thread only
  const int rc = plot_lines.empty() ? 1 : std::system(command.c_str());
  std::filesystem::remove_all(dir, error);
  if (rc != 0) return unavailable("gnuplot failed or had nothing to draw (install gnuplot-nox)");
  return Status::ok();
}

namespace {
sigset_t go_signal_set() {
  sigset_t go;
  sigemptyset(&go);
  sigaddset(&go, kGoSignal);
  return go;
}
}  // namespace

void block_go_signal() {
  const sigset_t go = go_signal_set();
  pthread_sigmask(SIG_BLOCK, &go, nullptr);
}

Status hold_for_go(std::string_view line, std::chrono::milliseconds limit, const std::atomic<bool>* stop) {
  std::cout << line << std::endl;
  const sigset_t go = go_signal_set();
  const auto give_up = std::chrono::steady_clock::now() + limit;
  const pid_t parent = ::getppid();
  // Short waits, so that a stop (SIGINT's handler sets it) or a parent that died (this
  // process was handed to another) is seen within one.
  const timespec tick{0, 100'000'000};
  while (std::chrono::steady_clock::now() < give_up) {
    if (stop != nullptr && stop->load()) return cancelled("stopped while holding for the go");
    if (::getppid() != parent) return cancelled("the parent process ended while this one held for the go");
    if (sigtimedwait(&go, nullptr, &tick) == kGoSignal) return Status::ok();
  }
  return timeout_error(fmt::format("no go (signal {}) within {} ms of '{}'", kGoSignal, limit.count(), line));
}

}  // namespace ecx::cli
