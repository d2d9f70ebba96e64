"""ECXConnector and ecx._core pieces in one process: metadata pickling and folding,
configuration translation, the ec_transfer_params contract at the scheduler, the
log bridge, and clean shutdown (also at interpreter exit)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ecx
from ecx import _core

import epd_cluster

HERE = Path(__file__).resolve().parent


def build_python_dir() -> str:
    return os.path.dirname(os.path.dirname(ecx.__file__))


# ------------------------------------------------------------------ metadata


def test_every_metadata_object_round_trips_through_pickle():
    from ecx.vllm import ECXConnectorMetadata, ECXLoadItem, ECXPushItem, ECXStoreCandidate, ECXWorkerMetadata

    meta = ECXConnectorMetadata(
        loads=[ECXLoadItem("h1", "t1", [16, 64], "bfloat16", False), ECXLoadItem("h2", "t2", [3, 8], "float16", True)],
        pushes=[ECXPushItem("h3", "t3", [256, 64], "bfloat16", "tcp://127.0.0.1:5000", "req-1")],
        freed=["h0"],
        orphan_cancels=["t9"],
        store_candidates=[ECXStoreCandidate("h4", [4, 4], "float32")],
    )
    worker = ECXWorkerMetadata({"h1"}, {"h2"}, {"h5"}, True, {"req-2"})
    for obj in (meta, ECXConnectorMetadata(), worker, ECXWorkerMetadata()):
        assert pickle.loads(pickle.dumps(obj)) == obj


def test_scheduler_plan_converts_to_metadata_and_back_to_core_tuples():
    from ecx.vllm import ECXConnectorMetadata

    planned = (
        ["f"],
        ["o"],
        [("s", [2, 2], "float32")],
        [("h", "t", [4, 64], "bfloat16", "tcp://127.0.0.1:1", "r")],
        [("h", "t", [4, 64], "bfloat16", True)],
        ["k"],
    )
    meta = ECXConnectorMetadata.from_core(planned)
    assert [p.to_core() for p in meta.pushes] == planned[3]
    assert [load.to_core() for load in meta.loads] == planned[4]
    assert meta.freed == ["f"] and meta.orphan_cancels == ["o"] and meta.retained == ["k"]


def test_worker_metadata_folds_like_the_core_rule():
    from ecx.vllm import ECXWorkerMetadata

    rng = random.Random(3)
    names = [f"h{i}" for i in range(6)]

    def sample():
        pick = lambda: set(rng.sample(names, rng.randint(0, 4)))  # noqa: E731
        return ECXWorkerMetadata(
            pick(), pick(), pick(), rng.random() < 0.5, pick(), store_ready=pick(), store_failed=pick(), store_dropped=pick()
        )

    def core(m):
        return (
            sorted(m.loaded),
            sorted(m.failed_loads),
            sorted(m.reclaimed),
            m.pending_saves,
            sorted(m.failed_saves),
            sorted(m.store_ready),
            sorted(m.store_failed),
            sorted(m.store_dropped),
        )

    for _ in range(200):
        a, b = sample(), sample()
        folded = a.aggregate(b)
        assert core(folded) == tuple(_core.aggregate_worker_meta(core(a), core(b)))
    assert a.aggregate(None) is a


# ------------------------------------------------------------------ configuration


def make_connector(role_name: str, ec_role: str, port: int, tp: int = 1, **extra):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    config = epd_cluster.vllm_config(ec_role, port, tp, **extra)
    return ECConnectorFactory.create_connector(config, getattr(ECConnectorRole, role_name))


def test_unknown_extra_config_key_stops_the_connector_with_the_key_named():
    with pytest.raises(ValueError, match="did you mean 'push_wait_timeout_s'"):
        make_connector("SCHEDULER", "ec_consumer", 20000, push_wait_timeout=3)


def test_producer_must_run_unsharded():
    with pytest.raises(ValueError, match="must run unsharded"):
        make_connector("SCHEDULER", "ec_producer", 20000, tp=2)


def test_cuda_buffer_device_falls_back_to_host_memory_without_cuda(caplog):
    from ecx._vllm_support import ecx_config_json
    from vllm.config import ECTransferConfig

    config = ECTransferConfig(ec_connector="ECXConnector", ec_role="ec_consumer", ec_buffer_device="cuda")
    with caplog.at_level(logging.WARNING, logger="ecx.vllm"):
        doc = json.loads(ecx_config_json(config, cuda_available=False))
    assert doc["ec_buffer_device"] == "cpu"
    assert doc["ec_buffer_size"] == 1_000_000_000 and isinstance(doc["ec_buffer_size"], int)
    assert "ec_connector" not in doc  # vLLM's own fields are not forwarded
    assert "CUDA is not available" in caplog.text
    doc = json.loads(ecx_config_json(config, cuda_available=True))
    assert doc["ec_buffer_device"] == "cuda"


def test_encoder_output_width_comes_from_the_model_config_or_the_override():
    from ecx._vllm_support import model_hidden_width
    from vllm.config import ModelConfig, VllmConfig

    assert model_hidden_width(VllmConfig(model_config=ModelConfig(inputs_embeds_size=3584))) == 3584
    producer = make_connector("SCHEDULER", "ec_producer", 20000, encoder_output_width=128)
    try:
        assert producer._config.encoder_output_width == 128
    finally:
        producer.shutdown()


# ------------------------------------------------------------------ scheduler contract


def scheduler_with_clock(**extra):
    config = _core.load_config(
        json.dumps(
            {
                "ec_role": "ec_consumer",
                "ec_port": epd_cluster.free_port_range(1),
                "ec_buffer_device": "cpu",
                "ec_connector_extra_config": epd_cluster.extra_config(**extra),
            }
        )
    )
    clock = _core.ManualClock()
    return _core.SchedulerCoordinator(config, "bfloat16", 64, clock), clock


def test_request_whose_params_name_no_transfer_for_an_item_fails_after_the_push_wait():
    scheduler, clock = scheduler_with_clock(push_wait_timeout_s=2)
    try:
        request = _core.RequestView("r1", [("h1", "image", 1, 16, 16)], json.dumps({"ec_items": []}))
        assert scheduler.ensure_cache_available(request, 0) is False
        assert scheduler.take_unavailable_requests() == []
        clock.advance(2.5)
        assert scheduler.ensure_cache_available(request, 0) is False
        assert scheduler.take_unavailable_requests() == ["r1"]
        assert scheduler.take_unavailable_requests() == []  # each request is reported once
    finally:
        scheduler.close()
        scheduler.close()


def test_malformed_params_fail_the_request_at_once_and_absent_params_encode_locally():
    scheduler, _ = scheduler_with_clock()
    try:
        malformed = _core.RequestView("bad", [("h1", "image", 1, 16, 16)], json.dumps({"ec_items": {}}))
        absent = _core.RequestView("plain", [("h2", "image", 1, 16, 16)], None)
        assert malformed.has_malformed_params and "ec_items must be an array" in malformed.ec_transfer_params_error
        assert scheduler.ensure_cache_available(malformed, 0) is False
        assert scheduler.ensure_cache_available(absent, 0) is True  # the engine encodes it itself
        assert scheduler.has_cache_item("h2") is False
        assert scheduler.take_unavailable_requests() == ["bad"]
    finally:
        scheduler.close()


def test_connector_has_cache_item_is_the_schedulers_own_function_and_answers_like_the_binding():
    connector = make_connector("SCHEDULER", "ec_consumer", epd_cluster.free_port_range(1))
    try:
        scheduler = connector._scheduler
        fast = connector.has_cache_item
        assert type(fast).__name__ == "builtin_function_or_method"  # no Python frame per call
        assert fast("h") is False and scheduler.has_cache_item("h") is False
        with pytest.raises(TypeError, match="identifier must be one str"):
            fast(b"h")
        with pytest.raises(TypeError, match="identifier must be one str"):
            fast()
        # Loads confirmed on vLLM's behalf wait in the scheduler until the next hook
        # that reads its state; has_cache_item is one.
        scheduler.confirm_loads_later(["h1", "h2", "h1"])
        assert scheduler.loads_awaiting_confirmation == 3
        assert fast("h1") is False  # never landed here: confirming it makes nothing appear
        assert scheduler.loads_awaiting_confirmation == 0
    finally:
        connector.shutdown()
    assert fast("h") is False  # the closed scheduler answers neutrally, even through a kept reference
    assert connector._scheduler.loads_awaiting_confirmation == 0


def test_scheduler_connector_hooks_after_shutdown_answer_neutrally():
    from vllm._double_engine import SchedulerOutput, make_request

    connector = make_connector("SCHEDULER", "ec_consumer", epd_cluster.free_port_range(1))
    request = make_request("r", [{"identifier": "h", "num_embeds": 4, "grid": [1, 1, 4]}], None)
    connector.shutdown()
    connector.shutdown()
    assert connector.has_cache_item("h") is False
    assert connector.has_caches(request) == [False]
    assert connector.ensure_cache_available(request, 0) is True
    assert connector.build_connector_meta(SchedulerOutput()).loads == []
    assert connector.request_finished(request) == (False, None)
    assert connector.take_unavailable_requests() == set()
    assert connector.has_pending_push_work() is False


# ------------------------------------------------------------------ worker


def test_consumer_worker_tolerates_hooks_without_metadata_and_exports_metrics():
    connector = make_connector("WORKER", "ec_consumer", epd_cluster.free_port_range(1))
    try:
        cache: dict = {}
        connector.start_worker_services()
        connector.start_load_caches(cache)  # nothing bound: nothing to do
        connector.save_caches(cache, "h")  # MRv1 calls it on consumers too
        assert connector.get_finished({"r"}) == (None, None)
        assert connector.build_connector_worker_meta() is not None
        snapshot = ecx.metrics_snapshot()
        assert any(name.startswith("ecx_consumer_") for name in snapshot)
        assert "# TYPE" in ecx.metrics_text()
    finally:
        connector.shutdown()
        connector.shutdown()
    assert connector.build_connector_worker_meta() is None


def test_consumer_scheduler_serves_its_own_metrics_after_the_worker_ports():
    import urllib.request

    from ecx import _core

    def scrape(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return reply.read().decode()

    port = epd_cluster.free_port_range(1)
    metrics_base = epd_cluster.free_port_range(4)
    worker = make_connector("WORKER", "ec_consumer", port)  # this process's shard, no endpoint of its own
    connector = make_connector("SCHEDULER", "ec_consumer", port, metrics_port=metrics_base)
    try:
        # TP 1, DP 1: the worker rank serves metrics_base, the scheduler the next port.
        text = scrape(metrics_base + 1)
        assert 'ecx_scheduler_cancels_total{outcome="queued"} 0' in text
        # No endpoint of this process serves its other ECX metrics (a scheduler without a
        # worker beside it, as with TP > 1): the scheduler's endpoint shows them.
        assert 'ecx_consumer_bytes_landed_total{shard="0"}' in text
        # Once a worker's endpoint in this process serves them, only that one does.
        process_endpoint = _core.MetricsServer("127.0.0.1", 0)
        try:
            assert 'ecx_consumer_bytes_landed_total{shard="0"}' in scrape(process_endpoint.port)
            text = scrape(metrics_base + 1)
            assert 'ecx_scheduler_cancels_total{outcome="queued"} 0' in text
            assert "ecx_consumer_" not in text
        finally:
            process_endpoint.stop()
        assert 'ecx_consumer_bytes_landed_total{shard="0"}' in scrape(metrics_base + 1)
    finally:
        connector.shutdown()
        worker.shutdown()


# ------------------------------------------------------------------ logging and shutdown


def test_cpp_log_records_reach_python_logging(caplog):
    scheduler, _ = scheduler_with_clock()
    try:
        with caplog.at_level(logging.WARNING, logger="ecx"):
            request = _core.RequestView("bad-params", [("h", "image", 1, 4, 4)], "{not json")
            scheduler.ensure_cache_available(request, 0)
            assert ecx.flush_logs(2.0)
        records = [r for r in caplog.records if r.name == "ecx.scheduler"]
        assert records and "bad-params" in records[0].getMessage()
        assert records[0].levelno == logging.WARNING
    finally:
        scheduler.close()


def run_python(code: str, extra_path: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(extra_path + [build_python_dir()]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_import_ecx_vllm_without_vllm_says_vllm_is_required():
    result = run_python(
        """
        import ecx
        try:
            import ecx.vllm
        except ImportError as e:
            print("IMPORT-ERROR:", e)
        """,
        [],
    )
    assert result.returncode == 0, result.stderr
    assert "IMPORT-ERROR:" in result.stdout and "requires vLLM" in result.stdout


def test_interpreter_exits_cleanly_with_live_connectors_and_logging_threads():
    # No shutdown() call: atexit detaches the log bridge, destructors stop the rest;
    # the process must exit 0 without hanging.
    result = run_python(
        f"""
        import logging, sys
        sys.path.insert(0, {str(HERE)!r})
        logging.basicConfig(level=logging.INFO)
        import epd_cluster
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
        port = epd_cluster.free_port_range(2)
        config = epd_cluster.vllm_config("ec_consumer", port, 1)
        scheduler = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
        print("STARTED", flush=True)
        """,
        [str(HERE / "vllm_double")],
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "STARTED" in result.stdout
    assert "consumer shard 0 serving" in result.stderr  # a C++ record delivered through the bridge


def test_docs_vllm_names_every_configuration_key():
    text = (HERE.parent.parent / "docs" / "vllm.md").read_text()
    missing = [k["name"] for k in ecx.config_keys() if f"`{k['name']}`" not in text]
    assert not missing, f"docs/vllm.md does not mention {missing}"
