"""The engine with every Triton kernel in the forward, under the interpreter on the CPU.

Same greedy tokens and logprobs as the torch path, through chunked prefill,
prefix sharing and decode (CUDA graphs are covered by tests/e2e/test_gpu_engine.py).
"""

from __future__ import annotations

import random

import pytest

from backends import assert_same_samples, generate_on_both_backends, interpreter_only
from rollout_cli import SamplingParams


@interpreter_only
@pytest.mark.parametrize("params", [
    SamplingParams(n=2, temperature=0.0, max_new_tokens=5),
    # seeded sampling: the Triton sampler draws the same uniforms on the device as the host does
    SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=50, seed=11, max_new_tokens=5),
], ids=["greedy", "sampled"])
def test_triton_backend_matches_torch_backend(tiny_checkpoints, params):
    model_dir = tiny_checkpoints["qwen2"]
    rng = random.Random(0)
    prompts = [[rng.randrange(400) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    runs, _ = generate_on_both_backends(model_dir, prompts, params, max_model_len=128, max_batch_tokens=16)
    assert_same_samples(runs)


@interpreter_only
def test_qwen3_fused_qk_norm_rope_store(tiny_checkpoints, monkeypatch):
    """Qwen3 (per-head q/k norm): the Triton batch takes q/k before norm and RoPE, one fused kernel
    per layer norms, rotates and stores them (never store_kv), and the greedy tokens are the torch path's."""
    import rollout_cli.engine.execution.triton_attention as triton_attention

    calls = {"fused": 0, "store_kv": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(triton_attention, "qk_norm_rope_store", counted("fused", triton_attention.qk_norm_rope_store))
    monkeypatch.setattr(triton_attention, "store_kv", counted("store_kv", triton_attention.store_kv))
    rng = random.Random(1)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(3, 20))] for _ in range(2)]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
    runs, _ = generate_on_both_backends(tiny_checkpoints["qwen3"], prompts, params, max_model_len=64,
                                        max_batch_tokens=16)
    assert_same_samples(runs)
    assert calls["fused"] > 0 and calls["store_kv"] == 0


@interpreter_only
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"], ids=["store_kv", "fused_prologue"])
def test_fp8_kv_cache_on_both_backends(tiny_checkpoints, arch):
    """--kv-cache-dtype fp8: the Triton writers quantize as the torch path does and the decode and
    extend kernels read the e4m3 pool as it does: same greedy tokens, logprobs to 2e-2. Not 1e-4: the two
    backends' k/v differ by float32 rounding before they are quantized, and a value that lands on the other
    side of an e4m3 rounding boundary moves by a whole e4m3 step (1/8 relative; 18 of 1.6M k values did on
    torch 2.13 + triton 3.9, moving a logprob by 6e-3). Given the same inputs the writers and readers agree
    bit for bit (tests/kernels/test_kv_store.py, test_fp8_kv_pool.py)."""
    rng = random.Random(2)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=5)
    runs, engine = generate_on_both_backends(tiny_checkpoints[arch], prompts, params, max_model_len=64,
                                             max_batch_tokens=16, kv_cache_dtype="fp8")
    assert engine.kv.is_fp8
    assert_same_samples(runs, logprob_tol=2e-2)


@interpreter_only
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_verified_drafts_on_the_triton_backend(arch, tiny_checkpoints, tiny_hybrid_checkpoints):
    """Speculative decoding's verify steps (a decode carrying draft tokens: an extend over the cached context;
    on a hybrid model the Triton conv and delta-rule decode kernels token by token, the state kept per
    draft position) on the Triton kernels: the tokens and logprobs of plain decoding on the torch path."""
    import sys
    from pathlib import Path

    from rollout_cli import Engine
    from rollout_cli.engine.trajectory import PromptInput

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speculative_oracle import OracleDrafter

    prompts = [[3, 9, 27, 81, 5], [7, 1, 4]]
    params = SamplingParams(n=2, temperature=1.0, seed=4, max_new_tokens=9, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        model = tiny_checkpoints["qwen3"] if arch == "qwen3" else tiny_hybrid_checkpoints[arch]
        engine = Engine(model, device="cpu", attention_backend=backend, max_model_len=64)
        if backend == "triton":
            truth = {(r.prompt_index, r.sample_index): r.response_token_ids for r in runs["torch"]}
            engine.scheduler.enable_speculation(OracleDrafter(truth, lambda k: k == 2), 3)
        runs[backend] = sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(prompts)], params),
                               key=lambda t: (t.prompt_index, t.sample_index))
    assert engine.scheduler.stats.accepted_draft_tokens > 0
    assert_same_samples(runs)


@interpreter_only
def test_mtp_drafts_on_the_triton_backend(tiny_hybrid_checkpoints, tmp_path):
    """--speculative mtp on the Triton kernels (the head's attention through the Triton attention batch, in
    the pass after each step and chained inside the verify step for a 2-token draft; verify steps with the
    linear layers token by token): the tokens and logprobs of plain decoding on the torch path."""
    import sys
    from pathlib import Path

    from rollout_cli import Engine
    from rollout_cli.engine.trajectory import PromptInput

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mtp_fixtures import with_mtp_head

    model = with_mtp_head(tiny_hybrid_checkpoints["qwen3_next"], tmp_path / "mtp")
    prompts = [[3, 9, 27, 81, 5], [7, 1, 4]]
    params = SamplingParams(n=2, temperature=1.0, seed=4, max_new_tokens=8, ignore_eos=True)
    runs = {}
    for backend, speculative in (("torch", None), ("triton", "mtp")):
        engine = Engine(model, device="cpu", attention_backend=backend, max_model_len=64, speculative=speculative,
                        num_draft_tokens=2 if speculative else None, speculative_gate=not speculative)
        runs[backend] = sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(prompts)], params),
                               key=lambda t: (t.prompt_index, t.sample_index))
    assert engine.scheduler.stats.verify_steps > 0
    assert_same_samples(runs)
