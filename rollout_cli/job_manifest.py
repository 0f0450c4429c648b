"""What a job's manifest records: the run and engine settings, the end-of-run summary (merged over
data-parallel replicas), and the final status of a job that failed or was interrupted.

Separate from the job's loop (job.py): these are pure functions from the engine, the job and its
counters to manifest fields, plus the one manifest write that must not hide the job's own error.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_cli.errors import JobInterrupted, RolloutError
from rollout_cli.io.atomic_write import OutputWriteError
from rollout_cli.io.fingerprints import file_digest
from rollout_cli.io.output_dir import write_manifest

if TYPE_CHECKING:
    from rollout_cli.engine.engine import Engine
    from rollout_cli.engine.sampling_params import SamplingParams
    from rollout_cli.io.prompts import SkippedRow
    from rollout_cli.job import JobConfig, JobProgress


def job_settings(engine: Engine, job: JobConfig, params: SamplingParams) -> dict:
    """The run's settings as the manifest records them (--resume compares them: job_resume.py)."""
    return {
        "model": engine.config.model,
        # a hub id's id, revision and commit (None: a local directory): which weights ran, by name
        "model_source": engine.config.model_source and engine.config.model_source.as_dict(),
        "data": job.data,
        "prompt_key": job.prompt_key,
        "image_key": job.image_key,
        "limit": job.limit,
        "sampling": dataclasses.asdict(params),
        "capture_routing": job.capture_routing,
        # a run resumed in the other mode would mix on-policy rows with batch-dependent ones
        "deterministic": engine.config.deterministic,
        # fp8 and bf16 weights are two policies: a resume in the other one would mix them
        "quantization": engine.config.quantization,
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        # float32 and bf16 logprobs of one policy differ (1e-3 on the example model); the model length
        # decides which samples end by "length"
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_model_len": engine.max_model_len,
        # multi-turn episodes: another environment or turn limit makes other rows
        "env": job.env and {"file": file_digest(Path(job.env)), "max_turns": job.max_turns},
    }


def final_state(failure: BaseException | None, close_error: OutputWriteError | None) -> tuple[str, str | None]:
    """(manifest status, error line) of a job that ended with `failure` (None: it completed).

    interrupted: --resume completes it (a signal, the daemon's abort, a full disk); failed: the error
    needs a fix first. Never `running`: that is left only by a process killed outright.
    """
    if failure is None:
        return "complete", None
    if isinstance(failure, OutputWriteError):
        return ("interrupted" if failure.disk_full else "failed"), str(failure)
    error = str(close_error) if close_error is not None else None  # e.g. the disk filled while Ctrl-C flushed
    if isinstance(failure, (KeyboardInterrupt, JobInterrupted)):
        return "interrupted", error
    if isinstance(failure, RolloutError):
        return "failed", str(failure)
    text = str(failure).strip().splitlines()
    return "failed", f"{type(failure).__name__}: {text[0]}" if text else type(failure).__name__


def write_final_manifest(out: str, manifest: dict, failure: BaseException | None) -> None:
    """Write the manifest; on a failure path, a manifest write that fails too (the disk is still full)
    must not hide the first error, which is what the user sees."""
    try:
        write_manifest(out, manifest)
    except OutputWriteError:
        if failure is None:
            raise


