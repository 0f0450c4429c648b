"""Qwen3MoeForCausalLM: the Qwen3 decoder (q/k RMSNorm) with sparse MoE MLPs.

Layer i is sparse unless it is in `mlp_only_layers` or (i + 1) is not a multiple
of `decoder_sparse_step`; dense layers keep the DecoderMLP of width
`intermediate_size`. Experts have width `moe_intermediate_size`.
"""

from __future__ import annotations

from torch import nn

from rollout_cli.models.moe import MoeMixin, SparseMoeBlock
from rollout_cli.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoeMixin, Qwen3ForCausalLM):
    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        self._record_moe_facts(config)

    def make_sparse_block(self, config, moe_index: int, flags: dict) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(config.norm_topk_prob), moe_index)
