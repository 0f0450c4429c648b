"""SamplingParams.top_logprobs: the K most likely tokens at every sampled position, as the sampler
reports logprobs (temperature, filters, logprobs mode), against HF transformers in float32."""

from __future__ import annotations

import pytest
import torch

from parity import make_engine, prompts_of
from rollout_cli import PartialSample, SamplingParams
from rollout_cli.errors import RolloutError

PROMPTS = prompts_of([4, 13, 7], seed=8)


def _hf_log_softmax(hf_ref, model_dir, prompt, response) -> torch.Tensor:
    """log_softmax of HF's logits at each response position: [len(response), V]."""
    model = hf_ref.model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1: len(prompt) + len(response) - 1]


def test_greedy_top_logprobs_are_hf_log_softmax_top_k(tiny_checkpoints, hf_ref):
    model_dir = tiny_checkpoints["qwen3"]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6, ignore_eos=True, top_logprobs=4)
    results = make_engine(model_dir, max_batch_tokens=8).generate(PROMPTS, params)
    assert len(results) == 6
    for traj in results:
        tops = traj.response_top_logprobs
        assert len(tops) == len(traj.response_token_ids) == 6
        want = _hf_log_softmax(hf_ref, model_dir, PROMPTS[traj.prompt_index], traj.response_token_ids)
        for position, (top, token, logprob) in enumerate(zip(tops, traj.response_token_ids, traj.response_logprobs,
                                                             strict=True)):
            values, ids = want[position].topk(4)
            assert [t for t, _ in top] == ids.tolist(), position
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
            assert top[0] == (token, logprob)  # greedy: the most likely token, with the sampler's own bits


def test_filtered_sampling_lists_only_tokens_it_could_draw(tiny_checkpoints):
    params = SamplingParams(n=3, temperature=0.7, top_k=3, seed=4, max_new_tokens=5, ignore_eos=True, top_logprobs=10)
    results = make_engine(tiny_checkpoints["qwen3"]).generate(PROMPTS, params)
    for traj in results:
        for top, token, logprob in zip(traj.response_top_logprobs, traj.response_token_ids, traj.response_logprobs,
                                       strict=True):
            assert len(top) == 3  # top_k 3 keeps three tokens: the other seven cannot be drawn
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            assert sum(torch.tensor(values).exp().tolist()) == pytest.approx(1.0, abs=1e-5)  # renormalised kept set
            assert (token, logprob) in top


def test_off_by_default_and_none_for_carried_tokens(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["qwen3"])
    plain = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert plain[0].response_top_logprobs is None
    first = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=3, top_logprobs=2))[0]
    carried = PartialSample(0, 0, PROMPTS[0], first.response_token_ids[:2], first.response_logprobs[:2],
                            first.response_weight_versions[:2])
    params = SamplingParams(temperature=0.0, max_new_tokens=3, top_logprobs=2)
    rest = list(engine.stream([carried], params))[0]
    assert rest.response_token_ids == first.response_token_ids
    assert rest.response_top_logprobs[:2] == [None, None] and rest.response_top_logprobs[2] == first.response_top_logprobs[2]
    with pytest.raises(RolloutError, match="top_logprobs"):
        SamplingParams(top_logprobs=-1)


def test_cli_run_writes_the_top_columns_only_when_asked(tmp_path):
    """`rollout run --top-logprobs K`: two list<list> columns, one entry per response token, the sampled
    token among them with its own logprob at T 0; without the flag the columns are absent; with --env
    it is refused in one line."""
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq

    repo = Path(__file__).resolve().parents[2]
    base = [sys.executable, "-m", "rollout_cli.cli.main", "run", "--model", str(repo / "recipes/example_model"),
            "--data", str(repo / "recipes/prompts.parquet"), "--limit", "3", "--n", "2", "--max-new-tokens", "5",
            "--temperature", "0", "--quiet"]
    done = subprocess.run(base + ["--out", str(tmp_path / "top"), "--top-logprobs", "3"], capture_output=True,
                          text=True, timeout=300, cwd=repo)
    assert done.returncode == 0, done.stderr
    rows = pq.read_table(tmp_path / "top" / "trajectories").to_pylist()
    assert len(rows) == 6
    for row in rows:
        assert len(row["response_top_token_ids"]) == len(row["response_top_logprobs"]) == len(row["response_token_ids"])
        for ids, values, token, logprob in zip(row["response_top_token_ids"], row["response_top_logprobs"],
                                               row["response_token_ids"], row["response_logprobs"], strict=True):
            assert len(ids) == 3 and ids[0] == token and values[0] == pytest.approx(logprob, abs=1e-6)
    plain = subprocess.run(base + ["--out", str(tmp_path / "plain")], capture_output=True, text=True, timeout=300,
                           cwd=repo)
    assert plain.returncode == 0, plain.stderr
    assert "response_top_token_ids" not in pq.read_table(tmp_path / "plain" / "trajectories").column_names
    env = subprocess.run(base + ["--out", str(tmp_path / "env"), "--top-logprobs", "2", "--env",
                                 str(repo / "recipes/envs/calculator.py")], capture_output=True, text=True,
                         timeout=300, cwd=repo)
    assert env.returncode != 0 and "--top-logprobs is not supported with --env" in env.stderr
    assert "Traceback" not in env.stderr and not (tmp_path / "env").exists()
