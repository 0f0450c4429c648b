"""Hybrid linear-attention decoders: Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM.

`config.layer_types` (from `full_attention_interval`, default every 4th layer)
says which layers are Gated DeltaNet ("linear_attention", models/gated_deltanet.py)
and which gated full attention ("full_attention"): Qwen3-style attention whose
q_proj also yields a per-head output gate (out * sigmoid(gate)), q/k norms,
partial rotary (`partial_rotary_factor`). Every norm but the DeltaNet output
norm is zero-centred ((1 + w), models/norms.py). MLPs: Qwen3-Next chooses
sparse layers like Qwen3-MoE (`mlp_only_layers`, `decoder_sparse_step`),
Qwen3.5-MoE makes all sparse, Qwen3.5 all dense; sparse blocks carry the
sigmoid-gated shared expert.

Full-attention layers are numbered among themselves for the KV pool
(`num_kv_layers`), linear layers among themselves for the state pool
(`linear_state_shape`). The step's batch object passed as `attn` does both:
`attn.forward(kv_layer, q, k, v)` and `attn.linear` (engine/execution/linear_state.py).
"""

from __future__ import annotations

import torch
from torch import nn

from rollout_cli.errors import RolloutError
from rollout_cli.models.gated_deltanet import GatedDeltaNet, linear_state_shape
from rollout_cli.models.layers import FusedLinear, Linear, RotaryEmbedding
from rollout_cli.models.llama import (DecoderMLP, DecoderModel, LlamaForCausalLM, head_dim_of, untied_lm_head,
                                      vocab_embedding)
from rollout_cli.models.moe import MoeMixin, SparseMoeBlock, moe_layer_ids
from rollout_cli.models.norms import ZeroCentredRMSNorm
from rollout_cli.models.tensor_parallel import HeadSplit, RowParallelLinear, column_parallel_qkv, tp_rank, tp_size
from rollout_cli.models.vision_language import VisionLanguageModel


