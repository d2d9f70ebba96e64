// State-machine fuzzer for the consumer's ReservationManager: the input is a
// sequence of reserves, cancels (scheduler and producer), landings (accepted,
// corrupted, failed), one-sided writes, takes, lease releases, expiries, clock
// moves and a shutdown, in any order and with right or wrong ids. The fuzzer plays
// the transport and writes every accepted landing into a real slab.
//
// Checked after every operation: the manager's own invariant walk (pool bytes =
// slots held, indexes consistent), pool bytes within capacity, and the central
// promise: a slot that may still be written is never handed to anyone else — no
// two open writes overlap, no open write overlaps a lease, and every lease reads
// exactly the content its mm_hash landed with, for as long as it is held.

#include <fuzzer/FuzzedDataProvider.h>

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/logging.h"
#include "ecx/consumer/reservation_manager.h"

namespace {

using namespace ecx;
using namespace ecx::consumer;

void check(bool condition) {
  if (!condition) std::abort();
}

// ECX_FUZZ_TRACE=1 prints every operation (to replay a finding by hand).
const bool kTrace = std::getenv("ECX_FUZZ_TRACE") != nullptr;  // NOLINT(concurrency-mt-unsafe): before any thread
#define TRACE(...)                                 \
  do {                                             \
    if (kTrace) std::fprintf(stderr, __VA_ARGS__); \
  } while (0)

constexpr int kIds = 8, kHashes = 4;
constexpr std::uint64_t kSlab = std::uint64_t{64} * 1024;

std::string id_name(int i) { return "t" + std::to_string(i); }
std::string hash_name(int i) { return "h" + std::to_string(i); }
std::byte pattern(const std::string& hash) { return static_cast<std::byte>(0x11 * (hash.back() - '0' + 1)); }

struct Range {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  bool overlaps(const Range& o) const { return offset < o.offset + o.length && o.offset < offset + length; }
};

struct Harness {
  explicit Harness(FuzzedDataProvider& input) : in(input) {}

  FuzzedDataProvider& in;
  std::vector<std::byte> slab = std::vector<std::byte>(kSlab);
  std::shared_ptr<ManualClock> clock = std::make_shared<ManualClock>();
  std::unique_ptr<ReservationManager> manager;
  bool one_sided = false;
  bool checksum = false;
  bool shut_down = false;
  std::uint64_t sizes[kHashes] = {};
  // What the producer side knows: the last reservation each transfer id was given.
  struct Known {
    ReservationId id;
    std::uint64_t generation = 0;
    Range slot;  // one-sided writers only
    bool writer = false;
    std::string hash;  // what the producer writes for this transfer
  };
  std::map<std::string, Known> known;
  // Slots that may be written right now (receiver-chosen: accepted landings not yet
  // completed; one-sided: writer reservations not yet completed or abandoned).
  std::map<std::string, std::pair<Range, std::string>> open_writes;
  struct Held {
    SlotLease lease;
    Range range;
  };
  std::vector<Held> leases;

  Range range_of(const std::byte* data, std::uint64_t length) const {
    check(data >= slab.data() && data + length <= slab.data() + slab.size());
    return Range{static_cast<std::uint64_t>(data - slab.data()), length};
  }

  void open_write(const std::string& tid, Range range, const std::string& hash) {
    check(range.offset + range.length <= kSlab);
    for (const auto& [other, write] : open_writes) {
      if (other != tid) check(!write.first.overlaps(range));
    }
    for (const auto& held : leases) check(!held.range.overlaps(range));
    open_writes[tid] = {range, hash};
  }

  void fill(Range range, std::byte value) {
    std::memset(slab.data() + range.offset, static_cast<int>(value), range.length);
  }

  void check_lease(const Held& held) {
    const auto want = pattern(held.lease.mm_hash());
    for (std::uint64_t i = 0; i < held.range.length; ++i) check(slab[held.range.offset + i] == want);
  }

  void check_all() {
    const Status s = manager->check_invariants();
    if (!s) std::abort();
    const auto c = manager->counters();
    check(c.pool_used_bytes <= c.pool_capacity);
    check(c.pool_capacity == kSlab);
    check(c.leases == leases.size());
    for (const auto& held : leases) {
      for (const auto& [tid, write] : open_writes) check(!write.first.overlaps(held.range));
    }
  }

