"""Layers shared by the decoder model files.

Each parameter that is fused from several checkpoint tensors (qkv, gate_up)
carries a `weight_loader(param, tensor, shard_id)` that copies one checkpoint
tensor into its slice; the loader never needs to know the fusion layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout_cli.errors import RolloutError


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise RolloutError(
            f"tensor {name} has shape {tuple(src.shape)} but the model expects {tuple(dst.shape)}; "
            "the checkpoint does not match config.json"
        )
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
    _copy_checked(param.data, tensor, getattr(param, "checkpoint_name", "weight"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias [out]) -> [..., out]. `batch_invariant` (the on-policy
    mode's GPU path): the Triton matmul whose rows have the same bits in any batch, where cuBLAS
    picks its algorithm, and so its rounding, from the number of rows."""
    if not batch_invariant:
        return F.linear(x, weight, bias)
    from rollout_kernels.batch_invariant_matmul import batch_invariant_matmul  # Triton: optional on the CPU

    y = batch_invariant_matmul(x.reshape(-1, x.shape[-1]), weight, bias)  # [rows, out]
    return y.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Module):
    """y = x W^T (+ b); W is [out_features, in_features] as in checkpoints."""

    batch_invariant = False  # set by enable_batch_invariant_kernels
    fp8_block: tuple[int, int] | None = None  # (rows, cols) of a weight scale block under --quantization fp8 (models/fp8.py)

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_block is not None:
            from rollout_kernels.fp8_blockwise import fp8_linear  # Triton: optional on the CPU

            return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, self.fp8_block)
        return linear(x, self.weight, self.bias, self.batch_invariant)


class FusedLinear(Linear):
    """Several projections of the same input stacked along the output dim.

    `shard_sizes` maps a shard id (the checkpoint tensor it comes from) to its
    number of output rows, in stacking order: qkv uses {"q", "k", "v"},
    gate_up uses {0, 1}.
    """

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load_shard
                param.shard_offsets = self.shard_offsets  # the loader checks shard shapes from it

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id) -> None:
        offset, size = self.shard_offsets[shard_id]
        _copy_checked(param.data.narrow(0, offset, size), tensor, f"shard {shard_id}")


# ---- FP8 rows from the producer (issue 20) ----------------------------------------------------------
# Under --quantization fp8 an RMSNorm or SiLU-and-mul whose output only an FP8 linear layer reads (its
# `fp8_consumer`, wired by models/fp8.quantize_model through the decoder modules' feed_fp8_rows) writes that layer's e4m3 rows and scales itself:
# one launch instead of two, the same bits (kernels/rmsnorm.rms_norm_fp8, kernels/silu_mul.silu_and_mul_fp8).

def feed_fp8_rows(producer: nn.Module, consumer: Linear) -> None:
    """Make `producer` hand `consumer` quantized rows, if `consumer` is FP8. Kept out of the module tree:
    the consumer's weights get no second name."""
    if consumer.fp8_block is not None:
        object.__setattr__(producer, "fp8_consumer", consumer)


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda  # fp8_linear's own test for its Triton / cuBLAS path (tests patch it to run the interpreter)


def _quantizes_for(consumer: Linear | None, x: torch.Tensor) -> bool:
    return consumer is not None and _on_gpu(x) and x.dim() == 2 and x.shape[-1] % consumer.fp8_block[1] == 0


def _fp8_rows(consumer: Linear, x: torch.Tensor, dtype: torch.dtype, quantize):
    """quantize(scale_outer_major) -> (q, scale) of x's rows for `consumer`, in the layout of the GEMM
    fp8_linear picks for that many rows -> kernels.fp8_blockwise.FP8Rows."""
    from rollout_kernels.fp8_blockwise import FP8Rows, takes_cublas  # Triton: optional on the CPU

    cublas = takes_cublas(x.shape[0], x.shape[1], dtype, x.device, consumer.weight, consumer.fp8_block)
    q, scale = quantize(cublas)
    return FP8Rows(q, scale, dtype, cublas)


