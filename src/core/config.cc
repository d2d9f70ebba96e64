#include "ecx/core/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/logging.h"

namespace ecx {
namespace {

using json = nlohmann::json;
constexpr std::string_view kExtra = "ec_connector_extra_config";
// ZMQ takes timeouts as int milliseconds.
constexpr double kMaxSeconds = 2147483.0;
constexpr std::uint64_t kMaxBytes = std::uint64_t{1} << 48;

std::string type_of(const json& v) {
  if (v.is_boolean()) return "boolean";
  if (v.is_number_integer() || v.is_number_unsigned()) return "integer";
  if (v.is_number_float()) return "number";
  if (v.is_string()) return "string";
  if (v.is_array()) return "array";
  if (v.is_object()) return "object";
  return "null";
}

Status wrong_type(std::string_view key, std::string_view expected, const json& v) {
  return invalid_argument(
      fmt::format("{}: expected {}, got {} ({})", key, expected, type_of(v), v.dump().substr(0, 64)));
}

// ---- value parsers: each returns the value or an error naming the key.

Result<std::string> parse_string(const json& v, std::string_view key) {
  if (!v.is_string()) return wrong_type(key, "a string", v);
  return v.get<std::string>();
}

Result<bool> parse_bool(const json& v, std::string_view key) {
  if (!v.is_boolean()) return wrong_type(key, "true or false", v);
  return v.get<bool>();
}

// Integers: JSON integers, integral finite floats (1e9), decimal strings. Never booleans.
Result<std::int64_t> parse_integer(const json& v, std::string_view key, std::int64_t lo, std::int64_t hi) {
  std::int64_t out = 0;
  if (v.is_number_integer()) {
    out = v.get<std::int64_t>();
  } else if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return invalid_argument(fmt::format("{}: {} is out of range {}..{}", key, u, lo, hi));
    }
    out = static_cast<std::int64_t>(u);
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.0e18) {
      return invalid_argument(fmt::format("{}: expected an integer, got {}", key, d));
    }
    out = static_cast<std::int64_t>(d);
  } else if (v.is_string()) {
    const auto s = v.get<std::string>();
    std::size_t used = 0;
    try {
      out = std::stoll(s, &used, 10);
    } catch (const std::exception&) {
      used = 0;
    }
    if (s.empty() || used != s.size())
      return invalid_argument(fmt::format("{}: expected an integer, got \"{}\"", key, s.substr(0, 64)));
  } else {
    return wrong_type(key, "an integer", v);
  }
  if (out < lo || out > hi) return invalid_argument(fmt::format("{}: {} is out of range {}..{}", key, out, lo, hi));
  return out;
}

