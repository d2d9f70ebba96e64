#include "ecx/proxy/options.h"

#include <charconv>

#include <fmt/format.h>

#include "ecx/store/store_config.h"
#include "store_route.h"

namespace ecx::proxy {

namespace {

// The store settings: the flags an operator gives, each error naming its flag.
Status validate_store(const ProxyOptions& options) {
  if (options.store_url.empty()) {
    if (!options.store_model.empty()) {
      return invalid_argument("--store-model is set without --store-url: name the encoders' store (redis://host:port)");
    }
    return Status::ok();
  }
  if (options.store_model.empty()) {
    return invalid_argument(
        "--store-model is required with --store-url: the model identity the encoders file entries under (their "
        "store_model)");
  }
  if (options.store_ttl <= Duration::zero()) {
    return invalid_argument("--store-ttl must be a positive number of seconds (the encoders' store_ttl_s)");
  }
  if (options.store_io_timeout <= Duration::zero()) {
    return invalid_argument("--store-io-timeout must be a positive number of seconds");
  }
  if (options.store_presence_max < 1 || options.store_presence_max > (std::size_t{1} << 32)) {
    return invalid_argument("--store-presence-max must be in 1..4294967296");
  }
  if (options.store_learned_max < 1) return invalid_argument("--store-learned-max must be at least 1");
  // Parses the URL and the key space as the encoders do, without connecting.
  return with_store_flag_names(store::check_store_url(store_config(options)));
}

}  // namespace

std::string UpstreamUrl::text() const { return fmt::format("http://{}:{}", host, port); }

Result<UpstreamUrl> parse_upstream_url(std::string_view url) {
  constexpr std::string_view kScheme = "http://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    return invalid_argument(fmt::format("upstream URL '{}' must start with http://", url));
  }
  std::string_view rest = url.substr(kScheme.size());
  while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  if (rest.find('/') != std::string_view::npos) {
    return invalid_argument(fmt::format("upstream URL '{}' must not have a path", url));
  }
  UpstreamUrl parsed;
  std::string_view host = rest;
  std::string_view port_text;
  if (!rest.empty() && rest.front() == '[') {  // [v6]:port
    const auto close = rest.find(']');
    if (close == std::string_view::npos) return invalid_argument(fmt::format("upstream URL '{}': unclosed '['", url));
    host = rest.substr(1, close - 1);
    if (close + 1 < rest.size()) {
      if (rest[close + 1] != ':')
        return invalid_argument(fmt::format("upstream URL '{}': expected ':' after ']'", url));
      port_text = rest.substr(close + 2);
    }
  } else if (const auto colon = rest.rfind(':'); colon != std::string_view::npos) {
    host = rest.substr(0, colon);
    port_text = rest.substr(colon + 1);
  }
  if (host.empty()) return invalid_argument(fmt::format("upstream URL '{}' has no host", url));
  parsed.host = std::string(host);
  if (!port_text.empty()) {
    unsigned value = 0;
    const auto [end, error] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), value);
    if (error != std::errc() || end != port_text.data() + port_text.size() || value == 0 || value > 65535) {
      return invalid_argument(fmt::format("upstream URL '{}' has an invalid port", url));
    }
    parsed.port = static_cast<std::uint16_t>(value);
  }
  return parsed;
}

Status validate(const ProxyOptions& options) {
  for (const auto* list : {&options.encode_urls, &options.prefill_urls, &options.decode_urls}) {
    for (const auto& url : *list) {
      if (auto parsed = parse_upstream_url(url); !parsed) return parsed.status();
    }
  }
  if (options.ec_consumer_dp_size < 1) return invalid_argument("--ec-consumer-dp-size must be at least 1");
  if (!options.ec_consumer_zmq_addrs.empty()) {
    const auto& consumers = options.prefill_urls.empty() ? options.decode_urls : options.prefill_urls;
    const std::size_t expected = consumers.size() * static_cast<std::size_t>(options.ec_consumer_dp_size);
    if (options.ec_consumer_zmq_addrs.size() != expected) {
      return invalid_argument(fmt::format(
          "--ec-consumer-zmq-addrs lists {} addresses; expected {} ({} {} instance(s) x dp size {}), listed "
          "instance-major",
          options.ec_consumer_zmq_addrs.size(), expected, consumers.size(),
          options.prefill_urls.empty() ? "decode" : "prefill", options.ec_consumer_dp_size));
    }
  }
  if (options.decode_retries < 0) return invalid_argument("--decode-retries must not be negative");
  if (options.encoder_max_batch < 0) return invalid_argument("--encoder-max-batch must not be negative");
  if (options.fail_threshold < 1) return invalid_argument("--fail-threshold must be at least 1");
  if (options.max_body_bytes < 1024) return invalid_argument("--max-body-bytes must be at least 1024");
  const auto positive = [](Duration d) { return d > Duration::zero(); };
  if (!positive(options.connect_timeout) || !positive(options.encode_timeout) || !positive(options.prefill_timeout) ||
      !positive(options.decode_timeout) || !positive(options.client_timeout) || !positive(options.probe_timeout)) {
    return invalid_argument("every timeout must be positive");
  }
  if (options.probe_interval < Duration::zero() || options.evicted_ttl < Duration::zero() ||
      options.shutdown_grace < Duration::zero() || options.keep_alive_idle < Duration::zero()) {
    return invalid_argument("intervals must not be negative");
  }
  return validate_store(options);
}

}  // namespace ecx::proxy
