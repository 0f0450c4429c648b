"""SamplingParams.return_sampling_mask (`rollout run --sampling-mask`): per sampled token, the ids the
top-k / top-p / min-p filters kept. Every token lies in its mask, and a trainer that renormalises HF's
own float32 logits over the recorded masks (training.sampling_mask_logprobs) gets the rollout's
processed logprobs to 1e-4, on the torch sampler, the Triton one (interpreter) and the on-policy path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parity import make_engine, prompts_of
from rollout_cli import PartialSample, SamplingParams
from rollout_cli.engine.trajectory import ScoreInput
from rollout_cli.errors import RolloutError
from rollout_cli.training import sampling_mask_logprobs

PROMPTS = prompts_of([4, 13, 7], seed=9)
# (temperature, top_k, top_p, min_p): each filter alone, then all three
SETTINGS = [(0.8, 12, 1.0, 0.0), (1.0, 0, 0.7, 0.0), (0.7, 0, 1.0, 0.1), (1.0, 30, 0.9, 0.02)]
TOL = 1e-4


def _params(setting, **extra) -> SamplingParams:
    temperature, top_k, top_p, min_p = setting
    return SamplingParams(n=2, max_new_tokens=6, ignore_eos=True, temperature=temperature, top_k=top_k, top_p=top_p,
                          min_p=min_p, seed=11, return_sampling_mask=True, **extra)


def _check_replay(hf_model, results, params, vocab: int) -> None:
    """Each token inside its (ascending, proper) mask; HF's logits renormalised over the masks give the
    rollout's logprobs."""
    assert results
    sizes = set()
    for traj in results:
        masks = traj.response_sampling_mask
        assert len(masks) == len(traj.response_token_ids) == params.max_new_tokens
        for token, ids in zip(traj.response_token_ids, masks, strict=True):
            assert token in ids and ids == sorted(set(ids)) and len(ids) < vocab
            assert params.top_k == 0 or len(ids) <= params.top_k
            sizes.add(len(ids))
        sequence = traj.prompt_token_ids + traj.response_token_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([sequence])).logits[0, len(traj.prompt_token_ids) - 1 : -1]
        replayed = sampling_mask_logprobs(logits, torch.tensor(traj.response_token_ids), params.temperature, masks)
        assert replayed.tolist() == pytest.approx(traj.response_logprobs, abs=TOL)
    assert params.top_k or len(sizes) > 1  # top-p / min-p sets change from position to position


@pytest.mark.parametrize("setting", SETTINGS, ids=["top_k", "top_p", "min_p", "all"])
def test_masks_replay_the_rollout_logprobs_on_hf_logits(tiny_checkpoints, hf_ref, setting):
    model_dir = tiny_checkpoints["qwen3"]
    params = _params(setting)
    engine = make_engine(model_dir, max_batch_tokens=8)
    _check_replay(hf_ref.model(model_dir), engine.generate(PROMPTS, params), params, engine.hf_config.vocab_size)


@pytest.mark.parametrize("options", [dict(attention_backend="triton"), dict(deterministic=True)],
                         ids=["triton-sampler", "on-policy"])
def test_masks_of_the_other_samplers_replay_too(tiny_checkpoints, hf_ref, options):
    """The Triton sampler's own kept set (kernels/sampling_support.py, the interpreter here) and the
    on-policy mode's one-row-at-a-time reference."""
    model_dir = tiny_checkpoints["qwen3"]
    params = dataclasses.replace(_params(SETTINGS[-1]), max_new_tokens=4)
    engine = make_engine(model_dir, **options)
    _check_replay(hf_ref.model(model_dir), engine.generate(PROMPTS[:2], params), params, engine.hf_config.vocab_size)


def test_off_by_default_and_carried_over_a_continuation(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["qwen3"])
    plain = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.8, top_k=5, max_new_tokens=3))[0]
    assert plain.response_sampling_mask is None and "response_sampling_mask" not in plain.to_row()
    params = _params(SETTINGS[0])
    whole = engine.generate(PROMPTS[:1], params)[0]
    cut = PartialSample.of(whole)
    cut = PartialSample(cut.prompt_index, cut.sample_index, cut.prompt_token_ids, cut.response_token_ids[:2],
                        cut.response_logprobs[:2], cut.response_weight_versions[:2],
                        response_sampling_mask=whole.response_sampling_mask[:2])
    rest = list(engine.stream([cut], params))[0]
    assert rest.response_token_ids == whole.response_token_ids  # same keys: the same draws
    assert rest.response_sampling_mask == whole.response_sampling_mask  # the carried masks, then the new ones
    unrecorded = PartialSample(*(getattr(cut, f) for f in ("prompt_index", "sample_index", "prompt_token_ids",
                                                            "response_token_ids", "response_logprobs",
                                                            "response_weight_versions")))
    rest = list(engine.stream([unrecorded], params))[0]
    assert rest.response_sampling_mask[:2] == [None, None] and rest.to_row()["response_sampling_mask"][:2] == [[], []]
    with pytest.raises(RolloutError, match="no recorded mask"):
        sampling_mask_logprobs(torch.zeros(2, 8), torch.tensor([0, 1]), 1.0, [[0], []])


