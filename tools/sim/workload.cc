#include "sim/workload.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>

#include <fmt/format.h>
#include <xxhash.h>

namespace ecx::sim {
namespace {

// The word at position `index` of an item's base block: a counter mixed by a
// bijection (the splitmix64 finaliser).
inline std::uint64_t word_at(std::uint64_t seed, std::uint64_t index) {
  std::uint64_t z = seed + index * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// An item's content is one body block (64 KiB of mixed words, the same for every
// item) repeated, each block's first word replaced by a stamp: a mix of the item's
// seed (a function of its mm_hash) and the block's index. Within a block every
// 8-byte word differs, every block of an item differs from every other, and items
// differ in every block's stamp, so a misplaced, shifted, truncated, stale or
// foreign payload is caught. Generating and checking it run at memcpy/memcmp speed;
// memory that already holds the body (prepare_content_body) needs only the stamps
// written (stamp_content) and, for a sampled check, read (stamps_match).
// 64 KiB, not 4 KiB: writing and reading a stamp costs a cache miss, and a 9 MiB
// item's 2304 stamps at 4 KiB cost the simulated engines about 200 us per item of the
// CPU the data plane needs (measured at 32 in flight on 2 CPUs).
constexpr std::size_t kBlockBytes = kContentBlockBytes;
constexpr std::size_t kBlockWords = kBlockBytes / 8;
constexpr std::uint64_t kBodySeed = 0xB0D1B0D1B0D1B0D1ULL;

struct Body {
  std::array<std::uint64_t, kBlockWords> words{};
  Body() {
    for (std::size_t i = 0; i < kBlockWords; ++i) words[i] = word_at(kBodySeed, i);
  }
  const std::byte* bytes() const { return reinterpret_cast<const std::byte*>(words.data()); }
};
const Body& body() {
  static const Body b;
  return b;
}

inline std::uint64_t stamp(std::uint64_t seed, std::uint64_t block) { return word_at(seed, block) ^ ~seed; }

std::uint64_t content_seed(std::string_view mm_hash) {
  const auto seed = XXH64(mm_hash.data(), mm_hash.size(), 0x5eed);
  return seed == 0 ? 1 : seed;
}

}  // namespace

std::vector<SimRequest> make_workload(const WorkloadOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<int> images(o.min_images, std::max(o.min_images, o.max_images));
  std::uniform_int_distribution<int> tokens(o.min_tokens, std::max(o.min_tokens, o.max_tokens));
  std::bernoulli_distribution repeat(o.repeat_fraction);
  std::vector<std::pair<std::string, TensorSpec>> seen;
  std::vector<SimRequest> out;
  out.reserve(static_cast<std::size_t>(o.requests));
  std::uint64_t image_counter = 0;
  for (int r = 0; r < o.requests; ++r) {
    SimRequest request;
    request.request_id = fmt::format("{}-req-{}", o.id_prefix, r);
    const int n = images(rng);
    for (int i = 0; i < n; ++i) {
      const std::string transfer_id = fmt::format("{}-t-{}-{}", o.id_prefix, r, i);
      if (!seen.empty() && repeat(rng)) {
        std::uniform_int_distribution<std::size_t> pick(0, seen.size() - 1);
        const auto& [hash, spec] = seen[pick(rng)];
        request.items.push_back(Item{hash, transfer_id, spec});
        continue;
      }
      std::vector<std::int64_t> shape;
      const auto item_size = dtype_item_size(o.dtype);
      if (o.fixed_bytes > 0) {
        shape = {static_cast<std::int64_t>(std::max<std::uint64_t>(1, o.fixed_bytes / item_size))};
      } else {
        int rows = tokens(rng);
        if (o.log_uniform_tokens) {
          std::uniform_real_distribution<double> u(std::log(std::max(1, o.min_tokens)),
                                                   std::log(std::max(1, o.max_tokens)));
          rows = static_cast<int>(std::lround(std::exp(u(rng))));
        }
        shape = {rows, o.hidden};
      }
      Item item{fmt::format("{}-img-{:08x}-{}", o.id_prefix, o.seed & 0xffffffffULL, image_counter++), transfer_id,
                TensorSpec::make(shape, o.dtype, ~0ULL).value()};
      seen.emplace_back(item.mm_hash, item.spec);
      request.items.push_back(std::move(item));
    }
    out.push_back(std::move(request));
  }
  return out;
}

std::uint64_t total_bytes(const std::vector<SimRequest>& requests) {
  std::uint64_t total = 0;
  for (const auto& r : requests) {
    for (const auto& i : r.items) total += i.spec.nbytes();
  }
  return total;
}

void prepare_content_body(std::span<std::byte> out) {
  for (std::size_t offset = 0; offset < out.size(); offset += kBlockBytes) {
    std::memcpy(out.data() + offset, body().bytes(), std::min(kBlockBytes, out.size() - offset));
  }
}

void stamp_content(std::string_view mm_hash, std::span<std::byte> out) {
  const std::uint64_t seed = content_seed(mm_hash);
  for (std::size_t offset = 0, block = 0; offset < out.size(); offset += kBlockBytes, ++block) {
    const std::uint64_t word = stamp(seed, block);
    std::memcpy(out.data() + offset, &word, std::min<std::size_t>(8, out.size() - offset));
  }
}

void fill_content(std::string_view mm_hash, std::span<std::byte> out) {
  prepare_content_body(out);
  stamp_content(mm_hash, out);
}

bool stamps_match(std::string_view mm_hash, std::span<const std::byte> data) {
  const std::uint64_t seed = content_seed(mm_hash);
  for (std::size_t offset = 0, block = 0; offset < data.size(); offset += kBlockBytes, ++block) {
    const std::uint64_t word = stamp(seed, block);
    if (std::memcmp(data.data() + offset, &word, std::min<std::size_t>(8, data.size() - offset)) != 0) return false;
  }
  return true;
}

bool content_matches(std::string_view mm_hash, std::span<const std::byte> data) {
  if (!stamps_match(mm_hash, data)) return false;
  for (std::size_t offset = 0; offset < data.size(); offset += kBlockBytes) {
    const std::size_t n = std::min(kBlockBytes, data.size() - offset);
    if (n > 8 && std::memcmp(data.data() + offset + 8, body().bytes() + 8, n - 8) != 0) return false;
  }
  return true;
}

}  // namespace ecx::sim
