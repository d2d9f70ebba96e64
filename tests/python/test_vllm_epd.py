"""E+PD through the vLLM test double: an encoder instance (ec_producer) and a PD
instance (ec_consumer, TP = 2) in their own processes, the test as the proxy; once
per vLLM profile (the builds 6adad087 and 7cfb97e3 with model runners V1 and V2,
and a vLLM that calls every hook).

200 requests with 1-4 images each, some images shared across requests; requests
with malformed ec_transfer_params, and requests without any (which the PD instance
encodes itself). Every embedding must arrive bit-exact in both ranks' encoder caches.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import queue
import random
import time
import uuid

import pytest

import epd_cluster

NUM_REQUESTS = 200
NUM_MALFORMED = 10
NUM_ABSENT = 10
DEADLINE_S = 120  # a hung cluster fails the test instead of hanging CI


def image(k: int) -> dict:
    identifier = hashlib.sha256(f"image-{k}".encode()).hexdigest()[:40]
    rows = 16 + (k * 37) % 241  # 16..256 rows of 64 bf16
    return {"identifier": identifier, "num_embeds": rows, "grid": [1, 2 + k % 5, rows]}


def workload(seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    popular = list(range(40))  # drawn often: shared across requests
    requests = []
    next_unique = 40
    for r in range(NUM_REQUESTS):
        count = rng.randint(1, 4)
        kind = "normal"
        if r % 20 == 3:
            kind = "malformed"
        elif r % 20 == 11:
            kind = "absent"
        picks: list[int] = []
        while len(picks) < count:
            # Requests without (usable) routing get images of their own, so that what
            # the PD instance encodes itself is never mistaken for a delivery (or vice
            # versa): on a vLLM that never polls take_unavailable_requests, malformed
            # requests are encoded locally too.
            if kind == "normal" and rng.random() < 0.4:
                k = rng.choice(popular)
            else:
                k, next_unique = next_unique, next_unique + 1
            if k not in picks:
                picks.append(k)
        requests.append({"id": f"req-{r:03d}", "items": [image(k) for k in picks], "kind": kind})
    return requests


MALFORMED_PARAMS = [
    {"ec_items": "not-a-list"},
    "not-an-object",
    {"ec_items": [{"mm_hash": "h", "transfer_id": 17}]},
    {"consumer_zmq": 5},
    {"ec_items": [{"transfer_id": "bad id with spaces"}]},
]


def recv(box, deadline: float, processes: dict):
    """The next message, failing fast when an instance died or the deadline passed."""
    while True:
        try:
            return box.get(timeout=0.2)
        except queue.Empty:
            pass
        for name, p in processes.items():
            if p.exitcode not in (None, 0):
                raise RuntimeError(f"the {name} instance died with exit code {p.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not answer before the test's deadline")


PROFILES = ["newer", "6adad087-mrv1", "6adad087-mrv2", "7cfb97e3-mrv1", "7cfb97e3-mrv2"]


@pytest.fixture(params=PROFILES)
def cluster(request):
    profile = request.param
    ctx = multiprocessing.get_context("spawn")
    boxes = {name: (ctx.Queue(), ctx.Queue()) for name in ("encoder", "pd")}
    pd_port = epd_cluster.free_port_range(2)
    encoder_port = epd_cluster.free_port_range(1)
    processes = {
        "encoder": ctx.Process(
            target=epd_cluster.encoder_main, args=(encoder_port, *boxes["encoder"], profile), daemon=True
        ),
        "pd": ctx.Process(target=epd_cluster.pd_main, args=(pd_port, *boxes["pd"], profile), daemon=True),
    }
    for p in processes.values():
        p.start()
    yield processes, boxes, profile
    for p in processes.values():
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
            p.join()


def run_encoder_legs(requests: list[dict], consumer_zmq: str, boxes: dict, deadline: float, processes: dict, on_done) -> None:
    """Proxy, encoder leg: one encoder request per image occurrence, each naming a
    fresh transfer id and the PD instance's control address. on_done(request,
    ec_items) runs when every leg of a request has finished, with the identifiers
    the encoder reported and their transfer ids."""
    encoder_in, encoder_out = boxes["encoder"]
    pending_legs: dict[str, int] = {}
    legs: dict[str, tuple[dict, int, str]] = {}  # encoder request id -> (request, index, transfer id)
    reported: dict[str, list[dict | None]] = {}
    for r in requests:
        pending_legs[r["id"]] = len(r["items"])
        reported[r["id"]] = [None] * len(r["items"])
        for i, item in enumerate(r["items"]):
            transfer_id = uuid.uuid4().hex
            leg_id = f"{r['id']}:{i}:{uuid.uuid4().hex[:8]}"
            legs[leg_id] = (r, i, transfer_id)
            params = {"consumer_zmq": consumer_zmq, "ec_items": [{"transfer_id": transfer_id}]}
            encoder_in.put(("request", leg_id, [item], params))
    problems: list[str] = []
    while pending_legs:
        kind, leg_id, status, params, detail, _ = recv(encoder_out, deadline, processes)
        assert kind == "finished"
        r, index, transfer_id = legs[leg_id]
        item = r["items"][index]
        if status != "ok":
            problems.append(f"{leg_id}: {status} {detail}")
        # request_finished: per-item metadata with the transfer id, and the push it prepared.
        expected = {
            item["identifier"]: {"item_indices": [0], "transfer_id": transfer_id, "metadata": {"image_grid_thw": item["grid"]}},
            "ec_items": [{"mm_hash": item["identifier"], "transfer_id": transfer_id}],
        }
        if params != expected:
            problems.append(f"{leg_id}: request_finished returned {params}, expected {expected}")
        reported[r["id"]][index] = {"mm_hash": params["ec_items"][0]["mm_hash"], "transfer_id": transfer_id}
        pending_legs[r["id"]] -= 1
        if pending_legs[r["id"]] == 0:
            del pending_legs[r["id"]]
            on_done(r, reported[r["id"]])
    assert not problems, problems[:5]


def collect_outcomes(pd_out, count: int, deadline: float, processes: dict) -> dict[str, tuple]:
    outcomes: dict[str, tuple] = {}
    while len(outcomes) < count:
        kind, request_id, status, _params, detail, provenance = recv(pd_out, deadline, processes)
        assert kind == "finished"
        assert request_id not in outcomes, f"{request_id} finished twice"
        outcomes[request_id] = (status, detail, provenance)
    return outcomes


def sized_image(name: str, rows: int) -> dict:
    identifier = hashlib.sha256(name.encode()).hexdigest()[:40]
    return {"identifier": identifier, "num_embeds": rows, "grid": [1, 2, rows]}


def test_e_pd_cluster_delivers_every_embedding_bit_exact(cluster):
    from vllm._double_engine import PROFILES as VLLM_PROFILES

    processes, boxes, profile = cluster
    polls_unavailable = VLLM_PROFILES[profile].polls_unavailable
    deadline = time.monotonic() + DEADLINE_S
    pd_in, pd_out = boxes["pd"]
    ready = {name: recv(boxes[name][1], deadline, processes) for name in ("encoder", "pd")}
    assert ready["encoder"][0] == "ready" and ready["pd"][0] == "ready"
    consumer_zmq = ready["pd"][1]

    requests = workload()
    # Requests that need no encoder leg go straight to the PD instance.
    for n, r in enumerate(x for x in requests if x["kind"] != "normal"):
        params = MALFORMED_PARAMS[n % len(MALFORMED_PARAMS)] if r["kind"] == "malformed" else None
        pd_in.put(("request", r["id"], r["items"], params))

    def send_to_pd(r: dict, ec_items: list[dict]) -> None:
        # Proxy, PD leg: the encoder-reported identifiers with their transfer ids.
        pd_in.put(("request", r["id"], r["items"], {"ec_items": ec_items}))

    normal = [r for r in requests if r["kind"] == "normal"]
    run_encoder_legs(normal, consumer_zmq, boxes, deadline, processes, send_to_pd)
    outcomes = collect_outcomes(pd_out, len(requests), deadline, processes)

    # Evicted and allocated again in one step, on purpose: the PD instance loads X and
    # keeps it as an unreferenced cache entry; then one step schedules a request whose
    # items fill the whole encoder cache (evicting X) and, after it, a request for X
    # with a new transfer. The workers drop X at the step's start and the connector
    # must put it back, bit-exact.
    x = sized_image("evicted-x", 200)
    first = {"id": "evict-first", "items": [x]}
    run_encoder_legs([first], consumer_zmq, boxes, deadline, processes, send_to_pd)
    outcomes |= collect_outcomes(pd_out, 1, deadline, processes)
    fill_rows = epd_cluster.PD_CACHE_ROWS // 8
    filler = {"id": "evict-filler", "items": [sized_image(f"evict-fill-{k}", fill_rows) for k in range(8)]}
    again = {"id": "evict-again", "items": [x]}
    reported: dict[str, list[dict]] = {}
    run_encoder_legs(
        [filler, again], consumer_zmq, boxes, deadline, processes,
        lambda r, ec_items: reported.__setitem__(r["id"], ec_items),
    )
    # In this order, admitted together once the connector has both requests' inputs.
    batch = [(r["id"], r["items"], {"ec_items": reported[r["id"]]}) for r in (filler, again)]
    pd_in.put(("probe",))
    before = recv(pd_out, deadline, processes)
    pd_in.put(("batch", batch))
    outcomes |= collect_outcomes(pd_out, 2, deadline, processes)
    pd_in.put(("probe",))
    after = recv(pd_out, deadline, processes)
    assert before[0] == "probe" and after[0] == "probe"
    assert after[1]["evicted_and_reallocated"] == before[1]["evicted_and_reallocated"] + 1, (before, after)
    for request_id in (first["id"], filler["id"], again["id"]):
        status, detail, provenance = outcomes[request_id]
        assert status == "ok" and set(provenance.values()) == {"connector"}, (request_id, status, detail, provenance)

    for name in ("encoder", "pd"):
        boxes[name][0].put(("stop",))
    final = {name: recv(boxes[name][1], deadline, processes) for name in ("encoder", "pd")}
    for p in processes.values():
        p.join(timeout=max(1.0, deadline - time.monotonic()))

    # Every well-formed request: all items bit-exact on both ranks, delivered by ECX,
    # except an item the PD engine held when the step began and evicted for another
    # request earlier in that step, before the connector could learn of it (a repeated
    # image of the workload, its own push still under way): the engine encodes that one
    # again, as vLLM does (see EngineDouble.reencoded_after_eviction). (Provenance is
    # the worker's latest for the identifier, so a later request served from the engine's
    # cache reports it too: matched by identifier.)
    reencoded = {identifier for _, identifier in final["pd"][1]["reencoded_after_eviction"]}
    wrong = []
    for r in requests:
        status, detail, provenance = outcomes[r["id"]]
        if r["kind"] == "normal":
            delivered = all(
                how == "connector" or (how == "local" and identifier in reencoded)
                for identifier, how in provenance.items()
            )
            if status != "ok" or not delivered:
                wrong.append((r["id"], status, detail, provenance))
        elif r["kind"] == "absent":
            # No routing at all: the PD instance encodes the items itself.
            if status != "ok" or set(provenance.values()) != {"local"}:
                wrong.append((r["id"], status, detail, provenance))
        elif polls_unavailable and status != "unavailable":
            wrong.append((r["id"], status, detail))
        elif not polls_unavailable and (status != "ok" or set(provenance.values()) != {"local"}):
            # Malformed routing on a vLLM that cannot be told to fail the request:
            # the PD instance encodes the items itself.
            wrong.append((r["id"], status, detail, provenance))
    assert not wrong, wrong[:5]
    assert sum(1 for r in requests if r["kind"] == "malformed") == NUM_MALFORMED
    assert sum(1 for r in requests if r["kind"] == "absent") == NUM_ABSENT

    # Clean shutdown: both processes stopped on their own; nothing leaked in the pools.
    assert final["encoder"][0] == "stopping" and final["pd"][0] == "stopping"
    encoder_counters = final["encoder"][1]["counters"]
    assert encoder_counters["staging_failures"] == 0
    assert encoder_counters["staging_used_bytes"] == 0
    assert final["pd"][1]["local_encodes"][0] > 0  # the absent-params requests were encoded locally
    for rank, c in enumerate(final["pd"][1]["counters"]):
        assert c["invariants"] == "", (rank, c)
        assert c["checksum_mismatches"] == 0
        assert c["pool_used_bytes"] == c["resident_bytes"], (rank, c)  # nothing held but the resident cache
        assert c["leases"] == 0
    for name, p in processes.items():
        assert p.exitcode == 0, f"{name} exited with {p.exitcode}"
