"""One vLLM engine process built from a real vLLM source tree (see test_real_vllm.py).

`engine_main` runs in a spawned process. It imports vLLM from the tree it is given,
builds vLLM's own v1 `Scheduler` (with its `EncoderCacheManager`, `KVCacheManager`
and the EC connector that `ECConnectorFactory` creates from `--ec-transfer-config`),
the worker-side connector through vLLM's `ensure_ec_transfer_initialized`, and one
model runner's EC path:

- MRv1: a `GPUModelRunner` (vllm/v1/worker/gpu_model_runner.py) whose EC-relevant
  methods run for real: `_process_encoder_cache_scheduler_output`,
  `maybe_get_ec_connector_output` (the ec_connector mixin's context manager),
  `_execute_mm_encoder` (which calls `save_caches` through the mixin),
  `_gather_mm_embeddings` (which raises "Encoder cache miss" like the real step).
- MRv2: vllm/v1/worker/gpu's `EncoderCache`, `ActiveECConnector` (from
  `get_ec_connector`), and a `DefaultModelState` with its `EncoderRunner`
  (`execute_mm_encoder`, `get_mm_embeddings`), plus, where the tree has it, the
  runner's `_merge_ec_connector_no_forward` for steps without tokens.

`RunnerStep` replays the control flow of each runner's `execute_model` around those
calls (which branch runs on an encoder-only step, a step without tokens, a step with
tokens), reading the branch conditions from the tree; attention, KV caches, the
language model and sampling are not run (there is no model), so each scheduled
request samples token 1 once its prompt is computed. The encoder is `EncoderModel`,
a deterministic function of the item's pixel tensor.

The process talks to the test (vLLM's API server and proxy, in effect) through
multiprocessing queues.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import queue
import sys
import time
from typing import Any

WIDTH = 64  # encoder output row width (the model's inputs_embeds size)
MAX_ITEM_ROWS = 256
MAX_NUM_BATCHED_TOKENS = 8192
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 4096

# Third-party packages vLLM imports that are absent here and that no tested path
# uses; they are replaced by permissive placeholder modules (vllm_shims).
STUBBED_PACKAGES = (
    "aiohttp", "cachetools", "cbor2", "cpuinfo", "einops", "filelock", "huggingface_hub", "llguidance",
    "openai", "openai_harmony", "prometheus_client", "pybase64", "safetensors", "tqdm", "transformers",
    "uvloop", "xgrammar", "zmq",
    "msgspec",  # replaced by _msgspec_lite (a working Struct; no serialisation)
)


# ------------------------------------------------------------------ media


def item_identifier(k: int) -> str:
    return hashlib.sha256(f"image-{k}".encode()).hexdigest()[:40]


SIZED = 10_000  # item k >= SIZED has k // SIZED rows (a test's way to pick sizes)


def item_rows(k: int) -> int:
    if k >= SIZED:
        return k // SIZED
    return 16 + (k * 37) % 241  # 16..256


def item_pixels(k: int):
    import torch

    g = torch.Generator().manual_seed(1000 + k)
    return torch.randn(item_rows(k), WIDTH, generator=g, dtype=torch.float32)


def encode_pixels(pixels):
    """The 'vision tower': any deterministic function will do; bf16 like a real model."""
    import torch

    return (pixels * 3.0 + 0.5).to(torch.bfloat16)


def expected_embedding(k: int):
    return encode_pixels(item_pixels(k))


def digest(tensor) -> str:
    import torch

    t = tensor.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16] + f":{list(tensor.shape)}:{tensor.dtype}"


# ------------------------------------------------------------------ setup


def setup_vllm(vllm_src: str) -> None:
    """vLLM from `vllm_src`, never the repository's vLLM double."""
    sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("vllm_double")]
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm."):
            del sys.modules[name]
    sys.path.insert(0, vllm_src)
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(1, here)
    import vllm_shims

    vllm_shims.install(STUBBED_PACKAGES)
    import vllm

    if not os.path.abspath(vllm.__file__).startswith(os.path.abspath(vllm_src)):
        raise RuntimeError(f"vllm imported from {vllm.__file__}, not from {vllm_src}")