class RMSNorm(nn.Module):
    """RMSNorm with float32 math inside, optionally fused with the residual add.

    forward(x) -> normed; forward(x, residual) -> (normed, x + residual), where
    the sum is also the next residual. Summing in the activation dtype before
    normalising matches HF transformers.
    """

    fp8_consumer: Linear | None = None  # feed_fp8_rows: the FP8 layer that alone reads the output

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.eps = eps
        self.use_triton = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.use_triton:
            from rollout_kernels.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_fp8  # Triton: optional on the CPU

            if _quantizes_for(self.fp8_consumer, x):
                dtype = torch.promote_types(self.weight.dtype, x.dtype)
                rows = _fp8_rows(self.fp8_consumer, x, dtype, lambda outer_major: rms_norm_fp8(
                    x, self.weight, self.eps, residual, scale_outer_major=outer_major)[:2])
                return rows if residual is None else (rows, residual)  # the add is in place, as below
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)  # in place: x, residual are temporaries
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def rope_inverse_frequencies(config) -> tuple[torch.Tensor, float]:
    """inv_freq [rotary_dim // 2] and the cos/sin scale, computed as HF does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        # on the CPU even under `with torch.device("cuda")`: the tables must not land in the weights' memory
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
        return inv_freq, 1.0
    if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
        raise RolloutError(
            f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3, yarn, longrope"
        )
    with torch.device("cpu"):  # the model may be built under `with torch.device("cuda")`
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


class _RopeTables:
    """cos and sin tables [max_positions, rotary_dim] float32, built once on the CPU and copied
    once per device. Shared by every layer (and model) with the same frequencies and length:
    one copy per layer cost 42 MB each at 40960 positions (1.5 GB for a 36-layer model)."""

    _cache: dict[tuple, "_RopeTables"] = {}

    def __init__(self, inv_freq: torch.Tensor, scale: float, max_positions: int):
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_positions, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._by_device = {torch.device("cpu"): (emb.cos() * scale, emb.sin() * scale)}

    @classmethod
    def shared(cls, inv_freq: torch.Tensor, scale: float, max_positions: int) -> "_RopeTables":
        key = (tuple(inv_freq.tolist()), scale, max_positions)
        if key not in cls._cache:
            cls._cache[key] = cls(inv_freq, scale, max_positions)
        return cls._cache[key]

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._by_device:
            cos, sin = self._by_device[torch.device("cpu")]
            self._by_device[device] = (cos.to(device), sin.to(device))
        return self._by_device[device]


def mrope_rows(section: list[int], num_freqs: int) -> torch.Tensor:
    """[2 * num_freqs] long: the position row each rotary column follows under interleaved multimodal
    rotary (HF's Qwen3-VL): frequency i takes h (row 1) when i % 3 == 1 and i < 3 * section[1], w (row 2)
    when i % 3 == 2 and i < 3 * section[2], else t (row 0); the second half repeats the first."""
    rows = [0] * num_freqs
    for row in (1, 2):
        for i in range(row, min(3 * section[row], num_freqs), 3):
            rows[i] = row
    return torch.tensor(rows + rows, dtype=torch.long, device="cpu")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over the first `rotary_dim` dims of each head.

    cos and sin are float32 tables [max_positions, rotary_dim] (plain tensors, not buffers:
    model.to(bfloat16) must not round them), shared between layers, built on the CPU and
    copied to a device at its first forward there (outside any memory-saver region).
    """

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, scale = rope_inverse_frequencies(config)
        self.rotary_dim = inv_freq.numel() * 2
        self.head_dim = head_dim
        self._tables = _RopeTables.shared(inv_freq.cpu(), scale, max_positions)
        self.cos, self.sin = self._tables.on(torch.device("cpu"))
        self.use_triton = False
        params = getattr(config, "rope_parameters", None) or {}
        section = params.get("mrope_section") if isinstance(params, dict) else None
        # multimodal rotary (Qwen3-VL, Qwen3.5): which position row (0 t, 1 h, 2 w) each rotary column
        # follows; None: one position per token only
        self.mrope_rows = mrope_rows(section, inv_freq.numel()) if section else None

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [max_positions, rotary_dim] float32 on `device` (copied there once)."""
        if self.cos.device != device:
            self.cos, self.sin = self._tables.on(device)
        return self.cos, self.sin

    def tables_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index [T], cos, sin) such that cos[index[t]] is token t's row. positions [T] index the shared
        tables; multimodal positions [3, T] (t, h, w rows; a text token has three equal ones) get a table
        of their own, [T, rotary_dim], each column taken at the position row it follows."""
        cos, sin = self.tables_on(positions.device)
        if positions.dim() == 1:
            return positions, cos, sin
        if self.mrope_rows is None:
            raise ValueError("3-row positions for a model without multimodal rotary (mrope_section)")
        picked = positions[self.mrope_rows.to(positions.device)]  # [rotary_dim, T]
        columns = torch.arange(self.rotary_dim, device=positions.device)
        index = torch.arange(positions.shape[1], device=positions.device)
        return index, cos[picked.T, columns].contiguous(), sin[picked.T, columns].contiguous()  # [T, rotary_dim]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T] (or [3, T], multimodal); q [T, heads, head_dim]; k [T, kv_heads, head_dim]."""
        positions, cos_table, sin_table = self.tables_for(positions)
        if self.use_triton:
            from rollout_kernels.rotary import apply_rotary  # Triton: optional on the CPU

            return apply_rotary(q, k, positions, cos_table, sin_table)  # in place on the qkv views
        cos = cos_table[positions].to(q.dtype).unsqueeze(1)  # [T, 1, rotary_dim]
        sin = sin_table[positions].to(q.dtype).unsqueeze(1)
        r = self.rotary_dim

        def rotate(x: torch.Tensor) -> torch.Tensor:
            if r == x.shape[-1]:
                return x * cos + self._rotate_half(x) * sin
            x_rot, x_pass = x[..., :r], x[..., r:]
            return torch.cat((x_rot * cos + self._rotate_half(x_rot) * sin, x_pass), dim=-1)

        return rotate(q), rotate(k)


class SiluAndMul(nn.Module):
    """x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:]."""

    use_triton = False
    fp8_consumer: Linear | None = None  # feed_fp8_rows: the FP8 down projection reading the output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from rollout_kernels.silu_mul import silu_and_mul, silu_and_mul_fp8  # Triton: optional on the CPU

            gate = x[..., : x.shape[-1] // 2]  # [T, I]: the shape of the output
            if _quantizes_for(self.fp8_consumer, gate):
                return _fp8_rows(self.fp8_consumer, gate, x.dtype,
                                 lambda outer_major: silu_and_mul_fp8(x, scale_outer_major=outer_major))
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


def enable_triton_kernels(model: nn.Module, on: bool = True) -> None:
    """Route every module with a Triton path through it (CUDA, or the interpreter on the CPU):
    RMSNorm, RoPE, SiLU-and-mul here; the MoE router and experts (models/moe.py). on=False: back to
    the torch path (the trainer's autograd forward, rollout_cli/training.py)."""
    for module in model.modules():
        if hasattr(module, "use_triton"):
            module.use_triton = on


def enable_batch_invariant_kernels(model: nn.Module, on: bool = True) -> None:
    """The on-policy mode on the Triton backend: every module with a `batch_invariant` switch (the
    linear layers, the MoE router and experts, the model's LM head) computes each row with the
    same bits whatever batch it runs in (on=False: back to cuBLAS and the tuned MoE configs).
    Call after enable_triton_kernels."""
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = on
