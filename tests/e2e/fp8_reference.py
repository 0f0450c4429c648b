"""HF transformers' stacked MoE experts running the engine's W8A8 math (tests of --quantization fp8)."""

from __future__ import annotations

import torch

from rollout_kernels.fp8_blockwise_ref import quantize_weight_blockwise
from rollout_kernels.fused_moe_fp8 import fused_experts_fp8_ref


def expert_block_rows(engine) -> list[int]:
    """The engine's W8A8 experts' block rows, in layer order."""
    return [m.fp8_block_rows for m in engine.model.modules() if getattr(m, "fp8_block_rows", None) is not None]


def patch_experts(hf_model: torch.nn.Module, block_rows: list[int]) -> None:
    """Every stacked-experts module of `hf_model` (gate_up_proj [E, 2I, H], down_proj [E, H, I]: the
    engine's w13 / w2 layout) quantized with the engine's block rows and run through the W8A8 reference."""
    experts = _experts_of(hf_model)
    assert len(experts) == len(block_rows), f"{len(experts)} HF expert modules, {len(block_rows)} W8A8 layers"
    for module, rows in zip(experts, block_rows, strict=True):
        _patch(module, rows)


def _experts_of(hf_model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in hf_model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)
            and hasattr(m, "down_proj")]


def patch_experts_with(hf_model: torch.nn.Module, stacks: list) -> None:
    """Every stacked-experts module running W8A8 on given e4m3 weights and scales (an FP8 checkpoint's):
    stacks[i] = ([w13, w13 scales, w2, w2 scales], block rows) of the i-th MoE layer."""
    experts = _experts_of(hf_model)
    assert len(experts) == len(stacks)
    for module, (tensors, block_rows) in zip(experts, stacks, strict=True):
        _run_w8a8(module, *tensors, block_rows)


def _patch(module: torch.nn.Module, block_rows: int) -> None:
    w13_q, w13_s = _quantize_stack(module.gate_up_proj.data, block_rows)
    w2_q, w2_s = _quantize_stack(module.down_proj.data, block_rows)
    _run_w8a8(module, w13_q, w13_s, w2_q, w2_s, block_rows)


def _run_w8a8(module: torch.nn.Module, w13_q, w13_s, w2_q, w2_s, block_rows: int) -> None:
    def forward(hidden_states, top_k_index, top_k_weights):
        return fused_experts_fp8_ref(hidden_states, w13_q, w13_s, w2_q, w2_s, top_k_weights.float(),
                                     top_k_index.int(), block_rows).to(hidden_states.dtype)

    module.forward = forward


def _quantize_stack(w: torch.Tensor, block_rows: int):
    pairs = [quantize_weight_blockwise(w[e], (block_rows, 128)) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
