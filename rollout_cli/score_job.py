"""One `rollout score` job: a run's trajectories in, teacher-forced logprobs out, and how far the two are.

    SCORES/scores/part-00000.parquet   prompt_index, sample_index, response_logprobs (list<float32>);
                                       with --top-logprobs K also top_token_ids (list<list<int32>>) and
                                       top_logprobs (list<list<float32>>): K per response position
    SCORES/manifest.json               settings, status, and the comparison with the run's logprobs

Shards are written atomically and numbered like `run`'s (io/trajectories.ShardWriter); `--resume`
scores only the (prompt_index, sample_index) pairs no whole shard holds yet. The comparison is
computed at the end over every shard, so a resumed job reports on all of its samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from rollout_cli.engine.engine import Engine
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import ScoreInput
from rollout_cli.errors import RolloutError, one_line
from rollout_cli.io.fingerprints import checkpoint_fingerprint
from rollout_cli.io.image_prompts import VisionPromptEncoder
from rollout_cli.io.image_rows import ImageRows
from rollout_cli.io.output_lock import OutputLock
from rollout_cli.io.prompt_encoding import InvalidPrompt
from rollout_cli.io.output_dir import (
    MANIFEST_NAME,
    TRAJECTORIES_SUBDIR,
    completed_pairs,
    create_output_dir,
    prepare_output_dir,
    read_manifest,
    sample_key_problem,
    write_manifest,
)
from rollout_cli.io.trajectories import ShardWriter
from rollout_cli.job_manifest import final_state, write_final_manifest
from rollout_cli.score_rows import is_superseded, superseded_aborts

SCORES_SUBDIR = "scores"
SCORE_SCHEMA = pa.schema([
    pa.field("prompt_index", pa.int64()),
    pa.field("sample_index", pa.int32()),
    pa.field("response_logprobs", pa.list_(pa.float32())),
])
TOP_FIELDS = (pa.field("top_token_ids", pa.list_(pa.list_(pa.int32()))),
              pa.field("top_logprobs", pa.list_(pa.list_(pa.float32()))))
NEEDED = ("prompt_index", "sample_index", "prompt_token_ids", "response_token_ids", "response_logprobs")
# what each list column's values must be (a list<null> is a shard whose lists are all empty)
LIST_VALUES = {"prompt_token_ids": ("token ids (integers)", pa.types.is_integer),
               "response_token_ids": ("token ids (integers)", pa.types.is_integer),
               "response_logprobs": ("numbers", lambda t: pa.types.is_floating(t) or pa.types.is_integer(t))}
# the recorded settings `rollout score` defaults to, and the JSON types they must have
RECORDED_TYPES = {"temperature": (int, float), "top_p": (int, float), "min_p": (int, float), "top_k": int,
                  "logprobs_mode": str}


@dataclass(frozen=True)
class ScoreJobConfig:
    data: str
    """A run's output directory or its trajectories/ folder (or one trajectory Parquet file)."""
    out: str
    """Output directory: scores/part-NNNNN.parquet and manifest.json."""
    resume: bool = False
    shard_rows: int = 1024
    flush_seconds: float = 10.0
    top_logprobs: int = 0
    """K > 0: also the K most likely tokens and their logprobs at every response position."""
    images_from: str | None = None
    """An image run's prompt file (the pixels its trajectories do not hold); None: the file its manifest names."""
    image_key: str | None = None
    """That file's image column; None: the run's (its manifest), else images, else image."""
    sampling_mask: bool = False
    """Renormalise each token over the run's recorded kept set (its response_sampling_mask column) instead of
    re-running top-k / top-p / min-p on the scoring logits: what a trainer replaying the masks computes."""


@dataclass
class ScoreProgress:
    samples_total: int = 0
    samples_done: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)


