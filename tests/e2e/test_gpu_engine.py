"""The CUDA engine paths: Triton kernels and CUDA graphs against the torch path and HF (GPU only)."""

from __future__ import annotations

import random

import pytest
import torch

from rollout_cli import Engine, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 70))] for _ in range(count)]


def _engine(model_dir: str, **options) -> Engine:
    options.setdefault("max_model_len", 256)
    return Engine(model_dir, device="cuda", **options)


def test_triton_and_graphs_match_hf_in_float32(arch, hf_ref):
    name, model_dir = arch
    engine = _engine(model_dir, dtype="float32", attention_backend="triton", max_batch_tokens=32)
    assert engine.runner.graphs is not None and engine.cuda_graph_capture_seconds > 0
    prompts = _prompts(engine.hf_config.vocab_size, 6, seed=1)
    results = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=12))
    for result in results:
        prompt = prompts[result.prompt_index]
        assert result.response_token_ids == hf_ref.greedy(model_dir, prompt, 12), name
        ref = hf_ref.logprobs(model_dir, prompt, result.response_token_ids)
        assert max(abs(a - b) for a, b in zip(ref, result.response_logprobs, strict=True)) < 1e-3, name
    assert engine.scheduler.stats.prefix_hit_rate > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_replay_equals_eager_decode(tiny_checkpoints, dtype):
    # 8 prompts with equal output lengths: every decode step has batch 8, a graph bucket,
    # so eager and replayed steps run the same kernels on the same shapes.
    model_dir = tiny_checkpoints["qwen3"]
    params = SamplingParams(n=1, temperature=1.0, seed=5, max_new_tokens=24, ignore_eos=True)
    outputs = []
    for graphs in (True, False):
        engine = _engine(model_dir, dtype=dtype, attention_backend="triton", cuda_graphs=graphs)
        prompts = _prompts(engine.hf_config.vocab_size, 8, seed=2)
        outputs.append([(r.response_token_ids, r.response_logprobs) for r in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_triton_backend_agrees_with_torch_backend_bfloat16(tiny_checkpoints):
    model_dir = tiny_checkpoints["qwen2"]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
    runs = {}
    for backend in ("torch", "triton"):
        engine = _engine(model_dir, dtype="bfloat16", attention_backend=backend)
        prompts = _prompts(engine.hf_config.vocab_size, 5, seed=3)
        runs[backend] = engine.generate(prompts, params)
    agree = sum(a.response_token_ids[:4] == b.response_token_ids[:4]
                for a, b in zip(runs["torch"], runs["triton"], strict=True))
    assert agree >= 4  # bf16 rounding may flip a near-tie late; the first tokens must agree


def _overlap_runs(model_dir, dtype, params, prompts_of, eos_every=None):
    """(sequential, overlapped) results of one workload, and the overlapped run's steps scheduled ahead."""
    runs, ahead = [], []
    for overlap in (False, True):
        engine = _engine(model_dir, dtype=dtype, attention_backend="triton", overlap_schedule=overlap,
                         max_batch_tokens=64, max_running=12)
        if eos_every:
            engine.eos_token_ids = frozenset(range(5, engine.hf_config.vocab_size, eos_every))
        real = engine.scheduler.schedule_ahead
        engine.scheduler.schedule_ahead = lambda prev: ahead.append(real(prev)) or ahead[-1]
        results = sorted(engine.stream(prompts_of(engine), params), key=lambda t: (t.prompt_index, t.sample_index))
        runs.append([(r.response_token_ids, r.response_logprobs, r.finish_reason) for r in results])
        assert engine.runner.graphs.replays > 0
    return runs, [out for out in ahead if out is not None]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_overlapped_graph_steps_equal_sequential_ones(tiny_checkpoints, dtype):
    """Graph steps scheduled ahead take the previous replay's tokens on the device. Mixed lengths
    (samples leave the batch by length, queued prompts join it in eager mixed steps) give the same
    batches both ways, so the same bits."""
    from rollout_cli import PromptInput

    def prompts_of(engine):
        for i, prompt in enumerate(_prompts(engine.hf_config.vocab_size, 20, seed=4)):
            yield PromptInput(i, prompt, params=SamplingParams(n=2, temperature=1.0, seed=9, ignore_eos=True,
                                                               max_new_tokens=8 + 5 * (i % 7)))

    (sequential, overlapped), ahead = _overlap_runs(tiny_checkpoints["qwen3"], dtype, SamplingParams(), prompts_of)
    assert len(ahead) > 10
    assert overlapped == sequential


def test_overlapped_steps_drop_the_samples_that_stopped(tiny_checkpoints):
    """A sample that samples eos while its next step is already queued on the GPU: that row is computed
    and dropped (a ghost); tokens equal one step at a time (float32: batch sizes differ by the ghosts)."""
    from rollout_cli import PromptInput

    def prompts_of(engine):
        return [PromptInput(i, p) for i, p in enumerate(_prompts(engine.hf_config.vocab_size, 16, seed=5))]

    params = SamplingParams(n=2, temperature=1.0, seed=9, max_new_tokens=40)
    (sequential, overlapped), ahead = _overlap_runs(tiny_checkpoints["qwen3"], "float32", params, prompts_of,
                                                    eos_every=23)
    assert any(e.ghost for out in ahead for e in out.entries)
    assert {reason for _, _, reason in sequential} == {"stop", "length"}
    for (tokens, logprobs, reason), (want_tokens, want_logprobs, want_reason) in zip(overlapped, sequential, strict=True):
        assert (tokens, reason) == (want_tokens, want_reason)
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_kv_cache_graphs_replay_the_eager_steps_and_match_the_torch_path(tiny_checkpoints, dtype):
    """--kv-cache-dtype fp8 on the GPU: CUDA graphs (which bake the scales in) replay the eager steps
    bit for bit, and in float32 the Triton kernels give the torch path's greedy tokens."""
    model_dir = tiny_checkpoints["qwen3"]
    params = SamplingParams(n=1, temperature=1.0, seed=5, max_new_tokens=24, ignore_eos=True)
    outputs = []
    for backend, graphs in (("triton", True), ("triton", False), ("torch", False)):
        engine = _engine(model_dir, dtype=dtype, attention_backend=backend, cuda_graphs=graphs, kv_cache_dtype="fp8")
        assert engine.kv.is_fp8
        prompts = _prompts(engine.hf_config.vocab_size, 8, seed=2)
        outputs.append([(r.response_token_ids, r.response_logprobs) for r in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]
    if dtype == "float32":
        for (tokens, logprobs), (want, want_logprobs) in zip(outputs[1], outputs[2], strict=True):
            assert tokens == want
            assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-3


def test_fp8_weights_graphs_replay_the_eager_steps(tiny_checkpoints):
    """--quantization fp8 on the GPU: the decode graphs (the quantize launch and the FP8 GEMM captured)
    replay the eager steps bit for bit in bf16."""
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_new_tokens=24, ignore_eos=True)
    outputs = []
    for graphs in (True, False):
        engine = _engine(tiny_checkpoints["qwen3"], dtype="bfloat16", cuda_graphs=graphs, quantization="fp8")
        prompts = _prompts(engine.hf_config.vocab_size, 8, seed=4)
        outputs.append([(r.response_token_ids, r.response_logprobs) for r in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 16


@pytest.mark.parametrize("deterministic", [False, True])
def test_verify_steps_replay_the_decode_graphs(tiny_checkpoints, deterministic):
    """Speculative verify steps of a dense model replay the decode graphs as one-token rows (ModelRunner.
    _graph_rows): greedy tokens of plain decoding (in float32; bit for bit, logprobs too, in the on-policy
    mode), with drafts the oracle makes right and wrong."""
    import sys
    from pathlib import Path

    from rollout_cli.engine.trajectory import PromptInput

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speculative_oracle import OracleDrafter

    model_dir = tiny_checkpoints["qwen3"]
    prompts = [PromptInput(i, p) for i, p in enumerate(_prompts(300, 6, seed=4))]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=20, ignore_eos=True)
    options = dict(dtype="float32", attention_backend="triton", deterministic=deterministic)
    want = sorted(_engine(model_dir, **options).stream(prompts, params), key=lambda t: (t.prompt_index, t.sample_index))
    truth = {(t.prompt_index, t.sample_index): t.response_token_ids for t in want}
    engine = _engine(model_dir, **options)
    engine.scheduler.enable_speculation(OracleDrafter(truth, lambda k: k == 2), 4)  # the third draft is wrong
    got = sorted(engine.stream(prompts, params), key=lambda t: (t.prompt_index, t.sample_index))
    assert [t.response_token_ids for t in got] == [t.response_token_ids for t in want]
    if deterministic:
        assert [t.response_logprobs for t in got] == [t.response_logprobs for t in want]
    stats = engine.scheduler.stats
    assert stats.verify_steps > 0 and 0 < stats.accepted_draft_tokens < stats.draft_tokens
    assert engine.runner.graphs.replays >= stats.verify_steps // 12  # one replay per step of 12 verifying requests


def test_verify_steps_wider_than_the_batch_replay_verify_graphs(tiny_checkpoints):
    """With --speculative on a dense model the engine also captures graphs for verify steps' 1 + d rows per
    request (4 running x 1 + 4 drafts = 20 rows, past the decode batch of 4): they replay, greedy tokens of
    plain decoding in float32, drafts right and wrong; admission pacing got a measured eager-step price."""
    import sys
    from pathlib import Path

    from rollout_cli.engine.trajectory import PromptInput

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from speculative_oracle import OracleDrafter

    model_dir = tiny_checkpoints["qwen3"]
    prompts = [PromptInput(i, p) for i, p in enumerate(_prompts(300, 6, seed=4))]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=20, ignore_eos=True)
    options = dict(dtype="float32", attention_backend="triton", max_running=4)
    want = sorted(_engine(model_dir, **options).stream(prompts, params), key=lambda t: (t.prompt_index, t.sample_index))
    truth = {(t.prompt_index, t.sample_index): t.response_token_ids for t in want}
    engine = _engine(model_dir, speculative="siblings", num_draft_tokens=4, speculative_gate=False, **options)
    assert engine.runner.graphs.buckets[-1] == 20 and engine.runner.graphs.decode_batch == 4
    assert engine.runner.graphs.eager_over_replay > 0 and engine.scheduler.pacing.cost >= 2
    engine.scheduler.enable_speculation(OracleDrafter(truth, lambda k: k == 2), 4)  # the third draft is wrong
    got = sorted(engine.stream(prompts, params), key=lambda t: (t.prompt_index, t.sample_index))
    assert [t.response_token_ids for t in got] == [t.response_token_ids for t in want]
    stats = engine.scheduler.stats
    assert stats.verify_steps > 0 and 0 < stats.accepted_draft_tokens < stats.draft_tokens
    assert engine.runner.graphs.replays >= stats.verify_steps // 4  # every step of up to 4 verifying requests


def test_sampling_masks_on_the_gpu_sampler(tiny_checkpoints, hf_ref):
    """--sampling-mask on CUDA (bf16, graphs captured): masked samples run eagerly beside graph-replayed
    ones, each token lies in its mask (the compiled sampler's own kept set), and HF's float32 logits
    renormalised over the masks replay the run's logprobs. float32 on both sides: in bf16 the model's own
    drift (0.15 nats on one token of this random model) would hide a wrong mask's renormalisation."""
    import torch

    from rollout_cli.training import sampling_mask_logprobs

    model_dir = tiny_checkpoints["qwen3"]
    engine = _engine(model_dir, dtype="float32", attention_backend="triton")
    assert engine.runner.graphs is not None
    prompts = _prompts(engine.hf_config.vocab_size, 4, seed=5)
    params = SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.9, seed=2, max_new_tokens=8, ignore_eos=True,
                            return_sampling_mask=True)
    results = engine.generate(prompts, params)
    hf = hf_ref.model(model_dir)  # float32 on the CPU (a tiny model)
    for result in results:
        masks = result.response_sampling_mask
        assert all(token in ids and len(ids) <= 20 for token, ids in zip(result.response_token_ids, masks, strict=True))
        sequence = result.prompt_token_ids + result.response_token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([sequence])).logits[0, len(result.prompt_token_ids) - 1 : -1]
        replayed = sampling_mask_logprobs(logits, torch.tensor(result.response_token_ids), 0.9, masks)
        assert (replayed - torch.tensor(result.response_logprobs)).abs().max() < 2e-3  # GPU vs CPU float32 (TF32-free)


