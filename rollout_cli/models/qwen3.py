"""Qwen3ForCausalLM: the Llama decoder plus per-head RMSNorm on q and k."""

from __future__ import annotations

from rollout_cli.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags_for(config) -> dict:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False, qk_norm=True)
