"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) on CUDA: the Triton backend (gated
attention over the Triton attention batch, the Triton conv / delta-rule kernels, fused MoE) with decode
steps replayed from CUDA graphs, against HF transformers' torch fallback, eager Triton steps and the
torch path (GPU only)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.scheduling.mtp_drafts import RecordingMTPDrafter

pytestmark = pytest.mark.gpu

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(vocab: int, count: int, seed: int, longest: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, longest))] for _ in range(count)]


def _engine(model_dir: str, **options) -> Engine:
    options.setdefault("max_model_len", 256)
    options.setdefault("max_running", 16)
    options.setdefault("attention_backend", "triton")
    return Engine(model_dir, device="cuda", **options)


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_triton_and_graphs_match_hf_in_float32(tiny_hybrid_checkpoints, hf_ref, name):
    model_dir = tiny_hybrid_checkpoints[name]
    engine = _engine(model_dir, dtype="float32", max_batch_tokens=32)  # prompts up to 60: chunked prefill
    graphs = engine.runner.graphs
    assert engine.attention_backend == "triton" and graphs is not None and graphs.linear_states is not None
    prompts = _prompts(engine.hf_config.vocab_size, 6, seed=1)
    results = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12, **GREEDY))
    assert graphs.replays > 0
    for traj in results:
        prompt = prompts[traj.prompt_index]
        assert traj.response_token_ids == hf_ref.greedy(model_dir, prompt, 12), (name, traj.prompt_index)
        ref = hf_ref.logprobs(model_dir, prompt, traj.response_token_ids)
        assert _max_diff(ref, traj.response_logprobs) < 1e-3, (name, traj.prompt_index)
    assert engine.scheduler.stats.prefix_hit_rate > 0  # the second samples forked the prompt snapshot


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_graph_replay_equals_eager_triton_bfloat16(tiny_hybrid_checkpoints, name):
    # 8 prompts prefilled in one step, equal output lengths: every decode step has batch 8, a graph
    # bucket, so replayed and eager steps run the same kernels on the same shapes
    model_dir = tiny_hybrid_checkpoints[name]
    params = SamplingParams(n=1, temperature=1.0, seed=5, max_new_tokens=24, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        engine = _engine(model_dir, dtype="bfloat16", cuda_graphs=graphs)
        assert (engine.runner.graphs is not None) == graphs
        moe = bool(getattr(engine.model, "moe_layers", None))
        if moe:
            engine.enable_routing_capture()
        runs.append(engine.generate(_prompts(engine.hf_config.vocab_size, 8, seed=2), params))
        if graphs:
            assert engine.runner.graphs.replays >= 20
    for replayed, eager in zip(*runs, strict=True):
        assert replayed.response_token_ids == eager.response_token_ids
        assert _max_diff(replayed.response_logprobs, eager.response_logprobs) < 1e-3
        if moe:  # the decode rows of the replayed run came from the graphs' routing buffer
            assert np.array_equal(replayed.routed_experts, eager.routed_experts)


def _torch_and_triton(model_dir: str, prompts, params, **options):
    """The same workload on the torch path and on auto (= Triton + graphs on CUDA), float32."""
    runs, engines = {}, {}
    for backend in ("torch", "auto"):
        engine = _engine(model_dir, dtype="float32", attention_backend=backend, **options)
        runs[backend] = engine.generate(prompts, params)
        engines[backend] = engine
    triton = engines["auto"]
    assert triton.attention_backend == "triton" and triton.runner.graphs.replays > 0
    assert engines["torch"].runner.graphs is None
    for a, b in zip(runs["torch"], runs["auto"], strict=True):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.response_token_ids == b.response_token_ids, (a.prompt_index, a.sample_index)
        assert _max_diff(a.response_logprobs, b.response_logprobs) < 1e-3
    return engines


def test_n4_prefix_sharing_matches_torch_path(tiny_hybrid_checkpoints):
    model_dir = tiny_hybrid_checkpoints["qwen3_next"]
    rng = random.Random(4)
    system = [rng.randrange(300) for _ in range(20)]
    prompts = [system + [rng.randrange(300) for _ in range(n)] for n in (3, 7, 1, 12)]
    # the samples forking a snapshot run one token: 1-token steps after state copies, replayed from graphs
    engines = _torch_and_triton(model_dir, prompts, SamplingParams(n=4, max_new_tokens=10, **GREEDY),
                                max_batch_tokens=16)
    for engine in engines.values():
        assert engine.scheduler.stats.prefix_hit_rate > 0.6


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_matches_torch_path(tiny_hybrid_checkpoints, prefix_cache):
    model_dir = tiny_hybrid_checkpoints["qwen3_next"]
    prompts = [[(5 * i + 11 * j) % 300 for j in range(n)] for i, n in enumerate((20, 14, 25, 11))]
    # each sample needs ~40 KV slots; 64 cannot hold the 8 samples: the scheduler must preempt
    engines = _torch_and_triton(model_dir, prompts, SamplingParams(n=2, max_new_tokens=20, **GREEDY),
                                max_model_len=64, kv_cache_tokens=65, max_batch_tokens=32,
                                enable_prefix_cache=prefix_cache)
    for engine in engines.values():
        assert engine.scheduler.stats.preemptions > 0


def test_graphs_replay_after_memory_release(tiny_hybrid_checkpoints):
    pytest.importorskip("torch_memory_saver")
    # the state pool lives in the kv_cache region: same addresses after resume, so the graphs stay valid
    engine = _engine(tiny_hybrid_checkpoints["qwen3_5"], dtype="bfloat16", weights_cpu_backup=True)
    prompts = _prompts(engine.hf_config.vocab_size, 8, seed=3)
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_new_tokens=16, ignore_eos=True)
    before = [(r.response_token_ids, r.response_logprobs) for r in engine.generate(prompts, params)]
    graphs = engine.runner.graphs
    engine.release_memory("weights,kv_cache")
    engine.resume_memory()
    assert engine.runner.graphs is graphs
    replays = graphs.replays
    assert [(r.response_token_ids, r.response_logprobs) for r in engine.generate(prompts, params)] == before
    assert graphs.replays > replays


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_verified_drafts_on_graphs_are_bitwise_plain_decoding(tiny_hybrid_checkpoints, name):
    """--deterministic in bfloat16 with CUDA graphs: verify steps (eager, the linear layers token by token
    with the state kept per draft position) between graph-replayed decodes give plain decoding's tokens
    and logprobs bit for bit, some drafts accepted and some not."""
    import sys
    from pathlib import Path

    from rollout_cli.engine.trajectory import PromptInput

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speculative_oracle import OracleDrafter

    model_dir = tiny_hybrid_checkpoints[name]
    prompts = _prompts(300, 6, seed=9)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=24, ignore_eos=True)
    runs = []
    for speculate in (False, True):
        engine = _engine(model_dir, dtype="bfloat16", deterministic=True)
        if speculate:
            truth = {(r.prompt_index, r.sample_index): r.response_token_ids for r in runs[0]}
            rng = random.Random(1)
            engine.scheduler.enable_speculation(OracleDrafter(truth, lambda k: rng.random() < 0.3), 4)
        runs.append(sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(prompts)], params),
                           key=lambda t: (t.prompt_index, t.sample_index)))
    for plain, spec in zip(*runs, strict=True):
        assert spec.response_token_ids == plain.response_token_ids
        assert spec.response_logprobs == plain.response_logprobs
    assert 0 < engine.scheduler.stats.accepted_draft_tokens < engine.scheduler.stats.draft_tokens


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_verify_steps_replay_verify_graphs(tiny_hybrid_checkpoints, name, deterministic):
    """An engine built with --speculative captures verify graphs for a hybrid (engine/execution/verify_layout.py:
    the linear layers read each step's layout from device buffers): verify steps replay them, 4 running x
    1 + 4 drafts, rows of entries with fewer drafts and padding rows included; greedy tokens of plain
    decoding in float32, and in the on-policy mode bf16 tokens and logprobs bit for bit."""
    import sys
    from pathlib import Path

    from rollout_cli.engine.trajectory import PromptInput

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speculative_oracle import OracleDrafter

    model_dir = tiny_hybrid_checkpoints[name]
    prompts = [PromptInput(i, p, params=SamplingParams(n=2, max_new_tokens=12 + 5 * i, **GREEDY))
               for i, p in enumerate(_prompts(300, 5, seed=9))]
    options = dict(dtype="bfloat16" if deterministic else "float32", deterministic=deterministic, max_running=4)
    want = sorted(_engine(model_dir, **options).stream(prompts, SamplingParams()),
                  key=lambda t: (t.prompt_index, t.sample_index))
    truth = {(t.prompt_index, t.sample_index): t.response_token_ids for t in want}
    engine = _engine(model_dir, speculative="siblings", num_draft_tokens=4, speculative_gate=False, **options)
    assert engine.runner.graphs.verify_buckets[-1] == 20
    rng = random.Random(2)
    engine.scheduler.enable_speculation(OracleDrafter(truth, lambda k: rng.random() < 0.3), 4)
    got = sorted(engine.stream(prompts, SamplingParams()), key=lambda t: (t.prompt_index, t.sample_index))
    assert [t.response_token_ids for t in got] == [t.response_token_ids for t in want]
    if deterministic:
        assert [t.response_logprobs for t in got] == [t.response_logprobs for t in want]
    stats = engine.scheduler.stats
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
    assert engine.runner.graphs.verify_replays >= stats.verify_steps // 8  # many steps of up to 4 verifying


