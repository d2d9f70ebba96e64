// Fault cases across real processes: the producer is `ecx demo --role producer`, the
// consumer runs here (stepped like an engine, or as bare shards) or as `ecx consumer`.
// ZeroMQ and UCX over loopback; consumer-side timeouts run on a manual clock so no
// test sleeps a timeout out.
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <set>
#include <thread>

#include <iostream>

#include <gtest/gtest.h>

#include "ecx/consumer/consumer_shard.h"
#include "fault_support.h"
#include "sim/engine_sim.h"
#include "sim/process.h"
#include "sim/workload.h"

namespace ecx::fault {
namespace {

using namespace std::chrono_literals;
using sim::ChildProcess;

// 1. The producer dies (SIGKILL) while its pushes are in flight. Every request the
// consumer admitted resolves — ready, or unavailable by push_wait_timeout — and the
// pool holds nothing but resident copies once the reservation TTL has passed.
// A landing the kill cut off fails when the consumer's transport sees the producer's
// endpoint fail, or at the latest when its landing watchdog (the reservation TTL)
// closes that endpoint; UCX 1.13 alone sometimes never completes such a receive.
// One round; `cut_off` tells whether the kill caught a request still waiting for its
// payload (whether it did is up to timing: the payloads may all have been on the
// wire, complete, when the signal hit).
void producer_killed_round(bool* cut_off) {
  *cut_off = false;
  const int port = free_port_block(1);
  ASSERT_NE(port, 0);
  constexpr double kPushWait = 3.0;
  constexpr double kTtl = 2.0;
  auto clock = std::make_shared<ManualClock>();
  sim::ConsumerSimOptions options;
  options.config =
      consumer_config(1, port, "256MiB", {{"push_wait_timeout_s", kPushWait}, {"reservation_ttl_s", kTtl}});
  options.clock = clock;
  options.deadline = 120s;  // manual time: reached only if the test stops advancing it wrongly

  std::optional<ChildProcess> producer;
  std::atomic<bool> stop{false};
  bool killed = false;
  TimePoint killed_at{};
  std::optional<TimePoint> all_resolved_at;
  std::uint64_t admitted_at_kill = 0;
  std::string at_kill;
  std::optional<std::chrono::steady_clock::time_point> settle_since;
  options.on_step = [&](const sim::Progress& p) {
    if (!killed) {
      // Kill while the pool holds reservations and a batch of admitted requests
      // still waits (the producer admits a batch of 8 right after binding their
      // sources: their 4..8 MiB payloads are then usually still on the wire).
      if (p.in_flight >= 6 && p.pool_used_bytes > 0) {
        producer->signal(SIGKILL);
        killed = true;
        killed_at = clock->now();
        admitted_at_kill = p.requests_admitted;
        at_kill = "at the kill: admitted " + std::to_string(p.requests_admitted) + ", ready " +
                  std::to_string(p.requests_ready) + ", in flight " + std::to_string(p.in_flight) + ", pool used " +
                  std::to_string(p.pool_used_bytes);
      }
      return;
    }
    if (!all_resolved_at && p.in_flight == 0) all_resolved_at = clock->now();
    // Move consumer time past every deadline, then give the shard's expiry sweep
    // (its control thread's tick) a moment of real time before stopping.
    const auto settle = killed_at + seconds_to_duration(std::max(kPushWait, kTtl) + 2.0);
    if (clock->now() < settle) {
      clock->advance(20ms);
    } else if (!settle_since) {
      settle_since = std::chrono::steady_clock::now();
    } else if (p.in_flight == 0 && std::chrono::steady_clock::now() - *settle_since > 1500ms) {
      stop.store(true);
    }
  };
  auto consumer = sim::ConsumerSim::start(std::move(options));
  ASSERT_TRUE(consumer) << consumer.status().to_string();

  auto args = producer_args((*consumer)->control_address(), port, (*consumer)->admit_endpoint());
  args.requests = 40;
  args.min_tokens = 2048;  // 4..8 MiB items (bf16, hidden 1024)
  args.max_tokens = 4096;
  args.pool = "256MiB";
  auto spawned = ChildProcess::spawn(producer_argv(args));
  ASSERT_TRUE(spawned) << spawned.status().to_string();
  producer.emplace(std::move(*spawned));

  const auto result = (*consumer)->run(&stop);
  ASSERT_TRUE(killed) << "the producer finished before it could be killed";
  EXPECT_EQ(producer->wait(5s).value_or(-1), 128 + SIGKILL);
  EXPECT_FALSE(result.producer_done);
  EXPECT_TRUE(stop.load()) << "the consumer ran into its deadline";
  // Every admitted request resolved, within push_wait_timeout of the kill.
  EXPECT_GE(result.progress.requests_admitted, admitted_at_kill);
  EXPECT_EQ(result.progress.requests_ready + result.progress.requests_failed, result.progress.requests_admitted);
  *cut_off = result.progress.requests_failed > 0;
  if (!*cut_off)
    std::fprintf(stderr, "no request was waiting for a push when the producer died; %s\n", at_kill.c_str());
  ASSERT_TRUE(all_resolved_at.has_value());
  EXPECT_LE(*all_resolved_at - killed_at, seconds_to_duration(kPushWait) + 100ms);
  // Nothing corrupted, nothing leaked.
  EXPECT_EQ(result.content_mismatches, 0U);
  EXPECT_EQ(result.checksum_mismatches, 0U);
  EXPECT_EQ(result.live_reservations, 0U) << at_kill;
  EXPECT_EQ(result.leaked_pool_bytes, 0U) << at_kill;
  EXPECT_EQ(result.invariant_error, "");
}

TEST(ProducerKilled, WaitingRequestsBecomeUnavailableAndThePoolIsFreed) {
  // Every round must resolve everything and leak nothing; at least one must have
  // cut a payload off (almost always the first).
  bool cut_off = false;
  for (int round = 0; round < 4 && !cut_off && !::testing::Test::HasFailure(); ++round) {
    producer_killed_round(&cut_off);
  }
  EXPECT_TRUE(cut_off) << "in 4 rounds the kill never caught a request waiting for its payload";
}

// 2. The consumer process dies (SIGKILL) while the producer pushes 2..4 MiB items,
// and comes back on the same ports. Returns the producer's result line; it must exit
// within its deadline, and the restarted consumer must still shut down cleanly.
json consumer_restarted_while_pushing(const std::string& producer_extra) {
  const int port = free_port_block(1);
  EXPECT_NE(port, 0);
  if (port == 0) return json();
  const ConsumerConfigFile config("fault_consumer", consumer_document(port, "256MiB"));
  auto consumer = spawn_serving_consumer(config);
  EXPECT_TRUE(consumer);
  if (!consumer) return json();

  AdmitChannel admit;
  auto args = producer_args(tcp_address("127.0.0.1", port), port, admit.endpoint());
  args.requests = 60;
  args.min_tokens = 1024;  // 2..4 MiB items
  args.max_tokens = 2048;
  args.deadline_s = 20;
  args.extra = producer_extra;
  const auto started = std::chrono::steady_clock::now();
  auto producer = ChildProcess::spawn(producer_argv(args));
  EXPECT_TRUE(producer) << producer.status().to_string();
  if (!producer) return json();

  // Kill the consumer once the producer has finished its first requests (their
  // pushes are then in flight).
  auto first = admit.next(30s);
  EXPECT_TRUE(first.has_value()) << "the producer never admitted a request";
  if (!first) return json();
  consumer->signal(SIGKILL);
  EXPECT_EQ(consumer->wait(5s).value_or(-1), 128 + SIGKILL);
  auto restarted = spawn_serving_consumer(config);
  EXPECT_TRUE(restarted);

  const auto result =
      producer_result(*producer, std::chrono::milliseconds(static_cast<int>(args.deadline_s * 1000)) + 15s);
  const auto exit_code = producer->wait(5s);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_TRUE(exit_code.has_value()) << "the producer hangs";
  EXPECT_EQ(exit_code.value_or(-1), 0);
  EXPECT_TRUE(result.has_value()) << "no result line";
  EXPECT_LE(wall, args.deadline_s + 10.0) << result.value_or(json()).dump();
  if (restarted) {
    restarted->signal(SIGTERM);
    EXPECT_EQ(restarted->wait(15s).value_or(-1), 0);
  }
  return result.value_or(json());
}

// Every item reserves first: the reservations in flight die with the consumer, so
// their saves fail, and the producer says so.
TEST(ConsumerRestarted, ProducerReportsFailedSavesAndExitsInTime) {
  const auto result = consumer_restarted_while_pushing(R"({"direct_payload_max_bytes": 0})");
  EXPECT_GT(result.value("failed_saves", 0ULL), 0U) << result.dump();
  EXPECT_EQ(result.value("direct_sent", 1ULL), 0U) << result.dump();
}

// Direct payloads (the default for a push to one shard): a payload whose shard died is
// reserved again, once, after the producer finds the topology anew, so the restarted
// consumer may take it; what it does not take is a failed save. Every item is one or
// the other.
TEST(ConsumerRestarted, DirectPayloadsReachTheRestartedConsumerOrFailAndEveryItemIsAccountedFor) {
  const auto result = consumer_restarted_while_pushing("");
  EXPECT_GT(result.value("direct_sent", 0ULL), 0U) << result.dump();
  EXPECT_EQ(result.value("pushes_done", 0ULL) + result.value("failed_saves", 0ULL), result.value("items", 1ULL))
      << result.dump();
}

// 2b. The consumer process is stopped (SIGSTOP) while the producer pushes, stays
// stopped until the producer has given up on it (every producer deadline passed),
// then resumes. The producer exits in time; the resumed consumer finds requests and
// payloads that are all late, answers or drops them, and once its reservation TTL
// has passed its pool holds only resident copies: no live record, nothing leaked.
TEST(ConsumerStopped, ResumedPastEveryDeadlineItLeaksNothing) {
  const int port = free_port_block(2);  // control port, metrics port
  ASSERT_NE(port, 0);
  const int metrics_port = port + 1;
  const ConsumerConfigFile config(
      "fault_stopped", consumer_document(port, "256MiB", {{"reservation_ttl_s", 2}, {"metrics_port", metrics_port}}));
  auto consumer = spawn_serving_consumer(config);
  ASSERT_TRUE(consumer);

  AdmitChannel admit;
  auto args = producer_args(tcp_address("127.0.0.1", port), port, admit.endpoint());
  args.requests = 40;
  args.min_tokens = 1024;  // 2..4 MiB items
  args.max_tokens = 2048;
  args.deadline_s = 6;
  const auto started = std::chrono::steady_clock::now();
  auto producer = ChildProcess::spawn(producer_argv(args));
  ASSERT_TRUE(producer) << producer.status().to_string();
  auto first = admit.next(30s);
  ASSERT_TRUE(first.has_value()) << "the producer never admitted a request";
  consumer->signal(SIGSTOP);
  // The producer gives up on the stopped consumer by its own deadlines.
  const auto result =
      producer_result(*producer, std::chrono::milliseconds(static_cast<int>(args.deadline_s * 1000)) + 20s);
  const auto exit_code = producer->wait(5s);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  consumer->signal(SIGCONT);
  ASSERT_TRUE(exit_code.has_value()) << "the producer hangs on a stopped consumer";
  EXPECT_EQ(*exit_code, 0);
  EXPECT_TRUE(result.has_value()) << "no result line";
  EXPECT_LE(wall, args.deadline_s + 15.0);

  // Resumed: everything it held expires within the TTL (plus its one-second sweep).
  std::map<std::string, double> m;
  const auto until = std::chrono::steady_clock::now() + 15s;
  while (std::chrono::steady_clock::now() < until) {
    m = scrape_metrics(metrics_port);
    if (!m.empty() && m["ecx_consumer_live_records"] == 0 && m["ecx_consumer_leases"] == 0 &&
        m["ecx_consumer_pool_used_bytes"] == m["ecx_consumer_resident_bytes"])
      break;
    std::this_thread::sleep_for(100ms);
  }
  ASSERT_FALSE(m.empty()) << "no metrics from the resumed consumer";
  EXPECT_EQ(m["ecx_consumer_live_records"], 0);
  EXPECT_EQ(m["ecx_consumer_pool_used_bytes"], m["ecx_consumer_resident_bytes"]) << "pool bytes leaked";
  EXPECT_EQ(m["ecx_consumer_checksum_mismatches_total"], 0);
  EXPECT_EQ(m["ecx_consumer_invalid_transitions_total"], 0);
  // Still healthy: it shuts down cleanly.
  consumer->signal(SIGTERM);
  EXPECT_EQ(consumer->wait(15s).value_or(-1), 0);
}

// 2c. Deadlines passing mid-write: the producer is stopped (SIGSTOP) while one of
// its payloads is landing. Once that landing has been open for the reservation TTL
// (manual clock) the consumer's landing watchdog closes the producer's connection
// and fails the landing after the close completed, so its slot is freed with no
// fragment able to follow; the producer's other reservations expire by the same
// TTL. The resumed producer finds its connection closed and carries on or gives up
// by its deadline; whatever lands afterwards is bit-exact, and nothing leaks.
TEST(ProducerStalled, LandingPastItsDeadlineIsCutOffAndItsSlotFreed) {
  const int port = free_port_block(1);
  ASSERT_NE(port, 0);
  constexpr double kTtl = 2.0;
  auto clock = std::make_shared<ManualClock>();
  auto config = consumer_config(1, port, "512MiB", {{"reservation_ttl_s", kTtl}});
  auto shard = consumer::ConsumerShard::start(config, clock);
  ASSERT_TRUE(shard) << shard.status().to_string();
  auto& s = **shard;
  AdmitChannel admit;
  auto args = producer_args(config.control_address(0), port, admit.endpoint());
  args.requests = 12;
  args.min_tokens = 16384;  // 32 MiB items (bf16, hidden 1024): each takes a while to land
  args.max_tokens = 16384;
  args.pool = "512MiB";
  args.deadline_s = 20;
  auto producer = ChildProcess::spawn(producer_argv(args));
  ASSERT_TRUE(producer) << producer.status().to_string();

  auto open_landings = [&] {
    const auto c = s.counters().reservations;
    return c.landings_accepted - c.landings_ready - c.landings_failed;
  };
  // Stop the producer while a payload is landing; confirm that the landing stays
  // open (it did not just finish before the signal), else resume and try again.
  bool stalled = false;
  const auto give_up = std::chrono::steady_clock::now() + 30s;
  while (!stalled && std::chrono::steady_clock::now() < give_up && producer->running()) {
    if (open_landings() == 0) {
      std::this_thread::sleep_for(200us);
      continue;
    }
    producer->signal(SIGSTOP);
    std::this_thread::sleep_for(300ms);
    if (open_landings() > 0) {
      stalled = true;
    } else {
      producer->signal(SIGCONT);
    }
  }
  ASSERT_TRUE(stalled) << "never caught a payload mid-landing";
  const auto failed_before = s.counters().reservations.landings_failed;
  const auto peer_failures_before = s.counters().transport.peer_failures;

  // The landing's deadline passes: the watchdog cuts the producer off.
  clock->advance(seconds_to_duration(kTtl) + 1s);
  auto settled = [&] {
    const auto c = s.counters().reservations;
    return open_landings() == 0 && c.live_records == 0 && c.pool_used_bytes == c.resident_bytes;
  };
  for (int i = 0; i < 250 && !settled(); ++i) std::this_thread::sleep_for(20ms);
  {
    const auto c = s.counters();
    EXPECT_EQ(open_landings(), 0U) << "the stalled landing is still open";
    EXPECT_GT(c.reservations.landings_failed, failed_before);
    EXPECT_GT(c.transport.peer_failures, peer_failures_before) << "the stalled sender was not cut off";
    EXPECT_EQ(c.reservations.live_records, 0U);
    EXPECT_EQ(c.reservations.pool_used_bytes, c.reservations.resident_bytes) << "pool bytes leaked";
    EXPECT_TRUE(s.check_invariants()) << s.check_invariants().to_string();
  }

  // Resumed, the producer finds its connection closed; it retries or gives up by its
  // deadline. Keep consumer time moving so what it reserves now can expire too.
  producer->signal(SIGCONT);
  const auto until = std::chrono::steady_clock::now() + 40s;
  while (!producer->eof() && std::chrono::steady_clock::now() < until) {
    clock->advance(50ms);
    (void)producer->read_line(10ms);
  }
  EXPECT_TRUE(producer->eof()) << "the resumed producer did not finish";
  EXPECT_EQ(producer->wait(5s).value_or(-1), 0);
  clock->advance(seconds_to_duration(kTtl) + 1s);
  for (int i = 0; i < 250 && !settled(); ++i) std::this_thread::sleep_for(20ms);
  const auto c = s.counters().reservations;
  EXPECT_EQ(c.checksum_mismatches, 0U) << "a corrupted payload was landed";
  EXPECT_EQ(c.live_records, 0U);
  EXPECT_EQ(c.pool_used_bytes, c.resident_bytes) << "pool bytes leaked";
  EXPECT_TRUE(s.check_invariants()) << s.check_invariants().to_string();
}

// A consumer at `tp` with 8 MiB pools and a producer pushing `requests` items of 1..4
// MiB: every item is still delivered to every rank, bit-exact, nothing left behind.
// Returns the producer's result line.
json expect_every_item_through_a_full_pool(int tp, int requests, const json& consumer_extra = json::object()) {
  const int port = free_port_block(tp);
  EXPECT_NE(port, 0);
  sim::ConsumerSimOptions options;
  options.config = consumer_config(tp, port, "8MiB", consumer_extra);
  options.deadline = 60s;
  auto consumer = sim::ConsumerSim::start(std::move(options));
  EXPECT_TRUE(consumer) << consumer.status().to_string();
  if (!consumer) return json();
  auto args = producer_args((*consumer)->control_address(), port, (*consumer)->admit_endpoint());
  args.requests = requests;
  args.min_tokens = 512;  // 1..4 MiB items (bf16, hidden 1024)
  args.max_tokens = 2048;
  args.deadline_s = 50;
  auto producer = ChildProcess::spawn(producer_argv(args));
  EXPECT_TRUE(producer) << producer.status().to_string();
  if (!producer) return json();

  const auto result = (*consumer)->run();
  const auto line = producer_result(*producer, 30s);
  EXPECT_EQ(producer->wait(5s).value_or(-1), 0);
  EXPECT_TRUE(line.has_value());
  if (!line) return json();
  EXPECT_TRUE(result.producer_done);
  // The full pool pushed back: reserves held until space freed (reserve_hold_ms), or
  // answered retry-after where holds are off.
  EXPECT_GT(line->value("retry_afters", 0ULL) + result.reserves_held, 0U) << line->dump();
  EXPECT_EQ(line->value("failed_saves", 1ULL), 0U) << line->dump();
  const auto n = static_cast<std::uint64_t>(requests);
  EXPECT_EQ(result.progress.requests_admitted, n);
  EXPECT_EQ(result.progress.requests_ready, n) << line->dump();
  EXPECT_EQ(result.progress.requests_failed, 0U);
  EXPECT_EQ(result.items_ready, n);
  EXPECT_EQ(result.content_mismatches, 0U);
  EXPECT_EQ(result.checksum_mismatches, 0U);
  EXPECT_EQ(result.live_reservations, 0U);
  EXPECT_EQ(result.leaked_pool_bytes, 0U);
  EXPECT_EQ(result.invariant_error, "");
  return *line;
}

// 3. A pool far smaller than the workload: the consumer holds reserves while it is full
// (or answers retry-after), and every item is still delivered, bit-exact.
TEST(PoolExhausted, BackPressureStillDeliversEveryItem) { expect_every_item_through_a_full_pool(1, 50); }

// 3b. The same at TP 2, each shard answering retry at once (no holds): a push holds
// both shards' slots or none, so a shard that did reserve while its sibling was told to
// retry gives its slot back and reserves again with it. Every item still reaches both
// ranks bit-exact, and no slot is left behind.
TEST(PoolExhausted, AtTp2APushHoldsBothSlotsOrNoneAndEveryItemArrives) {
  const json line = expect_every_item_through_a_full_pool(2, 40, {{"reserve_hold_ms", 0}});
  std::cout << "retry-afters " << line.value("retry_afters", 0ULL) << ", slots given back "
            << line.value("yields", 0ULL) << "\n";
}

// 4. One image in 50 requests: one write and one landing; every other transfer is a
// follower of that write or a hit on its resident copy, and all 50 read the same
// bit-exact content. The consumer is a bare shard here so its counters are visible.
TEST(SameImageInFiftyRequests, OneWriteOneLandingEveryTransferServed) {
  const int port = free_port_block(1);
  ASSERT_NE(port, 0);
  auto config = consumer_config(1, port, "64MiB");
  auto shard = consumer::ConsumerShard::start(config);
  ASSERT_TRUE(shard) << shard.status().to_string();
  AdmitChannel admit;
  auto args = producer_args(config.control_address(0), port, admit.endpoint());
  args.requests = 50;
  args.min_tokens = 512;  // one 1 MiB image
  args.max_tokens = 512;
  args.repeat = 1.0;  // every occurrence after the first repeats it
  auto producer = ChildProcess::spawn(producer_argv(args));
  ASSERT_TRUE(producer) << producer.status().to_string();

  std::map<std::string, std::string> transfers;  // transfer_id -> mm_hash
  bool done = false;
  while (!done) {
    auto message = admit.next(30s);
    ASSERT_TRUE(message.has_value()) << "the producer stopped admitting";
    if (std::holds_alternative<sim::AdmitDone>(*message)) {
      done = true;
      break;
    }
    for (const auto& item : std::get<sim::AdmitRequest>(*message).items) transfers[item.transfer_id] = item.mm_hash;
  }
  const auto line = producer_result(*producer, 30s);
  EXPECT_EQ(producer->wait(5s).value_or(-1), 0);
  ASSERT_TRUE(line.has_value());
  EXPECT_EQ(line->value("failed_saves", 1ULL), 0U) << line->dump();
  ASSERT_EQ(transfers.size(), 50U);
  std::set<std::string> hashes;
  for (const auto& [tid, hash] : transfers) hashes.insert(hash);
  ASSERT_EQ(hashes.size(), 1U);

  // Every transfer is served with the image's exact content.
  std::size_t served = 0;
  for (const auto& [tid, hash] : transfers) {
    auto lease = (*shard)->take(tid, hash);
    if (!lease) {
      ADD_FAILURE() << tid << ": " << lease.status().to_string();
      continue;
    }
    EXPECT_TRUE(sim::content_matches(hash, std::span<const std::byte>(lease->data(), lease->nbytes()))) << tid;
    ++served;
  }
  EXPECT_EQ(served, 50U);
  const auto c = (*shard)->counters().reservations;
  EXPECT_EQ(c.reserved_writer, 1U);
  EXPECT_EQ(c.landings_accepted, 1U);
  EXPECT_EQ(c.landings_ready, 1U);
  EXPECT_EQ(c.bytes_landed, 1U << 20);
  EXPECT_EQ(c.reserved_follower + c.resident_hits, 49U)
      << "followers " << c.reserved_follower << ", resident hits " << c.resident_hits;
  EXPECT_EQ(c.checksum_mismatches, 0U);
  EXPECT_TRUE((*shard)->check_invariants()) << (*shard)->check_invariants().to_string();
}

}  // namespace
}  // namespace ecx::fault
