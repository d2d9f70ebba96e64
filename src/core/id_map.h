#pragma once
// Hash maps keyed by id strings (transfer ids, mm_hashes, request ids) that are looked
// up by std::string_view without building a std::string: ids are longer than the
// small-string buffer, so each such copy was an allocation, several per item on the
// producer's and the consumer's per-item paths.
//
// The hasher is deliberately not noexcept: libstdc++ then keeps each node's hash
// code. With a noexcept hasher it keeps none, and every lookup rehashes the key of
// each node it steps past in a bucket (a second pointer chase and a full hash of a
// 56-byte id), as does every erase and rehash; on the per-item paths those node
// keys are cold, and the recomputation was most of the tables' cost in profiles.

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

namespace ecx {

struct IdHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view id) const { return std::hash<std::string_view>{}(id); }
};

template <typename V>
using IdMap = std::unordered_map<std::string, V, IdHash, std::equal_to<>>;
using IdSet = std::unordered_set<std::string, IdHash, std::equal_to<>>;

}  // namespace ecx