def trajectories_path(data: str) -> Path:
    """The Parquet file or folder of trajectories that `data` names."""
    path = Path(data)
    if path.is_dir() and (path / TRAJECTORIES_SUBDIR).is_dir():
        path = path / TRAJECTORIES_SUBDIR
    if not path.exists():
        raise RolloutError(f"--data {data} does not exist; pass a run's output directory or its trajectories/ folder")
    if path.is_dir() and (path / MANIFEST_NAME).is_file():  # an output directory, but not a run's
        what = "a `rollout score` output" if (path / SCORES_SUBDIR).is_dir() else "no run's output"
        raise RolloutError(f"--data {data} is {what} (no {TRAJECTORIES_SUBDIR}/ folder); pass the output directory "
                           f"of `rollout run` or its {TRAJECTORIES_SUBDIR}/ folder")
    return path


def run_sampling(data: str) -> dict:
    """The sampling settings recorded by the run that wrote `data` (its manifest.json), or {}. A hand-edited
    or damaged value of the wrong type is refused here: it was a TypeError traceback in SamplingParams."""
    sampling = _run_manifest(data).get("sampling") or {}
    if not isinstance(sampling, dict):
        raise _damaged(data, "sampling", sampling, "an object")
    for name, kind in RECORDED_TYPES.items():
        value = sampling.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise _damaged(data, f"sampling.{name}", value, "a string" if kind is str else "a number")
    return dict(sampling)


def _damaged(data: str, name: str, value, expected: str) -> RolloutError:
    return RolloutError(f"the manifest.json of --data {data} records {name} = {value!r}, not {expected}; restore "
                       "the run's manifest.json")


def _run_manifest(data: str) -> dict:
    """The manifest of the run that wrote `data`, or {}."""
    path = trajectories_path(data)
    folder = path.parent if path.is_file() else path
    run_dir = folder.parent if folder.name == TRAJECTORIES_SUBDIR else folder
    return read_manifest(run_dir) or {}


def _dataset(data: str) -> ds.Dataset:
    path = str(trajectories_path(data))
    # an explicit schema lists the shards without opening any: each is checked below, naming the bad one
    for fragment in ds.dataset(path, format="parquet", schema=pa.schema([])).get_fragments():
        _check_shard(fragment.path, data)
    dataset = ds.dataset(path, format="parquet")
    missing = [name for name in NEEDED if name not in dataset.schema.names]
    if missing:
        raise RolloutError(f"{data} holds no {', '.join(missing)} column(s); pass the trajectories of rollout run")
    return dataset


def _check_shard(path: str, data: str) -> None:
    """Refuse a shard that is unreadable or whose sample keys are not integers, before OUT is touched:
    found mid-job they were tracebacks (pyarrow's, or a None key's) after the manifest said running.
    Reads the footer and the two key columns only."""
    whole = Path(path).resolve() == Path(data).resolve()  # --data names this one file
    name = f"--data {data}" if whole else f"shard {path} of --data {data}"
    fix = "delete or replace it (rollout run --resume regenerates a run's lost rows)"
    try:
        schema = pq.read_schema(path)
        missing = [column for column in NEEDED if column not in schema.names]
        if missing:
            raise RolloutError(f"{name} holds no {', '.join(missing)} column(s); " + (
                "pass the trajectories of rollout run" if whole else "move that file out of the trajectories"))
        keys = pq.read_table(path, columns=["prompt_index", "sample_index"])
    except (pa.ArrowException, OSError) as err:
        raise RolloutError(f"{name} is not a readable Parquet file ({one_line(err)}); {fix}") from err
    problem = sample_key_problem(keys) or _list_type_problem(schema)
    if problem is not None:
        raise RolloutError(f"{name}: {problem}; {fix}")


def _list_type_problem(schema: pa.Schema) -> str | None:
    """What is wrong with the types of a shard's token and logprob columns, or None: float or string token
    ids were a torch or numpy traceback mid-job."""
    for column, (values, accepts) in LIST_VALUES.items():
        kind = schema.field(column).type
        if not ((pa.types.is_list(kind) or pa.types.is_large_list(kind))
                and (pa.types.is_null(kind.value_type) or accepts(kind.value_type))):
            return f"column {column} holds {kind}, not lists of {values}"
    return None


