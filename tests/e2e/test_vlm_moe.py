"""Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`) against HF transformers' own class, float32 on the CPU.

The tiny checkpoint of tests/vlm_fixtures.py (4 experts, top 2, expert width 24, hidden 64) in both stacked
expert layouts: as transformers' save_pretrained writes it (gate_up_proj [E, 2I, H], down_proj [E, H, I])
and as the hub's Qwen3-VL-MoE checkpoints store it (transposed: [E, H, 2I], [E, I, H]). Routing capture on
a prompt with images equals HF's router top-k. The rest of the VLM suite runs on this arch through the
`vlm` fixture of test_vlm_parity.py.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.trajectory import PromptInput

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_fixtures import HFVisionReference, ReferencePrompts, build_tiny_vlm, random_image  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(saved by transformers, the same weights with the experts stored as on the hub)."""
    saved = build_tiny_vlm(tmp_path_factory.mktemp("vlm_moe"), "qwen3_vl_moe")
    hub = tmp_path_factory.mktemp("vlm_moe_hub")
    shutil.copytree(saved, hub, dirs_exist_ok=True)
    path = str(hub / "model.safetensors")
    tensors = load_file(path)
    stacked = [name for name in tensors if name.endswith(STACKED)]
    assert len(stacked) == 2 * 3  # every layer is sparse (decoder_sparse_step 1)
    for name in stacked:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    return str(saved), str(hub)


def _engine(model_dir: str, **options) -> Engine:
    return Engine(model_dir, device="cpu", dtype="float32", max_model_len=512, kv_cache_tokens=4096, **options)


def _run(engine: Engine, prompts, params=GREEDY):
    inputs = [PromptInput(i, ids, images=images) for i, (ids, images) in enumerate(prompts)]
    return sorted(engine.stream(inputs, params), key=lambda t: (t.prompt_index, t.sample_index))


def _prompts(model_dir: str):
    build = ReferencePrompts(model_dir)
    return [build.build([random_image(20, 12, 1)]),
            build.build([random_image(32, 24, 2), random_image(16, 40, 3)], "compare them"),
            build.build([], "text only")]


def test_both_expert_layouts_load_and_match_hf(checkpoints):
    saved, hub = checkpoints
    with safe_open(f"{hub}/model.safetensors", framework="pt") as handle:
        gate_up = handle.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
        down = handle.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape()
    assert (gate_up, down) == ([4, 64, 48], [4, 24, 64])  # [E, H, 2I], [E, I, H]
    prompts = _prompts(saved)
    ref = HFVisionReference(saved)
    results = _run(_engine(saved), prompts)
    for result in results:
        ids, images = prompts[result.prompt_index]
        want = ref.greedy(ids, images, len(result.response_token_ids))
        assert result.response_token_ids == want, result.prompt_index
        assert result.response_logprobs == pytest.approx(ref.logprobs(ids, images, want), abs=1e-4)
    # HF reads the hub layout as the same model (its Transpose(1, 2) on load), and so does the engine
    hub_ref = HFVisionReference(hub)
    ids, images = prompts[1]
    assert hub_ref.greedy(ids, images, 10) == results[1].response_token_ids
    engine = _engine(hub)
    from_hub = _run(engine, prompts)
    for a, b in zip(results, from_hub):
        assert a.response_token_ids == b.response_token_ids
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-6)
    # and a reload switches layouts: the engine started from the hub layout takes transformers' one
    engine.reload_weights(saved)
    assert [r.response_token_ids for r in _run(engine, prompts)] == [r.response_token_ids for r in results]


def test_routing_capture_of_an_image_prompt_equals_hf_router_topk(checkpoints):
    saved, _ = checkpoints
    prompts = _prompts(saved)[:2]
    engine = _engine(saved)
    assert engine.enable_routing_capture() == "uint8"
    results = _run(engine, prompts, SamplingParams(temperature=1.0, seed=3, n=2, max_new_tokens=6, ignore_eos=True))
    num_moe, top_k = len(engine.model.moe_layers), engine.model.top_k
    assert (num_moe, top_k) == (3, 2)
    ref = HFVisionReference(saved)
    picked: list[torch.Tensor] = []
    gates = [layer.mlp.gate for layer in ref.model.model.language_model.layers]
    hooks = [gate.register_forward_hook(lambda module, args, out: picked.append(out[2])) for gate in gates]
    try:
        for traj in results:
            ids, images = prompts[traj.prompt_index]
            seq = traj.prompt_token_ids + traj.response_token_ids[:-1]
            got = traj.routed_experts
            assert got.shape == (len(seq), num_moe, top_k) and got.dtype == np.uint8
            picked.clear()
            with torch.no_grad():
                ref.model(**ref._inputs(seq, images))
            assert len(picked) == num_moe  # the router's (logits, weights, top-k ids) of each sparse layer
            for layer, want in enumerate(picked):
                have = torch.from_numpy(got[:, layer].astype(np.int64)).sort(-1).values
                assert torch.equal(have, want.sort(-1).values), (traj.prompt_index, traj.sample_index, layer)
    finally:
        for hook in hooks:
            hook.remove()


def test_fp8_quantization_takes_both_expert_layouts(checkpoints):
    """--quantization fp8 quantizes the experts as they load: the hub's transposed stacks give the same
    e4m3 weights, scales and samples as transformers' layout."""
    saved, hub = checkpoints
    prompts = _prompts(saved)[:2]
    engines = [_engine(path, quantization="fp8") for path in (saved, hub)]
    for name in ("w13", "w2", "w13_weight_scale_inv", "w2_weight_scale_inv"):
        a, b = (getattr(e.model.model.layers[0].mlp.experts, name) for e in engines)
        assert torch.equal(a.float(), b.float()), name
    runs = [_run(e, prompts) for e in engines]
    assert [r.response_token_ids for r in runs[0]] == [r.response_token_ids for r in runs[1]]
