"""One generation job: prompts Parquet in, trajectory shards and a manifest out.

Shared by the embedded `rollout run` and the daemon's /generate.
Order matters for "nothing written on bad input": every check that can fail
(output dir, prompt file, every prompt row) runs before OUT is created.
What the manifest records is job_manifest.py; what --resume compares, job_resume.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rollout_cli.data_parallel import ReplicaGroup
from rollout_cli.engine.engine import Engine
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.errors import RolloutError
from rollout_cli.io.atomic_write import OutputWriteError
from rollout_cli.io.output_dir import (
    ROUTING_SUBDIR,
    TRAJECTORIES_SUBDIR,
    completed_pairs,
    create_output_dir,
    prepare_output_dir,
    write_manifest,
)
from rollout_cli.io.image_prompts import VisionPromptEncoder
from rollout_cli.io.prompts import PromptSource
from rollout_cli.io.trajectories import TrajectoryWriter, shards_have_column, trajectory_schema
from rollout_cli.job_manifest import (
    engine_settings,
    final_state,
    job_settings,
    job_summary,
    merge_summaries,
    write_final_manifest,
)
from rollout_cli.episodes import EpisodeRunner, check_episode_sampling, check_max_turns, load_environment
from rollout_cli.job_continue import drop_superseded_aborts, prepare_continuation
from rollout_cli.io.output_lock import OutputLock
from rollout_cli.job_resume import check_resume, check_resumed_pairs, fingerprints
from rollout_cli.peer_failure import caused_by_peer, stop_if_a_peer_failed

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
    image_key: str | None = None
    """Column holding each row's images (vision-language models); None: `images`, else `image`, if the file has one."""
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
    continue_aborted: bool = False
    """With resume: continue the samples written with finish_reason abort from their response so far
    (on the weights the engine holds now) instead of counting them done (job_continue.py)."""
    env: str | None = None
    """A Python file defining make_env(row): every sample is a multi-turn episode with it (episodes.py)."""
    max_turns: int = 8
    """With env: model turns per episode at most."""

    def __post_init__(self) -> None:
        # checked here, where the CLI and the daemon's /generate both build the job: before OUT exists
        if self.shard_rows < 1:
            raise RolloutError(f"--shard-rows must be at least 1, got {self.shard_rows}")
        if self.continue_aborted and not self.resume:
            raise RolloutError("--continue-aborted continues the aborted samples of a run in OUT: add --resume")
        if self.env is not None:
            check_max_turns(self.max_turns)
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
    trajectory_schema(source.passthrough_schema, episodes=job.env is not None, images=source.has_images)
    if job.env is not None:
        load_environment(job.env)  # a missing or broken file is one line before anything is written
    return source


