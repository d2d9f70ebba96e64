"""The cross-encoder cache through the vLLM connector: two encoder instances
(ec_producer) share a real Redis; what one encodes and publishes, the other's
scheduler sees in has_cache_item and its worker loads instead of encoding."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

import epd_cluster

REDIS_SERVER = "/usr/bin/redis-server"
MODEL = "m@1"


def _resp(*args: bytes | str | int) -> bytes:
    parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def redis_call(port: int, *args: bytes | str | int) -> bytes:
    """One command over RESP; returns the first reply line (enough for PING, SET, EXISTS)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(_resp(*args))
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply.strip()


@pytest.fixture(scope="module")
def redis_port():
    if not os.access(REDIS_SERVER, os.X_OK) and shutil.which("redis-server") is None:
        pytest.skip(f"{REDIS_SERVER} is not installed: the cross-encoder cache tests need a real Redis")
    binary = REDIS_SERVER if os.access(REDIS_SERVER, os.X_OK) else shutil.which("redis-server")
    port = epd_cluster.free_port_range(1)
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--notify-keyspace-events", "K$gxe"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis_call(port, "PING") == b"+PONG":
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server on 127.0.0.1:{port} did not start (exit {server.poll()})")
            time.sleep(0.02)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def store_extra(port: int, **overrides):
    extra = {"cross_encoder_cache": True, "store_url": f"redis://127.0.0.1:{port}/0", "store_model": MODEL}
    extra.update(overrides)
    return extra


def producer_engine(port: int, **overrides):
    from vllm._double_engine import EngineDouble

    config = epd_cluster.vllm_config("ec_producer", epd_cluster.free_port_range(1), 1, **store_extra(port, **overrides))
    return EngineDouble(config, encode_only=True, cache_rows=2048)


