"""Timing of the fused sampler on CUDA (`scripts/bench_decode_kernels.py` prints its table)."""

from __future__ import annotations

import torch

from rollout_kernels.sampling import sample
from rollout_kernels.sampling_layout import BLOCK_V, CHUNK, chunk_layout, sample_workspace


def benchmark_sample(batch: int = 256, vocab: int = 151936, dtype=torch.bfloat16, setting: str = "plain",
                     hbm_bytes_per_s: float | None = None, **knobs) -> dict:
    """Time `sample` on CUDA (triton.testing.do_bench, median) for one step of keyed draws.

    setting: "plain" (temperature 1, no filtering), "filtered" (top_k 20, top_p 0.95, min_p 0.01)
    or "greedy" (temperature 0). Logits are standard normal times 4. GB/s counts the logits
    read once (the floor: the filtered path reads them several times); `hbm_fraction` divides
    by `hbm_bytes_per_s` when given. `knobs` go to `sample`.
    """
    assert torch.cuda.is_available(), "benchmark_sample needs a CUDA device"
    import triton.testing
    settings = {"plain": (1.0, 0, 1.0, 0.0), "filtered": (1.0, 20, 0.95, 0.01), "greedy": (0.0, 0, 1.0, 0.0)}
    assert setting in settings, f"setting must be one of {sorted(settings)}"
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn((batch, vocab), device=device, generator=gen) * 4.0).to(dtype)
    t, k, p, mp = settings[setting]
    temperature = torch.full((batch,), t, dtype=torch.float32, device=device)
    top_k = torch.full((batch,), k, dtype=torch.int64, device=device)
    top_p = torch.full((batch,), p, dtype=torch.float32, device=device)
    min_p = torch.full((batch,), mp, dtype=torch.float32, device=device)
    raw = torch.zeros(batch, dtype=torch.bool, device=device)
    keys = tuple(torch.randint(0, 2**62, (batch,), device=device, generator=gen) for _ in range(4))
    out = (torch.empty(batch, dtype=torch.int64, device=device), torch.empty(batch, device=device))
    ws = sample_workspace(batch, vocab, device, knobs.get("block_v", BLOCK_V), knobs.get("chunk", CHUNK),
                          knobs.get("cap", 512))

    def step():
        sample(logits, temperature, top_k, top_p, min_p, raw, keys=keys, out=out, workspace=ws, **knobs)

    step()
    seconds = triton.testing.do_bench(step, return_mode="median") * 1e-3
    total = logits.numel() * logits.element_size()
    block, chunk_len, num_chunks = chunk_layout(vocab, knobs.get("block_v", BLOCK_V), knobs.get("chunk", CHUNK))
    result = {
        "batch": batch, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."), "setting": setting,
        "num_chunks": num_chunks, "chunk_len": chunk_len, "time_us": seconds * 1e6, "bytes": total,
        "gb_per_s": total / seconds / 1e9,
    }
    if hbm_bytes_per_s is not None:
        result["hbm_fraction"] = total / seconds / hbm_bytes_per_s
    return result