def _prompt_source(job: JobConfig, engine: Engine | None) -> PromptSource:
    """The job's prompts; with an engine, rows are tokenized and held to what its RequestMaker admits, and
    a vision-language checkpoint reads the rows' images through its own image processor."""
    if engine is None:
        return PromptSource(job.data, tokenizer=None, prompt_key=job.prompt_key, limit=job.limit,
                            image_key=job.image_key)
    vision = VisionPromptEncoder.from_checkpoint(engine.config.model, engine.tokenizer)
    if vision is not None:
        vision.pin_rows = engine.device.type == "cuda"
    return PromptSource(job.data, engine.tokenizer, prompt_key=job.prompt_key, limit=job.limit,
                        max_prompt_len=engine.requests.max_prompt_len, skip_invalid=job.skip_invalid,
                        vocab_size=engine.requests.vocab_size, image_key=job.image_key, vision=vision)


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
    replica's counts, and holds OUT against any other job meanwhile (io/output_lock.py).
    `weights_path`: where the engine's weights were last loaded from when that is not its model
    directory (the daemon after a reload); --resume refuses to mix weights.
    """
    with OutputLock(job.out) if group.is_leader else contextlib.nullcontext() as lock:
        return _run_job(engine, params, job, on_progress, group, weights_path, lock)


def _run_job(engine: Engine, params: SamplingParams, job: JobConfig, on_progress, group: ReplicaGroup,
             weights_path: str | None, lock: OutputLock | None) -> dict:
    leader = group.is_leader
    if job.env is not None:  # the daemon's /generate reaches here without the CLI's check
        check_episode_sampling(params)
    engine.requests.stop_matcher(params)  # --stop without a tokenizer: refused before OUT is touched
    source = check_job_inputs(job, engine) if leader else _prompt_source(job, engine)
    skipped = source.validate()
    # before OUT is created: a dense model is refused with nothing written
    routing_dtype = engine.enable_routing_capture() if job.capture_routing else None
    settings = job_settings(engine, job, params)
    manifest = dict(settings, status="running", weight_version=engine.weight_version,
                    engine=engine_settings(engine))
    if not group.alone:
        manifest["data_parallel"] = group.size
    if routing_dtype:
        manifest["routing"] = {"dtype": routing_dtype, "num_layers": len(engine.model.moe_layers),
                               "top_k": engine.model.top_k, "num_experts": engine.model.num_experts}
    done: set[tuple[int, int]] = set()
    continuing: dict = {}  # (prompt_index, sample_index) -> PartialSample, with --continue-aborted
    if leader:  # one process cleans and creates OUT; the other replicas start once it did
        manifest["fingerprints"] = fingerprints(engine, job, weights_path)
        if job.resume:
            check_resume(job, settings, manifest["fingerprints"])
            done = completed_pairs(job.out)
            check_resumed_pairs(job.out, done, params.n)
            if job.continue_aborted:
                if not group.alone:
                    raise RolloutError("--continue-aborted runs on one engine for now; drop --dp")
                continuing = prepare_continuation(job.out)
                done -= continuing.keys()
        create_output_dir(job.out, (TRAJECTORIES_SUBDIR, ROUTING_SUBDIR) if routing_dtype else (TRAJECTORIES_SUBDIR,))
        lock.hold()  # a new OUT exists from here; a resumed one was held from the start
        write_manifest(job.out, manifest)
    _together(group.barrier, job, manifest if leader else None)
    if not leader and job.resume:
        done = completed_pairs(job.out, clean=False)  # replica 0 may be writing already
    owned = group.owns

    already_done = sum(owned(p) for p, _ in done)
    progress = JobProgress(prompts_total=sum(map(owned, source.valid_indices())), trajectories=already_done)
    if on_progress is not None:
        on_progress(progress)  # every row is valid: the bar may start
    remaining: dict[int, int] = {}  # prompt_index -> samples still to finish

    # per prompt row: how many samples are done, and the aborted ones to continue (in sample order);
    # counted once here, not per row over range(n) (a row may have millions of samples)
    done_per_prompt = Counter(p for p, _ in done)
    continued_per_prompt: dict[int, list] = defaultdict(list)
    for (p, _), partial in sorted(continuing.items(), key=lambda item: item[0]):
        continued_per_prompt[p].append(partial)

    def pending_prompts() -> Iterator[PromptInput]:
        for row in source:
            if not owned(row.prompt_index):
                continue
            missing = params.n - done_per_prompt[row.prompt_index]
            if missing == 0:
                progress.prompts_done += 1
                continue
            remaining[row.prompt_index] = missing
            continued = continued_per_prompt.pop(row.prompt_index, [])
            for partial in continued:  # from their response so far (a row keeps no pixels: the prompt
                # file's row gives its images back)
                yield dataclasses.replace(partial, passthrough=row.passthrough, images=tuple(row.images))
            if missing > len(continued):  # samples that neither finished nor continue: the row itself
                yield row

    writer = TrajectoryWriter(job.out, source.passthrough_schema, job.shard_rows, job.flush_seconds,
                              routing_dtype=routing_dtype,
                              routing_shape=(len(engine.model.moe_layers), engine.model.top_k) if routing_dtype else (0, 0),
                              replica=None if group.alone else group.rank, episodes=job.env is not None,
                              top_logprobs=params.top_logprobs > 0, images=source.has_images,
                              sampling_mask=params.return_sampling_mask,
                              stop_reason=_stop_reason_column(job, params))
    episodes = EpisodeRunner(engine, load_environment(job.env), job.max_turns) if job.env is not None else None
    finish_reasons: Counter[str] = Counter()
    stats_before = dataclasses.replace(engine.scheduler.stats)
    failure: BaseException | None = None
    try:
        skip = done | continuing.keys()  # a prompt row runs only its samples that neither finished nor continue
        stream = engine.stream if episodes is None else episodes.stream
        for trajectory in stream(pending_prompts(), params, skip=skip, on_step=_step_hook(writer)):
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
        failure = caused_by_peer(err)  # gloo's "connection closed" after another rank failed: its error
    # finished rows survive any exception, Ctrl-C and SIGTERM included
    close_error = _close(writer)
    if continuing and close_error is None:  # the continued rows are on disk: their aborted rows go
        drop_superseded_aborts(job.out)
    failure = failure or close_error
    status, error = final_state(failure, close_error)
    # count what is on disk: a signal between writer.add and the counter update must not skew it
    progress.trajectories = already_done + writer.rows_written
    summary = job_summary(engine, progress, writer, finish_reasons, skipped, stats_before, status)
    if episodes is not None:
        summary["episodes"] = episodes.summary()
    if error is not None:
        summary["error"] = error
    if failure is not None:
        if leader:  # alone, its counts are the job's; the replicas' counts are gathered only when all finish
            manifest.update(summary if group.alone else {"status": status, **({"error": error} if error else {})})
            write_final_manifest(job.out, manifest, failure)
        raise failure
    # a replica that failed above never gets here; torchrun stops the others
    manifest.update(merge_summaries(_together(lambda: group.gather(summary), job, manifest if leader else None)))
    if leader:
        write_manifest(job.out, manifest)
    return manifest


def _stop_reason_column(job: JobConfig, params: SamplingParams) -> bool:
    """Rows get a stop_reason column with stop rules (not --env: an episode's turns each end their own way),
    unless a resumed OUT holds shards without it (a --stop-token-ids run from before the column)."""
    return bool(params.stop or params.stop_token_ids) and job.env is None and shards_have_column(job.out, "stop_reason")


def _together(collective: Callable, job: JobConfig, manifest: dict | None):
    """`collective()` of the replicas (barrier, gather). Should another replica fail meanwhile (gloo's
    "connection closed" once it left), the leader's `manifest` gets its final state before the error
    is raised: the failure the other replica claimed, not "running" over a job nobody runs."""
    try:
        return collective()
    except BaseException as err:  # noqa: BLE001 - re-raised below
        failure = caused_by_peer(err)
        if manifest is not None:
            status, error = final_state(failure, None)
            manifest.update(status=status, **({"error": error} if error else {}))
            write_final_manifest(job.out, manifest, failure)
        raise failure  # caused_by_peer chained `err` to a peer's failure


def _step_hook(writer: TrajectoryWriter) -> Callable[[], None]:
    """What the engine calls between steps: close shards that waited flush_seconds (and the debug knob);
    end the job once another rank claimed a failure (a --dp replica waits for nobody mid-run)."""

    def step() -> None:
        stop_if_a_peer_failed()
        writer.maybe_flush()

    knob = os.environ.get(DEBUG_SIGNAL_ENV)
    if not knob:
        return step
    rows, _, name = knob.partition(":")
    threshold, signum = int(rows), getattr(signal, f"SIG{name or 'TERM'}")
    raised = False

    def hook() -> None:
        nonlocal raised
        step()
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
