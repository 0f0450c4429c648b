"""Mixture-of-experts layers shared by the MoE model files (Qwen3-MoE, Qwen2-MoE, Mixtral).

A sparse block is `TopKRouter` (which experts, with which weights) followed by
`FusedExperts` (the experts' SwiGLU MLPs, weights stacked per expert):

    w13 [E, 2 * I, H]   gate rows first, then up rows (HF's `experts.gate_up_proj`)
    w2  [E, H, I]       (HF's `experts.down_proj`)

Two paths with the same routing rule: the plain-torch one (`fused_moe_ref`, the CPU path) and,
once `enable_triton_kernels` set `use_triton` on the router and the experts, the Triton one
(kernels/moe_routing.py, kernels/fused_moe.py). The Triton path never reads a tensor value on the
host, so MoE decode steps run inside CUDA graphs; the torch expert loop syncs once per layer.

Routing capture: every `SparseMoeBlock` knows its index among the model's MoE layers (`moe_index`)
and, when `routing_recorder` is set (see `set_routing_recorder`), hands it the top-k expert ids of
each step: `recorder.record(moe_index, topk_ids)` with topk_ids [T, top_k] (int64 from the torch
router, int32 from the Triton one) on the device, rows in the order of the flat batch.
`RoutingPool` is the recorder `rollout run --capture-routing` uses: ids indexed by KV slot, so a
request's routing lives where its KV lives (and stays with prefixes kept in the radix cache).
Inside a CUDA graph the recorder is a `GraphRoutingBuffer` (fixed addresses); the runner copies
its rows into the pool after each replay.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from rollout_cli.errors import RolloutError
from rollout_cli.models.layers import Linear, _copy_checked, default_weight_loader, linear
from rollout_cli.models.loader import TRANSPOSED
from rollout_cli.models.tensor_parallel import all_reduce, split_experts, tp_rank, tp_size


def moe_layer_ids(config, num_experts: int) -> list[int]:
    """Decoder layers with a sparse MLP, the rule of HF's Qwen2/Qwen3-MoE decoder layers."""
    only_dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [i for i in range(config.num_hidden_layers)
            if i not in only_dense and num_experts > 0 and (i + 1) % step == 0]


class MoeMixin:
    """Shared by the MoE model classes: which layers are sparse, and the facts routing capture needs.

    After construction: `num_experts`, `top_k`, and `moe_layers` (decoder layer ids of
    the sparse layers; the i-th holds the SparseMoeBlock with moe_index i).
    """

    @staticmethod
    def experts_of(config) -> tuple[int, int]:
        """(num_experts, top_k) from the config."""
        return config.num_experts, config.num_experts_per_tok

    @staticmethod
    def expert_width(config) -> int:
        """Each expert's intermediate size."""
        return config.moe_intermediate_size

    @classmethod
    def mlp_widths(cls, config) -> dict[str, int]:
        """The widths --tp N splits: the experts', the shared expert's, the dense layers' (if any)."""
        widths = {"expert intermediate size": cls.expert_width(config)}
        if getattr(config, "shared_expert_intermediate_size", 0):
            widths["shared expert intermediate size"] = config.shared_expert_intermediate_size
        if len(moe_layer_ids(config, cls.experts_of(config)[0])) < config.num_hidden_layers:
            widths["intermediate size"] = config.intermediate_size
        return widths

    def make_sparse_block(self, config, moe_index: int, flags: dict) -> nn.Module:
        raise NotImplementedError

    def make_mlp(self, config, layer_idx: int, flags: dict) -> nn.Module | None:
        sparse = moe_layer_ids(config, self.experts_of(config)[0])
        if layer_idx not in sparse:
            return None  # dense DecoderMLP
        return self.make_sparse_block(config, sparse.index(layer_idx), flags)

    def _record_moe_facts(self, config) -> None:
        self.num_experts, self.top_k = self.experts_of(config)
        self.moe_layers = moe_layer_ids(config, self.num_experts)