@pytest.mark.parametrize("draft_tokens", [1, 3])
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_mtp_drafts_on_the_gpu_change_no_token(tiny_hybrid_checkpoints, tmp_path, name, draft_tokens):
    """--speculative mtp on the Triton backend in float32 (the head's KV layer in the pool): verify steps and the
    head's pass behind them replay graphs (3 tokens: the head's chain inside the verify graphs, mtp_chain.py);
    the greedy tokens of plain decoding with CUDA graphs."""
    import sys
    from pathlib import Path

    from rollout_cli.engine.trajectory import PromptInput

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mtp_fixtures import with_mtp_head

    model_dir = with_mtp_head(tiny_hybrid_checkpoints[name], tmp_path / "mtp")
    prompts = _prompts(300, 8, seed=5)
    params = SamplingParams(n=2, max_new_tokens=24, **GREEDY)
    runs = []
    for speculative in (None, "mtp"):
        engine = _engine(model_dir, dtype="float32", speculative=speculative, speculative_gate=not speculative,
                         num_draft_tokens=draft_tokens if speculative else None)
        runs.append(sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(prompts)], params),
                           key=lambda t: (t.prompt_index, t.sample_index)))
    for plain, spec in zip(*runs, strict=True):
        assert spec.response_token_ids == plain.response_token_ids
    assert engine.scheduler.stats.verify_steps > 0
    # verify steps replay verify graphs, the head's pass behind them too; 3 tokens: its chain inside them
    assert engine.runner.graphs.verify_replays > 0 and engine.runner.graphs.verify_head_graphs
    assert (engine.runner.graphs.verify.chain is not None) == (draft_tokens > 1)


