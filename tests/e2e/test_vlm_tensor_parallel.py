"""Vision-language models under --tp on the CPU (gloo, two processes): the language model is split, the
vision tower runs whole on every rank. `rollout run --tp 2` on an image Parquet writes --tp 1's greedy
tokens and image grids (logprobs within float32 all-reduce drift), and a reload that changes only the
vision tower reaches every rank's tower and image-embedding cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from rollout_cli import Engine

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from test_cli_tensor_parallel import HYBRID_LP_TOL, _env, _rows, _run  # noqa: E402
from vlm_fixtures import build_tiny_vlm, png_bytes, random_image  # noqa: E402

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@pytest.fixture(scope="module")
def image_prompts(tmp_path_factory) -> Path:
    """One image, two images (one shared with the first row: the prefix cache keys it by its pixels), text only."""
    path = tmp_path_factory.mktemp("vlm_tp") / "prompts.parquet"
    first, second = png_bytes(random_image(20, 12, 1)), png_bytes(random_image(32, 24, 2))
    rows = [("what is in <image>?", [first]), ("compare <image> with <image>", [second, first]),
            ("no picture here", [])]
    pq.write_table(pa.table({
        "prompt": pa.array([[{"role": "user", "content": text}] for text, _ in rows], MESSAGES),
        "images": pa.array([[{"bytes": b, "path": None} for b in cells] for _, cells in rows], pa.list_(IMAGE))}),
        path)
    return path


# Qwen3-VL-MoE: deepstack features, the hub's transposed expert stacks split by rank; Qwen3.5: the hybrid model
@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "qwen3_5"])
def test_image_run_under_tp2_equals_tp1(image_prompts, tmp_path, arch):
    model = build_tiny_vlm(tmp_path / arch, arch)
    args = ["--model", model, "--data", image_prompts, "--n", "2", "--max-new-tokens", "6", "--temperature", "0",
            "--device", "cpu", "--dtype", "float32", "--quiet"]
    one = _run(*args, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    two = _run(*args, "--out", tmp_path / "two", "--tp", "2")
    assert two.returncode == 0, two.stderr
    want, got = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert len(want) == 6
    assert len({tuple(r["response_token_ids"]) for r in want}) == 3  # the prompts' greedy outputs differ
    for a, b in zip(got, want, strict=True):
        key = (a["prompt_index"], a["sample_index"])
        assert a["prompt_token_ids"] == b["prompt_token_ids"] and a["image_grid_thw"] == b["image_grid_thw"], key
        assert a["response_token_ids"] == b["response_token_ids"], key
        assert a["response_logprobs"] == pytest.approx(b["response_logprobs"], abs=HYBRID_LP_TOL), key
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["engine"]["tensor_parallel"] == 2


def test_reload_of_the_vision_tower_reaches_every_rank(tmp_path):
    from tp_vlm_driver import greedy, image_prompts as driver_prompts

    model_a = build_tiny_vlm(tmp_path / "a", "qwen3_vl", seed=11)
    model_b = build_tiny_vlm(tmp_path / "b_seed", "qwen3_vl", seed=12)
    tensors = load_file(str(model_a / "model.safetensors"))
    changed = {k: v for k, v in load_file(str(model_b / "model.safetensors")).items() if k.startswith("model.visual.")}
    assert changed
    tensors.update(changed)
    save_file(tensors, str(model_b / "model.safetensors"))  # B: A's language model, another vision tower
    out = tmp_path / "tp2.json"
    driver = REPO / "tests" / "e2e" / "tp_vlm_driver.py"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(driver), str(model_a), str(model_b), str(out)],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(out.read_text())

    prompts = driver_prompts(str(model_a))
    options = dict(device="cpu", dtype="float32", max_model_len=256, max_batch_tokens=64)
    want_a = greedy(Engine(str(model_a), **options), prompts)
    want_b = greedy(Engine(str(model_b), **options), prompts)
    assert [w[1] for w in want_a] != [w[1] for w in want_b]  # the tower alone changes the image prompts' outputs
    assert got["b_version"] == "1"
    for key, want, version in (("a", want_a, "0"), ("b", want_b, "1")):
        assert len(got[key]) == len(want) == 6
        for (index, tokens, logprobs, v), (want_index, want_tokens, want_logprobs, _) in zip(got[key], want,
                                                                                             strict=True):
            assert index == want_index and tokens == want_tokens, key
            assert logprobs == pytest.approx(want_logprobs, abs=HYBRID_LP_TOL), key
            assert v == version, key
