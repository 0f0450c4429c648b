"""`rollout bench`: throughput of the engine on a synthetic or given workload.

Reports output and total tokens/s, time to first token, peak memory, and how close decode came to
the hardware limits (bench_limits.py: memory bandwidth, and on a GPU the roofline).

`--baseline hf` runs HF transformers `generate` on the same model and prompts
in the same process first (so its memory is gone before the engine sizes its
KV cache) and reports the ratio.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from dataclasses import dataclass

import torch

from rollout_cli.engine.engine import Engine, PromptInput
from rollout_cli.engine.memory.memory_saver import sync_device
from rollout_cli.engine.sampling_params import SamplingParams, check_seed
from rollout_cli.bench_episodes import SyntheticEnv, episode_report
from rollout_cli.episodes import EpisodeRunner
from rollout_cli.bench_vision import (add_images, hf_image_kwargs, hf_model_class, vision_report,
                                      without_vision_tokens)
from rollout_cli.errors import RolloutError


CAPTURE_MODES = ("off", "on", "compare")


@dataclass(frozen=True)
class BenchConfig:
    """The workload of one benchmark."""

    num_prompts: int = 256
    """Prompts to generate for (each with n samples)."""
    input_len: int = 256
    """Prompt length in tokens (random ids) when no range is given."""
    output_len: int = 512
    """Response length in tokens (eos ignored) when no range is given."""
    input_len_range: tuple[int, int] | None = None
    """Uniform prompt lengths in [LO, HI], seeded."""
    output_len_range: tuple[int, int] | None = None
    """Uniform response lengths in [LO, HI], seeded."""
    n: int = 1
    """Samples per prompt (a GRPO group shares its prompt through the prefix cache)."""
    temperature: float = 1.0
    """Sampling temperature."""
    seed: int = 0
    """Seeds the workload and the sampler; in [0, 2^64)."""
    baseline: str = "none"
    """none or hf (transformers generate on the same model and prompts)."""
    baseline_batch: int = 256
    """Batch size of the HF baseline."""
    baseline_time_limit: float = 0.0
    """Seconds after which the HF baseline stops (0: none); it then reports an upper bound."""
    capture_routing: str = "off"
    """MoE models: off, on (the timed run records every token's experts), or compare (a run
    without, then one with, on the same engine: the cost of routing capture)."""
    turns: int = 1
    """Model turns per sample: above 1, every sample is a multi-turn episode (rollout run --env) with a
    synthetic environment answering each turn with observation_len tokens."""
    observation_len: int = 32
    """With turns > 1: the environment's tokens between two model turns."""
    long_tail: float | None = None
    """A long-tailed output length: this share of the prompts run to output_len, the others to lengths
    uniform in [output_len / 16, output_len / 4] (seeded)."""
    carry_over: int = 0
    """Above 0: also compare waiting for every sample with carrying the unfinished over, on this many
    rounds of the workload (bench_long_tail.py)."""
    carry_at: float = 0.9
    """With carry_over: the share of a round's samples after which the rest are carried over."""
    images: int = 0
    """Vision-language models: images before each prompt's text, each prompt its own (bench_vision.py)."""
    image_size: tuple[int, int] = (448, 448)
    """With images: the width and height of each image, in pixels (multiples of patch x merge)."""

    def __post_init__(self):
        if self.baseline not in ("none", "hf"):
            raise RolloutError(f"unknown --baseline {self.baseline!r}; choose none or hf")
        if self.capture_routing not in CAPTURE_MODES:
            raise RolloutError(f"unknown --capture-routing {self.capture_routing!r}; choose {', '.join(CAPTURE_MODES)}")
        for name in ("input_len_range", "output_len_range"):
            value = getattr(self, name)
            if value is not None and not 1 <= value[0] <= value[1]:
                raise RolloutError(f"--{name.replace('_', '-')} needs 1 <= LO <= HI")
        if min(self.num_prompts, self.input_len, self.output_len, self.n, self.turns, self.observation_len) < 1:
            raise RolloutError("--num-prompts, --input-len, --output-len, --n, --turns and --observation-len "
                               "must be at least 1")
        if self.long_tail is not None and not 0 < self.long_tail <= 1:
            raise RolloutError("--long-tail is a share of the prompts: in (0, 1]")
        if self.long_tail is not None and self.output_len_range is not None:
            raise RolloutError("--long-tail and --output-len-range each set the output lengths; give one")
        if self.carry_over < 0 or not 0 < self.carry_at < 1:
            raise RolloutError("--carry-over needs a round count >= 0 and --carry-at in (0, 1)")
        check_seed(self.seed)  # before the model loads, not in run_engine after the HF baseline
        if self.images < 0:
            raise RolloutError("--images is a count per prompt: 0 or more")
        if self.baseline_batch < 1:  # range() refuses a 0 step; a negative one yields no batch at all
            raise RolloutError(f"--baseline-batch must be at least 1, not {self.baseline_batch}; give a batch size")
        if not 0 <= self.baseline_time_limit < math.inf:  # also false for nan
            raise RolloutError(f"--baseline-time-limit is seconds, not {self.baseline_time_limit}; "
                               "give 0 (never stop) or more")
        if self.images and (self.turns > 1 or self.carry_over):
            raise RolloutError("--images runs single-turn prompts for now; drop --turns or --carry-over")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    images: list[tuple] | None = None  # per prompt, its ImageInputs (--images); None: text only


