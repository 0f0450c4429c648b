"""A small, readable GRPO trainer on torch + transformers for the rollout recipe.

Reads the trajectories Parquet of one `rollout run`, scores each sample, normalises rewards
within its prompt group (the n samples of a prompt), recomputes the response logprobs under
the current weights, and takes a few policy-gradient steps with a truncated importance-sampling
(TIS) correction against the rollout logprobs. Saves a safetensors checkpoint directory that
`rollout reload-weights` accepts, written to a temp dir and renamed, so a killed trainer never
leaves a half-written checkpoint behind.

    python recipes/train_grpo.py --trajectories traj_1 --model ckpt_0 --out ckpt_1 --reward digit_fraction

Prints one JSON line: mean_reward, logprob_mismatch (mean |trainer - rollout| logprob on the
same weights, before any update), train_seconds, loss.

Episodes of `rollout run --env` (multi-turn, with tool results between the model's turns) train the
same way: their `response_loss_mask` keeps the environment's tokens out of the loss and the mismatch,
and `--reward env` reads each episode's reward.

With --deterministic the trainer is rollout's own differentiable forward (rollout_cli.training), whose
logprobs equal a `--deterministic` rollout's bit for bit: logprob_mismatch is exactly 0.0 and the
importance weights exactly 1 on the first step, provided it runs on the engine's device and dtype
(`--device` / `--dtype`, both `auto` by default as the engine's are: bfloat16 on a GPU, float32 on the
CPU). Without it, HF transformers' forward (float32, on `--device`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import defaultdict

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM

from rollout_cli.engine.tokenizer import TOKENIZER_SIDE_FILES, copy_side_files
from rollout_cli.models.build import resolve_device  # the engine's own rule for --device auto

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rewards import reward_function  # noqa: E402

SIDE_FILES = ("generation_config.json", *TOKENIZER_SIDE_FILES)
CHUNK_TOKENS = 4096  # response tokens scored per backward pass (see scoring_chunks)


def prompt_groups(rows: list[dict]) -> list[list[int]]:
    """Row indices of each prompt's group of samples, in the order prompts first appear."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[row["prompt_index"]].append(i)
    return list(groups.values())


def group_advantages(rows: list[dict], rewards: list[float]) -> list[float]:
    """(r - mean) / (std + eps) within each prompt's group of samples."""
    advantages = [0.0] * len(rows)
    for members in prompt_groups(rows):
        values = torch.tensor([rewards[i] for i in members])
        std = values.std(unbiased=False) if len(members) > 1 else torch.tensor(0.0)
        for i, a in zip(members, ((values - values.mean()) / (std + 1e-6)).tolist()):
            advantages[i] = a
    return advantages


def scoring_chunks(rows: list[dict], max_tokens: int = CHUNK_TOKENS) -> list[list[int]]:
    """Row indices in chunks that are scored and back-propagated one at a time: one prompt's samples
    (they share its forward), at most `max_tokens` response tokens together unless one sample alone has
    more. A chunk's graph holds a few [response tokens, vocab] float32 tensors, so a whole batch's at once
    (128 samples x 128 tokens of a 151,936-token vocabulary) ran an 80 GB GPU out of memory."""
    chunks: list[list[int]] = []
    for members in prompt_groups(rows):
        chunks.append([])
        tokens = 0
        for i in members:
            if chunks[-1] and tokens + len(rows[i]["response_token_ids"]) > max_tokens:
                chunks.append([])
                tokens = 0
            chunks[-1].append(i)
            tokens += len(rows[i]["response_token_ids"])
    return chunks


def response_logprobs(model, rows: list[dict], temperature: float, device: torch.device) -> list[torch.Tensor]:
    """log_softmax(logits / T) of each response token given its prompt and the tokens before it.

    One right-padded forward for all rows: [B, L] ids -> per row a [R] tensor of logprobs.
    """
    sequences = [list(r["prompt_token_ids"]) + list(r["response_token_ids"]) for r in rows]
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=device)
    logp = torch.log_softmax(model(ids, attention_mask=mask).logits.float() / temperature, dim=-1)  # [B, L, V]
    out = []
    for b, row in enumerate(rows):
        start, response = len(row["prompt_token_ids"]), torch.tensor(row["response_token_ids"], device=device)
        positions = torch.arange(start - 1, start - 1 + len(response), device=device)  # logits that predicted each token
        out.append(logp[b, positions, response])
    return out


