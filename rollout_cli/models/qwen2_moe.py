"""Qwen2MoeForCausalLM: the Qwen2 decoder (qkv bias) with sparse MoE MLPs plus a shared expert.

Each sparse layer adds sigmoid(shared_expert_gate(x)) * shared_expert(x), the shared
expert a dense SwiGLU MLP of width `shared_expert_intermediate_size`. Sparse/dense
layer choice as in Qwen3-MoE (`mlp_only_layers`, `decoder_sparse_step`).
"""

from __future__ import annotations

from torch import nn

from rollout_cli.models.llama import DecoderMLP, LlamaForCausalLM
from rollout_cli.models.moe import MoeMixin, SparseMoeBlock


class Qwen2MoeForCausalLM(MoeMixin, LlamaForCausalLM):
    @staticmethod
    def flags_for(config) -> dict:
        return dict(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False, mlp_bias=False, qk_norm=False)

    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        self._record_moe_facts(config)

    def make_sparse_block(self, config, moe_index: int, flags: dict) -> nn.Module:
        shared = None
        if getattr(config, "shared_expert_intermediate_size", 0):
            shared = DecoderMLP(config, bias=False, intermediate_size=config.shared_expert_intermediate_size,
                                reduce=False)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(config.norm_topk_prob), moe_index,
                              shared_expert=shared)
