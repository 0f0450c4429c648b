"""Qwen3ForCausalLM: the Llama decoder plus per-head RMSNorm on q and k; Qwen3-VL: it with the vision tower."""

from __future__ import annotations

from rollout_cli.models.llama import LlamaForCausalLM
from rollout_cli.models.vision_language import VisionLanguageModel


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags_for(config) -> dict:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False, qk_norm=True)


class Qwen3VLForConditionalGeneration(VisionLanguageModel, Qwen3ForCausalLM):
    """Qwen3-VL: the Qwen3 decoder (multimodal rotary) under model.language_model.*, the vision tower with
    deepstack features under model.visual.* (models/vision_language.py)."""
