"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from rollout_cli.errors import RolloutError
from rollout_cli.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from rollout_cli.models.mixtral import MixtralForCausalLM
from rollout_cli.models.qwen2_moe import Qwen2MoeForCausalLM
from rollout_cli.models.qwen3 import Qwen3ForCausalLM, Qwen3VLForConditionalGeneration
from rollout_cli.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3VLMoeForConditionalGeneration
from rollout_cli.models.qwen3_next import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextForCausalLM,
)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    # vision-language checkpoints (build.load_model_config hands them the text config, vision config attached)
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}


def model_class_for(config):
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    shown = ", ".join(architectures) or "none listed in config.json"
    raise RolloutError(
        f"unsupported architecture ({shown}); supported: {', '.join(sorted(MODEL_CLASSES))}"
    )
