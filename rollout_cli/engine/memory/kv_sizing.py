"""How many token slots the KV pool gets, and the profile step that measures activations for it."""

from __future__ import annotations

import torch

from rollout_cli.engine.execution.attention import KVCache
from rollout_cli.engine.execution.linear_state import LinearStatePool
from rollout_cli.engine.execution.model_runner import ModelRunner
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.request import Request
from rollout_cli.engine.scheduling.schedule_output import BatchEntry, ScheduleOutput
from rollout_cli.errors import RolloutError
from rollout_cli.models.llama import head_dim_of

CPU_KV_BUDGET_BYTES = 4 << 30  # the CPU has no "free memory after weights": cap the pool at 4 GiB


def kv_heads_here(model, hf_config, tp) -> int:
    """KV heads this process keeps in its pool: all of them, or this tensor-parallel rank's."""
    if tp is None:
        return hf_config.num_key_value_heads
    # the first layer with attention (hybrid models start with linear-attention layers)
    return next(layer.self_attn.num_kv_heads for layer in model.model.layers if layer.self_attn is not None)


def run_largest_step(engine) -> None:
    """One prefill chunk of max_batch_tokens through the engine's model over a throwaway KV pool (and
    state pool), for profile_activation_bytes."""
    hf = engine.hf_config
    tokens = min(engine.config.max_batch_tokens, engine.max_model_len)
    num_layers = getattr(engine.model, "num_kv_layers", hf.num_hidden_layers)
    kv = KVCache(num_layers, tokens + 1, kv_heads_here(engine.model, hf, engine.tp), head_dim_of(hf), engine.kv_dtype,
                 engine.device)
    state_shape = getattr(engine.model, "linear_state_shape", None)
    states = LinearStatePool(state_shape, 2, engine.device) if state_shape is not None else None
    runner = ModelRunner(engine.model, kv, 1, tokens, engine.device, engine.attention_backend, states)
    request = Request(-1, 0, 0, [0] * tokens, SamplingParams(max_new_tokens=1), state_slot=1)
    entry = BatchEntry(request, 0, 0, request.prompt_token_ids, 0, list(range(1, tokens + 1)), sample=True)
    runner.run(ScheduleOutput([entry]))


def profile_activation_bytes(run_dummy_step, device: torch.device) -> int:
    """Peak bytes a forward of the largest step allocates beyond what is live now (CUDA only)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_dummy_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def kv_pool_tokens(
    *,
    device: torch.device,
    bytes_per_token: int,
    max_running: int,
    max_model_len: int,
    kv_memory_fraction: float,
    kv_cache_tokens: int | None,
    activation_bytes: int = 0,
) -> int:
    """Slots in the pool, slot 0 (padding) included; at least one max-length request fits."""
    most_useful = max_running * max_model_len + 1
    if kv_cache_tokens is not None:
        tokens = kv_cache_tokens
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = (free - activation_bytes) * kv_memory_fraction
        tokens = min(int(budget // bytes_per_token), most_useful)
    else:  # at least one full-length request, even past the budget (the pages are only touched when used)
        tokens = min(max(CPU_KV_BUDGET_BYTES // bytes_per_token, max_model_len + 1), most_useful)
    if tokens - 1 < max_model_len:
        raise RolloutError(
            f"the KV cache holds {max(tokens - 1, 0)} tokens, fewer than one request of --max-model-len "
            f"{max_model_len}; lower --max-model-len or raise --kv-memory-fraction / --kv-cache-tokens"
        )
    return tokens
