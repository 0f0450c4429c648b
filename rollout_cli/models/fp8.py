"""`--quantization fp8`: a loaded model's linear layers in blockwise FP8 (issue 20).

Each quantized layer keeps `weight` as e4m3 [N, K] and a `weight_scale_inv` [N / BN, ceil(K / 128)]
float32 parameter beside it (the hub's FP8 layout, kernels/fp8_blockwise.py); its forward quantizes
the activations per token and 128-channel group and runs the blockwise GEMM (the torch reference on
the CPU). BN is 128, or for a fused layer whose shards are not multiples of 128 (tiny test models)
the largest power of two dividing every shard: a scale block never straddles two shards, so an
update of one shard (q, or gate) re-quantizes exactly the blocks it owns.

Left in the model's dtype, as the hub's FP8 checkpoints leave them: the LM head (the logits and
logprobs an RL trainer compares), embeddings, norms, the MoE router and shared-expert gate, Gated
DeltaNet's small b/a projections (they set the decay and write strength of the state) and its
state math. The MoE experts' fused GEMM stays in the model's dtype until its W8A8 kernel exists.

Weight updates stay exact about what they hold: the weight's loader takes the incoming (bf16 or
float32) tensor, quantizes it on the weight's device and writes the fp8 rows and their scale rows;
no unquantized copy of the model is kept.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from rollout_cli.config import QUANTIZATIONS
from rollout_cli.errors import RolloutError
from rollout_cli.models.layers import FusedLinear, Linear

KEPT_IN_MODEL_DTYPE = ("lm_head", "shared_expert_gate", "in_proj_ba")  # module names, see the docstring
BLOCK = 128


def scale_block_rows(module: Linear) -> int:
    """BN: 128, or the largest power of two dividing every fused shard's row count."""
    sizes = [size for _, size in module.shard_offsets.values()] if isinstance(module, FusedLinear) \
        else [module.weight.shape[0]]
    common = functools.reduce(math.gcd, sizes)
    block = BLOCK
    while common % block:
        block //= 2
    return block


def _load_quantized(module: Linear, layer_loader, param: nn.Parameter, tensor: torch.Tensor, shard_id) -> None:
    """The fp8 weight's loader: the layer's own loader (shard placement, row regrouping) writes the
    tensor into a staging weight in the model's dtype (one layer's, freed after), whose rows of this
    shard are quantized into the fp8 rows and their scale rows; other shards keep their bits."""
    from rollout_kernels.fp8_blockwise import quantize_weight_blockwise

    staging = nn.Parameter(torch.empty(param.shape, dtype=param.load_dtype, device=param.device), requires_grad=False)
    if hasattr(param, "shard_offsets"):
        staging.shard_offsets = param.shard_offsets
    layer_loader(staging, tensor.to(param.device), shard_id)
    offset, size = module.shard_offsets[shard_id] if shard_id is not None else (0, param.shape[0])
    q, scale = quantize_weight_blockwise(staging.data.narrow(0, offset, size), module.fp8_block)
    param.data.narrow(0, offset, size).copy_(q)
    module.weight_scale_inv.data.narrow(0, offset // module.fp8_block[0], scale.shape[0]).copy_(scale)


def quantize_layer(module: Linear) -> None:
    """Replace the layer's weight by its blockwise e4m3 form and scales (in place, same device)."""
    from rollout_kernels.fp8_blockwise import quantize_weight_blockwise

    old = module.weight
    block = (scale_block_rows(module), BLOCK)
    q, scale = quantize_weight_blockwise(old.data, block)
    weight = nn.Parameter(q, requires_grad=False)
    weight.load_dtype = old.dtype  # updates arrive in the model's dtype, not e4m3 (loader.copy_into_parameters)
    weight.weight_loader = functools.partial(_load_quantized, module, old.weight_loader)
    if hasattr(old, "shard_offsets"):
        weight.shard_offsets = old.shard_offsets  # the loader checks shard shapes from it
    scales = nn.Parameter(scale, requires_grad=False)
    scales.derived_from_weight = True  # not a checkpoint tensor: the weight's loader writes it
    module.fp8_block = block
    module.weight = weight
    module.weight_scale_inv = scales


def quantize_model(model: nn.Module, quantization: str) -> int:
    """Quantize every linear layer but those KEPT_IN_MODEL_DTYPE; -> how many were quantized."""
    if quantization not in QUANTIZATIONS:
        raise RolloutError(f"unknown --quantization {quantization!r}; choose {', '.join(QUANTIZATIONS)}")
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.rsplit(".", 1)[-1] not in KEPT_IN_MODEL_DTYPE:
                quantize_layer(module)
                count += 1
    return count
