// `ecx bench transport`: ECX's UCX data plane between a producer process and a
// consumer process on loopback, next to ucx_perftest (ucp_am_bw, tag_bw, stream_bw, ucp_put_bw) on the same
// transport and size and a plain memcpy, all in the same run. With `--transport
// mooncake` the Mooncake backend's one-sided writes (over Mooncake's tcp) join the
// table next to ECX over UCX tcp, measured in the same run.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "commands.h"
#include "core/byte_order.h"
#include "core/logging.h"
#include "data_link.h"
#include "ecx/core/config.h"
#include "ecx/pool/slab.h"
#include "ecx/transport/mooncake_transport.h"
#include "ecx/transport/ucx_transport.h"
#include "sim/thread_cpu.h"

namespace ecx::cli {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct BenchOptions {
  DataLink transport = DataLink::tcp;
  std::string size_text;                        // one size ("" and no --sizes: kDefaultSizes)
  std::string sizes_text;                       // comma list, or "sweep"
  std::string perftests = "am,tag,stream,put";  // ucx_perftest -t ucp_<name>_bw baselines
  std::uint64_t count = 0;                      // 0 = automatic per size
  std::uint32_t window = 4;
  std::uint32_t repeat = 3;
  std::string mode = "am";
  std::string json_file;
  std::string plot_file;
  bool skip_perftest = false;
  // The sender's buffers in a memfd, so that a payload from rndv_threshold on goes as
  // its place there and the consumer copies it out (UcxOptions::shared_sources; only
  // where UCX_TLS allows shared memory, i.e. with --transport shm).
  bool shared_sources = true;
  // "": each side reuses `window` slots, which stay in the CPU cache (as ucx_perftest
  // reuses its buffer). A size: both sides move through a ring of this many bytes, so
  // each message is sent from and lands in memory not touched since (as ECX's pools do).
  std::string spread_text;
  std::uint64_t spread = 0;  // parsed spread_text (the consumer half gets it as a number)
  // UCX series: each send waits this long after a send completed, so that it starts on
  // an idle plane (both progress threads asleep, as before an engine's lone item)
  // instead of behind its predecessor. 0: back to back.
  std::uint32_t gap_us = 0;
  // ECX series, mode am: payloads of at least this many bytes go rendezvous, smaller
  // ones eagerly, as ECX's ucx_rndv_thresh decides (0: UCX decides). Only the sender's
  // matters: it chooses the protocol of each send.
  std::string rndv_text;
  std::uint64_t rndv_threshold = transport::UcxOptions{}.rndv_threshold_bytes;  // parsed rndv_text
  // Hidden (ecx bench e2e): after the UCX series' warm-up, hold for the go
  // (bench_command.h) before the measured messages.
  bool hold = false;
  // Hidden: the consumer half, started by the producer as a child process.
  bool consumer = false;
  std::uint64_t consumer_slot_bytes = 0;
};

constexpr std::array<std::uint64_t, 4> kDefaultSizes = {64ULL << 10, 1ULL << 20, 4ULL << 20, 9ULL << 20};
constexpr std::array<std::uint64_t, 9> kSweepSizes = {4ULL << 10, 16ULL << 10, 64ULL << 10, 256ULL << 10, 1ULL << 20,
                                                      4ULL << 20, 9ULL << 20,  16ULL << 20, 64ULL << 20};

// The UCX link of the ECX and ucx_perftest series: with --transport mooncake they
// are the tcp baseline the Mooncake series is compared with. UCX_TLS is the same
// for ECX and ucx_perftest (self only matters for a process talking to itself).
DataLink ucx_link(const BenchOptions& options) {
  return uses_ucx(options.transport) ? options.transport : DataLink::tcp;
}

// ECX's endpoints over tcp use UCX's peer error handling (a dead peer fails its sends
// at once); UCX 1.13's shared-memory transports cannot run with it.
bool ecx_peer_errors(const BenchOptions& options) { return ucx_link(options) == DataLink::tcp; }

// A measured send's header carries its send time (monotonic ns, little-endian, after
// a marker): the receiver on the same host stamps the delivery against it.
constexpr std::uint64_t kSentMarker = 0x6563782d73656e74ULL;  // "ecx-sent"

std::int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

void stamp_sent(std::span<std::byte, 64> header) {
  byte_order::put_le<std::uint64_t>(header.data(), kSentMarker);
  byte_order::put_le<std::uint64_t>(header.data() + 8, static_cast<std::uint64_t>(monotonic_ns()));
}

std::optional<std::int64_t> sent_stamp(std::span<const std::byte> header) {
  if (header.size() < 16 || byte_order::get_le<std::uint64_t>(header.data()) != kSentMarker) return std::nullopt;
  return static_cast<std::int64_t>(byte_order::get_le<std::uint64_t>(header.data() + 8));
}

std::uint64_t auto_count(std::uint64_t size) { return std::clamp<std::uint64_t>((2ULL << 30) / size, 20, 100'000); }

// ---------------------------------------------------------------------------------
// Child processes

class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env) {
    ::signal(SIGPIPE, SIG_IGN);
    int to_child[2];
    int from_child[2];
    if (::pipe2(to_child, O_CLOEXEC) != 0 || ::pipe2(from_child, O_CLOEXEC) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::dup2(to_child[0], STDIN_FILENO);
      ::dup2(from_child[1], STDOUT_FILENO);
      // NOLINTNEXTLINE(concurrency-mt-unsafe): the forked child has a single thread
      for (const auto& [key, value] : env) ::setenv(key.c_str(), value.c_str(), 1);
      std::vector<char*> args;
      std::vector<std::string> copy = argv;
      args.reserve(copy.size() + 1);
      for (auto& arg : copy) args.push_back(arg.data());
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
    ::close(to_child[0]);
    ::close(from_child[1]);
    stdin_ = to_child[1];
    stdout_ = from_child[0];
  }
  ~Child() {
    if (stdin_ >= 0) ::close(stdin_);
    if (pid_ > 0) {
      // A well-behaved child exits on "quit" or EOF; give it a moment, then make sure.
      for (int i = 0; i < 200 && !exited(); ++i) std::this_thread::sleep_for(10ms);
      if (!exited()) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
      }
    }
    if (stdout_ >= 0) ::close(stdout_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  bool started() const { return pid_ > 0; }
  void write_line(const std::string& line) {
    const std::string data = line + "\n";
    [[maybe_unused]] auto n = ::write(stdin_, data.data(), data.size());
  }
  std::optional<std::string> read_line(std::chrono::milliseconds timeout) {
    const auto give_up = Clock::now() + timeout;
    for (;;) {
      if (auto newline = buffer_.find('\n'); newline != std::string::npos) {
        std::string line = buffer_.substr(0, newline);
        buffer_.erase(0, newline + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - Clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd fd{stdout_, POLLIN, 0};
      if (::poll(&fd, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::read(stdout_, chunk, sizeof chunk);
      if (n <= 0) return std::nullopt;
      buffer_.append(chunk, static_cast<std::size_t>(n));
    }
  }
  // Everything the child writes until it exits (bounded by `timeout`).
  std::string read_all(std::chrono::milliseconds timeout) {
    std::string all;
    while (auto line = read_line(timeout)) all += *line + "\n";
    return all + buffer_;
  }
  // Waits (bounded) for the exit; true when it exited with status 0.
  bool wait(std::chrono::milliseconds timeout) {
    const auto give_up = Clock::now() + timeout;
    while (!exited() && Clock::now() < give_up) std::this_thread::sleep_for(5ms);
    return exited() && exit_status_ == 0;
  }

 private:
  bool exited() {
    if (pid_ <= 0) return true;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      pid_ = -1;
      return true;
    }
    return false;
  }

  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  int exit_status_ = -1;
  std::string buffer_;
};

std::string self_executable() {
  std::error_code error;
  auto path = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::string("ecx") : path.string();
}

// ---------------------------------------------------------------------------------
// Series

struct Series {
  std::string name;
  std::string transport;
  std::uint64_t size = 0;
  double gbps = 0;
  std::optional<double> p50_us, p99_us;
  // Send to landed, stamped by the receiver (same host: one monotonic clock). Unlike
  // the sender's completion, an eager send's is not done before the bytes arrive.
  std::optional<double> delivery_p50_us, delivery_p99_us;
  std::optional<double> ratio_vs_perftest;
  // Against the best primitive run with endpoint error handling (ucx_perftest -e), as
  // ECX's own endpoints are over tcp (ucx_peer_errors).
  std::optional<double> ratio_vs_perftest_same_mode;
  // CPU time of both processes' threads per measured message (the sender's over its
  // measured sends, the receiver's from its first measured landing): what the raw data
  // plane costs the machine per item, for `ecx bench e2e`'s CPU table.
  std::optional<double> cpu_us_per_message;
  // The busiest single thread of either process, per measured message: the rate a host
  // with a CPU for every thread would be bound by (ecx bench e2e sets ECX's against it).
  std::optional<double> busiest_thread_us_per_message;
  std::string busiest_thread;  // "sender" or "receiver", then the thread's name
  // The same threads' sleeps per message (sim::ThreadCpu::sleeps_since), and those of
  // each side's UCX progress thread alone.
  std::optional<double> sleeps_per_message;
  std::optional<double> receiver_progress_sleeps_per_message;
  std::optional<double> sender_progress_sleeps_per_message;
  // When the measured messages were sent, first to last completed: seconds of the
  // host's monotonic clock, which every process of the host shares (ecx bench e2e
  // places them against ECX's phase). With --repeat, the last run's.
  std::optional<double> measured_from_s, measured_to_s;
  std::uint64_t count = 0;
};

// The name ECX's UCX worker gives its progress thread.
constexpr std::string_view kProgressThread = "ecx-ucx";

std::uint64_t sum_over_threads(const std::map<std::string, std::uint64_t>& by_thread) {
  std::uint64_t total = 0;
  for (const auto& [name, ns] : by_thread) total += ns;
  return total;
}

// The busiest thread: its name and figure (0 where none ran).
std::pair<std::string, std::uint64_t> busiest_thread_of(const std::map<std::string, std::uint64_t>& by_thread) {
  std::pair<std::string, std::uint64_t> most{"-", 0};
  for (const auto& [name, ns] : by_thread) {
    if (ns > most.second) most = {name, ns};
  }
  return most;
}

// The UCX progress thread's figure (0 where it did not run).
std::uint64_t progress_thread_of(const std::map<std::string, std::uint64_t>& by_thread) {
  const auto found = by_thread.find(std::string(kProgressThread));
  return found == by_thread.end() ? 0 : found->second;
}

double percentile(std::vector<double> values, double rank) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto index = static_cast<std::size_t>(std::ceil(rank / 100.0 * static_cast<double>(values.size()))) - 1;
  return values[std::min(index, values.size() - 1)];
}

// The Mooncake consumer half: registers `window` slots and says where they are; the
// producer writes into them one-sidedly. At the end the slots must hold its bytes.
int run_mooncake_consumer(const BenchOptions& options) {
  const std::uint64_t bytes = options.consumer_slot_bytes * options.window;
  auto slab = pool::Slab::allocate(pool::MemoryKind::host, bytes, pool::SlabOptions{.prefault = true});
  if (!slab) {
    std::cerr << "consumer: " << slab.status().to_string() << "\n";
    return 1;
  }
  auto created = transport::create_mooncake_transport(transport::MooncakeOptions{});
  if (!created) {
    std::cerr << "consumer: " << created.status().to_string() << "\n";
    return 1;
  }
  auto& transport = *created;
  if (!transport->register_region(slab->data(), slab->size(), transport::MemoryKind::host)) return 1;
  std::cout << "address " << transport->segment_name() << " " << reinterpret_cast<std::uint64_t>(slab->data())
            << std::endl;
  for (std::string line; std::getline(std::cin, line);) {
    if (line.starts_with("quit")) break;
  }
  const bool intact = std::all_of(slab->data(), slab->data() + bytes, [](std::byte b) { return b == std::byte{0x3c}; });
  std::cout << (intact ? "landed ok" : "landed corrupt") << std::endl;
  return 0;
}

// The consumer half: lands every payload in a slot of its registered pool.
int run_consumer(const BenchOptions& options) {
  if (!uses_ucx(options.transport)) return run_mooncake_consumer(options);
  const std::uint64_t slot = options.consumer_slot_bytes;
  const std::uint64_t alignment = 4096;
  // One slot that every payload lands in, or the --spread ring (see the resolver).
  const std::uint64_t pool_bytes = std::max(slot, options.spread);
  auto slab = pool::Slab::allocate(pool::MemoryKind::host, pool_bytes, pool::SlabOptions{.prefault = true});
  if (!slab) {
    std::cerr << "consumer: " << slab.status().to_string() << "\n";
    return 1;
  }
  transport::UcxOptions ucx;
  ucx.tls = std::string(ucx_tls(options.transport));
  ucx.peer_error_handling = ecx_peer_errors(options);
  // As an ECX consumer: the same endpoints, so the same UCX lanes.
  ucx.address_kind = transport::receiver_address_kind(ucx.peer_error_handling);
  ucx.mode = transport::parse_ucx_mode(options.mode).value_or(transport::UcxMode::am);
  // Without --spread every payload lands at the start of the pool, as ucx_perftest
  // receives every message of its window into one buffer: the same memory footprint.
  // (A window of distinct slots does not: at 9 MiB, 4 in flight, their 72 MiB left the
  // CPU cache perftest's buffers stay in, and ECX measured 2.9-3.0 GB/s against 4.2
  // with one slot over tcp, 9.6 against 12.1-12.7 over shared memory.)
  // --spread: landings go round a ring (the UCX thread resolves them one at a time); it
  // holds at least 4 windows of slots, so a landing under way is never reused.
  std::uint64_t ring_cursor = 0;
  ucx.resolver = [&](std::span<const std::byte>, std::uint64_t bytes) -> Result<transport::Landing> {
    if (options.spread == 0) return transport::Landing{slab->data(), bytes, 0};
    const std::uint64_t step = (bytes + alignment - 1) / alignment * alignment;
    if (ring_cursor + step > options.spread) ring_cursor = 0;
    const std::uint64_t at = ring_cursor;
    ring_cursor += step;
    return transport::Landing{slab->data() + at, bytes, at};
  };
  std::mutex mutex;
  std::condition_variable landed;
  std::uint64_t outcomes = 0;
  std::vector<double> delivery_us;         // of the payloads the producer marked as measured
  std::optional<sim::ThreadCpu> cpu_from;  // at the first measured landing (the warm-up is not stamped)
  ucx.on_landing = [&](std::span<const std::byte> header, const transport::Landing& /*landing*/, const Status& status) {
    const std::int64_t now_ns = monotonic_ns();
    std::lock_guard lock(mutex);
    ++outcomes;
    if (const auto sent = sent_stamp(header); status && sent) {
      delivery_us.push_back(static_cast<double>(now_ns - *sent) / 1e3);
      if (!cpu_from) cpu_from = sim::ThreadCpu::now();
    }
    landed.notify_all();
  };
  auto created = transport::create_ucx_transport(ucx);
  if (!created) {
    std::cerr << "consumer: " << created.status().to_string() << "\n";
    return 1;
  }
  auto& transport = *created;
  if (!transport->register_region(slab->data(), slab->size(), transport::MemoryKind::host)) return 1;
  auto address = transport->listen("127.0.0.1", 0);
  if (!address) {
    std::cerr << "consumer: " << address.status().to_string() << "\n";
    return 1;
  }
  std::cout << "address " << *address << std::endl;
  // "quit N": N payloads were sent; wait (bounded) until they all had their outcome.
  std::string line;
  std::uint64_t expected = 0;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string word;
    in >> word >> expected;
    if (word == "quit") break;
  }
  {
    std::unique_lock lock(mutex);
    landed.wait_for(lock, 30s, [&] { return outcomes + transport->stats().landings_rejected >= expected; });
  }
  const auto stats = transport->stats();
  std::lock_guard lock(mutex);
  const auto cpu_to = sim::ThreadCpu::now();
  const auto used = cpu_from ? cpu_to.used_since(*cpu_from) : std::map<std::string, std::uint64_t>{};
  const auto sleeps = cpu_from ? cpu_to.sleeps_since(*cpu_from) : std::map<std::string, std::uint64_t>{};
  std::cout << "landed " << stats.landings_ok << " failed " << stats.landings_failed << " delivery_us "
            << percentile(delivery_us, 50) << " " << percentile(delivery_us, 99) << " cpu_ns " << sum_over_threads(used)
            << " sleeps " << sum_over_threads(sleeps) << " " << progress_thread_of(sleeps);
  // Thread names carry no spaces (sim::ThreadCpu reads them from /proc, 15 characters).
  const auto [busiest_name, busiest_ns] = busiest_thread_of(used);
  std::cout << " busiest_ns " << busiest_ns << " " << busiest_name << std::endl;
  return 0;
}

// The producer half: one run of `count` sends of `size` bytes, `window` in flight.
// Keeps up to `window` asynchronous operations (sends or one-sided writes) in
// flight and records each one's start-to-completion latency. `issue(i, done)` starts
// operation i and arranges for `done` to be called once with its outcome.
class WindowedOps {
 public:
  using Done = std::function<void(Status)>;
  using Issue = std::function<Status(std::uint64_t index, Done done)>;

  WindowedOps(std::uint64_t window, std::uint64_t expected, Duration gap = Duration::zero())
      : window_(window), gap_(gap) {
    latencies_us_.reserve(expected);
  }

  // The first error among the `n` operations, or ok; latencies are kept when `record`.
  Status run(std::uint64_t n, bool record, const Issue& issue) {
    for (std::uint64_t i = 0; i < n; ++i) {
      {
        std::unique_lock lock(mutex_);
        if (!changed_.wait_for(lock, 60s, [&] { return in_flight_ < window_; })) {
          return timeout_error("operations stalled");
        }
        ++in_flight_;
      }
      if (gap_ > Duration::zero()) std::this_thread::sleep_for(gap_);  // the pause asked for (--gap), not a wait
      const auto started = Clock::now();
      auto status = issue(i, [this, started, record](const Status& s) {
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - started).count();
        std::lock_guard lock(mutex_);
        --in_flight_;
        if (!s) {
          if (first_error_) first_error_ = s;
        } else if (record) {
          latencies_us_.push_back(us);
        }
        changed_.notify_all();
      });
      if (!status) return status;
    }
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, 120s, [&] { return in_flight_ == 0; })) {
      return timeout_error("operations never completed");
    }
    return first_error_;
  }

  const std::vector<double>& latencies_us() const { return latencies_us_; }

 private:
  const std::uint64_t window_;
  const Duration gap_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::uint64_t in_flight_ = 0;
  std::vector<double> latencies_us_;
  Status first_error_;
};

// How long --hold waits for the go: ecx bench e2e gives it once ECX's processes have
// set up (seconds) or measured their phase (at most its --phase-timeout, 300 s by
// default), and kills this process if it gives up sooner.
constexpr std::chrono::milliseconds kHoldLimit = std::chrono::minutes(30);

Result<Series> run_ecx(const BenchOptions& options, std::uint64_t size, std::uint64_t count) {
  Child consumer({self_executable(), "bench", "transport", "--consumer", "--transport",
                  std::string(data_link_name(ucx_link(options))), "--mode", options.mode, "--window",
                  std::to_string(options.window), "--slot-bytes", std::to_string(size), "--consumer-spread",
                  std::to_string(options.spread)},
                 {});
  if (!consumer.started()) return internal_error("cannot start the consumer process");
  // UCX may print warnings on stdout before the address line: skip them.
  auto line = consumer.read_line(30s);
  while (line && !line->starts_with("address ")) line = consumer.read_line(30s);
  if (!line) return unavailable("the consumer process did not start listening");

  const std::uint64_t window = options.window;
  // Sent from in turn: one buffer for every message in flight, as ucx_perftest does, or
  // the --spread ring.
  const std::uint64_t slots = options.spread != 0 ? options.spread / size : 1;
  std::optional<pool::Slab> slab;  // outlives the transport it is registered with
  transport::UcxOptions ucx;
  ucx.tls = std::string(ucx_tls(options.transport));
  ucx.peer_error_handling = ecx_peer_errors(options);
  ucx.mode = transport::parse_ucx_mode(options.mode).value_or(transport::UcxMode::am);
  ucx.shared_sources = options.shared_sources;
  ucx.rndv_threshold_bytes = options.rndv_threshold;
  auto created = transport::create_ucx_transport(ucx);
  if (!created) return created.status();
  auto& transport = *created;
  // A memfd only where the transport uses it (as the producer's staging pool): it gets
  // no huge pages, so a tcp run keeps anonymous memory.
  const bool shared = transport->capabilities().shared_sources;
  auto allocated =
      pool::Slab::allocate(pool::MemoryKind::host, size * slots, pool::SlabOptions{.prefault = true, .shared = shared});
  if (!allocated) return allocated.status();
  slab.emplace(std::move(*allocated));
  std::memset(slab->data(), 0x3c, slab->size());
  auto region = shared ? transport->register_shared_region(slab->data(), slab->size(),
                                                           transport::SharedBacking{slab->shared_fd(), 0})
                       : transport->register_region(slab->data(), slab->size(), transport::MemoryKind::host);
  if (!region) return region.status();
  auto endpoint = transport->connect(line->substr(8));
  if (!endpoint) return endpoint.status();

  WindowedOps ops(window, count, std::chrono::microseconds(options.gap_us));
  const auto clock = SteadyClock::shared();
  auto run_batch = [&](std::uint64_t n, bool record) -> Status {
    return ops.run(n, record, [&](std::uint64_t i, WindowedOps::Done done) {
      std::array<std::byte, 64> header{};
      if (record) stamp_sent(header);  // the warm-up is not stamped: not measured
      return transport->send(*endpoint, header, *region, (i % slots) * size, size, clock->now() + 60s, std::move(done));
    });
  };

  const std::uint64_t warmup = std::max<std::uint64_t>(window * 2, count / 10);
  ECX_RETURN_IF_ERROR(run_batch(warmup, false));
  if (options.hold) ECX_RETURN_IF_ERROR(hold_for_go("holding", kHoldLimit));
  const auto cpu_from = sim::ThreadCpu::now();
  const auto begin = Clock::now();
  ECX_RETURN_IF_ERROR(run_batch(count, true));
  const auto end = Clock::now();
  const double seconds = std::chrono::duration<double>(end - begin).count();
  const auto cpu_to = sim::ThreadCpu::now();
  const auto sender_used = cpu_to.used_since(cpu_from);
  const std::uint64_t sender_cpu_ns = sum_over_threads(sender_used);
  const auto sender_sleeps = cpu_to.sleeps_since(cpu_from);
  // A payload the consumer could not place would still count as sent here: check.
  consumer.write_line(fmt::format("quit {}", warmup + count));
  const auto landed = consumer.read_line(30s);
  const std::string expected = fmt::format("landed {} failed 0 delivery_us ", warmup + count);
  if (!landed.value_or("").starts_with(expected)) {
    return internal_error(
        fmt::format("consumer reported '{}', expected '{}...'", landed.value_or("nothing"), expected));
  }
  std::istringstream delivery(landed->substr(expected.size()));
  double delivery_p50 = 0;
  double delivery_p99 = 0;
  std::string cpu_word;
  std::uint64_t receiver_cpu_ns = 0;
  std::string sleeps_word;
  std::uint64_t receiver_sleeps = 0;
  std::uint64_t receiver_progress_sleeps = 0;
  std::string busiest_word;
  std::uint64_t receiver_busiest_ns = 0;
  std::string receiver_busiest_name;
  delivery >> delivery_p50 >> delivery_p99 >> cpu_word >> receiver_cpu_ns >> sleeps_word >> receiver_sleeps >>
      receiver_progress_sleeps >> busiest_word >> receiver_busiest_ns >> receiver_busiest_name;
  Series series;
  series.name = "ecx";
  series.transport = data_link_name(ucx_link(options));
  series.size = size;
  series.count = count;
  series.gbps = static_cast<double>(size * count) / seconds / 1e9;
  series.measured_from_s = std::chrono::duration<double>(begin.time_since_epoch()).count();
  series.measured_to_s = std::chrono::duration<double>(end.time_since_epoch()).count();
  series.p50_us = percentile(ops.latencies_us(), 50);
  series.p99_us = percentile(ops.latencies_us(), 99);
  series.delivery_p50_us = delivery_p50;
  series.delivery_p99_us = delivery_p99;
  if (cpu_word == "cpu_ns" && receiver_cpu_ns > 0 && count > 0) {
    series.cpu_us_per_message = static_cast<double>(sender_cpu_ns + receiver_cpu_ns) / 1e3 / static_cast<double>(count);
  }
  if (busiest_word == "busiest_ns" && receiver_busiest_ns > 0 && count > 0) {
    const auto [sender_name, sender_ns] = busiest_thread_of(sender_used);
    const bool sender_busier = sender_ns > receiver_busiest_ns;
    series.busiest_thread = sender_busier ? "sender " + sender_name : "receiver " + receiver_busiest_name;
    series.busiest_thread_us_per_message =
        static_cast<double>(sender_busier ? sender_ns : receiver_busiest_ns) / 1e3 / static_cast<double>(count);
  }
  if (sleeps_word == "sleeps" && count > 0) {
    const auto per_message = [count](std::uint64_t n) { return static_cast<double>(n) / static_cast<double>(count); };
    series.sleeps_per_message = per_message(sum_over_threads(sender_sleeps) + receiver_sleeps);
    series.receiver_progress_sleeps_per_message = per_message(receiver_progress_sleeps);
    series.sender_progress_sleeps_per_message = per_message(progress_thread_of(sender_sleeps));
  }
  return series;
}

// The Mooncake producer half: `count` one-sided writes of `size` bytes, `window` in
// flight, each into its slot of the consumer's registered pool.
Result<Series> run_mooncake(const BenchOptions& options, std::uint64_t size, std::uint64_t count) {
  Child consumer({self_executable(), "bench", "transport", "--consumer", "--transport", "mooncake", "--window",
                  std::to_string(options.window), "--slot-bytes", std::to_string(size)},
                 {});
  if (!consumer.started()) return internal_error("cannot start the consumer process");
  auto line = consumer.read_line(60s);
  std::istringstream words(line.value_or(""));
  std::string word, segment;
  std::uint64_t base = 0;
  words >> word >> segment >> base;
  if (word != "address" || base == 0) return unavailable("the Mooncake consumer process did not start");

  const std::uint64_t window = options.window;
  auto slab = pool::Slab::allocate(pool::MemoryKind::host, size * window, pool::SlabOptions{.prefault = true});
  if (!slab) return slab.status();
  std::memset(slab->data(), 0x3c, slab->size());
  auto created = transport::create_mooncake_transport(transport::MooncakeOptions{});
  if (!created) return created.status();
  auto& transport = *created;
  auto region = transport->register_region(slab->data(), slab->size(), transport::MemoryKind::host);
  if (!region) return region.status();
  auto endpoint = transport->connect(segment);
  if (!endpoint) return endpoint.status();

  WindowedOps ops(window, count);
  const auto clock = SteadyClock::shared();
  auto run_batch = [&](std::uint64_t n, bool record) -> Status {
    return ops.run(n, record, [&](std::uint64_t i, WindowedOps::Done done) {
      const std::uint64_t slot = (i % window) * size;
      return transport->write(*endpoint, *region, slot, size, base + slot, clock->now() + 60s, std::move(done));
    });
  };
  const std::uint64_t warmup = std::max<std::uint64_t>(window * 2, count / 10);
  ECX_RETURN_IF_ERROR(run_batch(warmup, false));
  const auto begin = Clock::now();
  ECX_RETURN_IF_ERROR(run_batch(count, true));
  const double seconds = std::chrono::duration<double>(Clock::now() - begin).count();
  consumer.write_line("quit");
  const auto landed = consumer.read_line(30s);
  if (landed.value_or("") != "landed ok") {
    return internal_error(fmt::format("consumer reported '{}', expected 'landed ok'", landed.value_or("nothing")));
  }
  Series series;
  series.name = "ecx_mooncake";
  series.transport = "mooncake";
  series.size = size;
  series.count = count;
  series.gbps = static_cast<double>(size * count) / seconds / 1e9;
  series.p50_us = percentile(ops.latencies_us(), 50);
  series.p99_us = percentile(ops.latencies_us(), 99);
  return series;
}

bool port_is_listening(int port) {
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (colon == std::string::npos) continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port && state == "0A") return true;
    }
  }
  return false;
}