// Byte sizes: integers as above, "1e9", or human units ("512MiB", "4GB", "64 KiB").
Result<std::uint64_t> parse_bytes(const json& v, std::string_view key, std::uint64_t lo, std::uint64_t hi) {
  if (v.is_string()) {
    const auto s = v.get<std::string>();
    std::size_t used = 0;
    double number = 0;
    try {
      number = std::stod(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    std::string unit = s.substr(used);
    unit.erase(std::remove(unit.begin(), unit.end(), ' '), unit.end());
    static constexpr std::pair<std::string_view, double> kUnits[] = {
        {"", 1},      {"B", 1},        {"KB", 1e3},        {"MB", 1e6},           {"GB", 1e9},
        {"TB", 1e12}, {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
    };
    const auto* found =
        std::find_if(std::begin(kUnits), std::end(kUnits), [&](const auto& u) { return u.first == unit; });
    if (used == 0 || found == std::end(kUnits)) {
      return invalid_argument(fmt::format(
          "{}: expected a byte size such as 1000000000, 1e9, \"512MiB\" or \"4GB\", got \"{}\"", key, s.substr(0, 64)));
    }
    const double bytes = number * found->second;
    if (!std::isfinite(bytes) || bytes != std::floor(bytes) || bytes < static_cast<double>(lo) ||
        bytes > static_cast<double>(hi)) {
      return invalid_argument(fmt::format("{}: \"{}\" is not a whole number of bytes in range {}..{}", key, s, lo, hi));
    }
    return static_cast<std::uint64_t>(bytes);
  }
  auto as_int = parse_integer(v, key, static_cast<std::int64_t>(lo), static_cast<std::int64_t>(hi));
  if (!as_int) return as_int.status();
  return static_cast<std::uint64_t>(*as_int);
}

// Durations in seconds: positive finite numbers (not booleans, NaN or infinities).
Result<double> parse_seconds(const json& v, std::string_view key) {
  if (!v.is_number() || v.is_boolean()) return wrong_type(key, "a positive number of seconds", v);
  const double d = v.get<double>();
  if (!std::isfinite(d) || d <= 0 || d > kMaxSeconds) {
    return invalid_argument(
        fmt::format("{}: must be a finite number of seconds in (0, {}], got {}", key, kMaxSeconds, d));
  }
  return d;
}

Result<std::string> parse_enum(const json& v, std::string_view key, std::span<const std::string_view> accepted) {
  auto s = parse_string(v, key);
  if (!s) return s;
  for (auto a : accepted) {
    if (a == *s) return s;
  }
  std::string list;
  for (auto a : accepted) list += (list.empty() ? "" : ", ") + std::string(a);
  return invalid_argument(fmt::format("{}: \"{}\" is not accepted; accepted values: {}", key, s->substr(0, 64), list));
}

// ---- the key table

using Apply = std::function<Status(const json&, Config&, std::string_view)>;

struct KeySpec {
  ConfigKeyInfo info;
  Apply apply;  // null: key accepted for vLLM compatibility and ignored
};

template <typename Field>
Apply set_string(Field Config::*field) {
  return [field](const json& v, Config& c, std::string_view key) -> Status {
    auto s = parse_string(v, key);
    if (!s) return s.status();
    c.*field = std::move(*s);
    return Status::ok();
  };
}

Apply set_enum(std::string Config::*field, std::vector<std::string_view> accepted) {
  return [field, accepted = std::move(accepted)](const json& v, Config& c, std::string_view key) -> Status {
    auto s = parse_enum(v, key, accepted);
    if (!s) return s.status();
    c.*field = std::move(*s);
    return Status::ok();
  };
}

Apply set_bool(bool Config::*field) {
  return [field](const json& v, Config& c, std::string_view key) -> Status {
    auto b = parse_bool(v, key);
    if (!b) return b.status();
    c.*field = *b;
    return Status::ok();
  };
}

template <typename Int>
Apply set_integer(Int Config::*field, std::int64_t lo, std::int64_t hi) {
  return [field, lo, hi](const json& v, Config& c, std::string_view key) -> Status {
    auto n = parse_integer(v, key, lo, hi);
    if (!n) return n.status();
    c.*field = static_cast<Int>(*n);
    return Status::ok();
  };
}

Apply set_bytes(std::uint64_t Config::*field, std::uint64_t lo, std::uint64_t hi) {
  return [field, lo, hi](const json& v, Config& c, std::string_view key) -> Status {
    auto n = parse_bytes(v, key, lo, hi);
    if (!n) return n.status();
    c.*field = *n;
    return Status::ok();
  };
}

Apply set_seconds(double Config::*field) {
  return [field](const json& v, Config& c, std::string_view key) -> Status {
    auto d = parse_seconds(v, key);
    if (!d) return d.status();
    c.*field = *d;
    return Status::ok();
  };
}

Status apply_role(const json& v, Config& c, std::string_view key) {
  static constexpr std::string_view kRoles[] = {"ec_producer", "ec_consumer", "ec_both"};
  auto s = parse_enum(v, key, kRoles);
  if (!s) return s.status();
  c.role = *s == "ec_producer" ? Role::producer : *s == "ec_consumer" ? Role::consumer : Role::both;
  return Status::ok();
}

Status apply_buffer_device(const json& v, Config& c, std::string_view key) {
  auto s = parse_string(v, key);
  if (!s) return s.status();
  std::string lower = *s;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
  bool ok = lower == "cpu" || lower == "cuda";
  if (!ok && lower.starts_with("cuda:") && lower.size() > 5 && lower.size() <= 8) {
    ok = std::all_of(lower.begin() + 5, lower.end(), [](unsigned char ch) { return std::isdigit(ch); });
  }
  if (!ok)
    return invalid_argument(
        fmt::format("{}: \"{}\" is not accepted; accepted values: cpu, cuda, cuda:<index>", key, s->substr(0, 64)));
  c.buffer_device = lower;
  return Status::ok();
}

Status apply_alignment(const json& v, Config& c, std::string_view key) {
  auto n = parse_bytes(v, key, 8, 1 << 21);
  if (!n) return n.status();
  if ((*n & (*n - 1)) != 0) return invalid_argument(fmt::format("{}: must be a power of two, got {}", key, *n));
  c.pool_alignment = *n;
  return Status::ok();
}

const std::vector<KeySpec>& key_table() {
  static const std::vector<KeySpec> table = [] {
    std::vector<KeySpec> t;
    auto top = [&t](std::string_view name, std::string_view type, std::string_view def, std::string_view meaning,
                    Apply apply) {
      t.push_back({{"", name, type, def, meaning}, std::move(apply)});
    };
    auto extra = [&t](std::string_view name, std::string_view type, std::string_view def, std::string_view meaning,
                      Apply apply) {
      t.push_back({{kExtra, name, type, def, meaning}, std::move(apply)});
    };
    top("ec_role", "enum", "(required)",
        "ec_producer (encoder instance), ec_consumer (prefill or PD instance) or ec_both.", apply_role);
    top("ec_ip", "string", "127.0.0.1",
        "Address the consumer's control and event sockets bind to and advertise (IPv4 or IPv6). Never a wildcard in "
        "production: the channel accepts reservations and cancels.",
        set_string(&Config::ec_ip));
    top("ec_port", "integer", "14579",
        "Base control port. TP rank r of DP replica d listens on ec_port + d * tp_size + r; the whole range must fit "
        "1..65535.",
        set_integer(&Config::ec_port, 1, 65535));
    top("ec_buffer_size", "bytes", "1000000000",
        "Size of each side's registered pool (consumer receive pool, producer staging pool) and the scheduler's "
        "resident capacity. Integer, 1e9, or \"4GiB\".",
        set_bytes(&Config::buffer_size, 4096, kMaxBytes));
    top("ec_buffer_device", "enum", "cpu",
        "Where the pools live: cpu (host memory; pinned when built with CUDA), cuda or cuda:<index>.",
        apply_buffer_device);
    top("engine_id", "string", "\"\"", "vLLM's engine id; used only in logs.", set_string(&Config::engine_id));
    top("ec_connector", "string", "(ignored)",
        "vLLM's connector class name (ECXConnector); accepted and ignored by ECX.", nullptr);
    top("ec_connector_module_path", "string", "(ignored)",
        "vLLM's module path for the connector (ecx.vllm); accepted and ignored by ECX.", nullptr);
    top("ec_rank", "integer", "(ignored)", "Carried over from vLLM's KV design; accepted and ignored.", nullptr);
    top("ec_parallel_size", "integer", "(ignored)", "Carried over from vLLM's KV design; accepted and ignored.",
        nullptr);
    top("ec_connector_extra_config", "object", "{}", "ECX's own settings: the keys below.", nullptr);

    extra("control_timeout_s", "seconds", "30",
          "Deadline of every control request (reserve, cancel, discovery). Shutdown never waits for it.",
          set_seconds(&Config::control_timeout_s));
    extra("push_wait_timeout_s", "seconds", "60",
          "How long a consumer request waits for its pushes (also the LOADING deadline) and how long a producer keeps "
          "retrying a push.",
          set_seconds(&Config::push_wait_timeout_s));
    extra("readiness_recheck_s", "seconds", "5",
          "A consumer transfer still waiting for its readiness event this long is asked about on every shard, and "
          "again every interval while it waits: a shard that holds it ready counts as its event (one lost on the "
          "way, e.g. to a full event backlog, would otherwise fail the request at push_wait_timeout_s).",
          set_seconds(&Config::readiness_recheck_s));
    extra("reservation_ttl_s", "seconds", "300",
          "Lease of an unfinished reservation and of an AVAILABLE record; also the tombstone TTL. Scheduler and "
          "workers must agree.",
          set_seconds(&Config::reservation_ttl_s));
    extra("shutdown_drain_timeout_s", "seconds", "1.5",
          "Bound of a worker's whole shutdown: how long it waits for its in-flight pushes (encoder) and for remote "
          "writers into its pool (consumer) before abandoning them (the pool then stays registered).",
          set_seconds(&Config::shutdown_drain_timeout_s));
    extra("tombstone_max", "integer", "65536",
          "Maximum terminal records kept to make late events idempotent (scheduler and reservation manager).",
          set_integer(&Config::tombstone_max, 1, 16'777'216));
    extra("event_queue_max", "integer", "4096",
          "Bound of each shard's outgoing event queue; when full the oldest event is dropped and counted.",
          set_integer(&Config::event_queue_max, 1, 1'048'576));
    extra("max_frame_bytes", "bytes", "1048576", "Largest control frame accepted; larger frames are rejected unread.",
          set_bytes(&Config::max_frame_bytes, 4096, 64ULL << 20));
    extra("retry_after_ms", "integer", "5",
          "Delay a consumer asks producers to wait when its pool is full (back-pressure).",
          set_integer(&Config::retry_after_ms, 1, 60'000));
    extra("reserve_hold_ms", "integer", "5000",
          "Consumer: a reserve none of whose items fits the pool is held up to this long (at most half the "
          "producer's control timeout) and answered as soon as space frees, instead of at once with retry_after; "
          "0 answers at once.",
          set_integer(&Config::reserve_hold_ms, 0, 60'000));
    extra("retry_backoff_max_ms", "integer", "200",
          "Producer: a shard refused again with retry_after waits twice as long as the time before (with jitter), "
          "up to this many milliseconds, instead of retrying every retry_after_ms.",
          set_integer(&Config::retry_backoff_max_ms, 1, 60'000));
    extra("direct_payload_max_bytes", "bytes", "1073741824",
          "Producer: an item of at most this many bytes goes to each shard without a reservation first (a direct "
          "payload); the shard reserves for it on arrival, and one it turns away (pool full, content already "
          "there) is reserved the usual way. Saves the reserve round trip: a small item travels in one message, a "
          "rendezvous one has its landing chosen when its first message arrives (one turned away moves no payload "
          "bytes). A push to several shards (TP) goes direct only up to 128 KiB, since it must hold every shard's "
          "slot or none. Needs the ucx data plane in am mode; 0 turns it off.",
          set_bytes(&Config::direct_payload_max_bytes, 0, 1ULL << 40));
    extra("transport", "enum", "ucx", "Data plane: ucx or mooncake.",
          set_enum(&Config::transport, {"ucx", "mooncake"}));
    extra("ucx_mode", "enum", "am",
          "UCX protocol: am (active messages, receiver-chosen landing) or put (one-sided put + flush; meant for RC "
          "verbs).",
          set_enum(&Config::ucx_mode, {"am", "put"}));
    extra("ucx_peer_errors", "boolean", "true",
          "Detect dead peers through UCX's peer error handling (a failed peer fails its sends at once). UCX 1.13's "
          "shared-memory transports cannot run with it: set false to move payloads over shared memory within a host; a "
          "dead peer is then noticed at the send deadline.",
          set_bool(&Config::ucx_peer_errors));
    extra("ucx_tcp_seg_size", "bytes", "262144",
          "Segment size of UCX's TCP transport (UCX_TCP_RX_SEG_SIZE and UCX_TCP_TX_SEG_SIZE): rendezvous data moves "
          "in pieces of this size; UCX's own default, 64 KiB, costs a send and a receive call per 64 KiB. 0 leaves "
          "UCX's default; those variables in the environment take precedence.",
          set_bytes(&Config::ucx_tcp_seg_size, 0, 64ULL << 20));
    extra("ucx_rndv_thresh", "bytes", "131072",
          "Payloads of at least this many bytes are sent with rendezvous (UCX receives them straight into the slot); "
          "smaller ones eagerly, in one message without the rendezvous handshake (copied once on landing). 0 lets "
          "UCX decide (UCX_RNDV_THRESH).",
          set_bytes(&Config::ucx_rndv_thresh, 0, 1ULL << 30));
    extra("ucx_shared_sources", "boolean", "true",
          "Producer: stage payloads in shared memory (a memfd) where the data plane can use it; a consumer on the same "
          "host then copies a payload of "
          "at least ucx_rndv_thresh out of it itself, one memcpy instead of a socket or a kernel copy. Used only in "
          "am mode and where UCX_TLS allows shared memory (unset, all, or naming sm, posix or sysv); a consumer that "
          "cannot map the producer's memory says so and is sent bytes. false: plain staging memory.",
          set_bool(&Config::ucx_shared_sources));
    extra("mooncake_protocol", "enum", "tcp", "Mooncake protocol when transport is mooncake: tcp or rdma.",
          set_enum(&Config::mooncake_protocol, {"tcp", "rdma"}));
    extra("mooncake_lib", "string", "\"\"",
          "Path of libtransfer_engine.so; empty means ECX_MOONCAKE_LIB, then the loader's search path.",
          set_string(&Config::mooncake_lib));
    extra("data_ip", "string", "\"\"", "Address the data plane listens on and advertises; empty means ec_ip.",
          set_string(&Config::data_ip));
    extra("event_port", "integer", "0",
          "Base port of the shards' event sockets (shard r uses event_port + r); 0 picks ephemeral ports.",
          set_integer(&Config::event_port, 0, 65535));
    extra("checksum", "boolean", "false",
          "Verify an xxHash64 checksum of every payload on landing; a mismatch fails the transfer. On an encoder: "
          "hash every output while staging it; off, an output is hashed on the send path, and only for consumers "
          "that verify.",
          set_bool(&Config::checksum));
    extra("auth_secret", "string", "\"\"",
          "Shared secret authenticating control requests and events (HMAC); empty turns authentication off. Prefer "
          "auth_secret_file.",
          set_string(&Config::auth_secret));
    extra("auth_secret_file", "string", "\"\"",
          "File whose first line is the shared secret; exclusive with auth_secret.",
          set_string(&Config::auth_secret_file));
    extra("metrics_port", "integer", "0",
          "Serve Prometheus metrics over HTTP on this port (on ec_ip); 0 disables. Under vLLM each worker rank serves "
          "metrics_port + dp_index * tp_size + tp_rank, and each replica's scheduler its ecx_scheduler_* metrics on "
          "metrics_port + dp_size * tp_size + dp_index (with its process's other ECX metrics while no worker endpoint "
          "in that process serves them).",
          set_integer(&Config::metrics_port, 0, 65535));
    extra("pool_alignment", "bytes", "256",
          "Alignment of every slot carved from a pool; a power of two from 8 to 2 MiB.", apply_alignment);
    extra("max_tensor_bytes", "bytes", "0", "Largest single embedding accepted; 0 means ec_buffer_size.",
          set_bytes(&Config::max_tensor_bytes, 0, kMaxBytes));
    extra("resident_capacity_bytes", "bytes", "0",
          "Bytes of landed embeddings kept for reuse by content (resident LRU); 0 means ec_buffer_size.",
          set_bytes(&Config::resident_capacity_bytes, 0, kMaxBytes));
    extra("encoder_output_width", "integer", "0",
          "Hidden width of encoder outputs, needed by producers before an encode finishes; 0 takes it from the model "
          "config.",
          set_integer(&Config::encoder_output_width, 0, 1 << 24));
    extra("cross_encoder_cache", "boolean", "false",
          "Share encoder outputs through the embedding store (store_url). Producer: items in the store are loaded "
          "instead of encoded, computed images are published best effort. Consumer: items the proxy routes to the "
          "store (ec_items \"store\": true) and items of requests without ec_transfer_params are loaded from it "
          "instead of encoded locally. Needs store_url and store_model.",
          set_bool(&Config::cross_encoder_cache));
    extra("store_url", "string", "\"\"",
          "The embedding store of the cross-encoder cache: redis://[:password@]host[:port][/db] (port 6379, db 0 by "
          "default). Run Redis with a memory limit and an LRU policy, and notify-keyspace-events K$gxe so encoders "
          "learn of each other's entries without asking. Or a Mooncake Store: "
          "mooncake://<master host:port>?metadata=<url>[&local_hostname=<host>][&protocol=tcp][&device=<names>], "
          "with libmooncake_store.so named by the environment variable ECX_MOONCAKE_STORE_LIB (else found by the "
          "loader).",
          set_string(&Config::store_url));
    extra("store_prefix", "string", "ecx", "First part of every store key: one per cluster or tenant sharing a store.",
          set_string(&Config::store_prefix));
    extra("store_model", "string", "\"\"",
          "Model identity store entries are filed under, e.g. Qwen/Qwen2.5-VL-7B-Instruct@<revision>; an entry of "
          "another identity is never used. The vLLM connector defaults it to the served model and its revision.",
          set_string(&Config::store_model));
    extra("store_ttl_s", "seconds", "3600", "Store entries expire this long after they were written.",
          set_seconds(&Config::store_ttl_s));
    extra("store_io_timeout_s", "seconds", "0.5",
          "Longest one store round trip may take; a slow or stalled store costs a lookup or load this long, then the "
          "item is encoded.",
          set_seconds(&Config::store_io_timeout_s));
    extra("store_max_pending_items", "integer", "32",
          "Computed outputs waiting to be published at most; beyond it (or store_max_pending_bytes) an output is not "
          "published (counted).",
          set_integer(&Config::store_max_pending_items, 1, 1 << 20));
    extra("store_max_pending_bytes", "bytes", "2GiB", "Bytes of computed outputs waiting to be published at most.",
          set_bytes(&Config::store_max_pending_bytes, 1, kMaxBytes));
    extra("store_prefetch_max_bytes", "bytes", "1GiB",
          "Host memory a producer worker holds for store entries it prefetched (verified) and the engine has not "
          "allocated yet; an item that does not fit is encoded.",
          set_bytes(&Config::store_prefetch_max_bytes, 0, kMaxBytes));
    extra("store_presence_max", "integer", "1000000",
          "mm_hashes a producer's scheduler remembers as present in the store (oldest forgotten first).",
          set_integer(&Config::store_presence_max, 1, std::int64_t{1} << 32));
    extra("log_level", "enum", "info",
          "Log level of ECX's loggers (ECX_LOG_LEVEL overrides): trace, debug, info, warn, error, critical, off.",
          set_enum(&Config::log_level, {"trace", "debug", "info", "warn", "warning", "error", "critical", "off"}));
    extra("huge_pages", "boolean", "true", "Back host pools with transparent huge pages when the kernel offers them.",
          set_bool(&Config::huge_pages));
    extra("mlock", "boolean", "false", "Lock host pools into RAM (needs RLIMIT_MEMLOCK).", set_bool(&Config::mlock));
    extra("prefault", "boolean", "false",
          "Touch every page of the host pools at start: no page faults on first use, and the resident size does not "
          "grow as the pool is first used. Without it a landing's first touch of a pool page pays the kernel's page "
          "zeroing on the data path (+2-4 ms per 9 MiB item); with it start-up pays about 0.4 s per GiB (huge pages) "
          "and the whole pool is resident from the start. Recommended for a dedicated pool; ecx bench e2e sets it, ecx "
          "demo for a soak "
          "(--duration).",
          set_bool(&Config::prefault));
    extra("zero_copy_loads", "boolean", "false",
          "Host loads hand the engine a view of the landed slot instead of copying it into a tensor the engine "
          "allocated: no load copy (about 1.8 ms per 9 MiB item on 2 CPUs), but the slot stays out of the pool "
          "until the engine drops its encoder-cache entry, so the pool must hold the engine's encoder cache as well "
          "as the transfers in flight. Loads into GPU memory always copy. ecx bench e2e sets it.",
          set_bool(&Config::zero_copy_loads));
    extra("zero_copy_saves", "boolean", "false",
          "A host encoder output is sent from the engine's own memory, registered with the data plane per item, "
          "instead of a copy in the staging pool: no staging copy (0.8-1.9 ms per 9 MiB item on 2 CPUs), but the "
          "engine's tensor is held until every push of it is done. Device outputs are always staged. ecx bench e2e "
          "sets it.",
          set_bool(&Config::zero_copy_saves));
    extra("zero_copy_saves_min_bytes", "bytes", "1048576",
          "With zero_copy_saves, outputs smaller than this are still copied into the staging pool, and the engine "
          "has their memory back at once. At 64 KiB, lending saves the copy but pays for the registration, its "
          "removal and the give-back on the data plane's thread: over 14 alternated pairs of `ecx bench e2e --sizes "
          "64KiB --extra '{\"zero_copy_saves_min_bytes\": 0}'` against the default on 2 CPUs, transfers/s (median "
          "ratio 1.00-1.05) and ECX's CPU per item were within noise of the copy's.",
          set_bytes(&Config::zero_copy_saves_min_bytes, 0, 1ULL << 40));
    return t;
  }();
  return table;
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

Status unknown_key(std::string_view section, std::string_view key) {
  std::string_view best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  std::string valid;
  for (const auto& spec : key_table()) {
    if (spec.info.section != section) continue;
    valid += (valid.empty() ? "" : ", ") + std::string(spec.info.name);
    const auto d = edit_distance(key, spec.info.name);
    if (d < best_distance) {
      best_distance = d;
      best = spec.info.name;
    }
  }
  const std::string where = section.empty() ? "ec_transfer_config" : std::string(section);
  std::string hint;
  if (best_distance <= std::max<std::size_t>(3, key.size() / 3)) hint = fmt::format("; did you mean '{}'?", best);
  return invalid_argument(fmt::format("unknown key '{}' in {}{} Valid keys: {}", std::string(key.substr(0, 64)), where,
                                      hint.empty() ? "." : hint, valid));
}

Status apply_object(const json& object, std::string_view section, Config& config) {
  for (const auto& entry : object.items()) {
    // Plain names, not a structured binding: clang 14 (the fuzz build) cannot capture those.
    const std::string& key = entry.key();
    const json& value = entry.value();
    const auto& table = key_table();
    const auto it = std::find_if(table.begin(), table.end(),
                                 [&](const KeySpec& s) { return s.info.section == section && s.info.name == key; });
    if (it == table.end()) return unknown_key(section, key);
    if (value.is_null() || !it->apply) continue;  // vLLM writes unset fields as null
    const std::string full = section.empty() ? key : fmt::format("{}.{}", section, key);
    ECX_RETURN_IF_ERROR(it->apply(value, config, full));
  }
  return Status::ok();
}

Status read_secret_file(Config& config) {
  if (config.auth_secret_file.empty()) return Status::ok();
  const std::string key = fmt::format("{}.auth_secret_file", kExtra);
  if (!config.auth_secret.empty()) {
    return invalid_argument(fmt::format("{} and {}.auth_secret are exclusive; set one", key, kExtra));
  }
  std::ifstream in(config.auth_secret_file);
  std::string line;
  if (!in || !std::getline(in, line)) {
    return invalid_argument(fmt::format("{}: cannot read a secret from '{}'", key, config.auth_secret_file));
  }
  while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
  if (line.empty())
    return invalid_argument(fmt::format("{}: '{}' holds an empty secret", key, config.auth_secret_file));
  config.auth_secret = line;
  return Status::ok();
}

}  // namespace

std::string_view role_name(Role role) noexcept {
  switch (role) {
    case Role::producer:
      return "ec_producer";
    case Role::consumer:
      return "ec_consumer";
    case Role::both:
      return "ec_both";
  }
  return "unknown";
}

std::string tcp_address(std::string_view host, int port) {
  const bool v6 = host.find(':') != std::string_view::npos && !host.starts_with('[');
  return v6 ? fmt::format("tcp://[{}]:{}", host, port) : fmt::format("tcp://{}:{}", host, port);
}

std::string redact_url_password(std::string_view url) {
  constexpr std::size_t kShown = 128;
  const auto scheme = url.find("://");
  const auto at = url.rfind('@');
  if (scheme == std::string_view::npos || at == std::string_view::npos || at < scheme) {
    return std::string(url.substr(0, kShown));
  }
  return fmt::format("{}://***{}", url.substr(0, scheme), url.substr(at, kShown));
}

std::string Config::control_address(int tp_rank) const { return tcp_address(ec_ip, control_port() + tp_rank); }

std::span<const ConfigKeyInfo> config_keys() {
  static const std::vector<ConfigKeyInfo> infos = [] {
    std::vector<ConfigKeyInfo> out;
    for (const auto& spec : key_table()) out.push_back(spec.info);
    return out;
  }();
  return infos;
}

Status validate_layout(const ParallelLayout& l, Role role) {
  auto check = [](std::string_view size_name, int size, std::string_view index_name, int index) -> Status {
    if (size < 1 || size > 4096) return invalid_argument(fmt::format("{} must be in 1..4096, got {}", size_name, size));
    if (index < 0 || index >= size) {
      return invalid_argument(
          fmt::format("{} must be in 0..{} ({} - 1), got {}", index_name, size - 1, size_name, index));
    }
    return Status::ok();
  };
  ECX_RETURN_IF_ERROR(check("tp_size", l.tp_size, "tp_rank", l.tp_rank));
  ECX_RETURN_IF_ERROR(check("pp_size", l.pp_size, "pp_rank", l.pp_rank));
  ECX_RETURN_IF_ERROR(check("dp_size", l.dp_size, "dp_index", l.dp_index));
  if (role != Role::consumer && (l.tp_size != 1 || l.pp_size != 1 || l.dp_size != 1)) {
    return invalid_argument(fmt::format(
        "{} must run unsharded: tensor_parallel_size=1, no pipeline parallelism and data_parallel_size=1 "
        "(got tp_size={}, pp_size={}, dp_size={}); the producer holds one copy and writes every consumer shard itself",
        role_name(role), l.tp_size, l.pp_size, l.dp_size));
  }
  return Status::ok();
}

Result<Config> parse_config(std::string_view json_text, const ParallelLayout& layout) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number that overflows
    return invalid_argument(fmt::format("configuration is not valid JSON: {}", e.what()));
  }
  if (!root.is_object()) return invalid_argument("configuration must be a JSON object (vLLM's --ec-transfer-config)");
  if (!root.contains("ec_role") || root["ec_role"].is_null()) {
    return invalid_argument("ec_role is required; accepted values: ec_producer, ec_consumer, ec_both");
  }
  Config config;
  config.layout = layout;
  ECX_RETURN_IF_ERROR(apply_object(root, "", config));
  if (auto it = root.find(kExtra); it != root.end() && !it->is_null()) {
    if (!it->is_object()) return wrong_type(kExtra, "an object", *it);
    ECX_RETURN_IF_ERROR(apply_object(*it, kExtra, config));
  }
  ECX_RETURN_IF_ERROR(read_secret_file(config));
  ECX_RETURN_IF_ERROR(validate_layout(layout, config.role));
  if (config.is_consumer()) {
    const long first = config.control_port();
    const long last = first + layout.tp_size - 1;
    if (first < 1 || last > 65535) {
      return invalid_argument(fmt::format(
          "ec_port: control ports {}..{} (ec_port {} + dp_index {} * tp_size {}, one per TP rank) must fit 1..65535",
          first, last, config.ec_port, layout.dp_index, layout.tp_size));
    }
    if (config.event_port != 0 && config.event_port + layout.tp_size - 1 > 65535) {
      return invalid_argument(fmt::format("{}.event_port: ports {}..{} must fit 1..65535", kExtra, config.event_port,
                                          config.event_port + layout.tp_size - 1));
    }
  }
  if (config.ec_ip.empty()) return invalid_argument("ec_ip must not be empty");
  if (config.effective_max_tensor_bytes() > config.buffer_size) {
    return invalid_argument(fmt::format("{}.max_tensor_bytes ({}) exceeds ec_buffer_size ({})", kExtra,
                                        config.max_tensor_bytes, config.buffer_size));
  }
  if (config.cross_encoder_cache) {
    if (config.store_url.empty()) {
      return invalid_argument(fmt::format(
          "{0}.cross_encoder_cache needs {0}.store_url (redis://host:port/db): the store encoders share", kExtra));
    }
    if (config.store_model.empty()) {
      return invalid_argument(fmt::format(
          "{0}.cross_encoder_cache needs {0}.store_model: the model identity store entries are filed under", kExtra));
    }
  }
  if (auto level = log::parse_level(config.log_level)) log::set_level(*level);
  return config;
}

Result<Config> load_config_file(const std::filesystem::path& path, const ParallelLayout& layout) {
  std::ifstream in(path);
  if (!in) return not_found(fmt::format("cannot open configuration file '{}'", path.string()));
  std::stringstream buffer;
  buffer << in.rdbuf();
  auto parsed = parse_config(buffer.str(), layout);
  if (!parsed) return Status(parsed.status().code(), fmt::format("{}: {}", path.string(), parsed.status().message()));
  return parsed;
}

std::string format_bytes(std::uint64_t bytes) {
  static constexpr std::pair<double, std::string_view> kUnits[] = {{1e12, "TB"}, {1e9, "GB"}, {1e6, "MB"}, {1e3, "kB"}};
  for (const auto& [scale, unit] : kUnits) {
    if (static_cast<double>(bytes) >= scale) return fmt::format("{:.1f} {}", static_cast<double>(bytes) / scale, unit);
  }
  return fmt::format("{} B", bytes);
}

std::string describe_config(const Config& c) {
  std::string out;
  auto line = [&out](std::string_view label, const std::string& value) {
    out += fmt::format("{:<14}{}\n", label, value);
  };
  const auto& l = c.layout;
  line("role", std::string(role_name(c.role)));
  line("layout", fmt::format("tp {} (rank {}), pp {} (rank {}), dp {} (index {})", l.tp_size, l.tp_rank, l.pp_size,
                             l.pp_rank, l.dp_size, l.dp_index));
  if (c.is_consumer()) {
    for (int r = 0; r < l.tp_size; ++r) {
      line(r == 0 ? "control" : "", fmt::format("shard {}: {}", r, c.control_address(r)));
    }
    line("events", c.event_port == 0 ? std::string("ephemeral port per shard")
                                     : fmt::format("ports {}..{}", c.event_port, c.event_port + l.tp_size - 1));
  } else {
    line("control", "none (a producer connects to the consumers named by each request)");
  }
  line("pool", fmt::format("{} ({} bytes) on {}, alignment {}", format_bytes(c.buffer_size), c.buffer_size,
                           c.buffer_device, c.pool_alignment));
  line("max tensor", format_bytes(c.effective_max_tensor_bytes()));
  // Both protocol keys: the transport factory reads the one its backend uses.
  line("transport", fmt::format("{} on {} (ucx_mode {}, mooncake_protocol {})", c.transport, c.effective_data_ip(),
                                c.ucx_mode, c.mooncake_protocol));
  line("timeouts",
       fmt::format("control {} s, push wait {} s, reservation ttl {} s, shutdown drain {} s", c.control_timeout_s,
                   c.push_wait_timeout_s, c.reservation_ttl_s, c.shutdown_drain_timeout_s));
  line("checksum", c.checksum ? "on (xxHash64)" : "off");
  if (c.cross_encoder_cache) {
    line("store", fmt::format("{} as {}:{}, ttl {} s", redact_url_password(c.store_url), c.store_prefix, c.store_model,
                              c.store_ttl_s));
  }
  line("auth", c.auth_secret.empty() ? "off" : "shared secret");
  line("metrics",
       c.metrics_port == 0 ? std::string("off") : fmt::format("http://{}:{}/metrics", c.ec_ip, c.metrics_port));
  return out;
}

}  // namespace ecx
