"""`rollout run --env`: multi-turn episodes (issue 21), on the CPU.

The calculator environment on the example model through the CLI (rows, loss masks, turn spans, the
cache serving each turn's conversation so far, a kill and --resume); every model turn of an episode
equals the same conversation sent as one prompt (tokens and logprobs), on a dense and a hybrid
model; bad environments and flags get one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_cli.engine.engine import Engine
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.episodes import EnvStep, EpisodeRunner

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "example_model"
CALCULATOR = REPO / "recipes" / "envs" / "calculator.py"
CLI = [sys.executable, "-m", "rollout_cli.cli.main"]
MAX_TURNS = 4
ERROR_MESSAGE = "<error>no tool call or answer"


def _cli(args, **env) -> subprocess.CompletedProcess:
    environ = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env)
    environ.pop("ROLLOUT_ENGINE", None)
    if not env:
        environ.pop("ROLLOUT_DEBUG_SIGNAL_AFTER_ROWS", None)
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=environ)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("episodes") / "calc.parquet"
    subprocess.run([sys.executable, str(CALCULATOR), str(path), "--count", "6", "--seed", "0"], check=True,
                   capture_output=True)
    return path


def _run_args(prompts: Path, out: Path) -> list:
    return ["run", "--model", MODEL, "--device", "cpu", "--data", prompts, "--out", out, "--env", CALCULATOR,
            "--max-turns", MAX_TURNS, "--n", 2, "--max-new-tokens", 12, "--seed", 5, "--quiet"]


@pytest.fixture(scope="module")
def episodes(prompts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("episodes_run") / "out"
    result = _cli(_run_args(prompts, out))
    assert result.returncode == 0, result.stderr
    return out


def _rows(out: Path) -> list[dict]:
    table = pq.read_table(out / "trajectories")
    return table.sort_by([("prompt_index", "ascending"), ("sample_index", "ascending")]).to_pylist()


def test_episode_rows_hold_the_conversation_its_mask_and_its_turns(episodes):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    rows = _rows(episodes)
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(6) for s in range(2)]
    turns = 0
    for row in rows:
        response, mask, spans = row["response_token_ids"], row["response_loss_mask"], row["model_turns"]
        assert len(mask) == len(response) == len(row["response_logprobs"]) == len(row["response_weight_versions"])
        # the untrained model never calls the tool: the environment answers every turn with an error
        assert row["finish_reason"] == "max_turns" and len(spans) == MAX_TURNS and row["episode_reward"] == 0.0
        assert spans[0][0] == 0 and spans[-1][1] == len(response)
        for k, (start, end) in enumerate(spans):
            assert mask[start:end] == [1] * (end - start) and end > start
            if k + 1 < len(spans):  # between two model turns: the environment's tokens, logprob 0
                observation = response[end:spans[k + 1][0]]
                assert mask[end:spans[k + 1][0]] == [0] * len(observation)
                assert row["response_logprobs"][end:spans[k + 1][0]] == [0.0] * len(observation)
                assert ERROR_MESSAGE in tokenizer.decode(observation)
        # the conversation so far came from the cache: all but the last model token of the turn before
        cached = row["turn_cached_tokens"]
        assert len(cached) == MAX_TURNS
        for k in range(1, MAX_TURNS):
            assert cached[k] == len(row["prompt_token_ids"]) + spans[k - 1][1] - 1
        assert row["answer"] > 0  # the prompt file's columns pass through
        turns += len(spans)
    manifest = json.loads((episodes / "manifest.json").read_text())
    stats = manifest["episodes"]
    assert manifest["status"] == "complete" and stats["turns"] == turns
    assert stats["turn_cached_tokens"] == sum(sum(r["turn_cached_tokens"]) for r in rows)
    assert stats["prefix_hit_rate"] > 0.5
    assert stats["peak_open_episodes"] == len(rows) and stats["episode_rows_held_for_kv"] == 0  # a roomy pool
    assert manifest["env"]["max_turns"] == MAX_TURNS


def test_a_killed_episode_run_resumes_to_the_same_rows(episodes, prompts, tmp_path):
    out = tmp_path / "killed"
    killed = _cli(_run_args(prompts, out) + ["--flush-seconds", "3600", "--shard-rows", "2", "--max-running", "2"],
                  ROLLOUT_DEBUG_SIGNAL_AFTER_ROWS="5:TERM")
    assert killed.returncode != 0 and json.loads((out / "manifest.json").read_text())["status"] == "interrupted"
    kept = pq.read_table(out / "trajectories").num_rows
    assert 0 < kept < 12
    resumed = _cli(_run_args(prompts, out) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr
    got, want = _rows(out), _rows(episodes)
    assert [{k: v for k, v in r.items() if k not in ("response_logprobs", "turn_cached_tokens")} for r in got] == \
        [{k: v for k, v in r.items() if k not in ("response_logprobs", "turn_cached_tokens")} for r in want]
    for a, b in zip(got, want):
        assert a["response_logprobs"] == pytest.approx(b["response_logprobs"], abs=1e-5)


class _ScriptedEnv:
    """Answers every model turn with fixed token ids; done after `turns` turns, reward = turns taken."""

    def __init__(self, observation: list[int], turns: int):
        self.observation = observation
        self.turns = turns
        self.seen = 0

    def step(self, turn) -> EnvStep:
        self.seen += 1
        return EnvStep(observation=self.observation, reward=1.0, done=self.seen == self.turns)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_every_turn_equals_the_conversation_sent_as_one_prompt(kind, tiny_hybrid_checkpoints):
    """Five turns at T=1: each model turn's tokens (and logprobs, to the 1e-4 of float32 parity) are what the engine samples for the
    conversation before it as one prompt (the random stream is keyed by position, so a turn draws what
    the whole conversation draws at those positions)."""
    model = str(MODEL) if kind == "dense" else tiny_hybrid_checkpoints["qwen3_next"]
    engine = Engine(model, device="cpu", max_model_len=512, kv_cache_tokens=8192)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=9, ignore_eos=True)
    observation = [11, 12, 13, 14]
    runner = EpisodeRunner(engine, lambda row: _ScriptedEnv(observation, 5), max_turns=8)
    prompts = [PromptInput(0, [3, 4, 5, 6, 7, 8]), PromptInput(1, [9, 8, 7])]
    episodes = sorted(runner.stream(prompts, params), key=lambda t: (t.prompt_index, t.sample_index))
    assert len(episodes) == 4
    for episode in episodes:
        spans = episode.episode["model_turns"]
        assert len(spans) == 5 and episode.finish_reason == "done" and episode.episode["episode_reward"] == 5.0
        for k, (start, end) in enumerate(spans):
            conversation = episode.prompt_token_ids + episode.response_token_ids[:start]
            one = PromptInput(episode.prompt_index, conversation, params=SamplingParams(
                n=episode.sample_index + 1, max_new_tokens=6, temperature=1.0, seed=9, ignore_eos=True))
            alone = [t for t in engine.stream([one], params) if t.sample_index == episode.sample_index][0]
            assert alone.response_token_ids == episode.response_token_ids[start:end]
            assert alone.response_logprobs == pytest.approx(episode.response_logprobs[start:end], abs=1e-4)
            if k + 1 < len(spans):
                assert episode.response_token_ids[end:spans[k + 1][0]] == observation
        cached = episode.episode["turn_cached_tokens"]
        if kind == "dense":  # the pinned conversation serves every later turn: all but the last model token
            assert all(cached[k] == len(episode.prompt_token_ids) + spans[k - 1][1] - 1 for k in range(1, 5))
        else:  # a hybrid turn resumes at the previous turn's prompt state: its prompt but the last token
            assert all(cached[k] == len(episode.prompt_token_ids) + spans[k - 1][0] - 1 for k in range(1, 5))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_episode_routing_covers_the_whole_conversation(name, tiny_moe_checkpoints, hf_ref):
    """--capture-routing with episodes: one routing row per episode over every position of the prompt, the
    model turns and the observations but the last token, each layer's ids HF's router top-k over that
    sequence (earlier turns' positions served from the pinned conversation, with the routing their KV
    slots keep). The episodes end every turn in the same step: their turns then come out of the routing
    flush at the end of the step loop, which must ask for the next turns instead of ending the stream."""
    import numpy as np
    import torch

    model_dir = tiny_moe_checkpoints[name]
    engine = Engine(model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=4096)
    engine.enable_routing_capture()
    params = SamplingParams(n=1, max_new_tokens=5, temperature=1.0, seed=4, ignore_eos=True)
    runner = EpisodeRunner(engine, lambda row: _ScriptedEnv([11, 12, 13], 3), max_turns=5)
    episodes = list(runner.stream([PromptInput(i, [5 + i] * 8) for i in range(4)], params))
    assert len(episodes) == 4 and runner.turn_cached_tokens > 0
    num_moe, top_k = len(engine.model.moe_layers), engine.model.top_k
    hf = hf_ref.model(model_dir)
    for episode in episodes:
        assert len(episode.episode["model_turns"]) == 3
        sequence = episode.prompt_token_ids + episode.response_token_ids[:-1]
        got = episode.routed_experts
        assert got.shape == (len(sequence), num_moe, top_k)
        with torch.no_grad():
            router_logits = hf(torch.tensor([sequence]), output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            want = torch.topk(logits.float().softmax(-1), top_k, dim=-1).indices.sort(-1).values
            have = torch.from_numpy(got[:, layer].astype(np.int64)).sort(-1).values
            assert torch.equal(have, want), (episode.prompt_index, episode.sample_index, layer)


def _env_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "env.py"
    path.write_text(body)
    return path


_ANSWER = ("from rollout_cli.episodes import EnvStep\n\nclass E:\n    def step(self, turn):\n"
           "        return EnvStep({})\n\ndef make_env(row):\n    return E()\n")


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file; pass a Python file that defines make_env(row)"),
    ("no_make_env", "defines no make_env(row) function"),
    ("broken", "failed to import: ZeroDivisionError"),
    ("bad_step", "the environment's step returned NoneType; return an EnvStep"),
    ("raising_make_env", "--env make_env(row) on row 0 raised KeyError: 'no_such_column'"),
    ("stepless_env", "--env make_env(row) returned int, which has no step(turn) method"),
    ("raising_step", "--env the environment's step on row 0 raised ValueError: no tool"),
    ("max_turns", "--max-turns must be at least 1"),
    ("not_python", "is not a Python file; the env file must be a Python file (.py) defining make_env(row)"),
    ("int_observation", "--env the environment's step on row 0 returned observation 12345; return text"),
    ("text_reward", "--env the environment's step on row 0 returned reward 'x', not a finite number"),
    ("nan_reward", "--env the environment's step on row 0 returned reward nan, not a finite number"),
    ("directory", "is a directory; pass a Python file that defines make_env(row)"),
    ("exiting_step", "--env the environment's step on row 0 exited (SystemExit 0)"),
    ("exiting_make_env", "--env make_env(row) on row 0 exited (SystemExit 3)"),
])
def test_bad_environments_and_flags_get_one_line(case, message, prompts, tmp_path):
    bodies = {"no_make_env": "x = 1\n", "broken": "1 / 0\n",
              "bad_step": "class E:\n    def step(self, turn):\n        return None\n\n"
                          "def make_env(row):\n    return E()\n",
              "raising_make_env": "def make_env(row):\n    return row['no_such_column']\n",
              "stepless_env": "def make_env(row):\n    return 7\n",
              "raising_step": "class E:\n    def step(self, turn):\n        raise ValueError('no tool')\n\n"
                              "def make_env(row):\n    return E()\n",
              "int_observation": _ANSWER.format("observation=12345"), "text_reward": _ANSWER.format("reward='x'"),
              "nan_reward": _ANSWER.format("reward=float('nan')"),
              "exiting_step": "import sys\nclass E:\n    def step(self, turn):\n        sys.exit(0)\n\n"
                              "def make_env(row):\n    return E()\n",
              "exiting_make_env": "def make_env(row):\n    raise SystemExit(3)\n"}
    env = {"missing": tmp_path / "nope.py", "not_python": prompts, "directory": tmp_path}.get(case)
    if env is None:
        env = _env_file(tmp_path, bodies[case]) if case in bodies else CALCULATOR
    args = ["run", "--data", prompts, "--out", tmp_path / "out", "--env", env, "--max-new-tokens", 4, "--quiet"]
    args += ["--model", MODEL, "--device", "cpu"]
    if case == "max_turns":
        args += ["--max-turns", 0]
    result = _cli(args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    if case in ("missing", "no_make_env", "broken", "max_turns", "not_python", "directory"):
        assert not (tmp_path / "out").exists()  # refused before anything is written


def test_an_input_column_named_like_an_episode_column_is_refused(tmp_path):
    data = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["hi"], "episode_reward": [1.0]}), data)
    result = _cli(["run", "--model", MODEL, "--device", "cpu", "--data", data, "--out", tmp_path / "out",
                   "--env", CALCULATOR, "--quiet"])
    assert result.returncode != 0 and "input column 'episode_reward' has the name of an output column" in result.stderr


@pytest.mark.parametrize("parallel", [["--dp", 2], ["--tp", 2]])
def test_parallel_engines_run_the_same_episodes(parallel, episodes, prompts, tmp_path):
    """--dp 2: each replica runs the episodes of its prompts (every sample's random stream is keyed by
    prompt, sample and position), so the union is the one-engine run's rows; the manifest adds up the
    replicas' turns. --tp 2: rank 0 runs the episodes on the split engine (its sessions pinned there)."""
    out = tmp_path / "out"
    result = _cli(_run_args(prompts, out) + parallel)
    assert result.returncode == 0, result.stderr
    got, want = _rows(out), _rows(episodes)
    keys = ["prompt_index", "sample_index", "response_token_ids", "response_loss_mask", "model_turns", "finish_reason",
            "episode_reward"]
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in want]
    for a, b in zip(got, want, strict=True):
        assert a["response_logprobs"] == pytest.approx(b["response_logprobs"], abs=1e-5)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["episodes"]["turns"] == json.loads((episodes / "manifest.json").read_text())["episodes"]["turns"]
    assert manifest["episodes"]["episode_rows_held_for_kv"] == 0
    assert (manifest["data_parallel"] if parallel[0] == "--dp" else manifest["engine"]["tensor_parallel"]) == 2