Result<int> free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) ::close(fd);
    return unavailable("no free loopback port");
  }
  ::close(fd);
  return static_cast<int>(ntohs(address.sin_port));
}

// ucx_perftest server and client on loopback; parses the client's final line:
// iterations, 50%ile, avg and overall overhead (us), avg and overall bandwidth
// (MB/s, which ucx_perftest counts in MiB), avg and overall message rate.
// `primitive`: am, tag, stream or put (ucx_perftest's ucp_am_bw, tag_bw, stream_bw,
// ucp_put_bw). It runs
// with the TCP segment size ECX sets for itself (ucx_tcp_seg_size's default), so the
// baseline is UCX at its best on this transport, not UCX at its defaults.
// ucx_perftest's bandwidth tests ECX is measured against (ucp_<name>_bw); put is the
// one-sided one, which some transports emulate or lack.
constexpr std::string_view kPeerErrorsSuffix = "_peer_errors";

struct PerftestPrimitive {
  std::string_view name;
  bool one_sided;
  std::string_view test;  // ucx_perftest 1.13's -t name
};
constexpr std::array<PerftestPrimitive, 4> kPerftestPrimitives{{{"am", false, "ucp_am_bw"},
                                                                {"tag", false, "tag_bw"},
                                                                {"stream", false, "stream_bw"},
                                                                {"put", true, "ucp_put_bw"}}};

