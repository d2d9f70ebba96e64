#include "ecx/store/store_config.h"

#include <charconv>

#include <fmt/format.h>

namespace ecx::store {
namespace {

constexpr std::string_view kUrlKey = "ec_connector_extra_config.store_url";

Status bad_url(std::string_view url, std::string_view why) {
  return invalid_argument(fmt::format("{}: '{}' {}; expected redis://[:password@]host[:port][/db]", kUrlKey,
                                      url.substr(0, 128), why));
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
    return bad_url(url, fmt::format("has scheme '{}' (accepted: redis)",
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
  o.keys.prefix = config.store_prefix;
  o.keys.model = config.store_model;
  if (Status s = o.keys.validate(); !s) {
    return invalid_argument(fmt::format("ec_connector_extra_config.store_prefix / store_model: {}", s.message()));
  }
  o.ttl_s = config.store_ttl_s;
  o.io_timeout_s = config.store_io_timeout_s;
  o.connect_timeout_s = std::min(o.connect_timeout_s, config.store_io_timeout_s);
  o.max_entry_bytes = config.effective_max_tensor_bytes();
  o.clock = std::move(clock);
  return o;
}

Result<std::unique_ptr<EmbeddingStore>> open_store(const Config& config, std::shared_ptr<const Clock> clock) {
  auto options = redis_options(config, std::move(clock));
  if (!options) return options.status();
  return open_redis_store(std::move(*options));
}

Result<std::unique_ptr<PresenceIndex>> open_presence_index(const Config& config, std::shared_ptr<const Clock> clock) {
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
