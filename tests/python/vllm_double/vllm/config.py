"""Test double of the parts of vLLM's configuration an EC connector reads. Not vLLM."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ECTransferConfig:
    ec_connector: str | None = None
    ec_connector_module_path: str | None = None
    ec_role: str | None = None
    ec_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    engine_id: str | None = None
    ec_buffer_device: str | None = "cuda"  # vLLM's default
    ec_buffer_size: float = 1e9
    ec_rank: int | None = None
    ec_parallel_size: int = 1
    ec_ip: str = "127.0.0.1"
    ec_port: int = 14579

    def __post_init__(self) -> None:
        if self.ec_connector is not None and self.ec_role not in ("ec_producer", "ec_consumer", "ec_both"):
            raise ValueError(f"ec_role must be set with an EC connector, got {self.ec_role!r}")
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())

    @property
    def is_ec_producer(self) -> bool:
        return self.ec_connector is not None and self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_ec_consumer(self) -> bool:
        return self.ec_connector is not None and self.ec_role in ("ec_consumer", "ec_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.ec_connector_extra_config.get(key, default)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0


@dataclass
class ModelConfig:
    dtype: torch.dtype = torch.bfloat16
    inputs_embeds_size: int = 64
    model: str = "double/vl-model"
    revision: str | None = None

    def get_inputs_embeds_size(self) -> int:
        return self.inputs_embeds_size


@dataclass
class DeviceConfig:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass
class VllmConfig:
    ec_transfer_config: ECTransferConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