def item(identifier: str, rows: int = 16) -> dict:
    return {"identifier": identifier, "num_embeds": rows, "grid": [1, 4, rows // 4]}


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    """Bounded polling for an event another thread delivers (a keyspace notification)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def encode_and_publish(engine, identifier: str, rows: int = 16) -> None:
    from vllm._double_engine import make_request

    encoded_before = engine.workers[0].local_encodes
    engine.add_request(make_request(f"req-{identifier}", [item(identifier, rows)], None))
    done = epd_cluster.run_until_done(engine, 1, deadline_s=10)
    assert done[f"req-{identifier}"].status == "ok"
    assert engine.workers[0].local_encodes == encoded_before + 1
    worker = engine.workers[0].connector
    assert worker._worker.wait_published(5.0)
    assert worker.store_counters()["published"] >= 1


def step_one_request_by_hand(scheduler, worker, request, encoder_cache: dict):
    """One engine step for one request, hook by hook as vLLM's scheduler and a
    model runner call them, with start_load_caches called on the producer."""
    import pickle

    from vllm._double_engine import ECConnectorOutput, SchedulerOutput

    assert scheduler.ensure_cache_available(request, 0)
    external = [scheduler.has_cache_item(f.identifier) for f in request.mm_features]
    for i in range(len(request.mm_features)):
        scheduler.update_state_after_alloc(request, i)
    meta = scheduler.build_connector_meta(
        SchedulerOutput(total_num_scheduled_tokens=1, num_scheduled_tokens={request.request_id: 1})
    )
    worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
    worker.start_load_caches(encoder_cache)
    _, recving = worker.get_finished(set())
    output = ECConnectorOutput(finished_recving=recving, ec_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    return external, meta, output


def worker_report(output):
    """The worker's report in a step's output: in finished_recving until the worker has
    seen vLLM ask for worker metadata (the first step), in the metadata after that."""
    from ecx.vllm import report_from_finished_recving

    recving, _ = report_from_finished_recving(output.finished_recving)
    return recving if recving is not None else output.ec_connector_worker_meta


def connector_pair(port: int):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    config = epd_cluster.vllm_config("ec_producer", epd_cluster.free_port_range(1), 1, **store_extra(port))
    scheduler = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    return scheduler, worker


def test_an_output_one_encoder_published_is_loaded_by_another_instead_of_encoded(redis_port):
    from vllm._double_engine import encode, make_request, same_bits

    a = producer_engine(redis_port)
    scheduler, worker = connector_pair(redis_port)
    try:
        assert scheduler.has_cache_item("img-shared") is False
        encode_and_publish(a, "img-shared")
        assert wait_until(lambda: scheduler.has_cache_item("img-shared")), "B never learnt of A's entry"
        cache: dict = {}
        request = make_request("b-1", [item("img-shared")], None)
        external, meta, output = step_one_request_by_hand(scheduler, worker, request, cache)
        assert external == [True]
        assert [s.mm_hash for s in meta.store_loads] == ["img-shared"] and meta.store_candidates == []
        assert same_bits(cache["img-shared"], encode("img-shared", 16, epd_cluster.WIDTH))
        report = worker_report(output)
        assert report.loaded == {"img-shared"} and not report.failed_loads
        assert worker.store_counters()["loads"] == 1
        scheduler.update_connector_output(output)
        stats = scheduler.scheduler_stats()
        assert stats["store_hits"] >= 1 and stats["store_loads"] == 1 and stats["store_load_failures"] == 0
    finally:
        scheduler.shutdown()
        worker.shutdown()
        a.shutdown()


def test_an_encoder_instance_serves_a_published_item_without_encoding_it(redis_port):
    """Through the engine double, which (like vLLM) calls start_load_caches on
    consumers only: the load runs from start_save_caches."""
    from vllm._double_engine import encode, make_request, same_bits

    a = producer_engine(redis_port)
    b = producer_engine(redis_port)
    try:
        encode_and_publish(a, "img-engine", rows=32)
        assert wait_until(lambda: b.scheduler.has_cache_item("img-engine"))
        b.add_request(make_request("b-1", [item("img-engine", 32)], None))
        done = epd_cluster.run_until_done(b, 1, deadline_s=10)
        assert done["b-1"].status == "ok"
        assert b.workers[0].local_encodes == 0
        assert same_bits(b.workers[0].encoder_cache["img-engine"], encode("img-engine", 32, epd_cluster.WIDTH))
    finally:
        a.shutdown()
        b.shutdown()


def test_a_corrupt_store_entry_fails_the_load_cleanly(redis_port, caplog):
    from vllm._double_engine import make_request

    scheduler, worker = connector_pair(redis_port)
    try:
        assert redis_call(redis_port, "SET", f"ecx:{MODEL}:img-corrupt", b"not an ecx entry" * 8) == b"+OK"
        assert wait_until(lambda: scheduler.has_cache_item("img-corrupt"))
        cache: dict = {}
        request = make_request("b-1", [item("img-corrupt")], None)
        with caplog.at_level(logging.WARNING, logger="ecx.vllm"):
            external, meta, output = step_one_request_by_hand(scheduler, worker, request, cache)
        assert external == [True] and [s.mm_hash for s in meta.store_loads] == ["img-corrupt"]
        assert "img-corrupt" not in cache
        report = worker_report(output)
        assert report.failed_loads == {"img-corrupt"} and not report.loaded
        assert "img-corrupt" in caplog.text
        assert worker.store_counters()["load_failures"] == 1
        scheduler.update_connector_output(output)
        assert scheduler.scheduler_stats()["store_load_failures"] == 1
        # Forgotten: the next request encodes it (until the store announces it again).
        assert scheduler.has_cache_item("img-corrupt") is False
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_store_model_defaults_to_the_served_model_and_revision(redis_port):
    from ecx import _core
    from ecx._vllm_support import ecx_config_json
    from vllm.config import ECTransferConfig, ModelConfig

    def parsed(model_config, **extra):
        ec = ECTransferConfig(
            ec_connector="ECXConnector",
            ec_role="ec_producer",
            ec_buffer_device="cpu",
            ec_connector_extra_config=store_extra(redis_port, **{"store_model": None, **extra}),
        )
        ec.ec_connector_extra_config = {k: v for k, v in ec.ec_connector_extra_config.items() if v is not None}
        doc = ecx_config_json(ec, cuda_available=False, model_config=model_config)
        return json.loads(doc), _core.load_config(doc)

    doc, config = parsed(ModelConfig(model="Qwen/Qwen2.5-VL-7B-Instruct", revision=None))
    assert doc["ec_connector_extra_config"]["store_model"] == "Qwen/Qwen2.5-VL-7B-Instruct@main"
    assert config.cross_encoder_cache
    doc, _ = parsed(ModelConfig(model="/models/my model:v2", revision="abc 1"))
    assert doc["ec_connector_extra_config"]["store_model"] == "/models/my_model_v2@abc_1"
    doc, _ = parsed(ModelConfig(model="Qwen/Qwen2.5-VL-7B-Instruct"), store_model="pinned@7")
    assert doc["ec_connector_extra_config"]["store_model"] == "pinned@7"  # an explicit value wins
    doc, _ = parsed(ModelConfig(model="x", revision="r"), cross_encoder_cache=False)
    assert "store_model" not in doc["ec_connector_extra_config"]
    with pytest.raises(ValueError, match="store_model"):
        parsed(None)  # no model to take it from: the core names the key

    # And through the connector, from the vLLM config it is built with.
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    config = epd_cluster.vllm_config("ec_producer", epd_cluster.free_port_range(1), 1, **store_extra(redis_port))
    del config.ec_transfer_config.ec_connector_extra_config["store_model"]
    config.model_config = ModelConfig(model="org/vl", revision="r2")
    connector = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    try:
        assert connector._config.store_model == "org/vl@r2"
    finally:
        connector.shutdown()



def consumer_engine(port: int, tp: int = 1, **overrides):
    from vllm._double_engine import EngineDouble

    port_range = epd_cluster.free_port_range(tp)
    config = epd_cluster.vllm_config("ec_consumer", port_range, tp, **store_extra(port, **overrides))
    return EngineDouble(config, encode_only=False, cache_rows=2048)


def warm_up_pushed(producer, consumer) -> None:
    """One pushed request (E -> P) first, the consumer waiting for it: the steps without
    tokens that vLLM runs meanwhile show the connector its worker reports arrive, and
    loads become asynchronous (before that, a consumer encodes store items itself)."""
    import uuid

    from vllm._double_engine import make_request

    tid = uuid.uuid4().hex
    address = consumer.workers[0].connector._config.control_address(0)
    pushed = {"ec_items": [{"mm_hash": "img-warm", "transfer_id": tid}]}
    consumer.add_request(make_request("warm", [item("img-warm")], pushed))
    for _ in range(3):
        consumer.step()
    producer.add_request(
        make_request("warm-e", [item("img-warm")], {"consumer_zmq": address, "ec_items": [{"transfer_id": tid}]})
    )
    assert epd_cluster.run_until_done(producer, 1, deadline_s=10)["warm-e"].status == "ok"
    assert epd_cluster.run_until_done(consumer, 1, deadline_s=10)["warm"].status == "ok"
    assert consumer.scheduler._scheduler.asynchronous_loads, "the consumer's loads did not become asynchronous"


def test_a_consumer_loads_items_the_proxy_routed_to_the_store_and_encodes_what_it_cannot_load(redis_port):
    """What `ecx proxy --store-url` sends when every image is stored: raw media and
    ec_items [{mm_hash, "store": true}], no encoder hop. The prefill (consumer) instance
    prefetches and verifies the entry, loads it instead of encoding it on every TP rank,
    and encodes the image it cannot get from the store (absent, or corrupt) itself."""
    from vllm._double_engine import encode, make_request, same_bits

    a = producer_engine(redis_port)
    c = consumer_engine(redis_port, tp=2)
    try:
        warm_up_pushed(a, c)
        encode_and_publish(a, "img-routed", rows=32)
        assert redis_call(redis_port, "SET", f"ecx:{MODEL}:img-bad", b"not an ecx entry" * 8) == b"+OK"
        routed = [item("img-routed", 32), item("img-absent", 16), item("img-bad", 16)]
        params = {"ec_items": [{"mm_hash": i["identifier"], "store": True} for i in routed]}
        c.add_request(make_request("c-1", routed, params))
        done = epd_cluster.run_until_done(c, 1, deadline_s=20)
        assert done["c-1"].status == "ok", done["c-1"]
        for w in c.workers:
            assert same_bits(w.encoder_cache["img-routed"], encode("img-routed", 32, epd_cluster.WIDTH))
            assert w.provenance["img-routed"] == "connector", "loaded from the store, not encoded"
            assert w.provenance["img-absent"] == "local" and w.provenance["img-bad"] == "local"
            assert w.local_encodes == 2  # img-absent, img-bad (img-warm was pushed)
        stats = c.scheduler.scheduler_stats()
        assert stats["store_loads"] == 1 and stats["store_load_failures"] == 0
        assert stats["store_prefetch_failures"] >= 1, stats  # the corrupt entry, refused at the prefetch
        assert c.workers[0].connector.store_counters()["published"] == 0, "consumers only load"
        assert redis_call(redis_port, "EXISTS", f"ecx:{MODEL}:img-bad") == b":0", "the refused entry is deleted"
    finally:
        a.shutdown()
        c.shutdown()


def test_without_the_cache_a_consumer_encodes_store_items_itself(redis_port):
    from vllm._double_engine import make_request

    c = consumer_engine(redis_port, cross_encoder_cache=False)
    try:
        params = {"ec_items": [{"mm_hash": "img-x", "store": True}]}
        c.add_request(make_request("c-1", [item("img-x")], params))
        done = epd_cluster.run_until_done(c, 1, deadline_s=10)
        assert done["c-1"].status == "ok"
        assert c.workers[0].local_encodes == 1
    finally:
        c.shutdown()
