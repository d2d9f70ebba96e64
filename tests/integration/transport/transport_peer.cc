// The other process of the transport tests. Driven line by line over stdin;
// answers on stdout.
//
//   common options: [--tls TLS] [--mode am|put] [--peer-errors 0|1] [--shared 0|1]
//     --shared: the sender sends from a shared region (a memfd); the receiver takes
//     shared payloads (on by default: 0 makes it refuse them)
//   transport_peer send --connect ADDR
//     send INDEX SOURCE_OFFSET PAYLOAD_BYTES LANDING_BYTES FLAGS [DEADLINE_MS] -> "sent INDEX <status>"
//     deregister -> "deregistered <status>" (the pattern region; later sends fail)
//     stats -> "stats SHARED_SENDS SHARED_FALLBACKS"
//     advance MS -> moves the sender's clock (with --manual-clock 1; deadlines then pass only so)
//     random SEED COUNT WINDOW  -> "failed INDEX <status>" per failure, then "random-done OK FAILED"
//   transport_peer receive --listen HOST
//     prints "address ADDR", then "landed INDEX <status> verified|corrupt" per landing and
//     "stalled INDEX" when a kStall header hangs its resolver (until the test kills it)
//   both: "quit" exits.
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <iostream>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "ecx/pool/offset_allocator.h"
#include "ecx/pool/slab.h"
#include "ecx/transport/ucx_transport.h"
#include "peer_protocol.h"

