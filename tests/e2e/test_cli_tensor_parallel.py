"""Tensor parallelism on the CPU (gloo, two processes): `rollout run --tp 2` writes the same greedy
tokens as `--tp 1`, logprobs within 1e-5 in float32, and a reload under tp 2 equals tp 1 on the new
weights; `--tp 2 --dp 2` (four processes, two engines) equals one engine. Rank slicing itself is unit-tested in tests/unit/test_tensor_parallel_loader.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_cli import Engine

LP_TOL = 1e-5  # the row-parallel all-reduce sums in another order than one matmul: last float32 bits move
# hybrid models carry those last bits through each sequence's recurrent state, token after token
# (the largest drift seen on the tiny checkpoints: 1.5e-5, Qwen3-Next)
HYBRID_LP_TOL = 5e-5
REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 17, 33, 2], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [5, 9, 17, 40]]


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("ROLLOUT_ENGINE", None)
    return env


def _run(*args, timeout: float = 240, command: str = "run", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", command, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**_env(), **(env or {})})


def _rows(out: Path) -> list[dict]:
    table = pq.read_table(out / "trajectories")
    return table.sort_by([("prompt_index", "ascending"), ("sample_index", "ascending")]).to_pylist()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp_prompts") / "prompts.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS, "tag": ["a", "b", "c", "d"]}), path)
    return path


def _odd_vocabulary(src: str, dst: Path, vocab: int) -> str:
    """The checkpoint with its vocabulary cut to `vocab` rows: the last rank's vocab slice is padded."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:vocab].clone()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["vocab_size"] = vocab
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def _tp1_and_tp2(args: list, tmp_path: Path, lp_tol: float = LP_TOL) -> tuple[list[dict], list[dict]]:
    """`rollout run ARGS` into tmp_path/one and, with --tp 2, into tmp_path/two: (rows of one, rows of two),
    checked to hold the same greedy tokens and logprobs within LP_TOL (4 prompts x 2 samples)."""
    one = _run(*args, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    two = _run(*args, "--out", tmp_path / "two", "--tp", "2")
    assert two.returncode == 0, two.stderr
    want, got = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert len(got) == len(want) == 8
    assert len({tuple(r["response_token_ids"]) for r in want}) == 4  # the prompts' greedy outputs differ
    for a, b in zip(got, want):
        key = (a["prompt_index"], a["sample_index"])
        assert a["response_token_ids"] == b["response_token_ids"], key
        assert a["response_logprobs"] == pytest.approx(b["response_logprobs"], abs=lp_tol), key
    return want, got


@pytest.mark.parametrize("name, extra", [
    ("qwen3", ["--max-batch-tokens", "8"]),  # q/k norms, head_dim 32; chunked prefill, prefix sharing (--n 2)
    ("llama_bias", []),  # attention and mlp biases: the split qkv bias and the row-parallel bias added once
    ("llama3_scaled", []),  # untied head, cut to an odd vocabulary (319): padded vocab-parallel rows
    ("qwen3", ["--kv-cache-dtype", "fp8"]),  # each rank's e4m3 pool holds its heads' k/v
])
def test_tp2_equals_tp1(tiny_checkpoints, prompts, tmp_path, name, extra):
    model = tiny_checkpoints[name]
    if name == "llama3_scaled":
        model = _odd_vocabulary(model, tmp_path / "v319", 319)
    want, got = _tp1_and_tp2(["--model", model, "--data", prompts, "--n", "2", "--max-new-tokens", "12",
                              "--temperature", "0", "--device", "cpu", "--kv-cache-tokens", "1024", "--quiet", *extra],
                             tmp_path)
    for a, b in zip(got, want):
        assert a["tag"] == b["tag"] and a["finish_reason"] == b["finish_reason"], a["prompt_index"]
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["engine"]["tensor_parallel"] == 2


def test_tp2_with_dp2_equals_one_engine_and_resumes(tiny_checkpoints, prompts, tmp_path):
    """Four processes: two engines of two tensor-parallel ranks each, sharing the prompts as data-parallel
    replicas (ranks 0-1 and 2-3); the union of their shards equals one single-process engine, and a
    --resume after losing replica 1's shards (under plain --tp 2) redoes only those rows."""
    args = ["--model", tiny_checkpoints["qwen3"], "--data", prompts, "--n", "2", "--max-new-tokens", "10",
            "--temperature", "0", "--device", "cpu", "--kv-cache-tokens", "1024", "--quiet"]
    one = _run(*args, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    both = tmp_path / "tp2dp2"
    run = _run(*args, "--out", both, "--tp", "2", "--dp", "2", timeout=400)
    assert run.returncode == 0, run.stderr
    shards = sorted(p.name for p in (both / "trajectories").glob("*.parquet"))
    assert {name[:10] for name in shards} == {"part-r000-", "part-r001-"}, shards

    def check(out):
        want, got = _rows(tmp_path / "one"), _rows(out)
        assert [(r["prompt_index"], r["sample_index"]) for r in got] == [(r["prompt_index"], r["sample_index"])
                                                                        for r in want]
        for a, b in zip(got, want):
            assert a["response_token_ids"] == b["response_token_ids"], a["prompt_index"]
            assert a["response_logprobs"] == pytest.approx(b["response_logprobs"], abs=LP_TOL), a["prompt_index"]

    check(both)
    manifest = json.loads((both / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["engine"]["tensor_parallel"] == 2
    for shard in (both / "trajectories").glob("part-r001-*"):
        shard.unlink()
    resumed = _run(*args, "--out", both, "--tp", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    check(both)


@pytest.mark.parametrize("command, args", [("bench", ["--num-prompts", "2"]), ("serve", ["--socket", "engine.sock"])])
def test_bench_and_serve_refuse_a_world_of_several_engines(tiny_checkpoints, tmp_path, command, args):
    """As torchrun would start them with 4 processes for --tp 2: one line, before any process group."""
    args = [str(tmp_path / a) if a == "engine.sock" else a for a in args]
    result = _run("--model", tiny_checkpoints["qwen3"], "--tp", "2", "--device", "cpu", *args, command=command,
                  env={"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {command} --tp 2 runs one engine: start 2 processes, not 4 (several engines: "
        "`rollout run --tp 2 --dp M`)"]


def _perturbed(src: str, dst: Path, scale: float) -> str:
    """A copy of the checkpoint with other weights (same names and shapes)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    tensors = {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_reload_under_tp2_equals_tp1_on_the_new_weights(tiny_checkpoints, tmp_path):
    model_a = tiny_checkpoints["qwen3"]
    model_b = _perturbed(model_a, tmp_path / "b", 0.3)
    bad = str(shutil.copytree(model_a, tmp_path / "bad"))
    tensors = load_file(f"{bad}/model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :64].clone()
    save_file(tensors, f"{bad}/model.safetensors")
    out = tmp_path / "tp2.json"
    driver = REPO / "tests" / "e2e" / "tp_reload_driver.py"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(driver), model_a, model_b, bad, str(out)],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(out.read_text())

    sys.path.insert(0, str(driver.parent))
    from tp_reload_driver import PROMPTS as DRIVER_PROMPTS, greedy  # noqa: E402

    assert DRIVER_PROMPTS
    want_a = greedy(Engine(model_a, device="cpu", max_model_len=64, max_batch_tokens=8))
    want_b = greedy(Engine(model_b, device="cpu", max_model_len=64, max_batch_tokens=8))
    assert [w[0] for w in want_a] != [w[0] for w in want_b]  # the reload changes the greedy outputs
    assert "wrong shapes: model.layers.1.mlp.down_proj.weight (64, 64)" in got["refused"]
    assert got["version_after_refusal"] == "0"
    assert got["b_version"] == "1"
    assert got["stale"] and got["a_tensors_version"] == "2"
    for key, want, version in (("a", want_a, "0"), ("a_again", want_a, "0"), ("b", want_b, "1"),
                               ("a_tensors", want_a, "2")):
        assert len(got[key]) == len(want) == 6
        for (tokens, logprobs, v), (want_tokens, want_logprobs, _) in zip(got[key], want):
            assert tokens == want_tokens, key
            assert logprobs == pytest.approx(want_logprobs, abs=LP_TOL), key
            assert v == version, key


@pytest.mark.parametrize("extra, message", [
    (["--tp", "2", "--dp", "0"], "error: --dp must be >= 1"),
    (["--tp", "3"], "error: --tp 3 must divide the 4 attention heads; choose a divisor"),
    (["--tp", "0"], "error: --tp must be >= 1"),
    (["--tp", "2", "--engine", "/nonexistent/rollout.sock"],
     "error: --tp starts an embedded engine: give --model (a daemon serves one engine)"),
])
def test_bad_tp_is_one_line(tiny_checkpoints, prompts, tmp_path, extra, message):
    result = _run("--model", tiny_checkpoints["qwen3"], "--data", prompts, "--out", tmp_path / "o", "--device", "cpu",
                  *extra)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [message]


def _routing(out: Path) -> dict:
    rows = pq.read_table(out / "routing").to_pylist()
    return {(r["prompt_index"], r["sample_index"]): r for r in rows}


@pytest.mark.parametrize("name", [
    "qwen3_moe",  # 8 experts top-2 of width 32 (16 per rank), layer 1 dense: split like a dense MLP
    "qwen2_moe",  # plus the shared expert (48 -> 24 per rank) summed into the block's one all-reduce; qkv bias
    "mixtral",  # block_sparse_moe.experts.E.w1/w3/w2 names, every layer sparse, untied head
])
def test_moe_tp2_equals_tp1_with_routing(tiny_moe_checkpoints, prompts, tmp_path, name):
    _tp1_and_tp2(["--model", tiny_moe_checkpoints[name], "--data", prompts, "--n", "2", "--max-new-tokens", "10",
                  "--temperature", "0", "--device", "cpu", "--kv-cache-tokens", "1024", "--max-batch-tokens", "16",
                  "--capture-routing", "--quiet"], tmp_path)
    routing_one, routing_two = _routing(tmp_path / "one"), _routing(tmp_path / "two")
    assert routing_two.keys() == routing_one.keys() and len(routing_two) == 8
    for key, row in routing_two.items():  # the replicated router picks the same experts on every rank
        assert row == routing_one[key], key
    assert len(set(routing_one[(2, 0)]["routed_experts"])) > 2  # the routing varies between tokens
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["engine"]["tensor_parallel"] == 2


def _tp2_on_triton_kernels_equals_torch(args: list, tmp_path: Path) -> None:
    """`rollout run ARGS` on the torch path into tmp_path/one, and with --tp 2 on the Triton kernels (under
    the interpreter) into tmp_path/two: the same tokens, logprobs within 1e-4 (kernels vs torch)."""
    one = _run(*args, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    two = _run(*args, "--out", tmp_path / "two", "--tp", "2", "--attention-backend", "triton",
               env={"TRITON_INTERPRET": "1"})
    assert two.returncode == 0, two.stderr
    for a, b in zip(_rows(tmp_path / "two"), _rows(tmp_path / "one"), strict=True):
        assert a["response_token_ids"] == b["response_token_ids"]
        assert a["response_logprobs"] == pytest.approx(b["response_logprobs"], abs=1e-4)


def test_moe_tp2_on_the_triton_kernels(tiny_moe_checkpoints, prompts, tmp_path):
    """The fused MoE kernels (the CUDA path; here under Triton's interpreter) on each rank's [E, 2I/2, H] and
    [E, H, I/2] expert slices: the tokens and routing of the one-process torch path."""
    _tp2_on_triton_kernels_equals_torch(
        ["--model", tiny_moe_checkpoints["qwen2_moe"], "--data", prompts, "--max-new-tokens", "4", "--temperature",
         "0", "--device", "cpu", "--max-model-len", "64", "--capture-routing", "--quiet"], tmp_path)
    assert _routing(tmp_path / "two") == _routing(tmp_path / "one")


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_hybrid_tp2_equals_tp1(tiny_hybrid_checkpoints, prompts, tmp_path, name):
    """Gated DeltaNet heads split over the ranks (grouped Qwen3-Next rows, split Qwen3.5 projections, the
    q | k | v conv channels), each rank's own state pool: through chunked prefill (the state carried across
    chunks), the second sample forking the prompt's state snapshot on every rank, and decode; MoE routing
    capture rows equal."""
    args = ["--model", tiny_hybrid_checkpoints[name], "--data", prompts, "--n", "2", "--max-new-tokens", "8",
            "--temperature", "0", "--device", "cpu", "--max-model-len", "64", "--max-batch-tokens", "8",
            "--quiet"] + (["--capture-routing"] if name != "qwen3_5" else [])
    _tp1_and_tp2(args, tmp_path, lp_tol=HYBRID_LP_TOL)  # measured drift: 1.5e-5 (qwen3_next), 5e-6, 7e-6
    if name != "qwen3_5":
        assert _routing(tmp_path / "two") == _routing(tmp_path / "one")


def test_hybrid_tp2_on_the_triton_kernels_equals_torch(tiny_hybrid_checkpoints, prompts, tmp_path):
    """The GPU path's kernels (here under Triton's interpreter) on each rank's heads and state slots: the
    conv and delta-rule kernels, the gating and norms, the fused MoE: the tokens of the one-process torch path."""
    _tp2_on_triton_kernels_equals_torch(
        ["--model", tiny_hybrid_checkpoints["qwen3_next"], "--data", prompts, "--n", "2", "--max-new-tokens", "6",
         "--temperature", "0", "--device", "cpu", "--max-model-len", "64", "--max-batch-tokens", "8", "--quiet"],
        tmp_path)


def test_hybrid_tp_must_divide_the_linear_heads(tiny_hybrid_checkpoints, prompts, tmp_path):
    result = _run("--model", tiny_hybrid_checkpoints["qwen3_next"], "--data", prompts, "--out", tmp_path / "o",
                  "--device", "cpu", "--tp", "4")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --tp 4 must divide the 2 linear-attention key heads; choose a divisor"]


def test_bench_under_tp2_reports_from_rank_0(tiny_moe_checkpoints, tmp_path):
    report_path = tmp_path / "bench.json"
    result = _run("--model", tiny_moe_checkpoints["qwen3_moe"], "--device", "cpu", "--num-prompts", 4,
                  "--input-len", 10, "--output-len", 6, "--n", 2, "--capture-routing", "compare", "--tp", 2,
                  "--json", report_path, command="bench", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert report["engine_settings"]["tensor_parallel"] == 2
    for run in (report["rollout"], report["rollout_capture"]):
        assert run["requests"] == 8 and run["output_tokens"] == 8 * 6  # eos ignored
        assert abs(run["prefix_hit_rate"] - 9 / 20) < 1e-9  # the second sample reuses 9 of the 10 prompt tokens
    assert report["bandwidth"]["decode_steps"] > 0
    assert result.stdout.count("rollout bench") == 1 and "capture overhead" in result.stdout  # one report


@pytest.mark.parametrize("extra, message", [
    (["--tp", "2", "--baseline", "hf"], "error: --baseline hf runs transformers in one process; compare it with --tp 1"),
    (["--tp", "3"], "error: --tp 3 must divide the 4 attention heads; choose a divisor"),
])
def test_bad_bench_tp_is_one_line(tiny_checkpoints, extra, message):
    result = _run("--model", tiny_checkpoints["qwen3"], "--device", "cpu", "--num-prompts", 2, *extra,
                  command="bench")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [message]


PAST_LENGTH = ["--num-prompts", "2", "--input-len", "10", "--output-len", "600", "--tp", "2"]
PAST_LENGTH_ERROR = ("error: a sample of this workload needs 610 tokens (its longest prompt, 10, + --output-len 600), "
                     "past the max model length 512 (max_position_embeddings in config.json), where the engine would "
                     "cut it short; lower --output-len or lower --input-len (the model has no more positions)")


def test_bench_tp2_refuses_a_workload_past_the_model_length_at_once(tiny_checkpoints):
    """--output-len past max_position_embeddings (512) under --tp 2: one line and exit 2 from the command
    typed. (Refused on rank 0 after the start, the same line came only after ~49 s: the follower waited for
    rank 0 in the rendezvous, deaf to the launcher's SIGTERM, until SIGKILL 30 s later; the next test checks
    that no rank starts, without timing anything.)"""
    result = _run("--model", tiny_checkpoints["qwen3"], "--device", "cpu", *PAST_LENGTH, command="bench", timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [PAST_LENGTH_ERROR]


def test_bench_tp2_checks_the_workload_before_starting_the_ranks(tiny_checkpoints, monkeypatch):
    from typer.testing import CliRunner

    import rollout_cli.cli.bench as bench_cli
    from rollout_cli.cli.main import app

    def launch_ranks(*args, **kwargs):
        raise AssertionError("the ranks started")

    monkeypatch.setattr(bench_cli, "launch_ranks", launch_ranks)
    monkeypatch.delenv("RANK", raising=False)
    result = CliRunner().invoke(app, ["bench", "--model", tiny_checkpoints["qwen3"], "--device", "cpu", *PAST_LENGTH])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [PAST_LENGTH_ERROR]