const PerftestPrimitive* find_primitive(std::string_view name) {
  for (const auto& primitive : kPerftestPrimitives) {
    if (primitive.name == name) return &primitive;
  }
  return nullptr;
}

bool is_peer_errors_series(std::string_view name) { return name.ends_with(kPeerErrorsSuffix); }

std::string perftest_series_name(std::string_view primitive, bool error_handling) {
  return fmt::format("ucx_perftest_{}_bw{}", primitive, error_handling ? kPeerErrorsSuffix : "");
}

bool one_sided_primitive(std::string_view name) {
  const auto* primitive = find_primitive(name);
  return primitive != nullptr && primitive->one_sided;
}

// `error_handling`: endpoints with UCP_ERR_HANDLING_MODE_PEER (-e), as ECX's are over
// tcp; the series is then named ucx_perftest_<name>_bw_peer_errors.
Result<Series> run_perftest(const BenchOptions& options, const std::string& primitive, std::uint64_t size,
                            std::uint64_t count, bool error_handling) {
  auto port = free_port();
  if (!port) return port.status();
  const std::string seg = std::to_string(transport::UcxOptions{}.tcp_seg_size_bytes);
  const std::vector<std::pair<std::string, std::string>> env = {
      {"UCX_TLS", std::string(ucx_tls(options.transport))}, {"UCX_TCP_RX_SEG_SIZE", seg}, {"UCX_TCP_TX_SEG_SIZE", seg}};
  // Put over tcp is emulated by UCX at ~0.2 GB/s: fewer messages keep its run short.
  if (one_sided_primitive(primitive)) count = std::max<std::uint64_t>(20, count / 8);
  const std::string iterations = std::to_string(count);
  const std::string warmup = std::to_string(std::max<std::uint64_t>(std::uint64_t{options.window} * 2, count / 10));
  const auto* known = find_primitive(primitive);
  if (known == nullptr) return invalid_argument(fmt::format("ucx_perftest primitive '{}'", primitive));
  const std::string test(known->test);
  std::vector<std::string> common = {"-t", test,   "-s", std::to_string(size),  "-n", iterations,
                                     "-w", warmup, "-p", std::to_string(*port), "-f"};
  if (error_handling) common.emplace_back("-e");
  std::vector<std::string> server_args = {"ucx_perftest"};
  server_args.insert(server_args.end(), common.begin(), common.end());
  Child server(server_args, env);
  if (!server.started()) return unavailable("cannot start ucx_perftest (install ucx-utils)");
  const auto give_up = Clock::now() + 10s;
  while (!port_is_listening(*port)) {
    if (Clock::now() > give_up) return unavailable("ucx_perftest server did not start listening");
    std::this_thread::sleep_for(5ms);
  }
  std::vector<std::string> client_args = {"ucx_perftest", "127.0.0.1"};
  client_args.insert(client_args.end(), common.begin(), common.end());
  Child client(client_args, env);
  const std::string output = client.read_all(300s);
  const bool ok = client.wait(10s);
  server.wait(10s);
  std::istringstream lines(output);
  std::string line, last;
  while (std::getline(lines, line)) {
    if (line.find_first_not_of(" \t") != std::string::npos) last = line;
  }
  std::istringstream fields(last);
  std::vector<double> numbers;
  // Tokens one by one: ucx_perftest prints "inf" for a latency it could not time.
  for (std::string token; fields >> token;) {
    char* end = nullptr;
    const double value = std::strtod(token.c_str(), &end);
    if (end == token.c_str()) break;
    numbers.push_back(value);
  }
  if (!ok || numbers.size() != 8) {
    return unavailable(fmt::format("ucx_perftest failed or printed no result: '{}'", last));
  }
  Series series;
  series.name = perftest_series_name(primitive, error_handling);
  series.transport = data_link_name(options.transport);
  series.size = size;
  series.count = count;
  series.gbps = numbers[5] * 1024 * 1024 / 1e9;
  return series;
}