def _row_problem(row: dict) -> str | None:
    """What makes one trajectory unscorable, or None. A null list was a traceback, and logprobs that do not
    line up with the response tokens one to one failed the comparison after the scores were written,
    leaving the manifest `running`."""
    for column in LIST_VALUES:
        if row[column] is None:
            return f"{column} is null"
    if len(row["response_logprobs"]) != len(row["response_token_ids"]):
        return (f"{len(row['response_logprobs'])} response_logprobs for {len(row['response_token_ids'])} "
                "response_token_ids (one each)")
    if not all(v is not None and math.isfinite(v) for v in row["response_logprobs"]):
        return "response_logprobs holds a null, NaN or infinite value (a run writes finite logprobs)"  # NaN stats before
    return None


def _samples(dataset: ds.Dataset, done: set, run_logprobs: dict, images=None,
             masks: bool = False, data: str = "", superseded: frozenset = frozenset()) -> Iterator[ScoreInput]:
    """The trajectories not yet scored, one Parquet batch at a time; their run logprobs go to `run_logprobs`.
    `images`: an image run's (VisionPromptEncoder, ImageRows), the pixels looked up by prompt_index;
    `masks`: each row's response_sampling_mask goes with it; `superseded`: pairs whose aborted rows are skipped."""
    columns = (list(NEEDED) + (["image_grid_thw"] if images is not None else [])
               + (["response_sampling_mask"] if masks else []) + (["finish_reason"] if superseded else []))
    for batch in dataset.to_batches(columns=columns):
        for row in batch.to_pylist():
            key = (row["prompt_index"], row["sample_index"])
            if key in done or is_superseded(row, superseded):
                continue
            problem = _row_problem(row)
            if problem is not None:
                raise RolloutError(f"trajectory (prompt_index {key[0]}, sample_index {key[1]}) of --data {data}: "
                                   f"{problem}; fix or drop that row (rollout run --resume regenerates a run's "
                                   "lost rows)")
            run_logprobs[key] = row["response_logprobs"]
            yield ScoreInput(row["prompt_index"], row["sample_index"], row["prompt_token_ids"],
                             row["response_token_ids"], images=_row_images(row, images),
                             sampling_mask=row["response_sampling_mask"] if masks else None)


def _row_images(row: dict, images) -> tuple:
    """A trajectory's images from the run's prompt file, checked against the grids the run recorded."""
    if images is None or not row["image_grid_thw"]:
        return ()
    encoder, rows = images
    try:
        found = encoder.images(rows.cell(row["prompt_index"]), rows.base_dir)
    except InvalidPrompt as err:
        raise RolloutError(f"the images of prompt {row['prompt_index']} in {rows.path}: {err}") from err
    if [list(im.grid_thw) for im in found] != row["image_grid_thw"]:
        raise RolloutError(f"the images of prompt {row['prompt_index']} in {rows.path} have grids "
                           f"{[list(im.grid_thw) for im in found]}, the run's had {row['image_grid_thw']}; pass the "
                           "run's own prompt file with --images-from")
    return found


def _image_source(engine: Engine, dataset: ds.Dataset, job: ScoreJobConfig):
    """(encoder, ImageRows) for the trajectories of an image run (an image_grid_thw column), else None."""
    if "image_grid_thw" not in dataset.schema.names:
        return None
    encoder = VisionPromptEncoder.from_checkpoint(engine.config.model, engine.tokenizer)
    if encoder is None:
        raise RolloutError(f"{job.data} holds an image run's trajectories but {engine.config.model} is a text-only "
                           "model; score them with the vision-language checkpoint that sampled them")
    recorded = _run_manifest(job.data)
    path = job.images_from or recorded.get("data")
    if not path:
        raise RolloutError(f"{job.data} holds an image run's trajectories and no manifest names its prompt file; "
                           "pass it with --images-from")
    names = pq.ParquetFile(path).schema_arrow.names if Path(path).is_file() else []
    key = job.image_key or recorded.get("image_key") or next((k for k in ("images", "image") if k in names), "images")
    return encoder, ImageRows(path, key)


