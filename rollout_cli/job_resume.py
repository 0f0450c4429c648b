"""What `rollout run --resume` compares before it continues a run in a non-empty OUT, and its refusals.

The checkpoint, the prompt file and the weights the engine holds are compared by content (the
manifest's "fingerprints", rollout_cli.io.fingerprints), the hub commit by name, and the settings
that shape the rows key by key; each refusal is one line that says what changed. Separate from
the job itself (job.py), which only calls `fingerprints` and `check_resume`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.errors import RolloutError
from rollout_cli.io.fingerprints import checkpoint_change, checkpoint_fingerprint, data_change, data_fingerprint
from rollout_cli.io.output_dir import part_files_in, read_manifest
from rollout_cli.models.hub import source_change

if TYPE_CHECKING:
    from rollout_cli.engine.engine import Engine
    from rollout_cli.job import JobConfig

# Manifest keys that must be equal for --resume to continue a run. The checkpoint, the prompt file and
# the weights are compared by content (the manifest's "fingerprints"), never by the paths as typed.
RESUME_KEYS = ("prompt_key", "image_key", "limit", "sampling", "capture_routing", "deterministic", "quantization",
               "kv_cache_dtype", "env", "dtype", "max_model_len")
# as a manifest holds them (JSON: --stop-token-ids' tuple comes back a list)
SAMPLING_DEFAULTS = json.loads(json.dumps(dataclasses.asdict(SamplingParams())))
# A manifest written before fingerprints were recorded: its paths are compared as typed, as they were then.
LEGACY_RESUME_KEYS = ("model", "data", *RESUME_KEYS)


def fingerprints(engine: Engine, job: JobConfig, weights_path: str | None) -> dict:
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


def check_resume(job: JobConfig, settings: dict, fingerprints: dict) -> None:
    """Refuse, in one line that says what changed, a --resume that would mix two jobs in OUT."""
    previous = read_manifest(job.out)
    if previous is None:
        if part_files_in(job.out):
            raise RolloutError(f"--resume: {job.out} holds trajectory shards but no manifest.json, so nothing tells "
                               "which run wrote them; restore its manifest.json, or choose another --out")
        return
    _check_run_manifest(job.out, previous)
    # --continue-aborted carries samples over new weights on purpose (each token records its version):
    # another checkpoint of the same model (config, tokenizer, template) is allowed, another model is not
    new_weights_allowed = job.continue_aborted
    change = None if new_weights_allowed else source_change(previous.get("model_source"), settings["model_source"])
    if change is not None:  # before the content check: the commits say more than "model.safetensors changed"
        hub = previous["model_source"]
        raise RolloutError(f"--resume: {job.out} was made from another hub commit: {change}; resume with --model "
                           f"{hub['hub_id']} --revision {hub['commit']}, or choose another --out")
    recorded = previous.get("fingerprints")
    if recorded is not None:
        change = checkpoint_change(recorded["checkpoint"], fingerprints["checkpoint"], weights=not new_weights_allowed)
        if change is not None:
            raise RolloutError(
                f"--resume: {job.out} was made with another checkpoint ({previous.get('model')}): {change}; "
                "resume with that checkpoint, or choose another --out"
            )
    version = fingerprints["weights"]["version"]
    if "weight_version" in previous and previous["weight_version"] != version and not new_weights_allowed:
        raise RolloutError(
            f"--resume: the run was made at weight version {previous['weight_version']} and the engine has "
            f"weight version {version}; resuming would mix two weight versions in {job.out}: resume with the "
            f"run's weights at version {previous['weight_version']}, or choose another --out (or, to carry its "
            "aborted samples over to these weights, --continue-aborted)"
        )
    if recorded is not None and not new_weights_allowed:
        _check_same_weights(job, recorded["weights"], fingerprints["weights"])
        change = data_change(recorded["data"], fingerprints["data"])
        if change is not None:
            raise RolloutError(
                f"--resume: the prompt file {job.data} changed since {job.out} was made from it: {change}; "
                "restore that file, or choose another --out"
            )
    settings = json.loads(json.dumps(settings))  # compared as the manifest will hold them
    for key in RESUME_KEYS if recorded is not None else LEGACY_RESUME_KEYS:
        old = previous.get(key)
        if key == "sampling" and isinstance(old, dict):  # a manifest from before a setting existed ran at its default
            # except the text rule: a run from before include_stop_str_in_output kept a stop rule's text in
            # response_text (as the flag does, but for characters of the last token past a stop string);
            # resumed without the flag, one OUT would hold both kinds of text
            kept = {"include_stop_str_in_output": bool(old.get("stop") or old.get("stop_token_ids"))}
            old = {**SAMPLING_DEFAULTS, **kept, **old}
        if key in previous and old != settings[key]:
            name, old, new = _difference(key, old, settings[key])
            raise RolloutError(
                f"--resume: {job.out} was made with {name}={old!r}, this run has {new!r}; "
                "use the same settings to resume, or choose another --out"
            )


def _check_run_manifest(out: str, manifest: dict) -> None:
    """A manifest --resume can compare against: a run's (not a score's), with its settings and well-formed
    fingerprints; anything else is refused rather than read as "no such setting recorded"."""
    damaged = f"--resume: {out}/manifest.json"
    if not isinstance(manifest.get("sampling"), dict):
        what = "a score's (rollout score)" if "settings" in manifest else "damaged: it records no sampling settings"
        raise RolloutError(f"{damaged} is {what}, not a run's; choose another --out")
    recorded = manifest.get("fingerprints")
    if recorded is None:
        return  # a manifest from before fingerprints: its paths are compared instead
    parts = ("checkpoint", "data", "weights")
    if not isinstance(recorded, dict) or not all(isinstance(recorded.get(part), dict) for part in parts):
        raise RolloutError(f"{damaged} is damaged (its fingerprints need {', '.join(parts)}); restore it, or "
                           "choose another --out")


def check_resumed_pairs(out: str, done: set[tuple[int, int]], n: int) -> None:
    """Every finished sample in OUT is one this run makes: sample indices in [0, n), prompt indices >= 0
    (a shard copied in from another run, or edited, is refused rather than counted done)."""
    stray = sorted(pair for pair in done if pair[0] < 0 or not 0 <= pair[1] < n)
    if stray:
        raise RolloutError(f"--resume: {out} holds sample {stray[0]} (prompt_index, sample_index), which a run with "
                           f"--n {n} does not make; remove the shard that holds it, or choose another --out")


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