class HFPolicy:
    """HF transformers' model of the checkpoint, with the interface of rollout_cli.training.Policy."""

    def __init__(self, model_dir: str, device: torch.device):
        self.model_dir, self.device = model_dir, device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        self.model.train()

    def parameters(self):
        return self.model.parameters()

    def chunk_logprobs(self, rows: list[dict], temperature: float) -> list[torch.Tensor]:
        """The logprobs of one chunk's responses (scoring_chunks), one padded forward."""
        return response_logprobs(self.model, rows, temperature, self.device)

    def save_pretrained(self, out_dir: str) -> None:
        self.model.eval()
        save_checkpoint(self.model, self.model_dir, out_dir)


class RolloutPolicy:
    """rollout's own forward (rollout_cli.training): the deterministic engine's logprobs, bit for bit."""

    def __init__(self, model_dir: str, device: torch.device, dtype: str):
        from rollout_cli.training import Policy  # the engine's trainer forward: only this trainer needs it

        self.policy = Policy(model_dir, device=str(device), dtype=dtype)

    def parameters(self):
        return self.policy.parameters()

    def chunk_logprobs(self, rows: list[dict], temperature: float) -> list[torch.Tensor]:
        """The logprobs of one chunk's responses (one prompt's: scoring_chunks), packed in one forward."""
        responses = [row["response_token_ids"] for row in rows]
        return self.policy.group_logprobs(rows[0]["prompt_token_ids"], responses, temperature)

    def save_pretrained(self, out_dir: str) -> None:
        self.policy.save_pretrained(out_dir)


def save_checkpoint(model, source_dir: str, out_dir: str) -> None:
    temp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(temp, ignore_errors=True)
    model.save_pretrained(temp, safe_serialization=True)
    copy_side_files(source_dir, temp, SIDE_FILES)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(temp, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", required=True, help="OUT directory of rollout run")
    parser.add_argument("--model", required=True, help="checkpoint the rollouts were generated with")
    parser.add_argument("--out", required=True, help="where to write the updated checkpoint")
    parser.add_argument("--reward", default="digit_fraction")
    parser.add_argument("--temperature", type=float, default=1.0, help="the rollout temperature")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps over the batch")
    parser.add_argument("--tis-cap", type=float, default=2.0, help="truncation of the importance weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true",
                        help="train with rollout's own forward: on-policy bit for bit with a --deterministic engine")
    parser.add_argument("--device", default="auto", help="where the trainer runs (auto: cuda if there is one)")
    parser.add_argument("--dtype", default="auto",
                        help="--deterministic: the engine's dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    start = time.monotonic()
    rows = pq.read_table(os.path.join(args.trajectories, "trajectories")).to_pylist()
    rows = [r for r in rows if r["response_token_ids"]]
    score = reward_function(args.reward)
    rewards = [score(r) for r in rows]
    advantages = group_advantages(rows, rewards)
    device = resolve_device(args.device)
    policy = RolloutPolicy(args.model, device, args.dtype) if args.deterministic else HFPolicy(args.model, device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    rollout_lp = [torch.tensor(r["response_logprobs"], dtype=torch.float32, device=device) for r in rows]
    # 1 at the model's tokens; an episode's environment tokens (mask 0) are context, not actions
    masks = [torch.tensor(r.get("response_loss_mask") or [1] * len(r["response_token_ids"]), dtype=torch.bool,
                          device=device) for r in rows]

    mismatch, loss_value = None, 0.0
    tokens = sum(int(m.sum()) for m in masks)
    chunks = scoring_chunks(rows)
    for step in range(args.steps):
        optimizer.zero_grad()
        diffs, loss_value = [], 0.0
        for chunk in chunks:  # gradients accumulate over chunks: one chunk's graph in memory at a time
            current = policy.chunk_logprobs([rows[i] for i in chunk], args.temperature)
            loss = torch.zeros((), device=device)
            for i, c in zip(chunk, current):
                r, m = rollout_lp[i], masks[i]
                diffs.append((c.detach() - r)[m].abs())
                weight = torch.exp(c.detach() - r).clamp(max=args.tis_cap)  # TIS: rollout -> trainer policy
                loss = loss - (weight * advantages[i] * c)[m].sum() / tokens
            loss.backward()
            loss_value += float(loss.detach())
        if step == 0:  # same weights as the rollout: the engine should be on-policy
            mismatch = float(torch.cat(diffs).mean())
        optimizer.step()
    policy.save_pretrained(args.out)
    print(json.dumps({"mean_reward": sum(rewards) / len(rewards), "logprob_mismatch": mismatch,
                      "train_seconds": round(time.monotonic() - start, 3), "loss": loss_value,
                      "trajectories": len(rows)}))


if __name__ == "__main__":
    main()