def run_score_job(engine: Engine, params: SamplingParams, job: ScoreJobConfig,
                  on_progress: Callable[[ScoreProgress], None] | None = None) -> dict:
    """Score every trajectory of `job.data` (those not already in `job.out` with --resume); returns the manifest.
    OUT is held against any other job meanwhile (io/output_lock.py)."""
    with OutputLock(job.out) as lock:
        return _run_score_job(engine, params, job, on_progress, lock)


def _identity(engine: Engine, data: str) -> dict:
    """What a --resume must find unchanged beyond the typed settings: the weights by content and the
    numerics they ran with, and the run being scored (its sampling settings and fingerprints: a run
    made again at the same path is another run)."""
    cfg = engine.config
    run = _run_manifest(data)
    return {"checkpoint": None if cfg.load_format == "dummy" else checkpoint_fingerprint(cfg.model)["digest"],
            "load_format": cfg.load_format, "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": cfg.quantization, "kv_cache_dtype": cfg.kv_cache_dtype,
            "run": {"sampling": run.get("sampling"), "fingerprints": run.get("fingerprints")}}


def _run_score_job(engine: Engine, params: SamplingParams, job: ScoreJobConfig, on_progress, lock: OutputLock) -> dict:
    if job.shard_rows < 1 or not job.flush_seconds > 0:
        raise RolloutError("--shard-rows must be at least 1 and --flush-seconds above 0")
    if job.top_logprobs < 0:
        raise RolloutError(f"--top-logprobs {job.top_logprobs}: give 0 (off) or the number of tokens to keep")
    dataset = _dataset(job.data)
    if job.sampling_mask and "response_sampling_mask" not in dataset.schema.names:
        raise RolloutError(f"--sampling-mask: {job.data} holds no response_sampling_mask column; run with "
                           "--sampling-mask to record the kept sets, or score without it")
    images = _image_source(engine, dataset, job)  # before OUT exists: a missing prompt file is refused first
    superseded, superseded_rows = superseded_aborts(dataset, job.data)  # a pair twice is refused here too
    settings = {"model": engine.config.model, "data": job.data, "weight_version": engine.weight_version,
                "deterministic": engine.config.deterministic,
                "sampling": {name: getattr(params, name) for name in ("temperature", "logprobs_mode", "top_p", "top_k",
                                                                      "min_p")},
                "top_logprobs": job.top_logprobs,
                **({"sampling_mask": True} if job.sampling_mask else {}),  # older manifests: no key
                "identity": _identity(engine, job.data)}
    prepare_output_dir(job.out, job.resume)
    if job.resume:
        _check_resumable(job.out, settings)  # before create_output_dir: a refused --out is left as it was
    create_output_dir(job.out, (SCORES_SUBDIR,))
    lock.hold()  # a new OUT exists from here; a resumed one was held from the start
    done = completed_pairs(job.out, SCORES_SUBDIR) if job.resume else set()
    started = time.monotonic()
    write_manifest(job.out, {"status": "running", "settings": settings})
    progress = ScoreProgress(samples_total=dataset.count_rows() - superseded_rows - len(done))
    run_logprobs: dict = {}
    failure: BaseException | None = None
    try:
        schema = pa.schema(list(SCORE_SCHEMA) + (list(TOP_FIELDS) if job.top_logprobs else []))
        with ShardWriter(job.out, schema, job.shard_rows, job.flush_seconds, subdir=SCORES_SUBDIR) as writer:
            if on_progress is not None:
                on_progress(progress)
            samples = _samples(dataset, done, run_logprobs, images, job.sampling_mask, job.data, superseded)
            scores = engine.score(samples, params, on_step=writer.maybe_flush, top_logprobs=job.top_logprobs)
            for score in scores:
                run_logprobs.pop((score.prompt_index, score.sample_index), None)
                row = {"prompt_index": score.prompt_index, "sample_index": score.sample_index,
                       "response_logprobs": score.response_logprobs}
                if job.top_logprobs:
                    row["top_token_ids"] = [[t for t, _ in top] for top in score.top_logprobs]
                    row["top_logprobs"] = [[lp for _, lp in top] for top in score.top_logprobs]
                writer.add(row)
                progress.samples_done += 1
                progress.tokens += len(score.response_logprobs)
                if on_progress is not None:
                    on_progress(progress)
    except BaseException as err:  # noqa: BLE001 - re-raised below, once the manifest has its final state
        failure = err
    # as run's: interrupted (--resume completes it) only for Ctrl-C, SIGTERM, the daemon's abort or a full disk
    status, error = final_state(failure, None)
    manifest = {"status": status, **({"error": error} if error else {}), "settings": settings,
                "wall_seconds": round(time.monotonic() - started, 3), "scored_this_run": progress.samples_done,
                **compare_with_run(dataset, job.out, superseded)}
    write_final_manifest(job.out, manifest, failure)
    if failure is not None:
        raise failure
    return manifest