@pytest.mark.parametrize("options", [{}, dict(attention_backend="triton")], ids=["torch", "triton"])
def test_scoring_over_the_recorded_masks(tiny_checkpoints, options):
    """Engine.score with each sample's masks (`rollout score --sampling-mask`) gives the run's logprobs; the
    masks are what it renormalises over: a mask of the sampled token alone scores it 0 (to rounding)."""
    engine = make_engine(tiny_checkpoints["qwen3"], **options)
    params = dataclasses.replace(_params(SETTINGS[-1]), max_new_tokens=4)
    run = engine.generate(PROMPTS[:2], params)

    def scored(masks_of):
        inputs = [ScoreInput(t.prompt_index, t.sample_index, t.prompt_token_ids, t.response_token_ids,
                             sampling_mask=masks_of(t)) for t in run]
        return {(s.prompt_index, s.sample_index): s.response_logprobs for s in engine.score(inputs, params)}

    replayed = scored(lambda t: t.response_sampling_mask)
    for t in run:
        assert replayed[(t.prompt_index, t.sample_index)] == pytest.approx(t.response_logprobs, abs=1e-5)
    alone = scored(lambda t: [[token] for token in t.response_token_ids])
    assert all(abs(value) < 3e-7 for values in alone.values() for value in values)  # log(p / p), rounded
    with pytest.raises(RolloutError, match="non-empty list per response token"):
        list(engine.score([ScoreInput(0, 0, run[0].prompt_token_ids, run[0].response_token_ids,
                                      sampling_mask=[[1]])], params))


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=0.0, top_k=5), "needs --temperature > 0"),
    (dict(temperature=1.0), "set one of them"),
])
def test_a_mask_needs_a_filter_and_sampling(settings, message):
    with pytest.raises(RolloutError, match=message):
        SamplingParams(return_sampling_mask=True, **settings)


def test_cli_writes_the_column_and_a_resume_keeps_the_setting(tmp_path):
    """`rollout run --sampling-mask`: a list<list<int32>> column, one mask per response token holding it, which
    `rollout score --sampling-mask` scores over (the run's logprobs back; refused for a run without it);
    a --resume that drops the flag would mix rows with and without masks: refused in one line; bad
    combinations are one line and no output."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq

    repo = Path(__file__).resolve().parents[2]
    base = [sys.executable, "-m", "rollout_cli.cli.main", "run", "--model", str(repo / "recipes/example_model"),
            "--data", str(repo / "recipes/prompts.parquet"), "--limit", "3", "--n", "2", "--max-new-tokens", "5",
            "--temperature", "0.9", "--top-k", "7", "--quiet"]

    def rollout(*args):
        return subprocess.run(base + list(args), capture_output=True, text=True, timeout=300, cwd=repo)

    done = rollout("--out", str(tmp_path / "masked"), "--sampling-mask")
    assert done.returncode == 0, done.stderr
    table = pq.read_table(tmp_path / "masked" / "trajectories")
    assert str(table.schema.field("response_sampling_mask").type) == "list<element: list<element: int32>>"
    rows = table.to_pylist()
    assert len(rows) == 6
    for row in rows:
        assert len(row["response_sampling_mask"]) == len(row["response_token_ids"])
        assert all(token in ids and len(ids) <= 7 for token, ids in zip(row["response_token_ids"],
                                                                        row["response_sampling_mask"], strict=True))
    score = [sys.executable, "-m", "rollout_cli.cli.main", "score", "--model", str(repo / "recipes/example_model"),
             "--quiet", "--sampling-mask"]
    scored = subprocess.run(score + ["--data", str(tmp_path / "masked"), "--out", str(tmp_path / "scores")],
                            capture_output=True, text=True, timeout=300, cwd=repo)
    assert scored.returncode == 0, scored.stderr
    manifest = json.loads((tmp_path / "scores" / "manifest.json").read_text())
    assert manifest["settings"]["sampling_mask"] is True and manifest["max_abs_diff"] < 1e-5
    plain = rollout("--out", str(tmp_path / "plain"), "--limit", "1")
    assert plain.returncode == 0, plain.stderr
    refused = subprocess.run(score + ["--data", str(tmp_path / "plain"), "--out", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=300, cwd=repo)
    assert refused.returncode == 2 and "holds no response_sampling_mask column" in refused.stderr, refused.stderr
    resumed = rollout("--out", str(tmp_path / "masked"), "--resume")
    assert resumed.returncode != 0 and "sampling" in resumed.stderr and "Traceback" not in resumed.stderr
    for extra, message in ((["--top-k", "0"], "set one of them"), (["--temperature", "0"], "needs --temperature > 0"),
                           (["--env", str(repo / "recipes/envs/calculator.py")], "not supported with --env")):
        bad = rollout("--out", str(tmp_path / "bad"), "--sampling-mask", *extra)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()