Series run_memcpy(const std::string& transport, std::uint64_t size, std::uint64_t count) {
  std::vector<std::byte> source(size, std::byte{1});
  std::vector<std::byte> destination(size, std::byte{0});
  std::memcpy(destination.data(), source.data(), size);  // warm both buffers
  // At least ~0.2 s of copying so small sizes are measurable.
  const auto repetitions = std::max<std::uint64_t>(count, (200ULL << 20) / size);
  const auto begin = Clock::now();
  for (std::uint64_t i = 0; i < repetitions; ++i) {
    std::memcpy(destination.data(), source.data(), size);
    source[i % size] = destination[(i * 7) % size];  // keeps the copies observable
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - begin).count();
  Series series;
  series.name = "memcpy";
  series.transport = transport;
  series.size = size;
  series.count = repetitions;
  series.gbps = static_cast<double>(size * repetitions) / seconds / 1e9;
  return series;
}

nlohmann::json to_json(const Series& s) {
  nlohmann::json j = {{"series", s.name}, {"transport", s.transport}, {"size_bytes", s.size}, {"gbps", s.gbps}};
  if (s.p50_us) j["p50_us"] = *s.p50_us;
  if (s.p99_us) j["p99_us"] = *s.p99_us;
  if (s.delivery_p50_us) j["delivery_p50_us"] = *s.delivery_p50_us;
  if (s.delivery_p99_us) j["delivery_p99_us"] = *s.delivery_p99_us;
  if (s.ratio_vs_perftest) j["ratio_vs_ucx_perftest"] = *s.ratio_vs_perftest;
  if (s.ratio_vs_perftest_same_mode) j["ratio_vs_ucx_perftest_same_mode"] = *s.ratio_vs_perftest_same_mode;
  if (s.cpu_us_per_message) j["cpu_us_per_message"] = *s.cpu_us_per_message;
  if (s.busiest_thread_us_per_message) {
    j["busiest_thread_us_per_message"] = *s.busiest_thread_us_per_message;
    j["busiest_thread"] = s.busiest_thread;
  }
  if (s.measured_from_s) j["measured_from_s"] = *s.measured_from_s;
  if (s.measured_to_s) j["measured_to_s"] = *s.measured_to_s;
  if (s.sleeps_per_message) j["sleeps_per_message"] = *s.sleeps_per_message;
  if (s.receiver_progress_sleeps_per_message) {
    j["receiver_progress_sleeps_per_message"] = *s.receiver_progress_sleeps_per_message;
  }
  if (s.sender_progress_sleeps_per_message) {
    j["sender_progress_sleeps_per_message"] = *s.sender_progress_sleeps_per_message;
  }
  return j;
}

