"""Routing capture (`rollout run --capture-routing`) on the CPU: expert ids equal HF's router top-k for every
position of every sample (prompt positions served from the prefix cache included), prefix cache on == off,
routing shards paired with trajectory shards (and resume's cleanup), a dense model refused with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rollout_cli import SamplingParams
from rollout_cli.io.output_dir import completed_pairs
from rollout_cli.io.trajectories import TrajectoryWriter

from parity import make_engine, prompts_of

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "rollout_cli.cli.main", "run"]
SAMPLED = dict(temperature=1.0, seed=3, ignore_eos=True)


def _shared_prompts():
    system = prompts_of([18], seed=11)[0]
    return [system + tail for tail in prompts_of([3, 6], seed=12)]


def _capture(model_dir: str, prefix_cache: bool):
    engine = make_engine(model_dir, max_batch_tokens=32, enable_prefix_cache=prefix_cache)
    assert engine.enable_routing_capture() == "uint8"
    results = engine.generate(_shared_prompts(), SamplingParams(n=4, max_new_tokens=7, **SAMPLED))
    return engine, results


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "qwen3_moe_step2", "mixtral"])
def test_routing_equals_hf_router_topk_with_prefix_cache(tiny_moe_checkpoints, hf_ref, name):
    model_dir = tiny_moe_checkpoints[name]
    engine, results = _capture(model_dir, prefix_cache=True)
    assert engine.scheduler.stats.prefix_hit_rate > 0.5  # samples 1..3 (and the 2nd prompt) hit the cache
    num_moe, top_k = len(engine.model.moe_layers), engine.model.top_k
    hf = hf_ref.model(model_dir)
    assert len(results) == 8 and len({tuple(r.response_token_ids) for r in results}) > 1
    for traj in results:
        seq = traj.prompt_token_ids + traj.response_token_ids[:-1]
        got = traj.routed_experts
        assert got.shape == (len(seq), num_moe, top_k) and got.dtype == np.uint8
        with torch.no_grad():
            router_logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
        assert len(router_logits) == num_moe
        for layer, logits in enumerate(router_logits):
            want = torch.topk(logits.float().softmax(-1), top_k, dim=-1).indices.sort(-1).values
            have = torch.from_numpy(got[:, layer].astype(np.int64)).sort(-1).values
            assert torch.equal(have, want), (traj.prompt_index, traj.sample_index, layer)

    _, uncached = _capture(model_dir, prefix_cache=False)
    for a, b in zip(results, uncached):
        assert a.response_token_ids == b.response_token_ids
        assert np.array_equal(a.routed_experts, b.routed_experts), (a.prompt_index, a.sample_index)


def _routing(n: int, rows: int) -> np.ndarray:
    return (np.arange(rows * 2 * 3) % 7).astype(np.uint8).reshape(rows, 2, 3) + n


def test_writer_pairs_routing_shards_and_resume_drops_orphans(tmp_path):
    out = tmp_path / "out"
    writer = TrajectoryWriter(out, pa.schema([]), shard_rows=2, flush_seconds=1e9, routing_dtype="uint8",
                              routing_shape=(2, 3))
    for i in range(5):
        row = dict(prompt_index=i, sample_index=0, prompt_token_ids=[1, 2], response_token_ids=[3, 4, 5],
                   response_logprobs=[0.0] * 3, response_text="", finish_reason="length", weight_version="0",
                   response_weight_versions=["0"] * 3)
        writer.add(row, _routing(i, 4) if i != 4 else None)
    writer.close()
    names = sorted(p.name for p in (out / "trajectories").iterdir())
    assert names == sorted(p.name for p in (out / "routing").iterdir()) == [f"part-0000{i}.parquet" for i in range(3)]
    for name in names:
        traj = pq.read_table(out / "trajectories" / name).to_pylist()
        routing = pq.read_table(out / "routing" / name)
        assert routing.schema.field("routed_experts").type == pa.list_(pa.uint8())
        routing = routing.to_pylist()
        assert [(r["prompt_index"], r["sample_index"]) for r in traj] == \
            [(r["prompt_index"], r["sample_index"]) for r in routing]
        for row in routing:
            arr = np.asarray(row["routed_experts"], dtype=np.uint8).reshape(
                row["num_tokens"], row["num_layers"], row["top_k"])
            expected = _routing(row["prompt_index"], 4) if row["prompt_index"] != 4 else np.zeros((0, 2, 3), np.uint8)
            assert np.array_equal(arr, expected)
    # a kill between the two renames leaves routing without trajectories; temp files may be left too
    (out / "trajectories" / "part-00002.parquet").unlink()
    (out / "routing" / ".part-00003.parquet.tmp").write_bytes(b"partial")
    (out / "trajectories" / ".part-00003.parquet.tmp").write_bytes(b"partial")
    assert completed_pairs(out) == {(i, 0) for i in range(4)}
    assert sorted(p.name for p in (out / "routing").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    assert sorted(p.name for p in (out / "trajectories").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]


def _run(args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)


def test_cli_writes_paired_routing_and_refuses_dense_models(tiny_moe_checkpoints, tiny_checkpoints, tmp_path):
    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": pa.array(_shared_prompts(), pa.list_(pa.int64()))}), data)
    common = ["--data", str(data), "--n", "4", "--max-new-tokens", "5", "--device", "cpu", "--quiet",
              "--capture-routing", "--shard-rows", "3", "--max-model-len", "64"]
    moe_out, dense_out = tmp_path / "moe", tmp_path / "dense"
    with ThreadPoolExecutor(2) as pool:
        moe = pool.submit(_run, ["--model", tiny_moe_checkpoints["qwen3_moe"], "--out", str(moe_out)] + common)
        dense = pool.submit(_run, ["--model", tiny_checkpoints["qwen3"], "--out", str(dense_out)] + common)
        moe, dense = moe.result(), dense.result()

    assert dense.returncode != 0 and "Traceback" not in dense.stderr
    lines = [line for line in dense.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "MoE" in lines[0], dense.stderr
    assert not dense_out.exists()

    assert moe.returncode == 0, moe.stderr
    import json

    manifest = json.loads((moe_out / "manifest.json").read_text())
    assert manifest["capture_routing"] is True and manifest["routing"]["dtype"] == "uint8"
    names = sorted(p.name for p in (moe_out / "trajectories").iterdir())
    assert len(names) == 3 and names == sorted(p.name for p in (moe_out / "routing").iterdir())
    traj = pq.read_table(moe_out / "trajectories").to_pylist()
    routing = {(r["prompt_index"], r["sample_index"]): r for r in pq.read_table(moe_out / "routing").to_pylist()}
    assert len(traj) == len(routing) == 8
    for t in traj:
        row = routing[(t["prompt_index"], t["sample_index"])]
        arr = np.asarray(row["routed_experts"], dtype=np.uint8).reshape(row["num_tokens"], row["num_layers"], row["top_k"])
        assert arr.shape == (len(t["prompt_token_ids"]) + len(t["response_token_ids"]) - 1, 2, 2)


def test_capture_hands_out_finished_samples_one_step_later_and_before_an_error(tiny_moe_checkpoints):
    """With capture on, a step's finished samples leave the engine after the next step's launch (their
    routing is copied to the host meanwhile) or at the end; a step that fails hands them out before the error."""
    from rollout_cli.engine.engine import PromptInput

    model_dir = tiny_moe_checkpoints["qwen3_moe"]
    prompts = prompts_of([5, 7, 4], seed=21)
    inputs = [PromptInput(i, p, params=SamplingParams(max_new_tokens=2 + 3 * i, **SAMPLED))
              for i, p in enumerate(prompts)]

    def launches_at_yield(capture: bool, fail_at: int | None = None):
        engine = make_engine(model_dir, overlap_schedule=False)  # one launch per step: easy to count
        if capture:
            engine.enable_routing_capture()
        launch, calls = engine.runner.launch, []

        def counted_launch(*args, **kwargs):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("device lost")
            return launch(*args, **kwargs)

        engine.runner.launch = counted_launch
        for traj in engine.stream(inputs, SamplingParams()):
            yield traj.prompt_index, len(calls), traj

    plain, captured = list(launches_at_yield(False)), list(launches_at_yield(True))
    assert [p for p, _, _ in plain] == [p for p, _, _ in captured] == [0, 1, 2]
    plain_at = {p: n for p, n, _ in plain}
    for prompt, launches, traj in captured:
        assert traj.routed_experts.shape[0] == len(traj.prompt_token_ids) + len(traj.response_token_ids) - 1
        if prompt < 2:  # the last one leaves at the end of the stream, with no later launch
            assert launches == plain_at[prompt] + 1, (prompt, launches, plain_at)

    fail_at = plain_at[0] + 1  # the launch right after prompt 0 finished
    got = []
    with pytest.raises(RuntimeError, match="device lost"):
        for item in launches_at_yield(True, fail_at=fail_at):
            got.append(item)
    assert [p for p, _, _ in got] == [0]  # finished before the failing launch, handed out before the error
    assert got[0][2].routed_experts.shape[0] == len(got[0][2].prompt_token_ids) + 1
