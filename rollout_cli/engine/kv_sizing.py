"""How many token slots the KV pool gets."""

from __future__ import annotations

import torch

from rollout_cli.errors import RolloutError

CPU_KV_BUDGET_BYTES = 4 << 30  # the CPU has no "free memory after weights": cap the pool at 4 GiB


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
