#include "sim/workload.h"

#include <cmath>
#include <cstring>
#include <random>

#include <fmt/format.h>
#include <xxhash.h>

namespace ecx::sim {
namespace {

std::uint64_t next(std::uint64_t& state) {
  // xorshift64*: fast and good enough to make every byte position distinct.
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return state * 0x2545F4914F6CDD1DULL;
}

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
  std::uint64_t state = content_seed(mm_hash);
  std::size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    const std::uint64_t v = next(state);
    std::memcpy(out.data() + i, &v, 8);
  }
  if (i < out.size()) {
    const std::uint64_t v = next(state);
    std::memcpy(out.data() + i, &v, out.size() - i);
  }
}

bool content_matches(std::string_view mm_hash, std::span<const std::byte> data) {
  std::uint64_t state = content_seed(mm_hash);
  std::size_t i = 0;
  for (; i + 8 <= data.size(); i += 8) {
    const std::uint64_t v = next(state);
    if (std::memcmp(data.data() + i, &v, 8) != 0) return false;
  }
  if (i < data.size()) {
    const std::uint64_t v = next(state);
    if (std::memcmp(data.data() + i, &v, data.size() - i) != 0) return false;
  }
  return true;
}

}  // namespace ecx::sim