Status plot_series(const std::string& png, const std::vector<Series>& all) {
  PlotSpec spec;
  spec.png = png;
  spec.title = fmt::format("ecx bench transport ({})", all.empty() ? "" : all.front().transport);
  spec.x_label = "message size";
  spec.y_label = "GB/s (10^9 bytes/s)";
  spec.log_x = true;
  spec.x_bytes = true;
  for (const std::string name : {"ecx", "ecx_mooncake", "ucx_perftest_am_bw", "ucx_perftest_tag_bw",
                                 "ucx_perftest_stream_bw", "ucx_perftest_put_bw", "memcpy"}) {
    PlotLine line{name, {}, false};
    for (const auto& s : all) {
      if (s.name == name) line.points.emplace_back(static_cast<double>(s.size), s.gbps);
    }
    spec.lines.push_back(std::move(line));
  }
  return write_plot(spec);
}

int run_bench(BenchOptions options) {
  if (options.hold) block_go_signal();  // before the transport starts its threads
  log::set_level(spdlog::level::warn);
  if (options.consumer) return run_consumer(options);
  const bool mooncake = !uses_ucx(options.transport);
  if (mooncake) {
    if (auto available = transport::mooncake_library_available(); !available) {
      std::cerr << "ecx bench transport: " << available.message() << "\n";
      return 2;
    }
  }
  if (!transport::parse_ucx_mode(options.mode)) {
    std::cerr << "ecx bench transport: --mode must be am or put\n";
    return 2;
  }
  std::vector<std::uint64_t> sizes;
  if (options.sizes_text == "sweep") {
    sizes.assign(kSweepSizes.begin(), kSweepSizes.end());
  } else if (!options.sizes_text.empty()) {
    std::istringstream list(options.sizes_text);
    for (std::string item; std::getline(list, item, ',');) {
      auto size = parse_byte_size(item);
      if (!size) {
        std::cerr << "ecx bench transport: " << size.status().message() << "\n";
        return 2;
      }
      sizes.push_back(*size);
    }
  } else if (options.size_text.empty()) {
    sizes.assign(kDefaultSizes.begin(), kDefaultSizes.end());
  } else {
    auto size = parse_byte_size(options.size_text);
    if (!size) {
      std::cerr << "ecx bench transport: " << size.status().message() << "\n";
      return 2;
    }
    sizes.push_back(*size);
  }

  if (!options.spread_text.empty()) {
    auto spread = parse_byte_size_or_zero(options.spread_text);
    if (!spread) {
      std::cerr << "ecx bench transport: --spread: " << spread.status().message() << "\n";
      return 2;
    }
    const std::uint64_t needed = *std::max_element(sizes.begin(), sizes.end()) * options.window * 4;
    if (*spread != 0 && *spread < needed) {
      std::cerr << fmt::format(
          "ecx bench transport: --spread {} must hold at least 4 windows of the largest size ({} bytes)\n",
          options.spread_text, needed);
      return 2;
    }
    options.spread = *spread;
  }
  if (!options.rndv_text.empty()) {
    auto threshold = parse_byte_size_or_zero(options.rndv_text);
    if (!threshold) {
      std::cerr << "ecx bench transport: --rndv-thresh: " << threshold.status().message() << "\n";
      return 2;
    }
    options.rndv_threshold = *threshold;
  }
  // Both sides busy-poll in ucx_perftest; on a loaded machine that costs it more than
  // ECX's sleeping progress thread, so the load is part of the result.
  std::string load = "?";
  if (std::ifstream loadavg("/proc/loadavg"); loadavg) loadavg >> load;
  std::cout << fmt::format(
      "ecx bench transport: {} (UCX_TLS={}), mode {}{}, window {}{}, median of {} runs, UCX {}, load average {} "
      "on {} CPUs\n",
      mooncake ? std::string("mooncake (tcp) next to UCX tcp") : std::string(data_link_name(options.transport)),
      ucx_tls(options.transport), options.mode,
      options.mode != "am"          ? std::string()
      : options.rndv_threshold == 0 ? std::string(", UCX picks eager or rendezvous")
                                    : fmt::format(", ECX's sends rendezvous from {} bytes", options.rndv_threshold),
      options.window,
      (options.spread != 0 ? fmt::format(", ECX spread over {} bytes", options.spread) : std::string()) +
          (options.gap_us != 0 ? fmt::format(", each ECX send {} us after one completed", options.gap_us)
                               : std::string()),
      options.repeat, transport::ucx_library_version(), load, std::thread::hardware_concurrency());
  std::cout << fmt::format("{:>10} {:>34} {:>9} {:>10} {:>10} {:>8} {:>10}\n", "size", "series", "GB/s", "p50 us",
                           "p99 us", "ratio", "same mode");
  std::vector<Series> all;
  int rc = 0;
  std::vector<std::string> primitives;
  if (!options.skip_perftest) {
    std::istringstream list(options.perftests);
    for (std::string item; std::getline(list, item, ',');) {
      if (find_primitive(item) == nullptr) {
        std::cerr << "ecx bench transport: --perftest '" << item << "': expected am, tag, stream or put\n";
        return 2;
      }
      primitives.push_back(item);
    }
  }
  for (const auto size : sizes) {
    const std::uint64_t count = options.count != 0 ? options.count : auto_count(size);
    std::vector<Series> ecx_runs, mooncake_runs;
    std::map<std::string, std::vector<Series>> perftest_runs;                    // by series name
    std::map<std::string, std::pair<std::string, std::string>> perftest_errors;  // name -> (primitive, error)
    // Each primitive as UCX runs it at its best (no error handling) and, where ECX's
    // endpoints have it, with peer error handling too: the same mode as ECX.
    std::vector<bool> perftest_modes = {false};
    if (ecx_peer_errors(options)) perftest_modes.push_back(true);
    // Interleaved repetitions, so load from anything else on the machine hits both.
    for (std::uint32_t r = 0; r < options.repeat; ++r) {
      if (mooncake) {
        auto written = run_mooncake(options, size, count);
        if (!written) {
          std::cerr << "ecx bench transport: mooncake run failed: " << written.status().to_string() << "\n";
          return 1;
        }
        mooncake_runs.push_back(*written);
      }
      auto ecx = run_ecx(options, size, count);
      if (!ecx) {
        std::cerr << "ecx bench transport: ecx run failed: " << ecx.status().to_string() << "\n";
        return 1;
      }
      ecx_runs.push_back(*ecx);
      for (const bool error_handling : perftest_modes) {
        for (const auto& primitive : primitives) {
          const std::string name = perftest_series_name(primitive, error_handling);
          auto perftest = run_perftest(options, primitive, size, count, error_handling);
          if (perftest) {
            perftest_runs[name].push_back(*perftest);
          } else {
            perftest_errors[name] = {primitive, perftest.status().message()};
          }
        }
      }
    }
    auto pick_median = [](std::vector<Series>& runs) {
      std::sort(runs.begin(), runs.end(), [](const Series& a, const Series& b) { return a.gbps < b.gbps; });
      return runs[runs.size() / 2];
    };
    Series ecx = pick_median(ecx_runs);
    // The baseline is the best primitive at this size (median of its runs); the
    // same-mode baseline the best of those run with peer error handling.
    std::vector<Series> perftests;
    perftests.reserve(perftest_runs.size());
    for (auto& [name, runs] : perftest_runs) perftests.push_back(pick_median(runs));
    std::sort(perftests.begin(), perftests.end(), [](const Series& a, const Series& b) {
      return std::pair(is_peer_errors_series(a.name), a.name) < std::pair(is_peer_errors_series(b.name), b.name);
    });
    std::optional<Series> perftest, perftest_same_mode;
    for (const auto& p : perftests) {
      auto& best = is_peer_errors_series(p.name) ? perftest_same_mode : perftest;
      if (!best || p.gbps > best->gbps) best = p;
    }
    Series copy = run_memcpy(std::string(data_link_name(options.transport)), size, count);
    if (perftest) ecx.ratio_vs_perftest = ecx.gbps / perftest->gbps;
    if (perftest_same_mode) ecx.ratio_vs_perftest_same_mode = ecx.gbps / perftest_same_mode->gbps;
    if (mooncake) {
      Series written = pick_median(mooncake_runs);
      if (perftest) written.ratio_vs_perftest = written.gbps / perftest->gbps;
      std::cout << fmt::format("{:>10} {:>20} {:>9.2f} {:>10.1f} {:>10.1f} {:>8}  ({:.2f} x ecx over UCX tcp)\n",
                               byte_size_label(size), "ecx_mooncake", written.gbps, *written.p50_us, *written.p99_us,
                               written.ratio_vs_perftest ? fmt::format("{:.2f}", *written.ratio_vs_perftest) : "-",
                               written.gbps / ecx.gbps);
      all.push_back(written);
    }

    auto ratio_text = [](const std::optional<double>& ratio) {
      return ratio ? fmt::format("{:.2f}", *ratio) : std::string("-");
    };
    std::cout << fmt::format("{:>10} {:>34} {:>9.2f} {:>10.1f} {:>10.1f} {:>8} {:>10}\n",
                             mooncake ? "" : byte_size_label(size), mooncake ? "ecx (ucx tcp)" : "ecx", ecx.gbps,
                             *ecx.p50_us, *ecx.p99_us, ratio_text(ecx.ratio_vs_perftest),
                             ratio_text(ecx.ratio_vs_perftest_same_mode));
    for (auto& p : perftests) {
      const bool same_mode = is_peer_errors_series(p.name);
      if (perftest) p.ratio_vs_perftest = p.gbps / perftest->gbps;
      if (same_mode) p.ratio_vs_perftest_same_mode = p.gbps / perftest_same_mode->gbps;
      const auto& best = same_mode ? perftest_same_mode : perftest;
      std::cout << fmt::format("{:>10} {:>34} {:>9.2f} {:>10} {:>10} {:>8} {:>10}{}\n", "", p.name, p.gbps, "-", "-",
                               ratio_text(p.ratio_vs_perftest), ratio_text(p.ratio_vs_perftest_same_mode),
                               p.name == best->name ? "  (best)" : "");
    }
    for (const auto& [name, failure] : perftest_errors) {
      if (perftest_runs.count(name)) continue;
      std::cout << fmt::format("{:>10} {:>34}   failed: {}\n", "", name, failure.second);
      // Put needs an RMA lane some transports lack; the others must run.
      if (!one_sided_primitive(failure.first)) rc = 1;
    }
    std::cout << fmt::format("{:>10} {:>34} {:>9.2f} {:>10} {:>10} {:>8}\n", "", "memcpy", copy.gbps, "-", "-",
                             perftest ? fmt::format("{:.2f}", copy.gbps / perftest->gbps) : "-");
    std::cout << std::flush;
    all.push_back(ecx);
    for (const auto& p : perftests) all.push_back(p);
    all.push_back(copy);
  }
  std::cout << "ratio: GB/s divided by the best ucx_perftest primitive's at that size (each run with ECX's TCP "
               "segment size, without error handling: UCX at its best); same mode: divided by the best primitive "
               "run with peer error handling (ucx_perftest -e, the *_peer_errors series), as ECX's endpoints are "
               "over tcp; p50/p99: per-message send-to-completion latency with the window in flight\n";
  if (!options.json_file.empty()) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& s : all) list.push_back(to_json(s));
    std::ofstream out(options.json_file);
    out << list.dump(2) << "\n";
    if (!out) {
      std::cerr << "ecx bench transport: cannot write " << options.json_file << "\n";
      return 1;
    }
  }
  if (!options.plot_file.empty()) {
    if (auto st = plot_series(options.plot_file, all); !st) {
      std::cerr << "ecx bench transport: " << st.message() << "\n";
      return 1;
    }
  }
  return rc;
}

