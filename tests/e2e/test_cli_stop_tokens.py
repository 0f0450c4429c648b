"""`rollout run --stop-token-ids`: a sample also ends at any of those ids (finish_reason stop, the id kept as
its last token), with or without --ignore-eos; bad lists are one line; --resume compares the setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.errors import RolloutError

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "rollout_cli.cli.main", "run", "--model", str(REPO / "recipes" / "example_model"),
       "--data", str(REPO / "recipes" / "prompts.parquet"), "--limit", "8", "--n", "2", "--max-new-tokens", "24",
       "--temperature", "0", "--ignore-eos", "--device", "cpu"]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(CLI + ["--out", str(out), *extra], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env)


def _rows(out: Path) -> dict:
    table = pq.read_table(out / "trajectories").to_pylist()
    return {(r["prompt_index"], r["sample_index"]): r for r in table}


def test_samples_end_at_the_first_stop_token_id(tmp_path):
    free = tmp_path / "free"
    assert _run(free).returncode == 0
    plain = _rows(free)
    # two ids the greedy responses reach part way: the 5th token of one sample, the 9th of another
    stops = {plain[0, 0]["response_token_ids"][4], plain[3, 0]["response_token_ids"][8]}
    stopped = tmp_path / "stopped"
    result = _run(stopped, "--stop-token-ids", ",".join(map(str, sorted(stops))))
    assert result.returncode == 0, result.stderr
    rows = _rows(stopped)
    assert rows.keys() == plain.keys()
    for pair, row in rows.items():
        full = plain[pair]["response_token_ids"]
        cut = next((i + 1 for i, token in enumerate(full) if token in stops), len(full))
        assert row["response_token_ids"] == full[:cut], pair  # greedy: the same tokens, up to the stop id
        assert row["finish_reason"] == ("stop" if cut < len(full) or full[-1] in stops else "length"), pair
    assert sum(row["finish_reason"] == "stop" for row in rows.values()) >= 2
    manifest = json.loads((stopped / "manifest.json").read_text())
    assert manifest["sampling"]["stop_token_ids"] == sorted(stops)
    # --resume: the same list resumes (the manifest's JSON list equals the flag's ids); another one is refused
    assert _run(stopped, "--resume", "--stop-token-ids", ",".join(map(str, sorted(stops)))).returncode == 0
    refused = _run(stopped, "--resume")
    assert refused.returncode == 2 and "sampling.stop_token_ids" in refused.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", ["1,x", "-3", "1,,2"])
def test_a_bad_stop_token_id_list_is_one_line(tmp_path, flag):
    result = _run(tmp_path / "o", f"--stop-token-ids={flag}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --stop-token-ids takes comma-separated token ids such as 151645,151643; got {flag!r}"]
    assert not (tmp_path / "o").exists()


def test_a_json_list_becomes_a_tuple_and_bad_ids_are_refused():
    assert SamplingParams(stop_token_ids=[7, 9]).stop_token_ids == (7, 9)  # a request body's or manifest's list
    for bad in ([-1], ["7"], [True], "7"):
        with pytest.raises(RolloutError, match="--stop-token-ids must be token ids"):
            SamplingParams(stop_token_ids=bad)
    with pytest.raises(RolloutError, match="at most 1024"):
        SamplingParams(stop_token_ids=list(range(1025)))
