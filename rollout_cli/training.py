"""The trainer's side of the on-policy mode: a differentiable forward of rollout's own models whose
response logprobs equal a `--deterministic` rollout's bit for bit (same checkpoint, same dtype).

    from rollout_cli.training import Policy

    policy = Policy("ckpt_0", dtype="float32")
    logprobs = policy.response_logprobs(prompt_ids, response_ids, temperature=1.0)  # [R], differentiable
    loss = -(advantage * logprobs).sum(); loss.backward(); optimizer.step()      # policy.parameters()
    policy.save_pretrained("ckpt_1")          # HF names and layout: rollout reload-weights takes it

The forward is the one the `--deterministic` engine runs on the same device (`kernels`, picked by
the engine's rule, models/build.resolve_attention_backend):
  - torch (the CPU): the engine's on-policy forward (engine/execution/on_policy.py), one token at a time, every
    token attending to its whole context through the same call, logits and logprobs through the same
    functions as the engine's sampler. Only the keys and values live elsewhere: in lists that
    autograd follows instead of the KV pool. The backward is torch's.
  - triton (a GPU): the engine's batch-invariant kernels (matmul, attention, norms, the sampler's
    scoring kernel) give the values, bit for bit the engine's; Triton kernels have no backward, so
    a plain torch forward of the same sequence gives the gradient (straight through: values from
    the kernels, d/dparams from torch). Gradients need not be bitwise anything. A group's responses
    run packed into one forward (up to PACKED_ROWS scored tokens): batch invariance is what lets
    them share it and keep the bits each has alone.
Dense and MoE models on both paths; hybrid (Gated DeltaNet) models on the Triton path (their
torch path would need the engine's per-token recurrent states kept where autograd follows them).
"""

from __future__ import annotations

import itertools
import os
import shutil

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from rollout_cli.engine.execution.attention import KVCache
from rollout_cli.engine.execution.linear_state import HybridBatch, LinearBatch, LinearStatePool
from rollout_cli.engine.execution.on_policy import attend_token, token_forward
from rollout_cli.engine.execution.sampler import kept_ids_mask
from rollout_cli.engine.tokenizer import TOKENIZER_SIDE_FILES, copy_side_files
from rollout_cli.errors import RolloutError
from rollout_cli.models.build import (build_model, is_hybrid, load_model_config, resolve_attention_backend,
                                      resolve_device, resolve_dtype)
from rollout_cli.models.layers import enable_batch_invariant_kernels, enable_triton_kernels
from rollout_cli.models.llama import head_dim_of
from rollout_cli.models.loader import plan_checkpoint
from rollout_cli.models.moe import SparseMoeBlock
from rollout_kernels.gated_delta_rule import chunk_gated_delta_rule_ref
from rollout_kernels.sampling_ref import token_logprobs_ref

# files copied next to a saved checkpoint so that it loads like the one it came from
SIDE_FILES = ("config.json", "generation_config.json", *TOKENIZER_SIDE_FILES)
SAFETENSORS_TO_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


# the most response tokens scored in one packed forward of a group: their logits [R, vocab] (float32 in the
# gradient path, with its softmax) are the memory that grows with R (about 2.4 GB at 4,096 rows of a
# 151,936-token vocabulary); a longer response runs alone, as every response did before packing
PACKED_ROWS = 4096


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


def _per_sequence(lengths: list[int] | None, fn, *tensors) -> torch.Tensor:
    """fn over each sequence's rows of packed `tensors` (dim 0: the sequences' tokens one after another,
    `lengths` of them; None: one sequence), the results concatenated in the same order."""
    if lengths is None or len(lengths) == 1:
        return fn(*tensors)
    return torch.cat([fn(*parts) for parts in zip(*(t.split(lengths) for t in tensors))])