class TopKRouter(nn.Module):
    """hidden [T, H] -> (topk_weights [T, k], topk_ids [T, k]), as HF's TopKRouter.

    Logits in the activation dtype (HF: F.linear on the hidden states), softmax in float32, the
    k most probable experts, optional renormalisation to sum 1, then (`weights_in_float32` False,
    the Qwen routers) rounded to the activation dtype. Ties go to the lower expert id (torch.topk
    leaves their order unspecified), and experts are ranked by logit, which softmax preserves:
    the torch and Triton paths pick the same ids whatever their exp rounds to.

    Torch path: weights in the activation dtype (float32 if weights_in_float32), ids int64.
    Triton path (`use_triton`): float32 weights holding the same rounded values, ids int32.
    """

    use_triton = False
    batch_invariant = False  # the logits' matmul (layers.enable_batch_invariant_kernels)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 weights_in_float32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_float32 = weights_in_float32

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(hidden, self.weight, batch_invariant=self.batch_invariant)  # [T, E]
        if self.use_triton:
            from rollout_kernels.moe_routing import topk_softmax  # Triton: optional on the CPU

            weight_dtype = torch.float32 if self.weights_in_float32 else logits.dtype
            return topk_softmax(logits, self.top_k, self.renormalize, weight_dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :self.top_k]  # [T, k]
        weights = probs.gather(1, ids)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float32:
            weights = weights.to(logits.dtype)
        return weights, ids