  std::optional<ReserveRequest> request(int id, int hash) {
    std::uint64_t bytes = sizes[hash];
    if (in.ConsumeIntegralInRange<int>(0, 15) == 0) bytes = in.ConsumeIntegralInRange<std::uint64_t>(0, 2 * kSlab);
    std::optional<std::uint64_t> sum;
    if (in.ConsumeBool() && bytes <= kSlab) {
      std::vector<std::byte> content(bytes, pattern(hash_name(hash)));
      sum = XXH64(content.data(), content.size(), 0);
    }
    auto spec = TensorSpec::make({static_cast<std::int64_t>(bytes)}, DType::uint8, ~0ULL);
    if (!spec) return std::nullopt;  // the wire decoder refuses it before the manager
    return ReserveRequest{id_name(id), hash_name(hash), *spec, sum};
  }

  void reserve(int id, int hash) {
    const auto asked = request(id, hash);
    if (!asked) return;
    const ReserveRequest& req = *asked;
    const auto result = manager->reserve(req);
    TRACE("reserve %s %s %llu -> %s\n", req.transfer_id.c_str(), req.mm_hash.c_str(),
          static_cast<unsigned long long>(req.spec.nbytes()), describe(result).c_str());
    if (const auto* r = std::get_if<outcome::Reserved>(&result)) {
      check(!shut_down);
      check(r->slot_length == req.spec.nbytes());
      check(r->slot_offset + r->slot_length <= kSlab);
      known[req.transfer_id] =
          Known{r->reservation_id, r->generation, Range{r->slot_offset, r->slot_length}, r->write, req.mm_hash};
      if (one_sided && r->write && !open_writes.count(req.transfer_id)) {
        open_write(req.transfer_id, Range{r->slot_offset, r->slot_length}, req.mm_hash);
      }
    } else if (const auto* ready = std::get_if<outcome::Ready>(&result)) {
      known[req.transfer_id] = Known{ready->reservation_id, ready->generation, {}, false, req.mm_hash};
    }
  }

  // The ids a producer would send: usually the right ones, sometimes stale or made up.
  std::pair<ReservationId, std::uint64_t> ids_for(const std::string& tid) {
    auto it = known.find(tid);
    switch (in.ConsumeIntegralInRange<int>(0, 7)) {
      case 0:
        return {ReservationId(1, in.ConsumeIntegral<std::uint64_t>()), 0};
      case 1:
        return {it == known.end() ? ReservationId{} : it->second.id, in.ConsumeIntegral<std::uint64_t>()};
      default:
        return it == known.end() ? std::pair{ReservationId{}, std::uint64_t{0}}
                                 : std::pair{it->second.id, it->second.generation};
    }
  }

  // An honest producer writes the content of the mm_hash it reserved for.
  void land(const std::string& tid, const std::string& any_hash) {
    const auto it = known.find(tid);
    const std::string hash = it != known.end() ? it->second.hash : any_hash;
    auto [id, generation] = ids_for(tid);
    std::uint64_t nbytes = sizes[hash.back() - '0'];
    if (in.ConsumeIntegralInRange<int>(0, 7) == 0) nbytes = in.ConsumeIntegralInRange<std::uint64_t>(0, kSlab);
    const auto resolution = manager->resolve_landing(tid, id, nbytes, generation);
    TRACE("resolve %s %llu -> %s\n", tid.c_str(), static_cast<unsigned long long>(nbytes),
          resolution.accepted() ? "accepted" : std::string(landing_refusal_name(resolution.refusal)).c_str());
    if (!resolution.accepted()) return;
    check(!one_sided);
    check(resolution.target->length == nbytes);
    const Range range = range_of(resolution.target->data, resolution.target->length);
    check(!open_writes.count(tid));
    open_write(tid, range, hash);
    // The payload arrives whole, or corrupted (then the transport or the checksum
    // must say so), or only partly before its sender dies.
    const int how = in.ConsumeIntegralInRange<int>(0, 3);
    fill(range, how == 0 ? std::byte{0xEE} : pattern(hash));
    TRACE("  wrote %s at %llu+%llu\n", how == 0 ? "garbage" : "content", static_cast<unsigned long long>(range.offset),
          static_cast<unsigned long long>(range.length));
    if (in.ConsumeBool()) finish_landing(tid, how);  // else later (or never)
  }

