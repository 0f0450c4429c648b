"""One generation job: prompts Parquet in, trajectory shards and a manifest out.

Shared by the embedded `rollout run` and the daemon's /generate.
Order matters for "nothing written on bad input": every check that can fail
(output dir, prompt file, every prompt row) runs before OUT is created.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rollout_cli.data_parallel import ReplicaGroup
from rollout_cli.engine.engine import Engine
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.errors import JobInterrupted, RolloutError
from rollout_cli.io.fingerprints import checkpoint_change, checkpoint_fingerprint, data_change, data_fingerprint
from rollout_cli.io.prompts import PromptSource, SkippedRow
from rollout_cli.io.trajectories import (
    ROUTING_SUBDIR,
    TRAJECTORIES_SUBDIR,
    OutputWriteError,
    TrajectoryWriter,
    completed_pairs,
    create_output_dir,
    prepare_output_dir,
    read_manifest,
    trajectory_schema,
    write_manifest,
)
from rollout_cli.models.hub import source_change

# Manifest keys that must be equal for --resume to continue a run. The checkpoint, the prompt file and
# the weights are compared by content (the manifest's "fingerprints"), never by the paths as typed.
RESUME_KEYS = ("prompt_key", "limit", "sampling", "capture_routing", "deterministic")
# A manifest written before fingerprints were recorded: its paths are compared as typed, as they were then.
LEGACY_RESUME_KEYS = ("model", "data", *RESUME_KEYS)
# Debug knob (tests): "ROWS" or "ROWS:SIGNAL" (TERM, INT, KILL; default TERM). The job raises SIGNAL in
# itself at the first engine step after ROWS trajectories reached the writer, so a kill test lands at
# a known row count instead of racing a sleep or a poll against the engine.
DEBUG_SIGNAL_ENV = "ROLLOUT_DEBUG_SIGNAL_AFTER_ROWS"


@dataclass(frozen=True)
class JobConfig:
    """Where a job reads and writes, and how it treats bad rows."""

    data: str
    """Prompt Parquet file."""
    out: str
    """Output directory: OUT/trajectories/part-NNNNN.parquet and OUT/manifest.json."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, a list of chat messages, or token ids."""
    limit: int | None = None
    """Use only the first `limit` rows of the file."""
    resume: bool = False
    """Continue a run in a non-empty OUT: generate only the missing (prompt, sample) pairs."""
    skip_invalid: bool = False
    """Skip bad rows (listed in the manifest) instead of failing."""
    shard_rows: int = 1024
    """Rows per output shard."""
    flush_seconds: float = 10.0
    """A shard is also closed when its oldest row has waited this long (bounds what a kill loses)."""
    capture_routing: bool = False
    """MoE models: also write every token's expert ids to OUT/routing/part-NNNNN.parquet."""

    def __post_init__(self) -> None:
        # checked here, where the CLI and the daemon's /generate both build the job: before OUT exists
        if self.shard_rows < 1:
            raise RolloutError(f"--shard-rows must be at least 1, got {self.shard_rows}")
        if not self.flush_seconds >= 0:  # also refuses NaN
            raise RolloutError(f"--flush-seconds must be 0 or more, got {self.flush_seconds}; "
                               "0 writes every finished row at once")


@dataclass
class JobProgress:
    """Live counters, read by progress bars."""

    prompts_total: int = 0
    prompts_done: int = 0
    trajectories: int = 0
    output_tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / max(time.monotonic() - self.started, 1e-9)


def check_job_inputs(job: JobConfig, engine: Engine | None = None) -> PromptSource:
    """The checks before anything is written: OUT may be used, the prompt file opens, its columns fit the output.

    Cheap without an engine (the CLI calls it before the model loads); run_job calls it again with its
    engine, since OUT may have changed meanwhile (and the daemon never called it), and reads the rows
    from the source it returns: the prompt file is opened and checked once per call.
    """
    prepare_output_dir(job.out, job.resume)
    source = _prompt_source(job, engine)
    trajectory_schema(source.passthrough_schema)
    return source


