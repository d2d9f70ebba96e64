// The embedding store against a real Mooncake Store: the test starts mooncake_master
// on loopback (with its HTTP metadata server) and talks to it through
// libmooncake_store.so. Both come from a Mooncake build outside this project, named
// by ECX_MOONCAKE_STORE_LIB and ECX_MOONCAKE_MASTER; without them every test skips.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ecx/core/config.h"
#include "ecx/store/embedding_store.h"
#include "ecx/store/mooncake_store.h"
#include "ecx/store/store_config.h"
#include "sim/process.h"
#include "store/entry_format.h"
#include "store/mooncake_store_api.h"

namespace ecx::store {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr const char* kLibEnv = "ECX_MOONCAKE_STORE_LIB";
constexpr const char* kMasterEnv = "ECX_MOONCAKE_MASTER";

std::string env(const char* name) {
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read before any thread starts
  return v != nullptr ? v : "";
}

TensorSpec spec(const std::vector<std::int64_t>& shape, DType dtype = DType::bfloat16) {
  return TensorSpec::make(shape, dtype, std::uint64_t{1} << 34).value();
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = static_cast<std::byte>((i * 131 + std::size_t{seed} * 7 + (i >> 9)) & 0xff);
  return out;
}

EmbeddingStore::Landing into(std::vector<std::byte>& out, int* calls = nullptr) {
  return [&out, calls](const TensorSpec& s) -> Result<std::span<std::byte>> {
    if (calls != nullptr) ++*calls;
    out.assign(s.nbytes(), std::byte{0});
    return std::span<std::byte>(out);
  };
}

bool accepts(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// A raw client of the same C interface, for writing values ECX would never write.
class RawClient {
 public:
  static std::unique_ptr<RawClient> open(const std::string& lib, const std::string& metadata,
                                         const std::string& master) {
    auto api = mooncake::load_store_api(lib);
    if (!api) {
      ADD_FAILURE() << api.status().to_string();
      return nullptr;
    }
    mooncake::ClientHandle h = (*api)->create();
    if (h == nullptr) return nullptr;
    const int rc = (*api)->setup(h, "127.0.0.1", metadata.c_str(), std::uint64_t{16} << 20, std::uint64_t{16} << 20,
                                 "tcp", "", master.c_str());
    if (rc != 0) {
      ADD_FAILURE() << "raw client setup: " << mooncake::describe_error(rc);
      (*api)->destroy(h);
      return nullptr;
    }
    return std::unique_ptr<RawClient>(new RawClient(*api, h));
  }
  ~RawClient() { api_->destroy(handle_); }
  int put(const std::string& key, std::string_view value) {
    return api_->put(handle_, key.c_str(), value.data(), value.size(), nullptr);
  }

 private:
  RawClient(std::shared_ptr<const mooncake::StoreApi> api, mooncake::ClientHandle h)
      : api_(std::move(api)), handle_(h) {}
  std::shared_ptr<const mooncake::StoreApi> api_;
  mooncake::ClientHandle handle_;
};

// Mooncake's transfer engine serves on the first LAN address unless told otherwise:
// keep the test on loopback. Set before any test starts a client (and its threads).
class LoopbackOnly : public ::testing::Environment {
 public:
  void SetUp() override { ::setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1", 0); }  // NOLINT(concurrency-mt-unsafe)
};
// NOLINTNEXTLINE(cert-err58-cpp): gtest's registration idiom, run before main
[[maybe_unused]] const ::testing::Environment* const kLoopbackOnly =
    ::testing::AddGlobalTestEnvironment(new LoopbackOnly);  // NOLINT(cppcoreguidelines-owning-memory): gtest owns it

class MooncakeStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    lib_ = env(kLibEnv);
    const std::string master = env(kMasterEnv);
    if (lib_.empty() || master.empty()) {
      GTEST_SKIP() << "set " << kLibEnv << " (path of Mooncake's libmooncake_store.so) and " << kMasterEnv
                   << " (path of its mooncake_master) to run against a Mooncake Store";
    }
    ASSERT_EQ(::access(master.c_str(), X_OK), 0) << kMasterEnv << "=" << master << " is not executable";
    port_ = sim::free_port_block(3);  // RPC, HTTP metadata, metrics
    ASSERT_NE(port_, 0) << "no free loopback ports";
    auto child = sim::ChildProcess::spawn(
        {master, fmt::format("--rpc_port={}", port_), "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
         "--http_metadata_server_host=127.0.0.1", fmt::format("--http_metadata_server_port={}", port_ + 1),
         "--metrics_host=127.0.0.1", fmt::format("--metrics_port={}", port_ + 2), "--enable_metric_reporting=false"});
    ASSERT_TRUE(child) << child.status().to_string();
    master_.emplace(std::move(*child));
    // Bounded polling until both the RPC port and the metadata server accept.
    const auto deadline = Clock::now() + 30s;
    while (!(accepts(port_) && accepts(port_ + 1))) {
      ASSERT_TRUE(master_->running()) << "mooncake_master exited while starting";
      ASSERT_LT(Clock::now(), deadline) << "mooncake_master did not accept on 127.0.0.1:" << port_ << " within 30 s";
      std::this_thread::sleep_for(20ms);
    }
  }

  void TearDown() override {
    stores_.clear();
    if (master_) {
      master_->signal(SIGKILL);
      (void)master_->wait(5s);
    }
  }

  std::string metadata() const { return fmt::format("http://127.0.0.1:{}/metadata", port_ + 1); }
  std::string master_addr() const { return fmt::format("127.0.0.1:{}", port_); }

  MooncakeStoreOptions options(std::string model = "test-model@1") const {
    MooncakeStoreOptions o;
    o.library_path = lib_;
    o.local_hostname = "127.0.0.1";
    o.metadata_server = metadata();
    o.master_server = master_addr();
    o.global_segment_size = std::uint64_t{64} << 20;
    o.local_buffer_size = std::uint64_t{16} << 20;
    o.keys.prefix = "ecxtest";
    o.keys.model = std::move(model);
    o.max_entry_bytes = std::uint64_t{8} << 20;
    o.reconnect_interval_s = 60;  // one attempt per test: later calls fail fast
    return o;
  }

  EmbeddingStore& open(std::string model = "test-model@1") {
    auto s = open_mooncake_store(options(std::move(model)));
    EXPECT_TRUE(s) << s.status().to_string();
    stores_.push_back(std::move(*s));
    return *stores_.back();
  }

  std::string lib_;
  int port_ = 0;
  std::optional<sim::ChildProcess> master_;
  std::vector<std::unique_ptr<EmbeddingStore>> stores_;
};

TEST(MooncakeStoreOpen, NamesTheLibraryThatDoesNotLoad) {
  MooncakeStoreOptions o;
  o.library_path = "/nonexistent/libmooncake_store.so";
  o.keys.model = "m@1";
  auto s = open_mooncake_store(o);
  ASSERT_FALSE(s);
  EXPECT_NE(s.status().message().find("/nonexistent/libmooncake_store.so"), std::string::npos);
  EXPECT_NE(s.status().message().find(kLibEnv), std::string::npos);
  o.keys.model.clear();
  EXPECT_EQ(open_mooncake_store(o).status().code(), StatusCode::invalid_argument);
}

TEST(MooncakeStoreConfig, ReadsTheMasterAndMetadataFromStoreUrl) {
  Config c;
  c.store_model = "m@1";
  c.store_url =
      "mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&local_hostname=10.0.0.9&protocol=rdma"
      "&device=mlx5_0";
  auto o = mooncake_options(c);
  ASSERT_TRUE(o) << o.status().to_string();
  EXPECT_EQ(o->master_server, "10.0.0.5:50051");
  EXPECT_EQ(o->metadata_server, "http://10.0.0.5:8080/metadata");
  EXPECT_EQ(o->local_hostname, "10.0.0.9");
  EXPECT_EQ(o->protocol, "rdma");
  EXPECT_EQ(o->device_name, "mlx5_0");
  EXPECT_EQ(o->keys.model, "m@1");
  EXPECT_TRUE(o->library_path.empty()) << "the library comes from the environment";
  for (const char* bad :
       {"mooncake://10.0.0.5:50051", "mooncake://10.0.0.5?metadata=P2PHANDSHAKE", "mooncake://h:0?metadata=x",
        "mooncake://h:1?metadata=x&colour=red", "mooncake://h:1?metadata="}) {
    c.store_url = bad;
    auto r = mooncake_options(c);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.status().message().find("store_url"), std::string::npos) << r.status().message();
  }
  c.store_url = "mooncake://h:1?metadata=P2PHANDSHAKE";
  c.store_model.clear();
  EXPECT_NE(mooncake_options(c).status().message().find("store_model"), std::string::npos);
}