  // A direct payload: its reserve happens on arrival, and it lands only as the writer
  // of a fresh slot.
  void land_direct(int id, int hash) {
    const auto asked = request(id, hash);
    if (!asked) return;
    const std::string& tid = asked->transfer_id;
    const auto d = manager->resolve_direct_landing(*asked);
    TRACE("direct %s %s -> %s\n", tid.c_str(), asked->mm_hash.c_str(),
          d.landing.accepted() ? "accepted" : d.reserve_outcome.c_str());
    if (!d.landing.accepted()) return;
    check(!one_sided && !shut_down);
    check(d.landing.target->length == asked->spec.nbytes());
    const Range range = range_of(d.landing.target->data, d.landing.target->length);
    check(!open_writes.count(tid));
    known[tid] = Known{d.reservation_id, d.landing.target->generation, range, true, asked->mm_hash};
    open_write(tid, range, asked->mm_hash);
    const int how = in.ConsumeIntegralInRange<int>(0, 3);
    fill(range, how == 0 ? std::byte{0xEE} : pattern(asked->mm_hash));
    if (in.ConsumeBool()) finish_landing(tid, how);
  }

  void finish_landing(const std::string& tid, int how) {
    auto open = open_writes.find(tid);
    if (open == open_writes.end()) return;
    const auto [range, hash] = open->second;
    const bool corrupted = slab[range.offset] != pattern(hash) && range.length > 0;
    auto [id, generation] = ids_for(tid);
    (void)generation;
    std::optional<std::uint64_t> sum;
    if (checksum || in.ConsumeBool()) {
      std::vector<std::byte> honest(range.length, pattern(hash));
      sum = XXH64(honest.data(), honest.size(), 0);
    }
    // Corrupted bytes are reported as a failed transfer unless checksums are on
    // (then the honest checksum must catch them).
    const bool ok = corrupted ? checksum && how == 0 : how != 3;
    const auto result = manager->complete_landing(tid, id, ok, sum);
    TRACE("complete %s ok=%d sum=%d -> %s\n", tid.c_str(), ok, sum.has_value(),
          std::string(completion_outcome_name(result)).c_str());
    if (result != CompletionOutcome::rejected) open_writes.erase(tid);
    if (corrupted) check(result != CompletionOutcome::became_ready);
  }

  void one_sided_complete(const std::string& tid, bool write_first) {
    auto open = open_writes.find(tid);
    auto [id, generation] = ids_for(tid);
    (void)generation;
    if (open != open_writes.end() && write_first) fill(open->second.first, pattern(open->second.second));
    const bool whole = open != open_writes.end() && write_first;
    std::optional<std::uint64_t> sum;
    if (open != open_writes.end() && (checksum || in.ConsumeBool())) {
      std::vector<std::byte> honest(open->second.first.length, pattern(open->second.second));
      sum = XXH64(honest.data(), honest.size(), 0);
    }
    if (!whole && open != open_writes.end()) {
      // Completing without writing would leave stale bytes; with checksums off
      // that is the producer's lie to tell, so only do it with checksums on.
      if (!checksum || !sum) return;
    }
    const auto result = manager->writer_completed(tid, id, sum);
    TRACE("writer_completed %s -> %s\n", tid.c_str(), std::string(completion_outcome_name(result)).c_str());
    if (open != open_writes.end() && result != CompletionOutcome::rejected && result != CompletionOutcome::repeated) {
      open_writes.erase(open);
    }
  }

  void take(const std::string& tid, const std::string& hash) {
    auto lease = manager->take(tid, hash);
    if (!lease) return;
    keep(std::move(*lease), hash);
  }

  void take_resident(const std::string& hash) {
    auto spec = TensorSpec::make({static_cast<std::int64_t>(sizes[hash.back() - '0'])}, DType::uint8, ~0ULL);
    if (!spec) return;
    auto lease = manager->take_resident(hash, *spec);
    if (!lease) return;
    keep(std::move(*lease), hash);
  }

  void keep(SlotLease lease, const std::string& hash) {
    TRACE("lease %s at %llu+%llu\n", hash.c_str(), static_cast<unsigned long long>(lease.offset()),
          static_cast<unsigned long long>(lease.nbytes()));
    check(lease.mm_hash() == hash);
    Held held{std::move(lease), {}};
    held.range = range_of(held.lease.data(), held.lease.nbytes());
    for (const auto& [tid, write] : open_writes) check(!write.first.overlaps(held.range));
    check_lease(held);
    leases.push_back(std::move(held));
  }

