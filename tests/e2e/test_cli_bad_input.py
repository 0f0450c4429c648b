"""`rollout run` on bad input: one `error:` line on stderr, exit 2, no traceback, OUT untouched.

Every case is a real subprocess (`python -m rollout_cli.cli.main run ...`). Each start costs
~2 s of imports, so the module fixture launches all cases at once on a small thread pool and
the tests only look at the results. Failures after OUT exists (a full disk, a bad cell found
mid-run) leave a manifest in a final state, `interrupted` or `failed`, never `running`; the
disk-full cases run in-process, with pyarrow's writer patched to fail as a full disk does.
"""

from __future__ import annotations

import errno
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


def with_invalid_utf8(values: list[str], bad_row: int) -> pa.Array:
    """A string array whose row `bad_row` starts with the byte 0xff: Parquet stores it without a check."""
    good = pa.array(values, pa.string())
    data = bytearray(good.buffers()[2].to_pybytes())
    data[sum(len(v.encode()) for v in values[:bad_row])] = 0xFF
    return pa.Array.from_buffers(pa.string(), len(values), [None, good.buffers()[1], pa.py_buffer(bytes(data))])


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
    pq.write_table(pa.table({"prompt": with_invalid_utf8(["What is 1 + 1?", "What is 2 + 2?"], 1)}),
                   data / "bad_utf8.parquet")
    pq.write_table(pa.table({"prompt": [17, 18]}), data / "int_prompt.parquet")
    # over the tokenizer's model_max_length (2048): transformers would warn on stderr
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "one two three " * 900}]]}),
                   data / "long_chat.parquet")

    no_config = _model_copy(root, "no_config", skip=("config.json",))
    no_weights = _model_copy(root, "no_weights", skip=("model.safetensors",))
    pickle_only = _model_copy(root, "pickle_only", skip=("model.safetensors",))
    (pickle_only / "pytorch_model.bin").write_bytes(pickle.dumps(_PickleBomb(str(root / "PICKLE_RAN"))))
    bad_arch = _model_copy(root, "bad_arch")
    config = json.loads((bad_arch / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad_arch / "config.json").write_text(json.dumps(config))
    no_positions = _model_copy(root, "no_positions")  # ran with a made-up 4096 positions
    (no_positions / "config.json").write_text(json.dumps(dict(config, architectures=["Qwen3ForCausalLM"],
                                                              max_position_embeddings=0)))
    rope_shrinks = _model_copy(root, "rope_shrinks")  # transformers only warned
    shrinks = dict(config, architectures=["Qwen3ForCausalLM"], rope_scaling={"rope_type": "linear", "factor": -2})
    shrinks.pop("rope_parameters")
    (rope_shrinks / "config.json").write_text(json.dumps(shrinks))

    def case(name, data_file=PROMPTS, model=MODEL, extra=(), words=(), out=None):
        out = out or root / "out" / name
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
        # the stream is keyed by the seed's 64 bits: -1 was silently the seed 2^64 - 1
        "negative_seed": case("negative_seed", extra=("--seed", "-1"), words=("--seed -1 is out of range", "2^64")),
        "seed_past_64_bits": case("seed_past_64_bits", extra=("--seed", str(2**64)),
                                  words=(f"--seed {2**64} is out of range", "[0, 2^64 - 1]")),
        "shard_rows_zero": case("shard_rows_zero", extra=("--shard-rows", "0"), words=("--shard-rows", "at least 1")),
        # tuning flags of a feature left off are refused, not silently ignored
        "max_turns_without_env": case("max_turns_without_env", extra=("--max-turns", "3"),
                                      words=("--max-turns", "--env")),
        "draft_tokens_without_speculative": case("draft_tokens_without_speculative", extra=("--num-draft-tokens", "3"),
                                                 words=("--num-draft-tokens", "--speculative siblings or mtp")),
        "flush_seconds_negative": case("flush_seconds_negative", extra=("--flush-seconds", "-1"),
                                       words=("--flush-seconds", "-1", "0 or more")),
        "prompt_not_utf8": case("prompt_not_utf8", data / "bad_utf8.parquet",
                                words=("row 1", "not valid UTF-8", "byte 0xff", "--skip-invalid")),
        "int_prompt": case("int_prompt", data / "int_prompt.parquet", words=("row 0", "prompt is an int;")),
        "long_chat_prompt": case("long_chat_prompt", data / "long_chat.parquet",
                                 words=("row 0", "exceeds the limit of 2047", "--skip-invalid")),
        "out_uncreatable": case("out_uncreatable", out=Path("/proc/rollout-bad-input/out"),
                                words=("cannot create --out /proc/rollout-bad-input/out", "choose another --out")),
        "max_position_embeddings_zero": case("max_position_embeddings_zero", model=no_positions,
                                             words=("max_position_embeddings is 0", "positive integer")),
        "rope_factor_negative": case("rope_factor_negative", model=rope_shrinks,
                                     words=("rope_scaling factor is -2", ">= 1", "config.json")),
        "max_model_len_past_positions": case("max_model_len_past_positions", extra=("--max-model-len", "100000"),
                                             words=("--max-model-len 100000", "2048 positions",
                                                    "max_position_embeddings", "rope_scaling")),
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

    # after OUT exists: --skip-invalid leaves the non-UTF-8 row out; a kept row's bad passthrough cell fails the run
    data = root / "data"
    cases["skip_not_utf8"] = (["--model", str(MODEL), "--data", str(data / "bad_utf8.parquet"), "--out",
                               str(root / "out" / "skip_not_utf8"), "--n", "2", "--max-new-tokens", "4",
                               "--device", "cpu", "--skip-invalid", "--quiet"], root / "out" / "skip_not_utf8", ())
    pq.write_table(pa.table({"prompt": ["hi", "yo"], "note": with_invalid_utf8(["a", "b"], 1)}),
                   data / "bad_passthrough.parquet")
    cases["passthrough_not_utf8"] = (["--model", str(MODEL), "--data", str(data / "bad_passthrough.parquet"),
                                      "--out", str(root / "out" / "passthrough_not_utf8"), "--n", "2",
                                      "--max-new-tokens", "4", "--device", "cpu", "--quiet"],
                                     root / "out" / "passthrough_not_utf8",
                                     ("row 1", "column 'note' is not valid UTF-8", "fix or drop that row"))

    pool = ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2)))
    futures: dict[str, tuple[Future, Path, tuple[str, ...]]] = {
        name: (pool.submit(_run, args), out, words) for name, (args, out, words) in cases.items()
    }
    yield {"cases": futures, "root": root, "nonempty_before": before}
    pool.shutdown(wait=True)