def fused_moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]), looping over the experts hit.

    hidden [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_* [T, k] -> [T, H] in hidden's dtype.
    Same order of operations as HF's eager experts: down projection, then the routing
    weight, then index_add into the output.
    """
    out = torch.zeros_like(hidden)
    flat_ids = topk_ids.reshape(-1)  # [T * k], slot s is token s // k, choice s % k
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # one host sync per layer (CPU path)
    k = topk_ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // k
        gate, up = F.linear(hidden[tokens], w13[expert]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w2[expert])  # [n, H]
        y = y * topk_weights.reshape(-1)[slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class FusedExperts(nn.Module):
    """E SwiGLU experts, weights stacked; loads both checkpoint layouts.

    Per-expert tensors `experts.{e}.{gate,up,down}_proj.weight` (hub format, and what
    transformers' save_pretrained writes) fill one expert's slice, shard id (e, part);
    fused `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] (transformers'
    in-memory layout) fill the whole parameter, shard id None; the same stored with dims 1 and 2
    swapped ([E, H, 2I] / [E, I, H]: the hub's Qwen3-VL-MoE checkpoints) load transposed, shard id
    loader.TRANSPOSED. A square stack (H == 2I, or H == I for down_proj) always reads as [E, 2I, H],
    HF's own rule (its Transpose(check_dims=True) keeps a tensor whose shape already fits).

    Under --tp N each rank holds i = I / N of every expert's intermediate size (w13 [E, 2i, H],
    w2 [E, H, i], models/tensor_parallel.split_experts) and its forward returns the rank's partial
    sum; the checkpoint is still checked against the full shapes.
    """

    use_triton = False  # kernels/fused_moe.py (needs the Triton router's float32 weights, int32 ids)
    fp8_block_rows: int | None = None  # --quantization fp8: e4m3 weights, scales per block of this many rows (models/fp8.py)
    batch_invariant = False  # one launch config for every batch (layers.enable_batch_invariant_kernels)
    # the token count whose tuned launch config the batch-invariant mode uses at every batch size: a
    # decode batch of 256, where on-policy rollouts spend their time
    BATCH_INVARIANT_TOKENS = 256

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 part_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        E, H, full = num_experts, hidden_size, intermediate_size
        if full % tp_size():
            raise RolloutError(f"--tp {tp_size()} must divide the expert intermediate size {full}; choose a divisor")
        I = full // tp_size()  # noqa: E741 - this rank's share of the intermediate size
        self.num_experts, self.intermediate_size = E, I
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, H, I), requires_grad=False)
        gate, up, down = part_names
        # Alternative checkpoint layouts, names relative to this module (see loader.plan_checkpoint).
        self.w13.checkpoint_layouts = [
            {f"{e}.{name}.weight": (e, part) for e in range(E) for part, name in ((0, gate), (1, up))},
            {"gate_up_proj": None},
        ]
        self.w2.checkpoint_layouts = [{f"{e}.{down}.weight": (e, 0) for e in range(E)}, {"down_proj": None}]
        # rows of one (rank-sliced) checkpoint tensor inside param[expert]: w13 holds 2 (gate, up), w2 one
        # (down); shard_shape: the full checkpoint tensor, what the loader checks
        full_shapes = {self.w13: ((E, 2 * full, H), (full, H)), self.w2: ((E, H, full), (H, full))}
        for param, rows in ((self.w13, I), (self.w2, H)):
            param.shard_rows = rows
            param.weight_loader = self._load
            param.shard_shape = lambda shard_id, shapes=full_shapes[param]: _expert_shard_shape(shapes, shard_id)
            param.loads_transposed = True  # a stacked tensor may come [E, K, N] for [E, N, K] (loader.TRANSPOSED)
        if tp_size() > 1:
            split_experts(self.w13, self.w2, full, tp_rank())

    @staticmethod
    def _load(param: nn.Parameter, tensor: torch.Tensor, shard_id) -> None:
        if shard_id is None or shard_id == TRANSPOSED:
            _copy_checked(param.data, tensor if shard_id is None else tensor.transpose(1, 2), "stacked experts")
            return
        expert, part = shard_id
        rows = param.shard_rows
        _copy_checked(param.data[expert].narrow(0, part * rows, rows), tensor, f"expert {expert} part {part}")

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_weights/topk_ids [T, k] -> [T, H]."""
        if self.fp8_block_rows is not None:  # W8A8: needs float32 routing weights and int32 ids on both paths
            # Triton: optional on the CPU
            from rollout_kernels.fused_moe_fp8 import fused_experts_fp8, fused_experts_fp8_ref

            run = fused_experts_fp8 if self.use_triton else fused_experts_fp8_ref
            return run(hidden, self.w13, self.w13_weight_scale_inv, self.w2, self.w2_weight_scale_inv,
                       topk_weights.float(), topk_ids.int(), self.fp8_block_rows)
        if self.use_triton:
            from rollout_kernels.fused_moe import fused_experts  # Triton: optional on the CPU

            # batch-invariant: one launch config for every batch size (tile shapes are part of the
            # arithmetic; the tuned files pick them by token count)
            configs = None
            if self.batch_invariant:
                from rollout_kernels.fused_moe_config import get_config  # Triton: optional on the CPU

                configs = get_config(self.BATCH_INVARIANT_TOKENS, self.num_experts, topk_ids.shape[1],
                                     self.intermediate_size, hidden.shape[1], hidden.dtype)
            return fused_experts(hidden, self.w13, self.w2, topk_weights, topk_ids, configs=configs)
        return fused_moe_ref(hidden, self.w13, self.w2, topk_weights, topk_ids)


def _expert_shard_shape(shapes: tuple, shard_id) -> tuple[int, ...]:
    """The full checkpoint shape of a shard of w13 / w2; shapes = (stacked [E, N, K], one expert part)."""
    if shard_id is None:
        return shapes[0]
    if shard_id == TRANSPOSED:
        experts, n, k = shapes[0]
        return experts, k, n
    return shapes[1]


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert scaled by sigmoid(shared_expert_gate(x))).

    Under --tp the experts (and the shared expert, built with DecoderMLP(reduce=False)) return partial
    sums: the block all-reduces once, after adding them. The router and the shared expert's gate are
    replicated, so every rank picks the same experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, moe_index: int, shared_expert: nn.Module | None = None,
                 weights_in_float32: bool = False,
                 expert_part_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize, weights_in_float32)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, expert_part_names)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden_size, 1) if shared_expert is not None else None
        self.moe_index = moe_index  # position among the model's MoE layers: routing capture's layer axis
        self.routing_recorder = None
        self.reduce = tp_size() > 1

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden)  # [T, k] each
        if self.routing_recorder is not None:  # (an MTP head's block has moe_index None: no recorder)
            self.routing_recorder.record(self.moe_index, topk_ids)
        out = self.experts(hidden, topk_weights, topk_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return all_reduce(out) if self.reduce else out  # [T, H]


def set_routing_recorder(model: nn.Module, recorder) -> int:
    """Point every SparseMoeBlock of `model` at `recorder` (an object with record(moe_index, topk_ids
    [T, k]); None turns capture off); returns the MoE layer count. The recorders themselves are
    engine state: engine/execution/routing_pool.py."""
    blocks = _captured_blocks(model)
    for block in blocks:
        block.routing_recorder = recorder
    return len(blocks)


def _captured_blocks(model: nn.Module) -> list["SparseMoeBlock"]:
    """The MoE layers whose routing is captured: all but an MTP head's (models/mtp.py: moe_index None)."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.moe_index is not None]


@contextmanager
def routing_recorder_swapped(model: nn.Module, recorder):
    """Every SparseMoeBlock records into `recorder` inside the block, and into its own recorder again after."""
    blocks = _captured_blocks(model)
    outside = [block.routing_recorder for block in blocks]
    for block in blocks:
        block.routing_recorder = recorder
    try:
        yield
    finally:
        for block, previous in zip(blocks, outside):
            block.routing_recorder = previous