class ModelConfigDouble:
    """What the scheduler, the runners and the connector read from ModelConfig. A real
    ModelConfig loads a Hugging Face model config (transformers, a model on disk);
    there is none here."""

    def __init__(self) -> None:
        import torch

        self.model = "ecx-test/tiny-vl"
        self.served_model_name = self.model
        self.dtype = torch.bfloat16
        self.max_model_len = 4096
        self.is_encoder_decoder = False
        self.is_diffusion = False
        self.is_multimodal_model = True
        self.multimodal_config = None
        self.enable_return_routed_experts = False
        self.return_sampling_mask = False
        self.runner_type = "generate"
        self.architectures = ["TinyVLForConditionalGeneration"]
        self.is_moe = False
        self.is_hybrid = False
        self.is_attention_free = False
        self.uses_mrope = False
        self.uses_xdrope_dim = 0
        self.logits_processors = None
        self.logprobs_mode = "raw_logprobs"
        self.enable_cumem_allocator = False
        self.quantization = None
        self.hf_config = None
        self.hf_text_config = None
        self.enable_prompt_embeds = False
        self.skip_tokenizer_init = True
        self.enforce_eager = True

    def get_inputs_embeds_size(self) -> int:
        return WIDTH

    def get_hidden_size(self) -> int:
        return WIDTH

    def get_multimodal_config(self):
        return None

    def compute_hash(self) -> str:
        return "ecx-test"

    def __getattr__(self, name: str):
        raise AttributeError(f"ModelConfigDouble has no {name!r} (add it if vLLM reads it)")


def _registry_double():
    """vLLM's MultiModalRegistry, with the model-specific answers (which modalities,
    how many tokens per item) a real model's processor would give; the real one
    instantiates a Hugging Face processor."""
    from vllm.multimodal.registry import MultiModalRegistry

    class _Info:
        supported_mm_limits = {"image": None}
        allowed_mm_limits = {"image": 16}

        def get_mm_max_tokens_per_item(self, seq_len, mm_counts=None):
            return {"image": MAX_ITEM_ROWS}

    class _Processor:
        info = _Info()

    class Registry(MultiModalRegistry):
        def supports_multimodal_inputs(self, model_config) -> bool:
            return True

        def processor_only_cache_from_config(self, vllm_config):
            return None

        def create_processor(self, model_config, *args, **kwargs):
            return _Processor()

    return Registry()


def build_vllm_config(role: str, port: int, extra: dict, runner: str = "mrv1", max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ECTransferConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    # VllmConfig refuses MRv2 without Triton (its input-preparation kernels, which
    # this test does not run): build it with MRv1 selected, then select MRv2 the way
    # an operator does (VLLM_USE_V2_MODEL_RUNNER) before anything reads the choice.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,  # also the encoder cache's size, in rows
            max_num_seqs=64,
            max_model_len=4096,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig(device="cpu"),
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECXConnector",
            ec_connector_module_path="ecx.vllm",
            ec_role=role,
            ec_ip="127.0.0.1",
            ec_port=port,
            ec_buffer_device="cpu",
            ec_buffer_size=64 * 1024 * 1024,
            ec_connector_extra_config=extra,
        ),
    )
    # Set after construction: VllmConfig's __post_init__ would verify a real model.
    object.__setattr__(vllm_config, "model_config", ModelConfigDouble())
    vllm_config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "mrv2" else "0"
    assert vllm_config.use_v2_model_runner == (runner == "mrv2")
    return vllm_config


def build_scheduler(vllm_config):
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                                                          dtype=torch.float32))
        ],
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        mm_registry=_registry_double(),
        log_stats=False,
    )


def init_worker_distributed(vllm_config, port: int) -> None:
    """vLLM's own parallel state for a single worker (gloo over loopback), as
    gpu_worker's init_worker_distributed_environment sets it up."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
        )
        parallel_state.ensure_model_parallel_initialized(1, 1)


# ------------------------------------------------------------------ model


class EncoderModel:
    """The model: a deterministic vision tower (embed_multimodal) and a text embedding
    that leaves zeros where no multimodal embedding goes (embed_input_ids). It counts
    the items it encodes."""

    requires_raw_input_tokens = False
    supports_multimodal = True

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def embed_multimodal(self, pixel_values=None, **kwargs):
        items = list(pixel_values) if isinstance(pixel_values, (list, tuple)) else list(pixel_values.unbind(0))
        outputs = [encode_pixels(p) for p in items]
        self.encoded.extend(digest(o) for o in outputs)
        return outputs

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, is_multimodal=None):
        import torch

        out = torch.zeros(int(input_ids.shape[0]), WIDTH, dtype=torch.bfloat16)
        if multimodal_embeddings:
            out[is_multimodal] = torch.cat(list(multimodal_embeddings), dim=0).to(out.dtype)
        return out


def make_request(request_id: str, items: list[int], params: Any, *, with_media: bool = True):
    """A vLLM Request as EngineCore's input processor would build it: text tokens,
    one placeholder range per image, each item's processed data and identifier."""
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    tokens = [7, 7, 7, 7]
    features = []
    for k in items:
        rows = item_rows(k)
        data = None
        if with_media:
            data = MultiModalKwargsItem(
                {"pixel_values": MultiModalFieldElem(data=item_pixels(k), field=MultiModalBatchedField())}
            )
        features.append(
            MultiModalFeatureSpec(
                data=data,
                modality="image",
                identifier=item_identifier(k),
                mm_position=PlaceholderRange(offset=len(tokens), length=rows),
                mm_hash=item_identifier(k),
            )
        )
        tokens += [9] * rows + [7, 7]
    extra_args = {"ec_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=1, ignore_eos=True, extra_args=extra_args)
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=sampling,
        pooling_params=None,
        mm_features=features,
    )