namespace ecx::transport::testing {
namespace {

std::mutex output_mutex;

void say(const std::string& line) {
  std::lock_guard lock(output_mutex);
  std::cout << line << std::endl;
}

struct Args {
  std::string role, connect, listen, tls;
  UcxMode mode = UcxMode::am;
  bool peer_errors = true;
  std::optional<bool> shared;
  bool manual_clock = false;
};

int run_sender(const Args& args) {
  const bool shared = args.shared.value_or(false);
  auto slab = pool::Slab::allocate(pool::MemoryKind::host, kPatternBytes, pool::SlabOptions{.shared = shared});
  if (!slab) return say("error " + slab.status().to_string()), 1;
  const auto pattern = make_pattern(kPatternBytes);
  std::memcpy(slab->data(), pattern.data(), kPatternBytes);

  UcxOptions options;
  options.tls = args.tls;
  options.mode = args.mode;
  options.peer_error_handling = args.peer_errors;
  const auto manual = std::make_shared<ManualClock>();
  const std::shared_ptr<const Clock> clock =
      args.manual_clock ? std::shared_ptr<const Clock>(manual) : std::shared_ptr<const Clock>(SteadyClock::shared());
  options.clock = clock;
  auto transport = create_ucx_transport(options);
  if (!transport) return say("error " + transport.status().to_string()), 1;
  auto region =
      shared ? (*transport)->register_shared_region(slab->data(), slab->size(), SharedBacking{slab->shared_fd(), 0})
             : (*transport)->register_region(slab->data(), slab->size(), MemoryKind::host);
  auto endpoint = (*transport)->connect(args.connect);
  if (!region || !endpoint) return say("error cannot register or connect"), 1;

  std::mutex mutex;
  std::condition_variable changed;
  std::uint64_t in_flight = 0;

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string command;
    in >> command;
    if (command == "quit") break;
    if (command == "stats") {
      const auto stats = (*transport)->stats();
      say(fmt::format("stats {} {}", stats.shared_sends, stats.shared_fallbacks));
    } else if (command == "advance") {
      std::uint64_t ms = 0;
      in >> ms;
      manual->advance(std::chrono::milliseconds(ms));
    } else if (command == "deregister") {
      say("deregistered " + std::string(status_code_name((*transport)->deregister_region(*region).code())));
    } else if (command == "send") {
      TestHeader header;
      std::uint64_t payload = 0;
      std::uint64_t deadline_ms = 60'000;
      in >> header.index >> header.source_offset >> payload >> header.landing_length >> header.flags;
      if (!(in >> deadline_ms)) deadline_ms = 60'000;
      const auto index = header.index;
      auto on_sent = [index](const Status& result) {
        say("sent " + std::to_string(index) + " " + std::string(status_code_name(result.code())));
      };
      const auto deadline = clock->now() + std::chrono::milliseconds(deadline_ms);
      auto status = (header.flags & kConfirm) ? (*transport)
                                                    ->send_confirmed(*endpoint, as_bytes(header), *region,
                                                                     header.source_offset, payload, deadline, on_sent)
                                              : (*transport)
                                                    ->send(*endpoint, as_bytes(header), *region, header.source_offset,
                                                           payload, deadline, on_sent);
      if (!status) say("sent " + std::to_string(index) + " " + std::string(status_code_name(status.code())));
    } else if (command == "random") {
      std::uint64_t seed = 0, count = 0, window = 1;
      in >> seed >> count >> window;
      std::mt19937_64 rng(seed);
      std::uniform_real_distribution<double> log_size(0.0, std::log(static_cast<double>(kMaxRandomPayload)));
      std::uint64_t ok = 0, failed = 0;
      for (std::uint64_t i = 0; i < count; ++i) {
        const auto size =
            std::clamp<std::uint64_t>(static_cast<std::uint64_t>(std::exp(log_size(rng))), 1, kMaxRandomPayload);
        TestHeader header;
        header.index = i;
        header.source_offset = std::uniform_int_distribution<std::uint64_t>(0, kPatternBytes - size)(rng);
        header.landing_length = size;
        {
          std::unique_lock lock(mutex);
          if (!changed.wait_for(lock, std::chrono::seconds(60), [&] { return in_flight < window; })) {
            say("error window never drained");
            return 1;
          }
          ++in_flight;
        }
        auto status = (*transport)
                          ->send(*endpoint, as_bytes(header), *region, header.source_offset, size,
                                 clock->now() + std::chrono::seconds(60), [&, i](const Status& result) {
                                   std::lock_guard lock(mutex);
                                   --in_flight;
                                   if (result) {
                                     ++ok;
                                   } else {
                                     ++failed;
                                     say("failed " + std::to_string(i) + " " + result.to_string());
                                   }
                                   changed.notify_all();
                                 });
        if (!status) {
          std::lock_guard lock(mutex);
          --in_flight;
          ++failed;
          say("failed " + std::to_string(i) + " " + status.to_string());
        }
      }
      std::unique_lock lock(mutex);
      if (!changed.wait_for(lock, std::chrono::seconds(120), [&] { return in_flight == 0; })) {
        say("error sends never completed");
        return 1;
      }
      say("random-done " + std::to_string(ok) + " " + std::to_string(failed));
    }
  }
  return 0;
}

int run_receiver(const Args& args) {
  auto slab = pool::Slab::allocate(pool::MemoryKind::host, 128ULL << 20);
  if (!slab) return say("error " + slab.status().to_string()), 1;
  pool::OffsetAllocator allocator(slab->size(), 4096);
  const auto pattern = make_pattern(kPatternBytes);
  std::byte* base = slab->data();

  UcxOptions options;
  options.tls = args.tls;
  options.mode = args.mode;
  options.peer_error_handling = args.peer_errors;
  options.shared_sources = args.shared.value_or(true);
  options.resolver = [&](std::span<const std::byte> bytes, std::uint64_t) -> Result<Landing> {
    auto header = parse_header(bytes);
    if (!header) return invalid_argument("bad header");
    if (header->flags & kStall) {
      say("stalled " + std::to_string(header->index));
      // A hung receiver: the test kills this process; the bound keeps an orphan from lingering.
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return unavailable("stalled");
    }
    if (header->flags & kReject) return resource_exhausted("rejected by request");
    auto slot = allocator.allocate(header->landing_length);
    if (!slot) return slot.status();
    return Landing{base + slot->offset, header->landing_length, slot->offset};
  };
  options.on_landing = [&](std::span<const std::byte> bytes, const Landing& landing, const Status& status) {
    auto header = parse_header(bytes);
    const bool intact = header && header->source_offset + landing.length <= kPatternBytes &&
                        std::memcmp(landing.destination, pattern.data() + header->source_offset, landing.length) == 0;
    say("landed " + std::to_string(header ? header->index : 0) + " " + std::string(status_code_name(status.code())) +
        (intact ? " verified" : " corrupt"));
    (void)allocator.free(pool::Slot{landing.token, (landing.length + 4095) / 4096 * 4096});
  };
  auto transport = create_ucx_transport(options);
  if (!transport) return say("error " + transport.status().to_string()), 1;
  auto region = (*transport)->register_region(slab->data(), slab->size(), MemoryKind::host);
  auto address = (*transport)->listen(args.listen, 0);
  if (!region || !address) return say("error cannot register or listen"), 1;
  say("address " + *address);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "quit") break;
  }
  return 0;
}

}  // namespace
}  // namespace ecx::transport::testing

int main(int argc, char** argv) {
  using namespace ecx::transport::testing;
  Args args;
  if (argc < 2) return 2;
  args.role = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    const std::string value = argv[i + 1];
    if (key == "--connect") args.connect = value;
    if (key == "--listen") args.listen = value;
    if (key == "--tls") args.tls = value;
    if (key == "--peer-errors") args.peer_errors = value == "1";
    if (key == "--shared") args.shared = value == "1";
    if (key == "--manual-clock") args.manual_clock = value == "1";
    if (key == "--mode") args.mode = ecx::transport::parse_ucx_mode(value).value_or(ecx::transport::UcxMode::am);
  }
  if (args.role == "send") return run_sender(args);
  if (args.role == "receive") return run_receiver(args);
  return 2;
}