def make_workload(cfg: BenchConfig, vocab_size: int, data_prompts: list[list[int]] | None = None,
                  hf_config=None, pin_images: bool = False) -> Workload:
    """The prompts (random ids, or --data's) and output lengths; with cfg.images, images before each
    prompt (`hf_config` says where: bench_vision.add_images; pin_images for a CUDA engine)."""
    workload = _text_workload(cfg, vocab_size, data_prompts)
    if cfg.images:
        return add_images(workload, cfg, hf_config, pin_images)
    if data_prompts is None and getattr(hf_config, "vision_config", None) is not None:  # random ids, no images
        return dataclasses.replace(workload, prompts=without_vision_tokens(workload.prompts, hf_config))
    return workload


def _text_workload(cfg: BenchConfig, vocab_size: int, data_prompts: list[list[int]] | None) -> Workload:
    rng = random.Random(cfg.seed)

    def length(fixed: int, span: tuple[int, int] | None) -> int:
        return rng.randint(*span) if span else fixed

    if data_prompts is not None:
        prompts = data_prompts[: cfg.num_prompts]
    else:
        prompts = [[rng.randrange(vocab_size) for _ in range(length(cfg.input_len, cfg.input_len_range))]
                   for _ in range(cfg.num_prompts)]
    if cfg.long_tail is not None:
        short = (max(1, cfg.output_len // 16), max(1, cfg.output_len // 4))
        output_lens = [cfg.output_len if rng.random() < cfg.long_tail else rng.randint(*short) for _ in prompts]
    else:
        output_lens = [length(cfg.output_len, cfg.output_len_range) for _ in prompts]
    return Workload(prompts, output_lens)


_HF_WARMUP_TOKENS = 8


def run_hf_baseline(model_dir: str, load_format: str, device: torch.device, dtype: torch.dtype,
                    workload: Workload, cfg: BenchConfig) -> dict:
    """transformers `generate` over the same prompts (and images), left-padded batches, eos ignored."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    auto_class = hf_model_class(config)
    if load_format == "dummy":
        with torch.device(device):  # random init on the GPU: minutes faster for 8B shapes
            model = auto_class.from_config(config, dtype=dtype)
    else:
        model = auto_class.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    experts = _fastest_experts_implementation(model)
    images = workload.images or [()] * len(workload.prompts)
    requests = [(p, o, i) for p, o, i in zip(workload.prompts, workload.output_lens, images) for _ in range(cfg.n)]
    useful_tokens = sum(o for _, o, _ in requests)

    sampling = dict(do_sample=True, temperature=cfg.temperature, top_p=1.0, top_k=0) if cfg.temperature > 0 \
        else dict(do_sample=False)
    clock = _StepClock(cfg.baseline_time_limit)

    def generate(batch) -> int:
        """Runs one left-padded batch; returns the decode steps it made."""
        width = max(len(p) for p, _, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _, _ in batch], device=device)
        new = max(o for _, o, _ in batch)
        vision = hf_image_kwargs([i for _, _, i in batch], ids, getattr(config, "image_token_id", -1))
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                             stopping_criteria=clock.criteria(), **sampling, **vision)
        return out.shape[1] - width

    # Warm-up (kernel selection, allocator, compile caches) needs a few steps, not the whole output: a
    # full-length warm-up at a 2048-token output cost as much as the timed run itself.
    generate([(p, min(o, _HF_WARMUP_TOKENS), i) for p, o, i in requests[:2]])
    sync_device(device)
    clock.start()
    batches = [requests[i : i + cfg.baseline_batch] for i in range(0, len(requests), cfg.baseline_batch)]
    done_tokens, remaining_steps = 0, 0
    for batch in batches:
        if clock.stopped:  # not started: each of its steps costs at least the fastest step seen
            remaining_steps += max(o for _, o, _ in batch)
            continue
        steps = generate(batch)
        done_tokens += sum(min(o, steps) for _, o, _ in batch)
        remaining_steps += max(o for _, o, _ in batch) - steps
    sync_device(device)
    seconds = time.monotonic() - clock.started
    result = {"batch": cfg.baseline_batch, "experts_implementation": experts, "seconds": seconds}
    if remaining_steps == 0:
        result.update(output_tokens_per_s=useful_tokens / seconds, complete=True)
    else:
        # Stopped at the time limit. A step never gets cheaper as the context grows, so the whole run
        # takes at least the time spent + every step left x the fastest decode step measured: HF's
        # throughput is at most useful tokens / that (our speedup at least the ratio to it).
        at_least = seconds + remaining_steps * clock.fastest_step
        result.update(output_tokens_per_s=useful_tokens / at_least, complete=False, tokens_done=done_tokens,
                      steps_left=remaining_steps, fastest_step_s=clock.fastest_step, seconds_at_least=at_least)
    model.to("meta")  # drop the weights before the engine sizes its KV cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


class _StepClock:
    """Times HF generate's decode steps through a stopping criterion (called once per step, after the
    step's tokens are on the host) and stops generation once the time limit is spent."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.started = self._last = time.monotonic()
        self.fastest_step = float("inf")
        self.stopped = False

    def start(self) -> None:
        self.started = self._last = time.monotonic()
        self.fastest_step, self.stopped = float("inf"), False

    def criteria(self):
        from transformers import StoppingCriteria, StoppingCriteriaList

        clock = self

        class _Clock(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return clock.tick(input_ids)

        self._last = time.monotonic()  # the first call comes after the prefill step: not a decode step
        self._first = True
        return StoppingCriteriaList([_Clock()])

    def tick(self, input_ids: torch.Tensor) -> torch.Tensor:
        now = time.monotonic()
        if not self._first:
            self.fastest_step = min(self.fastest_step, now - self._last)
        self._first, self._last = False, now
        # stop only once a decode step was timed: the bound needs one
        self.stopped = self.stopped or (self.limit_s > 0 and now - self.started > self.limit_s
                                        and self.fastest_step < float("inf"))
        return torch.full((input_ids.shape[0],), self.stopped, dtype=torch.bool, device=input_ids.device)


def _fastest_experts_implementation(model) -> str | None:
    """MoE models: switch transformers to its grouped-GEMM experts (torch._grouped_mm), what a user
    after speed picks, instead of a Python loop over experts; returns the one in use (None: dense)."""
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if can_set is None or not can_set() or not hasattr(model, "set_experts_implementation"):
        return None
    try:
        model.set_experts_implementation("grouped_mm")
    except (ValueError, ImportError, RuntimeError):  # e.g. a GPU without grouped GEMM: keep the default
        pass
    return getattr(model.config, "_experts_implementation", None)


def run_engine(engine: Engine, workload: Workload, cfg: BenchConfig, flops_per_s: float | None = None) -> dict:
    images = workload.images or [()] * len(workload.prompts)

    def inputs():
        for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
            params = SamplingParams(n=cfg.n, max_new_tokens=out_len, temperature=cfg.temperature,
                                    seed=cfg.seed, ignore_eos=True)
            yield PromptInput(i, prompt, params=params, images=images[i])

    # Warm-up on the workload's own prompts (two tokens each): Triton compiles for the prefill
    # shapes here, not inside the timed run; the prefix cache is emptied afterwards.
    warm = SamplingParams(max_new_tokens=2, ignore_eos=True)
    count = min(len(workload.prompts), engine.config.max_running)
    list(engine.stream([PromptInput(i, p, images=images[i]) for i, p in enumerate(workload.prompts[:count])], warm))
    if engine.scheduler.cache is not None:  # the warm-up prompt must not count as a prefix hit
        engine.scheduler.cache.reset()
    encoder = engine.runner.encoder_cache
    if encoder is not None:  # the timed run encodes its images itself, and its encoder steps are timed
        encoder.clear()
        encoder.timed, encoder.seconds, encoder.grids = True, 0.0, []
    stats_before = dataclasses.replace(engine.scheduler.stats)
    engine.scheduler.stats.peak_running = 0  # the timed run's own peak
    engine.runner.traffic = type(engine.runner.traffic)()
    engine.runner.time_decode_steps = engine.device.type == "cuda"
    engine.runner.count_distinct_context = True
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    sync_device(engine.device)
    episodes = None
    if cfg.turns > 1:
        observation = [random.Random(cfg.seed).randrange(engine.requests.vocab_size) for _ in range(cfg.observation_len)]
        episodes = EpisodeRunner(engine, lambda row: SyntheticEnv(observation), cfg.turns)
    start = time.monotonic()
    results, finished_at = [], []  # finished_at: seconds into the run when each sample came out
    for result in (engine if episodes is None else episodes).stream(inputs(), SamplingParams()):
        results.append(result)
        finished_at.append(time.monotonic() - start)
    sync_device(engine.device)
    seconds = time.monotonic() - start
    # the long tail: how long the last 10% of the samples kept the run going after 90% were out
    ninety = finished_at[max(0, math.ceil(0.9 * len(finished_at)) - 1)] if finished_at else 0.0
    engine.runner.time_decode_steps = engine.runner.count_distinct_context = False
    if encoder is not None:
        encoder.timed = False
    traffic = engine.runner.traffic
    stats = engine.scheduler.stats
    # an episode's response holds the environment's tokens too: count the model's
    out_tokens = sum(sum(r.episode["response_loss_mask"]) if r.episode else len(r.response_token_ids) for r in results)
    in_tokens = sum(len(r.prompt_token_ids) for r in results)
    ttfts = sorted(r.ttft_seconds for r in results)
    prompt_tokens = stats.prompt_tokens - stats_before.prompt_tokens
    return {
        "seconds": seconds,
        "requests": len(results),
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / seconds,
        "total_tokens_per_s": (out_tokens + in_tokens) / seconds,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
        "prefix_hit_rate": (stats.cached_prompt_tokens - stats_before.cached_prompt_tokens) / max(prompt_tokens, 1),
        "preemptions": stats.preemptions - stats_before.preemptions,
        "recomputed_tokens": stats.recomputed_tokens - stats_before.recomputed_tokens,
        "admission_held_steps": stats.admission_held_steps - stats_before.admission_held_steps,
        "eager_step_cost": engine.scheduler.pacing.cost,  # in decode steps: measured at graph capture
        "peak_running": stats.peak_running,
        "last_10pct_seconds": seconds - ninety,
        "kv_cache_tokens": engine.kv.num_slots - 1,  # slot 0 is padding
        "kv_cache_dtype": str(engine.kv.k.dtype).removeprefix("torch."),
        "peak_memory_gib": torch.cuda.max_memory_allocated(engine.device) / (1 << 30)
        if engine.device.type == "cuda" else None,
        # share of a graph-replayed decode step's wall time (schedule -> postprocess) the GPU sat idle
        "decode_gpu_idle_share": 1 - traffic.gpu_seconds / traffic.wall_seconds if traffic.wall_seconds else None,
        "decode_step_ms": 1e3 * traffic.wall_seconds / traffic.timed_steps if traffic.timed_steps else None,
        "decode_seconds": traffic.wall_seconds,  # the graph-replayed decode steps' wall time
        # host time per graph step not spent waiting for results: when it tops the GPU's step time,
        # the host is what the GPU waits for
        "decode_host_busy_ms": (1e3 * (traffic.wall_seconds - traffic.wait_seconds) / traffic.timed_steps
                                if traffic.timed_steps else None),
        "decode_gpu_ms": 1e3 * traffic.gpu_seconds / traffic.timed_steps if traffic.timed_steps else None,
        "prefill_steps": traffic.prefill_steps,
        "prefill_step_ms": 1e3 * traffic.prefill_wall_seconds / traffic.prefill_steps if traffic.prefill_steps else None,
        "prefill_step_max_ms": 1e3 * traffic.prefill_max_seconds,
        "cuda_graph_capture_s": engine.cuda_graph_capture_seconds,
        **({"episodes": episode_report(episodes, results)} if episodes is not None else {}),
        **(vision_report(engine, seconds, flops_per_s) if workload.images else {}),
        **({"acceptance_length": 1 + (stats.accepted_draft_tokens - stats_before.accepted_draft_tokens) / verify_steps,
            "verify_steps": verify_steps,
            "verify_ahead_steps": stats.verify_ahead_steps - stats_before.verify_ahead_steps}
           if (verify_steps := stats.verify_steps - stats_before.verify_steps) else {}),
        **({"gate_drafting_steps": stats.gate_drafting_steps - stats_before.gate_drafting_steps,
            "gate_plain_steps": stats.gate_plain_steps - stats_before.gate_plain_steps,
            "gate_busiest_bucket": engine.scheduler.draft_gate.busiest()}
           if engine.scheduler.draft_gate is not None else {}),
    }


def profile_decode(engine: Engine, workload: Workload, cfg: BenchConfig, steps: int = 32, rows: int = 15) -> str:
    """torch.profiler over a short run of the workload's first prompts: where step time goes."""
    from torch.profiler import ProfilerActivity, profile

    count = min(len(workload.prompts), engine.config.max_running)
    prompts = [PromptInput(i, p) for i, p in enumerate(workload.prompts[:count])]
    params = SamplingParams(max_new_tokens=steps, temperature=cfg.temperature, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        list(engine.stream(prompts, params))
        sync_device(engine.device)
    sort_by = "cuda_time_total" if engine.device.type == "cuda" else "cpu_time_total"
    averages = prof.key_averages()
    # the host's side too: a host-bound step shows in the operators' own CPU time, not in the kernels'
    return (averages.table(sort_by=sort_by, row_limit=rows) + "\nby the host's own time\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=rows))