def _prompt_source(job: JobConfig, engine: Engine | None) -> PromptSource:
    """The job's prompts; with an engine, rows are tokenized and held to what its RequestMaker admits."""
    if engine is None:
        return PromptSource(job.data, tokenizer=None, prompt_key=job.prompt_key, limit=job.limit)
    return PromptSource(job.data, engine.tokenizer, prompt_key=job.prompt_key, limit=job.limit,
                        max_prompt_len=engine.requests.max_prompt_len, skip_invalid=job.skip_invalid,
                        vocab_size=engine.requests.vocab_size)


def _settings(engine: Engine, job: JobConfig, params: SamplingParams) -> dict:
    return {
        "model": engine.config.model,
        # a hub id's id, revision and commit (None: a local directory): which weights ran, by name
        "model_source": engine.config.model_source and engine.config.model_source.as_dict(),
        "data": job.data,
        "prompt_key": job.prompt_key,
        "limit": job.limit,
        "sampling": dataclasses.asdict(params),
        "capture_routing": job.capture_routing,
        # a run resumed in the other mode would mix on-policy rows with batch-dependent ones
        "deterministic": engine.config.deterministic,
    }


def _fingerprints(engine: Engine, job: JobConfig, weights_path: str | None) -> dict:
    """What --resume compares: the checkpoint and prompt file by content, and the weights the engine holds."""
    checkpoint = checkpoint_fingerprint(engine.config.model)
    return {"checkpoint": checkpoint, "data": data_fingerprint(job.data),
            "weights": _weights(engine, checkpoint, weights_path)}


def _weights(engine: Engine, checkpoint: dict, weights_path: str | None) -> dict:
    """The weights the engine holds now: their version, where they came from, and that directory's digest.

    `weights_path` is the daemon's last reload (None: the weights loaded at start, from the model
    directory). Weights pushed from tensors have no directory: their version alone tells them apart.
    """
    model = engine.config.model
    from_start = weights_path is None or os.path.realpath(weights_path) == os.path.realpath(model)
    if from_start and engine.config.load_format == "dummy":
        source, digest = "random weights (--load-format dummy)", None
    elif from_start:
        source, digest = model, checkpoint["digest"]
    else:
        source = weights_path
        digest = checkpoint_fingerprint(weights_path)["digest"] if os.path.isdir(weights_path) else None
    return {"version": engine.weight_version, "source": source, "checkpoint": digest}


def _check_resume(job: JobConfig, settings: dict, fingerprints: dict) -> None:
    """Refuse, in one line that says what changed, a --resume that would mix two jobs in OUT."""
    previous = read_manifest(job.out)
    if previous is None:
        return
    change = source_change(previous.get("model_source"), settings["model_source"])
    if change is not None:  # before the content check: the commits say more than "model.safetensors changed"
        hub = previous["model_source"]
        raise RolloutError(f"--resume: {job.out} was made from another hub commit: {change}; resume with --model "
                           f"{hub['hub_id']} --revision {hub['commit']}, or choose another --out")
    recorded = previous.get("fingerprints")
    if recorded is not None:
        change = checkpoint_change(recorded["checkpoint"], fingerprints["checkpoint"])
        if change is not None:
            raise RolloutError(
                f"--resume: {job.out} was made with another checkpoint ({previous.get('model')}): {change}; "
                "resume with that checkpoint, or choose another --out"
            )
    version = fingerprints["weights"]["version"]
    if "weight_version" in previous and previous["weight_version"] != version:
        raise RolloutError(
            f"--resume: the run was made at weight version {previous['weight_version']} and the engine has "
            f"weight version {version}; resuming would mix two weight versions in {job.out}: resume with the "
            f"run's weights at version {previous['weight_version']}, or choose another --out"
        )
    if recorded is not None:
        _check_same_weights(job, recorded["weights"], fingerprints["weights"])
        change = data_change(recorded["data"], fingerprints["data"])
        if change is not None:
            raise RolloutError(
                f"--resume: the prompt file {job.data} changed since {job.out} was made from it: {change}; "
                "restore that file, or choose another --out"
            )
    for key in RESUME_KEYS if recorded is not None else LEGACY_RESUME_KEYS:
        if key in previous and previous[key] != settings[key]:
            name, old, new = _difference(key, previous[key], settings[key])
            raise RolloutError(
                f"--resume: {job.out} was made with {name}={old!r}, this run has {new!r}; "
                "use the same settings to resume, or choose another --out"
            )


