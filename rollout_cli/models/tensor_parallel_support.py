"""Which models `--tp N` can split: the architectures built from the split layers of
models/tensor_parallel.py, and head counts and MLP widths N divides. Apart from the layers because it
needs the model registry, which imports every model, which imports the split layers."""

from __future__ import annotations

from rollout_cli.errors import RolloutError
from rollout_cli.models.registry import model_class_for
from rollout_cli.models.tensor_parallel import HeadSplit

# Architectures whose layers are all built from the split layers above.
# Vision-language models split their language model; every rank runs the whole (replicated) vision
# tower on the step's images, so each rank places the same embeddings at its image rows.
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3VLForConditionalGeneration")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
                     "Qwen3VLMoeForConditionalGeneration")
# Gated DeltaNet heads split like attention heads (models/gated_deltanet.py), full attention as above
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                        "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def check_tensor_parallel(hf_config, size: int) -> None:
    """Refuse, in one line, a model --tp N cannot split: other architectures, or head counts and MLP
    widths N does not divide."""
    if size == 1:
        return
    cls = model_class_for(hf_config)
    supported = DENSE_ARCHITECTURES + MOE_ARCHITECTURES + HYBRID_ARCHITECTURES
    if cls.__name__ not in supported:
        raise RolloutError(f"--tp {size} supports {', '.join(supported)} for now; "
                           f"{cls.__name__} runs with --tp 1 (or --dp N)")
    HeadSplit.of(hf_config.num_attention_heads, hf_config.num_key_value_heads, size, 0)
    for what in ("linear_num_key_heads", "linear_num_value_heads"):  # Gated DeltaNet heads: split, never replicated
        heads = getattr(hf_config, what, None)
        if heads is not None and heads % size:
            raise RolloutError(f"--tp {size} must divide the {heads} linear-attention "
                               f"{'key' if 'key' in what else 'value'} heads; choose a divisor")
    for what, width in cls.mlp_widths(hf_config).items():
        if width % size:
            raise RolloutError(f"--tp {size} must divide the {what} {width}; choose a divisor")
