"""`rollout run --stop STR`: a sample ends inside the engine with the token that completes a stop string
(finish_reason stop, stop_reason names it, the token kept as its last), so its row is the unstopped row
cut right after the token where the decoded text first holds the string; its response_text ends before
the string (before a stop token's text), through it with --include-stop-str-in-output (vLLM's rule).
The expectation is computed here with tokenizer.decode, independently of the engine's byte table. Also:
bad lists are one line, --resume compares the strings and the text rule, episode turns honour them.

The example model's greedy rows are all newlines, so most checks run seeded samples at temperature 1:
a sample's random stream is keyed by (seed, prompt, sample, position), never by the batch, so in
float32 on the CPU a row is the same tokens whatever else runs or stops beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rollout_cli.engine.engine import Engine
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.episodes import EnvStep, EpisodeRunner

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "example_model"
CLI = [sys.executable, "-m", "rollout_cli.cli.main"]
RUN = ["run", "--model", str(MODEL), "--data", str(REPO / "recipes" / "prompts.parquet"), "--limit", "8",
       "--n", "2", "--max-new-tokens", "24", "--ignore-eos", "--device", "cpu", "--quiet"]
SEEDED = ["--temperature", "1", "--seed", "3"]
ABSENT = "never written by this model"


def _cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("ROLLOUT_ENGINE", None)
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env)


def _rows(out: Path) -> dict:
    return {(r["prompt_index"], r["sample_index"]): r for r in pq.read_table(out / "trajectories").to_pylist()}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(MODEL))


@pytest.fixture(scope="module")
def free(tmp_path_factory) -> dict:
    """The seeded rows without stop rules."""
    out = tmp_path_factory.mktemp("free") / "out"
    result = _cli(*RUN, *SEEDED, "--out", out)
    assert result.returncode == 0, result.stderr
    return _rows(out)


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _first_hit(tokenizer, ids: list[int], stop: str) -> int | None:
    """The index of the token after which the decoded text first holds `stop`, or None."""
    return next((i for i in range(len(ids)) if stop in _text(tokenizer, ids[: i + 1])), None)


def _expected_text(tokenizer, ids: list[int], reason: str, stop_id: int, include: bool = False) -> str:
    """vLLM's text of a row that `reason` (a stop string, or str(stop_id)) ended at its last token."""
    if reason == str(stop_id):  # the stop token's text is left out, or decoded as any other token's
        return _text(tokenizer, ids if include else ids[:-1])
    text = _text(tokenizer, ids)
    return text[: text.find(reason) + (len(reason) if include else 0)]


def _spanning_stop(tokenizer, ids: list[int]) -> str:
    """Three characters of the text across a token boundary (no U+FFFD near it): a stop string whose
    first occurrence the token completing it does not hold alone."""
    for k in range(4, len(ids) - 1):
        before, after = _text(tokenizer, ids[:k]), _text(tokenizer, ids[: k + 1])
        stop = after[len(before) - 2: len(before) + 1]
        hit = _first_hit(tokenizer, ids, stop)
        if (after.startswith(before) and len(stop) == 3 and "\ufffd" not in stop and stop.strip() == stop
                and hit is not None and stop not in _text(tokenizer, ids[hit: hit + 1])):
            return stop
    raise AssertionError("no stop string spans two tokens of this row")


