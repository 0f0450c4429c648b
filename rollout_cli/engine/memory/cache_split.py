"""How a hybrid model's cache memory splits between the KV pool and the linear-state pool.

The cache budget is what kv_sizing gives the KV pool of other models (CUDA:
free memory after weights and activations times --kv-memory-fraction; CPU: a
fixed cap). The state pool may take up to --linear-state-memory-ratio of it,
but never more slots than it can use: one per running request plus as many
again for prompt snapshots (prefix sharing), plus the padding slot. The KV
pool gets the rest. Either pool too small for one maximum-length request is
a start-up error naming the numbers and the setting to change.
"""

from __future__ import annotations

import torch

from rollout_cli.engine.memory.kv_sizing import CPU_KV_BUDGET_BYTES
from rollout_cli.errors import RolloutError

MIB = 1 << 20


def hybrid_pool_sizes(
    *,
    device: torch.device,
    kv_bytes_per_token: int,
    state_bytes_per_slot: int,
    max_running: int,
    max_model_len: int,
    kv_memory_fraction: float,
    kv_cache_tokens: int | None,
    linear_state_memory_ratio: float,
    activation_bytes: int = 0,
    draft_states: int = 0,
) -> tuple[int, int]:
    """(KV slots, state slots), padding slot 0 included in both. `draft_states`: speculative decoding's
    drafts per request, each a state slot while its step runs (engine/scheduling/speculation.py)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int((free - activation_bytes) * kv_memory_fraction)
    else:
        budget = CPU_KV_BUDGET_BYTES
    state_budget = int(budget * linear_state_memory_ratio)
    wanted = (2 + draft_states) * max_running + 1  # running requests, prompt snapshots, draft forks, padding
    state_slots = min(state_budget // state_bytes_per_slot, wanted)
    if state_slots < 2:
        raise RolloutError(
            f"the linear-state pool gets {state_budget / MIB:.1f} MiB (--linear-state-memory-ratio "
            f"{linear_state_memory_ratio} of {budget / MIB:.1f} MiB cache memory), less than two states of "
            f"{state_bytes_per_slot / MIB:.1f} MiB (one request plus padding); raise --linear-state-memory-ratio "
            "or --kv-memory-fraction"
        )
    if kv_cache_tokens is not None:
        kv_tokens = kv_cache_tokens
    else:
        most_useful = max_running * max_model_len + 1
        kv_tokens = min((budget - state_slots * state_bytes_per_slot) // kv_bytes_per_token, most_useful)
        if device.type != "cuda":  # as kv_sizing: one full-length request even past the CPU cap
            kv_tokens = max(kv_tokens, min(max_model_len + 1, most_useful))
    if kv_tokens - 1 < max_model_len:
        raise RolloutError(
            f"the KV cache holds {max(kv_tokens - 1, 0)} tokens ({state_slots - 1} linear states take "
            f"{state_slots * state_bytes_per_slot / MIB:.1f} MiB of {budget / MIB:.1f} MiB cache memory), fewer than "
            f"one request of --max-model-len {max_model_len}; lower --linear-state-memory-ratio or "
            "--max-model-len, or raise --kv-memory-fraction / --kv-cache-tokens"
        )
    return kv_tokens, state_slots
