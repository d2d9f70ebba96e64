"""The connector adapts to what vLLM actually calls, through the vLLM test double's
profiles of the four builds the connector must work with (6adad087 and 7cfb97e3,
model runner V1 and V2; see vllm/_double_engine.py PROFILES): loads are synchronous
until a worker report shows the connector runs on steps without tokens, load reports
travel in finished_recving where there is no worker metadata, an item whose push
cannot arrive is encoded locally where nothing polls take_unavailable_requests, and
a PD instance whose shards are gone shuts down promptly. Encoder and PD instance
share one process here (independent connectors, real sockets, real pushes)."""

from __future__ import annotations

import logging
import socket
import time
import uuid

import pytest

import epd_cluster
from test_vllm_epd import image

BUILDS = ["6adad087-mrv1", "6adad087-mrv2", "7cfb97e3-mrv1", "7cfb97e3-mrv2"]
STEP_DEADLINE_S = 60  # a hung engine fails the test instead of hanging CI


def _pd(profile: str, tp: int = 2, **extra):
    from vllm._double_engine import EngineDouble

    port = epd_cluster.free_port_range(tp)
    return EngineDouble(epd_cluster.vllm_config("ec_consumer", port, tp, **extra), encode_only=False, profile=profile)


def _encoder(profile: str, **extra):
    from vllm._double_engine import EngineDouble

    return EngineDouble(
        epd_cluster.vllm_config("ec_producer", epd_cluster.free_port_range(1), 1, **extra),
        encode_only=True,
        profile=profile,
        call_start_save_caches=False,  # neither build's runners call it
    )


def _run_until_done(engine, count: int) -> dict:
    return epd_cluster.run_until_done(engine, count, STEP_DEADLINE_S)