def _difference(key: str, old, new) -> tuple[str, object, object]:
    """("sampling.seed", 3, 4) rather than two whole sampling dicts: the line names what differs."""
    if isinstance(old, dict) and isinstance(new, dict):
        for name in sorted(old.keys() | new.keys()):
            if old.get(name) != new.get(name):
                return f"{key}.{name}", old.get(name), new.get(name)
    return key, old, new


def _check_same_weights(job: JobConfig, previous: dict, current: dict) -> None:
    """Same version, other weights: e.g. a daemon reloaded another directory under the same version."""
    if (previous.get("checkpoint") or previous.get("source")) == (current["checkpoint"] or current["source"]):
        return
    raise RolloutError(
        f"--resume: {job.out} was made with the weights of {previous.get('source')} (version "
        f"{previous.get('version')}), the engine holds those of {current['source']}; resuming would mix two "
        "weight sets: load the run's weights, or choose another --out"
    )


def run_job(
    engine: Engine,
    params: SamplingParams,
    job: JobConfig,
    on_progress: Callable[[JobProgress], None] | None = None,
    group: ReplicaGroup = ReplicaGroup(),
    weights_path: str | None = None,
) -> dict:
    """Generate every missing trajectory of the job; return the final manifest.

    In a data-parallel `group` (rollout_cli.data_parallel; default: this process alone) this replica
    generates only the prompts it owns; replica 0 prepares OUT and writes the manifest, with every
    replica's counts.
    `weights_path`: where the engine's weights were last loaded from when that is not its model
    directory (the daemon after a reload); --resume refuses to mix weights.
    """
    leader = group.is_leader
    source = check_job_inputs(job, engine) if leader else _prompt_source(job, engine)
    skipped = source.validate()
    # before OUT is created: a dense model is refused with nothing written
    routing_dtype = engine.enable_routing_capture() if job.capture_routing else None
    settings = _settings(engine, job, params)
    manifest = dict(settings, status="running", weight_version=engine.weight_version,
                    engine=_engine_settings(engine))
    if not group.alone:
        manifest["data_parallel"] = group.size
    if routing_dtype:
        manifest["routing"] = {"dtype": routing_dtype, "num_layers": len(engine.model.moe_layers),
                               "top_k": engine.model.top_k, "num_experts": engine.model.num_experts}
    done: set[tuple[int, int]] = set()
    if leader:  # one process cleans and creates OUT; the other replicas start once it did
        manifest["fingerprints"] = _fingerprints(engine, job, weights_path)
        if job.resume:
            _check_resume(job, settings, manifest["fingerprints"])
            done = completed_pairs(job.out)
        create_output_dir(job.out, (TRAJECTORIES_SUBDIR, ROUTING_SUBDIR) if routing_dtype else (TRAJECTORIES_SUBDIR,))
        write_manifest(job.out, manifest)
    group.barrier()
    if not leader and job.resume:
        done = completed_pairs(job.out, clean=False)  # replica 0 may be writing already
    owned = group.owns

    already_done = sum(owned(p) for p, _ in done)
    progress = JobProgress(prompts_total=sum(map(owned, source.valid_indices())), trajectories=already_done)
    if on_progress is not None:
        on_progress(progress)  # every row is valid: the bar may start
    remaining: dict[int, int] = {}  # prompt_index -> samples still to finish

    def pending_prompts() -> Iterator[PromptInput]:
        for row in source:
            if not owned(row.prompt_index):
                continue
            missing = sum((row.prompt_index, s) not in done for s in range(params.n))
            if missing == 0:
                progress.prompts_done += 1
                continue
            remaining[row.prompt_index] = missing
            yield row

    writer = TrajectoryWriter(job.out, source.passthrough_schema, job.shard_rows, job.flush_seconds,
                              routing_dtype=routing_dtype,
                              routing_shape=(len(engine.model.moe_layers), engine.model.top_k) if routing_dtype else (0, 0),
                              replica=None if group.alone else group.rank)
    finish_reasons: Counter[str] = Counter()
    stats_before = dataclasses.replace(engine.scheduler.stats)
    failure: BaseException | None = None
    try:
        for trajectory in engine.stream(pending_prompts(), params, skip=done, on_step=_step_hook(writer)):
            writer.add(trajectory.to_row(), trajectory.routed_experts)
            finish_reasons[trajectory.finish_reason] += 1
            progress.trajectories += 1
            progress.output_tokens += len(trajectory.response_token_ids)
            remaining[trajectory.prompt_index] -= 1
            if remaining[trajectory.prompt_index] == 0:
                del remaining[trajectory.prompt_index]
                progress.prompts_done += 1
            if on_progress is not None:
                on_progress(progress)
    except BaseException as err:  # noqa: BLE001 - re-raised below, once the manifest has its final state
        failure = err
    # finished rows survive any exception, Ctrl-C and SIGTERM included
    close_error = _close(writer)
    failure = failure or close_error
    status, error = _final_state(failure, close_error)
    # count what is on disk: a signal between writer.add and the counter update must not skew it
    progress.trajectories = already_done + writer.rows_written
    summary = _summary(engine, progress, writer, finish_reasons, skipped, stats_before, status)
    if error is not None:
        summary["error"] = error
    if failure is not None:
        if leader:  # alone, its counts are the job's; the replicas' counts are gathered only when all finish
            manifest.update(summary if group.alone else {"status": status, **({"error": error} if error else {})})
            _write_final_manifest(job.out, manifest, failure)
        raise failure
    # a replica that failed above never gets here; torchrun stops the others
    manifest.update(_merge_summaries(group.gather(summary)))
    if leader:
        write_manifest(job.out, manifest)
    return manifest


