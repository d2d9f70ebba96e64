#pragma once
// Keeps the nodes erased from node-based standard containers (set, map, their multi and
// unordered forms) so that a later insert reuses one instead of allocating. On the
// per-transfer paths each index entry was a malloc on insert and a free on erase, on
// the busiest threads. Bounded; one owner, like the containers it serves (not
// thread-safe). A kept map node's mapped value is reset at once, so nothing it owned
// outlives its erase; a kept key (a string) keeps its buffer for the next key.

#include <concepts>
#include <cstddef>
#include <utility>
#include <vector>

namespace ecx {

template <class Container, std::size_t kMaxKept = 64>
class NodeStash {
  static constexpr bool kUnique = requires { typename Container::insert_return_type; };

 public:
  using Node = typename Container::node_type;

  NodeStash() { kept_.reserve(kMaxKept); }

  // Erases the element at `at` from `from`.
  void erase(Container& from, typename Container::const_iterator at) { keep(from.extract(at)); }
  // Erases one element equal to `key` from `from`, if any; true if one was there.
  template <class Key>
  bool erase_key(Container& from, const Key& key) {
    Node node = from.extract(key);
    if (!node) return false;
    keep(std::move(node));
    return true;
  }

  // The inserts answer where the element is and whether it is new (always, in a multi
  // container). A value or key may be anything the element is assignable from (a
  // string_view for a string): it is assigned into a kept node's element, whose buffer
  // it reuses.

  // set / multiset / unordered_set: inserts `value`.
  template <class Value>
  std::pair<typename Container::iterator, bool> insert(Container& into, Value&& value) {
    if (kept_.empty()) return position(into.emplace(std::forward<Value>(value)));
    Node node = take();
    node.value() = std::forward<Value>(value);
    return insert_node(into, std::move(node));
  }

  // map / multimap / unordered_map: inserts `key` -> `mapped`.
  template <class Key, class Mapped>
  std::pair<typename Container::iterator, bool> insert(Container& into, Key&& key, Mapped&& mapped) {
    if (kept_.empty()) return position(into.emplace(std::forward<Key>(key), std::forward<Mapped>(mapped)));
    Node node = take();
    node.key() = std::forward<Key>(key);
    node.mapped() = std::forward<Mapped>(mapped);
    return insert_node(into, std::move(node));
  }

  // map / unordered_map: the mapped value under `key`, inserted (value-initialized)
  // when absent; operator[] with a kept node.
  template <class Key>
  auto& find_or_insert(Container& into, const Key& key) requires kUnique {
    if (auto it = into.find(key); it != into.end()) return it->second;
    return insert(into, key, typename Container::mapped_type{}).first->second;
  }

  // map / unordered_map: `key` -> `mapped`, replacing the value of an existing key;
  // insert_or_assign with a kept node.
  template <class Key, class Mapped>
  auto insert_or_assign(Container& into, const Key& key, Mapped&& mapped) requires kUnique {
    if (auto it = into.find(key); it != into.end()) {
      it->second = std::forward<Mapped>(mapped);
      return it;
    }
    return insert(into, key, std::forward<Mapped>(mapped)).first;
  }

  std::size_t kept() const noexcept { return kept_.size(); }

 private:
  using Position = std::pair<typename Container::iterator, bool>;
  static Position position(typename Container::iterator at) { return {at, true}; }
  static Position position(Position at) { return at; }

  Node take() {
    Node node = std::move(kept_.back());
    kept_.pop_back();
    return node;
  }

  void keep(Node node) {
    if constexpr (requires { typename Container::mapped_type; }) {
      static_assert(std::default_initializable<typename Container::mapped_type>,
                    "a kept node's mapped value is reset, so it lets go of what it owned");
      node.mapped() = typename Container::mapped_type{};
    }
    if (kept_.size() < kMaxKept) kept_.push_back(std::move(node));
  }

  Position insert_node(Container& into, Node node) {
    if constexpr (kUnique) {
      auto inserted = into.insert(std::move(node));
      if (!inserted.inserted) keep(std::move(inserted.node));  // already there: the node goes back
      return {inserted.position, inserted.inserted};
    } else {
      return {into.insert(std::move(node)), true};
    }
  }

  std::vector<Node> kept_;
};

// Moves the entry at `at` of the ordered map `from` into `to` (which may be `from`)
// under `key`, in its own node: a deadline re-armed or handed to another index keeps
// its mapped value (an id string) without copying it. Returns its new place.
template <class Map, class Key>
typename Map::iterator rekey(Map& from, typename Map::iterator at, Map& to, Key&& key) {
  auto node = from.extract(at);
  node.key() = std::forward<Key>(key);
  return to.insert(std::move(node));
}

}  // namespace ecx
