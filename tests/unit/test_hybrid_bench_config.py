"""recipes/configs/qwen3-next-80b-a3b-12l: Qwen3-Next-80B-A3B's shapes with 12 of its 48 layers, for
`rollout bench --load-format dummy` on one GPU. Built on the meta device here (no memory), and a copy
with few experts and a small vocabulary runs with dummy weights on the CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from rollout_cli import Engine, SamplingParams
from rollout_cli.models.build import load_model_config
from rollout_cli.models.registry import model_class_for

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "qwen3-next-80b-a3b-12l"

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: what the slice keeps
KEPT = dict(hidden_size=2048, head_dim=256, num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16,
            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            vocab_size=151936)  # and full_attention_interval 4: layer_types below


def test_slice_keeps_the_80b_shapes_and_fits_one_gpu():
    config = load_model_config(str(CONFIG_DIR))
    for key, value in KEPT.items():
        assert getattr(config, key) == value, key
    assert config.num_hidden_layers == 12  # of 48
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + (
        ["linear_attention"] * 3 + ["full_attention"]) * 2
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = model_class_for(config)(config, 4096)
    finally:
        torch.set_default_dtype(previous)
    weight_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    assert 30 < weight_gb < 60, weight_gb  # 40.8 GB
    assert model.num_kv_layers == 3 and len(model.moe_layers) == 12
    assert model.model.layers[3].self_attn.rotary.rotary_dim == 64  # partial rotary 0.25 of head_dim 256


def test_scaled_copy_generates_with_dummy_weights(tmp_path):
    raw = json.loads((CONFIG_DIR / "config.json").read_text())
    # the same layer and head shapes; 4 layers, 8 experts, a small vocabulary: ~1 GB in float32
    raw.update(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, vocab_size=512, max_position_embeddings=128)
    model_dir = tmp_path / "qwen3-next-scaled"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(raw))
    engine = Engine(str(model_dir), device="cpu", load_format="dummy", max_running=2, kv_cache_tokens=256)
    results = engine.generate([[1, 2, 3, 4, 5], [6, 7]], SamplingParams(n=2, temperature=0.0, max_new_tokens=3,
                                                                      ignore_eos=True))
    assert [len(r.response_token_ids) for r in results] == [3] * 4
    shutil.rmtree(model_dir)
