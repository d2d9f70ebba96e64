#pragma once
// The one way ECX writes down a state machine: an enum of states and a constexpr
// table of the transitions it allows. Every machine (the scheduler's transfer
// records, the consumer's reservations, the producer's pushes and push shards) uses
// this type, so "is this move legal?" is answered the same way everywhere, and an
// illegal move is the caller's counted, logged failure of that one transfer — never
// an abort.
//
//   constexpr auto kTable = TransitionTable<State, kStateCount>{
//       {State::a, {State::b, State::c}},
//       {State::b, {State::c}},
//   };
//   if (!kTable.allows(from, to)) { ++invalid; log; fail that transfer; }

#include <array>
#include <cstddef>
#include <initializer_list>

namespace ecx {

template <typename State, std::size_t kStates>
class TransitionTable {
 public:
  // One row: the states `from` may move to.
  struct Row {
    State from;
    std::initializer_list<State> to;
  };

  constexpr TransitionTable(std::initializer_list<Row> rows) {
    for (const Row& row : rows) {
      for (State to : row.to) allowed_[index(row.from)][index(to)] = true;
    }
  }

  // False for an out-of-range value too (a corrupted record is refused, not indexed).
  constexpr bool allows(State from, State to) const noexcept {
    return index(from) < kStates && index(to) < kStates && allowed_[index(from)][index(to)];
  }

  static constexpr std::size_t size() noexcept { return kStates; }

 private:
  static constexpr std::size_t index(State s) noexcept { return static_cast<std::size_t>(s); }

  std::array<std::array<bool, kStates>, kStates> allowed_{};
};

}  // namespace ecx