def _check_one_error_line(result: subprocess.CompletedProcess, words: tuple[str, ...]) -> str:
    assert result.returncode == 2, f"exit {result.returncode} on bad input; stderr: {result.stderr!r}"
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
    "unknown_dtype", "unknown_device", "bogus_logprobs_mode", "negative_n", "negative_seed", "seed_past_64_bits",
    "shard_rows_zero",
    "flush_seconds_negative", "prompt_not_utf8", "int_prompt", "long_chat_prompt", "out_uncreatable",
    "max_model_len_past_positions", "max_turns_without_env", "draft_tokens_without_speculative",
    "max_position_embeddings_zero", "rope_factor_negative",
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


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_skip_invalid_leaves_a_non_utf8_prompt_out(launched):
    future, out, _ = launched["cases"]["skip_not_utf8"]
    result = future.result()
    assert result.returncode == 0, result.stderr
    manifest = _manifest(out)
    assert manifest["status"] == "complete" and manifest["trajectories"] == 2
    reason = "prompt is not valid UTF-8 (byte 0xff at offset 0)"
    assert manifest["skipped_rows"] == [{"prompt_index": 1, "reason": reason}]
    assert {r["prompt_index"] for r in pq.read_table(out / "trajectories").to_pylist()} == {0}


def test_a_bad_cell_found_mid_run_leaves_a_failed_manifest(launched):
    future, out, words = launched["cases"]["passthrough_not_utf8"]
    line = _check_one_error_line(future.result(), words)
    manifest = _manifest(out)
    assert manifest["status"] == "failed" and manifest["error"] == line.removeprefix("error: ")
    assert not [p for p in (out / "trajectories").iterdir() if p.name.startswith(".")]


# ---- a full disk, in-process: pyarrow's writer raises what a full disk raises ----------------------


def _invoke(args: list[str]):
    from typer.testing import CliRunner

    from rollout_cli.cli.main import app

    return CliRunner().invoke(app, ["run", *args])


def _fail_shard_writes(monkeypatch, from_call: int, err: OSError) -> None:
    """Shard writes number `from_call` (1-based) and later write half a file, then raise `err`."""
    calls = {"n": 0}
    real = pq.write_table

    def write_table(table, where, **kwargs):
        calls["n"] += 1
        if calls["n"] < from_call:
            return real(table, where, **kwargs)
        Path(where).write_bytes(b"PAR1 half a shard")
        raise err

    monkeypatch.setattr(pq, "write_table", write_table)


def _args(out: Path, *extra: str) -> list[str]:
    return ["--model", str(MODEL), "--data", str(PROMPTS), "--out", str(out), "--limit", "3", "--n", "2",
            "--max-new-tokens", "4", "--shard-rows", "2", "--device", "cpu", "--quiet", *extra]


def _pairs(out: Path) -> list[tuple[int, int]]:
    rows = pq.read_table(out / "trajectories").to_pylist()
    return sorted((r["prompt_index"], r["sample_index"]) for r in rows)


def test_disk_full_is_one_line_an_interrupted_manifest_and_resume_completes(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _fail_shard_writes(monkeypatch, 2, OSError(errno.ENOSPC, "No space left on device"))
    result = _invoke(_args(out))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    shard = out / "trajectories" / "part-00001.parquet"
    assert lines == [f"error: disk full writing {shard}: free space and re-run with --resume"]
    manifest = _manifest(out)
    assert manifest["status"] == "interrupted" and manifest["error"] == lines[0].removeprefix("error: ")
    assert manifest["trajectories"] == manifest["trajectories_this_run"] == 2
    # the first shard is whole, the half-written one is gone (its temp file too)
    assert sorted(os.listdir(out / "trajectories")) == ["part-00000.parquet"]
    assert pq.read_table(out / "trajectories").num_rows == 2

    monkeypatch.undo()  # space freed
    resumed = _invoke(_args(out, "--resume"))
    assert resumed.exit_code == 0, resumed.output
    assert _manifest(out)["status"] == "complete" and "error" not in _manifest(out)
    assert _pairs(out) == [(p, s) for p in range(3) for s in range(2)]


def test_another_write_error_is_one_line_and_a_failed_manifest(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _fail_shard_writes(monkeypatch, 1, OSError(errno.EIO, "Input/output error"))
    result = _invoke(_args(out))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    shard = out / "trajectories" / "part-00000.parquet"
    assert lines == [f"error: cannot write {shard} (Input/output error); fix that and re-run with --resume"]
    manifest = _manifest(out)
    assert manifest["status"] == "failed" and manifest["error"] == lines[0].removeprefix("error: ")
    assert os.listdir(out / "trajectories") == []