def _step_hook(writer: TrajectoryWriter) -> Callable[[], None]:
    """What the engine calls between steps: close shards that waited flush_seconds (and the debug knob)."""
    knob = os.environ.get(DEBUG_SIGNAL_ENV)
    if not knob:
        return writer.maybe_flush
    rows, _, name = knob.partition(":")
    threshold, signum = int(rows), getattr(signal, f"SIG{name or 'TERM'}")
    raised = False

    def hook() -> None:
        nonlocal raised
        writer.maybe_flush()
        if not raised and writer.rows_added >= threshold:
            raised = True
            # called from the main thread (the embedded run steps there), raise_signal runs the Python
            # handler before it returns: SIGTERM's KeyboardInterrupt comes out of this very call
            signal.raise_signal(signum)

    return hook


def _close(writer: TrajectoryWriter) -> OutputWriteError | None:
    """Flush the buffered rows; a failed write is returned, so the manifest still gets its final state."""
    try:
        writer.close()
    except OutputWriteError as err:
        return err
    return None


def _final_state(failure: BaseException | None, close_error: OutputWriteError | None) -> tuple[str, str | None]:
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


def _write_final_manifest(out: str, manifest: dict, failure: BaseException | None) -> None:
    """Write the manifest; on a failure path, a manifest write that fails too (the disk is still full)
    must not hide the first error, which is what the user sees."""
    try:
        write_manifest(out, manifest)
    except OutputWriteError:
        if failure is None:
            raise


def _merge_summaries(summaries: list[dict]) -> dict:
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
    return merged


def _engine_settings(engine: Engine) -> dict:
    cfg = engine.config
    return {
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_model_len": engine.max_model_len,
        "max_batch_tokens": cfg.max_batch_tokens,
        "max_running": cfg.max_running,
        "kv_cache_tokens": engine.num_kv_slots - 1,
        "enable_prefix_cache": cfg.enable_prefix_cache,
        "tensor_parallel": cfg.tensor_parallel_size,
        "attention_backend": engine.attention_backend,
    }


def _summary(engine, progress: JobProgress, writer, finish_reasons, skipped: list[SkippedRow], before, status) -> dict:
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
    }