void add_bench_transport_command(CLI::App& app, Runner& run) {
  auto* cmd = bench_subcommand(app)->add_subcommand(
      "transport", "UCX data plane between two processes vs ucx_perftest (am, tag, stream, put) and memcpy");
  auto options = std::make_shared<BenchOptions>();
  add_data_link_option(cmd, options->transport,
                       "tcp or shm (shared memory), or mooncake (Mooncake over tcp, next to UCX tcp; library from "
                       "ECX_MOONCAKE_LIB)");
  cmd->add_option("--size", options->size_text,
                  "one message size, e.g. 9MiB, 64K, 4096 (default: 64KiB,1MiB,4MiB,9MiB)");
  cmd->add_option("--sizes", options->sizes_text,
                  "comma-separated sizes to sweep, or 'sweep' for 4 KiB..64 MiB (overrides --size)");
  cmd->add_option("--count", options->count, "messages per run (0: automatic, ~2 GiB per run)")->capture_default_str();
  cmd->add_option("--window", options->window, "sends kept in flight")->capture_default_str()->check(CLI::Range(1, 64));
  cmd->add_option("--repeat", options->repeat, "interleaved runs per series; the median is reported")
      ->capture_default_str()
      ->check(CLI::Range(1, 20));
  cmd->add_option("--mode", options->mode, "am (active messages) or put (one-sided, for RC verbs)")
      ->capture_default_str();
  cmd->add_option("--json", options->json_file, "write the series as a JSON list to FILE");
  cmd->add_option("--plot", options->plot_file, "draw GB/s against size into FILE.png (gnuplot)");
  cmd->add_option("--perftest", options->perftests,
                  "ucx_perftest primitives to run next to ECX: comma list of am, tag, stream, put")
      ->capture_default_str();
  cmd->add_flag("--no-perftest", options->skip_perftest, "skip the ucx_perftest baselines");
  cmd->add_flag("--shared-sources,!--no-shared-sources", options->shared_sources,
                "send from a memfd, so that over shared memory the consumer copies payloads of at least the "
                "rendezvous threshold out of it itself (default on; off: UCX's rendezvous moves them)");
  cmd->add_option("--spread", options->spread_text,
                  "UCX series: send from and land in a ring of this many bytes (e.g. 1GiB), memory not touched since, "
                  "as ECX's pools do; default: every message is sent from one buffer and lands in one buffer, as "
                  "ucx_perftest's messages do (the same memory footprint)");
  cmd->add_option("--gap", options->gap_us,
                  "UCX series: microseconds each send waits after a send completed, so that it starts on an idle "
                  "plane (with --window 1: one message at a time, as an engine's lone item); 0: back to back")
      ->capture_default_str()
      ->check(CLI::Range(0, 1'000'000));
  cmd->add_option(
      "--rndv-thresh", options->rndv_text,
      fmt::format("ECX series, mode am: payloads of at least this many bytes go rendezvous (UCX fetches "
                  "them into their landing), smaller ones eagerly (copied out of UCX's receive buffer), as "
                  "ECX's ucx_rndv_thresh (over shm, with --shared-sources, the consumer copies those out of "
                  "the sender's memory); 0: UCX decides (default: ucx_rndv_thresh's, {})",
                  byte_size_label(options->rndv_threshold)));
  auto* hold = cmd->add_flag("--hold", options->hold,
                             "print 'holding' after the UCX series' warm-up and send the measured messages only on "
                             "SIGUSR1 (internal: ecx bench e2e)");
  auto* consumer = cmd->add_flag("--consumer", options->consumer, "run the consumer half (internal)");
  auto* slot = cmd->add_option("--slot-bytes", options->consumer_slot_bytes, "consumer slot size (internal)");
  auto* consumer_spread = cmd->add_option("--consumer-spread", options->spread, "ring size in bytes (internal)");
  consumer->group("");
  hold->group("");
  slot->group("");
  consumer_spread->group("");
  cmd->callback([&run, options] { run = [options] { return run_bench(*options); }; });
}

}  // namespace

ECX_REGISTER_COMMAND(add_bench_transport_command);

}  // namespace ecx::cli
