"""The hardware limits `rollout bench` measures a run against, and the hardware numbers behind them (and
check_context_length: the model's context every sample of a workload must fit).

    decode bytes  = sum over decode steps of (weight bytes + KV bytes per token x distinct context tokens)
                    + decode tokens x 2 x linear-state bytes per sequence (hybrid models: read and written)
    limit tok/s   = decode tokens / (decode bytes / measured HBM bandwidth)
    fraction      = measured output tok/s / limit tok/s

Distinct context tokens (engine/model_runner.distinct_context_tokens) count a prefix that running
samples of one prompt share through the prefix cache once per step: what must move, by the grouping
shared-prefix decode attention reads by (engine/execution/prefix_groups.py). On a GPU the roofline also
counts the matmuls' FLOPs where they, not the weight reads, bound a step (`roofline_seconds`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from rollout_cli.engine.engine import Engine
from rollout_cli.errors import RolloutError


def _median_cuda_seconds(op, runs: int = 12, warmups: int = 2) -> float:
    """Median seconds of `op()` on the current CUDA stream (CUDA events), the first `warmups` runs dropped."""
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[warmups:])


def measure_hbm_bandwidth(device: torch.device, gib: float = 2.0) -> float | None:
    """Bytes/s of a large device-to-device copy (read + write), median of 10; None on the CPU."""
    if device.type != "cuda":
        return None
    numel = int(gib * (1 << 30)) // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = _median_cuda_seconds(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * numel * 4 / seconds


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float | None:
    """FLOP/s of a large square matmul in `dtype` (cuBLAS; float8_e4m3fn: torch._scaled_mm with unit
    scales, bf16 out), median of 10 after 2 warm-ups; None on the CPU."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    if dtype == torch.float8_e4m3fn:
        one = torch.ones((), device=device)
        seconds = _median_cuda_seconds(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16))
    else:
        seconds = _median_cuda_seconds(lambda: torch.mm(a, b))
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / seconds


@dataclass(frozen=True)
class MatmulRates:
    """Measured matmul FLOP/s: in the model's dtype, and in e4m3 when --quantization fp8 stores weights so."""
    flops_per_s: float | None
    fp8_flops_per_s: float | None = None


def measure_matmul_rates(device: torch.device, dtype: torch.dtype, fp8_weights: bool) -> MatmulRates:
    fp8 = measure_matmul_flops(device, torch.float8_e4m3fn) if fp8_weights else None
    return MatmulRates(measure_matmul_flops(device, dtype), fp8)


def active_matmul_params(model, dtype: torch.dtype | None = None) -> int:
    """Weights one decode token is multiplied through (its matmul FLOPs are 2 x this): every 2-D weight
    but the input embedding (counted as the head when tied), and of each stacked-experts module
    (w13, w2 [E, ...]) the top_k / E share a token is routed through. Under --tp: this rank's shards.
    `dtype`: only the weights stored in it (float8_e4m3fn: the layers --quantization fp8 turned e4m3)."""
    def counted(p) -> bool:
        return dtype is None or p.dtype == dtype

    embed = model.model.embed_tokens.weight
    experts = [m for m in model.modules() if hasattr(m, "w13") and hasattr(m, "w2")]
    stacked = {id(p) for m in experts for p in (m.w13, m.w2)}
    total = sum(p.numel() for name, p in model.named_parameters()  # FP8 block scales are not matmul weights
                if p.dim() == 2 and p is not embed and id(p) not in stacked and counted(p)
                and not name.endswith("_scale_inv"))
    if getattr(model, "tie_word_embeddings", False) and counted(embed):
        total += embed.numel()
    top_k = getattr(model, "top_k", 0)
    for m in experts:
        total += sum(w.numel() for w in (m.w13, m.w2) if counted(w)) * top_k // m.num_experts
    return total


def roofline_seconds(steps: int, tokens: int, weight_bytes: int, matmul_params: int, other_bytes: int,
                     hbm_bytes_per_s: float, flops_per_s: float, fp8_params: int = 0,
                     fp8_flops_per_s: float | None = None) -> float:
    """The least time the decode steps can take, kernel class by kernel class: each step's matmuls take
    the longer of reading the weights and doing their FLOPs (2 x matmul params x the step's tokens, the
    mean batch here), and the attention's KV (plus linear states) reads are bandwidth alone. FP8 weights
    (fp8_params of the matmul_params) run at fp8_flops_per_s, the rest at flops_per_s."""
    per_step_tokens = tokens / steps
    flop_seconds = 2 * per_step_tokens * (matmul_params - fp8_params) / flops_per_s
    if fp8_params:
        flop_seconds += 2 * per_step_tokens * fp8_params / fp8_flops_per_s
    matmuls = max(weight_bytes / hbm_bytes_per_s, flop_seconds)
    return steps * matmuls + other_bytes / hbm_bytes_per_s