# ------------------------------------------------------------------ runners


class _RequestState:
    def __init__(self, new_req) -> None:
        self.req_id = new_req.req_id
        self.mm_features = new_req.mm_features
        self.prompt_token_ids = new_req.prompt_token_ids
        self.num_computed_tokens = new_req.num_computed_tokens
        self.num_prompt_tokens = len(new_req.prompt_token_ids)


class _InputBatchV1:
    def __init__(self) -> None:
        self.req_ids: list[str] = []


class RunnerStep:
    """One model runner's execute_model, EC path real (see the module docstring)."""

    def __init__(self, runner: str, vllm_config, model: EncoderModel) -> None:
        import torch
        from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

        self.kind = runner
        self.vllm_config = vllm_config
        self.model = model
        self.device = torch.device("cpu")
        self.states: dict[str, _RequestState] = {}
        self.has_ec_transfer, self.get_ec_transfer = has_ec_transfer, get_ec_transfer
        self.gathered: dict[str, dict[str, list]] = {}  # req_id -> identifier -> rows the LM got
        self.embeds_checked = 0
        try:
            from vllm.distributed.ec_transfer.ec_connector.utils import ECOutputAggregator

            self.aggregator = ECOutputAggregator()
        except ImportError:  # 6adad087: only rank 0's output reaches the scheduler
            self.aggregator = None
        if runner == "mrv1":
            self._init_mrv1()
        else:
            self._init_mrv2()

    # -- MRv1

    def _init_mrv1(self) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        r = GPUModelRunner.__new__(GPUModelRunner)  # no __init__: it allocates GPU buffers and loads a model
        r.vllm_config = self.vllm_config
        r.model_config = self.vllm_config.model_config
        r.observability_config = self.vllm_config.observability_config
        r.lora_config = None
        r.device = self.device
        r.model = self.model
        r.encoder_cache = {}
        r.requests = self.states
        r.input_batch = _InputBatchV1()
        r.is_multimodal_pruning_enabled = False
        r.requires_sequential_video_encoding = False
        r.encoder_cudagraph_manager = None
        r.uses_mrope = False
        r.uses_xdrope_dim = 0
        r.encoder_timing_registry = {}
        self.runner = r
        self.encoder_cache = r.encoder_cache

    def _step_mrv1(self, so):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, make_empty_encoder_model_runner_output

        r = self.runner
        self._update_request_states(so)
        r.input_batch.req_ids = list(so.num_scheduled_tokens)
        # _update_states: the encoder-cache part.
        r._process_encoder_cache_scheduler_output(so)
        # execute_model: an encoder-only instance encodes inside the EC context and
        # returns from within it; its ECConnectorOutput is not returned.
        if self.has_ec_transfer() and not self.get_ec_transfer().is_consumer:
            with r.maybe_get_ec_connector_output(so, encoder_cache=r.encoder_cache):
                r._execute_mm_encoder(so)
                return make_empty_encoder_model_runner_output(so)
        if not so.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT  # no KV connector: the early return
        # _preprocess: supports_mm_inputs, first PP rank, not encoder-decoder.
        with r.maybe_get_ec_connector_output(so, encoder_cache=r.encoder_cache) as ec_connector_output:
            r._execute_mm_encoder(so)
            mm_embeds, is_mm_embed = r._gather_mm_embeddings(so)
        self._record_gathered_v1(so, mm_embeds)
        return self._sampled_output(so, ec_connector_output)

    def _record_gathered_v1(self, so, mm_embeds) -> None:
        """Which embedding rows the language model received for every item in the
        window (order: the batch's requests, then their items, as
        _gather_mm_embeddings builds it); a chunked prompt delivers an item in parts."""
        it = iter(mm_embeds)
        for req_id in self.runner.input_batch.req_ids:
            st = self.states[req_id]
            start, end = st.num_computed_tokens, st.num_computed_tokens + so.num_scheduled_tokens[req_id]
            for f in st.mm_features:
                pos = f.mm_position
                if pos.offset < end and pos.offset + pos.length > start:
                    self._record(req_id, f.identifier, next(it))

    # -- MRv2

    def _init_mrv2(self) -> None:
        from vllm.v1.worker.gpu.ec_connector import get_ec_connector
        from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache
        from vllm.v1.worker.gpu.model_states.default import DefaultModelState

        self.v2_encoder_cache = EncoderCache()
        self.ec_connector = get_ec_connector(self.vllm_config, self.v2_encoder_cache)
        self.model_state = DefaultModelState(self.vllm_config, self.model, self.v2_encoder_cache, self.device)
        self.is_encoder_only = self.vllm_config.is_encoder_only
        self.encoder_cache = self.v2_encoder_cache.encoder_outputs
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

        # The V2 runner without __init__ (GPU buffers, a model): its free_states and,
        # at 7cfb97e3, _merge_ec_connector_no_forward use only these two attributes.
        shell = V2Runner.__new__(V2Runner)
        shell.ec_connector = self.ec_connector
        shell.encoder_cache = self.v2_encoder_cache
        self.v2_runner = shell
        self.v2_no_forward = hasattr(V2Runner, "_merge_ec_connector_no_forward")
        # Whether a step that runs the language model returns its ECConnectorOutput
        # (sample_tokens carries it at 7cfb97e3; at 6adad087 only the encoder-only
        # return does, so a PD engine's reports never reach its scheduler).
        import inspect

        self.v2_sampled_carries_ec = "ec_connector_output" in inspect.getsource(V2Runner.sample_tokens)

    def _step_mrv2(self, so):
        import numpy as np
        import torch
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, make_empty_encoder_model_runner_output

        cache = self.v2_encoder_cache
        # finish_requests and add_requests (their encoder-cache parts), free_states (real).
        for req_id in set(so.finished_req_ids) | set(getattr(so, "preempted_req_ids", None) or ()):
            cache.remove_request(req_id)
        self.v2_runner.free_states(so)
        for new_req in so.scheduled_new_reqs:
            cache.add_request(new_req.req_id, new_req.mm_features)
        self._update_request_states(so)
        if so.total_num_scheduled_tokens == 0:
            empty = EMPTY_MODEL_RUNNER_OUTPUT  # kv_connector.no_forward without a KV connector
            if self.v2_no_forward:  # 7cfb97e3: the EC context runs anyway
                return self.v2_runner._merge_ec_connector_no_forward(so, empty)
            return empty
        req_ids = list(so.num_scheduled_tokens)
        with self.ec_connector.maybe_get_output(so) as ec_connector_output:
            if self.is_encoder_only:
                self.model_state.execute_mm_encoder(so.scheduled_encoder_inputs)
            else:
                n = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
                batch = _InputBatchV2(
                    req_ids=req_ids,
                    num_tokens=int(n.sum()),
                    num_scheduled_tokens=n,
                    query_start_loc_np=np.concatenate([[0], np.cumsum(n)]).astype(np.int32),
                    prefill_len_np=np.array([self.states[r].num_prompt_tokens for r in req_ids], dtype=np.int32),
                    num_computed_tokens_np=np.array([self.states[r].num_computed_tokens for r in req_ids],
                                                    dtype=np.int32),
                    input_ids=torch.zeros(int(n.sum()), dtype=torch.int32),
                    num_tokens_after_padding=int(n.sum()),
                )
                # get_mm_embeddings at 6adad087, prepare_inputs_embeds at 7cfb97e3.
                prepare = getattr(self.model_state, "prepare_inputs_embeds", None) or self.model_state.get_mm_embeddings
                inputs_embeds = prepare(so.scheduled_encoder_inputs, batch, None)
                self._record_gathered_v2(so, batch, inputs_embeds)
        if self.is_encoder_only:
            from vllm.v1.outputs import ModelRunnerOutput

            output = make_empty_encoder_model_runner_output(so)
            if hasattr(ModelRunnerOutput, "with_ec_conn_output"):  # 7cfb97e3
                return ModelRunnerOutput.with_ec_conn_output(output, ec_connector_output)
            output.ec_connector_output = ec_connector_output  # 6adad087
            return output
        return self._sampled_output(so, ec_connector_output if self.v2_sampled_carries_ec else None)

    def _record_gathered_v2(self, so, batch, inputs_embeds) -> None:
        """The rows of inputs_embeds (what the language model would read) at each item's
        placeholder positions in this step's window."""
        for i, req_id in enumerate(batch.req_ids):
            st = self.states[req_id]
            start = st.num_computed_tokens
            end = start + int(batch.num_scheduled_tokens[i])
            base = int(batch.query_start_loc_np[i])
            for f in st.mm_features:
                pos = f.mm_position
                lo, hi = max(pos.offset, start), min(pos.offset + pos.length, end)
                if lo < hi:
                    self._record(req_id, f.identifier, inputs_embeds[base + lo - start : base + hi - start])

    # -- both

    def _record(self, req_id: str, identifier: str, rows) -> None:
        self.gathered.setdefault(req_id, {}).setdefault(identifier, []).append(rows.clone())

    def take_gathered(self, req_id: str) -> dict[str, str]:
        """identifier -> digest of every row the language model received for it."""
        import torch

        parts = self.gathered.pop(req_id, {})
        self.embeds_checked += len(parts)
        return {identifier: digest(torch.cat(rows, dim=0)) for identifier, rows in parts.items()}

    def _update_request_states(self, so) -> None:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for new_req in so.scheduled_new_reqs:
            self.states[new_req.req_id] = _RequestState(new_req)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(getattr(cached, "req_ids", ()) or ()):
            if req_id in self.states:
                self.states[req_id].num_computed_tokens = cached.num_computed_tokens[i]

    def _sampled_output(self, so, ec_connector_output):
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            st = self.states[req_id]
            done = st.num_computed_tokens + so.num_scheduled_tokens[req_id] >= st.num_prompt_tokens
            sampled.append([1] if done else [])
            st.num_computed_tokens += so.num_scheduled_tokens[req_id]
        out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        out.ec_connector_output = ec_connector_output
        return out

    def step(self, so):
        # The executor hands the worker a pickled SchedulerOutput in multiprocess
        # setups: the connector's metadata must survive that.
        if so.ec_connector_metadata is not None:
            so.ec_connector_metadata = pickle.loads(pickle.dumps(so.ec_connector_metadata))
        out = self._step_mrv1(so) if self.kind == "mrv1" else self._step_mrv2(so)
        if self.aggregator is not None:
            # 7cfb97e3's multiprocess executor folds every rank's EC output onto the
            # output rank's (one rank here).
            out = self.aggregator.aggregate([out], output_rank=0)
        ec_out = getattr(out, "ec_connector_output", None)
        meta = getattr(ec_out, "ec_connector_worker_meta", None) if ec_out is not None else None
        if meta is not None:
            pickle.loads(pickle.dumps(meta))
        return out


