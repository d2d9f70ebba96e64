"""vLLM's older model runner (MRv1) never calls start_save_caches: the connector must
hand its pushes to ECX from save_caches / get_finished instead. Encoder and PD
instance share one process here (two independent connectors each, real sockets)."""

from __future__ import annotations

import uuid

import epd_cluster
from test_vllm_epd import image


def test_pushes_flow_without_start_save_caches():
    from vllm._double_engine import EngineDouble, make_request

    pd = EngineDouble(epd_cluster.vllm_config("ec_consumer", epd_cluster.free_port_range(2), 2), encode_only=False)
    encoder = EngineDouble(
        epd_cluster.vllm_config("ec_producer", epd_cluster.free_port_range(1), 1),
        encode_only=True,
        cache_rows=512,  # small: later requests find some images still cached, others re-encoded
        call_start_save_caches=False,
    )
    try:
        address = pd.workers[0].connector._config.control_address(0)
        requests = []
        for r in range(20):
            # Image r // 2 recurs in the next request, one step later: still in the
            # encoder's cache, so it is not encoded (nor saved) again and its second
            # push must take the cached output.
            items = [image(r // 2), image(100 + r)]
            tids = [uuid.uuid4().hex for _ in items]
            requests.append((f"r{r}", items, tids))
            for i, (item, tid) in enumerate(zip(items, tids)):
                params = {"consumer_zmq": address, "ec_items": [{"transfer_id": tid}]}
                encoder.add_request(make_request(f"r{r}:{i}", [item], params))
            encoder.step()
            assert all(f.status == "ok" for f in encoder.take_finished())
        assert encoder.workers[0].local_encodes < 40  # some outputs were reused from the cache
        while encoder.has_requests():
            encoder.step()
            assert all(f.status == "ok" for f in encoder.take_finished())
        for rid, items, tids in requests:
            ec_items = [{"mm_hash": item["identifier"], "transfer_id": tid} for item, tid in zip(items, tids)]
            pd.add_request(make_request(rid, items, {"ec_items": ec_items}))
        done = epd_cluster.run_until_done(pd, len(requests), 30)
        assert len(done) == len(requests)
        bad = [(f.request_id, f.status, f.detail) for f in done.values() if f.status != "ok"]
        assert not bad, bad
        assert all(set(f.provenance.values()) == {"connector"} for f in done.values())
    finally:
        pd.shutdown()
        encoder.shutdown()
