// The Mooncake Store backend of the embedding store: one Mooncake client of the
// cluster that a mooncake_master coordinates, serialised by a mutex. Entries are the
// same bytes the Redis backend stores (header, then payload; see entry_format.h),
// written from and read into one buffer registered with the client once, and
// verified (header and xxHash64) before the caller's landing sees a byte.
//
// The client is set up on the first call (and, after a failed setup, again once
// reconnect_interval_s passed). When the master stops answering, calls fail fast
// until reconnect_interval_s passed; the client is kept, since Mooncake's own
// heartbeat reconnects it and remounts its segment (tearing a client down while the
// master is gone waits for the master's RPC timeout, seconds).

#include "ecx/store/mooncake_store.h"

#include <sys/mman.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "core/logging.h"
#include "store/entry_format.h"
#include "store/mooncake_store_api.h"

namespace ecx::store {
namespace {

using mooncake::StoreApi;

// Header, model identity and shape are far below this (the Redis backend's bound too).
constexpr std::uint64_t kEntryOverheadBytes = std::uint64_t{64} << 10;
constexpr std::uint64_t kMaxEntryBytesLimit = std::uint64_t{1} << 40;

// Anonymous memory, backed only where it is touched.
class MappedBuffer {
 public:
  static Result<MappedBuffer> map(std::size_t size) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return unavailable(fmt::format("cannot map a buffer of {} bytes: {}", size, errno_text(errno)));
    }
    return MappedBuffer(static_cast<std::byte*>(p), size);
  }
  MappedBuffer(MappedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  MappedBuffer& operator=(MappedBuffer&&) = delete;
  MappedBuffer(const MappedBuffer&) = delete;
  MappedBuffer& operator=(const MappedBuffer&) = delete;
  ~MappedBuffer() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  MappedBuffer(std::byte* data, std::size_t size) : data_(data), size_(size) {}
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// One set-up Mooncake client with `buffer` registered; unregisters and destroys it.
class Client {
 public:
  Client(std::shared_ptr<const StoreApi> api, mooncake::ClientHandle handle, std::byte* buffer)
      : api_(std::move(api)), handle_(handle), buffer_(buffer) {}
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client() {
    if (buffer_ != nullptr) (void)api_->unregister_buffer(handle_, buffer_);
    api_->destroy(handle_);
  }
  mooncake::ClientHandle handle() const noexcept { return handle_; }

 private:
  std::shared_ptr<const StoreApi> api_;
  mooncake::ClientHandle handle_;
  std::byte* buffer_;
};

bool unreachable(std::int64_t code) { return code == mooncake::kRpcFail || code == mooncake::kRpcTimeout; }

class MooncakeStore final : public EmbeddingStore {
 public:
  MooncakeStore(MooncakeStoreOptions options, std::shared_ptr<const StoreApi> api, MappedBuffer buffer)
      : o_(std::move(options)),
        api_(std::move(api)),
        clock_(o_.clock ? o_.clock : std::make_shared<SteadyClock>()),
        buffer_(std::move(buffer)) {}

  ~MooncakeStore() override { client_.reset(); }  // before the buffer it registered is unmapped

  Result<std::vector<bool>> contains(std::span<const std::string> mm_hashes) override {
    std::vector<std::string> keys;
    keys.reserve(mm_hashes.size());
    for (const auto& h : mm_hashes) {
      auto k = o_.keys.key(h);
      if (!k) return k.status();
      keys.push_back(std::move(*k));
    }
    if (keys.empty()) return std::vector<bool>{};
    std::vector<const char*> names(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) names[i] = keys[i].c_str();
    std::vector<int> results(keys.size(), -1);
    std::lock_guard lock(mutex_);
    counters_.lookups += keys.size();
    if (Status s = connect(); !s) return s;
    const int rc = api_->batch_is_exist(client_->handle(), names.data(), names.size(), results.data());
    if (rc != 0) return failed("batch_is_exist", rc);
    for (int r : results) {
      if (r < 0) return failed("batch_is_exist", r);
    }
    up();
    std::vector<bool> out;
    out.reserve(keys.size());
    for (int r : results) {
      out.push_back(r > 0);
      ++(r > 0 ? counters_.hits : counters_.misses);
    }
    return out;
  }

  Result<Entry> get_into(std::string_view mm_hash, const Landing& land) override {
    auto key = o_.keys.key(mm_hash);
    if (!key) return key.status();
    std::lock_guard lock(mutex_);
    ++counters_.gets;
    if (Status s = connect(); !s) return s;
    const std::int64_t n = api_->get_into(client_->handle(), key->c_str(), buffer_.data(), buffer_.size());
    if (n >= 0 || n == mooncake::kObjectNotFound) up();
    if (n == mooncake::kObjectNotFound) return not_found(fmt::format("no entry for {} in {}", mm_hash, describe()));
    if (n < 0) {
      if (unreachable(n)) return failed("get_into", n);
      // A value too large for the buffer (another writer's, say) is refused unread.
      const std::int64_t size = api_->get_size(client_->handle(), key->c_str());
      if (size == mooncake::kObjectNotFound)
        return not_found(fmt::format("no entry for {} in {}", mm_hash, describe()));
      if (size > 0 && static_cast<std::uint64_t>(size) > buffer_.size()) {
        return reject(
            *key, mm_hash,
            protocol_error(fmt::format("entry of {} bytes is over max_entry_bytes {}", size, o_.max_entry_bytes)));
      }
      return failed("get_into", n);
    }
    if (static_cast<std::uint64_t>(n) > buffer_.size()) {
      return reject(*key, mm_hash, protocol_error(fmt::format("read of {} bytes overran its buffer", n)));
    }
    const std::string_view value(reinterpret_cast<const char*>(buffer_.data()), static_cast<std::size_t>(n));
    bool refused = false;
    auto entry = detail::check_and_land(value, o_.keys.model, o_.max_entry_bytes, mm_hash, land, refused);
    if (!entry) return refused ? reject(*key, mm_hash, entry.status()) : entry.status();
    counters_.bytes_loaded += entry->spec.nbytes();
    return entry;
  }

  Status put(std::string_view mm_hash, const TensorSpec& spec, std::span<const std::byte> payload) override {
    auto key = o_.keys.key(mm_hash);
    if (!key) return key.status();
    auto encoded = detail::header_for(o_.keys.model, spec, payload, o_.max_entry_bytes);
    if (!encoded) return encoded.status();
    const std::string& header = *encoded;
    const std::size_t total = header.size() + payload.size();
    if (total > buffer_.size()) {
      return invalid_argument(fmt::format("entry of {} bytes does not fit the {} byte buffer", total, buffer_.size()));
    }
    std::lock_guard lock(mutex_);
    if (Status s = connect(); !s) return s;
    std::memcpy(buffer_.data(), header.data(), header.size());
    if (!payload.empty()) std::memcpy(buffer_.data() + header.size(), payload.data(), payload.size());
    const int rc = api_->put_from(client_->handle(), key->c_str(), buffer_.data(), total, nullptr);
    // Keys are content hashes: an entry already there holds these bytes (a bad one is
    // refused and removed by the get that finds it).
    if (rc == 0 || rc == mooncake::kObjectAlreadyExists) up();
    if (rc == mooncake::kObjectAlreadyExists) return Status::ok();
    if (rc != 0) return failed("put_from", rc);
    ++counters_.puts;
    counters_.bytes_published += payload.size();
    return Status::ok();
  }

  StoreCounters counters() const override {
    std::lock_guard lock(mutex_);
    return counters_;
  }

  std::string describe() const override {
    return fmt::format("mooncake master {} (metadata {}, {})", o_.master_server, o_.metadata_server, o_.protocol);
  }

 private:
  // Sets the client up unless it is, or failed less than reconnect_interval_s ago.
  Status connect() {
    const TimePoint now = clock_->now();
    if (now < retry_at_) {
      ++counters_.errors;
      return unavailable(fmt::format("{} is unreachable ({}); next attempt in {:.0f} ms", describe(), last_error_,
                                     std::chrono::duration<double, std::milli>(retry_at_ - now).count()));
    }
    if (client_) return Status::ok();
    mooncake::ClientHandle handle = api_->create();
    if (handle == nullptr) return down("mooncake_store_create returned no client");
    const int rc =
        api_->setup(handle, o_.local_hostname.c_str(), o_.metadata_server.c_str(), o_.global_segment_size,
                    o_.local_buffer_size, o_.protocol.c_str(), o_.device_name.c_str(), o_.master_server.c_str());
    if (rc != 0) {
      api_->destroy(handle);
      return down(fmt::format("setup failed: {}", mooncake::describe_error(rc)));
    }
    if (const int r = api_->register_buffer(handle, buffer_.data(), buffer_.size()); r != 0) {
      api_->destroy(handle);
      return down(
          fmt::format("registering its {} byte buffer failed: {}", buffer_.size(), mooncake::describe_error(r)));
    }
    client_ = std::make_unique<Client>(api_, handle, buffer_.data());
    return Status::ok();
  }

  // A call the master answered, so it is reachable.
  void up() {
    if (was_down_) log_->info("{} reachable again", describe());
    was_down_ = false;
  }

  Status down(std::string why) {
    ++counters_.errors;
    last_error_ = std::move(why);
    retry_at_ = clock_->now() + seconds_to_duration(o_.reconnect_interval_s);
    const std::string message = fmt::format("cannot use {}: {}", describe(), last_error_);
    if (!was_down_) log_->warn("{}; calls fail fast for {} s between attempts", message, o_.reconnect_interval_s);
    was_down_ = true;
    return unavailable(message);
  }

  // A call failed on the store. When the master did not answer, calls fail fast for a
  // while (the client is kept: see the top of this file).
  Status failed(std::string_view call, std::int64_t code) {
    if (unreachable(code)) return down(fmt::format("{}: {}", call, mooncake::describe_error(code)));
    ++counters_.errors;
    return unavailable(fmt::format("{} failed on {}: {}", call, describe(), mooncake::describe_error(code)));
  }

  // A corrupt, truncated or foreign entry: count it, remove it (best effort) so an
  // encoder writes a good one, and tell the caller to encode.
  Status reject(const std::string& key, std::string_view mm_hash, const Status& why) {
    ++counters_.rejected;
    log_->warn("refused the stored entry for {} in {}: {}", mm_hash, describe(), why.message());
    (void)api_->remove(client_->handle(), key.c_str(), 1);
    return protocol_error(fmt::format("stored entry for {} refused: {}", mm_hash, why.message()));
  }

  const MooncakeStoreOptions o_;
  const std::shared_ptr<const StoreApi> api_;
  const std::shared_ptr<const Clock> clock_;
  std::shared_ptr<spdlog::logger> log_ = ecx::log::get("store");

  mutable std::mutex mutex_;  // guards everything below
  MappedBuffer buffer_;       // entries are staged here; registered with every client
  std::unique_ptr<Client> client_;
  TimePoint retry_at_{};
  std::string last_error_;
  bool was_down_ = false;
  StoreCounters counters_;
};

Status validate(const MooncakeStoreOptions& o) {
  if (Status s = o.keys.validate(); !s) return s;
  for (auto [name, value] : {std::pair<const char*, const std::string&>{"local_hostname", o.local_hostname},
                             {"metadata_server", o.metadata_server},
                             {"master_server", o.master_server},
                             {"protocol", o.protocol}}) {
    if (value.empty()) return invalid_argument(fmt::format("mooncake store {} is empty", name));
  }
  if (o.max_entry_bytes == 0 || o.max_entry_bytes > kMaxEntryBytesLimit) {
    return invalid_argument(
        fmt::format("mooncake store max_entry_bytes {} is outside 1..{}", o.max_entry_bytes, kMaxEntryBytesLimit));
  }
  if (!(o.reconnect_interval_s >= 0) || !std::isfinite(o.reconnect_interval_s)) {
    return invalid_argument(
        fmt::format("mooncake store reconnect_interval_s must be >= 0, got {}", o.reconnect_interval_s));
  }
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<EmbeddingStore>> open_mooncake_store(MooncakeStoreOptions options) {
  if (Status s = validate(options); !s) return s;
  auto api = mooncake::load_store_api(mooncake::store_library_path(options.library_path));
  if (!api) return api.status();
  auto buffer = MappedBuffer::map(static_cast<std::size_t>(options.max_entry_bytes + kEntryOverheadBytes));
  if (!buffer) return buffer.status();
  return std::unique_ptr<EmbeddingStore>(
      std::make_unique<MooncakeStore>(std::move(options), std::move(*api), std::move(*buffer)));
}

}  // namespace ecx::store
