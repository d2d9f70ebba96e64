#pragma once
// Hash maps keyed by id strings (transfer ids, mm_hashes, request ids) that are looked
// up by std::string_view without building a std::string: ids are longer than the
// small-string buffer, so each such copy was an allocation, several per item on the
// producer's and the consumer's per-item paths.

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>

namespace ecx {

struct IdHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view id) const noexcept { return std::hash<std::string_view>{}(id); }
};

template <typename V>
using IdMap = std::unordered_map<std::string, V, IdHash, std::equal_to<>>;

}  // namespace ecx
