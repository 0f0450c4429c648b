"""Train small models that predict something, so speculative decoding can be measured (issue 22).

Random weights accept no draft. This trains, for a few minutes on the GPU, on the Python standard
library's source code (it ships with every Python install):
  OUT/hybrid   a small Qwen3-Next-shaped model (Gated DeltaNet + gated attention layers, MoE MLPs) with
               its multi-token-prediction head (mtp.* tensors, the hub's naming), trained jointly: the
               head learns token q + 2 from the trunk's final hidden state at q and the token at q + 1
  OUT/dense    a small Qwen3 model (for --speculative siblings)
  OUT/prompts.parquet  code prefixes from held-out files (`prompt`: a string), for `rollout bench --data`
Both checkpoints share a byte-level BPE tokenizer trained on the same files. Then, for instance:

    python scripts/train_speculation_models.py --out /tmp/spec --minutes 4
    rollout bench --model /tmp/spec/hybrid --data /tmp/spec/prompts.parquet --output-len 256 \
        --temperature 0 --speculative mtp --num-draft-tokens 2

`--tiny` trains a few steps of a tiny pair on the CPU (the test of this script).
"""

from __future__ import annotations

import argparse
import math
import random
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

EOS = "<|endoftext|>"
SIZES = {  # hidden, layers, heads, kv heads, head dim, vocab, experts, expert width, dense MLP width, sequence
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64, vocab=8192, experts=8, expert_width=384,
                  mlp_width=1536, seq=512, batch=32),
    "tiny": dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, vocab=400, experts=4, expert_width=32,
                 mlp_width=128, seq=64, batch=4),
}


def source_files(limit: int | None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the standard library's .py files, every 10th held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    files = files[:limit] if limit else files
    return [f for i, f in enumerate(files) if i % 10], [f for i, f in enumerate(files) if not i % 10]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab: int, out: Path):
    """A byte-level BPE of `vocab` ids over the files, saved as a transformers tokenizer in out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((read(f) for f in files), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)
    tokenizer.save_pretrained(out)
    return tokenizer


class MTPHead(nn.Module):
    """The hub's MTP head layout on transformers' own Qwen3-Next modules: fc over [norm_e(embed(t_{q+1})),
    norm_h(h_q)], one full-attention decoder layer, a final norm; the trunk's LM head predicts t_{q+2}."""

    def __init__(self, config, layer_idx: int):
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, layer_idx)])  # a full-attention layer's kind
        self.norm = Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, position_ids) -> torch.Tensor:
        """embeds [B, T, H] of the tokens at q + 1, hidden [B, T, H] the trunk's at q -> [B, T, H] normed."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1))
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None, position_ids=position_ids)
        return self.norm(x[0] if isinstance(x, tuple) else x)


def build_models(size: dict, eos_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

    common = dict(vocab_size=size["vocab"], hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                  num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"],
                  max_position_embeddings=4096, eos_token_id=eos_id, bos_token_id=eos_id, tie_word_embeddings=False)
    hybrid = Qwen3NextConfig(**common, intermediate_size=size["mlp_width"], num_experts=size["experts"],
                             num_experts_per_tok=2, moe_intermediate_size=size["expert_width"],
                             shared_expert_intermediate_size=size["expert_width"], linear_num_key_heads=size["heads"] // 2,
                             linear_num_value_heads=size["heads"], linear_key_head_dim=size["head_dim"],
                             linear_value_head_dim=size["head_dim"], full_attention_interval=4)
    dense = Qwen3Config(**common, intermediate_size=size["mlp_width"])
    trunk = Qwen3NextForCausalLM(hybrid)
    head = MTPHead(hybrid, hybrid.layer_types.index("full_attention"))
    return trunk, head, Qwen3ForCausalLM(dense)


def batches(ids: torch.Tensor, batch: int, seq: int, rng: random.Random):
    """Random windows [batch, seq + 1] of the token stream, forever."""
    while True:
        starts = [rng.randrange(len(ids) - seq - 1) for _ in range(batch)]
        yield torch.stack([ids[s:s + seq + 1] for s in starts])


def train(model, head, data, seconds: float, max_steps: int | None, device, label: str) -> None:
    """AdamW with warm-up and cosine decay until `seconds` (or max_steps) pass; bf16 autocast on the GPU.
    With `head`: loss = main + 0.3 * the head's loss on the token after next."""
    params = list(model.parameters()) + (list(head.parameters()) if head is not None else [])
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    start, step, budget = time.monotonic(), 0, seconds
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    while (max_steps is None or step < max_steps) and time.monotonic() - start < budget:
        progress = min(1.0, (time.monotonic() - start) / budget)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        window = next(data).to(device)
        inputs, targets = window[:, :-1], window[:, 1:]
        with autocast:
            out = model.model(input_ids=inputs)
            hidden = out.last_hidden_state  # [B, T, H] after the final norm
            loss = F.cross_entropy(model.lm_head(hidden).flatten(0, 1).float(), targets.flatten())
            mtp_loss = torch.zeros(())
            if head is not None:  # position q: (h_q, token q + 1) -> token q + 2
                positions = torch.arange(inputs.shape[1] - 1, device=device)[None].expand(inputs.shape[0], -1)
                rotary = model.model.rotary_emb(hidden, positions)
                x = head(model.model.embed_tokens(inputs[:, 1:]), hidden[:, :-1], rotary, positions)
                mtp_loss = F.cross_entropy(model.lm_head(x).flatten(0, 1).float(), targets[:, 1:].flatten())
                loss = loss + 0.3 * mtp_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        if step % 200 == 0 or step == 1:
            print(f"{label} step {step} loss {float(loss.detach()):.3f} mtp {float(mtp_loss.detach()):.3f} "
                  f"{time.monotonic() - start:.0f}s", flush=True)


