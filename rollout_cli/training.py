"""The trainer's side of the on-policy mode: a differentiable forward of rollout's own models whose
response logprobs equal a `--deterministic` rollout's bit for bit (same checkpoint, same dtype).

    from rollout_cli.training import Policy

    policy = Policy("ckpt_0", dtype="float32")
    logprobs = policy.response_logprobs(prompt_ids, response_ids, temperature=1.0)  # [R], differentiable
    loss = -(advantage * logprobs).sum(); loss.backward(); optimizer.step()      # policy.parameters()
    policy.save_pretrained("ckpt_1")          # HF names and layout: rollout reload-weights takes it

The forward is the engine's on-policy forward (engine/on_policy.py): one token at a time, every
token attending to its whole context through the same call, logits and logprobs through the same
functions as the engine's sampler. Only the keys and values live elsewhere: in lists that autograd
follows instead of the KV pool. The backward is torch's; gradients need not be bitwise anything.
Dense and MoE models; hybrid linear-attention models are not covered yet (their recurrent state
lives in the engine's state pool, updated in place).
"""

from __future__ import annotations

import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollout_cli.engine.on_policy import attend_token, token_forward
from rollout_cli.errors import RolloutError
from rollout_cli.models.build import build_model, load_model_config, resolve_device, resolve_dtype
from rollout_cli.models.llama import head_dim_of
from rollout_cli.models.loader import plan_checkpoint
from rollout_cli.models.moe import SparseMoeBlock
from rollout_kernels.sampling_ref import token_logprobs_ref