def test_aborted_episodes_continue_to_the_uninterrupted_rows(episodes, prompts, tmp_path):
    """--resume --continue-aborted with --env: rows cut inside their second model turn (as an abort writes
    them: the response so far, finish_reason abort) continue: a fresh environment replays the finished
    turns (its answers checked against the row's observations), the cut turn continues from its tokens,
    and the episode goes on; the rows equal the uninterrupted run's."""
    import shutil

    from trajectory_edits import cut_response, edit_trajectory_rows

    def cut_in_second_turn(row) -> bool:
        spans = row["model_turns"]
        if len(spans) < 2:
            return False
        end = spans[1][0] + min(2, spans[1][1] - spans[1][0])  # two tokens into the second model turn
        cut_response(row, end, ("response_token_ids", "response_logprobs", "response_weight_versions",
                                "response_loss_mask"))
        row.update(model_turns=[spans[0], [spans[1][0], end]], turn_cached_tokens=row["turn_cached_tokens"][:2],
                   episode_reward=0.0)
        return True

    out = tmp_path / "out"
    shutil.copytree(episodes, out)
    assert edit_trajectory_rows(out, cut_in_second_turn) >= 3
    result = _cli(_run_args(prompts, out) + ["--resume", "--continue-aborted"])
    assert result.returncode == 0, result.stderr
    got, want = _rows(out), _rows(episodes)
    keys = ["prompt_index", "sample_index", "response_token_ids", "response_loss_mask", "model_turns", "finish_reason",
            "episode_reward", "response_text"]
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in want]
    for a, b in zip(got, want, strict=True):
        assert a["response_logprobs"] == pytest.approx(b["response_logprobs"], abs=1e-4)

    # an environment that answers differently on replay cannot continue an episode: one line, rows kept
    shutil.copytree(episodes, tmp_path / "again")
    before = _rows(tmp_path / "again")

    def change_first_observation(row) -> bool:
        if len(row["model_turns"]) < 2:
            return False
        row["response_token_ids"][row["model_turns"][0][1]] += 1
        row["finish_reason"] = "abort"
        return True

    assert edit_trajectory_rows(tmp_path / "again", change_first_observation) >= 3
    result = _cli(_run_args(prompts, tmp_path / "again") + ["--resume", "--continue-aborted"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and "differently on replay" in lines[0], result.stderr
    assert len(_rows(tmp_path / "again")) == len(before)


def test_rollout_score_of_episodes_compares_the_model_tokens(episodes, tmp_path):
    """`rollout score` over an episode run: every response position is scored (the environment's tokens too,
    teacher-forced), but the comparison with the run counts the model's tokens only: the run wrote 0.0 for
    the environment's, which it did not sample."""
    out = tmp_path / "scores"
    result = _cli(["score", "--model", MODEL, "--device", "cpu", "--data", episodes, "--out", out, "--quiet"])
    assert result.returncode == 0, result.stderr
    comparison = json.loads((out / "manifest.json").read_text())  # the comparison sits at its top level
    rows = _rows(episodes)
    assert comparison["tokens"] == sum(sum(r["response_loss_mask"]) for r in rows)
    assert comparison["tokens"] < sum(len(r["response_token_ids"]) for r in rows)  # observations left out
    assert comparison["max_abs_diff"] < 1e-4


def test_episodes_run_on_the_daemon_as_they_run_here(episodes, prompts, tmp_path):
    """`rollout run --engine SOCK --env FILE`: the daemon imports the environment (a path on its machine)
    and writes the same episode rows as the embedded run."""
    from test_daemon import Daemon

    sock = tmp_path / "engine.sock"
    daemon = Daemon(["--socket", sock], tmp_path / "daemon.log")
    try:
        import httpx

        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://rollout") as client:
            daemon.wait_ready(client)
        args = [a for a in _run_args(prompts, tmp_path / "out") if a not in ("--model", MODEL, "--device", "cpu")]
        result = _cli(args + ["--engine", sock])
        assert result.returncode == 0, result.stderr
    finally:
        daemon.kill()
    got, want = _rows(tmp_path / "out"), _rows(episodes)
    assert [{k: v for k, v in r.items() if k not in ("response_logprobs", "turn_cached_tokens")} for r in got] == \
        [{k: v for k, v in r.items() if k not in ("response_logprobs", "turn_cached_tokens")} for r in want]
    for a, b in zip(got, want, strict=True):
        assert a["response_logprobs"] == pytest.approx(b["response_logprobs"], abs=1e-5)



def test_an_env_exiting_on_the_daemon_fails_its_job_and_the_daemon_serves_on(prompts, tmp_path):
    """sys.exit() in a step once ended the daemon's worker thread: the job and every later command hung."""
    from test_daemon import Daemon

    env = _env_file(tmp_path, "import sys\nclass E:\n    def step(self, turn):\n        sys.exit(0)\n\n"
                              "def make_env(row):\n    return E()\n")
    sock = tmp_path / "engine.sock"
    daemon = Daemon(["--socket", sock], tmp_path / "daemon.log")
    try:
        import httpx

        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://rollout") as client:
            daemon.wait_ready(client)
        job = ["run", "--engine", sock, "--data", prompts, "--max-new-tokens", 4, "--limit", 2, "--quiet"]
        failed = _cli(job + ["--out", tmp_path / "failed", "--env", env])
        assert failed.returncode == 2 and failed.stderr.strip().splitlines() == [
            "error: --env the environment's step on row 0 exited (SystemExit 0); an environment must return, "
            "not exit: fix the environment"], failed.stderr
        assert _cli(["status", "--engine", sock]).returncode == 0
        assert _cli(job + ["--out", tmp_path / "after"]).returncode == 0
    finally:
        daemon.kill()
