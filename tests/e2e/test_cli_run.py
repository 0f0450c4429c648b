"""`rollout run` end to end on the CPU: output layout and dtypes, prompt forms, passthrough, --skip-invalid,
--load-format dummy, --help, and the Python API.

The CLI runs are real subprocesses; each start costs ~2 s of imports, so the module fixture starts
them all at once on a small thread pool and the tests look at the results.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_cli.io.trajectories import nanoseconds_as_ints

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "example_model"
PROMPTS = REPO / "recipes" / "prompts.parquet"
CLI = [sys.executable, "-m", "rollout_cli.cli.main", "run"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

FIXED = [
    ("prompt_index", pa.int64()),
    ("sample_index", pa.int32()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("response_token_ids", pa.list_(pa.int32())),
    ("response_logprobs", pa.list_(pa.float32())),
    ("response_text", pa.string()),
    ("finish_reason", pa.string()),
    ("weight_version", pa.string()),
    ("response_weight_versions", pa.list_(pa.string())),
]
FIXED_NAMES = [name for name, _ in FIXED]

STRING_PROMPTS = ["What is 1 + 1?", "Name a prime number.", "Say hi.", "Count to three."]
TOKEN_PROMPTS = [[5, 17, 300, 42], [1, 2, 3], [700, 12, 12, 12, 9, 4], [33], [100, 200]]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("COLUMNS", None)  # --help at the width a pipe gets (80)
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return result


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _rows(out: Path) -> pa.Table:
    files = sorted(os.listdir(out / "trajectories"))
    assert files and all(re.fullmatch(r"part-\d{5}\.parquet", f) for f in files), files
    return pq.read_table(out / "trajectories")


def _nested_passthrough_table(prompt_column: str, prompts) -> pa.Table:
    k = len(prompts)
    meta_type = pa.struct([("source", pa.string()), ("tags", pa.list_(pa.string())),
                           ("inner", pa.struct([("x", pa.int64()), ("y", pa.float64())]))])
    meta = [{"source": f"src{i}", "tags": ["a", f"t{i}"][: 1 + i % 2], "inner": {"x": i * 10, "y": i / 4}}
            for i in range(k)]
    return pa.table({
        "id": pa.array([1000 + i for i in range(k)], pa.int64()),
        prompt_column: prompts,
        "meta": pa.array(meta, meta_type),
        "scores": pa.array([[1.5, 0.5], [], [1e9], [-2.0, 3.0, 4.0], [0.0]][:k], pa.list_(pa.float64())),
        "label": pa.array(["x", None, "z", "w", "v"][:k], pa.string()),
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_run")
    data = root / "data"
    data.mkdir()

    # Text prompts in a column named 'question'; the 'prompt' column is a decoy no model can take.
    text = _nested_passthrough_table("question", STRING_PROMPTS).append_column(
        "prompt", pa.array([None, 3.5, None, 1.0], pa.float64()))
    pq.write_table(text, data / "text.parquet")
    pq.write_table(_nested_passthrough_table("prompt", pa.array(TOKEN_PROMPTS, pa.list_(pa.int64()))),
                   data / "ids.parquet")
    pq.write_table(pa.table({"prompt": ["What is 2 + 2?", "", "count " * 200, "Say hi."],
                             "row": [0, 1, 2, 3]}), data / "mixed.parquet")

    dummy_model = root / "dummy_model"
    dummy_model.mkdir()
    for name in ("config.json", *TOKENIZER_FILES):
        if (MODEL / name).exists():
            shutil.copy(MODEL / name, dummy_model / name)

    common = ["--device", "cpu", "--quiet"]
    jobs = {
        "main": ["--model", str(MODEL), "--data", str(PROMPTS), "--out", str(root / "main"),
                 "--n", "4", "--max-new-tokens", "32", "--seed", "1", "--device", "cpu"],  # bar + summary on
        "text": ["--model", str(MODEL), "--data", str(data / "text.parquet"), "--out", str(root / "text"),
                 "--prompt-key", "question", "--n", "3", "--max-new-tokens", "6", *common],
        "ids": ["--model", str(MODEL), "--data", str(data / "ids.parquet"), "--out", str(root / "ids"),
                "--limit", "3", "--n", "2", "--max-new-tokens", "5", "--temperature", "0", *common],
        "skip": ["--model", str(MODEL), "--data", str(data / "mixed.parquet"), "--out", str(root / "skip"),
                 "--skip-invalid", "--max-model-len", "64", "--n", "2", "--max-new-tokens", "4", *common],
        "dummy": ["--model", str(dummy_model), "--data", str(PROMPTS), "--out", str(root / "dummy"),
                  "--load-format", "dummy", "--limit", "4", "--n", "2", "--max-new-tokens", "4", *common],
        "help": ["--help"],
    }
    pool = ThreadPoolExecutor(max_workers=max(2, min(3, os.cpu_count() or 2)))
    futures = {name: pool.submit(_run, args) for name, args in jobs.items()}
    yield {"root": root, "data": data, "futures": futures}
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL), local_files_only=True)


def test_main_run_output_layout_dtypes_and_counts(runs):
    result = _ok(runs["futures"]["main"].result())
    assert "64/64" in result.stderr and "complete" in result.stderr, result.stderr  # progress bar, summary
    out = runs["root"] / "main"
    table = _rows(out)
    source = pq.read_table(PROMPTS)
    assert table.num_rows == 64 * 4

    passthrough = [f for f in source.schema if f.name != "prompt"]
    assert table.schema.names == FIXED_NAMES + [f.name for f in passthrough]
    for name, type_ in FIXED:
        assert table.schema.field(name).type == type_, (name, table.schema.field(name).type)
    for field in passthrough:
        assert table.schema.field(field.name).type == field.type, field.name

    rows = table.to_pylist()
    pairs = Counter((r["prompt_index"], r["sample_index"]) for r in rows)
    assert set(pairs) == {(p, s) for p in range(64) for s in range(4)}
    assert max(pairs.values()) == 1, "duplicate (prompt_index, sample_index) rows"

    inputs = source.to_pylist()
    for r in rows:
        resp = r["response_token_ids"]
        assert 1 <= len(resp) <= 32
        assert len(r["response_logprobs"]) == len(resp)
        assert all(lp <= 1e-6 and lp == lp for lp in r["response_logprobs"])
        assert r["finish_reason"] in ("stop", "length")
        if r["finish_reason"] == "length":
            assert len(resp) == 32
        else:
            assert resp[-1] in (0, 2), resp  # eos ids of generation_config.json
        assert isinstance(r["response_text"], str)
        assert r["weight_version"] == "0" and r["response_weight_versions"] == ["0"] * len(resp)
        src = inputs[r["prompt_index"]]
        for field in passthrough:
            assert r[field.name] == src[field.name], (field.name, r["prompt_index"])

    # All samples of one prompt share its prompt tokens.
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_index"], set()).add(tuple(r["prompt_token_ids"]))
    assert all(len(v) == 1 for v in by_prompt.values())

    m = _manifest(out)
    assert m["status"] == "complete"
    assert m["prompts"] == m["prompts_done"] == 64
    assert m["trajectories"] == m["trajectories_this_run"] == 256
    assert sum(m["finish_reasons_this_run"].values()) == 256
    assert m["finish_reasons_this_run"].get("length", 0) == sum(r["finish_reason"] == "length" for r in rows)
    assert m["output_tokens_this_run"] == sum(len(r["response_token_ids"]) for r in rows)
    assert 0 < m["prefix_hit_rate"] <= 1, m["prefix_hit_rate"]
    assert m["skipped_rows"] == []
    s = m["sampling"]
    assert (s["n"], s["max_new_tokens"], s["seed"], s["temperature"]) == (4, 32, 1, 1.0)
    assert m["prompt_key"] == "prompt" and m["limit"] is None
    assert m["engine"]["device"] == "cpu" and m["engine"]["dtype"] == "float32"
    assert m["engine"]["admission_pacing"] is True  # the default; timing only (nothing held on the CPU)
    assert not [f for f in os.listdir(out / "trajectories") if f.endswith(".tmp")]


def test_chat_prompts_use_the_chat_template(runs, tokenizer):
    _ok(runs["futures"]["main"].result())
    table = _rows(runs["root"] / "main")
    messages = pq.read_table(PROMPTS, columns=["prompt"]).column(0).to_pylist()
    seen = {}
    for r in table.select(["prompt_index", "prompt_token_ids"]).to_pylist():
        seen[r["prompt_index"]] = r["prompt_token_ids"]
    for i in (0, 1, 63):
        text = tokenizer.apply_chat_template(messages[i], add_generation_prompt=True, tokenize=False)
        assert text.endswith("assistant\n")
        assert seen[i] == tokenizer(text, add_special_tokens=False)["input_ids"], i


def _check_passthrough(table: pa.Table, source: pa.Table, prompt_column: str, n: int, prompt_indices):
    passthrough = [f for f in source.schema if f.name != prompt_column]
    assert table.schema.names == FIXED_NAMES + [f.name for f in passthrough]
    for field in passthrough:
        assert table.schema.field(field.name).type == field.type, field.name
    src = source.to_pylist()
    rows = table.to_pylist()
    assert sorted((r["prompt_index"], r["sample_index"]) for r in rows) == \
        [(p, s) for p in prompt_indices for s in range(n)]
    for r in rows:
        for field in passthrough:
            assert r[field.name] == src[r["prompt_index"]][field.name], (field.name, r["prompt_index"])
    return rows


def test_text_prompts_prompt_key_and_nested_passthrough(runs, tokenizer):
    _ok(runs["futures"]["text"].result())
    out = runs["root"] / "text"
    source = pq.read_table(runs["data"] / "text.parquet")
    rows = _check_passthrough(_rows(out), source, "question", 3, range(4))
    for r in rows:
        assert r["prompt_token_ids"] == tokenizer(STRING_PROMPTS[r["prompt_index"]])["input_ids"]
        assert r["prompt"] == source.column("prompt")[r["prompt_index"]].as_py()  # decoy passed through
    assert _manifest(out)["prompt_key"] == "question"


def test_token_id_prompts_and_limit(runs):
    _ok(runs["futures"]["ids"].result())
    out = runs["root"] / "ids"
    source = pq.read_table(runs["data"] / "ids.parquet")
    rows = _check_passthrough(_rows(out), source, "prompt", 2, range(3))  # --limit 3 of 5 rows
    for r in rows:
        assert r["prompt_token_ids"] == TOKEN_PROMPTS[r["prompt_index"]]
    # Greedy: both samples of a prompt are the same.
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_index"], []).append(r["response_token_ids"])
    assert all(a == b for a, b in by_prompt.values())
    m = _manifest(out)
    assert m["limit"] == 3 and m["prompts"] == 3 and m["trajectories"] == 6


def test_skip_invalid_lists_bad_rows_and_generates_the_rest(runs):
    _ok(runs["futures"]["skip"].result())
    out = runs["root"] / "skip"
    rows = _rows(out).to_pylist()
    assert sorted((r["prompt_index"], r["sample_index"]) for r in rows) == [(0, 0), (0, 1), (3, 0), (3, 1)]
    assert all(r["row"] == r["prompt_index"] for r in rows)
    m = _manifest(out)
    skipped = {s["prompt_index"]: s["reason"] for s in m["skipped_rows"]}
    assert set(skipped) == {1, 2}
    assert "empty" in skipped[1]
    assert "exceeds" in skipped[2] and "64" in skipped[2]
    assert m["status"] == "complete" and m["prompts"] == 2 and m["trajectories"] == 4


def test_load_format_dummy_runs_from_config_alone(runs):
    _ok(runs["futures"]["dummy"].result())
    dummy_model = runs["root"] / "dummy_model"
    assert not list(dummy_model.glob("*.safetensors"))
    rows = _rows(runs["root"] / "dummy").to_pylist()
    assert sorted((r["prompt_index"], r["sample_index"]) for r in rows) == [(p, s) for p in range(4) for s in range(2)]
    assert all(len(r["response_logprobs"]) == len(r["response_token_ids"]) >= 1 for r in rows)
    assert _manifest(runs["root"] / "dummy")["status"] == "complete"


# Every option of the contract, with the default its help must show (None: a flag or a computed default).
CONTRACT_OPTIONS = {
    "--n": "1", "--max-new-tokens": "256", "--temperature": "1.0", "--top-p": "1.0", "--top-k": "0",
    "--min-p": "0.0", "--seed": "0", "--ignore-eos": None, "--logprobs-mode": "processed",
    "--prompt-key": "prompt", "--limit": None, "--resume": None, "--device": "auto", "--dtype": "auto",
    "--max-model-len": None, "--max-batch-tokens": "8192", "--max-running": "256",
    "--kv-memory-fraction": "0.85", "--load-format": "auto",
}


def _help_rows(text: str) -> dict[str, str]:
    """--flag -> the text of its row in rich's option tables (wrapped lines joined)."""
    rows: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if not line.startswith("│"):
            current = None
            continue
        body = line.strip("│ ").replace("│", " ")
        # An option's first line has its name at the left edge; wrapped help text is indented.
        match = re.match(r"^│\s{1,4}(?:\*\s+)?(--[a-z][a-z0-9-]*)\b", line)
        if match:
            current = match.group(1)
            rows[current] = body
        elif current is not None:
            rows[current] += " " + body
    return {flag: " ".join(row.split()) for flag, row in rows.items()}


