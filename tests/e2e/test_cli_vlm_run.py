"""`rollout run` on a vision-language checkpoint end to end (issue 23): a Parquet file in verl's layout
(chat messages with <image> placeholders, an `images` column of {bytes, path} structs, a path relative to
the file's folder, a text-only row) -> trajectories whose prompt ids are HF's processor's and whose greedy
responses and logprobs are HF's, with each row's image grids; --resume completes a killed run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from vlm_fixtures import HFVisionReference, ReferencePrompts, build_tiny_vlm, png_bytes, random_image  # noqa: E402

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def _rollout(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "run", *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_run")
    model = build_tiny_vlm(root / "model", "qwen3_vl")
    pictures = [random_image(20, 12, 1), random_image(32, 24, 2), random_image(16, 40, 3)]
    pictures[2].save(root / "third.png")
    rows = [("what is in <image>?", [{"bytes": png_bytes(pictures[0]), "path": None}], pictures[:1]),
            ("compare <image> with <image>", [{"bytes": png_bytes(pictures[1]), "path": None},
                                              {"bytes": None, "path": "third.png"}], pictures[1:]),
            ("no picture here", [], [])]
    data = root / "prompts.parquet"
    pq.write_table(pa.table({"prompt": pa.array([[{"role": "user", "content": t}] for t, _, _ in rows], MESSAGES),
                             "images": pa.array([cell for _, cell, _ in rows], pa.list_(IMAGE)),
                             "id": [10, 11, 12]}), data)
    return model, data, rows


def _settings(model, data, out) -> list:
    return ["--model", model, "--data", data, "--out", out, "--n", 2, "--max-new-tokens", 6, "--temperature", 0,
            "--device", "cpu", "--dtype", "float32", "--shard-rows", 2, "--flush-seconds", 3600, "--max-running", 2]


def _sorted(out: Path) -> pa.Table:
    return pq.read_table(out / "trajectories").sort_by([("prompt_index", "ascending"), ("sample_index", "ascending")])


@pytest.fixture(scope="module")
def full_run(job, tmp_path_factory):
    model, data, _ = job
    out = tmp_path_factory.mktemp("vlm_full") / "out"
    result = _rollout(*_settings(model, data, out))
    assert result.returncode == 0, result.stderr
    return out


def test_images_in_parquet_match_hf(job, full_run):
    model, data, rows = job
    table = _sorted(full_run)
    got = table.to_pylist()
    assert len(got) == 6 and [r["id"] for r in got] == [10, 10, 11, 11, 12, 12]
    assert "images" not in table.column_names  # image bytes stay out of the trajectories
    ref = HFVisionReference(str(model))
    build = ReferencePrompts(str(model))
    for row in got:
        _, _, pictures = rows[row["prompt_index"]]
        images = tuple(build.image(p) for p in pictures)
        assert row["image_grid_thw"] == [list(im.grid_thw) for im in images]
        ids = row["prompt_token_ids"]
        assert ids.count(770) == sum(im.num_tokens(2) for im in images)
        want = ref.greedy(ids, images, 6)
        assert row["response_token_ids"] == want
        assert row["response_logprobs"] == pytest.approx(ref.logprobs(ids, images, want), abs=1e-4)


def test_a_killed_run_resumes_to_the_same_rows(job, full_run, tmp_path):
    """SIGKILL after 2 rows (the job's debug knob), then --resume: the rows of the uninterrupted run."""
    model, data, _ = job
    out = tmp_path / "out"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", ROLLOUT_DEBUG_SIGNAL_AFTER_ROWS="2:KILL")
    killed = subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "run", *map(str, _settings(model, data, out))],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert killed.returncode == -9
    assert 0 < pq.read_table(out / "trajectories").num_rows < 6
    resumed = _rollout(*_settings(model, data, out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    columns = ["prompt_index", "sample_index", "prompt_token_ids", "response_token_ids", "image_grid_thw"]
    assert _sorted(out).select(columns).to_pylist() == _sorted(full_run).select(columns).to_pylist()


def test_prompt_ids_are_the_processors(job, tmp_path):
    """The placeholders expanded as HF's processor expands them, images where the text put them."""
    model, data, rows = job
    out = tmp_path / "out"
    assert _rollout("--model", model, "--data", data, "--out", out, "--max-new-tokens", 1, "--device", "cpu",
                    "--limit", 1).returncode == 0
    row = pq.read_table(out / "trajectories").to_pylist()[0]
    build = ReferencePrompts(str(model))
    tokenizer = build.tokenizer
    image = build.image(rows[0][2][0])
    content = [{"type": "text", "text": "what is in "}, {"type": "image"}, {"type": "text", "text": "?"}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    at = ids.index(770)
    assert row["prompt_token_ids"] == ids[:at] + [770] * image.num_tokens(2) + ids[at + 1:]


def _score(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "score", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def test_rollout_score_pairs_an_image_runs_trajectories_with_its_images(job, full_run, tmp_path):
    """The trajectories hold the image tokens, not the pixels: score reads them from the run's prompt file (its
    manifest names it) by prompt_index, and teacher forcing gives the run's logprobs (float32, 1e-4)."""
    model, data, _ = job
    out = tmp_path / "scores"
    result = _score("--model", model, "--data", full_run, "--out", out, "--device", "cpu", "--dtype", "float32",
                    "--quiet")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == 6 and manifest["max_abs_diff"] < 1e-4
    # a prompt file elsewhere, or without the images, is named in one line and nothing is written
    missing = _score("--model", model, "--data", full_run, "--out", tmp_path / "none", "--device", "cpu",
                     "--images-from", tmp_path / "moved.parquet", "--quiet")
    assert missing.returncode != 0 and "--images-from" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1 and not (tmp_path / "none").exists()


def test_aborted_image_samples_continue_to_the_uninterrupted_rows(job, full_run, tmp_path):
    """--resume --continue-aborted on an image run: the aborted rows (made here from the full run's, as the
    daemon's abort writes them: the response so far, finish_reason abort) hold no pixels; the prompt file's
    rows give each continuation its images back, and the rows equal the uninterrupted run's."""
    import shutil

    model, data, _ = job
    from trajectory_edits import cut_response, edit_trajectory_rows

    out = tmp_path / "out"
    shutil.copytree(full_run, out)
    # the second sample of every prompt, cut after 2 tokens
    assert edit_trajectory_rows(out, lambda row: row["sample_index"] == 1 and not cut_response(row, 2)) == 3
    result = _rollout(*_settings(model, data, out), "--resume", "--continue-aborted")
    assert result.returncode == 0, result.stderr
    columns = ["prompt_index", "sample_index", "prompt_token_ids", "response_token_ids", "finish_reason",
               "image_grid_thw"]
    got, want = _sorted(out), _sorted(full_run)
    assert got.select(columns).to_pylist() == want.select(columns).to_pylist()
    for a, b in zip(got.column("response_logprobs").to_pylist(), want.column("response_logprobs").to_pylist(),
                    strict=True):
        assert a == pytest.approx(b, abs=1e-4)