TEST_F(MooncakeStoreTest, PutThenGetIsBitExactAndChecksummed) {
  EmbeddingStore& store = open();
  const TensorSpec s = spec({3, 5, 7});
  const auto payload = pattern(s.nbytes(), 1);
  ASSERT_TRUE(store.put("h1", s, payload)) << store.describe();
  std::vector<std::byte> out;
  auto e = store.get_into("h1", into(out));
  ASSERT_TRUE(e) << e.status().to_string();
  EXPECT_EQ(e->spec, s);
  EXPECT_EQ(e->checksum, XXH64(payload.data(), payload.size(), 0));
  EXPECT_EQ(out, payload);

  // A larger payload (a few MiB, several of Mooncake's slices).
  const TensorSpec big = spec({1024, 1536}, DType::float32);
  const auto big_payload = pattern(big.nbytes(), 2);
  ASSERT_TRUE(store.put("h2", big, big_payload));
  std::vector<std::byte> big_out;
  ASSERT_TRUE(store.get_into("h2", into(big_out)));
  EXPECT_EQ(big_out, big_payload);

  EXPECT_EQ(store.get_into("absent", into(out)).status().code(), StatusCode::not_found);
  const StoreCounters c = store.counters();
  EXPECT_EQ(c.puts, 2u);
  EXPECT_EQ(c.bytes_published, s.nbytes() + big.nbytes());
  EXPECT_EQ(c.bytes_loaded, s.nbytes() + big.nbytes());
  EXPECT_EQ(c.gets, 3u);
  EXPECT_EQ(c.errors, 0u);
}

