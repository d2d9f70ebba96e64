#include "ecx/store/store_config.h"

#include <charconv>
#include <string>

#include <fmt/format.h>

#include "ecx/store/mooncake_store.h"

namespace ecx::store {
namespace {

constexpr std::string_view kUrlKey = "ec_connector_extra_config.store_url";

Status bad_url(std::string_view url, std::string_view why) {
  return invalid_argument(fmt::format("{}: '{}' {}; expected redis://[:password@]host[:port][/db]", kUrlKey,
                                      redact_url_password(url), why));
}

constexpr std::string_view kMooncakeScheme = "mooncake://";

Status bad_mooncake_url(std::string_view url, std::string_view why) {
  return invalid_argument(fmt::format(
      "{}: '{}' {}; expected mooncake://<master host:port>?metadata=<url>[&local_hostname=<host>][&protocol=<p>]"
      "[&device=<names>]",
      kUrlKey, redact_url_password(url), why));
}

Status key_space_from(const Config& config, KeySpace& keys) {
  keys.prefix = config.store_prefix;
  keys.model = config.store_model;
  if (Status s = keys.validate(); !s) {
    return invalid_argument(fmt::format("ec_connector_extra_config.store_prefix / store_model: {}", s.message()));
  }
  return Status::ok();
}

Result<int> parse_number(std::string_view url, std::string_view text, std::string_view what, int lo, int hi) {
  int value = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || value < lo || value > hi) {
    return bad_url(url, fmt::format("has {} '{}' (accepted: {}..{})", what, text, lo, hi));
  }
  return value;
}

}  // namespace