def test_help_lists_every_contract_option_with_defaults(runs):
    result = _ok(runs["futures"]["help"].result())
    flat = " ".join(result.stdout.split())
    assert re.search(r"rollout run --model \S+ --data \S+\.parquet --out \S+", flat), "no example line"
    assert "…" not in result.stdout, "help is truncated at 80 columns"
    rows = _help_rows(result.stdout)
    for flag, default in CONTRACT_OPTIONS.items():
        assert flag in rows, f"{flag} missing from --help (options: {sorted(rows)})"
        row = rows[flag]
        assert len(row.split()) > 3, f"{flag} has no help text: {row!r}"
        if default is not None:
            assert f"[default: {default}]" in row, f"{flag}: no [default: {default}] in {row!r}"
    assert "default: the model's max_position_embeddings" in rows["--max-model-len"]


def test_python_api_generate():
    from rollout_cli import Engine, SamplingParams

    engine = Engine(model=str(MODEL))
    results = engine.generate(["What is 1 + 1?", [{"role": "user", "content": "hi"}]],
                              SamplingParams(n=2, max_new_tokens=8))
    assert len(results) == 4
    assert [(r.prompt_index, r.sample_index) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        row = r.to_row()
        assert list(row) == FIXED_NAMES
        assert 1 <= len(row["response_token_ids"]) <= 8
        assert len(row["response_logprobs"]) == len(row["response_token_ids"])
        assert row["finish_reason"] in ("stop", "length")
        assert isinstance(row["response_text"], str) and row["weight_version"] == "0"
    assert results[0].prompt_token_ids == results[1].prompt_token_ids != results[2].prompt_token_ids


def test_nanosecond_passthrough_columns_come_out_unchanged_and_continue(tmp_path):
    """Python's datetime holds microseconds: a timestamp / duration / time64 cell with nanoseconds (pandas'
    datetime64[ns] writes them) was a ValueError traceback mid-run, and again reading an aborted row back
    for --continue-aborted. The values pass through bit for bit, under their own types."""
    data, out = tmp_path / "ns.parquet", tmp_path / "out"
    source = pa.table({"prompt": ["What is 1 + 1?", "hi"],
                       "ts": pa.array([1_700_000_000_123_456_789, None], pa.timestamp("ns", tz="UTC")),
                       "dur": pa.array([5, 7], pa.duration("ns")), "t64": pa.array([3, 4], pa.time64("ns")),
                       "nested": pa.array([{"at": [1_700_000_000_123_456_789]}, None],  # at any depth
                                          pa.struct([("at", pa.list_(pa.timestamp("ns")))]))})
    pq.write_table(source, data)
    args = ["--model", str(MODEL), "--data", str(data), "--out", str(out), "--max-new-tokens", "4", "--ignore-eos",
            "--quiet"]
    _ok(_run(args))
    shard = next((out / "trajectories").glob("part-*.parquet"))
    table = pq.read_table(shard)  # row 1 as an abort leaves it: two response tokens, finish_reason abort
    for name in ("response_token_ids", "response_logprobs", "response_weight_versions"):
        cells = table.column(name).to_pylist()
        cells[1] = cells[1][:2]
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(cells, table.schema.field(name).type))
    reasons = table.column("finish_reason").to_pylist()
    reasons[1] = "abort"
    table = table.set_column(table.schema.get_field_index("finish_reason"), "finish_reason", pa.array(reasons))
    pq.write_table(table, shard)
    _ok(_run([*args, "--resume", "--continue-aborted"]))
    rows = pq.read_table(out / "trajectories").sort_by("prompt_index")
    assert rows.column("finish_reason").to_pylist() == ["length", "length"]
    for name in ("ts", "dur", "t64", "nested"):
        assert rows.schema.field(name).type == source.schema.field(name).type
        assert nanoseconds_as_ints(rows.select([name])).to_pylist() == \
            nanoseconds_as_ints(source.select([name])).to_pylist()
