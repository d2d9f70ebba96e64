#pragma once
// Synthetic multimodal workloads for the demo, the end-to-end bench and the
// integration tests: requests of 1..N images whose embedding shapes follow a
// Qwen2.5-VL-7B-like distribution, some images repeated across requests, and
// deterministic content derived from each image's mm_hash so any process can verify
// a delivery bit for bit without shipping the expected bytes.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ecx/core/dtype.h"
#include "ecx/core/tensor_spec.h"

namespace ecx::sim {

struct Item {
  std::string mm_hash;
  std::string transfer_id;  // unique per occurrence
  TensorSpec spec;
};

struct SimRequest {
  std::string request_id;
  std::vector<Item> items;
};

struct WorkloadOptions {
  int requests = 200;
  int min_images = 1;
  int max_images = 4;
  int min_tokens = 256;
  int max_tokens = 2500;
  int hidden = 3584;
  DType dtype = DType::bfloat16;
  double repeat_fraction = 0.2;     // share of image occurrences that reuse an earlier image
  bool log_uniform_tokens = false;  // token counts log-uniform in [min, max] (many small, few large)
  std::uint64_t seed = 1;
  std::uint64_t fixed_bytes = 0;  // > 0: every item has exactly this size (benches)
  std::string id_prefix = "sim";
};

std::vector<SimRequest> make_workload(const WorkloadOptions& options);
std::uint64_t total_bytes(const std::vector<SimRequest>& requests);

// Deterministic content of an image: a function of its mm_hash only (see workload.cc),
// in blocks of this size (the body repeats at this period, each block stamped).
inline constexpr std::size_t kContentBlockBytes = std::size_t{64} * 1024;
void fill_content(std::string_view mm_hash, std::span<std::byte> out);
bool content_matches(std::string_view mm_hash, std::span<const std::byte> data);
// The same content in two steps, for memory an engine reuses (an arena whose outputs
// start at multiples of kContentBlockBytes):
// the body every item shares, written once, then each item's per-block stamps.
void prepare_content_body(std::span<std::byte> out);
void stamp_content(std::string_view mm_hash, std::span<std::byte> out);
// Only the stamps: catches a foreign, stale, misplaced or truncated payload, not a
// corrupted byte inside a block (content_matches does).
bool stamps_match(std::string_view mm_hash, std::span<const std::byte> data);

}  // namespace ecx::sim