def test_fp8_rows_from_the_norms_and_silu_change_no_bit(fp8_groups_checkpoint):
    """--quantization fp8: the norms and SiLU-and-mul quantize for their FP8 readers (models/layers.
    feed_fp8_rows) with the bits the layers' own quantize launch gives: an engine whose producers are
    unwired samples the same tokens and logprobs, eagerly and from the decode graphs. 8 prompts x n 16
    decode 128 rows at once, where cuBLAS's blockwise GEMM is chosen where it works."""
    params = SamplingParams(n=16, temperature=1.0, seed=3, max_new_tokens=16, ignore_eos=True)
    runs = {}
    for graphs in (True, False):
        for wired in (True, False):
            engine = _engine(fp8_groups_checkpoint, dtype="bfloat16", cuda_graphs=graphs, quantization="fp8")
            producers = [m for m in engine.model.modules() if "fp8_consumer" in vars(m)]
            assert len(producers) == 3 * engine.hf_config.num_hidden_layers  # two norms and the SiLU per layer
            if not wired:
                for module in producers:
                    del vars(module)["fp8_consumer"]
            prompts = _prompts(engine.hf_config.vocab_size, 8, seed=6)
            runs[graphs, wired] = [(r.response_token_ids, r.response_logprobs) for r in engine.generate(prompts, params)]
    assert len(runs[True, True]) == 128
    # (graphs and eager steps may differ in the default mode: attention splits its context otherwise)
    assert runs[True, True] == runs[True, False], "graphs: the fused producers changed a bit"
    assert runs[False, True] == runs[False, False], "eager: the fused producers changed a bit"


