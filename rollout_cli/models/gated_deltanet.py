"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5.

Per token: project to q, k, v (conv channels), z (output gate), b (-> beta)
and a (-> decay g); run q|k|v through a causal depthwise conv1d + SiLU; run the
gated delta rule over the sequence's recurrent state; normalise per value head
gated by silu(z); project out.

Our projection rows are part-major: in_proj_qkvz = [q (all k heads) | k | v
(all v heads) | z] and in_proj_ba = [b | a], so q|k|v is one contiguous slice
(the conv input). Qwen3-Next checkpoints group the rows per key head
([q_h, k_h, v_h..., z_h...] for each k head h); `grouped_row_loader` reorders
them on load. Qwen3.5 checkpoints store in_proj_qkv / in_proj_z / in_proj_b /
in_proj_a separately, loaded as shards of the same fused parameters.

The recurrences run in the engine's linear-state batch (`linear.conv`,
`linear.delta_rule`), which owns the per-sequence state slots, as attention
runs in `attn.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from rollout_cli.models.layers import FusedLinear, Linear, _copy_checked, default_weight_loader
from rollout_cli.models.norms import GatedRMSNorm
from rollout_cli.models.tensor_parallel import RowParallelLinear, mark_row_pieces, tp_rank, tp_size


@dataclass(frozen=True)
class LinearStateShape:
    """Per-sequence state of a model's linear-attention layers (what the engine's state pool stores)."""

    num_layers: int  # linear-attention layers
    conv_dim: int  # conv channels: 2 * k heads * k_dim + v heads * v_dim
    conv_kernel: int  # conv width K; the conv state keeps K - 1 inputs
    num_v_heads: int
    k_dim: int
    v_dim: int

    @property
    def bytes_per_sequence(self) -> int:
        """float32 conv + SSM state of one sequence over all linear layers."""
        per_layer = self.conv_dim * (self.conv_kernel - 1) + self.num_v_heads * self.k_dim * self.v_dim
        return 4 * self.num_layers * per_layer


def linear_state_shape(config, num_layers: int) -> LinearStateShape:
    """This process's state per sequence: under --tp N, its 1/N of the heads."""
    k_heads, v_heads = config.linear_num_key_heads // tp_size(), config.linear_num_value_heads // tp_size()
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
    return LinearStateShape(num_layers, 2 * k_heads * k_dim + v_heads * v_dim, config.linear_conv_kernel_dim,
                            v_heads, k_dim, v_dim)


def grouped_row_loader(num_groups: int, parts: list[int]):
    """weight_loader turning rows grouped per key head ([G, sum(parts), in]) into part-major rows."""

    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        if tensor.shape[0] != num_groups * sum(parts):
            _copy_checked(param.data, tensor, "grouped projection")  # raises with both shapes
        grouped = tensor.reshape(num_groups, sum(parts), -1)
        part_major = torch.cat([p.reshape(-1, grouped.shape[-1]) for p in grouped.split(parts, dim=1)], dim=0)
        _copy_checked(param.data, part_major, "grouped projection")

    # rows move in runs of whole parts: an fp8 scale block of this many rows (or a divisor) moves whole,
    # so an FP8 checkpoint's scales can follow the regrouping (models/fp8.scale_block_rows)
    load.row_granularity = functools.reduce(math.gcd, parts)
    return load


class GatedDeltaNet(nn.Module):
    def __init__(self, config, linear_idx: int, grouped_checkpoint: bool):
        super().__init__()
        self.linear_idx = linear_idx  # index among the linear layers: the state pool's layer axis
        H = config.hidden_size
        # --tp N: this rank's 1/N of the key heads and of the value heads (a value head's key head
        # is on the same rank); every size below is this rank's
        size = tp_size()
        self.num_k_heads = config.linear_num_key_heads // size
        self.num_v_heads = config.linear_num_value_heads // size
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_size, value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.splits = [key_size, key_size, value_size]
        self.conv_dim = 2 * key_size + value_size
        if grouped_checkpoint:  # Qwen3-Next: in_proj_qkvz / in_proj_ba, rows grouped per key head
            r = self.num_v_heads // self.num_k_heads
            self.in_proj_qkvz = Linear(H, self.conv_dim + value_size)
            self.in_proj_qkvz.weight.weight_loader = grouped_row_loader(
                self.num_k_heads, [self.k_dim, self.k_dim, r * self.v_dim, r * self.v_dim])
            self.in_proj_ba = Linear(H, 2 * self.num_v_heads)
            self.in_proj_ba.weight.weight_loader = grouped_row_loader(self.num_k_heads, [r, r])
        else:  # Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (packed_modules_mapping)
            self.in_proj_qkvz = FusedLinear(H, {"qkv": self.conv_dim, "z": value_size})
            self.in_proj_ba = FusedLinear(H, {"b": self.num_v_heads, "a": self.num_v_heads})
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, config.linear_conv_kernel_dim),
                                          requires_grad=False)  # [C, 1, K], the checkpoint's Conv1d layout
        self.conv1d.weight.weight_loader = default_weight_loader
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        for param in (self.dt_bias, self.A_log):
            param.weight_loader = default_weight_loader
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        if size == 1:
            self.out_proj = Linear(value_size, H)
        else:
            self.out_proj = RowParallelLinear(value_size * size, H, size, tp_rank())
            self._mark_rank_slices(grouped_checkpoint, size, tp_rank())
        self.activation = getattr(config, "hidden_act", "silu")
        self.use_triton = False  # the gating in one launch (kernels/gdn_gating_norm.py)

    def _mark_rank_slices(self, grouped_checkpoint: bool, size: int, rank: int) -> None:
        """Which rows of each full checkpoint tensor this rank holds (models/tensor_parallel.py)."""
        H = self.in_proj_qkvz.weight.shape[1]
        key, value = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim  # this rank's
        full_key, full_value = key * size, value * size
        # conv channels q | k | v: the rank's q heads, its k heads, its v heads
        qkv = [(rank * key, key), (full_key + rank * key, key), (2 * full_key + rank * value, value)]
        full_conv = 2 * full_key + full_value
        if grouped_checkpoint:  # rows grouped per key head: the rank's key heads are one range
            for weight in (self.in_proj_qkvz.weight, self.in_proj_ba.weight):
                rows = weight.shape[0]  # this rank's
                mark_row_pieces(weight, {None: [(rank * rows, rows)]}, {None: (rows * size, H)})
        else:  # Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, part-major
            heads = self.num_v_heads
            mark_row_pieces(self.in_proj_qkvz.weight, {"qkv": qkv, "z": [(rank * value, value)]},
                            {"qkv": (full_conv, H), "z": (full_value, H)})
            mark_row_pieces(self.in_proj_ba.weight, {"b": [(rank * heads, heads)], "a": [(rank * heads, heads)]},
                            {"b": (heads * size, H), "a": (heads * size, H)})
        mark_row_pieces(self.conv1d.weight, {None: qkv}, {None: (full_conv, 1, self.conv1d.weight.shape[2])})
        for param in (self.dt_bias, self.A_log):
            param.tp_split = {None: (0, rank * self.num_v_heads, self.num_v_heads, self.num_v_heads * size)}

    def forward(self, hidden: torch.Tensor, linear) -> torch.Tensor:
        """hidden [T, H] -> [T, H]; `linear` is the step's linear-state batch (engine.linear_state)."""
        T = hidden.shape[0]
        mixed, z = self.in_proj_qkvz(hidden).split([self.conv_dim, self.splits[2]], dim=-1)  # [T, C], [T, Hv*dv]
        b, a = self.in_proj_ba(hidden).chunk(2, dim=-1)  # [T, Hv] each
        mixed = linear.conv(self.linear_idx, mixed, self.conv1d.weight[:, 0], None, self.activation)  # [T, C]
        q, k, v = mixed.split(self.splits, dim=-1)
        q = q.reshape(T, self.num_k_heads, self.k_dim)
        k = k.reshape(T, self.num_k_heads, self.k_dim)
        v = v.reshape(T, self.num_v_heads, self.v_dim)
        g, beta = self._gating(a, b)  # [T, Hv] float32 (<= 0) and [T, Hv] in b's dtype
        out = linear.delta_rule(self.linear_idx, q, k, v, g, beta)  # [T, Hv, dv]
        out = self.norm(out, z.unflatten(-1, (self.num_v_heads, self.v_dim)))  # per value head
        return self.out_proj(out.reshape(T, -1))

    def _gating(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a, b [T, Hv] -> (g = -exp(A_log) * softplus(a + dt_bias) float32, beta = sigmoid(b))."""
        if self.use_triton:
            from rollout_kernels.gdn_gating_norm import gdn_gating  # Triton: optional on the CPU

            return gdn_gating(a, b, self.A_log, self.dt_bias)
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()
