#include "ecx/proxy/flow.h"

#include <array>
#include <iterator>
#include <random>
#include <utility>

#include <fmt/format.h>
#include <openssl/evp.h>

namespace ecx::proxy {

std::string_view modality_name(Modality modality) noexcept {
  switch (modality) {
    case Modality::image:
      return "image";
    case Modality::audio:
      return "audio";
    case Modality::video:
      return "video";
  }
  return "unknown";
}

std::string sha256_hex(std::string_view data) {
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int length = 0;
  EVP_Digest(data.data(), data.size(), digest.data(), &length, EVP_sha256(), nullptr);
  std::string hex;
  hex.reserve(std::size_t{length} * 2);
  for (unsigned int i = 0; i < length; ++i) fmt::format_to(std::back_inserter(hex), "{:02x}", digest[i]);
  return hex;
}

std::string random_hex(std::size_t digits) {
  thread_local std::mt19937_64 generator{[] {
    std::random_device device;
    std::seed_seq seed{device(), device(), device(), device()};
    return std::mt19937_64(seed);
  }()};
  std::string out;
  out.reserve(digits + 16);
  while (out.size() < digits) fmt::format_to(std::back_inserter(out), "{:016x}", generator());
  out.resize(digits);
  return out;
}

std::vector<std::vector<std::size_t>> group_items(const std::vector<MediaRef>& media, int max_batch) {
  std::vector<std::size_t> all(media.size());
  for (std::size_t i = 0; i < media.size(); ++i) all[i] = i;
  return group_items(media, all, max_batch);
}

std::vector<std::vector<std::size_t>> group_items(const std::vector<MediaRef>& media,
                                                  const std::vector<std::size_t>& indices, int max_batch) {
  std::vector<std::vector<std::size_t>> groups;
  std::vector<std::size_t> images;
  const auto limit = max_batch <= 0 ? indices.size() : static_cast<std::size_t>(max_batch);
  for (const std::size_t i : indices) {
    if (media[i].modality != Modality::image || limit <= 1) {
      groups.push_back({i});
      continue;
    }
    images.push_back(i);
    if (images.size() == limit) groups.push_back(std::exchange(images, {}));
  }
  if (!images.empty()) groups.push_back(std::move(images));
  return groups;
}

}  // namespace ecx::proxy
