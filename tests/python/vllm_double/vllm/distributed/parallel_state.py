"""Test double of vllm.distributed.parallel_state: the ranks of the worker being built.

vLLM runs one worker per process; the double can build several workers in one
process, so the engine double sets the ranks before it constructs each worker's
connector (set_ranks is the double's own, not vLLM's).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _GroupCoordinator:
    rank_in_group: int = 0
    world_size: int = 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


_tp = _GroupCoordinator()
_pp = _GroupCoordinator()


def set_ranks(tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> None:
    global _tp, _pp
    _tp = _GroupCoordinator(tp_rank, tp_size)
    _pp = _GroupCoordinator(pp_rank, pp_size)


def get_tensor_model_parallel_rank() -> int:
    return _tp.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _tp.world_size


def get_pp_group() -> _GroupCoordinator:
    return _pp