class _InputBatchV2:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


# ------------------------------------------------------------------ engine process


def engine_main(vllm_src: str, runner: str, role: str, port: int, dist_port: int, extra: dict, inbox, outbox,
                max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS) -> None:
    """The engine process: builds everything, then steps while there is work and
    answers the test's messages: ("request", id, items, ec_transfer_params,
    with_media), ("batch", [request, ...]) admitted together once all their items have
    landed in this engine's pool (so that one step schedules them), ("advance",
    seconds) for the connector's scheduler clock (a ManualClock: deadlines pass only
    when the test says so), ("probe",), ("stop",)."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's diagnostics on a timeout
    os.environ["UCX_TLS"] = "tcp"
    try:
        setup_vllm(vllm_src)
        vllm_config = build_vllm_config(role, port, extra, runner, max_num_batched_tokens)
        from ecx import _core
        from ecx.vllm import ECXConnector

        clock = _core.ManualClock()
        ECXConnector.scheduler_clock = clock
        init_worker_distributed(vllm_config, dist_port)
        from vllm.distributed.ec_transfer import ensure_ec_transfer_initialized, get_ec_transfer

        ensure_ec_transfer_initialized(vllm_config)  # the worker's connector (ECConnectorFactory, WORKER)
        scheduler = build_scheduler(vllm_config)  # the scheduler's connector (ECConnectorFactory, SCHEDULER)
        model = EncoderModel()
        step = RunnerStep(runner, vllm_config, model)
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails with it
        import traceback

        outbox.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    worker_connector = get_ec_transfer()
    control = worker_connector._config.control_address(0) if worker_connector.is_consumer else None
    import vllm_shims

    outbox.put(("ready", {
        "control": control,
        "connector": type(scheduler.ec_connector).__module__ + "." + type(scheduler.ec_connector).__name__,
        "stubbed_packages": sorted(vllm_shims.STUBBED_PACKAGES),
        "torch_filled": sorted(set(vllm_shims.TORCH_FILLED)),
    }))

    steps = 0
    stopping = False
    staged: list = []  # a batch waiting for its items to land
    staged_landings = 0
    retained: set[str] = set()  # entries vLLM evicted and allocated again in one step, kept by ECX

    def handle(message) -> None:
        nonlocal stopping
        nonlocal staged_landings
        if message[0] == "request":
            _, request_id, items, params, with_media = message
            scheduler.add_request(make_request(request_id, items, params, with_media=with_media))
        elif message[0] == "batch":
            staged.extend(make_request(r, items, params, with_media=m) for r, items, params, m in message[1])
            staged_landings = message[2]
        elif message[0] == "stop":
            stopping = True
        elif message[0] == "advance":
            clock.advance(float(message[1]))
        elif message[0] == "probe":  # diagnostics for a test that timed out
            outbox.put(("probe", {
                "steps": steps,
                "landings_ready": worker_connector.worker_counters().get("landings_ready"),
                "waiting": [r.request_id for r in scheduler.waiting],
                "skipped_waiting": [r.request_id for r in getattr(scheduler, "skipped_waiting", ())],
                "running": [r.request_id for r in scheduler.running],
                "has_requests": scheduler.has_requests(),
                "scheduler_stats": scheduler.ec_connector.scheduler_stats(),
                "worker_counters": worker_connector.worker_counters(),
                "encoder_cache": sorted(step.encoder_cache),
            }))

    while True:
        try:
            while True:
                handle(inbox.get_nowait())
        except queue.Empty:
            pass
        if staged and worker_connector.worker_counters()["landings_ready"] >= staged_landings:
            for r in staged:
                scheduler.add_request(r)
            staged.clear()
        if scheduler.has_requests():
            so = scheduler.schedule()
            if so.ec_connector_metadata is not None:
                retained.update(getattr(so.ec_connector_metadata, "retained", ()) or ())
            out = step.step(so)
            steps += 1
            engine_outputs = scheduler.update_from_output(so, out)
            finished_any = False
            for eco in engine_outputs.values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        finished_any = True
                        outbox.put(("finished", o.request_id, str(o.finish_reason), o.ec_transfer_params,
                                    step.take_gathered(o.request_id)))
            if not finished_any and not so.total_num_scheduled_tokens:
                time.sleep(0.0005)  # waiting on the network; do not starve the other engine
        elif stopping and not staged:
            break
        else:
            try:
                handle(inbox.get(timeout=0.05))
            except queue.Empty:
                pass
    try:
        from vllm.v1.worker.gpu.ec_connector import ActiveECConnector

        ec_no_forward = hasattr(ActiveECConnector, "no_forward")
    except ImportError:
        ec_no_forward = False
    import inspect

    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    report = {
        # 7cfb97e3's EncoderCacheManager no longer reports an entry as freed when the
        # same scheduling pass allocates it again (the worker keeps its tensor).
        "vllm_keeps_reallocated": "not in self.cached" in inspect.getsource(EncoderCacheManager.get_freed_mm_hashes),
        "asynchronous_loads": bool(scheduler.ec_connector._scheduler.asynchronous_loads),
        "no_token_steps_reach_workers": scheduler.ec_connector._no_token_steps_reach_workers,
        "ec_no_forward": ec_no_forward,
        "steps": steps,
        "retained": sorted(retained),
        "local_encodes": len(model.encoded),
        "embeds_checked": step.embeds_checked,
        "scheduler_stats": scheduler.ec_connector.scheduler_stats(),
        "worker_counters": worker_connector.worker_counters(),
        "encoder_cache_left": len(step.encoder_cache),
        "has_requests": scheduler.has_requests(),
    }
    t0 = time.monotonic()
    scheduler.shutdown()
    from vllm.distributed.ec_transfer.ec_transfer_state import ensure_ec_transfer_shutdown

    ensure_ec_transfer_shutdown()
    report["shutdown_s"] = time.monotonic() - t0
    outbox.put(("stopped", report))
