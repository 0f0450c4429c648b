"""The vision tower of Qwen3-VL and Qwen3.5: image patches -> embeddings at the image's placeholder tokens.

One forward takes the patch rows of several images at once ([N, C * T * P * P], the HF image
processor's layout, merge blocks of m^2 consecutive rows) and their grids:
  patch embedding (a Conv3d whose stride is its kernel: one matmul over the flattened patch)
  + a learned position table [side^2, D] resampled bilinearly (align_corners) to each image's grid,
  -> `depth` pre-norm blocks (LayerNorm, bidirectional attention within each image with 2-D rotary
     positions, LayerNorm, GELU-tanh MLP),
  -> the merger: LayerNorm, then each m x m block of patches concatenated (4D) -> MLP -> the language
     model's hidden size. One token per merged block: [N / m^2, out_hidden].
Qwen3-VL also taps `deepstack_visual_indexes` blocks through mergers of their own (norm after the
concatenation); the language model adds those features to the image tokens' hidden states after
its first layers (models/vision_language.py). Qwen3.5 has none.
Checkpoint names are HF's under model.visual.* (renamed visual.* by the model class).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout_cli.models.layers import Linear, RotaryEmbedding, default_weight_loader


class LayerNorm(nn.Module):
    """LayerNorm with a weight and a bias, loaded like every parameter here."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.weight.weight_loader = self.bias.weight_loader = default_weight_loader
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class PatchEmbed(nn.Module):
    """Conv3d(C, D, kernel = stride = (T, P, P)) over one patch per row: a matmul with the flattened kernel."""

    def __init__(self, config):
        super().__init__()
        t, p, c = config.temporal_patch_size, config.patch_size, config.in_channels
        self.proj = nn.Module()
        # [D, C, T, P, P] as the checkpoint stores the Conv3d kernel
        self.proj.weight = nn.Parameter(torch.empty(config.hidden_size, c, t, p, p), requires_grad=False)
        self.proj.bias = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.proj.weight.weight_loader = self.proj.bias.weight_loader = default_weight_loader

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)  # [N, D]


class VisionAttention(nn.Module):
    use_triton = False  # the Triton rotary kernel, in place on q and k (layers.enable_triton_kernels)

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple, plan) -> torch.Tensor:
        """x [N, D]; rope: (rows [N] int64, cos, sin [N, head_dim] float32); `plan`: attention_plan's groups."""
        n = x.shape[0]
        rows, cos, sin = rope
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)
        if self.use_triton:  # float32 math in registers, written back in place into the qkv views
            from rollout_kernels.rotary import apply_rotary  # Triton: optional on the CPU

            q, k = apply_rotary(qkv[:, 0], qkv[:, 1], rows, cos, sin)
        else:
            q, k = _rotate(qkv[:, :2], cos[:, None, None], sin[:, None, None]).unbind(1)  # [N, heads, head_dim] each
        v = qkv[:, 2]
        if len(plan) == 1 and plan[0][2] is None:  # one length, images end to end: no gather
            length, count, _ = plan[0]
            out = _attend(q, k, v, count, length)
        else:
            out = torch.empty_like(q)
            for length, count, index in plan:
                out[index] = _attend(q[index], k[index], v[index], count, length)
        return self.proj(out.reshape(n, -1))


def _attend(q, k, v, count: int, length: int) -> torch.Tensor:
    """Bidirectional attention within each of `count` images of `length` patches laid end to end:
    q, k, v [count * length, heads, head_dim] -> the same shape."""
    heads, dim = q.shape[1], q.shape[2]
    q, k, v = (t.reshape(count, length, heads, dim).transpose(1, 2) for t in (q, k, v))  # [count, heads, L, d]
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(count * length, heads, dim)


