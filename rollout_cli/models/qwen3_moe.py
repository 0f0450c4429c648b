"""Qwen3MoeForCausalLM: the Qwen3 decoder (q/k RMSNorm) with sparse MoE MLPs; Qwen3-VL-MoE: it with the
vision tower.

Layer i is sparse unless it is in `mlp_only_layers` or (i + 1) is not a multiple
of `decoder_sparse_step`; dense layers keep the DecoderMLP of width
`intermediate_size`. Experts have width `moe_intermediate_size`.
"""

from __future__ import annotations

from torch import nn

from rollout_cli.models.moe import MoeMixin, SparseMoeBlock
from rollout_cli.models.qwen3 import Qwen3ForCausalLM
from rollout_cli.models.vision_language import VisionLanguageModel


class Qwen3MoeForCausalLM(MoeMixin, Qwen3ForCausalLM):
    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        self._record_moe_facts(config)

    @staticmethod
    def renormalize(config) -> bool:
        """Whether the top-k routing weights are rescaled to sum 1."""
        return bool(config.norm_topk_prob)

    def make_sparse_block(self, config, moe_index: int, flags: dict) -> nn.Module:
        num_experts, top_k = self.experts_of(config)
        return SparseMoeBlock(config.hidden_size, num_experts, top_k, config.moe_intermediate_size,
                              self.renormalize(config), moe_index)


class Qwen3VLMoeForConditionalGeneration(VisionLanguageModel, Qwen3MoeForCausalLM):
    """Qwen3-VL-MoE: the Qwen3-MoE decoder (multimodal rotary) under model.language_model.*, the vision tower
    with deepstack features under model.visual.* (models/vision_language.py).

    Its text config names the expert count num_local_experts (num_experts is an alias of it) and has no
    norm_topk_prob: HF's router always renormalises the top-k weights. The hub's checkpoints store the
    stacked experts transposed (gate_up_proj [E, H, 2I], down_proj [E, I, H]); transformers' own
    save_pretrained writes [E, 2I, H] / [E, H, I]: both load (moe.FusedExperts)."""

    @staticmethod
    def renormalize(config) -> bool:
        return True
