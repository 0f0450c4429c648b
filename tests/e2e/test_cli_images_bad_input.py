"""`rollout run` on image rows that cannot run (issue 23, item 1): one `error:` line naming the row, exit 2,
OUT never created; `--skip-invalid` lists them in the manifest instead. Runs only to the validation of the
rows, on a tiny Qwen3-VL checkpoint (tests/vlm_fixtures.py); a run that generates is the model's tests' job.

Each case is a real subprocess, all started at once on a small thread pool (imports cost ~2 s a start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "rollout_cli.cli.main", "run"]
sys.path.insert(0, str(REPO / "tests"))
from vlm_fixtures import EXAMPLE_MODEL, build_tiny_vlm, png_bytes, random_image  # noqa: E402

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def _verl(path: Path, rows: list[tuple[str, list]]) -> Path:
    pq.write_table(pa.table({"prompt": pa.array([[{"role": "user", "content": t}] for t, _ in rows], MESSAGES),
                             "images": pa.array([images for _, images in rows], pa.list_(IMAGE))}), path)
    return path


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("image_bad_input")
    vlm = build_tiny_vlm(root / "vlm", "qwen3_vl")
    good = {"bytes": png_bytes(random_image(16, 16, 0)), "path": None}
    data = {
        "corrupt": _verl(root / "corrupt.parquet", [("fine <image>", [good]),
                                                    ("see <image>", [{"bytes": b"garbage", "path": None}])]),
        "missing_path": _verl(root / "missing_path.parquet", [("see <image>", [{"bytes": None, "path": "gone.png"}])]),
        "placeholders": _verl(root / "placeholders.parquet", [("ok", []), ("two <image> <image>", [good])]),
    }
    cases = {
        "corrupt": (vlm, data["corrupt"], (), ("row 1 of", "image 1 of the row cannot be decoded", "--skip-invalid")),
        "missing_path": (vlm, data["missing_path"], (), ("row 0 of", "no file", "gone.png", "--skip-invalid")),
        "placeholders": (vlm, data["placeholders"], (),
                         ("row 1 of", "2 image placeholders", "the row has 1 image", "--skip-invalid")),
        # before the model loads: the named column is checked with the prompt column
        "missing_image_key": (vlm, data["corrupt"], ("--image-key", "pics"),
                              ("no column 'pics'", "prompt, images", "--image-key")),
        "text_only_model": (EXAMPLE_MODEL, data["corrupt"], (),
                            ("row 0 of", "column 'images'", "text-only", "drop that column")),
    }
    outs = {name: root / "out" / name for name in [*cases, "skip_invalid"]}
    args = {name: ["--model", str(model), "--data", str(path), "--out", str(outs[name]), "--device", "cpu",
                   "--max-new-tokens", "2", *extra] for name, (model, path, extra, _) in cases.items()}
    both_bad = _verl(root / "both_bad.parquet", [("see <image>", [{"bytes": b"garbage", "path": None}]),
                                                 ("two <image> <image>", [good])])
    args["skip_invalid"] = ["--model", str(vlm), "--data", str(both_bad), "--out", str(outs["skip_invalid"]),
                            "--device", "cpu", "--max-new-tokens", "2", "--skip-invalid", "--quiet"]
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        futures = {name: pool.submit(_run, a) for name, a in args.items()}
        results = {name: f.result() for name, f in futures.items()}
    return results, outs, {name: words for name, (_, _, _, words) in cases.items()}


@pytest.mark.parametrize("name", ["corrupt", "missing_path", "placeholders", "missing_image_key", "text_only_model"])
def test_bad_image_rows_are_one_error_line_and_write_nothing(launched, name):
    results, outs, words = launched
    result = results[name]
    assert result.returncode == 2, f"exit {result.returncode}; stderr: {result.stderr!r}"
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words[name]:
        assert word in lines[0], f"{word!r} missing from: {lines[0]}"
    assert not outs[name].exists()


def test_skip_invalid_lists_bad_image_rows_in_the_manifest(launched):
    results, outs, _ = launched
    result = results["skip_invalid"]
    assert result.returncode == 0, result.stderr
    manifest = json.loads((outs["skip_invalid"] / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["image_key"] is None
    skipped = manifest["skipped_rows"]
    assert [s["prompt_index"] for s in skipped] == [0, 1]
    assert "cannot be decoded" in skipped[0]["reason"] and "2 image placeholders" in skipped[1]["reason"]
    assert manifest["trajectories"] == 0
