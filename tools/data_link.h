#pragma once
// The data link a bench or demo runs over (`--transport`): UCX over TCP, UCX over
// shared memory, or Mooncake's Transfer Engine over TCP. Named once, here; the
// commands ask these functions instead of comparing names.

#include <map>
#include <string>
#include <string_view>

#include <CLI/CLI.hpp>

namespace ecx::cli {

enum class DataLink { tcp, shm, mooncake };

// `--transport` values, for CLI11's CheckedTransformer.
inline const std::map<std::string, DataLink>& data_link_names() {
  static const std::map<std::string, DataLink> names{
      {"tcp", DataLink::tcp}, {"shm", DataLink::shm}, {"mooncake", DataLink::mooncake}};
  return names;
}

inline std::string_view data_link_name(DataLink link) {
  for (const auto& [name, value] : data_link_names()) {
    if (value == link) return name;
  }
  return "?";
}

inline bool uses_ucx(DataLink link) { return link != DataLink::mooncake; }

// UCX_TLS for a UCX link (Mooncake uses TCP whatever UCX_TLS says).
inline std::string_view ucx_tls(DataLink link) { return link == DataLink::shm ? "sm,self" : "tcp"; }

// The `ucx_peer_errors` a UCX link needs: UCX 1.13's shared-memory transports cannot
// run with peer error handling (docs/configuration.md).
inline bool ucx_peer_errors(DataLink link) { return link != DataLink::shm; }

// The `transport` configuration key a link maps to.
inline std::string_view config_transport(DataLink link) { return uses_ucx(link) ? "ucx" : "mooncake"; }

// Binds `--transport` to `link`, accepting exactly the names above (only the UCX
// ones with ucx_only).
inline CLI::Option* add_data_link_option(CLI::App* app, DataLink& link, const std::string& help,
                                         bool ucx_only = false) {
  std::map<std::string, DataLink> accepted;
  std::string names;
  for (const auto& [name, value] : data_link_names()) {
    if (ucx_only && !uses_ucx(value)) continue;
    accepted.emplace(name, value);
    names += (names.empty() ? "" : ",") + name;
  }
  // CLI11 reads an enum from its number: the name becomes that number here, and a
  // name outside the list is refused naming the ones accepted.
  CLI::Validator by_name(
      [accepted, names](std::string& value) -> std::string {
        auto it = accepted.find(value);
        if (it == accepted.end()) return "'" + value + "': expected one of " + names;
        value = std::to_string(static_cast<int>(it->second));
        return {};
      },
      "{" + names + "}");
  return app->add_option("--transport", link, help)
      ->transform(by_name)
      ->type_name("TEXT")
      ->default_str(std::string(data_link_name(link)));
}

}  // namespace ecx::cli
