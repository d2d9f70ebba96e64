#pragma once
// Settings of the EPD proxy (`ecx proxy`). Every upstream hop has its own timeout;
// request bodies are bounded; the liveness prober's intervals are settable so tests
// can run it fast.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"

namespace ecx::proxy {

struct ProxyOptions {
  std::string host = "0.0.0.0";
  std::uint16_t port = 8000;  // 0 picks a free port (printed at start)

  // Static roster. URLs are "http://host:port" (no path, no trailing slash).
  std::vector<std::string> encode_urls;
  std::vector<std::string> prefill_urls;
  std::vector<std::string> decode_urls;
  // EC consumer control addresses, one per consumer instance x DP replica, listed
  // instance-major (c0r0, c0r1, c1r0, ...). The consumer instances are the prefill
  // URLs when there are any, else the decode URLs.
  std::vector<std::string> ec_consumer_zmq_addrs;
  int ec_consumer_dp_size = 1;

  // Admin API (/instances) key, compared with the X-API-Key header. Empty disables
  // the admin API (every call answers 403).
  std::string admin_api_key;

  int decode_retries = 1;     // extra attempts of the whole path after a decode 500
  bool rewrite = true;        // rewrite media items into their embeds form
  int encoder_max_batch = 1;  // images per encoder sub-request (0 = no limit)
  std::size_t max_body_bytes = 64u << 20;

  Duration connect_timeout = std::chrono::seconds(5);
  Duration encode_timeout = std::chrono::seconds(300);
  Duration prefill_timeout = std::chrono::seconds(600);
  // Decode: time to the response head, and then the longest gap between two reads.
  Duration decode_timeout = std::chrono::seconds(600);
  Duration client_timeout = std::chrono::seconds(60);  // reading a client's request
  Duration keep_alive_idle = std::chrono::seconds(2);  // idle upstream connections are dropped after this
  std::size_t max_idle_per_upstream = 128;

  Duration probe_interval = std::chrono::seconds(5);  // 0 disables liveness probing
  Duration probe_timeout = std::chrono::seconds(2);
  int fail_threshold = 3;
  Duration evicted_ttl = std::chrono::minutes(15);  // 0 keeps probing evicted instances forever
  Duration shutdown_grace = std::chrono::seconds(30);

  // Cross-encoder cache: images already in the encoders' shared store skip the encoder
  // hop (the consumer loads them from the store). Empty store_url turns it off. The
  // key space must be the encoders' and consumers' own (their store_prefix and
  // store_model), else nothing is ever found.
  std::string store_url;  // redis://[:password@]host[:port][/db] or mooncake://...
  std::string store_prefix = "ecx";
  std::string store_model;                     // required with store_url
  Duration store_ttl = std::chrono::hours(1);  // the encoders' store_ttl_s: known entries are forgotten after it
  Duration store_io_timeout = std::chrono::milliseconds(500);  // one store round trip (off the request path)
  std::size_t store_presence_max = 1'000'000;                  // mm_hashes the presence index remembers
  std::size_t store_learned_max = 100'000;                     // engine hashes learned from encoder answers
};

// Checks ranges, URL forms and the consumer address count.
Status validate(const ProxyOptions& options);

// "http://host:port" → its parts; the scheme must be http, the port is required or 80.
struct UpstreamUrl {
  std::string host;
  std::uint16_t port = 80;
  std::string text() const;  // normalised "http://host:port"
};
Result<UpstreamUrl> parse_upstream_url(std::string_view url);

}  // namespace ecx::proxy
