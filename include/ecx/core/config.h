#pragma once
// ECX configuration: the JSON a user passes to vLLM's --ec-transfer-config plus the
// engine's parallel layout. Every key is known, typed and range-checked; the list
// of keys (config_keys()) is the single source for docs/configuration.md.

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"

namespace ecx {

enum class Role : unsigned char { producer, consumer, both };
std::string_view role_name(Role role) noexcept;  // "ec_producer", ...

// Where this process sits in the engine's parallel layout.
struct ParallelLayout {
  int tp_size = 1;
  int tp_rank = 0;
  int pp_size = 1;
  int pp_rank = 0;
  int dp_size = 1;
  int dp_index = 0;
};

struct Config {
  // --- vLLM ECTransferConfig fields
  Role role = Role::consumer;
  std::string ec_ip = "127.0.0.1";
  int ec_port = 14579;
  std::uint64_t buffer_size = 1'000'000'000;  // ec_buffer_size: each side's pool
  std::string buffer_device = "cpu";          // ec_buffer_device: cpu | cuda | cuda:N
  std::string engine_id;
  ParallelLayout layout;

  // --- ec_connector_extra_config
  double control_timeout_s = 30.0;
  double push_wait_timeout_s = 60.0;
  double readiness_recheck_s = 5.0;
  double reservation_ttl_s = 300.0;
  double shutdown_drain_timeout_s = 1.5;
  std::uint64_t tombstone_max = 65'536;
  std::uint64_t event_queue_max = 4'096;
  std::uint64_t max_frame_bytes = 1 << 20;
  std::uint64_t retry_after_ms = 5;
  std::uint64_t reserve_hold_ms = 5'000;  // a consumer holds a reserve it cannot place yet this long (0 = off)

  std::uint64_t direct_payload_max_bytes = 1ULL << 30;  // producers send items up to this size unreserved (0 = off)
  std::uint64_t retry_backoff_max_ms = 200;             // producers' longest wait between reserves after retry_afters

  std::string transport = "ucx";          // ucx | mooncake
  std::string ucx_mode = "am";            // am | put
  bool ucx_peer_errors = true;            // UCP peer error handling (off lets UCX use shared memory)
  std::string mooncake_protocol = "tcp";  // tcp | rdma
  std::string mooncake_lib;               // "" = ECX_MOONCAKE_LIB or the loader's search path
  std::string data_ip;                    // "" = ec_ip
  int event_port = 0;                     // 0 = ephemeral
  // UCX tuning set by ECX (see docs/configuration.md).
  std::uint64_t ucx_tcp_seg_size = 256ULL * 1024;  // UCX TCP segment size (0 = UCX's default)
  std::uint64_t ucx_rndv_thresh = 128ULL * 1024;   // payloads from this size go rendezvous (0 = UCX decides)
  bool ucx_shared_sources = true;  // same-host receivers copy payloads out of the producer's shared staging memory
  bool checksum = false;
  std::string auth_secret;  // "" = authentication off
  std::string auth_secret_file;
  int metrics_port = 0;  // 0 = no HTTP metrics endpoint
  std::uint64_t pool_alignment = 256;
  std::uint64_t max_tensor_bytes = 0;         // 0 = buffer_size
  std::uint64_t resident_capacity_bytes = 0;  // 0 = buffer_size
  std::int64_t encoder_output_width = 0;      // 0 = from the model config
  // Cross-encoder cache: encoders share their outputs through an embedding store.
  bool cross_encoder_cache = false;
  std::string store_url;             // redis://[:password@]host[:port][/db] or mooncake://host:port?metadata=...
  std::string store_prefix = "ecx";  // first part of every key (one per cluster or tenant)
  std::string store_model;           // model identity entries are filed under ("<model>@<revision>")
  double store_ttl_s = 3600;
  double store_io_timeout_s = 0.5;
  std::uint64_t store_max_pending_items = 32;
  std::uint64_t store_max_pending_bytes = std::uint64_t{2} << 30;
  std::uint64_t store_presence_max = 1'000'000;                     // mm_hashes the scheduler remembers as present
  std::uint64_t store_prefetch_max_bytes = std::uint64_t{1} << 30;  // verified entries a worker holds
  std::string log_level = "info";
  bool huge_pages = true;
  bool mlock = false;
  bool prefault = false;
  bool zero_copy_loads = false;  // host loads hand the engine a view of the landed slot
  bool zero_copy_saves = false;  // host outputs are sent from the engine's memory, not a staging copy
  std::uint64_t zero_copy_saves_min_bytes = 1ULL << 20;  // smaller outputs are copied (lending gains nothing)

  bool is_producer() const noexcept { return role != Role::consumer; }
  bool is_consumer() const noexcept { return role != Role::producer; }
  // First TP shard's control port of this DP replica: ec_port + dp_index * tp_size.
  int control_port() const noexcept { return ec_port + layout.dp_index * layout.tp_size; }
  // tcp://<ec_ip>:<control_port + tp_rank>, IPv6 addresses in brackets.
  std::string control_address(int tp_rank) const;
  std::string effective_data_ip() const { return data_ip.empty() ? ec_ip : data_ip; }
  std::uint64_t effective_max_tensor_bytes() const noexcept {
    return max_tensor_bytes ? max_tensor_bytes : buffer_size;
  }
  std::uint64_t effective_resident_capacity() const noexcept {
    return resident_capacity_bytes ? resident_capacity_bytes : buffer_size;
  }
  Duration control_timeout() const { return seconds_to_duration(control_timeout_s); }
  Duration push_wait_timeout() const { return seconds_to_duration(push_wait_timeout_s); }
  Duration reservation_ttl() const { return seconds_to_duration(reservation_ttl_s); }
};

// Parses vLLM-style JSON. Errors name the key ("ec_connector_extra_config.control_timeout_s")
// and the accepted values or range; an unknown key suggests the closest known one.
Result<Config> parse_config(std::string_view json_text, const ParallelLayout& layout);
Result<Config> load_config_file(const std::filesystem::path& path, const ParallelLayout& layout);
// Checks a layout on its own (ranges; producer must be unsharded). parse_config calls it.
Status validate_layout(const ParallelLayout& layout, Role role);

// Human-readable resolved configuration (what `ecx config check` prints).
std::string describe_config(const Config& config);
// "1.0 GB (1000000000 bytes)"-style formatting for sizes.
std::string format_bytes(std::uint64_t bytes);
// tcp://host:port with IPv6 brackets.
std::string tcp_address(std::string_view host, int port);
// A URL fit for logs and errors: credentials (before the last '@' after the scheme)
// become "***", "redis://:pw@h:1/0" -> "redis://***@h:1/0"; at most 128 characters.
std::string redact_url_password(std::string_view url);

struct ConfigKeyInfo {
  std::string_view section;  // "" for top-level, "ec_connector_extra_config" for extra keys
  std::string_view name;
  std::string_view type;  // string | integer | bytes | seconds | boolean | enum
  std::string_view default_text;
  std::string_view meaning;
};
std::span<const ConfigKeyInfo> config_keys();

}  // namespace ecx
