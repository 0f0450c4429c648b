"""Memory release / resume on the GPU with torch_memory_saver (GPU only): the memory really goes
back (measured from another process), and decode graphs replay correctly after resume."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from rollout_cli import Engine, SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(n=2, temperature=1.0, seed=11, max_new_tokens=24, ignore_eos=True)


def _device_used_bytes() -> int:
    """GPU memory in use on device 0, as another process sees it."""
    code = "import torch; free, total = torch.cuda.mem_get_info(0); print(total - free)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def _prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % vocab for j in range(5 + 3 * i)] for i in range(8)]


def _outputs(engine: Engine):
    results = engine.generate(_prompts(engine.hf_config.vocab_size), PARAMS)
    return [(r.response_token_ids, r.response_logprobs) for r in results]


@pytest.fixture
def fresh_gpu():
    import torch

    gc.collect()
    # the CUDA context and cuBLAS of this process exist before any baseline is read: they are not the
    # engine's memory, and a release cannot free them (run alone, this test used to count them)
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    yield


def test_release_frees_the_gpu_and_resume_plus_reload_restores_outputs(tiny_checkpoints, fresh_gpu):
    pytest.importorskip("torch_memory_saver")
    model_dir = tiny_checkpoints["qwen3"]
    baseline = _device_used_bytes()
    # a KV pool of 4 GB (512 B per token): the memory a release must free dwarfs what it cannot
    # (Triton's loaded kernels, allocator rounding)
    engine = Engine(model_dir, device="cuda", dtype="bfloat16", max_model_len=512, kv_cache_tokens=8_000_000)
    assert engine.memory.backend == "torch_memory_saver" and engine.runner.graphs is not None
    before = _outputs(engine)
    held = _device_used_bytes() - baseline
    result = engine.release_memory()
    held_after = _device_used_bytes() - baseline
    # the KV pool (most of the GPU) and the weights are gone; what stays is the CUDA context and small buffers
    assert held_after <= 0.05 * held, (held, held_after)
    assert result["free_bytes_after"] - result["free_bytes_before"] > 0.9 * held
    resumed = engine.resume_memory()
    assert resumed["weights_stale"] and resumed["cuda_graph_capture_seconds"] is not None
    engine.reload_weights(model_dir)  # float32 files, bf16 engine
    replays = engine.runner.graphs.replays
    assert _outputs(engine) == before
    assert engine.runner.graphs.replays > replays  # decode steps ran on the re-captured graphs


def test_graphs_captured_before_release_replay_after_resume(tiny_checkpoints, fresh_gpu):
    pytest.importorskip("torch_memory_saver")
    engine = Engine(tiny_checkpoints["qwen2"], device="cuda", dtype="bfloat16", max_model_len=512,
                    weights_cpu_backup=True)
    before = _outputs(engine)
    graphs = engine.runner.graphs
    # weights and KV come back at the same addresses, so the graphs captured at start-up stay valid
    engine.release_memory("weights,kv_cache")
    resumed = engine.resume_memory()
    assert not resumed["weights_stale"] and resumed["cuda_graph_capture_seconds"] is None
    assert engine.runner.graphs is graphs
    replays = graphs.replays
    assert _outputs(engine) == before
    assert graphs.replays > replays
