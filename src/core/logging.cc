#include "core/logging.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include <spdlog/sinks/dist_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

namespace ecx::log {
namespace {

// All loggers write into one dist_sink whose single child is swapped by set_sink(),
// so replacing the destination never races with a logger being created.
struct Registry {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<spdlog::logger>, std::less<>> loggers;
  std::shared_ptr<spdlog::sinks::dist_sink_mt> sink = std::make_shared<spdlog::sinks::dist_sink_mt>();
  spdlog::level::level_enum level = spdlog::level::info;
  bool env_override = false;

  Registry() {
    sink->add_sink(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    // NOLINTNEXTLINE(concurrency-mt-unsafe): ECX never modifies its environment.
    if (const char* env = std::getenv("ECX_LOG_LEVEL"); env != nullptr && *env != '\0') {
      if (auto parsed = parse_level(env)) {
        level = *parsed;
        env_override = true;
      }
    }
  }
};

Registry& registry() {
  static Registry instance;
  return instance;
}

}  // namespace

Result<spdlog::level::level_enum> parse_level(std::string_view name) {
  using L = spdlog::level::level_enum;
  static constexpr std::pair<std::string_view, L> kLevels[] = {
      {"trace", L::trace},  {"debug", L::debug}, {"info", L::info},         {"warn", L::warn},
      {"warning", L::warn}, {"error", L::err},   {"critical", L::critical}, {"off", L::off},
  };
  for (const auto& [text, value] : kLevels) {
    if (text == name) return value;
  }
  return invalid_argument("unknown log level '" + std::string(name.substr(0, 32)) +
                          "'; accepted: trace, debug, info, warn, error, critical, off");
}

std::shared_ptr<spdlog::logger> get(std::string_view component) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  if (auto it = reg.loggers.find(component); it != reg.loggers.end()) return it->second;
  auto logger = std::make_shared<spdlog::logger>("ecx." + std::string(component), reg.sink);
  logger->set_level(reg.level);
  logger->flush_on(spdlog::level::warn);
  reg.loggers.emplace(std::string(component), logger);
  return logger;
}

void set_level(spdlog::level::level_enum new_level) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  if (reg.env_override) return;
  reg.level = new_level;
  for (auto& [name, logger] : reg.loggers) logger->set_level(new_level);
}

spdlog::level::level_enum level() {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  return reg.level;
}

void set_sink(std::shared_ptr<spdlog::sinks::sink> new_sink) {
  auto& reg = registry();
  if (!new_sink) new_sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  reg.sink->set_sinks({std::move(new_sink)});
}

}  // namespace ecx::log