def test_fp8_decode_graphs_of_128_rows_run_cublas_where_it_works(fp8_groups_checkpoint, monkeypatch):
    """The cuBLASLt probe runs when the FP8 model is built, before the decode graphs are captured (a capture
    cannot probe): graphs of >= CUBLAS_MIN_ROWS rows then capture cuBLAS's blockwise GEMM (on the H100,
    session 30, every graph had run our Triton GEMM: the probe came at the first eager prefill)."""
    from rollout_kernels import fp8_blockwise

    fp8_blockwise._cublas_blockwise_works.cache_clear()
    calls = []
    cublas = fp8_blockwise.cublas_blockwise_matmul
    monkeypatch.setattr(fp8_blockwise, "cublas_blockwise_matmul",
                        lambda *args: (calls.append(torch.cuda.is_current_stream_capturing()), cublas(*args))[1])
    _engine(fp8_groups_checkpoint, dtype="bfloat16", quantization="fp8", max_running=256)
    assert fp8_blockwise._cublas_blockwise_works.cache_info().currsize == 1  # probed at build
    if not fp8_blockwise.probe_cublas_blockwise(torch.device("cuda")):
        pytest.skip("this torch / cuBLAS build or GPU has no blockwise-scaled _scaled_mm (the engine's probe says so)")
    assert calls.count(True) > 1  # captured by a decode graph, besides the probe's own captured call


