"""Llama-family dense decoders: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.

They differ only in biases (Qwen2: q/k/v; Llama: `attention_bias`, `mlp_bias`)
and Qwen3's per-head RMSNorm on q and k before RoPE. Attention itself lives
in the engine: each layer hands q, k, v to `attn.forward(layer_idx, ...)`,
which stores k/v in the KV pool and attends over the request's context. A
Triton attention batch takes them before norm and RoPE instead
(`forward_prologue_fused`): one kernel norms, rotates and stores them.
"""

from __future__ import annotations

import torch
from torch import nn

from rollout_cli.models.layers import (
    FusedLinear,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    VocabEmbedding,
    feed_fp8_rows,
    linear,
)
from rollout_cli.models.tensor_parallel import (
    HeadSplit,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_gate_up,
    column_parallel_qkv,
    mark_vocab_rows,
    tp_rank,
    tp_size,
    vocab_parallel_logits,
)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool, max_positions: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        total = HeadSplit.of(config.num_attention_heads, config.num_key_value_heads, 1, 0)
        if tp_size() == 1:
            self.num_heads, self.num_kv_heads = total.num_heads, total.num_kv_heads
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            self.qkv_proj = FusedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=qkv_bias)
            self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        else:  # this rank's heads (models/tensor_parallel.py); o_proj all-reduces
            split = HeadSplit.of(total.num_heads, total.num_kv_heads, tp_size(), tp_rank())
            self.num_heads, self.num_kv_heads = split.num_heads, split.num_kv_heads
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            self.qkv_proj = column_parallel_qkv(config.hidden_size, split, total, self.head_dim, qkv_bias)
            self.o_proj = RowParallelLinear(total.num_heads * self.head_dim, config.hidden_size, tp_size(),
                                            tp_rank(), bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = RotaryEmbedding(config, self.head_dim, max_positions)
        self.splits = [q_size, kv_size, kv_size]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn) -> torch.Tensor:
        # hidden [T, hidden_size] -> q [T, heads, head_dim], k/v [T, kv_heads, head_dim]
        q, k, v = self.qkv_proj(hidden).split(self.splits, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self._fuses_prologue(attn, q):  # q/k norm, RoPE and the KV write in one launch
            index, cos, sin = self.rotary.tables_for(positions)  # multimodal positions: rows of their own
            qn, kn = self.q_norm, self.k_norm
            out = attn.forward_prologue_fused(
                self.layer_idx, q, k, v, index, cos, sin,
                qn.weight if qn is not None else None, kn.weight if kn is not None else None,
                qn.eps if qn is not None else 0.0)
            return self.o_proj(out.reshape(out.shape[0], -1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = attn.forward(self.layer_idx, q, k, v)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(out.shape[0], -1))


    def _fuses_prologue(self, attn, q: torch.Tensor) -> bool:
        """Whether the attention batch can take q/k before norm and RoPE (the Triton backend), and
        this layer's norm and RoPE run their Triton kernels, whose rounding the fused kernel keeps."""
        if not (getattr(attn, "fuses_qk_norm_rope_store", False) and self.rotary.use_triton):
            return False
        qn, kn = self.q_norm, self.k_norm
        if qn is None or kn is None:
            return qn is None and kn is None
        return (qn.use_triton and kn.use_triton and qn.eps == kn.eps
                and qn.weight.dtype == kn.weight.dtype == q.dtype)


class DecoderMLP(nn.Module):
    """SwiGLU MLP. Under --tp, reduce=False leaves the all-reduce to the caller (the MoE block sums its
    shared expert's partial output with the routed experts' and reduces once)."""

    def __init__(self, config, bias: bool, intermediate_size: int | None = None, reduce: bool = True):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        if tp_size() == 1:
            self.gate_up_proj = FusedLinear(config.hidden_size, {0: inter, 1: inter}, bias=bias)
            self.down_proj = Linear(inter, config.hidden_size, bias=bias)
        else:  # this rank's slice of the intermediate size; down_proj all-reduces
            self.gate_up_proj = column_parallel_gate_up(config.hidden_size, inter, tp_size(), tp_rank(), bias)
            self.down_proj = RowParallelLinear(inter, config.hidden_size, tp_size(), tp_rank(), bias=bias,
                                               reduce=reduce)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def feed_fp8_rows(self) -> None:
        """Under --quantization fp8 (models/fp8.quantize_model): SiLU-and-mul quantizes for down_proj."""
        feed_fp8_rows(self.act, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, flags: dict, max_positions: int, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = DecoderAttention(
            config, layer_idx, flags["qkv_bias"], flags["o_bias"], flags["qk_norm"], max_positions
        )
        self.mlp = DecoderMLP(config, flags["mlp_bias"]) if mlp is None else mlp  # MoE models pass theirs
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, attn):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def feed_fp8_rows(self) -> None:
        """Under --quantization fp8: the input norm quantizes for qkv_proj, its only reader; the
        post-attention norm for a dense MLP's gate_up_proj (an MoE block's router reads it in bf16)."""
        feed_fp8_rows(self.input_layernorm, self.self_attn.qkv_proj)
        if isinstance(self.mlp, DecoderMLP):
            feed_fp8_rows(self.post_attention_layernorm, self.mlp.gate_up_proj)


def vocab_embedding(config) -> nn.Module:
    """The token embedding: whole, or under --tp this rank's rows of the vocabulary."""
    if tp_size() == 1:
        return VocabEmbedding(config.vocab_size, config.hidden_size)
    return VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_size(), tp_rank())


def untied_lm_head(config, embed: nn.Module) -> Linear:
    """A head of its own: whole, or under --tp the same rows of the vocabulary as the embedding."""
    if tp_size() == 1:
        return Linear(config.hidden_size, config.vocab_size)
    head = Linear(config.hidden_size, embed.weight.shape[0])
    head.weight.data.zero_()
    mark_vocab_rows(head.weight, embed.start, embed.size, config.vocab_size)
    return head


class DecoderModel(nn.Module):
    def __init__(self, config, flags: dict, max_positions: int, make_mlp=None):
        """make_mlp(layer_idx) -> the layer's MLP module, or None for the dense DecoderMLP."""
        super().__init__()
        self.embed_tokens = vocab_embedding(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, flags, max_positions, make_mlp(i) if make_mlp else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, attn):
        hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden_size]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    batch_invariant = False  # the LM head's matmul (layers.enable_batch_invariant_kernels)
    """Also serves Qwen2 (qkv bias) through `flags`; Qwen3 subclasses it."""

    # checkpoint tensor name part -> (our fused parameter part, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def flags_for(config) -> dict:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return dict(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=False,
        )

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        flags = self.flags_for(config)
        self.model = DecoderModel(config, flags, max_positions, lambda i: self.make_mlp(config, i, flags))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else untied_lm_head(config, self.model.embed_tokens)

    def make_mlp(self, config, layer_idx: int, flags: dict) -> nn.Module | None:
        """The MLP of layer `layer_idx`; None keeps the dense DecoderMLP (MoE models override)."""
        return None

    @staticmethod
    def mlp_widths(config) -> dict[str, int]:
        """The MLP widths --tp N splits (each must divide by N), by name for the error message."""
        return {"intermediate size": config.intermediate_size}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden_size]."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden [B, hidden_size] -> logits [B, vocab]: float32, or in the model dtype with
        upcast=False (the Triton sampler reads those and upcasts in registers)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if tp_size() == 1:
            logits = linear(hidden, weight, batch_invariant=self.batch_invariant)
        else:  # every rank computes its vocabulary rows and gathers the rest
            logits = vocab_parallel_logits(hidden, weight, self.config.vocab_size)
        return logits.float() if upcast else logits


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags_for(config) -> dict:
        return dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