def test_mtp_plain_steps_replay_graphs_above_the_max_batch(tiny_hybrid_checkpoints, tmp_path):
    """--speculative mtp --speculative-max-batch 4: steps of more running requests replay the CUDA graphs
    (which keep their hidden states for the head's pass), then drafts resume; greedy tokens of plain decoding."""
    import sys
    from pathlib import Path

    from rollout_cli.engine.trajectory import PromptInput

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mtp_fixtures import with_mtp_head

    model_dir = with_mtp_head(tiny_hybrid_checkpoints["qwen3_next"], tmp_path / "mtp")
    prompts = [PromptInput(i, p, params=SamplingParams(n=2, max_new_tokens=8 + 4 * i, **GREEDY))
               for i, p in enumerate(_prompts(300, 6, seed=9))]  # 12 running, down to 2
    runs, engines = [], []
    for options in ({}, {"speculative": "mtp", "speculative_max_batch": 4, "speculative_gate": False}):
        engine = _engine(model_dir, dtype="float32", **options)
        runs.append(sorted(engine.stream(prompts, SamplingParams()), key=lambda t: (t.prompt_index, t.sample_index)))
        engines.append(engine)
    for plain, spec in zip(*runs, strict=True):
        assert spec.response_token_ids == plain.response_token_ids
    assert engines[1].runner.graphs.replays > 0 and engines[1].scheduler.stats.verify_steps > 0


def test_mtp_drafts_on_graphs_are_the_heads_drafts_on_the_cpu(tiny_hybrid_checkpoints, tmp_path):
    """The head's drafts themselves (tokens compare equal whatever the drafts are): plain steps replaying the
    CUDA graphs, then the head's own graph behind them (it reads the decode graph's hidden states and sampled
    tokens), propose what the CPU's torch path proposes, float32 on both; so do the head's verify graphs for the
    verify steps planned ahead (their drafts never reach the host's propose: the log records what each verify
    step checked)."""
    import sys
    from pathlib import Path

    from rollout_cli.engine.trajectory import PromptInput

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mtp_fixtures import with_mtp_head

    model_dir = with_mtp_head(tiny_hybrid_checkpoints["qwen3_next"], tmp_path / "mtp")
    # 12 running, down to none: the head's KV built behind graph replays, its drafts read once 4 or fewer run
    prompts = [PromptInput(i, p, params=SamplingParams(max_new_tokens=6 + 4 * i, **GREEDY))
               for i, p in enumerate(_prompts(300, 12, seed=4))]
    logs = []
    for device in ("cpu", "cuda"):
        # above 4 running requests the steps are plain (graph replays on the GPU), the head drafting behind them
        options = dict(speculative="mtp", speculative_max_batch=4, speculative_gate=False, dtype="float32",
                       max_model_len=256, max_running=16, enable_prefix_cache=False)
        engine = (Engine(model_dir, device="cpu", **options) if device == "cpu" else _engine(model_dir, **options))
        log = {}
        engine.scheduler.enable_speculation(RecordingMTPDrafter(log), 1, 4)
        list(engine.stream(prompts, SamplingParams()))
        logs.append(log)
    assert engine.runner.graphs.replays > 0 and engine.runner.graphs.head_replays > 0
    cpu, gpu = logs
    shared = cpu.keys() & gpu.keys()
    assert len(shared) >= 30
    assert sum(cpu[k] == gpu[k] for k in shared) >= 0.95 * len(shared)  # float32 on both: near-ties alone may differ