def test_shared_prefix_graphs_sample_what_the_plain_kernel_does(tiny_checkpoints, monkeypatch):
    """--shared-prefix-attention: replayed decode steps read each prompt's KV once for its n samples (the
    groups go to the graph through a static buffer) and sample what plain decode attention does."""
    import rollout_cli.engine.execution.cuda_graphs as cuda_graphs

    grouped, real = [], cuda_graphs.group_shared_prefixes

    def spy(requests, **kwargs):
        groups = real(requests, **kwargs)
        grouped.append(groups is not None and max(groups.prefix_lens) >= 32)
        return groups

    monkeypatch.setattr(cuda_graphs, "group_shared_prefixes", spy)
    rng = random.Random(6)
    runs = []
    for shared in (False, True):
        engine = _engine(tiny_checkpoints["qwen3"], dtype="float32", attention_backend="triton",
                         shared_prefix_attention=shared)
        prompts = [[rng.randrange(engine.hf_config.vocab_size) for _ in range(rng.randint(3, 90))] for _ in range(8)]
        rng = random.Random(6)  # the same prompts for the second engine
        params = SamplingParams(n=4, temperature=1.0, seed=3, max_new_tokens=20, ignore_eos=True)
        runs.append({(r.prompt_index, r.sample_index): r for r in engine.generate(prompts, params)})
        assert engine.runner.graphs.replays > 0 and engine.runner.graphs.shared_prefix == shared
    assert sum(grouped) > 5  # replays with groups of a long shared prompt
    for key, plain in runs[0].items():
        assert runs[1][key].response_token_ids == plain.response_token_ids, key
        gaps = [abs(a - b) for a, b in zip(runs[1][key].response_logprobs, plain.response_logprobs, strict=True)]
        assert max(gaps) < 1e-4, (key, max(gaps))
