#include "sim/engine_sim.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <thread>
#include <unordered_map>

#include <time.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "connector/scheduler/transfer_params_json.h"
#include "core/logging.h"
#include "ecx/connector/scheduler/coordinator.h"
#include "ecx/connector/scheduler/transfer_params.h"
#include "ecx/connector/worker/scheduler_links.h"
#include "ecx/connector/worker/worker_coordinator.h"
#include "ecx/core/thread_name.h"
#include "ecx/pool/offset_allocator.h"
#include "ecx/pool/slab.h"
#include "ecx/store/store_config.h"
#include "sim/admit_link.h"
#include "sim/admit_message.h"
#include "sim/thread_cpu.h"

namespace ecx::sim {
namespace {

using json = nlohmann::json;
constexpr auto kBusyPause = std::chrono::microseconds(50);
// Longest idle wait of the consumer engine for a transfer event or a new request:
// the cap only bounds what no event announces (the scheduler's own deadlines, whole
// milliseconds to seconds). Measured at 9 MiB, 32 in flight, 2 CPUs: 10 ms instead of
// 1 ms took about 100 us of CPU per item off the engine thread (2-3 idle steps per
// item) and raised the rate 5%.
constexpr auto kIdleStepCap = std::chrono::milliseconds(10);
constexpr std::uint64_t kFullCheckEvery = 16;  // ContentCheck::sampled
// Longest wait, after the run, for the shards to answer the scheduler's last cancels.
constexpr auto kSettleLimit = std::chrono::seconds(5);
// How long a producer retries a refused admit connection (a consumer still binding),
// and waits for the consumer to take its last admit messages.
constexpr auto kAdmitConnectLimit = std::chrono::seconds(10);
constexpr auto kAdmitDoneLimit = std::chrono::seconds(5);

// The proxy's ec_transfer_params for an encoder: where the consumer listens, and each
// item's transfer. Written as text: built as a JSON tree per request, they were most
// of the producer simulator's allocations (about 25 of its 37 per 64 KiB item).
std::string encoder_params(const std::string& consumer_address, const std::vector<Item>& items) {
  std::string out;
  std::size_t room = consumer_address.size() + 40;
  for (const auto& item : items) room += item.transfer_id.size() + 20;
  out.reserve(room);
  out += "{\"consumer_zmq\":";
  scheduler::append_json_string(out, consumer_address);
  out += ",\"ec_items\":[";
  for (std::size_t i = 0; i < items.size(); ++i) {
    out += i == 0 ? "{\"transfer_id\":" : ",{\"transfer_id\":";
    scheduler::append_json_string(out, items[i].transfer_id);
    out += '}';
  }
  out += "]}";
  return out;
}

// False when `seen` has `hash` already; adds it otherwise.
bool first_time(std::vector<std::string_view>& seen, std::string_view hash) {
  if (std::find(seen.begin(), seen.end(), hash) != seen.end()) return false;
  seen.push_back(hash);
  return true;
}

std::vector<scheduler::MmFeature> features_of(const std::vector<Item>& items) {
  std::vector<scheduler::MmFeature> out;
  std::int64_t offset = 0;
  for (const auto& item : items) {
    scheduler::MmFeature f;
    f.identifier = item.mm_hash;
    f.modality = "image";
    f.num_encoder_embeds = item.spec.shape().front();
    f.offset = offset;
    f.length = f.num_encoder_embeds;
    f.output_spec = item.spec;
    offset += f.length + 1;
    out.push_back(std::move(f));
  }
  return out;
}

// One engine thread per TP rank, as vLLM runs one worker process per rank: run(job)
// calls job(rank) for every rank at once (rank 0 on the calling thread) and returns
// when all have finished. The threads are owned and joined by the destructor.
class RankThreads {
 public:
  explicit RankThreads(std::size_t ranks) {
    for (std::size_t rank = 1; rank < ranks; ++rank)
      threads_.emplace_back([this, rank] {
        name_this_thread(fmt::format("{}-r{}", kEngineThreadName, rank));
        loop(rank);
      });
  }
  ~RankThreads() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    start_.notify_all();
    for (auto& t : threads_) t.join();
  }
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  void run(const std::function<void(std::size_t)>& job) {
    if (threads_.empty()) {
      job(0);
      return;
    }
    {
      std::lock_guard lock(mu_);
      job_ = &job;
      remaining_ = threads_.size();
      ++generation_;
    }
    start_.notify_all();
    job(0);
    std::unique_lock lock(mu_);
    // A step waits for every rank (a collective); the bounded wait only re-checks.
    while (remaining_ > 0) done_.wait_for(lock, std::chrono::milliseconds(100));
    job_ = nullptr;
  }

