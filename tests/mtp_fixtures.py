"""Tiny hybrid checkpoints with a multi-token-prediction head (`mtp.*` tensors, as the hub's Qwen3-Next and
Qwen3.5 checkpoints ship them, multimodal ones included; transformers writes none), for tests of
`--speculative mtp`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def with_mtp_head(src: str, dst: Path, seed: int = 7) -> str:
    """A copy of the checkpoint at `src` plus mtp.safetensors: the head's decoder layer takes the
    attention tensors of the model's first full-attention layer and the MLP tensors of its first sparse
    layer (a dense one if it has none), perturbed so the head differs from both; fc and the three norms
    random. A multimodal checkpoint (Qwen3.5 as the hub ships it) keeps its layers under
    model.language_model.* and its settings in text_config; its head is at mtp.* all the same."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config = config.get("text_config", config)
    tensors = {}
    for path in sorted(dst.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    layers = config.get("num_hidden_layers")
    types = config.get("layer_types") or ["full_attention" if (i + 1) % config.get("full_attention_interval", 4) == 0
                                          else "linear_attention" for i in range(layers)]
    full = types.index("full_attention")
    sparse = [i for i in range(layers) if config.get("num_experts", 0) and i not in (config.get("mlp_only_layers") or [])]
    mlp_layer = sparse[0] if sparse else full
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    head = {}
    for name, tensor in tensors.items():
        for layer, parts in ((full, (".self_attn.", ".input_layernorm.", ".post_attention_layernorm.")),
                             (mlp_layer, (".mlp.",))):
            prefix = (f"model.language_model.layers.{layer}." if name.startswith("model.language_model.")
                      else f"model.layers.{layer}.")
            if name.startswith(prefix) and any(part in "." + name[len(prefix):] for part in parts):
                noise = 0.05 * torch.randn(tensor.shape, generator=gen, dtype=torch.float32).to(tensor.dtype)
                head["mtp.layers.0." + name[len(prefix):]] = (tensor + noise).contiguous()
    head["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        head[f"mtp.{norm}.weight"] = 0.1 * torch.randn(hidden, generator=gen)
    save_file(head, str(dst / "mtp.safetensors"))
    return str(dst)
