"""--resume continues the same job or refuses in one line that says what changed.

The checkpoint and the prompt file are matched by content (manifest "fingerprints"), not by the
path as typed; the weight version and the weights the engine holds must be the run's. A refusal
exits 2 with one `error:` line and leaves OUT byte for byte as it was. Every run here is small and
finishes; a run is made partial by deleting its last shard, which is what a kill leaves (whole
shards, fewer of them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from weight_trainers import wait_for_daemon

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "example_model"
PROMPTS = REPO / "recipes" / "prompts.parquet"
CLI = [sys.executable, "-m", "rollout_cli.cli.main"]
N, LIMIT = 2, 3
JOB = ["--n", str(N), "--limit", str(LIMIT), "--max-new-tokens", "4", "--shard-rows", "2", "--seed", "5", "--quiet"]
PAIRS = [(p, s) for p in range(LIMIT) for s in range(N)]


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("ROLLOUT_ENGINE", None)
    env.pop("ROLLOUT_DEBUG_SIGNAL_AFTER_ROWS", None)
    return env


def _cli(args: list, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=180, cwd=cwd,
                          env=_env())


def _run(out: Path, model="recipes/example_model", data=PROMPTS, *extra,
         cwd: Path = REPO) -> subprocess.CompletedProcess:
    return _cli(["run", "--model", model, "--data", data, "--out", out, "--device", "cpu", *JOB, *extra], cwd=cwd)


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr


def _snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _pairs(out: Path) -> list[tuple[int, int]]:
    rows = pq.read_table(out / "trajectories").to_pylist()
    return sorted((r["prompt_index"], r["sample_index"]) for r in rows)


def _partial(out: Path) -> None:
    """Drop the last shard: OUT then holds what a kill leaves, whole shards for part of the pairs."""
    shards = sorted((out / "trajectories").glob("part-*.parquet"))
    assert len(shards) == 3
    shards[-1].unlink()


def _refused(result: subprocess.CompletedProcess, out: Path, before: dict, *words: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --resume: "), result.stderr
    for word in words:
        assert word in lines[0], f"{word!r} missing from: {lines[0]}"
    assert _snapshot(out) == before, "a refused --resume changed OUT"
    return lines[0]


@pytest.fixture
def partial_run(tmp_path) -> Path:
    out = tmp_path / "out"
    _ok(_run(out))
    _partial(out)
    return out


def test_same_checkpoint_spelled_three_ways_resumes(partial_run):
    out = partial_run
    fingerprints = _manifest(out)["fingerprints"]
    assert set(fingerprints) == {"checkpoint", "data", "weights"}
    assert "model.safetensors" in fingerprints["checkpoint"]["files"]
    assert fingerprints["weights"]["version"] == "0" and fingerprints["data"]["rows"] == 64
    _ok(_run(out, "recipes/example_model/", PROMPTS, "--resume"))
    assert _manifest(out)["trajectories_this_run"] == 2 and _pairs(out) == PAIRS
    _partial(out)
    _ok(_run(out, MODEL, os.path.relpath(PROMPTS, REPO), "--resume"))  # absolute model, relative data
    assert _manifest(out)["status"] == "complete" and _pairs(out) == PAIRS


def test_another_weight_version_is_refused(partial_run):
    out = partial_run
    before = _snapshot(out)
    line = _refused(_run(out, "recipes/example_model", PROMPTS, "--resume", "--weight-version", "5"), out, before,
                    "the run was made at weight version 0", "weight version 5")
    assert "or choose another --out" in line


def test_a_prompt_file_rewritten_at_the_same_path_is_refused(partial_run, tmp_path):
    data = tmp_path / "prompts.parquet"
    shutil.copy(PROMPTS, data)
    out = tmp_path / "own_data"
    _ok(_run(out, "recipes/example_model", data))
    _partial(out)
    table = pq.read_table(data)
    pq.write_table(table.take(list(reversed(range(table.num_rows)))), data)  # same rows, shuffled
    before = _snapshot(out)
    _refused(_run(out, "recipes/example_model", data, "--resume"), out, before,
             f"the prompt file {data} changed", "same row count and columns, other content", "restore that file")


def test_another_checkpoint_at_the_same_relative_path_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    first, second = tmp_path / "a", tmp_path / "b"
    shutil.copytree(MODEL, first / "model")
    shutil.copytree(MODEL, second / "model")
    tensors = load_file(str(second / "model" / "model.safetensors"))
    tensors = {k: v * 1.01 if "mlp" in k else v for k, v in tensors.items()}  # a fine-tune: same shapes
    save_file(tensors, str(second / "model" / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    _ok(_run(out, "model", PROMPTS, cwd=first))
    _partial(out)
    before = _snapshot(out)
    _refused(_run(out, "model", PROMPTS, "--resume", cwd=second), out, before,
             "was made with another checkpoint (model): model.safetensors changed", "resume with that checkpoint")


def test_a_manifest_without_fingerprints_resumes_on_the_paths_as_typed(partial_run):
    """Manifests of older versions: the model and data paths are compared as typed, as they were then."""
    out = partial_run
    manifest = _manifest(out)
    del manifest["fingerprints"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = _snapshot(out)
    _refused(_run(out, "recipes/example_model/", PROMPTS, "--resume"), out, before,
             "model='recipes/example_model'", "this run has 'recipes/example_model/'", "same settings")
    _ok(_run(out, "recipes/example_model", PROMPTS, "--resume"))
    assert _pairs(out) == PAIRS and "fingerprints" in _manifest(out)  # recorded from now on


def test_a_manifest_from_before_a_sampling_setting_existed_resumes(partial_run):
    """A sampling setting added later (top_logprobs here) is absent from older manifests: they ran at
    its default, so --resume continues; another value of a recorded setting is still refused."""
    out = partial_run
    manifest = _manifest(out)
    del manifest["sampling"]["top_logprobs"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = _snapshot(out)
    _refused(_run(out, "recipes/example_model", PROMPTS, "--resume", "--temperature", "0.5"), out, before,
             "sampling.temperature=1.0", "this run has 0.5")
    _ok(_run(out, "recipes/example_model", PROMPTS, "--resume"))
    assert _pairs(out) == PAIRS and _manifest(out)["sampling"]["top_logprobs"] == 0


class _Daemon:
    def __init__(self, sock: Path, log: Path):
        self.sock = sock
        self.proc = subprocess.Popen(CLI + ["serve", "--model", str(MODEL), "--device", "cpu", "--socket", str(sock)],
                                     stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=REPO, env=_env())
        self.log = log

    def wait_ready(self, timeout: float = 120) -> None:
        wait_for_daemon(self.proc, self.sock, self.log, timeout).close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_daemon_job_resumed_after_reload_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    tuned = shutil.copytree(MODEL, tmp_path / "tuned")
    tensors = {k: v * 1.01 if "mlp" in k else v for k, v in load_file(str(tuned / "model.safetensors")).items()}
    save_file(tensors, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    sock, out = tmp_path / "engine.sock", tmp_path / "out"
    job = ["run", "--engine", sock, "--data", PROMPTS, "--out", out, *JOB]
    daemon = _Daemon(sock, tmp_path / "serve.log")
    try:
        daemon.wait_ready()
        _ok(_cli(job))
        _partial(out)
        before = _snapshot(out)
        _ok(_cli(["reload-weights", tuned, "--engine", sock]))  # version 0 -> 1
        _refused(_cli(job + ["--resume"]), out, before, "the run was made at weight version 0",
                 "weight version 1")
        _ok(_cli(["reload-weights", tuned, "--version", "0", "--engine", sock]))  # other weights, same version
        _refused(_cli(job + ["--resume"]), out, before, f"was made with the weights of {MODEL}",
                 f"the engine holds those of {tuned}")
        _ok(_cli(["reload-weights", MODEL, "--version", "0", "--engine", sock]))  # the run's weights again
        _ok(_cli(job + ["--resume"]))
    finally:
        daemon.stop()
    assert _manifest(out)["status"] == "complete" and _pairs(out) == PAIRS