def save(model, head, tokenizer_dir: Path, out: Path) -> None:
    """save_pretrained (bf16) plus, with a head, mtp.safetensors under the hub's names (mtp.fc, mtp.layers.0...)."""
    import shutil

    from safetensors.torch import save_file

    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    if head is not None:
        tensors = {f"mtp.{name}": t.detach().to(torch.bfloat16).contiguous().cpu() for name, t in head.state_dict().items()}
        save_file(tensors, str(out / "mtp.safetensors"))
    for name in tokenizer_dir.iterdir():
        if name.is_file():
            shutil.copy(name, out / name.name)


def write_prompts(files: list[Path], tokenizer, count: int, length: int, out: Path, rng: random.Random) -> None:
    """`count` code prefixes of `length` tokens from the held-out files, as strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    streams = [ids for ids in (tokenizer.encode(read(f)) for f in files) if len(ids) > length]
    prompts = []
    for _ in range(count):
        ids = rng.choice(streams)
        start = rng.randrange(len(ids) - length)
        prompts.append(tokenizer.decode(ids[start:start + length]))
    pq.write_table(pa.table({"prompt": prompts}), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, default=4.0, help="training time of each model")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tiny", action="store_true", help="a few steps of a tiny pair (CPU test)")
    parser.add_argument("--layers", type=int, help="trunk layers instead of the size's (the MTP head, one layer, "
                        "costs about 1 / layers of a step: 1 / 48 in Qwen3-Next-80B, 1 / 8 in the small pair)")
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    size = dict(SIZES["tiny" if args.tiny else "small"])
    if args.layers:
        size["layers"] = args.layers
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    torch.manual_seed(0)
    train_files, held_out = source_files(40 if args.tiny else None)
    tokenizer = train_tokenizer(train_files, size["vocab"], out / "tokenizer")
    eos = tokenizer.convert_tokens_to_ids(EOS)
    stream = []
    for f in train_files:
        stream += tokenizer.encode(read(f)) + [eos]
    ids = torch.tensor(stream)
    print(f"{len(train_files)} training files, {len(ids):,} tokens; {len(held_out)} held out", flush=True)
    trunk, head, dense = build_models(size, eos)
    steps = 3 if args.tiny else None
    for label, model, mtp in (("hybrid", trunk, head), ("dense", dense, None)):
        model.to(device).train()
        if mtp is not None:
            mtp.to(device).train()
        train(model, mtp, batches(ids, size["batch"], size["seq"], rng), args.minutes * 60, steps, device, label)
        save(model, mtp, out / "tokenizer", out / label)
    write_prompts(held_out, tokenizer, args.num_prompts, min(args.prompt_len, size["seq"] * 4), out / "prompts.parquet", rng)
    print(f"wrote {out}/hybrid, {out}/dense, {out}/prompts.parquet", flush=True)


if __name__ == "__main__":
    main()