def merge_summaries(summaries: list[dict]) -> dict:
    """One manifest summary from every replica's (each counted its own prompts)."""
    if len(summaries) == 1:  # one process: its own summary, rates as it measured them
        return summaries[0]
    merged = dict(summaries[0])
    for key in ("prompts", "prompts_done", "trajectories", "trajectories_this_run", "output_tokens_this_run",
                "preemptions", "prompt_tokens", "cached_prompt_tokens"):
        merged[key] = sum(s[key] for s in summaries)
    reasons: Counter[str] = Counter()
    for s in summaries:
        reasons.update(s["finish_reasons_this_run"])
    merged["finish_reasons_this_run"] = dict(reasons)
    merged["status"] = "complete" if all(s["status"] == "complete" for s in summaries) else "interrupted"
    merged["wall_seconds"] = max(s["wall_seconds"] for s in summaries)
    merged["output_tokens_per_s"] = round(merged["output_tokens_this_run"] / max(merged["wall_seconds"], 1e-9), 1)
    tokens = merged["prompt_tokens"]
    merged["prefix_hit_rate"] = round(merged["cached_prompt_tokens"] / tokens, 4) if tokens else 0.0
    merged["skipped_rows"] = summaries[0]["skipped_rows"]  # every replica validated the whole file
    if "episodes" in merged:  # --env: each replica ran its own prompts' episodes
        episodes = {key: sum(s["episodes"][key] for s in summaries)
                    for key in ("turns", "turn_prompt_tokens", "turn_cached_tokens")}
        tokens = episodes["turn_prompt_tokens"]
        episodes["prefix_hit_rate"] = round(episodes["turn_cached_tokens"] / tokens, 4) if tokens else 0.0
        episodes["episode_rows_held_for_kv"] = sum(s["episodes"]["episode_rows_held_for_kv"] for s in summaries)
        episodes["peak_open_episodes"] = max(s["episodes"]["peak_open_episodes"] for s in summaries)  # one replica's
        merged["episodes"] = episodes
    return merged


def engine_settings(engine: Engine) -> dict:
    """The engine's settings, recorded in the manifest for the record (--resume does not compare them)."""
    cfg = engine.config
    return {
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_model_len": engine.max_model_len,
        "max_batch_tokens": cfg.max_batch_tokens,
        "max_running": cfg.max_running,
        "kv_cache_tokens": engine.num_kv_slots - 1,
        "enable_prefix_cache": cfg.enable_prefix_cache,
        "admission_pacing": cfg.admission_pacing,
        "shared_prefix_attention": engine.runner.shared_prefix_attention,
        "tensor_parallel": cfg.tensor_parallel_size,
        "attention_backend": engine.attention_backend,
        "speculative": cfg.speculative and {"method": cfg.speculative, "num_draft_tokens": cfg.num_draft_tokens,
                                             "max_batch": cfg.speculative_max_batch, "gate": cfg.speculative_gate},
    }


def job_summary(engine, progress: JobProgress, writer, finish_reasons, skipped: list[SkippedRow], before, status) -> dict:
    stats = engine.scheduler.stats
    prompt_tokens = stats.prompt_tokens - before.prompt_tokens
    cached = stats.cached_prompt_tokens - before.cached_prompt_tokens
    wall = time.monotonic() - progress.started
    return {
        "status": status,
        "prompts": progress.prompts_total,
        "prompts_done": progress.prompts_done,
        "trajectories": progress.trajectories,
        "trajectories_this_run": writer.rows_written,
        "output_tokens_this_run": progress.output_tokens,
        "finish_reasons_this_run": dict(finish_reasons),
        "prefix_hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "preemptions": stats.preemptions - before.preemptions,
        "wall_seconds": round(wall, 3),
        "output_tokens_per_s": round(progress.output_tokens / max(wall, 1e-9), 1),
        "skipped_rows": [dataclasses.asdict(s) for s in skipped],
        **_speculation_summary(stats, before),
    }


def _speculation_summary(stats, before) -> dict:
    """With --speculative: the drafts verified this run and the tokens a verifying request gained a step."""
    steps = stats.verify_steps - before.verify_steps
    gated = {name: getattr(stats, name) - getattr(before, name) for name in ("gate_drafting_steps", "gate_plain_steps")}
    if not steps and not any(gated.values()):
        return {}
    accepted = stats.accepted_draft_tokens - before.accepted_draft_tokens
    return {"speculation": {"verify_steps": steps, "draft_tokens": stats.draft_tokens - before.draft_tokens,
                            "accepted_draft_tokens": accepted,
                            "acceptance_length": round(1 + accepted / steps, 3) if steps else None,
                            **(gated if any(gated.values()) else {})}}
