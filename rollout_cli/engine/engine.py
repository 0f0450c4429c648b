"""The engine: load a checkpoint once, then turn prompts into trajectories.

The loop (engine/step_loop.py) is the three calls of shared/DESIGN.md: scheduler.schedule() ->
runner.launch() -> scheduler.postprocess(), overlapped in the steady state. Prompts are pulled lazily
from the caller's iterator, so a million-row prompt file never sits in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from rollout_cli.config import EngineConfig
from rollout_cli.engine.control import EngineControl, RankOperations, SingleRank
from rollout_cli.engine.execution.attention import KVCache
from rollout_cli.engine.execution.linear_state import LinearStatePool
from rollout_cli.engine.execution.model_runner import ModelRunner
from rollout_cli.engine.execution.routing_capture import RoutingCapture
from rollout_cli.engine.memory.cache_split import hybrid_pool_sizes
from rollout_cli.engine.memory.kv_sizing import (kv_heads_here, kv_pool_tokens, profile_activation_bytes,
                                                 run_largest_step)
from rollout_cli.engine.memory.memory_saver import MemorySaver
from rollout_cli.engine.multimodal import model_cache_key, prompt_layout
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.mtp_drafts import MTPDrafter
from rollout_cli.engine.scheduling.request import Request
from rollout_cli.engine.scheduling.request_maker import RequestMaker, sample_slices
from rollout_cli.engine.scheduling.scheduler import Scheduler
from rollout_cli.engine.scheduling.sibling_drafts import SiblingDrafter
from rollout_cli.engine.step_loop import StepLoop
from rollout_cli.engine.tensor_parallel import TensorParallelRanks, TensorParallelRunner, min_over_ranks
from rollout_cli.engine.tokenizer import checkpoint_eos_token_ids, load_tokenizer
from rollout_cli.engine.trajectory import PartialSample, PromptInput, Score, ScoreInput, Trajectory
from rollout_cli.errors import RolloutError
from rollout_cli.io.prompt_encoding import InvalidPrompt, encode_prompt
from rollout_cli.models.build import (build_model, load_model_config, model_positions, resolve_attention_backend,
                                      resolve_device, resolve_dtype, resolve_max_model_len)
from rollout_cli.models.fp8 import checkpoint_is_fp8
from rollout_cli.models.hub import resolve_engine_config, resolve_model
from rollout_cli.models.layers import enable_batch_invariant_kernels, enable_triton_kernels
from rollout_cli.models.llama import head_dim_of
from rollout_cli.models.tensor_parallel import init_tensor_parallel
from rollout_cli.models.tensor_parallel_support import check_tensor_parallel
from rollout_kernels.kv_fp8_ref import KV_FP8_DTYPE


class Engine:
    """Python API under the CLI.

        from rollout_cli import Engine, SamplingParams
        engine = Engine(model="recipes/example_model")
        results = engine.generate(["What is 2 + 3?"], SamplingParams(n=4, max_new_tokens=32))
    """

    def __init__(self, model: str | EngineConfig, **options):
        config = model if isinstance(model, EngineConfig) else EngineConfig(model=model, **options)
        self.config = resolve_engine_config(config)  # a hub id -> its snapshot directory (no-op once resolved)
        cfg = self.config
        self.hf_config = load_model_config(cfg.model)
        if cfg.quantization is None and checkpoint_is_fp8(self.hf_config):  # the hub's *-FP8 checkpoints
            self.config = cfg = _as_fp8_checkpoint(cfg)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.kv_dtype = self.dtype if cfg.kv_cache_dtype == "auto" else KV_FP8_DTYPE  # the KV pool's elements
        self.max_model_len = resolve_max_model_len(self.hf_config, cfg.max_model_len)
        self.attention_backend = resolve_attention_backend(cfg.attention_backend, self.device, cfg.deterministic,
                                                           cfg.tensor_parallel_size)
        self.tokenizer = load_tokenizer(cfg.model)
        self.tp = None  # models.tensor_parallel.TensorParallelGroup under --tp N > 1
        if cfg.tensor_parallel_size > 1:
            check_tensor_parallel(self.hf_config, cfg.tensor_parallel_size)
            self.tp = init_tensor_parallel(cfg.tensor_parallel_size, self.device)
        self.memory = MemorySaver(self.device, cfg.weights_cpu_backup)
        with self.memory.region("weights"):
            self.model = build_model(cfg.model, self.hf_config, self.device, self.dtype,
                                     max_positions=self.max_model_len, load_format=cfg.load_format,
                                     quantization=cfg.quantization, mtp=cfg.speculative == "mtp")
        self.memory.keep_only_parameters(self.model)
        if self.attention_backend == "triton":
            enable_triton_kernels(self.model)
            if cfg.deterministic:
                enable_batch_invariant_kernels(self.model)
        self.weight_version = cfg.weight_version
        self.hold_requested = False  # a pause that may change the weights (pause keep): the step in flight ends first
        self.step_in_flight = False  # True while on_step runs with a launched step not yet post-processed
        self._build_cache()
        eos = checkpoint_eos_token_ids(cfg.model, self.hf_config, self.tokenizer)
        self.requests = RequestMaker(self.hf_config.vocab_size, eos, self.max_model_len, model_positions(self.hf_config)[0],
                                     self.tokenizer)  # the tokenizer spells tokens as bytes for stop strings
        self.routing = RoutingCapture()  # off until enable_routing_capture
        self.weight_update_groups = {}  # group name -> engine.weight_group.WeightGroup
        # the control API; tensor parallelism is decided here, once: operations reach every rank or this one
        operations = RankOperations(self, rank=0 if self.tp is None else self.tp.rank)
        self.control = EngineControl(self, SingleRank(operations) if self.tp is None
                                     else TensorParallelRanks(self.tp, operations))

    def _build_cache(self) -> None:
        cfg, hf = self.config, self.hf_config
        # hybrid models keep KV for their full-attention layers only, and a linear-state pool beside it
        num_layers = getattr(self.model, "num_kv_layers", hf.num_hidden_layers)
        num_kv_heads, head_dim = kv_heads_here(self.model, hf, self.tp), head_dim_of(hf)
        state_shape = getattr(self.model, "linear_state_shape", None)
        bytes_per_token = KVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, self.kv_dtype)
        activation = 0
        if self.device.type == "cuda" and cfg.kv_cache_tokens is None:
            activation = profile_activation_bytes(lambda: run_largest_step(self), self.device)
        sizes = dict(device=self.device, max_running=cfg.max_running, max_model_len=self.max_model_len,
                     kv_memory_fraction=cfg.kv_memory_fraction, kv_cache_tokens=cfg.kv_cache_tokens,
                     activation_bytes=activation)
        self.linear_states, state_slots = None, None
        if state_shape is None:
            num_slots = kv_pool_tokens(bytes_per_token=bytes_per_token, **sizes)
        else:
            num_slots, state_slots = hybrid_pool_sizes(
                kv_bytes_per_token=bytes_per_token, state_bytes_per_slot=state_shape.bytes_per_sequence,
                linear_state_memory_ratio=cfg.linear_state_memory_ratio,
                draft_states=cfg.num_draft_tokens if cfg.speculative is not None else 0, **sizes)
        if self.tp is not None:  # every rank needs the same slots: the scheduler on rank 0 hands them out
            num_slots = min_over_ranks(num_slots, self.tp)
            if state_slots is not None:
                state_slots = min_over_ranks(state_slots, self.tp)
        with self.memory.region("kv_cache"):  # the linear-attention states are cache memory too
            if state_shape is not None:
                self.linear_states = LinearStatePool(state_shape, state_slots, self.device)
            self.kv = KVCache(num_layers, num_slots, num_kv_heads, head_dim, self.kv_dtype, self.device)
        runner_class = ModelRunner if self.tp is None else TensorParallelRunner
        self.runner = runner_class(self.model, self.kv, cfg.max_running, self.max_model_len, self.device,
                                  self.attention_backend, self.linear_states, deterministic=cfg.deterministic,
                                  shared_prefix_attention=cfg.shared_prefix_attention and self.tp is None)
        self.scheduler = Scheduler(num_slots, cfg.max_running, cfg.max_batch_tokens, cfg.enable_prefix_cache,
                                   linear_state_slots=state_slots, admission_pacing=cfg.admission_pacing)
        self.set_speculation(cfg.speculative is not None)
        self.cuda_graph_capture_seconds = None
        # MoE and hybrids too (no kernel reads a tensor on the host; hybrids' state slots: a static buffer); --tp: eager
        if self.device.type == "cuda" and self.attention_backend == "triton" and cfg.cuda_graphs and self.tp is None:
            self.capture_decode_graphs()

    def capture_decode_graphs(self) -> None:
        """Decode and verify steps replay graphs from now on (CPU engines on Triton: graph_replay's stand-in)."""
        drafts = (self.config.num_draft_tokens or 0, self.config.speculative_max_batch)  # verify steps too
        self.cuda_graph_capture_seconds = self.runner.capture_cuda_graphs(min(self.config.max_running, 256), drafts)
        self.scheduler.pacing.price_eager_steps(self.runner.graphs.eager_over_replay)  # measured at capture
        if self.config.overlap_schedule:  # verify steps settled on the device: the next may be planned ahead
            self.scheduler.verify_ahead_rows = self.runner.graphs.ahead_rows()

    def enable_routing_capture(self) -> str:
        """Record every token's expert ids from now on; returns the routing dtype name ("uint8"/"int16").

        Allocates the routing pool next to the KV cache (one row per KV slot). Once on it stays on
        for the engine's lifetime, so every cached prefix has its routing; prefixes cached before
        (without routing) are dropped. A model without MoE layers is refused.
        """
        return self.routing.enable(self)

    def disable_routing_capture(self) -> None:
        """Stop recording expert ids (`rollout bench --capture-routing compare` alternates runs with and without).
        The pool is kept for the next enable_routing_capture, which empties the prefix cache again."""
        self.routing.disable(self)

    @property
    def routing_pool(self):
        """The engine.routing_pool.RoutingPool while routing capture is on, else None."""
        return self.routing.pool

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a sample (config.json, generation_config.json, else the tokenizer's)."""
        return self.requests.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.requests.eos_token_ids = frozenset(ids)

    @property
    def cache_pools(self) -> list:
        """The pools in cache memory (released with the `kv_cache` tag): KV, and a hybrid's linear-attention states."""
        return [self.kv] if self.linear_states is None else [self.kv, self.linear_states]

    @property
    def num_kv_slots(self) -> int:
        return self.kv.num_slots

    # ---- control (engine/control.py: the API the CLI and the daemon call too) ----------------

    def release_memory(self, tags=None) -> dict:
        """Free GPU memory for a trainer (tags: weights, kv_cache, cuda_graph; default all); every rank under --tp."""
        return self.control.release_memory(tags)

    def resume_memory(self, tags=None) -> dict:
        """Take released memory back; without --weights-cpu-backup new weights must be loaded before generating."""
        return self.control.resume_memory(tags)

    def reload_weights(self, path: str, version: str | None = None, revision: str | None = None) -> str:
        """Load the checkpoint in `path` (a directory, or a hub id at `revision`, fetched into the Hugging
        Face cache) into the live weights, checked first; returns the new weight version."""
        return self.control.reload_weights(resolve_model(path, revision, what="checkpoint").path, version)

    def set_deterministic(self, deterministic: bool) -> None:
        """Switch the on-policy mode of this loaded engine (`rollout bench --deterministic` times both modes
        in one run): kernels, attention, decode graphs; the prefix cache (the other mode's bits) is emptied."""
        if self.tp is not None:
            raise RolloutError("switching --deterministic on a loaded engine runs with --tp 1")
        self.control.flush_cache()
        if self.attention_backend == "triton":
            enable_batch_invariant_kernels(self.model, deterministic)
        self.runner.set_deterministic(deterministic)
        self.config = dataclasses.replace(self.config, deterministic=deterministic)

    def set_speculation(self, on: bool) -> None:
        """--speculative drafts on or off between streams (`rollout bench` times both), a fresh drafter each time."""
        cfg, method = self.config, self.config.speculative if on else None  # (the state pool is sized for it)
        drafter = {"mtp": MTPDrafter, "siblings": SiblingDrafter}[method]() if method else None
        self.scheduler.enable_speculation(drafter, cfg.num_draft_tokens, cfg.speculative_max_batch, cfg.speculative_gate)

    def retract_running(self) -> int:
        """Before a weight update inside a held stream: every running request goes back to the queue
        with its response so far and no KV (computed by the old weights), to recompute it on the new
        ones and sample on. Needs no step in flight (hold_requested). -> how many were retracted."""
        if self.step_in_flight:
            raise RolloutError("a step is in flight: retract only where the stream holds with none (hold_requested)")
        return self.scheduler.retract_running()

    def flush_cache(self) -> None:
        """Drop every cached prefix."""
        self.control.flush_cache()

    def update_weights_from_tensor(self, named_tensors, version: str | None = None, partial: bool = False) -> str:
        """New weights from (name, tensor) pairs, a dict, a FlattenedBucket (engine.tensor_bucket) or the
        text of tensor_ipc.serialize_named_tensors (another process: CUDA IPC / shared memory).
        HF checkpoint names; all of them unless partial=True. Returns the new weight version."""
        return self.control.update_weights_from_tensor(named_tensors, version, partial)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str | None = None, timeout_seconds: float = 600.0) -> None:
        """Join the trainer's broadcast group as rank `rank_offset` (nccl on CUDA, gloo on the CPU by default);
        under --tp N rank r joins as rank_offset + r."""
        self.control.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                               backend, timeout_seconds)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list, group_name: str,
                                        version: str | None = None, partial: bool = False) -> str:
        """Receive tensors broadcast by the trainer's rank 0 (in `names` order); returns the new weight version."""
        return self.control.update_weights_from_distributed(names, dtypes, shapes, group_name, version, partial)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.control.destroy_weights_update_group(group_name)

    # ---- prompts -------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """A string, a list of chat messages or a list of token ids -> token ids."""
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt) and prompt:
            return list(prompt)
        if self.tokenizer is None:
            raise RolloutError(f"{self.config.model} has no tokenizer files; pass prompts as token ids")
        try:
            return encode_prompt(self.tokenizer, prompt)
        except InvalidPrompt as err:
            raise RolloutError(f"invalid prompt: {err}") from err

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- generation ----------------------------------------------------------

    def generate(self, prompts: list, params: SamplingParams | None = None) -> list[Trajectory]:
        """All samples of all prompts, ordered by (prompt_index, sample_index)."""
        params = params or SamplingParams()
        inputs = [PromptInput(i, self.encode(p)) for i, p in enumerate(prompts)]
        results = list(self.stream(inputs, params))
        return sorted(results, key=lambda t: (t.prompt_index, t.sample_index))

    def stream(self, prompts: Iterable[PromptInput | PartialSample], params: SamplingParams,
               skip: set[tuple[int, int]] | frozenset = frozenset(),
               on_step: Callable[[], None] | None = None) -> Iterator[Trajectory]:
        """Yield trajectories as they finish; (prompt_index, sample_index) pairs in `skip` are not run.
        A PartialSample is one sample continued from its response so far (the trajectory holds the
        whole response). A live source (the daemon's online requests) yields NO_PROMPT_YET when it has
        nothing now: the stream asks again at its next step, and ends once it has no work left."""
        self.memory.check_can_generate()
        try:
            sliced = sample_slices(prompts, params, 2 * self.config.max_running)  # as many as the loop queues
            yield from self._stream(sliced, lambda prompt: self._add_prompt(prompt, params, skip), on_step)
        finally:
            # A job that failed or was abandoned mid-way must not leak its requests into the next one.
            self.scheduler.abort_all()

    def score(self, samples: Iterable[ScoreInput], params: SamplingParams,
              on_step: Callable[[], None] | None = None, top_logprobs: int = 0) -> Iterator[Score]:
        """Teacher forcing: yield each sample's response logprobs as they are computed (prompt and
        response in one prefill, the trainer's way; chunked, cached and preempted like any prompt).
        `params` gives the temperature and logprobs mode the samples were drawn with. Under
        --deterministic the logprobs equal the sampled ones bit for bit. `top_logprobs` K > 0 adds the K
        most likely tokens and their logprobs at every response position (teacher scoring for distillation)."""
        if top_logprobs < 0:
            raise RolloutError(f"top_logprobs must be 0 (off) or more, got {top_logprobs}")
        self.memory.check_can_generate()
        empty: list[Score] = []  # nothing to score: no request, handed out in order of arrival

        def scorable():
            for sample in samples:
                if sample.response_token_ids:
                    yield sample
                else:
                    empty.append(Score(sample.prompt_index, sample.sample_index, [], dict(sample.passthrough),
                                       [] if top_logprobs else None))

        try:
            for score in self._stream(scorable(), lambda sample: self._add_scoring(sample, params, top_logprobs), on_step):
                yield from _drain(empty)
                yield score
            yield from _drain(empty)
        finally:
            self.scheduler.abort_all()

    def _stream(self, prompts, add, on_step) -> Iterator[Trajectory | Score]:
        """The step loop over `prompts` (engine/step_loop.py); `add` queues one as requests."""
        return StepLoop(self, add, on_step).run(prompts)

    def results_of(self, finished: list[tuple[Request, Any]]) -> list[Trajectory | Score]:
        """What the caller gets for finished requests (with their routing): trajectories, or scores."""
        return [self._score(request) if request.is_scoring else self.trajectory(request, routed)
                for request, routed in finished]

    def _score(self, request: Request) -> Score:
        top = None if request.scored_top is None else [list(zip(*pair)) for pair in request.scored_top]
        return Score(request.prompt_index, request.sample_index, list(request.scored_logprobs),
                     request.payload or {}, top)

    def _add_prompt(self, prompt: PromptInput | PartialSample, params: SamplingParams, skip) -> None:
        if isinstance(prompt, PartialSample):  # `skip` names samples of prompt rows, not these
            request = self.requests.partial(prompt, params)
            request.vision = self._vision_layout(prompt, "continued")
            self._queue([request])
            return
        vision = self._vision_layout(prompt)
        requests = self.requests.samples(prompt, params, skip)
        for request in requests:
            request.vision = vision
        self._queue(requests)

    def _queue(self, requests: list[Request]) -> None:
        """Hand one prompt's requests to the scheduler (and to the sibling drafter, which keeps the prompt's
        responses as draft sources until all of them have ended)."""
        if requests and self.scheduler.drafter is not None:
            self.scheduler.drafter.expect(requests[0], len(requests))  # the first is the others' group leader
        for request in requests:
            self.scheduler.add(request)

    def _vision_layout(self, prompt: PromptInput | PartialSample | ScoreInput, what: str = "generated"):
        """The multimodal layout of a prompt with images, None without (engine/multimodal.py)."""
        return prompt_layout(self.model, prompt, what, self.config.model)

    def cache_key(self, ids: list[int], images=()) -> list[int]:
        """The ids the prefix cache keys a prompt by (a pin must name them; engine/multimodal.py)."""
        return model_cache_key(self.model, ids, images)

    def _add_scoring(self, sample: ScoreInput, params: SamplingParams, top_logprobs: int) -> None:
        request = self.requests.scoring(sample, params, top_logprobs)
        # the layout spans prompt + response: a scoring request's "prompt" is both
        request.vision = self._vision_layout(dataclasses.replace(sample, prompt_token_ids=request.prompt_token_ids),
                                             "scored")
        self.scheduler.add(request)

    def trajectory(self, request: Request, routed_experts=None) -> Trajectory:
        return Trajectory(
            prompt_index=request.prompt_index,
            sample_index=request.sample_index,
            prompt_token_ids=request.prompt_token_ids,
            response_token_ids=request.output_token_ids,
            response_logprobs=request.output_logprobs,
            **request.per_token_outputs(),  # response_top_logprobs, response_sampling_mask
            response_text=request.text(self.decode),  # cut at its stop rule (scheduling/stop_text.py)
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            # the version that sampled the last token (the current one for an empty response)
            weight_version=request.version_spans[-1][1] if request.version_spans else self.weight_version,
            response_weight_versions=request.response_weight_versions(self.weight_version),
            passthrough=request.payload or {},
            ttft_seconds=(request.first_token_time or request.arrival_time) - request.arrival_time,
            cached_prompt_tokens=request.cached_prompt_tokens,
            routed_experts=routed_experts,
            image_grid_thw=[list(image.grid_thw) for image in request.images] if request.images else None,
        )


def _as_fp8_checkpoint(cfg: EngineConfig) -> EngineConfig:
    """An FP8 checkpoint runs as --quantization fp8 does, with its refusals worded for the checkpoint."""
    if cfg.deterministic:
        raise RolloutError(f"{cfg.model} is an FP8 checkpoint and --deterministic runs the model's dtype only "
                           "(no batch-invariant FP8 GEMM yet); use its bf16 checkpoint")
    if cfg.tensor_parallel_size > 1:
        raise RolloutError(f"{cfg.model} is an FP8 checkpoint, which runs on one GPU for now (--tp 1)")
    return dataclasses.replace(cfg, quantization="fp8")


def _drain(items: list):
    """Yield and remove every item of `items` (filled while another generator runs)."""
    while items:
        yield items.pop(0)