  void release(std::size_t index) {
    if (leases.empty()) return;
    index %= leases.size();
    check_lease(leases[index]);
    leases[index].lease.release();
    leases.erase(leases.begin() + static_cast<std::ptrdiff_t>(index));
  }
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  log::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  Harness h(in);
  h.one_sided = in.ConsumeBool();
  h.checksum = in.ConsumeBool();
  ReservationOptions options;
  options.slab_base = h.slab.data();
  options.slab_size = kSlab;
  options.alignment = std::uint64_t{1} << in.ConsumeIntegralInRange<int>(0, 12);
  options.mode = h.one_sided ? LandingMode::one_sided : LandingMode::receiver_chosen;
  options.ttl = std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(1, 1000));
  options.tombstone_max = in.ConsumeIntegralInRange<std::uint64_t>(1, 16);
  options.event_queue_max = in.ConsumeIntegralInRange<std::uint64_t>(1, 16);
  options.checksum = h.checksum;
  options.max_tensor_bytes = in.ConsumeBool() ? 0 : in.ConsumeIntegralInRange<std::uint64_t>(1, kSlab);
  options.resident_capacity_bytes = in.ConsumeBool() ? 0 : in.ConsumeIntegralInRange<std::uint64_t>(1, kSlab);
  for (auto& s : h.sizes) s = in.ConsumeIntegralInRange<std::uint64_t>(1, kSlab / 4);
  h.manager = std::make_unique<ReservationManager>(options, h.clock);

  for (int step = 0; step < 256 && in.remaining_bytes() > 0; ++step) {
    const int id = in.ConsumeIntegralInRange<int>(0, kIds - 1);
    const int hash = in.ConsumeIntegralInRange<int>(0, kHashes - 1);
    const std::string tid = id_name(id);
    switch (in.ConsumeIntegralInRange<int>(0, 16)) {
      case 0:
      case 1:
        h.reserve(id, hash);
        break;
      case 2: {
        auto [rid, generation] = h.ids_for(tid);
        (void)generation;
        const bool abandon = in.ConsumeBool();
        const bool refresh = abandon && in.ConsumeBool();
        const auto result =
            h.manager->cancel(CancelRequest{tid, in.ConsumeBool() ? ReservationId{} : rid, abandon, refresh});
        TRACE("cancel %s abandon=%d refresh=%d -> %s\n", tid.c_str(), abandon, refresh,
              std::string(cancel_outcome_name(result)).c_str());
        // The producer said it stopped writing: its one-sided slot is no longer written.
        if (h.one_sided && abandon && cancel_accepted(result)) h.open_writes.erase(tid);
        break;
      }
      case 3:
      case 4:
        h.land(tid, hash_name(hash));
        break;
      case 5:
        h.finish_landing(tid, in.ConsumeIntegralInRange<int>(0, 3));
        break;
      case 6:
        h.one_sided_complete(tid, in.ConsumeBool());
        break;
      case 7: {
        auto [rid, generation] = h.ids_for(tid);
        (void)generation;
        if (cancel_accepted(h.manager->writer_abandoned(tid, rid)) && h.one_sided) h.open_writes.erase(tid);
        break;
      }
      case 8:
        h.take(tid, hash_name(hash));
        break;
      case 9:
        h.take_resident(hash_name(hash));
        break;
      case 10:
        h.release(in.ConsumeIntegral<std::size_t>());
        break;
      case 11:
        h.clock->advance(std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 1500)));
        TRACE("advance\n");
        [[fallthrough]];
      case 12:
        h.manager->expire();
        break;
      case 13:
        (void)h.manager->drain_events(in.ConsumeIntegralInRange<std::size_t>(0, 8));
        (void)h.manager->drain_reclaimed();
        break;
      case 14:
        (void)h.manager->state_of(tid);
        break;
      case 15:
        if (in.ConsumeIntegralInRange<int>(0, 7) == 0 && !h.shut_down) {
          h.shut_down = true;
          h.manager->begin_shutdown();
        }
        break;
      case 16:
        h.land_direct(id, hash);
        break;
    }
    h.check_all();
  }
  if (h.shut_down) {
    const auto report = h.manager->wait_for_writers(Duration::zero());
    check(report.writers_finished == h.open_writes.empty());
  }
  for (const auto& held : h.leases) h.check_lease(held);
  h.leases.clear();
  h.check_all();
  return 0;
}
