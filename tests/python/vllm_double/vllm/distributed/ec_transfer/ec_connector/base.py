"""Test double of vllm/distributed/ec_transfer/ec_connector/base.py (the hooks ECX implements)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any


class ECConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class ECConnectorMetadata(ABC):  # noqa: B024 - an empty marker class, as in vLLM
    """Per-step plan from the scheduler-side connector to the workers."""


class ECConnectorWorkerMetadata(ABC):
    """Per-step report from each worker, folded across ranks with aggregate()."""

    @abstractmethod
    def aggregate(self, other: "ECConnectorWorkerMetadata") -> "ECConnectorWorkerMetadata": ...


class ECConnectorBase(ABC):
    def __init__(self, vllm_config: Any, role: ECConnectorRole):
        if vllm_config.ec_transfer_config is None:
            raise ValueError("ec_transfer_config must be set for an EC connector")
        self._vllm_config = vllm_config
        self._role = role
        self._connector_metadata: ECConnectorMetadata | None = None
        self._is_producer = vllm_config.ec_transfer_config.is_ec_producer
        self._is_consumer = vllm_config.ec_transfer_config.is_ec_consumer

    @property
    def role(self) -> ECConnectorRole:
        return self._role

    @property
    def is_producer(self) -> bool:
        return self._is_producer

    @property
    def is_consumer(self) -> bool:
        return self._is_consumer

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> ECConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    # Worker side
    @abstractmethod
    def start_load_caches(self, encoder_cache: dict, **kwargs: Any) -> None: ...

    @abstractmethod
    def save_caches(self, encoder_cache: dict, mm_hash: str, **kwargs: Any) -> None: ...

    def start_worker_services(self) -> None:
        return None

    def start_save_caches(self, **kwargs: Any) -> None:
        return None

    def register_caches(self, ec_caches: dict) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        return None

    # Scheduler side
    @abstractmethod
    def has_cache_item(self, identifier: str) -> bool: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, index: int) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> ECConnectorMetadata: ...

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        return True

    def update_state_after_free(self, request: Any, index: int) -> None:
        return None

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def has_pending_push_work(self) -> bool:
        return False

    def take_unavailable_requests(self) -> set[str]:
        return set()

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def shutdown(self) -> None:
        return None