# files copied next to a saved checkpoint so that it loads like the one it came from
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")
SAFETENSORS_TO_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class SequenceKV:
    """The `attn` of a trainer's one-token forwards over one sequence: each layer keeps the k/v of the
    tokens so far (in the KV pool's dtype, as the engine stores them) and attends as the engine does."""

    def __init__(self, scale: float, dtype: torch.dtype):
        self.scale = scale
        self.dtype = dtype
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, heads, d], k/v [1, kv_heads, d] of the next token -> [1, heads, d]."""
        keys = self.keys.setdefault(layer_idx, [])
        values = self.values.setdefault(layer_idx, [])
        keys.append(k[0].to(self.dtype))
        values.append(v[0].to(self.dtype))
        return attend_token(q, torch.stack(keys), torch.stack(values), self.scale)  # context [C, kv_heads, d]

    def fork(self) -> "SequenceKV":
        """A continuation of this sequence: the keys so far shared, the new ones its own."""
        other = SequenceKV(self.scale, self.dtype)
        other.keys = {layer: list(keys) for layer, keys in self.keys.items()}
        other.values = {layer: list(values) for layer, values in self.values.items()}
        return other


class Policy:
    """Rollout's model of a checkpoint with trainable parameters."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32"):
        self.model_dir = model_dir
        hf_config = load_model_config(model_dir)
        if getattr(hf_config, "layer_types", None) and "linear_attention" in hf_config.layer_types:
            raise RolloutError("rollout_cli.training covers dense and MoE models; hybrid linear-attention models "
                               "are not supported yet")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = build_model(model_dir, hf_config, self.device, self.dtype,
                                 max_positions=getattr(hf_config, "max_position_embeddings", None) or 4096)
        self.model.train()
        for param in self.model.parameters():
            param.requires_grad_(True)
        for block in self.model.modules():  # no routing capture here: the recorder is the engine's
            if isinstance(block, SparseMoeBlock):
                block.routing_recorder = None
        self.scale = head_dim_of(hf_config) ** -0.5

    def parameters(self):
        return self.model.parameters()

    def response_logprobs(self, prompt_token_ids: list[int], response_token_ids: list[int],
                          temperature: float = 1.0, logprobs_mode: str = "processed", **filters) -> torch.Tensor:
        """[len(response)] logprobs of the response tokens given the prompt and the tokens before each,
        reported as the engine reports sampled tokens (temperature, processed or raw, and the top_k /
        top_p / min_p the rollout drew with: processed logprobs are over the kept set), differentiable."""
        return self.group_logprobs(prompt_token_ids, [response_token_ids], temperature, logprobs_mode, **filters)[0]

    def group_logprobs(self, prompt_token_ids: list[int], responses: list[list[int]], temperature: float = 1.0,
                       logprobs_mode: str = "processed", top_k: int = 0, top_p: float = 1.0,
                       min_p: float = 0.0) -> list[torch.Tensor]:
        """response_logprobs of several responses to one prompt (a GRPO group): the prompt is computed
        once and its keys shared by every response's forward (the same values: the same bits)."""
        prompt = list(prompt_token_ids)
        prefix = SequenceKV(self.scale, self.dtype)
        for position, token in enumerate(prompt[:-1]):
            token_forward(self.model, token, position, prefix, self.device, logits=False)
        temperature_row = torch.tensor([temperature], dtype=torch.float32, device=self.device)
        raw_row = torch.tensor([logprobs_mode == "raw"], device=self.device)
        filters = (torch.tensor([top_k], dtype=torch.int64, device=self.device),
                   torch.tensor([top_p], dtype=torch.float32, device=self.device),
                   torch.tensor([min_p], dtype=torch.float32, device=self.device))
        results = []
        for response in responses:
            attn = prefix.fork()
            tokens = prompt + list(response)
            out = []
            for position in range(len(prompt) - 1, len(tokens) - 1):
                logits = token_forward(self.model, tokens[position], position, attn, self.device)  # [1, vocab]
                target = torch.tensor([tokens[position + 1]], device=self.device)
                out.append(token_logprobs_ref(logits, target, temperature_row, raw_row, *filters))
            results.append(torch.cat(out) if out else torch.zeros(0, device=self.device))
        return results

    @torch.no_grad()
    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """The weights under the checkpoint's tensor names, shapes and dtypes (on the CPU).

        Each checkpoint tensor's place inside the fused parameters is found by loading an index tensor
        through the parameter's own weight loader (the way loading placed it), then read back from there."""
        params = dict(self.model.named_parameters())
        tensors = {}
        for target, shape in _targets_with_shapes(self.model, self.model_dir):
            param = params[target.param_name]
            numel = 1
            for size in shape:
                numel *= size
            where = torch.full(param.shape, -1, dtype=torch.int64)
            for name, value in vars(param).items():  # what the loader reads of its parameter (shard layout)
                setattr(where, name, value)
            param.weight_loader(where, torch.arange(numel, dtype=torch.int64).reshape(shape), target.shard_id)
            placed = where >= 0
            flat = torch.empty(numel, dtype=param.dtype)
            flat[where[placed]] = param.detach().cpu()[placed]
            tensors[target.checkpoint_name] = flat.reshape(shape).to(SAFETENSORS_TO_TORCH.get(target.dtype, param.dtype))
        return tensors

    def save_pretrained(self, out_dir: str) -> None:
        """A checkpoint directory like the source one (config, tokenizer files, model.safetensors), written to
        a temp dir and renamed: a killed trainer leaves no half-written checkpoint behind."""
        temp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(temp, ignore_errors=True)
        os.makedirs(temp)
        save_file({k: v.contiguous() for k, v in self.state_dict_hf().items()}, os.path.join(temp, "model.safetensors"))
        for name in SIDE_FILES:
            if os.path.isfile(os.path.join(self.model_dir, name)):
                shutil.copy(os.path.join(self.model_dir, name), os.path.join(temp, name))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(temp, out_dir)


def _targets_with_shapes(model, model_dir: str):
    """(loader target, checkpoint tensor shape) for every tensor of the checkpoint in `model_dir`."""
    shapes = {}
    targets = plan_checkpoint(model, model_dir)
    for path in sorted({t.file for t in targets}):
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return [(t, shapes[t.checkpoint_name]) for t in targets]
