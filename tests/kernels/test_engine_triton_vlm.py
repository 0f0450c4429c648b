"""Vision-language models on the Triton backend, under the interpreter on the CPU: image tokens' multimodal
positions reach the rotary kernels as per-token cos/sin rows (the fused norm-RoPE-store prologue of
Qwen3-VL, the rotary kernel of Qwen3.5's gated attention); same greedy tokens and logprobs as the torch path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from backends import assert_same_samples, interpreter_only
from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.trajectory import PromptInput

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_fixtures import ReferencePrompts, build_tiny_vlm, random_image  # noqa: E402


@interpreter_only
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5"])
def test_images_on_the_triton_backend_match_the_torch_path(arch, tmp_path):
    model_dir = str(build_tiny_vlm(tmp_path / arch, arch))
    build = ReferencePrompts(model_dir)
    prompts = [build.build([random_image(16, 24, 1)], "one"),
               build.build([random_image(24, 16, 2), random_image(16, 16, 3)], "two")]
    inputs = [PromptInput(i, ids, images=images) for i, (ids, images) in enumerate(prompts)]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=4, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        engine = Engine(model_dir, device="cpu", dtype="float32", attention_backend=backend, max_model_len=128,
                        kv_cache_tokens=1024, max_batch_tokens=16)  # chunks cut the images
        runs[backend] = sorted(engine.stream(inputs, params), key=lambda t: (t.prompt_index, t.sample_index))
    assert_same_samples(runs)