TEST_F(MooncakeStoreTest, ContainsAnswersManyKeysInOneBatch) {
  EmbeddingStore& store = open();
  const TensorSpec s = spec({4, 8});
  std::vector<std::string> hashes;
  for (int i = 0; i < 100; ++i) {
    hashes.push_back(fmt::format("img{}", i));
    if (i % 3 == 0) {
      ASSERT_TRUE(store.put(hashes.back(), s, pattern(s.nbytes(), static_cast<unsigned>(i))));
    }
  }
  auto present = store.contains(hashes);
  ASSERT_TRUE(present) << present.status().to_string();
  ASSERT_EQ(present->size(), hashes.size());
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    EXPECT_EQ((*present)[i], i % 3 == 0) << hashes[i];
  }
  const StoreCounters c = store.counters();
  EXPECT_EQ(c.lookups, 100u);
  EXPECT_EQ(c.hits, 34u);
  EXPECT_EQ(c.misses, 66u);
}

TEST_F(MooncakeStoreTest, AnotherModelsEntryIsNeverUsed) {
  EmbeddingStore& a = open("model-a@1");
  EmbeddingStore& b = open("model-b@1");
  const TensorSpec s = spec({2, 16});
  const auto payload = pattern(s.nbytes(), 3);
  ASSERT_TRUE(a.put("same", s, payload));
  std::vector<std::byte> out;
  EXPECT_EQ(b.contains(std::vector<std::string>{"same"})->at(0), false);
  EXPECT_EQ(b.get_into("same", into(out)).status().code(), StatusCode::not_found);

  // Model a's bytes copied under model b's key: refused by the header, and removed.
  auto raw = RawClient::open(lib_, metadata(), master_addr());
  ASSERT_TRUE(raw);
  const std::string value = detail::encode_entry_header("model-a@1", s, XXH64(payload.data(), payload.size(), 0)) +
                            std::string(reinterpret_cast<const char*>(payload.data()), payload.size());
  ASSERT_EQ(raw->put("ecxtest:model-b@1:copied", value), 0);
  int landed = 0;
  auto e = b.get_into("copied", into(out, &landed));
  ASSERT_FALSE(e);
  EXPECT_EQ(e.status().code(), StatusCode::protocol) << e.status().to_string();
  EXPECT_EQ(landed, 0);
  EXPECT_EQ(b.counters().rejected, 1u);
  EXPECT_EQ(b.contains(std::vector<std::string>{"copied"})->at(0), false) << "a refused entry is removed";
}

