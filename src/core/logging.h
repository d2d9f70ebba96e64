#pragma once
// One named spdlog logger per component ("ecx.scheduler", "ecx.control", ...), all
// writing to one replaceable sink. Level: ECX_LOG_LEVEL, else config, else "info".

#include <memory>
#include <string_view>

#include <spdlog/logger.h>
#include <spdlog/sinks/sink.h>

#include "ecx/core/status.h"

namespace ecx::log {

// The logger for a component; created on first use, cached afterwards. Thread-safe.
std::shared_ptr<spdlog::logger> get(std::string_view component);

// Parses trace|debug|info|warn|warning|error|critical|off.
Result<spdlog::level::level_enum> parse_level(std::string_view name);
// Sets the level of every logger, present and future. ECX_LOG_LEVEL, when set and
// valid, wins over this call (an operator's override beats a config file).
void set_level(spdlog::level::level_enum level);
spdlog::level::level_enum level();
// Replaces the sink of every logger, present and future (e.g. Python's logging).
// nullptr restores the default stderr sink.
void set_sink(std::shared_ptr<spdlog::sinks::sink> sink);

}  // namespace ecx::log