class SequenceLinear:
    """The `linear` of a hybrid model's differentiable forward over whole sequences from position 0
    (plain torch, zero initial states, nothing updated in place): the causal depthwise conv and the
    chunked gated delta rule (the gradient path of the Triton kernels' forward). `lengths`: the token
    counts of sequences packed one after another (None: one sequence)."""

    def __init__(self, lengths: list[int] | None = None):
        self.lengths = lengths

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias, activation: str | None) -> torch.Tensor:
        """x [T, C], weight [C, K] -> conv over each sequence's inputs, zeros before its position 0,
        + activation [T, C]."""
        width = weight.shape[1]

        def one(rows):
            window = F.pad(rows.t().to(weight.dtype)[None], (width - 1, 0))  # [1, C, K - 1 + T]
            out = F.conv1d(window, weight[:, None, :], bias, groups=weight.shape[0])[0]  # [C, T]
            return (F.silu(out) if activation else out).t().to(x.dtype)

        return _per_sequence(self.lengths, one, x)

    def delta_rule(self, layer: int, q, k, v, g, beta) -> torch.Tensor:
        """q/k [T, Hk, dk], v [T, Hv, dv], g/beta [T, Hv] -> o [T, Hv, dv], each sequence from a zero state."""
        zero = torch.zeros(v.shape[1], q.shape[2], v.shape[2], dtype=torch.float32, device=q.device)
        return _per_sequence(self.lengths, lambda *x: chunk_gated_delta_rule_ref(*x, zero)[0], q, k, v, g, beta)


