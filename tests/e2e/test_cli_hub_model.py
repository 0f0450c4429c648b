"""`--model ORG/NAME`: a hub id resolved through the Hugging Face cache, offline.

The cache is tests/conftest.py's make_hub_cache: the example model at COMMIT_MAIN (refs/main) and
the same files with other weights at COMMIT_V2 (refs/v2), laid out as huggingface_hub lays it out.
Every command runs with HF_HUB_CACHE pointing at it and HF_HUB_OFFLINE=1: nothing touches the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hub_cache import COMMIT_MAIN, COMMIT_V2, HUB_ID
from weight_trainers import wait_for_daemon

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "recipes" / "prompts.parquet"
CLI = [sys.executable, "-m", "rollout_cli.cli.main"]
JOB = ["--n", "2", "--limit", "3", "--max-new-tokens", "4", "--shard-rows", "2", "--seed", "5", "--device", "cpu",
       "--quiet"]


def _env(cache: Path) -> dict:
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for name in ("ROLLOUT_ENGINE", "ROLLOUT_DEBUG_SIGNAL_AFTER_ROWS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        env.pop(name, None)
    return env


def _cli(cache: Path, args: list, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=180, cwd=cwd,
                          env=_env(cache))


def _run(cache: Path, out: Path, model, *extra, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return _cli(cache, ["run", "--model", model, "--data", PROMPTS, "--out", out, *JOB, *extra], cwd=cwd)


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr


def _one_error_line(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], f"{word!r} missing from: {lines[0]}"
    return lines[0]


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _tokens(out: Path) -> list:
    rows = pq.read_table(out / "trajectories").to_pylist()
    return sorted((r["prompt_index"], r["sample_index"], r["response_token_ids"]) for r in rows)


def _snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_hub_id_runs_as_its_snapshot_directory_and_the_manifest_names_it(hub_cache, tmp_path):
    cache = hub_cache["cache"]
    by_id, by_dir = tmp_path / "by_id", tmp_path / "by_dir"
    _ok(_run(cache, by_id, HUB_ID))
    _ok(_run(cache, by_dir, hub_cache["snapshots"][COMMIT_MAIN]))
    assert _tokens(by_id) == _tokens(by_dir) and len(_tokens(by_id)) == 6
    manifest = _manifest(by_id)
    assert manifest["model_source"] == {"hub_id": HUB_ID, "revision": "main", "commit": COMMIT_MAIN}
    assert manifest["model"] == str(hub_cache["snapshots"][COMMIT_MAIN])
    assert manifest["fingerprints"]["checkpoint"] == _manifest(by_dir)["fingerprints"]["checkpoint"]
    assert _manifest(by_dir)["model_source"] is None  # a directory typed as such: no hub id to record


def test_revision_loads_the_files_of_that_ref(hub_cache, tmp_path):
    cache = hub_cache["cache"]
    main, v2 = tmp_path / "main", tmp_path / "v2"
    _ok(_run(cache, main, HUB_ID, "--revision", COMMIT_MAIN))
    _ok(_run(cache, v2, HUB_ID, "--revision", "v2"))
    assert _manifest(main)["model_source"]["commit"] == COMMIT_MAIN
    assert _manifest(v2)["model_source"] == {"hub_id": HUB_ID, "revision": "v2", "commit": COMMIT_V2}
    assert _manifest(v2)["model"] == str(hub_cache["snapshots"][COMMIT_V2])
    files = [_manifest(out)["fingerprints"]["checkpoint"]["files"] for out in (main, v2)]
    assert files[0]["model.safetensors"] != files[1]["model.safetensors"]  # the other snapshot's weights
    assert files[0]["config.json"] == files[1]["config.json"]


def test_uncached_id_offline_is_one_line_and_exit_2(hub_cache, tmp_path):
    out = tmp_path / "out"
    line = _one_error_line(_run(hub_cache["cache"], out, "rollout-test/not-cached"),
                           "--model rollout-test/not-cached (revision main)", "neither a local directory nor in the "
                           "Hugging Face cache", "HF_HUB_OFFLINE=1 forbids downloading it", "unset HF_HUB_OFFLINE")
    assert str(hub_cache["cache"]) in line
    assert not out.exists()


@pytest.mark.parametrize("model", ["a/b/c", ""])
def test_bad_id_is_one_line_and_exit_2(hub_cache, tmp_path, model):
    _one_error_line(_run(hub_cache["cache"], tmp_path / "out", model), "neither a local directory nor a valid hub id")


def test_local_directory_of_the_same_spelling_wins(hub_cache, tmp_path):
    import shutil

    shutil.copytree(hub_cache["snapshots"][COMMIT_V2], tmp_path / HUB_ID)  # ./rollout-test/tiny: the v2 files
    out = tmp_path / "out"
    _ok(_run(hub_cache["cache"], out, HUB_ID, cwd=tmp_path))
    assert _manifest(out)["model_source"] is None and _manifest(out)["model"] == HUB_ID


def test_resume_with_another_revision_is_refused_and_its_commit_resumes(hub_cache, tmp_path):
    cache, out = hub_cache["cache"], tmp_path / "out"
    _ok(_run(cache, out, HUB_ID))
    shards = sorted((out / "trajectories").glob("part-*.parquet"))
    assert len(shards) == 3
    shards[-1].unlink()  # what a kill leaves: whole shards for part of the pairs
    before = _snapshot(out)
    _one_error_line(_run(cache, out, HUB_ID, "--revision", "v2", "--resume"),
                    "--resume:", f"commit {COMMIT_MAIN} (revision main)", f"commit {COMMIT_V2} (revision v2)",
                    f"--revision {COMMIT_MAIN}")
    assert _snapshot(out) == before, "a refused --resume changed OUT"
    _ok(_run(cache, out, HUB_ID, "--revision", COMMIT_MAIN, "--resume"))  # the same commit, spelled as one
    assert _manifest(out)["status"] == "complete" and len(_tokens(out)) == 6


def test_serve_a_hub_id_and_reload_another_revision(hub_cache, tmp_path):
    cache, sock = hub_cache["cache"], tmp_path / "engine.sock"
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(CLI + ["serve", "--model", HUB_ID, "--device", "cpu", "--socket", str(sock)],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=REPO, env=_env(cache))
    try:
        wait_for_daemon(proc, sock, log).close()
        out = tmp_path / "out"
        _ok(_cli(cache, ["run", "--engine", sock, "--data", PROMPTS, "--out", out, "--n", "1", "--limit", "2",
                         "--max-new-tokens", "2", "--quiet"]))
        assert _manifest(out)["model_source"]["commit"] == COMMIT_MAIN
        _ok(_cli(cache, ["reload-weights", HUB_ID, "--revision", "v2", "--engine", sock]))
        status = _cli(cache, ["status", "--engine", sock])
        _ok(status)
        assert f"snapshots/{COMMIT_V2}" in status.stdout  # the weights now served name their commit
        _one_error_line(_cli(cache, ["reload-weights", "rollout-test/not-cached", "--engine", sock]),
                        "CHECKPOINT rollout-test/not-cached (revision main)", "HF_HUB_OFFLINE")
    finally:
        proc.terminate()
        proc.wait(timeout=60)




@pytest.mark.parametrize("parallel", [["--dp", "2"], ["--tp", "2"]])
def test_replicas_and_ranks_load_the_commit_their_launcher_resolved(hub_cache, tmp_path, parallel):
    """--dp / --tp re-start the command: each process is handed --revision COMMIT (the branch could move)."""
    cache, one, many = hub_cache["cache"], tmp_path / "one", tmp_path / "many"
    greedy = ["--temperature", "0", "--kv-cache-tokens", "1024", "--max-model-len", "256"]
    _ok(_run(cache, one, hub_cache["snapshots"][COMMIT_MAIN], *greedy))
    _ok(_run(cache, many, HUB_ID, *greedy, *parallel))
    assert _manifest(many)["model_source"] == {"hub_id": HUB_ID, "revision": COMMIT_MAIN, "commit": COMMIT_MAIN}
    assert _tokens(many) == _tokens(one)