Result<RedisOptions> redis_options(const Config& config, std::shared_ptr<const Clock> clock) {
  const std::string_view url = config.store_url;
  if (url.empty()) return invalid_argument(fmt::format("{} is empty: name the store (redis://host:port/db)", kUrlKey));
  constexpr std::string_view kScheme = "redis://";
  if (!url.starts_with(kScheme)) {
    const auto colon = url.find("://");
    return bad_url(url, fmt::format("has scheme '{}' (accepted: redis, mooncake)",
                                    colon == std::string_view::npos ? url.substr(0, 16) : url.substr(0, colon)));
  }
  RedisOptions o;
  std::string_view rest = url.substr(kScheme.size());
  if (auto at = rest.rfind('@'); at != std::string_view::npos) {
    const std::string_view credentials = rest.substr(0, at);
    const auto colon = credentials.find(':');
    // "user:password" (ACL users are not supported: only the password is used) or ":password".
    o.password = std::string(colon == std::string_view::npos ? credentials : credentials.substr(colon + 1));
    rest = rest.substr(at + 1);
  }
  std::string_view db;
  if (auto slash = rest.find('/'); slash != std::string_view::npos) {
    db = rest.substr(slash + 1);
    rest = rest.substr(0, slash);
  }
  std::string_view host = rest;
  std::string_view port;
  if (rest.starts_with('[')) {
    const auto close = rest.find(']');
    if (close == std::string_view::npos) return bad_url(url, "has an unclosed '[' in its host");
    host = rest.substr(1, close - 1);
    const std::string_view after = rest.substr(close + 1);
    if (!after.empty()) {
      if (!after.starts_with(':')) return bad_url(url, "has text after its host");
      port = after.substr(1);
    }
  } else if (auto colon = rest.rfind(':'); colon != std::string_view::npos) {
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  if (host.empty()) return bad_url(url, "has no host");
  o.host = std::string(host);
  if (!port.empty()) {
    auto p = parse_number(url, port, "port", 1, 65535);
    if (!p) return p.status();
    o.port = *p;
  }
  if (!db.empty()) {
    auto d = parse_number(url, db, "database", 0, 1 << 20);
    if (!d) return d.status();
    o.database = *d;
  }
  if (Status s = key_space_from(config, o.keys); !s) return s;
  o.ttl_s = config.store_ttl_s;
  o.io_timeout_s = config.store_io_timeout_s;
  o.connect_timeout_s = std::min(o.connect_timeout_s, config.store_io_timeout_s);
  o.max_entry_bytes = config.effective_max_tensor_bytes();
  o.clock = std::move(clock);
  return o;
}

bool is_mooncake_url(const Config& config) { return std::string_view(config.store_url).starts_with(kMooncakeScheme); }

Result<MooncakeStoreOptions> mooncake_options(const Config& config, std::shared_ptr<const Clock> clock) {
  const std::string_view url = config.store_url;
  if (!url.starts_with(kMooncakeScheme)) return bad_mooncake_url(url, "is not a mooncake:// URL");
  std::string_view rest = url.substr(kMooncakeScheme.size());
  std::string_view query;
  if (auto q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  if (rest.empty() || rest.find('/') != std::string_view::npos) return bad_mooncake_url(url, "has no master host:port");
  const auto colon = rest.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return bad_mooncake_url(url, "has no master port");
  if (auto p = parse_number(url, rest.substr(colon + 1), "port", 1, 65535); !p) {
    return bad_mooncake_url(url, fmt::format("has master port '{}' (accepted: 1..65535)", rest.substr(colon + 1)));
  }
  MooncakeStoreOptions o;
  o.master_server = std::string(rest);
  bool have_metadata = false;
  while (!query.empty()) {
    const auto amp = query.find('&');
    const std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view{} : query.substr(amp + 1);
    const auto eq = item.find('=');
    const std::string_view name = item.substr(0, eq);
    const std::string_view value = eq == std::string_view::npos ? std::string_view{} : item.substr(eq + 1);
    if (value.empty()) return bad_mooncake_url(url, fmt::format("has no value for '{}'", name));
    if (name == "metadata") {
      o.metadata_server = std::string(value);
      have_metadata = true;
    } else if (name == "local_hostname") {
      o.local_hostname = std::string(value);
    } else if (name == "protocol") {
      o.protocol = std::string(value);
    } else if (name == "device") {
      o.device_name = std::string(value);
    } else {
      return bad_mooncake_url(url, fmt::format("has parameter '{}' (accepted: metadata, local_hostname, protocol, "
                                               "device)",
                                               name));
    }
  }
  if (!have_metadata) return bad_mooncake_url(url, "has no metadata=<url> (e.g. http://host:8080/metadata)");
  if (Status s = key_space_from(config, o.keys); !s) return s;
  o.max_entry_bytes = config.effective_max_tensor_bytes();
  o.clock = std::move(clock);
  return o;  // the library: $ECX_MOONCAKE_STORE_LIB, else the loader's search path
}

Status check_store_url(const Config& config) {
  return is_mooncake_url(config) ? mooncake_options(config).status() : redis_options(config).status();
}

Result<std::unique_ptr<EmbeddingStore>> open_store(const Config& config, std::shared_ptr<const Clock> clock) {
  if (is_mooncake_url(config)) {
    auto options = mooncake_options(config, std::move(clock));
    if (!options) return options.status();
    return open_mooncake_store(std::move(*options));
  }
  auto options = redis_options(config, std::move(clock));
  if (!options) return options.status();
  return open_redis_store(std::move(*options));
}

Result<std::unique_ptr<PresenceIndex>> open_presence_index(const Config& config, std::shared_ptr<const Clock> clock) {
  if (is_mooncake_url(config)) {
    // Mooncake Store sends no change feed: only confirmations keep the index current.
    auto lookups = open_store(config, clock);
    if (!lookups) return lookups.status();
    PresenceOptions p;
    p.max_entries = config.store_presence_max;
    p.entry_lifetime = seconds_to_duration(config.store_ttl_s);
    p.clock = std::move(clock);
    return std::make_unique<PresenceIndex>(std::shared_ptr<EmbeddingStore>(std::move(*lookups)), nullptr, p);
  }
  auto options = redis_options(config, clock);
  if (!options) return options.status();
  auto lookups = open_redis_store(*options);
  if (!lookups) return lookups.status();
  auto feed = open_redis_feed(*options);
  if (!feed) return feed.status();
  PresenceOptions p;
  p.max_entries = config.store_presence_max;
  p.entry_lifetime = seconds_to_duration(config.store_ttl_s);
  p.clock = std::move(clock);
  return std::make_unique<PresenceIndex>(std::shared_ptr<EmbeddingStore>(std::move(*lookups)), std::move(*feed), p);
}

PublisherOptions publisher_options(const Config& config) {
  PublisherOptions p;
  p.max_pending_items = config.store_max_pending_items;
  p.max_pending_bytes = config.store_max_pending_bytes;
  return p;
}

}  // namespace ecx::store