class CausalSequenceAttention:
    """The `attn` of a differentiable forward over whole sequences in plain torch: each sequence's tokens
    attend causally to its own keys (the gradient path of the Triton kernels' forward). `lengths`: the
    token counts of sequences packed one after another (None: one sequence)."""

    def __init__(self, scale: float, lengths: list[int] | None = None):
        self.scale = scale
        self.lengths = lengths

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads, d]."""
        def one(q, k, v):
            attended = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                scale=self.scale, enable_gqa=True)  # [1, heads, T, d]
            return attended[0].transpose(0, 1)

        return _per_sequence(self.lengths, one, q, k, v)


def _switch_kernels(model, on: bool) -> None:
    """The Triton and batch-invariant paths of every module on (the exact forward) or off (torch: autograd)."""
    enable_triton_kernels(model, on)
    enable_batch_invariant_kernels(model, on)


def sampling_mask_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                           sampling_mask: list) -> torch.Tensor:
    """A trainer's logprobs of sampled tokens over the sets they were drawn from (`rollout run
    --sampling-mask`): log_softmax(logits / T) renormalised over each position's kept ids, at its target,
    as the rollout reported it (processed logprobs). Replaying the recorded set instead of re-running
    top-k / top-p / min-p on the trainer's logits keeps a token that sat at the cut on the same side.
    logits [R, V] (any dtype, computed in float32), targets [R] int64, sampling_mask: R lists of token
    ids (the rows of response_sampling_mask) -> [R] float32, differentiable. A position with an empty
    list (no mask recorded) is refused: there is no set to replay."""
    if len(sampling_mask) != logits.shape[0] or targets.shape != (logits.shape[0],):
        raise RolloutError(f"sampling_mask_logprobs: {logits.shape[0]} logits rows need as many targets and masks, "
                           f"got {tuple(targets.shape)} and {len(sampling_mask)}")
    if temperature <= 0:
        raise RolloutError("sampling_mask_logprobs: a sampling mask comes from temperature > 0")
    if any(not ids for ids in sampling_mask):
        raise RolloutError("sampling_mask_logprobs: a position has no recorded mask (a token carried over from a run "
                           "without --sampling-mask); score it without the mask")
    keep = kept_ids_mask(sampling_mask, logits.shape, logits.device)
    scaled = (logits.float() / temperature).masked_fill(~keep, float("-inf"))
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


class Policy:
    """Rollout's model of a checkpoint with trainable parameters."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32", kernels: str = "auto"):
        """kernels: auto (the deterministic engine's choice on this device), torch, or triton."""
        self.model_dir = model_dir
        hf_config = load_model_config(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kernels = resolve_attention_backend(kernels, self.device, deterministic=True)
        self.hybrid = is_hybrid(hf_config)
        if self.hybrid and self.kernels != "triton":
            raise RolloutError("rollout_cli.training runs hybrid linear-attention models on the Triton kernels only "
                               "(a GPU, or kernels='triton' under TRITON_INTERPRET=1); the torch path covers dense "
                               "and MoE models")
        self.model = build_model(model_dir, hf_config, self.device, self.dtype,
                                 max_positions=getattr(hf_config, "max_position_embeddings", None) or 4096)
        # the private KV pool of the Triton forward: [layers, slots, kv_heads, head_dim] (hybrid models:
        # their full-attention layers only)
        self.kv_shape = (getattr(self.model, "num_kv_layers", hf_config.num_hidden_layers),
                         hf_config.num_key_value_heads, head_dim_of(hf_config))
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
        settings = dict(temperature=temperature, raw=logprobs_mode == "raw", top_k=top_k, top_p=top_p, min_p=min_p)
        if self.kernels == "triton":
            return self._kernel_group_logprobs(prompt, [list(r) for r in responses], settings)
        prefix = SequenceKV(self.scale, self.dtype)
        for position, token in enumerate(prompt[:-1]):
            token_forward(self.model, token, position, prefix, self.device, logits=False)
        row_settings = self._settings(1, settings)  # temperature, raw, top_k, top_p, min_p: [1] each
        results = []
        for response in responses:
            attn = prefix.fork()
            tokens = prompt + list(response)
            out = []
            for position in range(len(prompt) - 1, len(tokens) - 1):
                logits = token_forward(self.model, tokens[position], position, attn, self.device)  # [1, vocab]
                target = torch.tensor([tokens[position + 1]], device=self.device)
                out.append(token_logprobs_ref(logits, target, *row_settings))
            results.append(torch.cat(out) if out else torch.zeros(0, device=self.device))
        return results

    def _settings(self, rows: int, settings: dict) -> tuple[torch.Tensor, ...]:
        """The sampler's per-row settings for `rows` rows: temperature, raw flag, top_k, top_p, min_p."""
        def full(value, dtype):
            return torch.full((rows,), value, dtype=dtype, device=self.device)

        return (full(settings["temperature"], torch.float32), full(settings["raw"], torch.bool),
                full(settings["top_k"], torch.int64), full(settings["top_p"], torch.float32),
                full(settings["min_p"], torch.float32))

    def _kernel_group_logprobs(self, prompt: list[int], responses: list[list[int]], settings: dict) -> list[torch.Tensor]:
        """Each response's logprobs [len(response)], from packed forwards of the group's sequences (prompt +
        response; the last token is only a target), at most PACKED_ROWS scored rows per pack (the logits'
        memory): values from the engine's batch-invariant kernels (a row's bits do not depend on what is
        packed beside it, so the same as one sequence at a time), gradient from a torch forward of the
        same pack (straight through)."""
        packs, rows = [[]], 0  # response indices, shortest first; `rows`: the last pack's scored tokens
        for i in sorted(range(len(responses)), key=lambda i: len(responses[i])):
            if packs[-1] and rows + len(responses[i]) > PACKED_ROWS:
                packs.append([])
                rows = 0
            packs[-1].append(i)
            rows += len(responses[i])
        results: list[torch.Tensor | None] = [None] * len(responses)
        for pack in packs:
            for i, values in zip(pack, self._packed_logprobs(prompt, [responses[i] for i in pack], settings)):
                results[i] = values
        return results

    def _packed_logprobs(self, prompt: list[int], responses: list[list[int]], settings: dict) -> list[torch.Tensor]:
        sequences = [prompt + response for response in responses]
        lengths = [len(s) - 1 for s in sequences]  # input tokens of each: its last token is only a target
        offsets = [0, *itertools.accumulate(lengths)][:-1]  # where each sequence starts in the pack
        device = self.device
        ids = torch.tensor([t for s in sequences for t in s[:-1]], device=device)  # [T] packed
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        # the packed rows that predict the responses [R], and their targets [R]
        rows = torch.cat([start + torch.arange(len(prompt) - 1, n, device=device) for start, n in zip(offsets, lengths)])
        targets = torch.tensor([t for s in sequences for t in s[len(prompt):]], device=device)
        row_settings = self._settings(len(targets), settings)  # temperature, raw, top_k, top_p, min_p
        with torch.no_grad():
            exact = self._invariant_forward(ids, positions, rows, lengths, offsets)  # [R, V] logits, the engine's bits
            from rollout_kernels.sampling_score import score_tokens  # Triton: optional on the CPU

            temperature, raw, top_k, top_p, min_p = row_settings
            values = score_tokens(exact, targets, temperature, top_k, top_p, min_p, raw)
        approx = self.torch_logprobs(ids, positions, rows, targets, row_settings, lengths)
        # forward: the kernels' values (approx - approx.detach() is 0); backward: torch's gradient
        values = values + torch.where(approx.isfinite(), approx - approx.detach(), 0.0)
        return list(values.split([len(response) for response in responses]))

    def torch_logprobs(self, ids, positions, rows, targets, row_settings, lengths: list[int] | None = None) -> torch.Tensor:
        """The gradient path: a plain torch forward of whole sequences (causal SDPA; hybrid models' conv and
        chunked delta rule from zero states) -> the targets' logprobs [R], differentiable. ids, positions
        [n] (sequences of `lengths` tokens packed one after another; None: one); rows [R] (the positions
        that predict `targets` [R]); row_settings as _settings."""
        attn = CausalSequenceAttention(self.scale, lengths)
        if self.hybrid:
            attn = HybridBatch(attn, SequenceLinear(lengths))
        hidden = self.model(ids, positions, attn)  # [n, hidden]
        logits = self.model.compute_logits(hidden[rows])  # [R, V] float32
        return token_logprobs_ref(logits, targets, *row_settings)

    def _invariant_forward(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                           lengths: list[int], offsets: list[int]) -> torch.Tensor:
        """One prefill of the packed sequences (`lengths` tokens each, starting at `offsets`) on the engine's
        batch-invariant kernels over a private KV pool -> logits [len(rows), V] in the model dtype, as the
        engine hands them to its sampler."""
        from rollout_cli.engine.execution.triton_attention import InvariantAttentionBatch  # Triton: optional on the CPU

        total, device = ids.shape[0], self.device
        num_layers, num_kv_heads, head_dim = self.kv_shape
        kv = KVCache(num_layers, total, num_kv_heads, head_dim, self.dtype, device)
        # sequence i's position p sits in slot offsets[i] + p: one table row per sequence [S, longest]
        req_to_token = torch.zeros(len(lengths), max(lengths), dtype=torch.int32, device=device)
        for i, (start, n) in enumerate(zip(offsets, lengths)):
            req_to_token[i, :n] = torch.arange(start, start + n, dtype=torch.int32, device=device)
        spans = [(i, start, 0, n) for i, (start, n) in enumerate(zip(offsets, lengths))]
        attn = InvariantAttentionBatch(kv, req_to_token, torch.arange(total, device=device), self.scale, spans=spans)
        if self.hybrid:  # a private state pool: slot 0 is the pool's padding slot, sequence i uses slot i + 1
            pool = LinearStatePool(self.model.linear_state_shape, len(lengths) + 1, device)
            no_decodes = torch.zeros(0, dtype=torch.long, device=device)
            slots = torch.arange(1, len(lengths) + 1, dtype=torch.long, device=device)
            attn = HybridBatch(attn, LinearBatch(pool, no_decodes, slots, [*offsets, total], triton_kernels=True,
                                                 invariant=True))
        _switch_kernels(self.model, True)
        try:
            hidden = self.model(ids, positions, attn)
            return self.model.compute_logits(hidden[rows], upcast=False)
        finally:
            _switch_kernels(self.model, False)

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
        copy_side_files(self.model_dir, temp, SIDE_FILES)
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