def attention_plan(lengths: list[int], device) -> list[tuple[int, int, torch.Tensor | None]]:
    """[(length, image count, their rows or None)]: images of one length attend in one batched call; rows
    None when every image has the one length (a plain reshape). Built once per forward, for every block."""
    groups: dict[int, list[int]] = {}
    start = 0
    for length in lengths:
        groups.setdefault(length, []).append(start)
        start += length
    if len(groups) == 1:
        length, starts = next(iter(groups.items()))
        return [(length, len(starts), None)]
    return [(length, len(starts), torch.cat([torch.arange(s, s + length, device=device) for s in starts]))
            for length, starts in groups.items()]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32 over the whole last dim: x [N, ..., head_dim], cos/sin broadcast to it."""
    dtype, x = x.dtype, x.float()
    return (x * cos + RotaryEmbedding._rotate_half(x) * sin).to(dtype)


class VisionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = LayerNorm(config.hidden_size)
        self.norm2 = LayerNorm(config.hidden_size)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x, rope, plan):
        x = x + self.attn(self.norm1(x), rope, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """m x m patches -> one language-model token. `norm_after_merge`: the deepstack mergers normalise the
    concatenated [4D] rows; the final merger normalises each patch [D] first."""

    def __init__(self, config, norm_after_merge: bool):
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size ** 2
        self.norm_after_merge = norm_after_merge
        self.norm = LayerNorm(self.merged if norm_after_merge else config.hidden_size)
        self.linear_fc1 = Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = Linear(self.merged, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.norm_after_merge else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # [N / m^2, out_hidden]


class VisionTower(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Module()
        self.pos_embed.weight = nn.Parameter(torch.empty(config.num_position_embeddings, config.hidden_size),
                                             requires_grad=False)
        self.pos_embed.weight.weight_loader = default_weight_loader
        self.side = int(config.num_position_embeddings ** 0.5)
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        # axial 2-D rotary: head_dim / 4 frequencies per axis (h, then w), the whole head rotated
        quarter = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device="cpu") / quarter))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, norm_after_merge=False)
        self.deepstack_indexes = list(getattr(config, "deepstack_visual_indexes", None) or [])
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(config, norm_after_merge=True)
                                                   for _ in self.deepstack_indexes)

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack_indexes)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        """pixels [N, C * T * P * P], the images' rows end to end; grids: (t, h, w) per image ->
        (embeddings [N / m^2, out_hidden], deepstack features: one [N / m^2, out_hidden] per tapped block)."""
        x = self.patch_embed(pixels)
        x = x + self._positions(grids, x.device).to(x.dtype)
        rope = (torch.arange(x.shape[0], device=x.device), *self._rotary(grids, x.device))  # row t: patch t's
        plan = attention_plan([h * w for t, h, w in grids for _ in range(t)], x.device)  # within each frame
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, plan)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return self.merger(x), deepstack

    def matmul_flops(self, grids: list[tuple[int, int, int]]) -> int:
        """FLOPs of the tower's matmuls over images of these grids (2 per multiply-add): the patch embedding,
        per block qkv, attention scores and values, the output projection and the MLP, and the mergers."""
        patch_in = self.patch_embed.proj.weight[0].numel()
        d = self.patch_embed.proj.weight.shape[0]
        inter = self.blocks[0].mlp.linear_fc1.weight.shape[0] if len(self.blocks) else 0
        merged, out = self.merger.merged, self.merger.linear_fc2.weight.shape[0]
        total = 0
        for t, h, w in grids:
            n = t * h * w
            per_block = 2 * n * (3 * d * d + d * d + 2 * d * inter) + 2 * 2 * n * (h * w) * d  # + attention
            mergers = (1 + self.num_deepstack) * 2 * (n // self.merge ** 2) * (merged * merged + merged * out)
            total += 2 * n * patch_in * d + len(self.blocks) * per_block + mergers
        return total

    def _block_order(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) of each patch in the processor's order: m x m merge blocks, row-major within and across."""
        m = self.merge
        rows = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        cols = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        return rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)

    def _positions(self, grids, device) -> torch.Tensor:
        """The learned [side, side] position table resampled to each grid (bilinear, corners aligned) -> [N, D]."""
        side, table, out, by_grid = self.side, self.pos_embed.weight, [], {}
        for t, h, w in grids:
            if (h, w) in by_grid:  # images of one size share their resampled table
                out.append(by_grid[h, w].repeat(t, 1))
                continue
            rows, cols = self._block_order(h, w, device)
            (h0, h1), (wh0, wh1) = _taps(rows, h, side)
            (w0, w1), (ww0, ww1) = _taps(cols, w, side)
            # four taps, summed in HF's order (h0w0, h0w1, h1w0, h1w1)
            taps = torch.stack((h0 * side + w0, h0 * side + w1, h1 * side + w0, h1 * side + w1), dim=1)
            weights = torch.stack((wh0 * ww0, wh0 * ww1, wh1 * ww0, wh1 * ww1), dim=1)  # [h * w, 4]
            by_grid[h, w] = pos = (table[taps] * weights[:, :, None].to(table.dtype)).sum(1)
            out.append(pos.repeat(t, 1))
        return torch.cat(out)

    def _rotary(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] float32 of each patch's (row, col)."""
        inv_freq = self.inv_freq.to(device)
        parts, by_grid = [], {}
        for t, h, w in grids:
            if (h, w) not in by_grid:
                rows, cols = self._block_order(h, w, device)
                by_grid[h, w] = torch.cat((rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq), dim=-1)
            parts.append(by_grid[h, w].repeat(t, 1))
        freqs = torch.cat(parts)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _taps(index: torch.Tensor, size: int, side: int):
    """Bilinear taps (floor, floor + 1, clamped) and their weights of grid index `index` on an axis of
    `size` patches read from a table of `side` entries, corners aligned."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    frac = src - floor
    low = floor.long().clamp(0, side - 1)
    high = (floor.long() + 1).clamp(0, side - 1)
    return (low, high), (1 - frac, frac)