class GatedAttention(nn.Module):
    def __init__(self, config, kv_layer_idx: int, max_positions: int):
        super().__init__()
        self.layer_idx = kv_layer_idx
        self.head_dim = head_dim_of(config)
        total = HeadSplit.of(config.num_attention_heads, config.num_key_value_heads, 1, 0)
        split = HeadSplit.of(total.num_heads, total.num_kv_heads, tp_size(), tp_rank())  # this rank's heads
        self.num_heads, self.num_kv_heads = split.num_heads, split.num_kv_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        # q_proj rows are per head [query (head_dim), gate (head_dim)]: a rank's heads are one range
        if tp_size() == 1:
            self.qkv_proj = FusedLinear(config.hidden_size, {"q": 2 * q_size, "k": kv_size, "v": kv_size}, bias=bias)
            self.o_proj = Linear(q_size, config.hidden_size, bias=bias)
        else:
            self.qkv_proj = column_parallel_qkv(config.hidden_size, split, total, self.head_dim, bias,
                                                q_rows_per_head=2)
            self.o_proj = RowParallelLinear(total.num_heads * self.head_dim, config.hidden_size, tp_size(), tp_rank(),
                                            bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, self.head_dim, max_positions)
        self.splits = [2 * q_size, kv_size, kv_size]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn) -> torch.Tensor:
        T = hidden.shape[0]
        q_gate, k, v = self.qkv_proj(hidden).split(self.splits, dim=-1)
        q, gate = q_gate.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, heads, head_dim] each
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = attn.forward(self.layer_idx, q.contiguous(), k, v)  # [T, heads, head_dim]
        out = out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    def __init__(self, token_mixer: nn.Module, mlp: nn.Module, config):
        super().__init__()
        if isinstance(token_mixer, GatedDeltaNet):
            self.linear_attn, self.self_attn = token_mixer, None
        else:
            self.linear_attn, self.self_attn = None, token_mixer
        self.mlp = mlp
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, attn):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.linear_attn is not None:
            hidden = self.linear_attn(hidden, attn.linear)
        else:
            hidden = self.self_attn(positions, hidden, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class HybridModel(nn.Module):
    def __init__(self, config, layers: list[HybridDecoderLayer]):
        super().__init__()
        self.embed_tokens = vocab_embedding(config)
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    forward = DecoderModel.forward  # embed, the layers with a carried residual, final norm: the same stack


class Qwen3NextForCausalLM(MoeMixin, nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping  # fused qkv of full attention, gate_up
    checkpoint_ignored_prefixes = ("mtp.",)  # the multi-token-prediction head HF also skips
    grouped_checkpoint = True  # in_proj_qkvz / in_proj_ba rows grouped per key head

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.num_experts, self.top_k = self.experts_of(config)
        self.moe_layers = self.sparse_layers(config)
        layers, num_kv, num_linear = [], 0, 0
        for i, kind in enumerate(config.layer_types):
            if kind == "linear_attention":
                mixer = GatedDeltaNet(config, num_linear, self.grouped_checkpoint)
                num_linear += 1
            elif kind == "full_attention":
                mixer = GatedAttention(config, num_kv, max_positions)
                num_kv += 1
            else:
                raise RolloutError(f"layer {i} has type {kind!r}; supported: linear_attention, full_attention")
            layers.append(HybridDecoderLayer(mixer, self.make_layer_mlp(config, i), config))
        self.model = HybridModel(config, layers)
        self.num_kv_layers = num_kv
        self.linear_state_shape = linear_state_shape(config, num_linear)
        self.attention_head_dim = head_dim_of(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else untied_lm_head(config, self.model.embed_tokens)

    def sparse_layers(self, config) -> list[int]:
        return moe_layer_ids(config, self.num_experts)

    def make_layer_mlp(self, config, layer_idx: int) -> nn.Module:
        if layer_idx not in self.moe_layers:
            return DecoderMLP(config, bias=False)
        shared = DecoderMLP(config, bias=False, intermediate_size=config.shared_expert_intermediate_size,
                            reduce=False)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, self.renormalize(config),
                              self.moe_layers.index(layer_idx), shared_expert=shared)

    @staticmethod
    def renormalize(config) -> bool:
        return bool(config.norm_topk_prob)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden_size]."""
        return self.model(input_ids, positions, attn)

    batch_invariant = False  # the LM head's matmul (layers.enable_batch_invariant_kernels)
    compute_logits = LlamaForCausalLM.compute_logits  # same head: float32, or model dtype with upcast=False


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE text model: DeltaNet projections stored split (in_proj_qkv/z/b/a), every MLP sparse,
    top-k always renormalised."""

    packed_modules_mapping = dict(
        Qwen3NextForCausalLM.packed_modules_mapping,
        in_proj_qkv=("in_proj_qkvz", "qkv"), in_proj_z=("in_proj_qkvz", "z"),
        in_proj_b=("in_proj_ba", "b"), in_proj_a=("in_proj_ba", "a"),
    )
    grouped_checkpoint = False

    def sparse_layers(self, config) -> list[int]:
        return list(range(config.num_hidden_layers))

    @staticmethod
    def renormalize(config) -> bool:
        return True


class Qwen3_5ForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3.5 dense text model: split DeltaNet projections, dense MLPs only."""

    @staticmethod
    def experts_of(config) -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def mlp_widths(config) -> dict[str, int]:
        return {"intermediate size": config.intermediate_size}

    def sparse_layers(self, config) -> list[int]:
        return []


class Qwen3_5ForConditionalGeneration(VisionLanguageModel, Qwen3_5ForCausalLM):
    """Qwen3.5 as the hub ships it: the hybrid language model under model.language_model.*, the vision
    tower (no deepstack) under model.visual.* (models/vision_language.py)."""


class Qwen3_5MoeForConditionalGeneration(VisionLanguageModel, Qwen3_5MoeForCausalLM):
    pass