def bandwidth_limit(engine: Engine, measured_tok_s: float, hbm_bytes_per_s: float | None,
                    flops_per_s: float | None = None, fp8_flops_per_s: float | None = None) -> dict:
    """The run against its bandwidth limit and roofline (module docstring); fp8_flops_per_s: the e4m3
    matmul rate for the weights --quantization fp8 stores in e4m3 (None: every matmul at flops_per_s)."""
    traffic = engine.runner.traffic
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_bytes_per_token = engine.kv.bytes_per_token_of_pool
    # hybrid models: every decode token also reads and writes its sequence's float32 linear-attention state
    state_shape = getattr(engine.model, "linear_state_shape", None)
    state_bytes_per_token = 2 * state_shape.bytes_per_sequence if state_shape is not None else 0
    state_bytes = traffic.tokens * state_bytes_per_token
    # what must move: a prompt prefix the n samples share (the same KV slots) counted once per step
    decode_bytes = traffic.steps * weight_bytes + traffic.distinct_context_tokens * kv_bytes_per_token + state_bytes
    # what a kernel reading every sample's whole context moves (the limit before the rule above)
    per_sample_bytes = traffic.steps * weight_bytes + traffic.context_tokens * kv_bytes_per_token + state_bytes
    formula = ("limit tok/s = decode tokens / ((steps x weight bytes + distinct context tokens x KV bytes/token"
               + (" + decode tokens x 2 x linear-state bytes/sequence" if state_bytes_per_token else "")
               + ") / HBM B/s); distinct: the prefix the samples of one prompt share through the prefix cache counts "
               "once per step (the groups --shared-prefix-attention reads once)")
    report = {
        "formula": formula,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "linear_state_bytes_per_token": state_bytes_per_token,
        "decode_steps": traffic.steps,
        "decode_tokens": traffic.tokens,
        "decode_context_tokens": traffic.context_tokens,
        "decode_distinct_context_tokens": traffic.distinct_context_tokens,
        "decode_bytes": decode_bytes,
        "decode_bytes_per_sample_reads": per_sample_bytes,
        "hbm_bytes_per_s": hbm_bytes_per_s,
    }
    if hbm_bytes_per_s and decode_bytes:
        limit = traffic.tokens / (decode_bytes / hbm_bytes_per_s)
        report["limit_output_tokens_per_s"] = limit
        report["fraction_of_limit"] = measured_tok_s / limit
        # the same limit if every sample re-read its shared prefix (above 100%: the GPU did not)
        report["limit_per_sample_reads_output_tokens_per_s"] = traffic.tokens / (per_sample_bytes / hbm_bytes_per_s)
    if hbm_bytes_per_s and flops_per_s and traffic.steps:
        # at large batches the matmuls run out of FLOP/s before bandwidth (the 8B shape at 256 rows)
        params = active_matmul_params(engine.model)
        fp8_params = active_matmul_params(engine.model, torch.float8_e4m3fn) if fp8_flops_per_s else 0
        seconds = roofline_seconds(traffic.steps, traffic.tokens, weight_bytes, params,
                                   decode_bytes - traffic.steps * weight_bytes, hbm_bytes_per_s, flops_per_s,
                                   fp8_params, fp8_flops_per_s)
        report.update({
            "roofline_formula": "roofline tok/s = decode tokens / (steps x max(weight bytes / HBM B/s, 2 x active "
                                "matmul params x tokens per step / matmul FLOP/s) + other decode bytes / HBM B/s)"
                                + ("; e4m3 weights' params at the e4m3 FLOP/s" if fp8_params else ""),
            "active_matmul_params": params,
            "active_fp8_matmul_params": fp8_params,
            "matmul_flops_per_s": flops_per_s,
            "fp8_matmul_flops_per_s": fp8_flops_per_s,
            "roofline_output_tokens_per_s": traffic.tokens / seconds,
            "fraction_of_roofline": measured_tok_s * seconds / traffic.tokens,
        })
    return report


def speculation_bound(plain: dict, acceptance_length: float | None) -> float | None:
    """The most a drafter accepting `acceptance_length` tokens per verifying step could speed up the plain run
    `plain` (a run_engine report): its graph-replayed decode steps' wall time divided by that length (every
    step drafting, drafts free), the rest of the run (prefill and other eager steps, the tail) as it was:
    Amdahl's law over the run. None without drafts or timed decode steps."""
    decode = plain.get("decode_seconds") or 0.0
    if not acceptance_length or decode <= 0.0:
        return None
    return plain["seconds"] / (plain["seconds"] - decode + decode / acceptance_length)


def check_context_length(cfg, prompt_lengths: list[int], max_model_len: int, model_positions: int,
                         data: str | None = None, set_by_flag: bool = False) -> None:
    """Refuse a workload (bench.BenchConfig, its prompts' lengths) whose longest sample runs past the engine's
    max model length: the engine ends a sample there (finish_reason length), so the run timed fewer tokens
    than asked and reported them as the workload's. vLLM's throughput benchmark refuses such a workload too.
    A sample of --turns T holds its prompt, T model turns and T - 1 observations."""
    output = cfg.output_len_range[1] if cfg.output_len_range else cfg.output_len  # --long-tail: output_len
    prompt = max(prompt_lengths, default=0)
    total = prompt + cfg.turns * output + (cfg.turns - 1) * cfg.observation_len
    if total <= max_model_len:
        return
    flag = "--output-len-range" if cfg.output_len_range else "--output-len"
    asked = f"{flag}'s upper end {output}" if cfg.output_len_range else f"{flag} {output}"
    turns = f" x {cfg.turns} turns + {cfg.turns - 1} x --observation-len {cfg.observation_len}" if cfg.turns > 1 else ""
    shorter = (f"use shorter --data {data} prompts" if data
               else f"lower {'--input-len-range' if cfg.input_len_range else '--input-len'}")
    source = "--max-model-len" if set_by_flag else "max_position_embeddings in config.json"
    wider = (f", or raise --max-model-len (the model allows up to {model_positions})"
             if max_model_len < model_positions else " (the model has no more positions)")
    raise RolloutError(f"a sample of this workload needs {total} tokens (its longest prompt, {prompt}, + {asked}"
                       f"{turns}), past the max model length {max_model_len} ({source}), where the engine would cut "
                       f"it short; lower {flag} or {shorter}{wider}")