TEST_F(MooncakeStoreTest, ACorruptEntryIsRefusedAndRemoved) {
  EmbeddingStore& store = open();
  auto raw = RawClient::open(lib_, metadata(), master_addr());
  ASSERT_TRUE(raw);
  const TensorSpec s = spec({8, 8});
  const auto payload = pattern(s.nbytes(), 4);
  const std::string value =
      detail::encode_entry_header("test-model@1", s, XXH64(payload.data(), payload.size(), 0) ^ 1) +
      std::string(reinterpret_cast<const char*>(payload.data()), payload.size());
  ASSERT_EQ(raw->put("ecxtest:test-model@1:bad", value), 0);
  ASSERT_EQ(store.contains(std::vector<std::string>{"bad"})->at(0), true);
  std::vector<std::byte> out;
  int landed = 0;
  auto e = store.get_into("bad", into(out, &landed));
  ASSERT_FALSE(e);
  EXPECT_EQ(e.status().code(), StatusCode::protocol);
  EXPECT_NE(e.status().message().find("checksum"), std::string::npos) << e.status().to_string();
  EXPECT_EQ(landed, 0);
  EXPECT_EQ(store.counters().rejected, 1u);
  EXPECT_EQ(store.contains(std::vector<std::string>{"bad"})->at(0), false) << "a refused entry is removed";

  // A truncated entry too.
  ASSERT_EQ(raw->put("ecxtest:test-model@1:short", value.substr(0, value.size() - 5)), 0);
  EXPECT_EQ(store.get_into("short", into(out, &landed)).status().code(), StatusCode::protocol);
  EXPECT_EQ(landed, 0);
}

TEST_F(MooncakeStoreTest, AKilledMasterMakesCallsFailFast) {
  EmbeddingStore& store = open();
  const TensorSpec s = spec({4, 4});
  const auto payload = pattern(s.nbytes(), 5);
  ASSERT_TRUE(store.put("before", s, payload));
  master_->signal(SIGKILL);
  ASSERT_TRUE(master_->wait(5s).has_value());
  master_.reset();

  std::vector<std::byte> out;
  auto t0 = Clock::now();
  auto first = store.contains(std::vector<std::string>{"before"});
  const auto first_took = Clock::now() - t0;
  EXPECT_FALSE(first);
  EXPECT_LT(first_took, 2s) << "the first call after the master died took "
                            << std::chrono::duration<double>(first_took).count() << " s";
  t0 = Clock::now();
  EXPECT_FALSE(store.get_into("before", into(out)));
  EXPECT_FALSE(store.put("after", s, payload));
  EXPECT_FALSE(store.contains(std::vector<std::string>{"before"}));
  const auto rest_took = Clock::now() - t0;
  EXPECT_LT(rest_took, 1s) << "calls after a failure should fail fast, took "
                           << std::chrono::duration<double>(rest_took).count() << " s";
  EXPECT_GE(store.counters().errors, 3u);
  RecordProperty("first_call_ms",
                 static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(first_took).count()));
}

}  // namespace
}  // namespace ecx::store