@pytest.mark.parametrize("build", BUILDS)
def test_pushed_embeddings_arrive_bit_exact_and_the_engine_idles_afterwards(build):
    from vllm._double_engine import PROFILES, make_request

    profile = PROFILES[build]
    pd = _pd(build)
    encoder = _encoder(build)
    try:
        address = pd.workers[0].connector._config.control_address(0)
        # An engine step with nothing scheduled, as vLLM runs while a request waits.
        pd.step()
        expect_async = profile.ec_on_steps_without_tokens and profile.worker_meta
        assert pd.scheduler._scheduler.asynchronous_loads is expect_async
        requests = []
        for r in range(12):
            items = [image(300 + r // 2), image(400 + r)]  # the first image recurs in the next request
            tids = [uuid.uuid4().hex for _ in items]
            requests.append((f"r{r}", items, tids))
            for i, (item, tid) in enumerate(zip(items, tids)):
                encoder.add_request(
                    make_request(f"r{r}:{i}", [item], {"consumer_zmq": address, "ec_items": [{"transfer_id": tid}]})
                )
        while encoder.has_requests():
            encoder.step()
            assert all(f.status == "ok" for f in encoder.take_finished())
        for rid, items, tids in requests:
            ec_items = [{"mm_hash": item["identifier"], "transfer_id": tid} for item, tid in zip(items, tids)]
            pd.add_request(make_request(rid, items, {"ec_items": ec_items}))
        done = _run_until_done(pd, len(requests))
        assert len(done) == len(requests)
        bad = [(f.request_id, f.status, f.detail) for f in done.values() if f.status != "ok"]
        assert not bad, bad  # "ok" = every rank gathered the encoder's exact bytes
        assert all(set(f.provenance.values()) == {"connector"} for f in done.values())
        assert pd.workers[0].local_encodes == 0
        # Nothing left for a step to do: vLLM's has_requests() lets the engine idle.
        assert not pd.has_requests()
        assert not encoder.has_requests()
        stats = pd.scheduler.scheduler_stats()
        assert stats["local_fallbacks"] == 0
        if not expect_async:
            assert stats["alloc_loads"] >= len(requests)  # every load ran in its request's step
    finally:
        pd.shutdown()
        encoder.shutdown()


def _push_and_serve(pd, encoder, count: int) -> tuple[dict, list[str]]:
    """`count` one-image requests pushed by the encoder, then served by the PD instance.
    Returns the finished requests and the images' identifiers."""
    from vllm._double_engine import make_request

    address = pd.workers[0].connector._config.control_address(0)
    requests = []
    for r in range(count):
        item, tid = image(500 + r), uuid.uuid4().hex
        requests.append((f"z{r}", item, tid))
        encoder.add_request(make_request(f"z{r}:0", [item], {"consumer_zmq": address, "ec_items": [{"transfer_id": tid}]}))
    while encoder.has_requests():
        encoder.step()
        assert all(f.status == "ok" for f in encoder.take_finished())
    for rid, item, tid in requests:
        pd.add_request(make_request(rid, [item], {"ec_items": [{"mm_hash": item["identifier"], "transfer_id": tid}]}))
    return _run_until_done(pd, count), [item["identifier"] for _, item, _ in requests]


@pytest.mark.parametrize("zero_copy", [True, False])
def test_zero_copy_loads_lend_the_engine_the_landed_slots_until_it_drops_them(zero_copy):
    import gc

    build = BUILDS[-1]
    pd = _pd(build, tp=1, zero_copy_loads=zero_copy)
    encoder = _encoder(build)
    try:
        done, identifiers = _push_and_serve(pd, encoder, 6)
        bad = [(f.request_id, f.status, f.detail) for f in done.values() if f.status != "ok"]
        assert not bad, bad  # the engine read the encoder's exact bytes
        worker = pd.workers[0]
        held = [h for h in identifiers if h in worker.encoder_cache]
        assert held, "the engine's encoder cache kept none of the loaded items"
        counters = worker.connector.worker_counters()
        # A view keeps its slot out of the pool; a copy gives it back at once.
        assert counters["leases"] == (len(held) if zero_copy else 0)
        # The engine drops its entries (vLLM frees them): the slots come back.
        for h in held:
            worker.encoder_cache.pop(h)
            worker.connector._loaded_tensors.pop(h, None)
        gc.collect()
        assert worker.connector.worker_counters()["leases"] == 0
    finally:
        pd.shutdown()
        encoder.shutdown()


def test_zero_copy_saves_send_the_encoders_tensors_in_place_and_let_go_of_them_once_sent():
    import gc
    import weakref

    build = BUILDS[-1]
    pd = _pd(build, tp=1)
    encoder = _encoder(build, zero_copy_saves=True, zero_copy_saves_min_bytes=0)  # these images are small
    try:
        done, identifiers = _push_and_serve(pd, encoder, 6)
        bad = [(f.request_id, f.status, f.detail) for f in done.values() if f.status != "ok"]
        assert not bad, bad  # the PD instance read the encoder's exact bytes
        connector = encoder.workers[0].connector
        assert connector.worker_counters()["sources_lent"] == len(identifiers)
        cache = encoder.workers[0].encoder_cache
        lent = [weakref.ref(cache.pop(h)) for h in identifiers if h in cache]
        assert lent, "the encoder's cache kept none of its outputs"
        connector._worker.get_finished([])  # a hook on the engine's thread drops what ECX gave back
        gc.collect()
        assert all(ref() is None for ref in lent), "ECX still holds tensors whose pushes are done"
    finally:
        pd.shutdown()
        encoder.shutdown()


def _never_pushed(pd, monkeypatch_clock, profile_polls: bool):
    from vllm._double_engine import make_request

    item = image(900)
    request = make_request("lost", [item], {"ec_items": [{"mm_hash": item["identifier"], "transfer_id": "never"}]})
    pd.add_request(request)
    for _ in range(3):
        pd.step()
        assert pd.take_finished() == []  # held: its push may still come
    monkeypatch_clock.advance(3.0)  # past push_wait_timeout_s
    return _run_until_done(pd, 1)


@pytest.mark.parametrize("build", ["6adad087-mrv1", "7cfb97e3-mrv2"])
def test_a_push_that_never_arrives_is_encoded_locally_where_vllm_cannot_fail_the_request(build, monkeypatch):
    import ecx
    from ecx import _core
    from ecx.vllm import ECXConnector

    clock = _core.ManualClock()
    monkeypatch.setattr(ECXConnector, "scheduler_clock", clock)
    key = 'ecx_scheduler_unreachable_items_total{outcome="encoded_locally"}'
    before = ecx.metrics_snapshot().get(key, 0)
    pd = _pd(build, tp=1, push_wait_timeout_s=2)
    try:
        done = _never_pushed(pd, clock, profile_polls=False)
        assert done["lost"].status == "ok"
        assert set(done["lost"].provenance.values()) == {"local"}
        assert pd.scheduler.scheduler_stats()["local_fallbacks"] == 1
        assert ecx.metrics_snapshot()[key] == before + 1
        assert not pd.has_requests()
    finally:
        pd.shutdown()


def test_a_push_that_never_arrives_fails_the_request_where_vllm_polls_unavailable_requests(monkeypatch):
    from ecx import _core
    from ecx.vllm import ECXConnector

    clock = _core.ManualClock()
    monkeypatch.setattr(ECXConnector, "scheduler_clock", clock)
    pd = _pd("newer", tp=1, push_wait_timeout_s=2)
    try:
        done = _never_pushed(pd, clock, profile_polls=True)
        assert done["lost"].status == "unavailable"
        assert pd.scheduler.scheduler_stats()["local_fallbacks"] == 0
    finally:
        pd.shutdown()


def test_worker_reports_travel_in_finished_recving_without_worker_metadata():
    from ecx.vllm import report_from_finished_recving, report_to_finished_recving

    report = (["a", "b"], ["c"], ["d"], True, ["req-1"])
    entries = report_to_finished_recving(report, pending_changed=True)
    # Rank 1 failed "b": a union of the ranks' sets still counts it failed.
    entries |= report_to_finished_recving(([], ["b"], [], True, []), pending_changed=False)
    meta, pending = report_from_finished_recving(entries)
    assert meta.loaded == {"a"}
    assert meta.failed_loads == {"b", "c"}
    assert meta.reclaimed == {"d"}
    assert meta.failed_saves == {"req-1"}
    assert pending is True
    assert report_from_finished_recving({"someone-else"}) == (None, None)
    assert report_from_finished_recving(None) == (None, None)


def _shutdown_within_two_seconds(engine, caplog) -> list[str]:
    """Shuts the engine down, asserts it took at most 2 s, returns the warnings logged."""
    import ecx

    with caplog.at_level(logging.WARNING, logger="ecx"):
        start = time.monotonic()
        engine.shutdown()
        took = time.monotonic() - start
        ecx.flush_logs()
    assert took <= 2.0, f"shutdown took {took:.2f} s"
    return [r.getMessage() for r in caplog.records]


def test_a_pd_instance_whose_shards_are_gone_shuts_down_within_two_seconds(caplog):
    from vllm._double_engine import make_request

    # The reference's control timeout: each unanswered cancel would hold 30 s per round.
    pd = _pd("7cfb97e3-mrv1", tp=2, control_timeout_s=30)
    scheduler = pd.scheduler
    try:
        for w in pd.workers:  # the shards go away (their processes died)
            w.connector.shutdown()
        for r in range(8):
            item = image(700 + r)
            request = make_request(f"gone-{r}", [item], {"ec_items": [{"transfer_id": f"t-gone-{r}"}]})
            scheduler.ensure_cache_available(request, 0)
            scheduler.request_finished(request)  # queues the remote cancel of its reservation
        assert scheduler.scheduler_stats()["cancels_queued"] == 8
        logged = _shutdown_within_two_seconds(pd, caplog)
        assert any("were abandoned" in m or "were not sent" in m for m in logged)
    finally:
        pd.shutdown()


def test_an_encoder_whose_consumer_never_answers_shuts_down_within_two_seconds(caplog):
    from vllm._double_engine import make_request

    # A consumer that takes the connection and never speaks: every control call to it
    # would wait out the reference's 30 s control timeout.
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    encoder = _encoder("7cfb97e3-mrv2", control_timeout_s=30, shutdown_drain_timeout_s=None)
    try:
        for r in range(4):
            item = image(1000 + r)
            encoder.add_request(
                make_request(f"silent-{r}", [item], {"consumer_zmq": address, "ec_items": [{"transfer_id": f"s{r}"}]})
            )
        for _ in range(3):
            encoder.step()
        assert encoder.has_requests()  # its pushes are waiting for the consumer
        logged = _shutdown_within_two_seconds(encoder, caplog)
        assert any("producer shutdown" in m for m in logged)
    finally:
        encoder.shutdown()
        silent.close()


def test_behind_vllms_example_proxy_nothing_is_pushed_and_the_pd_instance_encodes_itself():
    """vLLM's disagg_epd_proxy.py sends the encoder no ec_transfer_params, rewrites an
    item only when ec_items[0] of the encoder's response has fields besides mm_hash,
    and sends the PD instance no ec_transfer_params."""
    from vllm._double_engine import make_request

    pd = _pd("7cfb97e3-mrv2", tp=1)
    encoder = _encoder("7cfb97e3-mrv2")
    try:
        item = image(800)
        encoder.add_request(make_request("enc", [item], None))
        encoder.step()
        (finished,) = encoder.take_finished()
        assert finished.status == "ok"
        params = finished.ec_transfer_params or {}
        # The example proxy's read: nothing reported, so it forwards the media unchanged.
        assert (params.get("ec_items") or []) == []
        assert encoder.scheduler.scheduler_stats()["pushes_planned"] == 0
        pd.add_request(make_request("pd", [item], None))
        done = _run_until_done(pd, 1)
        assert done["pd"].status == "ok"
        assert set(done["pd"].provenance.values()) == {"local"}
        assert not pd.has_requests()
    finally:
        pd.shutdown()
        encoder.shutdown()
