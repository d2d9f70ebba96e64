"""ECX inside real vLLM code: an encoder engine (ec_producer) and a PD engine
(ec_consumer), each in its own process, both built from the vLLM source tree named by
ECX_VLLM_SRC (several trees separated by os.pathsep run one after the other); the
test plays vLLM's API server and the EPD proxy. Skipped without ECX_VLLM_SRC.

Real, from the vLLM tree: the v1 `Scheduler` with its `EncoderCacheManager` and
`KVCacheManager`, `ECConnectorFactory` (both roles load `ECXConnector` from
`ec_connector_module_path`), `ensure_ec_transfer_initialized` / `get_ec_transfer`,
`Request`, `SamplingParams`, `MultiModalFeatureSpec` and friends, `ModelRunnerOutput`,
`make_empty_encoder_model_runner_output`, vLLM's parallel state (gloo, one rank), the
CPU platform, and each model runner's EC code:
- MRv1 (`VLLM_USE_V2_MODEL_RUNNER=0`): `GPUModelRunner._process_encoder_cache_scheduler_output`,
  the ec_connector mixin's `maybe_get_ec_connector_output` and `maybe_save_ec_to_connector`,
  `_execute_mm_encoder`, `_cache_encoder_output`, `_gather_mm_embeddings`.
- MRv2 (`VLLM_USE_V2_MODEL_RUNNER=1`): `EncoderCache`, `get_ec_connector` /
  `ActiveECConnector`, `DefaultModelState` with its `EncoderRunner`
  (`execute_mm_encoder`, `get_mm_embeddings` or `prepare_inputs_embeds`), and the
  runner's `_merge_ec_connector_no_forward` where the tree has it (7cfb97e3).
Between the engines everything is ECX: control sockets, readiness events, UCX over
loopback TCP.

Doubles (real_engine.py): `ModelConfigDouble` (a real ModelConfig loads a Hugging Face
config), a `MultiModalRegistry` subclass answering the model-specific questions (one
image modality, at most 256 tokens per item; the real one builds an HF processor),
`EncoderModel` (the model: a deterministic vision tower and a text embedding), and
`RunnerStep`, which replays the branches of each runner's `execute_model` around the
real calls above; the engine loop replays `EngineCore.step` (schedule, execute,
update_from_output) with the worker in the engine process, as vLLM's UniProcExecutor
runs it. Attention, KV caches, the language model and sampling do not run.

Stubbed because they are absent here (vllm_shims.py, _msgspec_lite.py): the
packages listed in real_engine.STUBBED_PACKAGES (import-only placeholders;
msgspec gets a working `Struct` without serialisation), torch-2 names vLLM imports
from torch 1.13 (`torch.library.infer_schema` as an annotation-based subset, FRAGMENT
libraries that register ops as plain Python functions, float8/uint16+ dtypes as
stand-ins, `torch.Tag` members, missing torch submodules and attributes as
placeholders; the test prints the exact list), the `vllm` distribution metadata
(version "+cpu", so vLLM picks its CpuPlatform), and torch 1.13's
`init_process_group`/`new_group` taking `timeout=None`.

Checked per configuration: every request finishes; every embedding the language
model receives on the PD engine is bit-exact with what the encoder computed; the PD
engine encodes nothing except the items of requests sent without (usable)
`ec_transfer_params` or whose pushes never come (which it must encode itself); an
entry vLLM evicts and allocates again in one step is kept; loads are asynchronous
exactly where the runner runs the connector on steps without tokens; both engines go
idle and shut down in under 2 s.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import signal
import socket
import time
import uuid

import pytest

SRC = os.environ.get("ECX_VLLM_SRC", "")
if not SRC:
    pytest.skip(
        "ECX_VLLM_SRC is not set: name a vLLM source tree (the directory holding vllm/) to run this suite",
        allow_module_level=True,
    )
TREES = [p for p in SRC.split(os.pathsep) if p]

import real_engine  # noqa: E402  (pure Python until engine_main runs: imports no vLLM here)

NUM_REQUESTS = 40
NUM_ABSENT = 4
PUSH_WAIT_TIMEOUT_S = 5  # on the engines' manual scheduler clock: passes only when the test advances it
LOST = [{"id": "lost-0", "items": [900, 901]}, {"id": "lost-1", "items": [902]}]  # pushes that never come
MALFORMED = {"id": "malformed-0", "items": [910], "params": {"ec_items": "not-a-list"}}
# The PD engine's max_num_batched_tokens, which is also its encoder cache's size in
# rows: small, so that the workload evicts, and the eviction scenario below fits.
PD_BATCHED_TOKENS = 2048
SIZED = real_engine.SIZED
EVICT_X = 200 * SIZED + 1  # loaded first: the oldest unreferenced entry
EVICT_Y = 300 * SIZED + 1  # loaded next
EVICT_FILLER = [206 * SIZED + i for i in range(1, 9)]  # 1648 rows: evicts X (not Y) to fit
DEADLINE_S = int(os.environ.get("ECX_VLLM_DEADLINE_S", "300"))  # a hung cluster fails the test instead of hanging CI


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def workload(seed: int = 11) -> list[dict]:
    rng = random.Random(seed)
    popular = list(range(12))  # shared across requests
    next_unique = 100
    requests = []
    for r in range(NUM_REQUESTS):
        absent = r % (NUM_REQUESTS // NUM_ABSENT) == 5
        items: list[int] = []
        for _ in range(rng.randint(1, 3)):
            if not absent and rng.random() < 0.4:
                k = rng.choice(popular)
            else:
                k, next_unique = next_unique, next_unique + 1
            if k not in items:
                items.append(k)
        requests.append({"id": f"req-{r:03d}", "items": items, "absent": absent})
    return requests


def recv(box, deadline: float, processes: dict):
    while True:
        try:
            message = box.get(timeout=0.2)
        except queue.Empty:
            message = None
        if message is not None:
            if message[0] == "error":
                raise RuntimeError(f"an engine failed to start:\n{message[1]}")
            return message
        for name, p in processes.items():
            if p.exitcode not in (None, 0):
                raise RuntimeError(f"the {name} engine died with exit code {p.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError("the engines did not answer before the test's deadline")


def extra_config() -> dict:
    return {"control_timeout_s": 5, "push_wait_timeout_s": PUSH_WAIT_TIMEOUT_S, "shutdown_drain_timeout_s": 5,
            "huge_pages": False}


@pytest.mark.parametrize("runner", ["mrv1", "mrv2"])
@pytest.mark.parametrize("tree", TREES, ids=[os.path.basename(t.rstrip("/")) for t in TREES])
def test_encoder_and_pd_engines_deliver_every_embedding_bit_exact(tree: str, runner: str) -> None:
    """Also, on the same engines: requests whose pushes never come, and one with
    malformed ec_transfer_params; neither build polls take_unavailable_requests, so
    the PD engine encodes their items itself once the push deadline passes."""
    try:
        import pydantic
    except ImportError:
        pydantic = None
    if pydantic is None or int(pydantic.VERSION.split(".")[0]) < 2:
        pytest.fail("ECX_VLLM_SRC is set, but vLLM needs pydantic 2 and this interpreter has "
                    f"{'none' if pydantic is None else pydantic.VERSION}: put a site-packages directory with "
                    "pydantic 2 (and regex, cloudpickle) on PYTHONPATH (docs/vllm.md)")
    if not os.path.isdir(os.path.join(tree, "vllm", "distributed", "ec_transfer")):
        pytest.fail(f"{tree} is not a vLLM source tree with EC transfer (no vllm/distributed/ec_transfer)")
    ctx = multiprocessing.get_context("spawn")
    boxes = {name: (ctx.Queue(), ctx.Queue()) for name in ("encoder", "pd")}
    pd_port, encoder_port, pd_dist, encoder_dist = _free_ports(4)
    processes = {
        "encoder": ctx.Process(
            target=real_engine.engine_main,
            args=(tree, runner, "ec_producer", encoder_port, encoder_dist, extra_config(), *boxes["encoder"]),
            daemon=True,
        ),
        "pd": ctx.Process(
            target=real_engine.engine_main,
            args=(tree, runner, "ec_consumer", pd_port, pd_dist, extra_config(), *boxes["pd"], PD_BATCHED_TOKENS),
            daemon=True,
        ),
    }
    for p in processes.values():
        p.start()
    try:
        try:
            _run_cluster(processes, boxes, runner)
        except TimeoutError as e:
            states = _probe(boxes)
            for p in processes.values():
                if p.is_alive():
                    os.kill(p.pid, signal.SIGUSR1)  # each engine prints its threads' stacks
            exits = {name: p.exitcode for name, p in processes.items()}
            raise TimeoutError(f"{e}; exit codes {exits}; engine states: {states}") from None
    finally:
        for p in processes.values():
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join()


def _probe(boxes: dict) -> dict:
    states = {}
    for name, (inbox, outbox) in boxes.items():
        inbox.put(("probe",))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                message = outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if message[0] == "probe":
                states[name] = message[1]
                break
    return states


def _run_cluster(processes: dict, boxes: dict, runner: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    encoder_in, encoder_out = boxes["encoder"]
    pd_in, pd_out = boxes["pd"]
    ready = {name: recv(boxes[name][1], deadline, processes) for name in ("encoder", "pd")}
    for name, message in ready.items():
        assert message[0] == "ready", (name, message)
        assert message[1]["connector"] == "ecx.vllm.ECXConnector", message
    consumer_zmq = ready["pd"][1]["control"]
    print("stubbed packages (modules created):", ", ".join(ready["pd"][1]["stubbed_packages"]))
    print("torch 2 names filled in on torch 1.13:", ", ".join(ready["pd"][1]["torch_filled"]))

    outcomes: dict[str, tuple] = {}
    scenario = _evicted_and_allocated_again(consumer_zmq, boxes, deadline, processes, outcomes)

    requests = workload()
    by_id = {r["id"]: r for r in requests}
    transfer_ids: dict[str, list[str]] = {}
    for r in requests:
        if r["absent"]:
            # No ec_transfer_params: the PD engine must encode these itself.
            pd_in.put(("request", r["id"], r["items"], None, True))
            continue
        transfer_ids[r["id"]] = [uuid.uuid4().hex for _ in r["items"]]
        params = {"consumer_zmq": consumer_zmq, "ec_items": [{"transfer_id": t} for t in transfer_ids[r["id"]]]}
        encoder_in.put(("request", r["id"], r["items"], params, True))

    problems: list[str] = []
    pending_encoder = set(transfer_ids)
    while pending_encoder or any(r["id"] not in outcomes for r in requests):
        progressed = False
        try:
            kind, request_id, reason, params, _ = encoder_out.get_nowait()
            progressed = True
            assert kind == "finished", kind
            r = by_id[request_id]
            pending_encoder.discard(request_id)
            expected_items = [
                {"mm_hash": real_engine.item_identifier(k), "transfer_id": t}
                for k, t in zip(r["items"], transfer_ids[request_id])
            ]
            if not params or params.get("ec_items") != expected_items:
                problems.append(f"{request_id}: encoder reported {params}, expected ec_items {expected_items}")
                continue
            # Proxy, PD leg: the identifiers the encoder reported, with their transfer ids.
            pd_in.put(("request", request_id, r["items"], {"ec_items": params["ec_items"]}, True))
        except queue.Empty:
            pass
        try:
            kind, request_id, reason, _params, gathered = pd_out.get_nowait()
            progressed = True
            assert kind == "finished", kind
            assert request_id not in outcomes, f"{request_id} finished twice"
            outcomes[request_id] = (reason, gathered)
        except queue.Empty:
            pass
        if not progressed:
            recv_deadline_check(deadline, processes)
            time.sleep(0.01)
    assert not problems, problems[:5]

    requests += scenario
    # Pushes that never come, and malformed routing: held until the push deadline
    # passes, then encoded by the PD engine itself (vLLM cannot be told to fail them).
    for r in LOST:
        ec_items = [{"mm_hash": real_engine.item_identifier(k), "transfer_id": uuid.uuid4().hex} for k in r["items"]]
        pd_in.put(("request", r["id"], r["items"], {"ec_items": ec_items}, True))
        requests.append({"id": r["id"], "items": r["items"], "absent": False, "local": True})
    pd_in.put(("request", MALFORMED["id"], MALFORMED["items"], MALFORMED["params"], True))
    requests.append({"id": MALFORMED["id"], "items": MALFORMED["items"], "absent": False, "local": True})
    def probe_pd() -> dict:
        pd_in.put(("probe",))
        while True:
            message = recv(pd_out, deadline, processes)
            if message[0] == "probe":
                return message[1]
            assert message[0] == "finished", message
            outcomes[message[1]] = (message[2], message[4])

    # Held while vLLM steps (their pushes may still come). Two engine steps after the
    # requests were queued, vLLM has shown them to the connector (ensure_cache_available).
    first = probe_pd()
    held = probe_pd()
    while held["steps"] < first["steps"] + 2:
        held = probe_pd()
    waiting = set(held["waiting"]) | set(held["skipped_waiting"]) | set(held["running"])
    assert {r["id"] for r in LOST} <= waiting, held
    pd_in.put(("advance", PUSH_WAIT_TIMEOUT_S + 1))
    while len(outcomes) < len(requests):
        kind, request_id, reason, _params, gathered = recv(pd_out, deadline, processes)
        assert kind == "finished", kind
        outcomes[request_id] = (reason, gathered)

    for name in ("encoder", "pd"):
        boxes[name][0].put(("stop",))
    final = {name: recv(boxes[name][1], deadline, processes) for name in ("encoder", "pd")}
    for p in processes.values():
        p.join(timeout=max(1.0, deadline - time.monotonic()))

    wrong = []
    for r in requests:
        reason, gathered = outcomes[r["id"]]
        expected = {real_engine.item_identifier(k): real_engine.digest(real_engine.expected_embedding(k))
                    for k in r["items"]}
        if reason != "length" or gathered != expected:
            wrong.append((r["id"], reason, gathered, expected))
    assert not wrong, wrong[:3]

    encoder, pd = final["encoder"][1], final["pd"][1]
    assert final["encoder"][0] == "stopped" and final["pd"][0] == "stopped"
    local_items = sum(len(r["items"]) for r in requests if r["absent"] or r.get("local"))
    # Nothing encoded on the PD engine but what the test asked it to encode.
    assert pd["local_encodes"] == local_items, (pd["local_encodes"], local_items, pd["scheduler_stats"])
    # Counted as local fallbacks: the items of the lost pushes and of the malformed request.
    fallbacks = sum(len(r["items"]) for r in LOST) + len(MALFORMED["items"])
    assert pd["scheduler_stats"]["local_fallbacks"] == fallbacks, pd["scheduler_stats"]
    # Asynchronous loads exactly where the runner runs the connector on steps without
    # tokens and reports worker metadata (MRv2 with its no_forward EC path, 7cfb97e3).
    assert pd["asynchronous_loads"] == (runner == "mrv2" and pd["ec_no_forward"]), pd
    assert (pd["no_token_steps_reach_workers"] is True) == (runner == "mrv2" and pd["ec_no_forward"]), pd
    # vLLM evicted X and allocated it again in one step: at 6adad087 it told the
    # runner to drop X and ECX put its copy back; 7cfb97e3 keeps X itself.
    x = real_engine.item_identifier(EVICT_X)
    assert (x in pd["retained"]) != pd["vllm_keeps_reallocated"], (pd["retained"], pd["vllm_keeps_reallocated"])
    assert pd["embeds_checked"] == sum(len(r["items"]) for r in requests)
    assert encoder["local_encodes"] > 0
    assert not encoder["has_requests"] and not pd["has_requests"]
    counters = pd["worker_counters"]
    assert counters["checksum_mismatches"] == 0, counters
    assert counters["invariants"] == "", counters
    assert encoder["worker_counters"]["staging_failures"] == 0, encoder["worker_counters"]
    for name, report in final.items():
        assert report[1]["shutdown_s"] < 2.0, (name, report[1]["shutdown_s"])
    for name, p in processes.items():
        assert p.exitcode == 0, f"{name} exited with {p.exitcode}"


def _through_encoder(request_id: str, items: list[int], consumer_zmq: str, boxes: dict, deadline: float,
                     processes: dict) -> list[dict]:
    """Proxy, encoder leg of one request: the ec_items the encoder reported."""
    encoder_in, encoder_out = boxes["encoder"]
    params = {"consumer_zmq": consumer_zmq, "ec_items": [{"transfer_id": uuid.uuid4().hex} for _ in items]}
    encoder_in.put(("request", request_id, items, params, True))
    kind, finished_id, _reason, reported, _ = recv(encoder_out, deadline, processes)
    assert kind == "finished" and finished_id == request_id, (kind, finished_id)
    return reported["ec_items"]


def _evicted_and_allocated_again(consumer_zmq: str, boxes: dict, deadline: float, processes: dict,
                                 outcomes: dict) -> list[dict]:
    """The PD engine loads X, then Y (both stay as unreferenced encoder-cache
    entries); then one step schedules a request whose items make vLLM's
    EncoderCacheManager evict X, and after it a request for X with a new transfer: vLLM
    drops X from the runner's cache at the step's start and ECX must put it back."""
    pd_in, pd_out = boxes["pd"]

    def pd_request(request_id: str, items: list[int]) -> None:
        pd_in.put(("request", request_id, items, {"ec_items": _through_encoder(
            request_id, items, consumer_zmq, boxes, deadline, processes)}, True))
        kind, finished_id, reason, _params, gathered = recv(pd_out, deadline, processes)
        assert kind == "finished" and finished_id == request_id, (kind, finished_id)
        outcomes[request_id] = (reason, gathered)

    pd_request("evict-x", [EVICT_X])
    pd_request("evict-y", [EVICT_Y])
    pd_in.put(("probe",))
    message = recv(pd_out, deadline, processes)
    assert message[0] == "probe", message
    landed_before = message[1]["landings_ready"]
    batch = [("evict-filler", EVICT_FILLER), ("evict-x-again", [EVICT_X])]
    entries = [(r, items, {"ec_items": _through_encoder(r, items, consumer_zmq, boxes, deadline, processes)}, True)
               for r, items in batch]
    # Admitted together once the filler's 8 pushes have landed (X's second push finds
    # X's copy still resident in the pool and lands nothing new), so that one step
    # schedules both.
    pd_in.put(("batch", entries, landed_before + len(EVICT_FILLER)))
    for _ in batch:
        kind, finished_id, reason, _params, gathered = recv(pd_out, deadline, processes)
        assert kind == "finished", kind
        outcomes[finished_id] = (reason, gathered)
    return [{"id": r, "items": items, "absent": False} for r, items in
            [("evict-x", [EVICT_X]), ("evict-y", [EVICT_Y]), *batch]]


def recv_deadline_check(deadline: float, processes: dict) -> None:
    for name, p in processes.items():
        if p.exitcode not in (None, 0):
            raise RuntimeError(f"the {name} engine died with exit code {p.exitcode}")
    if time.monotonic() > deadline:
        raise TimeoutError("the engines did not answer before the test's deadline")
