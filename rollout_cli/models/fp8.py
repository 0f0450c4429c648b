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
state math. The MoE experts run the W8A8 fused MoE (kernels/fused_moe_fp8.py): e4m3 w13 / w2 with a
scale per (BN x 128) block of each expert, quantized as they load.

Weight updates stay exact about what they hold: the weight's loader takes the incoming (bf16 or
float32) tensor, quantizes it on the weight's device and writes the fp8 rows and their scale rows;
no unquantized copy of the model is kept.

Checkpoints already in FP8 (config.json's quantization_config: quant_method fp8, weight_block_size
[128, 128], as the hub's *-FP8 checkpoints) load as they are: an e4m3 weight tensor is placed by the
layer's own loader, and its `weight_scale_inv` [ceil(n / 128), ceil(k / 128)] goes through the same
loader as one scale per row, then one per block of BN rows (BN divides 128, so each of our blocks lies
in one of the checkpoint's; checked). No value is rounded twice: the bytes of the checkpoint are the
bytes the GEMM reads. Such a checkpoint runs with --quantization fp8 without the flag.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from rollout_cli.config import QUANTIZATIONS
from rollout_cli.errors import RolloutError
from rollout_cli.models.layers import FusedLinear, Linear
from rollout_cli.models.loader import TRANSPOSED
from rollout_cli.models.moe import FusedExperts
from rollout_kernels.fp8_blockwise_ref import FP8_DTYPE, quantize_weight_blockwise

KEPT_IN_MODEL_DTYPE = ("lm_head", "shared_expert_gate", "in_proj_ba")  # module names, see the docstring
BLOCK = 128
CHECKPOINT_BLOCK = [BLOCK, BLOCK]  # the one FP8 checkpoint layout taken as it is


def checkpoint_is_fp8(hf_config) -> bool:
    """Whether config.json says the weights are blockwise FP8 (refused with one line: other quantizations)."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return False
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    if method != "fp8":
        raise RolloutError(f"the checkpoint is quantized with {method!r}, which this engine does not load; "
                           "use its bf16 checkpoint (add --quantization fp8 for FP8 rollouts)")
    if list(config.get("weight_block_size") or []) != CHECKPOINT_BLOCK:
        raise RolloutError(f"the checkpoint's FP8 weight_block_size is {config.get('weight_block_size')}; this "
                           f"engine loads blockwise {CHECKPOINT_BLOCK} FP8 checkpoints only: use the bf16 checkpoint "
                           "with --quantization fp8")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise RolloutError("the checkpoint's FP8 activation_scheme is static; this engine quantizes activations "
                           "per token (dynamic): use the bf16 checkpoint with --quantization fp8")
    return True


def scale_block_rows(module: Linear) -> int:
    """BN: 128, or the largest power of two dividing every fused shard's row count (and the runs of rows
    a regrouping loader moves whole)."""
    sizes = [size for _, size in module.shard_offsets.values()] if isinstance(module, FusedLinear) \
        else [module.weight.shape[0]]
    sizes.append(getattr(module.weight.weight_loader, "row_granularity", BLOCK))
    return _largest_block_dividing(sizes)


def _largest_block_dividing(sizes: list[int]) -> int:
    common = functools.reduce(math.gcd, sizes)
    block = BLOCK
    while common % block:
        block //= 2
    return block


def _load_quantized(module: Linear, layer_loader, param: nn.Parameter, tensor: torch.Tensor, shard_id) -> None:
    """The fp8 weight's loader: the layer's own loader (shard placement, row regrouping) writes the
    tensor into a staging weight in the model's dtype (one layer's, freed after), whose rows of this
    shard are quantized into the fp8 rows and their scale rows; other shards keep their bits.
    An e4m3 tensor (an FP8 checkpoint's) is placed as it is; its scales come as their own tensor."""
    if tensor.dtype == FP8_DTYPE:
        layer_loader(param, tensor.to(param.device), shard_id)
        return
    staging = nn.Parameter(torch.empty(param.shape, dtype=param.load_dtype, device=param.device), requires_grad=False)
    if hasattr(param, "shard_offsets"):
        staging.shard_offsets = param.shard_offsets
    layer_loader(staging, tensor.to(param.device), shard_id)
    offset, size = module.shard_offsets[shard_id] if shard_id is not None else (0, param.shape[0])
    q, scale = _quantized(staging.data.narrow(0, offset, size), module.fp8_block[0])
    param.data.narrow(0, offset, size).copy_(q)
    module.weight_scale_inv.data.narrow(0, offset // module.fp8_block[0], scale.shape[0]).copy_(scale)


def _load_checkpoint_scales(module: Linear, layer_loader, param: nn.Parameter, tensor: torch.Tensor,
                            shard_id) -> None:
    """The loader of an FP8 checkpoint's weight_scale_inv [ceil(n / 128), KB] for n weight rows: one
    scale per row, placed by the layer's own loader like the weight's rows, then one per BN-row block."""
    weight = module.weight
    n = weight.shape[0] if shard_id is None else module.shard_offsets[shard_id][1]
    per_row = tensor.to(param.device, torch.float32).repeat_interleave(BLOCK, dim=0)[:n]  # [n, KB]
    staging = nn.Parameter(torch.empty(weight.shape[0], tensor.shape[1], device=param.device), requires_grad=False)
    if hasattr(weight, "shard_offsets"):
        staging.shard_offsets = weight.shard_offsets
    layer_loader(staging, per_row, shard_id)
    offset, size = module.shard_offsets[shard_id] if shard_id is not None else (0, weight.shape[0])
    rows = module.fp8_block[0]
    blocks = staging.data.narrow(0, offset, size).view(size // rows, rows, -1)  # [blocks, BN, KB]
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
        raise RolloutError(f"the checkpoint's 128-row scale blocks do not line up with {rows}-row blocks of this "
                           "layer; load the bf16 checkpoint with --quantization fp8")
    param.data.narrow(0, offset // rows, size // rows).copy_(blocks[:, 0])


def quantize_layer(module: Linear, empty: bool = False) -> None:
    """Replace the layer's weight by its blockwise e4m3 form and scales (in place, same device);
    `empty`: allocate them only, for a checkpoint loaded next."""
    old = module.weight
    block = (scale_block_rows(module), BLOCK)
    if empty:
        n, k = old.shape
        q = torch.empty(n, k, dtype=FP8_DTYPE, device=old.device)
        scale = torch.ones(n // block[0], -(-k // BLOCK), dtype=torch.float32, device=old.device)
    else:
        q, scale = _quantized(old.data, block[0])
    weight = nn.Parameter(q, requires_grad=False)
    weight.load_dtype = old.dtype  # updates arrive in the model's dtype, not e4m3 (loader.copy_into_parameters)
    weight.weight_loader = functools.partial(_load_quantized, module, old.weight_loader)
    if hasattr(old, "shard_offsets"):
        weight.shard_offsets = old.shard_offsets  # the loader checks shard shapes from it
    scales = nn.Parameter(scale, requires_grad=False)
    # not a checkpoint tensor of a bf16 checkpoint (the weight's loader writes it); an FP8 checkpoint's
    # own scales load through this loader
    scales.derived_from_weight = True
    scales.weight_loader = functools.partial(_load_checkpoint_scales, module, old.weight_loader)
    module.fp8_block = block
    module.weight = weight
    module.weight_scale_inv = scales


def quantize_model(model: nn.Module, quantization: str, empty: bool = False) -> int:
    """Quantize every linear layer but those KEPT_IN_MODEL_DTYPE (`empty`: allocate their fp8 weights and
    scales only, for the checkpoint loaded next); -> how many were quantized."""
    if quantization not in QUANTIZATIONS:
        raise RolloutError(f"unknown --quantization {quantization!r}; choose {', '.join(QUANTIZATIONS)}")
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.rsplit(".", 1)[-1] not in KEPT_IN_MODEL_DTYPE:
                quantize_layer(module, empty)
                count += 1
            elif isinstance(module, FusedExperts):
                quantize_experts(module, empty)
                count += 1
    for module in model.modules():
        if hasattr(module, "feed_fp8_rows"):  # decoder layers and MLPs: norms / SiLU-and-mul hand their
            module.feed_fp8_rows()            # FP8 readers quantized rows (models/layers.feed_fp8_rows)
    return count


# ---- MoE experts (W8A8 fused MoE, kernels/fused_moe_fp8.py) -------------------------------------

def quantize_experts(module: FusedExperts, empty: bool = False) -> None:
    """w13 [E, 2I, H] and w2 [E, H, I] to e4m3 with one scale per (BN x 128) block of each expert,
    BN the largest power of two up to 128 dividing I and H (a block never spans gate and up rows);
    `empty`: allocate only, for a checkpoint loaded next."""
    block_rows = _largest_block_dividing([module.intermediate_size, module.w2.shape[1]])
    module.fp8_block_rows = block_rows
    for name in ("w13", "w2"):
        old = getattr(module, name)
        num_experts, n, k = old.shape
        scale = torch.ones(num_experts, n // block_rows, -(-k // BLOCK), dtype=torch.float32, device=old.device)
        weight = torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device)
        if not empty:
            for expert in range(num_experts):
                weight[expert], scale[expert] = _quantized(old.data[expert], block_rows)
        param = nn.Parameter(weight, requires_grad=False)
        for attr in ("checkpoint_layouts", "shard_rows", "shard_shape", "loads_transposed"):
            if hasattr(old, attr):
                setattr(param, attr, getattr(old, attr))
        param.load_dtype = old.dtype  # updates arrive in the model's dtype (loader.copy_into_parameters)
        scales = nn.Parameter(scale, requires_grad=False)
        # written by the weight's loader from a bf16 checkpoint; an FP8 checkpoint's per-expert scales
        # (optional names, loader.scale_names) load through their own loader
        scales.derived_from_weight = True
        scales.checkpoint_scale_names = {rel.removesuffix(".weight") + ".weight_scale_inv": (shard, name)
                                         for rel, shard in old.checkpoint_layouts[0].items()}
        scales.weight_loader = functools.partial(_load_expert_scales, module, param)
        param.weight_loader = functools.partial(_load_quantized_experts, module, scales)
        setattr(module, name, param)
        setattr(module, f"{name}_weight_scale_inv", scales)


def _quantized(weight: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], scale per (block_rows x 128) block): one Triton launch on the GPU,
    the torch reference (the same bits) elsewhere."""
    if weight.is_cuda:
        from rollout_kernels.fp8_blockwise import quantize_weight  # Triton: optional on the CPU
        return quantize_weight(weight, (block_rows, BLOCK))
    return quantize_weight_blockwise(weight, (block_rows, BLOCK))


def _load_quantized_experts(module: FusedExperts, scales: nn.Parameter, param: nn.Parameter, tensor: torch.Tensor,
                            shard_id) -> None:
    """An expert weight's loader: one expert's gate, up or down rows (shard (expert, part)) or all
    experts stacked (None), quantized as they arrive; the other rows keep their bits."""
    block_rows = module.fp8_block_rows
    tensor = tensor.to(param.device)
    if shard_id == TRANSPOSED:  # the hub's Qwen3-VL-MoE stacks: [E, K, N] for our [E, N, K]
        tensor, shard_id = tensor.transpose(1, 2), None
    if shard_id is None:
        _copy_shape_checked(param, tensor, "stacked experts")
        for expert in range(param.shape[0]):
            param.data[expert], scales.data[expert] = _quantized(tensor[expert], block_rows)
        return
    expert, part = shard_id
    rows = param.shard_rows
    want = (rows, param.shape[2])
    if tuple(tensor.shape) != want:
        raise RolloutError(f"expert {expert} part {part} has shape {tuple(tensor.shape)}, the model expects {want}; "
                           "the checkpoint does not match config.json")
    if tensor.dtype == FP8_DTYPE:  # an FP8 checkpoint's: placed as it is, its scales come on their own
        param.data[expert].narrow(0, part * rows, rows).copy_(tensor)
        return
    q, scale = _quantized(tensor, block_rows)
    param.data[expert].narrow(0, part * rows, rows).copy_(q)
    scales.data[expert].narrow(0, part * rows // block_rows, rows // block_rows).copy_(scale)


def _load_expert_scales(module: FusedExperts, weight: nn.Parameter, param: nn.Parameter, tensor: torch.Tensor,
                        shard_id) -> None:
    """An FP8 checkpoint's expert scales [ceil(rows / 128), KB] for one expert part: one per 128 rows,
    spread over this layer's blocks of BN rows (BN divides 128 and the part's rows)."""
    expert, part = shard_id
    rows, block_rows = weight.shard_rows, module.fp8_block_rows
    per_row = tensor.to(param.device, torch.float32).repeat_interleave(BLOCK, dim=0)[:rows]  # [rows, KB]
    param.data[expert].narrow(0, part * rows // block_rows, rows // block_rows).copy_(per_row[::block_rows])


def _copy_shape_checked(param: nn.Parameter, tensor: torch.Tensor, what: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise RolloutError(f"{what} have shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}; "
                           "the checkpoint does not match config.json")
