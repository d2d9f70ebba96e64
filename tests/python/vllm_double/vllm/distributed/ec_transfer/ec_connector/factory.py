"""Test double of vllm/distributed/ec_transfer/ec_connector/factory.py: resolves the
connector class the way vLLM does for an out-of-tree connector. Not vLLM."""

from __future__ import annotations

import importlib
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole


class ECConnectorFactory:
    _registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def get_connector_class(cls, ec_transfer_config: Any) -> type[ECConnectorBase]:
        name = ec_transfer_config.ec_connector
        if name in cls._registry:
            module_path, class_name = cls._registry[name]
        elif ec_transfer_config.ec_connector_module_path:
            module_path, class_name = ec_transfer_config.ec_connector_module_path, name
        else:
            raise ValueError(f"Unsupported connector type: {name}")
        return getattr(importlib.import_module(module_path), class_name)

    @classmethod
    def create_connector(cls, config: Any, role: ECConnectorRole) -> ECConnectorBase:
        connector_cls = cls.get_connector_class(config.ec_transfer_config)
        return connector_cls(config, role)
