"""Smoke tests of the Python package built by `make build`."""

import json

import pytest

import ecx


def test_version_is_exposed():
    assert ecx.__version__.count(".") == 2


def test_parse_config_resolves_every_shard():
    config = ecx.parse_config(
        json.dumps({"ec_role": "ec_consumer", "ec_port": 21000}), tp_size=2, tp_rank=1
    )
    assert config["role"] == "ec_consumer"
    assert config["control_addresses"] == ["tcp://127.0.0.1:21000", "tcp://127.0.0.1:21001"]


def test_bad_config_raises_value_error_naming_the_key():
    with pytest.raises(ValueError, match="did you mean 'ec_port'"):
        ecx.parse_config(json.dumps({"ec_role": "ec_consumer", "ec_prot": 1}))


def test_dtype_sizes():
    assert ecx.dtype_item_size("torch.bfloat16") == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        ecx.dtype_item_size("complex32")