def test_rows_end_at_the_token_that_completes_a_stop_string(free, tokenizer, tmp_path):
    spanning = _spanning_stop(tokenizer, free[1, 0]["response_token_ids"])
    word = "hank"  # written inside the responses of several rows (one token or more)
    stop_id = free[2, 1]["response_token_ids"][15]
    assert all(ABSENT not in row["response_text"] for row in free.values())
    out = tmp_path / "stopped"
    result = _cli(*RUN, *SEEDED, "--out", out, "--stop", spanning, "--stop", word, "--stop", ABSENT,
                  "--stop-token-ids", stop_id)
    assert result.returncode == 0, result.stderr
    rows = _rows(out)
    assert rows.keys() == free.keys()
    reasons = set()
    for pair, row in rows.items():
        full = free[pair]["response_token_ids"]
        hits = {stop: _first_hit(tokenizer, full, stop) for stop in (spanning, word, ABSENT)}
        hits[str(stop_id)] = full.index(stop_id) if stop_id in full else None
        cut = min((i for i in hits.values() if i is not None), default=None)
        if cut is None:  # no stop rule met: the row is unchanged
            assert row["response_token_ids"] == full and row["finish_reason"] == "length", pair
            assert row["stop_reason"] is None
            continue
        assert row["response_token_ids"] == full[: cut + 1], pair  # the token that completed it is kept
        assert row["response_logprobs"] == pytest.approx(free[pair]["response_logprobs"][: cut + 1], abs=1e-5)
        assert len(row["response_weight_versions"]) == cut + 1
        assert row["finish_reason"] == "stop" and row["stop_reason"] in {s for s, i in hits.items() if i == cut}
        assert row["response_text"] == _expected_text(tokenizer, full[: cut + 1], row["stop_reason"], stop_id)
        assert row["stop_reason"] == str(stop_id) or row["stop_reason"] not in row["response_text"]
        reasons.add(row["stop_reason"])
    assert {spanning, word, str(stop_id)} <= reasons  # every rule ended a row; the absent one none
    sampling = json.loads((out / "manifest.json").read_text())["sampling"]
    assert sampling["stop"] == [spanning, word, ABSENT] and sampling["stop_token_ids"] == [stop_id]
    assert sampling["include_stop_str_in_output"] is False
    # the rows are rollout score's input as any run's
    scored = _cli("score", "--model", MODEL, "--device", "cpu", "--data", out, "--out", tmp_path / "scores", "--quiet")
    assert scored.returncode == 0, scored.stderr
    # --resume: the same strings resume; others (or none) are refused in one line, OUT untouched
    assert _cli(*RUN, *SEEDED, "--out", out, "--resume", "--stop", spanning, "--stop", word, "--stop", ABSENT,
                "--stop-token-ids", stop_id).returncode == 0
    for other in (["--stop", word], []):
        refused = _cli(*RUN, *SEEDED, "--out", out, "--resume", *other, "--stop-token-ids", stop_id)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and "sampling.stop" in lines[0], refused.stderr
    assert _rows(out) == rows
    # --include-stop-str-in-output: the same tokens, logprobs and stop reasons; the text keeps the rule's
    kept_out = tmp_path / "kept"
    flags = ["--stop", spanning, "--stop", word, "--stop", ABSENT, "--stop-token-ids", stop_id]
    result = _cli(*RUN, *SEEDED, "--out", kept_out, *flags, "--include-stop-str-in-output")
    assert result.returncode == 0, result.stderr
    kept = _rows(kept_out)
    assert json.loads((kept_out / "manifest.json").read_text())["sampling"]["include_stop_str_in_output"] is True
    same = ("response_token_ids", "finish_reason", "stop_reason", "response_weight_versions")
    for pair, row in kept.items():
        assert [row[k] for k in same] == [rows[pair][k] for k in same], pair
        assert row["response_logprobs"] == pytest.approx(rows[pair]["response_logprobs"], abs=1e-5)
        if row["finish_reason"] == "stop":
            want = _expected_text(tokenizer, row["response_token_ids"], row["stop_reason"], stop_id, include=True)
            assert row["response_text"] == want and want.startswith(rows[pair]["response_text"])
        else:
            assert row["response_text"] == rows[pair]["response_text"]
    assert any(row["stop_reason"] in (spanning, word) and row["stop_reason"] in row["response_text"]
               for row in kept.values())
    # --resume refuses the other text rule either way, in one line naming it
    for target, other in ((out, ["--include-stop-str-in-output"]), (kept_out, [])):
        refused = _cli(*RUN, *SEEDED, "--out", target, "--resume", *flags, *other)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1, refused.stderr
        assert "sampling.include_stop_str_in_output" in lines[0], refused.stderr


def test_a_stop_string_over_several_greedy_tokens(tmp_path):
    """Greedy rows of the example model are newlines, one token each: "\\n\\n\\n" is three tokens."""
    plain = _cli(*RUN, "--temperature", "0", "--out", tmp_path / "plain")
    stopped = _cli(*RUN, "--temperature", "0", "--out", tmp_path / "stopped", "--stop", "\n\n\n")
    assert plain.returncode == 0 and stopped.returncode == 0, stopped.stderr
    free, rows = _rows(tmp_path / "plain"), _rows(tmp_path / "stopped")
    for pair, row in rows.items():
        full = free[pair]["response_token_ids"]
        assert full[:3] == [full[0]] * 3 and free[pair]["response_text"].startswith("\n\n\n")
        assert row["response_token_ids"] == full[:3] and row["stop_reason"] == "\n\n\n"
        assert row["response_text"] == ""  # the response is the stop string: nothing before it


