"""Vision-language models on the CUDA paths (GPU only): the Triton kernels and decode graphs against HF in
float32, graph replay (rotary positions offset past the images) against eager steps in bfloat16."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.multimodal import ImageInput
from rollout_cli.engine.trajectory import PromptInput

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_fixtures import HFVisionReference, ReferencePrompts, build_tiny_vlm, random_image  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def vlm(request, tmp_path_factory):
    directory = str(build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param))
    build = ReferencePrompts(directory)
    prompts = [build.build([random_image(20, 12, 1)]), build.build([random_image(32, 24, 2), random_image(16, 40, 3)]),
               build.build([], "text only")]
    return directory, prompts


def _run(model_dir: str, prompts, params, **options):
    engine = Engine(model_dir, device="cuda", attention_backend="triton", max_model_len=256, **options)
    inputs = [PromptInput(i, ids, images=images) for i, (ids, images) in enumerate(prompts)]
    return engine, sorted(engine.stream(inputs, params), key=lambda t: (t.prompt_index, t.sample_index))


def test_triton_and_graphs_match_hf_in_float32(vlm):
    model_dir, prompts = vlm
    engine, results = _run(model_dir, prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=12, ignore_eos=True),
                           dtype="float32", max_batch_tokens=16)
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    ref = HFVisionReference(model_dir)
    ref.model.to("cuda")
    # HF's patch embedding is a Conv3d, which cuDNN runs in TF32 by default (ours is a float32 matmul)
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    try:
        _compare(results, prompts, ref)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def _compare(results, prompts, ref) -> None:
    for result in results:
        ids, images = prompts[result.prompt_index]
        assert result.response_token_ids == ref.greedy(ids, images, 12)
        want = ref.logprobs(ids, images, result.response_token_ids)
        assert max(abs(a - b) for a, b in zip(want, result.response_logprobs, strict=True)) < 1e-3


def test_graph_replay_equals_eager_decode_bfloat16(vlm):
    model_dir, prompts = vlm
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_new_tokens=16, ignore_eos=True)
    outputs = []
    for graphs in (True, False):
        _, results = _run(model_dir, prompts, params, dtype="bfloat16", cuda_graphs=graphs)
        outputs.append([(r.response_token_ids, r.response_logprobs) for r in results])
    assert outputs[0] == outputs[1]


def test_pinned_image_rows_give_the_same_samples(vlm):
    """Rows in page-locked memory (what a CUDA engine's prompt reader makes, ImageInput.of(pin=True)):
    the same digest, and the tower's asynchronous copies give the same tokens and logprobs."""
    model_dir, prompts = vlm
    pinned = []
    for ids, images in prompts:
        again = tuple(ImageInput.of(im.pixel_values, im.grid_thw, pin=True) for im in images)
        assert all(a.pixel_values.is_pinned() and a.digest == b.digest for a, b in zip(again, images))
        pinned.append((ids, again))
    params = SamplingParams(n=2, temperature=1.0, seed=9, max_new_tokens=8, ignore_eos=True)
    outputs = [[(r.response_token_ids, r.response_logprobs) for r in _run(model_dir, p, params, dtype="bfloat16")[1]]
               for p in (prompts, pinned)]
    assert outputs[0] == outputs[1]
