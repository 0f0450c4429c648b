"""Multi-token prediction (MTP) heads of Qwen3-Next and Qwen3.5: a draft model that ships inside the
checkpoint (`mtp.*` weights), used by `--speculative mtp` (engine/execution/mtp_step.py).

For position q the head takes the target model's final hidden state h_q (after its final norm: the
state the LM head reads) and the embedding of the token at q + 1, and predicts the token at q + 2:

    x = fc([norm_e(embed(token_{q+1})), norm_h(h_q)])      fc: [2H] -> [H], embedding first
    x = decoder layer(x, position q)                        one full-attention layer (gated attention,
                                                            q/k norms, partial rotary) + the model's MLP
    logits = lm_head(norm(x))                               the target's own embedding and LM head

Its attention layer keeps its own KV (one more layer of the KV pool, written at the same slot as the
target's KV of position q), so it reads the head's states at every earlier position of the sequence.
The checkpoint names: mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*,
mtp.norm (transformers skips them: its classes have no MTP).
"""

from __future__ import annotations

import torch
from torch import nn

from rollout_cli.errors import RolloutError
from rollout_cli.models.layers import Linear
from rollout_cli.models.loader import checkpoint_headers
from rollout_cli.models.norms import ZeroCentredRMSNorm
from rollout_cli.models.qwen3_next import GatedAttention, HybridDecoderLayer, Qwen3NextForCausalLM

MTP_WEIGHT = "mtp.fc.weight"  # a checkpoint holds an MTP head when it holds this tensor


class MultiTokenPredictor(nn.Module):
    def __init__(self, config, layer: nn.Module):
        super().__init__()
        hidden = config.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList([layer])  # HybridDecoderLayer with a full-attention mixer
        self.norm = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """embeds [M, H] of the tokens at q + 1, target_hidden [M, H] at q, positions [M] (q) -> [M, H]
        normed, for the LM head; the layer's KV stored through `attn` at the step's slots."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(target_hidden)), dim=-1))
        x, residual = self.layers[0](positions, x, None, attn)
        x, _ = self.norm(x, residual)
        return x


def attach_mtp(model: nn.Module, max_positions: int) -> None:
    """Give a hybrid model (models/qwen3_next.py) its MTP head, built in the current default device and
    dtype: a full-attention layer numbered after the model's own KV layers (the pool grows by one), the
    model's MLP kind (sparse when the model has experts; the head's MoE block records no routing: it
    drafts, it does not decide any token), and the checkpoint's mtp.* weights no longer skipped."""
    config = model.config
    attention = GatedAttention(config, model.num_kv_layers, max_positions)
    mlp = model.make_layer_mlp(config, model.moe_layers[0] if model.moe_layers else -1)
    if hasattr(mlp, "moe_index"):
        mlp.moe_index = None  # not one of the routing capture's layers
    model.mtp = MultiTokenPredictor(config, HybridDecoderLayer(attention, mlp, config))
    model.num_kv_layers += 1
    model.checkpoint_ignored_prefixes = ()


def check_mtp_checkpoint(model_dir: str, cls, load_format: str) -> None:
    """One line if `--speculative mtp` cannot run on this checkpoint: a hybrid model (Qwen3-Next, Qwen3.5 and
    Qwen3.5-MoE, text-only or multimodal as the hub ships Qwen3.5) holding mtp.* weights (a dummy-weight run
    needs none)."""
    if not issubclass(cls, Qwen3NextForCausalLM):
        raise RolloutError(f"--speculative mtp runs the MTP head of Qwen3-Next / Qwen3.5 checkpoints; "
                           f"{cls.__name__} has none here: use --speculative siblings")
    if load_format != "dummy" and not any(h.name == MTP_WEIGHT for h in checkpoint_headers(model_dir)):
        raise RolloutError(f"{model_dir} holds no multi-token-prediction head (no {MTP_WEIGHT} in its safetensors); "
                           "use --speculative siblings")