def test_a_run_from_before_stop_strings_and_the_column_resumes_as_it_was_written(free, tmp_path):
    """A --stop-token-ids run written before --stop (no sampling.stop in its manifest), stop_reason (its
    shards lack the column) and the text rule (its text kept the stop token's, as
    --include-stop-str-in-output does): --resume without --stop continues it, its new shards without
    the column too, once the flag says the text is kept; without the flag it is refused."""
    out, stop_id = tmp_path / "old", free[0, 0]["response_token_ids"][3]
    args = [*RUN, *SEEDED, "--limit", "2", "--shard-rows", "1", "--out", out, "--stop-token-ids", stop_id]
    assert _cli(*args, "--include-stop-str-in-output").returncode == 0
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["sampling"]["stop"], manifest["sampling"]["include_stop_str_in_output"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    shards = sorted((out / "trajectories").glob("part-*.parquet"))
    for shard in shards:
        pq.write_table(pq.read_table(shard).drop_columns(["stop_reason"]), shard)
    want = _rows(out)
    shards[0].unlink()  # its row is generated again
    refused = _cli(*args, "--resume")
    assert refused.returncode == 2 and "sampling.include_stop_str_in_output=True" in refused.stderr
    args.append("--include-stop-str-in-output")
    assert _cli(*args, "--resume").returncode == 0
    assert all("stop_reason" not in pq.read_schema(path).names for path in (out / "trajectories").iterdir())
    # the regenerated row ran in another batch: its logprobs within float32 noise, the rest the same
    rows = _rows(out)
    assert rows.keys() == want.keys()
    for pair, row in rows.items():
        assert row["response_logprobs"] == pytest.approx(want[pair]["response_logprobs"], abs=1e-5)
        assert {k: v for k, v in row.items() if k != "response_logprobs"} == \
            {k: v for k, v in want[pair].items() if k != "response_logprobs"}
    refused = _cli(*args, "--resume", "--stop", "x")
    assert refused.returncode == 2 and "sampling.stop" in refused.stderr


@pytest.mark.parametrize("flags, message", [
    (["--stop", ""], "error: --stop takes non-empty strings: an empty one would match before any token; drop it"),
    (["--stop", "ab"] * 65, "error: --stop takes at most 64 strings, got 65; keep the ones the model writes"),
    (["--stop", "y" * 257], "error: --stop 'yyyy"),
])
def test_a_bad_stop_list_is_one_line(tmp_path, flags, message):
    result = _cli(*RUN, "--out", tmp_path / "o", *flags)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert not (tmp_path / "o").exists()


def test_episode_turns_end_at_the_stop_string_of_their_own_text(tokenizer):
    """--env: each model turn is a request of the job's params, so a turn ends at the stop string (its
    text, which the environment reads, before it); the conversation before it (the observation spells
    the stop string) ends nothing."""
    class Echo:
        def __init__(self):
            self.turns = []

        def step(self, turn) -> EnvStep:
            self.turns.append(turn)
            return EnvStep(observation=" 4", done=len(self.turns) == 4)

    engine = Engine(str(MODEL), device="cpu", max_model_len=512, kv_cache_tokens=8192)
    envs = []
    runner = EpisodeRunner(engine, lambda row: envs.append(Echo()) or envs[-1], max_turns=4)
    params = SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True, stop=(" 4",))
    list(runner.stream([PromptInput(0, tokenizer.encode("Count: 1 2 3")), PromptInput(1, [9, 8, 7])], params))
    turns = [turn for env in envs for turn in env.turns]
    assert len(turns) == 8 * 4
    for turn in turns:
        hit = _first_hit(tokenizer, turn.token_ids, " 4")
        if turn.finish_reason == "stop":
            assert hit == len(turn.token_ids) - 1, turn
            full = _text(tokenizer, turn.token_ids)  # the environment reads the text before the stop string
            assert turn.text == full[: full.find(" 4")], turn
        else:
            assert turn.finish_reason == "length" and hit is None and len(turn.token_ids) == 12, turn
    assert sum(turn.finish_reason == "stop" for turn in turns) >= 2
