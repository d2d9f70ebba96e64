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

// An item's content is its base block (4 KiB of mixed words, a function of the
// mm_hash) repeated, with block k's first word xor-ed with a mix of k: within a block
// every 8-byte word differs, every block differs from every other, and items differ
// by their seed, so a misplaced, shifted, truncated or foreign payload is caught. Both
// generating and checking it run at memcpy/memcmp speed, so the simulator stays cheap
// next to what it measures.
constexpr std::size_t kBlockBytes = 4096;
constexpr std::size_t kBlockWords = kBlockBytes / 8;

struct Pattern {
  std::array<std::uint64_t, kBlockWords> base{};
  explicit Pattern(std::uint64_t seed) {
    for (std::size_t i = 0; i < kBlockWords; ++i) base[i] = word_at(seed, i);
  }
  std::uint64_t first_word(std::uint64_t block) const { return base[0] ^ word_at(~base[0], block); }
  const std::byte* bytes() const { return reinterpret_cast<const std::byte*>(base.data()); }
};

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
                TensorSpec::make(std::move(shape), o.dtype, ~0ULL).value()};
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

void fill_content(std::string_view mm_hash, std::span<std::byte> out) {
  const Pattern pattern(content_seed(mm_hash));
  for (std::size_t offset = 0, block = 0; offset < out.size(); offset += kBlockBytes, ++block) {
    const std::size_t n = std::min(kBlockBytes, out.size() - offset);
    std::memcpy(out.data() + offset, pattern.bytes(), n);
    const std::uint64_t first = pattern.first_word(block);
    std::memcpy(out.data() + offset, &first, std::min<std::size_t>(8, n));
  }
}

bool content_matches(std::string_view mm_hash, std::span<const std::byte> data) {
  const Pattern pattern(content_seed(mm_hash));
  for (std::size_t offset = 0, block = 0; offset < data.size(); offset += kBlockBytes, ++block) {
    const std::size_t n = std::min(kBlockBytes, data.size() - offset);
    const std::uint64_t first = pattern.first_word(block);
    const std::size_t head = std::min<std::size_t>(8, n);
    if (std::memcmp(data.data() + offset, &first, head) != 0) return false;
    if (n > head && std::memcmp(data.data() + offset + head, pattern.bytes() + head, n - head) != 0) return false;
  }
  return true;
}

}  // namespace ecx::sim
