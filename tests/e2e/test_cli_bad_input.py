"""`rollout run` on bad input: one `error:` line on stderr, non-zero exit, no traceback, OUT untouched.

Every case is a real subprocess (`python -m rollout_cli.cli.main run ...`). Each start costs
~2 s of imports, so the module fixture launches all cases at once on a small thread pool and
the tests only look at the results.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "example_model"
PROMPTS = REPO / "recipes" / "prompts.parquet"
CLI = [sys.executable, "-m", "rollout_cli.cli.main", "run"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


class _PickleBomb:
    """Unpickling this creates the file `path`: proof that a loader ran pickle code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _model_copy(root: Path, name: str, skip: tuple[str, ...] = ()) -> Path:
    dst = root / name
    dst.mkdir()
    for f in MODEL.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


def _cases(root: Path) -> dict[str, tuple[list[str], Path, tuple[str, ...]]]:
    """name -> (CLI args, OUT, key words the error line must hold, case-insensitive)."""
    data = root / "data"
    data.mkdir()
    pq.write_table(pa.table({"question": ["What is 1 + 1?"], "answer": ["2"]}), data / "no_prompt.parquet")
    pq.write_table(pa.table({"prompt": ["What is 1 + 1?", "", "hi"]}), data / "empty.parquet")
    pq.write_table(pa.table({"prompt": ["hi", "count with me: " + "one two three " * 40]}), data / "long.parquet")
    (data / "garbage.parquet").write_bytes(b"this is not parquet at all\n" * 20)

    no_config = _model_copy(root, "no_config", skip=("config.json",))
    no_weights = _model_copy(root, "no_weights", skip=("model.safetensors",))
    pickle_only = _model_copy(root, "pickle_only", skip=("model.safetensors",))
    (pickle_only / "pytorch_model.bin").write_bytes(pickle.dumps(_PickleBomb(str(root / "PICKLE_RAN"))))
    bad_arch = _model_copy(root, "bad_arch")
    config = json.loads((bad_arch / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad_arch / "config.json").write_text(json.dumps(config))

    def case(name, data_file=PROMPTS, model=MODEL, extra=(), words=()):
        out = root / "out" / name
        args = ["--model", str(model), "--data", str(data_file), "--out", str(out), "--n", "2",
                "--max-new-tokens", "4", *extra]
        if "--device" not in extra:
            args += ["--device", "cpu"]
        return args, out, words

    return {
        "missing_prompt_column": case("missing_prompt_column", data / "no_prompt.parquet",
                                      words=("no column 'prompt'", "question", "--prompt-key")),
        "empty_prompt": case("empty_prompt", data / "empty.parquet", words=("row 1", "empty prompt", "--skip-invalid")),
        "prompt_too_long": case("prompt_too_long", data / "long.parquet", extra=("--max-model-len", "32"),
                                words=("row 1", "exceeds", "--max-model-len")),
        "unreadable_parquet": case("unreadable_parquet", data / "garbage.parquet",
                                   words=("garbage.parquet", "not a readable parquet", "--data")),
        "missing_data_file": case("missing_data_file", data / "nope.parquet",
                                  words=("nope.parquet", "does not exist", "--data")),
        "model_without_config": case("model_without_config", model=no_config,
                                     words=("config.json", "checkpoint")),
        "model_without_weights": case("model_without_weights", model=no_weights,
                                      words=("safetensors", str(no_weights))),
        "model_pickle_only": case("model_pickle_only", model=pickle_only,
                                  words=("pytorch_model.bin", "pickle", "run code", "safetensors")),
        "unsupported_architecture": case("unsupported_architecture", model=bad_arch,
                                         words=("unsupported architecture", "GPT2LMHeadModel", "supported:",
                                                "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM")),
        "unknown_dtype": case("unknown_dtype", extra=("--dtype", "float64"),
                              words=("--dtype", "float64", "float32", "bfloat16")),
        "unknown_device": case("unknown_device", extra=("--device", "tpu"), words=("--device", "tpu", "cpu", "cuda")),
        "bogus_logprobs_mode": case("bogus_logprobs_mode", extra=("--logprobs-mode", "bogus"),
                                    words=("--logprobs-mode", "bogus", "processed", "raw")),
        "negative_n": case("negative_n", extra=("--n", "-3"), words=("--n", "at least 1")),
    }


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every bad-input run plus the non-empty-OUT run, started together; name -> (future, OUT, words)."""
    root = tmp_path_factory.mktemp("bad_input")
    cases = _cases(root)

    nonempty = root / "out" / "nonempty"
    (nonempty / "trajectories").mkdir(parents=True)
    (nonempty / "notes.txt").write_text("my earlier results\n")
    (nonempty / "trajectories" / "part-00000.parquet").write_bytes(b"not ours to touch")
    before = _snapshot(nonempty)
    cases["nonempty_out"] = (["--model", str(MODEL), "--data", str(PROMPTS), "--out", str(nonempty),
                              "--n", "2", "--max-new-tokens", "4", "--device", "cpu"],
                             nonempty, ("not empty", "--resume", "--out"))

    pool = ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2)))
    futures: dict[str, tuple[Future, Path, tuple[str, ...]]] = {
        name: (pool.submit(_run, args), out, words) for name, (args, out, words) in cases.items()
    }
    yield {"cases": futures, "root": root, "nonempty_before": before}
    pool.shutdown(wait=True)


def _check_one_error_line(result: subprocess.CompletedProcess, words: tuple[str, ...]) -> str:
    assert result.returncode != 0, f"exit 0 on bad input; stderr: {result.stderr!r}"
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one stderr line, got {len(lines)}: {result.stderr!r}"
    line = lines[0]
    assert line.startswith("error: "), line
    for word in words:
        assert word.lower() in line.lower(), f"{word!r} missing from: {line}"
    return line


BAD_CASES = [
    "missing_prompt_column", "empty_prompt", "prompt_too_long", "unreadable_parquet", "missing_data_file",
    "model_without_config", "model_without_weights", "model_pickle_only", "unsupported_architecture",
    "unknown_dtype", "unknown_device", "bogus_logprobs_mode", "negative_n",
]


@pytest.mark.parametrize("name", BAD_CASES)
def test_bad_input_is_one_error_line_and_writes_nothing(launched, name):
    future, out, words = launched["cases"][name]
    result = future.result()
    _check_one_error_line(result, words)
    assert not out.exists(), f"{out} was created: {sorted(p.name for p in out.rglob('*'))}"


def test_pickle_weights_are_never_unpickled(launched):
    future, _, _ = launched["cases"]["model_pickle_only"]
    future.result()
    assert not (launched["root"] / "PICKLE_RAN").exists(), "the pickle in pytorch_model.bin was loaded"


def test_nonempty_out_without_resume_is_refused_and_left_unchanged(launched):
    future, out, words = launched["cases"]["nonempty_out"]
    _check_one_error_line(future.result(), words)
    assert _snapshot(out) == launched["nonempty_before"]
