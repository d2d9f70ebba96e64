#include "ecx/transport/factory.h"

#include <array>
#include <optional>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "ecx/transport/mooncake_transport.h"
#include "ecx/transport/ucx_transport.h"

namespace ecx::transport {

namespace {

enum class Backend : std::uint8_t { ucx, mooncake };

template <typename Value, std::size_t N>
using NameTable = std::array<std::pair<std::string_view, Value>, N>;

// The one lookup of a data-plane name: the backends a configuration may name and
// Mooncake's protocols (config validation accepts the same lists).
template <typename Value, std::size_t N>
std::optional<Value> find_named(const NameTable<Value, N>& table, std::string_view name) {
  for (const auto& [known, value] : table) {
    if (known == name) return value;
  }
  return std::nullopt;
}

constexpr NameTable<Backend, 2> kBackends{{{"ucx", Backend::ucx}, {"mooncake", Backend::mooncake}}};
// The value: whether the protocol needs device discovery first.
constexpr NameTable<bool, 2> kMooncakeProtocols{{{"tcp", false}, {"rdma", true}}};
constexpr NameTable<UcxMode, 2> kUcxModes{{{"am", UcxMode::am}, {"put", UcxMode::put}}};

Result<Backend> backend_of(const Config& config) {
  if (auto backend = find_named(kBackends, config.transport)) return *backend;
  return invalid_argument(fmt::format("transport '{}': expected ucx or mooncake", config.transport));
}

Result<std::unique_ptr<Transport>> create_mooncake(const Config& config, std::shared_ptr<const Clock> clock) {
  MooncakeOptions options;
  options.library_path = config.mooncake_lib;
  options.protocol = config.mooncake_protocol;
  options.host = config.effective_data_ip();
  options.clock = std::move(clock);
  auto created = create_mooncake_transport(std::move(options));
  if (!created) return created.status();
  return std::unique_ptr<Transport>(std::move(*created));
}

Result<std::unique_ptr<Transport>> create_ucx(const Config& config, std::shared_ptr<const Clock> clock,
                                              DataPlaneRole role, ReceiverHooks hooks) {
  auto options = ucx_options_from_config(config, std::move(clock));
  if (!options) return options.status();
  UcxOptions ucx = std::move(*options);
  if (role == DataPlaneRole::sender) {
    ucx.resolver = [](std::span<const std::byte>, std::uint64_t) -> Result<Landing> {
      return unavailable("a producer does not accept payloads");
    };
    ucx.on_landing = [](std::span<const std::byte>, const Landing&, const Status&) {};
    return create_ucx_transport(std::move(ucx));
  }
  ucx.address_kind = receiver_address_kind(config.ucx_peer_errors);
  if (config.ucx_peer_errors) {
    // A payload stuck landing past the reservation TTL is cut off by closing its
    // sender's connection (UCX never writes into a slot after that, so the slot can be
    // freed).
    ucx.landing_timeout = config.reservation_ttl();
  }
  ucx.resolver = std::move(hooks.resolver);
  ucx.on_landing = std::move(hooks.on_landing);
  return create_ucx_transport(std::move(ucx));
}

}  // namespace

Result<MooncakeProtocol> parse_mooncake_protocol(std::string_view name) {
  if (auto discover = find_named(kMooncakeProtocols, name)) return MooncakeProtocol{std::string(name), *discover};
  return invalid_argument(fmt::format("mooncake_protocol '{}': use tcp or rdma", name));
}

Result<UcxMode> parse_ucx_mode(std::string_view name) {
  if (auto mode = find_named(kUcxModes, name)) return *mode;
  return invalid_argument(fmt::format("ucx mode '{}': expected am or put", name));
}

Result<std::unique_ptr<Transport>> create_data_plane(const Config& config, std::shared_ptr<const Clock> clock,
                                                     DataPlaneRole role, ReceiverHooks hooks) {
  auto backend = backend_of(config);
  if (!backend) return backend.status();
  switch (*backend) {
    case Backend::mooncake:
      return create_mooncake(config, std::move(clock));
    case Backend::ucx:
      return create_ucx(config, std::move(clock), role, std::move(hooks));
  }
  return internal_error("unknown data-plane backend");
}

std::string describe_data_plane(const Config& config) {
  auto backend = backend_of(config);
  if (!backend) return config.transport;
  return *backend == Backend::ucx ? fmt::format("ucx {}", config.ucx_mode)
                                  : fmt::format("mooncake {}", config.mooncake_protocol);
}

}  // namespace ecx::transport
