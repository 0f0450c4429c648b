"""MixtralForCausalLM: the Llama decoder with a sparse MoE MLP in every layer.

Hub checkpoints name the block `block_sparse_moe` and the experts' projections
w1 (gate), w3 (up), w2 (down); the loader maps `.block_sparse_moe.` to our `.mlp.`
(`checkpoint_renames`), so transformers' fused in-memory names load as well. The
router always renormalises its top-k and keeps the weights in float32, as HF does.
"""

from __future__ import annotations

from torch import nn

from rollout_cli.errors import RolloutError
from rollout_cli.models.llama import LlamaForCausalLM
from rollout_cli.models.moe import MoeMixin, SparseMoeBlock


class MixtralForCausalLM(MoeMixin, LlamaForCausalLM):
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    @staticmethod
    def flags_for(config) -> dict:
        return dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)

    @staticmethod
    def experts_of(config) -> tuple[int, int]:
        return config.num_local_experts, config.num_experts_per_tok

    @staticmethod
    def expert_width(config) -> int:
        return config.intermediate_size

    def __init__(self, config, max_positions: int):
        window = getattr(config, "sliding_window", None)
        if window and window < max_positions:
            raise RolloutError(f"sliding-window attention (window {window}) is not supported; "
                               f"use --max-model-len {window} or less")
        super().__init__(config, max_positions)
        self._record_moe_facts(config)

    def make_sparse_block(self, config, moe_index: int, flags: dict) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True, moe_index=moe_index,
                              weights_in_float32=True, expert_part_names=("w1", "w3", "w2"))