def _check_resumable(out: str, settings: dict) -> None:
    """Refuse to --resume into an --out that holds a run's output, or scores made with other settings."""
    if (Path(out) / TRAJECTORIES_SUBDIR).is_dir():
        raise RolloutError(f"--resume: {out} holds a run's output ({TRAJECTORIES_SUBDIR}/), not scores; "
                           "pass the --out of an earlier `rollout score`, or choose another --out")
    previous = read_manifest(out)
    recorded = (previous or {}).get("settings") or {}
    if "identity" not in recorded:  # scores made before it was recorded: the typed settings alone
        settings = {k: v for k, v in settings.items() if k != "identity"}
    if previous and recorded != settings:
        name, old, new = _first_difference(recorded, settings)
        raise RolloutError(f"--resume: {out} was scored with {name}={old!r}, this job has {new!r}; "
                           "use the same settings to resume, or choose another --out")


def _first_difference(old: dict, new: dict, prefix: str = "") -> tuple[str, object, object]:
    """("sampling.temperature", 0.8, 1.0): the first setting that differs, named by its path."""
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                return _first_difference(a, b, f"{prefix}{key}.")
            return f"{prefix}{key}", a, b
    return prefix.rstrip(".") or "settings", old, new


def compare_with_run(dataset: ds.Dataset, out: str, superseded: frozenset = frozenset()) -> dict:
    """How the scores in `out` differ from the run's logprobs of the same tokens: absolute differences
    (mean, p99, max over tokens) and the fraction of tokens and of samples that are equal bit for bit.
    Episodes (`run --env`) count their model's tokens only (response_loss_mask 1): the environment's
    tokens were not sampled, and the run records 0.0 for them. The aborted rows of `superseded` pairs are skipped."""
    scores_dir = Path(out) / SCORES_SUBDIR
    scored = {}
    if any(scores_dir.glob("part-*.parquet")):
        for row in ds.dataset(str(scores_dir), format="parquet").to_table().to_pylist():
            scored[(row["prompt_index"], row["sample_index"])] = row["response_logprobs"]
    diffs, equal_samples = [], 0
    columns = ["prompt_index", "sample_index", "response_logprobs"] + ["finish_reason"] * bool(superseded)
    masked = "response_loss_mask" in dataset.schema.names
    for batch in dataset.to_batches(columns=columns + ["response_loss_mask"] * masked):
        for row in batch.to_pylist():
            ours = scored.get((row["prompt_index"], row["sample_index"]))
            if ours is None or is_superseded(row, superseded):
                continue
            diff = np.abs(np.asarray(ours, np.float32) - np.asarray(row["response_logprobs"], np.float32))
            if masked:
                diff = diff[np.asarray(row["response_loss_mask"], bool)]
            diffs.append(diff)
            equal_samples += bool((diff == 0).all())
    diff = np.concatenate(diffs) if diffs else np.zeros(0, np.float32)
    stats = {"samples": len(diffs), "tokens": int(diff.size), "bitwise_equal_samples": equal_samples}
    if diff.size:
        stats.update(mean_abs_diff=float(diff.mean()), p99_abs_diff=float(np.percentile(diff, 99)),
                     max_abs_diff=float(diff.max()), bitwise_equal_tokens=float((diff == 0).mean()))
    return stats
