"""MoE models against HF transformers (CPU, float32): greedy tokens exact, logprobs to 1e-4, routing ids,
and the two checkpoint layouts of stacked experts (per-expert names, fused gate_up_proj/down_proj)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_cli import SamplingParams
from rollout_cli.errors import RolloutError

from parity import assert_matches_hf, make_engine, prompts_of

# ignore_eos: these random checkpoints have no eos token; every sample runs to max_new_tokens.
GREEDY = dict(temperature=0.0, ignore_eos=True)
MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_step2"]


@pytest.fixture(params=MOE_ARCHS)
def moe_arch(request, tiny_moe_checkpoints) -> tuple[str, str]:
    return request.param, tiny_moe_checkpoints[request.param]


def test_layer_structure_follows_config(tiny_moe_checkpoints):
    from rollout_cli.models.moe import SparseMoeBlock

    expected = {"qwen3_moe": [0, 2], "qwen3_moe_step2": [1, 3], "qwen2_moe": [0, 1], "mixtral": [0, 1]}
    for name, sparse in expected.items():
        engine = make_engine(tiny_moe_checkpoints[name])
        layers = engine.model.model.layers
        assert engine.model.moe_layers == sparse
        assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)] == sparse
        assert [layers[i].mlp.moe_index for i in sparse] == list(range(len(sparse)))
        assert (layers[sparse[0]].mlp.shared_expert is not None) == (name == "qwen2_moe")


def test_chunked_prefill_and_shared_prefixes_match_hf(moe_arch, hf_ref):
    _, model_dir = moe_arch
    prompts = prompts_of([1, 9, 17, 40], seed=2)  # 40 > max_batch_tokens: chunked prefill
    engine = make_engine(model_dir, max_batch_tokens=16)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=16, **GREEDY))
    assert_matches_hf(hf_ref, model_dir, results, prompts, 16)
    assert len(set(results[2].response_token_ids)) >= 5  # random weights give varied text

    system = prompts_of([20], seed=4)[0]
    shared = [system + tail for tail in prompts_of([3, 7], seed=5)]
    cached = make_engine(model_dir, max_batch_tokens=32, enable_prefix_cache=True)
    with_cache = cached.generate(shared, SamplingParams(n=4, max_new_tokens=10, **GREEDY))
    assert cached.scheduler.stats.prefix_hit_rate > 0.5
    assert_matches_hf(hf_ref, model_dir, with_cache, shared, 10, n=4)


class _ListRecorder:
    """Keeps every step's top-k ids per MoE layer (tests only; the engine uses RoutingPool)."""

    def __init__(self):
        self.steps: dict[int, list[torch.Tensor]] = {}

    def record(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        self.steps.setdefault(moe_index, []).append(topk_ids.clone())


def test_recorded_expert_ids_equal_hf_router_topk(moe_arch, hf_ref):
    """The routing hook hands out, per MoE layer, the top-k of HF's router logits for every position."""
    from rollout_cli.engine.execution.routing_pool import RoutingPool
    from rollout_cli.models.moe import set_routing_recorder

    _, model_dir = moe_arch
    prompt = prompts_of([13], seed=7)[0]
    engine = make_engine(model_dir, max_batch_tokens=8)  # prefill in chunks of 8, then decode steps
    recorder = _ListRecorder()
    num_moe = set_routing_recorder(engine.model, recorder)
    assert num_moe == len(engine.model.moe_layers)
    traj = engine.generate([prompt], SamplingParams(max_new_tokens=6, **GREEDY))[0]
    set_routing_recorder(engine.model, None)
    hf = hf_ref.model(model_dir)
    ids = torch.tensor([prompt + traj.response_token_ids[:-1]])
    with torch.no_grad():
        router_logits = hf(ids, output_router_logits=True).router_logits  # per MoE layer: [positions, E]
    assert len(router_logits) == num_moe
    top_k = engine.model.top_k
    for layer, logits in enumerate(router_logits):
        got = torch.cat(recorder.steps[layer])  # one request: rows are positions in order
        want = torch.topk(logits.float().softmax(-1), top_k, dim=-1).indices
        assert torch.equal(got.sort(-1).values, want.sort(-1).values), layer

    pool = RoutingPool(64, num_moe, top_k, engine.model.num_experts, "cpu")  # uint8: <= 256 experts
    slots = torch.tensor([9, 4, 17, 30, 2])
    pool.begin_step(slots)
    pool.record(num_moe - 1, torch.tensor([[3, 1, 2]] * 5)[:, :top_k])
    assert pool.ids.dtype == torch.uint8 and pool.ids[slots, num_moe - 1, 0].tolist() == [3] * 5


def _write(src: str, dst: Path, tensors: dict) -> str:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return str(dst)


def _outputs(model_dir: str):
    engine = make_engine(model_dir, max_model_len=64)
    results = engine.generate(prompts_of([6, 11], seed=9), SamplingParams(max_new_tokens=8, **GREEDY))
    return [(r.response_token_ids, r.response_logprobs) for r in results]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_fused_expert_layout_loads_like_per_expert(tiny_moe_checkpoints, hf_ref, tmp_path, name):
    """transformers keeps experts fused in memory (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]); save_pretrained splits them into per-expert names. Both layouts load the same weights."""
    src = tiny_moe_checkpoints[name]
    per_expert = ".block_sparse_moe.experts.0.w1.weight" if name == "mixtral" else ".mlp.experts.0.gate_proj.weight"
    assert any(per_expert in k for k in load_file(f"{src}/model.safetensors"))
    state = dict(hf_ref.model(src).state_dict())
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    state.pop("lm_head.weight", None) if hf_ref.model(src).config.tie_word_embeddings else None
    fused = _write(src, tmp_path / "fused", state)
    assert _outputs(fused) == _outputs(src)


def test_bad_expert_checkpoints_are_refused_by_name(tiny_moe_checkpoints, hf_ref, tmp_path):
    from rollout_cli.models.build import build_model, load_model_config
    from rollout_cli.models.loader import load_checkpoint, plan_checkpoint

    src = tiny_moe_checkpoints["qwen3_moe"]
    per_expert = load_file(f"{src}/model.safetensors")
    model = build_model(src, load_model_config(src), torch.device("cpu"), torch.float32, 64, load_format="dummy")

    def refused(dirname, tensors, match):
        path = _write(src, tmp_path / dirname, tensors)
        with pytest.raises(RolloutError, match=match):
            plan_checkpoint(model, path)
        return path

    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    refused("missing", {k: v for k, v in per_expert.items() if k != name}, f"missing tensors: {name}")
    fused = {k: v for k, v in hf_ref.model(src).state_dict().items() if k != "lm_head.weight"}
    refused("missing_fused", {k: v for k, v in fused.items() if k != "model.layers.0.mlp.experts.down_proj"},
            r"missing tensors: model\.layers\.0\.mlp\.experts\.down_proj")
    mixed = dict(per_expert, **{"model.layers.0.mlp.experts.gate_up_proj": fused["model.layers.0.mlp.experts.gate_up_proj"]})
    refused("mixed", mixed, r"both per-expert and fused expert tensors for model\.layers\.0\.mlp\.experts\.w13")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shrunk = dict(per_expert, **{name: per_expert[name][:-1].clone()})
    path = refused("shape", shrunk, rf"wrong shapes: {name} \(31, 64\)")
    with pytest.raises(RolloutError):
        load_checkpoint(model, path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing copied
    extra = dict(per_expert, **{"model.layers.0.mlp.experts.8.up_proj.weight": per_expert[name].clone()})
    refused("extra", extra, r"unexpected tensors: model\.layers\.0\.mlp\.experts\.8\.up_proj\.weight")


def test_missing_mixtral_expert_is_named_as_the_checkpoint_names_it(tiny_moe_checkpoints, tmp_path):
    from rollout_cli.models.build import build_model, load_model_config
    from rollout_cli.models.loader import plan_checkpoint

    src = tiny_moe_checkpoints["mixtral"]
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    tensors = {k: v for k, v in load_file(f"{src}/model.safetensors").items() if k != name}
    path = _write(src, tmp_path / "m", tensors)
    model = build_model(path, load_model_config(path), torch.device("cpu"), torch.float32, 64, load_format="dummy")
    with pytest.raises(RolloutError, match=rf"missing tensors: {name}"):
        plan_checkpoint(model, path)


def test_dummy_weights_fill_expert_parameters(tiny_moe_checkpoints):
    engine = make_engine(tiny_moe_checkpoints["qwen2_moe"], load_format="dummy")
    experts = engine.model.model.layers[0].mlp.experts
    assert 0.01 < experts.w13.std().item() < 0.03 and experts.w2.abs().sum() > 0
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, **GREEDY))[0]
    assert len(out.response_token_ids) == 3