 private:
  void loop(std::size_t rank) {
    std::uint64_t seen = 0;
    std::unique_lock lock(mu_);
    while (true) {
      while (!stop_ && generation_ == seen) start_.wait_for(lock, std::chrono::milliseconds(100));
      if (stop_) return;
      seen = generation_;
      const auto* job = job_;
      lock.unlock();
      (*job)(rank);
      lock.lock();
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable start_;
  std::condition_variable done_;
  const std::function<void(std::size_t)>* job_ = nullptr;
  std::uint64_t generation_ = 0;
  std::size_t remaining_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// A rank's simulated encoder cache. vLLM's encoder cache is memory the engine holds
// for its whole life (a budget on the GPU), so a load copies into warm memory: here
// one arena of `arena_bytes`, touched once at start (before any clock runs) and
// carved by an offset allocator, so a load costs no page fault, no mapping and no
// unmapping (munmap's TLB shootdowns would also stall the ECX threads on the other
// CPU). An entry that does not fit the arena gets a mapping of its own, touched when
// mapped, so a workload larger than the budget still runs; `overflowed` counts them.
class EncoderCache {
 public:
  explicit EncoderCache(std::uint64_t arena_bytes)
      : allocator_(std::max<std::uint64_t>(arena_bytes, kAlignment), kAlignment) {
    pool::SlabOptions options;
    options.prefault = true;
    if (auto arena = pool::Slab::allocate(pool::MemoryKind::host, allocator_.capacity(), options)) {
      arena_.emplace(std::move(*arena));
    }
  }

  Result<std::byte*> insert(const std::string& hash, std::uint64_t nbytes) {
    erase(hash);
    Entry entry;
    entry.nbytes = nbytes;
    std::byte* data = nullptr;
    std::optional<pool::Slot> slot;
    if (arena_) {
      if (auto carved = allocator_.allocate(nbytes)) slot = *carved;
    }
    if (slot) {
      entry.slot = *slot;
      data = arena_->data() + slot->offset;
    } else {
      pool::SlabOptions options;
      options.prefault = true;
      auto own = pool::Slab::allocate(pool::MemoryKind::host, nbytes, options);
      if (!own) return own.status();
      data = own->data();
      overflow_bytes_ += own->size();
      entry.own.emplace(std::move(*own));
      ++overflowed_;
    }
    entries_.insert_or_assign(hash, std::move(entry));
    return data;
  }
  // A zero-copy load: the entry is the landed slot itself, held until erased.
  void adopt(const std::string& hash, consumer::SlotLease lease) {
    erase(hash);
    Entry entry;
    entry.nbytes = lease.nbytes();
    entry.lease.emplace(std::move(lease));
    entries_.insert_or_assign(hash, std::move(entry));
    ++adopted_;
  }
  void erase(const std::string& hash) {
    auto it = entries_.find(hash);
    if (it == entries_.end()) return;
    if (it->second.lease) {
      // Dropping the lease gives the slot back to the pool.
    } else if (it->second.own) {
      overflow_bytes_ -= it->second.own->size();
    } else {
      (void)allocator_.free(it->second.slot);
    }
    entries_.erase(it);
  }
  // Drops the zero-copy entries: their slots go back to the pool.
  void release_views() {
    std::erase_if(entries_, [](const auto& e) { return e.second.lease.has_value(); });
  }
  bool contains(const std::string& hash) const { return entries_.count(hash) > 0; }
  std::optional<std::span<const std::byte>> find(const std::string& hash) const {
    auto it = entries_.find(hash);
    if (it == entries_.end()) return std::nullopt;
    const Entry& e = it->second;
    const std::byte* data = e.lease ? e.lease->data() : e.own ? e.own->data() : arena_->data() + e.slot.offset;
    return std::span<const std::byte>(data, e.nbytes);
  }
  // Memory the cache keeps resident: the arena and the entries beyond it.
  std::uint64_t resident_bytes() const { return (arena_ ? arena_->size() : 0) + overflow_bytes_; }
  std::uint64_t overflowed() const { return overflowed_; }
  std::uint64_t adopted() const { return adopted_; }

 private:
  static constexpr std::uint64_t kAlignment = 256;
  struct Entry {
    pool::Slot slot;                           // in the arena, unless `own`
    std::optional<pool::Slab> own;             // an entry that did not fit the arena
    std::optional<consumer::SlotLease> lease;  // a zero-copy load: the pool's slot
    std::uint64_t nbytes = 0;
  };
  pool::OffsetAllocator allocator_;
  std::optional<pool::Slab> arena_;
  std::unordered_map<std::string, Entry> entries_;
  std::uint64_t overflow_bytes_ = 0;
  std::uint64_t overflowed_ = 0;
  std::uint64_t adopted_ = 0;
};

// The encoder's output memory when zero_copy_saves is on: each output is written
// into a block of one arena and lent to ECX, which sends it in place and gives the
// block back (from its own thread) once the output's pushes are done. Touched at start
// with `prefault` (the bench), as the pools are. Shared with the release callbacks, so
// a late one finds it alive.
class LentOutputs : public std::enable_shared_from_this<LentOutputs> {
 public:
  LentOutputs(std::uint64_t arena_bytes, bool prefault)
      : allocator_(std::max<std::uint64_t>(arena_bytes, kPage), kPage) {
    pool::SlabOptions options;
    options.prefault = prefault;
    if (auto arena = pool::Slab::allocate(pool::MemoryKind::host, allocator_.capacity(), options)) {
      arena_.emplace(std::move(*arena));
      prepared_.assign(arena_->size() / kPage, false);
      if (prefault) prepare(0, arena_->size());
    }
  }
  // A block for an output (holding the content body: only the stamps are left to
  // write), and what gives it back; nullopt when the arena is full.
  std::optional<std::pair<std::span<std::byte>, std::function<void()>>> take(std::uint64_t nbytes) {
    if (!arena_) return std::nullopt;
    std::lock_guard lock(mutex_);
    auto slot = allocator_.allocate(nbytes);
    if (!slot) return std::nullopt;
    ++lent_;
    prepare(slot->offset, nbytes);
    std::span<std::byte> block(arena_->data() + slot->offset, nbytes);
    return std::pair{block, [self = shared_from_this(), slot = *slot] {
                       std::lock_guard held(self->mutex_);
                       (void)self->allocator_.free(slot);
                       --self->lent_;
                     }};
  }
  // Blocks ECX has not given back yet.
  std::uint64_t outstanding() const {
    std::lock_guard lock(mutex_);
    return lent_;
  }

 private:
  static constexpr std::uint64_t kPage =
      kContentBlockBytes;  // a content block, not a memory page: the body repeats at this period
  // The shared content body, written once per page (the first time a block uses it).
  void prepare(std::uint64_t offset, std::uint64_t nbytes) {
    for (std::uint64_t page = offset / kPage; page < (offset + nbytes + kPage - 1) / kPage; ++page) {
      if (prepared_[page]) continue;
      prepare_content_body(std::span<std::byte>(arena_->data() + page * kPage, kPage));
      prepared_[page] = true;
    }
  }

  mutable std::mutex mutex_;
  pool::OffsetAllocator allocator_;
  std::optional<pool::Slab> arena_;
  std::vector<bool> prepared_;
  std::uint64_t lent_ = 0;
};

// The span of a run its CPU figures cover: from the start, or from the end of a
// warm-up (warm_up_requests) to the end. Engine thread only.
class CpuWindow {
 public:
  CpuWindow(std::uint64_t warm_up_requests, std::function<void()> on_opened)
      : warm_up_(warm_up_requests), open_(warm_up_requests == 0), on_opened_(std::move(on_opened)) {}

  // A run without a warm-up counts from its first request, not from its start.
  void first_request(std::uint64_t sim_ns) {
    if (warm_up_ != 0) return;
    from_ = ThreadCpu::now();
    sim_ns_from_ = sim_ns;
  }
  // Opens the window once `requests` reach the warm-up. `sim_ns` and `items` are the
  // run's so far: close() counts only what comes after.
  void reached(std::uint64_t requests, std::uint64_t sim_ns, std::uint64_t items) {
    if (open_ || requests < warm_up_) return;
    open_ = true;
    from_ = ThreadCpu::now();
    sim_ns_from_ = sim_ns;
    items_from_ = items;
    if (on_opened_) on_opened_();
  }
  // The window's figures: its threads' CPU time and sleeps, and `sim_ns` and the
  // items as they stand at the end made the window's own.
  template <typename Result>
  void close(Result& result, std::uint64_t& sim_ns, std::uint64_t items) const {
    const auto to = ThreadCpu::now();
    result.thread_cpu_ns = to.used_since(from_);
    result.thread_sleeps = to.sleeps_since(from_);
    sim_ns -= sim_ns_from_;
    result.window_items = items - items_from_;
  }

 private:
  std::uint64_t warm_up_;
  bool open_;
  std::function<void()> on_opened_;
  ThreadCpu from_ = ThreadCpu::now();
  std::uint64_t sim_ns_from_ = 0;
  std::uint64_t items_from_ = 0;
};

}  // namespace

double percentile(std::vector<double> samples, double pct) {
  if (samples.empty()) return 0.0;
  std::sort(samples.begin(), samples.end());
  const double rank = std::clamp(pct, 0.0, 100.0) / 100.0 * static_cast<double>(samples.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(rank));
  const auto hi = static_cast<std::size_t>(std::ceil(rank));
  return samples[lo] + (samples[hi] - samples[lo]) * (rank - static_cast<double>(lo));
}

// ---------------------------------------------------------------- consumer

struct ConsumerSim::State {
  ConsumerSimOptions options;
  std::shared_ptr<spdlog::logger> log = ecx::log::get("sim");
  // Producers connect and send admit messages; a resolved request whose message asked
  // (wants_answer) is answered on its producer's connection, so a producer can send
  // one item at a time.
  std::unique_ptr<AdmitListener> admit;
  std::unique_ptr<scheduler::SchedulerCoordinator> scheduler;
  std::vector<std::unique_ptr<worker::WorkerCoordinator>> workers;
  std::vector<EncoderCache> caches;  // one encoder cache per TP rank
  std::unique_ptr<RankThreads> ranks;
  TimePoint run_started{};  // run()'s start: what ready_at_s counts from

  struct Pending {
    scheduler::RequestView view;
    std::vector<Item> items;
    TimePoint admitted;
    std::optional<TimePoint> encoded;  // the producer's stamp: its last output handed to ECX
    std::string sender;                // the producer's routing id
    bool wants_answer = false;         // the producer waits for this request's outcome (max_unresolved)
    std::string params_text;           // ec_transfer_params as forwarded, until ECX reads them
  };
  std::unordered_map<std::string, Pending> pending;  // admitted, not yet resolved
  std::vector<std::string> order;                    // admission order of `pending`
  std::unordered_map<std::string, int> allocated;    // encoder-cache entries by hash: users
  std::vector<std::string> to_free;
  ConsumerResult result;
  bool producer_done = false;
  int producers_done = 0;
  std::uint64_t expected = 0;

  // What one rank did in a step (written by that rank's thread only).
  struct RankStep {
    std::unordered_map<std::string, TimePoint> loaded_at;  // hash -> its load finished
    std::set<std::string> bad;                             // hashes missing or differing in this rank's cache
    std::uint64_t mismatches = 0;
    std::optional<worker::WorkerMeta> meta;
    std::uint64_t sim_ns = 0;  // the simulator's own work: cache allocation and content checks

    // Emptied, not replaced, at each step: a fresh map grew (and rehashed) again in
    // every step.
    void reset() {
      loaded_at.clear();
      bad.clear();
      mismatches = 0;
      meta.reset();
      sim_ns = 0;
    }
  };
  std::vector<RankStep> rank_steps;
  // The simulator's own CPU time, sampled (thread_cpu.h): the engine thread's and each
  // rank thread's.
  SampledCpuTime sim_cpu{1};
  std::vector<SampledCpuTime> rank_cpu;

  void admit_messages() {
    for (auto& batch : admit->receive()) {
      for (auto& decoded : batch.admits) {
        if (!decoded) {
          log->warn("ignoring an unreadable admit message: {}", decoded.status().to_string());
          continue;
        }
        admit_one(batch.sender, *decoded);
      }
    }
  }

  void admit_one(const std::string& sender, std::variant<AdmitRequest, AdmitDone>& decoded) {
    if (const auto* done = std::get_if<AdmitDone>(&decoded)) {
      // Done once every producer said so; the requests expected are all of theirs.
      expected += done->requests;
      producer_done = ++producers_done >= std::max(1, options.producers);
      return;
    }
    auto& request = std::get<AdmitRequest>(decoded);
    Pending p;
    p.admitted = options.clock->now();
    if (request.encoded_at_ns) p.encoded = TimePoint(Duration(*request.encoded_at_ns));
    p.sender = sender;
    p.wants_answer = request.wants_answer;
    p.items = std::move(request.items);  // a store item names no transfer
    p.view.request_id = std::move(request.request_id);
    p.view.mm_features = features_of(p.items);
    // What a proxy forwards: the encoder's ec_transfer_params as they are (its
    // ec_items, mm_hash + transfer_id, and the handles under each hash), or
    // {mm_hash, "store": true} items for what it found in the store. ECX reads them
    // (read_params), outside the simulator's own time.
    p.params_text = std::move(request.ec_transfer_params);
    ++result.progress.requests_admitted;
    order.push_back(p.view.request_id);
    pending.emplace(p.view.request_id, std::move(p));
  }

  // ECX reads the ec_transfer_params of the requests admitted from `order[first]` on,
  // from their JSON text, as the Python connector does once per request (RequestView).
  void read_params(std::size_t first) {
    for (std::size_t k = first; k < order.size(); ++k) {
      auto it = pending.find(order[k]);
      if (it == pending.end()) continue;
      Pending& p = it->second;
      if (p.params_text.empty()) {
        set_ec_transfer_params(p.view, json::object());
      } else {
        p.view.set_ec_transfer_params_text(p.params_text);
      }
      p.params_text = std::string();
    }
  }

  // Tells the request's producer it resolved; a producer that left is skipped.
  void answer(const Pending& p, bool ready) {
    // Only a producer that paces itself by the outcomes asks: an answer nobody reads
    // would cost both processes a message per request.
    if (!p.wants_answer) return;
    auto region = sim_cpu.start();
    const auto text = encode_answer(AdmitAnswer{p.view.request_id, ready});
    admit->send(p.sender, text);
    region.stop(result.sim_engine_ns);
  }

  // By value: callers pass ids that live in the record this erases.
  // `ready_at`: when the engine found the items loaded (before the simulator's own
  // byte-for-byte check, which is no part of the time to ready); default now.
  // NOLINTNEXTLINE(performance-unnecessary-value-param): see above
  void resolve(std::string id, bool ready, std::optional<TimePoint> ready_at = std::nullopt) {
    auto it = pending.find(id);
    if (it == pending.end()) return;
    if (ready) {
      ++result.progress.requests_ready;
      result.items_ready += it->second.items.size();
      const TimePoint at = ready_at.value_or(options.clock->now());
      result.time_to_ready_ms.push_back(std::chrono::duration<double, std::milli>(at - it->second.admitted).count());
      result.ready_at_s.push_back(duration_to_seconds(at - run_started));
      const auto& encoded = it->second.encoded;
      result.encoded_to_ready_ms.push_back(encoded ? std::chrono::duration<double, std::milli>(at - *encoded).count()
                                                   : -1.0);
    } else {
      ++result.progress.requests_failed;
      result.failed_requests.push_back(id);
    }
    answer(it->second, ready);
    pending.erase(it);
    order.erase(std::remove(order.begin(), order.end(), id), order.end());
  }

  // A request the scheduler cannot serve ends like any finished request: the
  // scheduler releases what it holds for it (loads it started but the request never
  // allocated would otherwise stay in the workers' caches).
  void fail_unscheduled(const std::string& id) {
    auto it = pending.find(id);
    if (it == pending.end()) return;
    (void)scheduler->request_finished(it->second.view);
    resolve(id, false);
  }

  // The gate opened: allocate the request's encoder-cache entries, as vLLM's
  // scheduler does before it builds the step's connector metadata.
  bool allocate_request(Pending& p) {
    bool ok = true;
    for (std::size_t i = 0; i < p.items.size(); ++i) {
      const auto& h = p.items[i].mm_hash;
      auto& users = allocated[h];
      if (users == 0) {
        if (!scheduler->has_cache_item(h) && !caches[0].contains(h)) {
          const auto* params = p.view.params();
          if (scheduler::is_store_item(params, i, h)) {
            encode_locally(p.items[i]);  // the store could not give it: the engine encodes it
          } else {
            log->error("request {}: item {} is neither cached nor loadable after the gate opened", p.view.request_id,
                       h);
            ok = false;
          }
        }
        scheduler->update_state_after_alloc(p.view, i);
      }
      ++users;
    }
    return ok;
  }

  // The engine runs the vision encoder itself: every rank's cache gets the output.
  void encode_locally(const Item& item) {
    ++result.local_encodes;
    for (auto& cache : caches) {
      auto data = cache.insert(item.mm_hash, item.spec.nbytes());
      if (!data) continue;  // the content check reports the missing entry
      fill_content(item.mm_hash, std::span<std::byte>(*data, item.spec.nbytes()));
    }
  }

  // The step's forward pass: every rank's encoder cache must hold every item, byte
  // for byte (checked by each rank's thread after its loads, see load_rank). Then the
  // request finishes; entries nobody uses any more are freed in the next step's
  // metadata, as vLLM reports frees. Ready when the last of its items was loaded on
  // the last rank.
  void run_request(Pending& p, bool ok, TimePoint step_at) {
    TimePoint ready_at = step_at;
    for (std::size_t rank = 0; rank < caches.size(); ++rank) {
      const auto& rs = rank_steps[rank];
      for (const auto& item : p.items) {
        if (rs.bad.count(item.mm_hash)) {
          if (ok) {
            log->error(
                "rank {}: request {}: the encoder cache lacks {} or holds bytes that differ from what was "
                "encoded",
                rank, p.view.request_id, item.mm_hash);
          }
          ok = false;
        }
        if (auto at = rs.loaded_at.find(item.mm_hash); at != rs.loaded_at.end())
          ready_at = std::max(ready_at, at->second);
      }
    }
    if (ok) {
      for (const auto& item : p.items) result.progress.bytes_moved += item.spec.nbytes();
    }
    for (std::size_t i = 0; i < p.items.size(); ++i) scheduler->update_state_after_free(p.view, i);
    (void)scheduler->request_finished(p.view);
    for (const auto& item : p.items) {
      if (--allocated[item.mm_hash] == 0) {
        allocated.erase(item.mm_hash);
        to_free.push_back(item.mm_hash);
      }
    }
    resolve(p.view.request_id, ok, ready_at);
  }

  // One rank's part of a step, on that rank's thread: drop what the engine freed,
  // load (each load stamped when its copy finished), report, then check the bytes of
  // every item the step's requests use (after the stamps: no part of the time to ready).
  void load_rank(std::size_t rank, const scheduler::ConnectorMeta& meta, const std::vector<const Item*>& used) {
    auto& cache = caches[rank];
    auto& rs = rank_steps[rank];
    rs.reset();
    for (const auto& h : meta.freed) cache.erase(h);
    std::uint64_t sim_ns = 0;
    auto& sampler = rank_cpu[rank];
    scheduler::ConnectorMeta one;
    const auto allocate = [&cache, &sim_ns, &sampler](const scheduler::LoadSpec& l) -> Result<worker::LoadDestination> {
      auto region = sampler.start();
      auto data = cache.insert(l.mm_hash, l.spec.nbytes());
      region.stop(sim_ns);
      if (!data) return data.status();
      return worker::LoadDestination{*data, false, 0};
    };
    worker::WorkerCoordinator::Adopt adopt;
    if (options.config.zero_copy_loads) {
      adopt = [&cache](const scheduler::LoadSpec& l, consumer::SlotLease lease) {
        cache.adopt(l.mm_hash, std::move(lease));
        return Status::ok();
      };
    }
    for (const auto& load : meta.loads) {
      one.loads.assign(1, load);
      workers[rank]->start_load_caches(one, allocate, adopt,
                                       [&cache](const std::string& h) { return cache.contains(h); });
      rs.loaded_at[load.mm_hash] = options.clock->now();
    }
    if (!meta.store_loads.empty() || !meta.store_prefetches.empty()) {
      // Items routed to the store: prefetches start, loads copy the held entries.
      scheduler::ConnectorMeta store;
      store.store_loads = meta.store_loads;
      store.store_prefetches = meta.store_prefetches;
      const auto report = workers[rank]->start_load_caches(store, allocate);
      const auto now = options.clock->now();
      for (const auto& h : report.loaded) rs.loaded_at[h] = now;
    }
    rs.meta = workers[rank]->build_worker_meta();
    std::uint64_t checked_bytes = 0;
    for (const Item* item : used) checked_bytes += item->spec.nbytes();
    auto checking = sampler.start(checked_bytes);
    for (const Item* item : used) {
      if (rs.bad.count(item->mm_hash)) continue;
      if (rs.meta && rs.meta->failed_loads.count(item->mm_hash)) {  // reported by the worker; dropped below
        rs.bad.insert(item->mm_hash);
        continue;
      }
      const auto cached = cache.find(item->mm_hash);
      if (!cached) {
        rs.bad.insert(item->mm_hash);
      } else if (cached->size() != item->spec.nbytes() || !content_ok(rank, item->mm_hash, *cached)) {
        rs.bad.insert(item->mm_hash);
        ++rs.mismatches;
      }
    }
    checking.stop(sim_ns);
    rs.sim_ns = sim_ns;
  }

  // Every byte, or (ContentCheck::sampled) every block's stamp and every byte of one
  // item in kFullCheckEvery per rank.
  std::vector<std::uint64_t> checks;  // per rank
  bool content_ok(std::size_t rank, const std::string& hash, std::span<const std::byte> data) {
    if (options.content_check == ContentCheck::full || checks[rank]++ % kFullCheckEvery == 0) {
      return content_matches(hash, data);
    }
    return stamps_match(hash, data);
  }

  // True when the step changed something (a request admitted, finished or failed, a
  // load started, the producers done): the next step may find more to do at once.
  bool step() {
    const std::uint64_t admitted_before = result.progress.requests_admitted;
    const bool done_before = producer_done;
    // The admit channel stands in for the proxy: its messages are the simulator's cost.
    auto admitting = sim_cpu.start();
    const std::size_t order_before = order.size();
    admit_messages();
    const std::size_t pending_before = pending.size();
    admitting.stop(result.sim_engine_ns);
    read_params(order_before);
    // Schedule: gate, then allocate what passed.
    std::vector<std::pair<std::string, bool>> scheduled;  // (request id, allocated cleanly)
    for (const auto& id : order) {
      auto& p = pending.at(id);
      if (p.view.has_malformed_params()) continue;  // the scheduler reports it unavailable
      if (scheduler->ensure_cache_available(p.view, 0)) scheduled.emplace_back(id, false);
    }
    for (auto& [id, ok] : scheduled) ok = allocate_request(pending.at(id));
    scheduler::StepView view;
    // Like vLLM's encoder cache, an entry no request used any more but one scheduled in
    // this step allocated again is a hit, not an eviction.
    std::erase_if(to_free, [&](const std::string& h) { return allocated.contains(h); });
    view.free_encoder_mm_hashes = std::move(to_free);
    to_free.clear();
    const auto meta = scheduler->build_connector_meta(view);
    const auto step_at = options.clock->now();
    std::vector<const Item*> used;
    for (const auto& [id, ok] : scheduled) {
      for (const auto& item : pending.at(id).items) used.push_back(&item);
    }
    // Workers: the engine drops what it freed, the connector puts back what it
    // retained (the sim simply does not drop those), then loads; every rank at once.
    ranks->run([&](std::size_t rank) { load_rank(rank, meta, used); });
    std::optional<worker::WorkerMeta> merged;
    for (auto& rs : rank_steps) {
      if (rs.meta) merged = merged ? merged->aggregate(*rs.meta) : *rs.meta;
      result.content_mismatches += rs.mismatches;
      result.sim_engine_ns += rs.sim_ns;
    }
    for (const auto& h : merged ? merged->failed_loads : std::set<std::string>{}) {
      for (auto& cache : caches) cache.erase(h);
    }
    if (merged) scheduler->update_connector_output(merged->to_output());
    for (const auto& [id, ok] : scheduled) {
      if (auto it = pending.find(id); it != pending.end()) run_request(it->second, ok, step_at);
    }
    for (const auto& id : scheduler->take_unavailable_requests()) {
      log->warn("request {} failed: the scheduler reports an input it cannot obtain", id);
      fail_unscheduled(id);
    }
    return result.progress.requests_admitted != admitted_before || producer_done != done_before ||
           pending.size() != pending_before || !meta.loads.empty() || !meta.store_loads.empty() ||
           !meta.store_prefetches.empty();
  }

  // Memory the simulated encoder caches keep resident, all ranks.
  std::uint64_t cache_bytes() const {
    std::uint64_t total = 0;
    for (const auto& cache : caches) total += cache.resident_bytes();
    return total;
  }

  Progress snapshot(TimePoint started) {
    Progress p = result.progress;
    p.requests_total = expected;
    p.in_flight = pending.size();
    for (const auto& w : workers) {
      if (auto* shard = w->shard()) {
        const auto c = shard->counters().reservations;
        p.pool_used_bytes += c.pool_used_bytes;
        p.pool_capacity += c.pool_capacity;
        p.resident_bytes += c.resident_bytes;
        p.records_writing += c.writers + c.followers;
        p.records_ready += c.ready;
        p.tombstones += c.tombstones;
        p.tombstone_bound += options.config.tombstone_max;
      }
    }
    p.encoder_cache_bytes = cache_bytes();
    p.elapsed_s = duration_to_seconds(options.clock->now() - started);
    return p;
  }
};

Result<std::unique_ptr<ConsumerSim>> ConsumerSim::start(ConsumerSimOptions options) {
  auto state = std::make_unique<State>();
  state->options = std::move(options);
  const auto& config = state->options.config;
  if (!config.is_consumer()) return invalid_argument("ConsumerSim needs a consumer configuration");
  auto admit = AdmitListener::bind(state->options.admit_bind);
  if (!admit) return admit.status();
  state->admit = std::move(*admit);
  // The engine's own memory first: a producer may start once every shard answers
  // (`ecx bench e2e`), so what the engine needs must be in place by then.
  for (int rank = 0; rank < config.layout.tp_size; ++rank) state->caches.emplace_back(config.buffer_size);
  for (int rank = 0; rank < config.layout.tp_size; ++rank) {
    Config rank_config = config;
    rank_config.layout.tp_rank = rank;
    auto w = worker::WorkerCoordinator::start(rank_config, state->options.clock);
    if (!w) return Status(w.status().code(), fmt::format("consumer rank {}: {}", rank, w.status().message()));
    state->workers.push_back(std::move(*w));
  }
  state->checks.assign(state->workers.size(), 0);
  state->rank_steps.resize(state->workers.size());
  for (std::size_t rank = 0; rank < state->workers.size(); ++rank) {
    state->rank_cpu.emplace_back(static_cast<std::uint32_t>(rank + 2));
  }
  state->ranks = std::make_unique<RankThreads>(state->workers.size());
  auto coordinator = worker::make_scheduler_coordinator(config, DType::bfloat16, 0, state->options.clock);
  if (!coordinator) return coordinator.status();
  state->scheduler = std::move(*coordinator);
  return std::unique_ptr<ConsumerSim>(new ConsumerSim(std::move(state)));  // NOLINT: private constructor
}

ConsumerSim::ConsumerSim(std::unique_ptr<State> state) : state_(std::move(state)) {}

ConsumerSim::~ConsumerSim() {
  if (state_->scheduler) state_->scheduler->close();
  state_->caches.clear();  // zero-copy entries are leases on the shards' pools: back before they stop
  for (auto& w : state_->workers) w->shutdown();
}

std::string ConsumerSim::admit_endpoint() const { return state_->admit->endpoint(); }
std::string ConsumerSim::control_address() const { return state_->options.config.control_address(0); }

ConsumerResult ConsumerSim::run(const std::atomic<bool>* stop) {
  auto& s = *state_;
  name_this_thread(kEngineThreadName);  // the CPU table finds the engine threads by name
  CpuWindow cpu_window(s.options.warm_up_requests, s.options.on_warmed_up);
  const auto started = s.options.clock->now();
  s.run_started = started;
  const auto deadline = started + s.options.deadline;
  auto next_progress = started + s.options.progress_interval;
  while (s.options.clock->now() < deadline && !(stop && stop->load())) {
    const bool progressed = s.step();
    cpu_window.reached(s.result.progress.requests_ready, s.result.sim_engine_ns, s.result.items_ready);
    if (s.producer_done && s.pending.empty() && s.result.progress.requests_admitted >= s.expected) break;
    if (s.options.on_step) s.options.on_step(s.snapshot(started));
    if (s.options.on_progress && s.options.clock->now() >= next_progress) {
      s.options.on_progress(s.snapshot(started));
      next_progress = s.options.clock->now() + s.options.progress_interval;
    }
    if (s.pending.empty()) {
      // Nothing admitted waits: the engine waits for the admit channel (the simulated
      // proxy), the simulator's own wait. Left outside its regions, the waits of a
      // latency phase, one or two per item, were charged to ECX's calls.
      auto waiting = s.sim_cpu.start_always();
      const bool readable = s.admit->wait(std::chrono::milliseconds(1));
      waiting.stop(s.result.sim_engine_ns);
      // The CPU window opens with the first request. Before it the engine waits for
      // the producer's start-up (its pools: seconds), stepping once a millisecond, which
      // cost 0.2-0.4 s of this thread's CPU and, spread over the items, was counted as
      // ECX's (about 1 ms per item in a 300-item phase).
      if (s.result.progress.requests_admitted == 0 && readable) cpu_window.first_request(s.result.sim_engine_ns);
    } else if (!progressed) {
      // Requests wait for their transfers: the next step comes as soon as a transfer
      // event or a new request arrives (one poll for both), as an engine stepping
      // without pause would take them, without a core spent stepping on nothing. On
      // this VM each timed 50 µs wait cost its thread tens of µs of CPU, which the
      // CPU table charged to ECX. See kIdleStepCap.
      const auto admit_sockets = s.admit->wake_sources();
      (void)s.scheduler->wait_for_events(kIdleStepCap, admit_sockets);
    }
  }
  cpu_window.close(s.result, s.result.sim_engine_ns, s.result.items_ready);
  // Whatever is still pending at the deadline failed.
  for (const auto& id : std::vector<std::string>(s.order)) s.fail_unscheduled(id);
  // Give the engine's frees back and let the shards acknowledge the scheduler's last
  // remote cancels (sent asynchronously when the last requests finished: a READY
  // record they release would otherwise still count as live), then read the pools.
  const auto settle_by = std::chrono::steady_clock::now() + kSettleLimit;
  for (int i = 0; i < 2 || (s.scheduler->pending_remote_cancels() > 0 && std::chrono::steady_clock::now() < settle_by);
       ++i) {
    s.step();
    if (i >= 1) std::this_thread::sleep_for(kBusyPause);
  }
  s.result.progress = s.snapshot(started);
  s.result.producer_done = s.producer_done;
  s.result.wall_s = duration_to_seconds(s.options.clock->now() - started);
  std::uint64_t overflowed = 0;
  for (const auto& cache : s.caches) {
    overflowed += cache.overflowed();
    s.result.loads_as_views += cache.adopted();
  }
  if (overflowed > 0) {
    // Each such load paid page faults the bench means to keep out of what it measures.
    s.log->warn("{} loads did not fit the simulated encoder cache's arena ({} per rank) and were mapped on their own",
                overflowed, fmt::format("{} MiB", s.options.config.buffer_size >> 20));
  }
  // The run is over: views into the pools are given back, so what the pools still
  // hold beyond their resident copies is a leak.
  for (auto& cache : s.caches) cache.release_views();
  const auto stats = s.scheduler->stats();
  s.result.store_loads = stats.store_loads;
  s.result.readiness_recovered = stats.readiness_recovered;
  s.result.store_prefetch_failures = stats.store_prefetch_failures + stats.store_prefetch_timeouts;
  s.result.store_prefetch_timeouts = stats.store_prefetch_timeouts;
  for (const auto& w : s.workers) {
    if (auto* shard = w->shard()) {
      const auto all = shard->counters();
      const auto& c = all.reservations;
      s.result.reserves_held += all.control.reserves_held;
      s.result.events_dropped += all.control.events_dropped;
      s.result.held_reserves_placed += all.control.held_reserves_placed;
      s.result.in_process_cancels += all.control.in_process_cancels;
      s.result.cancels_of_unknown += c.pre_reserved_tombstones;
      s.result.held_reserves_expired += all.control.held_reserves_expired;
      s.result.checksum_mismatches += c.checksum_mismatches;
      s.result.live_reservations += c.live_records;
      s.result.resident_bytes += c.resident_bytes;
      s.result.leaked_pool_bytes += c.pool_used_bytes - std::min(c.pool_used_bytes, c.resident_bytes);
      if (auto inv = shard->check_invariants(); !inv && s.result.invariant_error.empty()) {
        s.result.invariant_error = inv.message();
      }
    }
  }
  return s.result;
}

// ---------------------------------------------------------------- producer

Result<ProducerResult> run_producer(const ProducerSimOptions& o, const std::atomic<bool>* stop) {
  auto log = ecx::log::get("sim");
  // This encoder's share of the workload (a proxy's round robin over the encoders).
  auto share = [&o](std::vector<SimRequest> all) {
    if (o.encoder_count <= 1) return all;
    std::vector<SimRequest> mine;
    for (std::size_t i = static_cast<std::size_t>(o.encoder_index); i < all.size();
         i += static_cast<std::size_t>(o.encoder_count)) {
      mine.push_back(std::move(all[i]));
    }
    return mine;
  };
  auto workload = share(make_workload(o.workload));
  auto coordinator = worker::make_scheduler_coordinator(o.config, o.workload.dtype, o.workload.hidden, o.clock);
  if (!coordinator) return coordinator.status();
  auto& scheduler = **coordinator;
  auto started_worker = worker::WorkerCoordinator::start(o.config, o.clock);
  if (!started_worker) return started_worker.status();
  auto& worker = **started_worker;
  SampledCpuTime sim_cpu(1);  // the simulator's own CPU time on this thread, sampled

  // What `ecx proxy --store-url` consults: its own presence index of the store.
  std::unique_ptr<store::PresenceIndex> proxy_index;
  if (o.skip_encoder_hop) {
    if (!o.config.cross_encoder_cache) return invalid_argument("skip_encoder_hop needs cross_encoder_cache");
    auto index = store::open_presence_index(o.config, o.clock);
    if (!index) return index.status();
    proxy_index = std::move(*index);
    // A proxy that has run a while has seen these images: its index starts warm
    // (bounded: what is not confirmed in time is simply not known yet).
    for (const auto& r : workload) {
      for (const auto& item : r.items) (void)proxy_index->present(item.mm_hash);
    }
    (void)proxy_index->wait_confirmed(std::chrono::seconds(30));
  }

  auto connected = AdmitConnection::connect(o.admit_connect, kAdmitConnectLimit);
  if (!connected) return connected.status();
  AdmitConnection& admit = **connected;

  ProducerResult result;
  bool admit_lost_logged = false;
  // Requests sent to the consumer and not yet answered as resolved (max_unresolved).
  std::set<std::string> unresolved;
  auto take_answers = [&] {
    for (const auto& answer : admit.receive()) {
      if (auto decoded = decode_answer(answer)) unresolved.erase(decoded->request_id);
    }
  };
  // zero_copy_saves: the encoder writes its outputs into memory it lends to ECX.
  std::shared_ptr<LentOutputs> lent_outputs;
  if (o.config.zero_copy_saves) lent_outputs = std::make_shared<LentOutputs>(o.config.buffer_size, o.config.prefault);
  name_this_thread(kEngineThreadName);  // the CPU table finds the engine threads by name
  if (o.before_first_request) ECX_RETURN_IF_ERROR(o.before_first_request());
  CpuWindow cpu_window(o.warm_up_requests, o.on_warmed_up);
  const auto started = o.clock->now();
  const auto deadline = started + o.deadline;
  std::vector<std::byte> buffer;
  std::size_t next = 0;
  std::vector<const SimRequest*> deferred;
  std::vector<std::string> encoder_frees;  // entries of requests that finished: freed in the next step
  // A request's hashes seen so far (a few per request): reused, as sets made per request
  // allocated a node and a string for each item.
  std::vector<std::string_view> asked;
  std::vector<std::string_view> encoded;
  result.rounds = 1;
  while (o.clock->now() < deadline && !(stop && stop->load())) {
    cpu_window.reached(result.requests, result.sim_ns, result.items);
    if (next >= workload.size() && o.clock->now() - started < o.run_for) {
      WorkloadOptions round = o.workload;
      round.seed = o.workload.seed + result.rounds;
      round.id_prefix = fmt::format("{}-r{}", o.workload.id_prefix, result.rounds);
      workload = share(make_workload(round));
      next = 0;
      ++result.rounds;
    }
    // Requests the gate deferred (their items are being prefetched from the store) are
    // asked again first, as vLLM's waiting queue does.
    std::vector<const SimRequest*> candidates(deferred.begin(), deferred.end());
    const std::size_t deferred_count = deferred.size();
    deferred.clear();
    std::vector<const SimRequest*> batch;
    // In flight: submitted and not finished, the pushes the dispatcher has not started
    // yet included (counting only the started ones, the window was passed by the
    // submits of the steps the dispatcher had not caught up with). pending() also sees
    // what a finished push still holds, so a window of one really sends one item at a
    // time.
    const auto& engine = *worker.push_engine();
    const auto counters = engine.counters();
    const std::uint64_t in_flight = counters.pushes.active + counters.unstarted;
    const std::uint64_t ended = counters.pushes.done + counters.pushes.failed + counters.pushes.cancelled;
    result.max_in_flight = std::max(result.max_in_flight, counters.submitted - std::min(counters.submitted, ended));
    const auto active = std::max<std::uint64_t>(in_flight, engine.pending() ? 1 : 0);
    // Like an encoder whose output buffer is full, admit nothing new while staging
    // is mostly used: staging refuses what does not fit, and that push fails.
    std::uint64_t staging_budget =
        counters.staging_capacity - std::min(counters.staging_capacity, counters.staging_used_bytes);
    staging_budget -= std::min(staging_budget, counters.staging_capacity / 4);  // headroom for fragmentation
    if (o.max_unresolved > 0) take_answers();                                   // only then does the consumer answer
    const bool gated = o.max_unresolved > 0 && unresolved.size() >= static_cast<std::size_t>(o.max_unresolved);
    while (
        !gated && next < workload.size() &&
        active + candidates.size() < static_cast<std::uint64_t>(o.max_active_pushes) && candidates.size() < 8 &&
        (o.max_unresolved == 0 || unresolved.size() + candidates.size() < static_cast<std::size_t>(o.max_unresolved))) {
      std::uint64_t bytes = 0;
      for (const auto& item : workload[next].items) bytes += item.spec.nbytes();
      if (bytes > staging_budget && active + candidates.size() > 0) break;
      staging_budget -= std::min(staging_budget, bytes);
      candidates.push_back(&workload[next++]);
    }
    std::vector<scheduler::RequestView> views;
    // Items the engine does not encode: has_cache_item said another encoder's output
    // is in the shared store (the cross-encoder cache), so it is loaded instead.
    std::set<std::string> external;
    for (std::size_t c = 0; c < candidates.size(); ++c) {
      const SimRequest* r = candidates[c];
      // The proxy decides before the encoder hop: a request this encoder deferred is its own.
      const bool new_request = c >= deferred_count;
      if (new_request && proxy_index && !r->items.empty() &&
          std::all_of(r->items.begin(), r->items.end(),
                      [&](const Item& item) { return proxy_index->present(item.mm_hash); })) {
        // Every image is in the store: the proxy sends the request straight on.
        std::vector<Item> unencoded = r->items;  // they name no transfer
        json items = json::array();
        for (auto& item : unencoded) {
          item.transfer_id.clear();
          items.push_back({{"mm_hash", item.mm_hash}, {"store", true}});
        }
        const auto params = json{{"ec_items", std::move(items)}}.dump();
        const auto text =
            encode_admit(AdmitRequestView{r->request_id, std::nullopt, o.max_unresolved > 0, unencoded, params});
        admit.queue(text);
        if (o.max_unresolved > 0) unresolved.insert(r->request_id);
        ++result.encoder_hops_skipped;
        ++result.requests;
        result.items += r->items.size();
        continue;
      }
      scheduler::RequestView view;
      view.request_id = r->request_id;
      view.mm_features = features_of(r->items);
      view.set_ec_transfer_params_text(encoder_params(o.consumer_address, r->items));
      if (!scheduler.ensure_cache_available(view, 0)) {
        deferred.push_back(r);
        continue;
      }
      batch.push_back(r);
      asked.clear();
      for (const auto& item : r->items) {
        if (!external.contains(item.mm_hash) && first_time(asked, item.mm_hash) &&
            scheduler.has_cache_item(item.mm_hash)) {
          external.insert(item.mm_hash);
        }
      }
      for (std::size_t i = 0; i < r->items.size(); ++i) scheduler.update_state_after_alloc(view, i);
      views.push_back(std::move(view));
    }
    // The encoder cache frees its finished requests' entries (their outputs are handed
    // to ECX) in the next step, as vLLM's does, unless a request of this step
    // allocated them again. Never freed, the producer's gate kept every hash of the
    // run: one set entry per item, and rehashes of the whole set inside a phase.
    scheduler::StepView step;
    std::erase_if(encoder_frees, [&](const std::string& h) {
      return std::any_of(batch.begin(), batch.end(), [&](const SimRequest* r) {
        return std::any_of(r->items.begin(), r->items.end(), [&](const Item& item) { return item.mm_hash == h; });
      });
    });
    step.free_encoder_mm_hashes = std::move(encoder_frees);
    encoder_frees.clear();
    const auto meta = scheduler.build_connector_meta(step);
    worker.start_save_caches(meta);
    // The store loads land in encoder-cache entries the engine allocates, then are
    // bound to their pushes like encoded outputs.
    std::map<std::string, std::vector<std::byte>> loaded_entries;
    if (!meta.store_loads.empty() || !meta.store_prefetches.empty()) {
      const auto report = worker.start_load_caches(meta, [&](const scheduler::LoadSpec& load) {
        auto& entry = loaded_entries[load.mm_hash];
        entry.resize(load.spec.nbytes());
        return Result<worker::LoadDestination>(worker::LoadDestination{entry.data(), false, 0});
      });
      for (const auto& h : report.loaded) {
        const auto& entry = loaded_entries[h];
        if (auto s = worker.save_cache(h, entry.data(), entry.size()); !s) {
          log->warn("cannot stage {}: {}", h, s.to_string());
        }
      }
      // A failed load is not encoded here either (the engine counted on the store):
      // its push is abandoned when its request finishes, and the consumer is told.
    }
    std::vector<std::string> finished;
    std::vector<TimePoint> encoded_at;  // per request: its last output handed to ECX
    for (std::size_t b = 0; b < batch.size(); ++b) {
      encoded.clear();
      for (const auto& item : batch[b]->items) {
        if (external.contains(item.mm_hash)) {
          result.bytes += item.spec.nbytes();
          continue;
        }
        if (!first_time(encoded, item.mm_hash)) continue;  // the engine encodes an item once per request
        ++result.encoder_runs;
        auto block = lent_outputs ? lent_outputs->take(item.spec.nbytes()) : std::nullopt;
        if (!block) buffer.resize(item.spec.nbytes());
        const std::span<std::byte> output = block ? block->first : std::span<std::byte>(buffer);
        auto filling = sim_cpu.start(output.size());
        if (block) {
          stamp_content(item.mm_hash, output);  // the arena holds the body already
        } else {
          fill_content(item.mm_hash, output);
        }
        filling.stop(result.sim_ns);
        Status bound = block ? worker.lend_cache(item.mm_hash, output.data(), output.size(), std::move(block->second))
                             : worker.save_cache(item.mm_hash, output.data(), output.size());
        if (!bound) log->warn("cannot stage {}: {}", item.mm_hash, bound.to_string());
        if (block) ++result.outputs_lent;
        result.bytes += item.spec.nbytes();
      }
      result.items += batch[b]->items.size();
      finished.push_back(batch[b]->request_id);
      encoded_at.push_back(o.clock->now());
    }
    worker.get_finished(finished);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const auto params = scheduler.request_finished(views[b]);
      for (const auto& item : batch[b]->items) {
        if (std::find(encoder_frees.begin(), encoder_frees.end(), item.mm_hash) == encoder_frees.end()) {
          encoder_frees.push_back(item.mm_hash);
        }
      }
      auto admitting = sim_cpu.start();
      // Paced by the outcomes (max_unresolved): the consumer answers each.
      const auto text =
          encode_admit(AdmitRequestView{batch[b]->request_id, encoded_at[b].time_since_epoch().count(),
                                        o.max_unresolved > 0, batch[b]->items, params.params.value_or("")});
      admit.queue(text);  // the step's requests go in one write, below
      admitting.stop(result.sim_ns);
      if (o.max_unresolved > 0) unresolved.insert(batch[b]->request_id);
      ++result.requests;
    }
    if (admit.has_queued()) {  // a step that queued nothing has no write to time
      auto writing = sim_cpu.start();
      admit.flush();
      writing.stop(result.sim_ns);
    }
    if (!admit.open() && !admit_lost_logged) {
      log->warn("the admit channel to the consumer is closed: {}", admit.why_closed());
      admit_lost_logged = true;
    }
    if (auto m = worker.build_worker_meta()) scheduler.update_connector_output(m->to_output());
    if (next >= workload.size() && deferred.empty() && !worker.push_engine()->pending() &&
        o.clock->now() - started >= o.run_for) {
      break;
    }
    if (batch.empty()) {
      if (gated) {
        // Waiting for the consumer's answer: wake as soon as it comes. The cap only
        // bounds what no answer announces (failed pushes reported to the scheduler),
        // as the consumer's: a 1 ms cap woke the engine 2-3 times during each lone
        // 9 MiB item's transfer, CPU the data plane's threads wanted on 2 CPUs.
        // The simulator's own wait (see the consumer's).
        auto waiting = sim_cpu.start_always();
        (void)admit.wait(kIdleStepCap);
        waiting.stop(result.sim_ns);
      } else if (in_flight > 0 && next < workload.size()) {
        // Window or staging full: the next push may start once one finishes. A timed
        // 200 us sleep here woke the engine about ten times per 9 MiB item, CPU the
        // CPU table charged to ECX's calls (55-190 us per item).
        (void)engine.wait_active_below(in_flight, kIdleStepCap);
      } else if (next >= workload.size() && deferred.empty() && engine.pending()) {
        // All handed over: wait for the last pushes to end. A timed 200 us sleep here
        // woke the engine 536 times at the end of a 200-item 9 MiB phase (2.7 per
        // item), CPU the CPU table charged to ECX's calls.
        (void)engine.wait_idle(kIdleStepCap);
      } else {
        auto waiting = sim_cpu.start_always();
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        waiting.stop(result.sim_ns);
      }
    }
  }
  cpu_window.close(result, result.sim_ns, result.items);
  (void)worker.wait_published(std::chrono::seconds(2));  // best effort: what is left is dropped, counted
  const auto counters = worker.push_engine()->counters();
  result.retry_afters = counters.pushes.retry_afters;
  result.yields = counters.pushes.yields;
  result.pushes_done = counters.pushes.done;
  result.direct_sent = counters.pushes.direct_sent;
  result.direct_turned_away = counters.pushes.direct_turned_away;
  // Counted from the push engine: a failure after its request finished names no
  // request any more, so the worker metadata's failed_saves would miss it.
  result.failed_saves = counters.pushes.failed + counters.topology_failures + counters.staging_failures;
  log->info(
      "producer: {} submitted, {} sources bound ({} lent, {} unused), pushes {} started / {} done / {} failed / {} "
      "active, {} payloads sent, {} I/O in flight, {} discovery failures, {} staging failures",
      counters.submitted, counters.sources_bound, counters.sources_lent, counters.sources_unused,
      counters.pushes.started, counters.pushes.done, counters.pushes.failed, counters.pushes.active,
      counters.pushes.payloads_sent, counters.pushes.io_in_flight, counters.topology_failures,
      counters.staging_failures);
  admit.queue(encode_admit(AdmitDone{result.requests}));
  // What ZeroMQ's linger did: the consumer gets the last requests and the "done".
  if (Status sent = admit.flush_within(kAdmitDoneLimit); !sent) {
    log->warn("the consumer did not take the admit channel's last messages: {}", sent.to_string());
  }
  result.wall_s = duration_to_seconds(o.clock->now() - started);
  scheduler.close();
  worker.shutdown();
  // Every lent output came back: sent, failed, or released by the shutdown.
  if (lent_outputs) result.outputs_not_given_back = lent_outputs->outstanding();
  const auto stats = scheduler.stats();
  result.store_lookups = stats.store_lookups;
  result.store_hits = stats.store_hits;
  result.store_prefetch_timeouts = stats.store_prefetch_timeouts;
  result.store = worker.store_counters();
  return result;
}

}  // namespace ecx::sim
