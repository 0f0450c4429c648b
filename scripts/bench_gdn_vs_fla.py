"""Our Gated DeltaNet kernels against flash-linear-attention's on the same inputs, in one run (issue 8).

    python3 scripts/bench_gdn_vs_fla.py [--json FILE] [--sweep]

Needs FLA importable (`fla`, from the flash-linear-attention / fla-core wheels; the device call
installs them into a directory of their own). Qwen3-Next's linear-layer shape: 16 key heads,
32 value heads, 128 x 128, bf16 inputs, float32 states.
- prefill: our chunk_gated_delta_rule_varlen (states updated in place at slot indices) against FLA's
  chunk_gated_delta_rule (cu_seqlens, initial_state, output_final_state); outputs and final states
  compared, then timed; TFLOP/s counts chunk_gated_delta_rule_flops for both.
- decode: our recurrent_gated_delta_rule_update (one token per sequence, state slots updated in
  place) against FLA's fused_recurrent_gated_delta_rule (initial_state in, final state out);
  fraction of HBM bandwidth = (state read + write + q/k/v/o bytes) / time / the copy bandwidth
  `rollout bench` measures.
- --sweep (alone, FLA not needed): each of our prefill kernels' time under its launch knobs (block sizes,
  warps, the state walk's pipelining), at 4 x 4096 and 16 x 256.
- knobs: our prefill under each TUNINGS entry (LOWP: issue 25 item 5's bf16 intermediates), its time
  and its output's distance from the default knobs'; the kernel split for the default and LOWP.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from rollout_cli.bench_limits import measure_hbm_bandwidth  # the copy `rollout bench` measures the limit with

HK, HV, DK, DV = 16, 32, 128, 128


def inputs(tokens: int, seqs: int, seed: int):
    """q/k [T, HK, DK], v [T, HV, DV] bf16; g [T, HV] float32 log decay; beta [T, HV] bf16;
    states [seqs, HV, DK, DV] float32."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((tokens, HK, DK), dtype=torch.bfloat16, device="cuda", generator=gen)
    k = torch.randn((tokens, HK, DK), dtype=torch.bfloat16, device="cuda", generator=gen)
    v = torch.randn((tokens, HV, DV), dtype=torch.bfloat16, device="cuda", generator=gen)
    g = F.logsigmoid(torch.randn((tokens, HV), device="cuda", generator=gen) + 4.0)
    beta = torch.rand((tokens, HV), device="cuda", generator=gen).to(torch.bfloat16)
    states = torch.randn((seqs, HV, DK, DV), device="cuda", generator=gen) * 0.05
    return q, k, v, g, beta, states


def prefill_case(seqs: int, seq_len: int):
    """seqs prompts of seq_len tokens packed in one batch -> (q, k, v, g, beta, states, cu_seqlens, slots)."""
    q, k, v, g, beta, states = inputs(seqs * seq_len, seqs, seed=seq_len)
    return q, k, v, g, beta, states, [i * seq_len for i in range(seqs + 1)], torch.arange(seqs, device="cuda")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def prefill_row(seqs: int, seq_len: int) -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from rollout_kernels.chunk_gated_delta_rule import chunk_gated_delta_rule_varlen
    from rollout_kernels.chunk_gated_delta_rule_bench import chunk_gated_delta_rule_flops

    q, k, v, g, beta, states, cu, index = prefill_case(seqs, seq_len)
    cu_t = torch.tensor(cu, dtype=torch.long, device="cuda")
    ours_states = states.clone()
    ours = chunk_gated_delta_rule_varlen(q, k, v, g, beta, ours_states, index, cu)
    theirs, theirs_final = fla_chunk(q[None], k[None], v[None], g[None], beta[None], initial_state=states.clone(),
                                     output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t)
    scratch = states.clone()
    ours_s = triton.testing.do_bench(lambda: chunk_gated_delta_rule_varlen(q, k, v, g, beta, scratch, index, cu),
                                     return_mode="median") * 1e-3
    theirs_s = triton.testing.do_bench(lambda: fla_chunk(q[None], k[None], v[None], g[None], beta[None],
                                                         initial_state=states, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t),
                                       return_mode="median") * 1e-3
    flops = chunk_gated_delta_rule_flops(seqs * seq_len, HV, DK, DV, 64)
    return {"seqs": seqs, "seq_len": seq_len, "ours_us": ours_s * 1e6, "fla_us": theirs_s * 1e6,
            "ours_tflops": flops / ours_s / 1e12, "fla_tflops": flops / theirs_s / 1e12,
            "out_rel_err": rel_err(ours, theirs[0]), "state_rel_err": rel_err(ours_states, theirs_final)}


LOWP = {"lowp_intermediates": True}  # w, u, v_new and the chunk-start states in bf16 (issue 25 item 5)
TUNINGS = ({}, LOWP, {**LOWP, "inv_precision": "tf32"}, {**LOWP, "inv_precision": "tf32", "block_v": 128},
           {**LOWP, "inv_precision": "tf32", "state_warps": 8},
           {**LOWP, "inv_precision": "tf32", "block_v": 128, "state_warps": 8})


def tuning_rows(seqs: int, seq_len: int) -> list[dict]:
    """Our prefill at each TUNINGS entry: time, and its output's distance from the default's."""
    from rollout_kernels.chunk_gated_delta_rule import chunk_gated_delta_rule_varlen
    from rollout_kernels.chunk_gated_delta_rule_bench import chunk_gated_delta_rule_flops

    q, k, v, g, beta, states, cu, index = prefill_case(seqs, seq_len)
    flops = chunk_gated_delta_rule_flops(seqs * seq_len, HV, DK, DV, 64)
    base = chunk_gated_delta_rule_varlen(q, k, v, g, beta, states.clone(), index, cu)
    rows = []
    for tuning in TUNINGS:
        try:
            out = chunk_gated_delta_rule_varlen(q, k, v, g, beta, states.clone(), index, cu, tuning=tuning)
            scratch = states.clone()
            sec = triton.testing.do_bench(lambda: chunk_gated_delta_rule_varlen(q, k, v, g, beta, scratch, index, cu,
                                                                                tuning=tuning),
                                          return_mode="median") * 1e-3
            rows.append({"seqs": seqs, "seq_len": seq_len, "tuning": tuning, "us": sec * 1e6,
                         "tflops": flops / sec / 1e12, "rel_err_vs_default": rel_err(out, base)})
        except Exception as e:  # a knob set that does not compile (registers, shared memory): report it
            rows.append({"seqs": seqs, "seq_len": seq_len, "tuning": tuning, "error": str(e).splitlines()[0][:120]})
    return rows


def kernel_split(seqs: int, seq_len: int, tuning: dict | None = None) -> dict:
    """CUDA time of each of our prefill's kernels (torch.profiler over 5 calls, per call)."""
    from rollout_kernels.chunk_gated_delta_rule import chunk_gated_delta_rule_varlen

    q, k, v, g, beta, states, cu, index = prefill_case(seqs, seq_len)
    chunk_gated_delta_rule_varlen(q, k, v, g, beta, states, index, cu, tuning=tuning)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            chunk_gated_delta_rule_varlen(q, k, v, g, beta, states, index, cu, tuning=tuning)
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / 5 for e in prof.key_averages() if e.device_time_total > 0}


# Each kernel's launch knobs, swept together: a kernel's time depends on its own knobs only, so one
# profiled call per row gives every kernel's time under the row's knobs (the state walk's 18 settings,
# the WY and output kernels' cycled through them).
STATE_KNOBS = [(bv, warps, stages) for bv in (32, 64, 128) for warps in (4, 8) for stages in (1, 2, 3)]
WY_WARPS = (4, 8)
OUTPUT_KNOBS = [(bv, warps) for bv in (64, 128) for warps in (4, 8)]
SHORT_NAMES = {"_chunk_wy_kernel": "wy", "_chunk_state_kernel": "state", "_chunk_output_kernel": "output"}
KNOB_LABELS = {"state_block_v": "state.BV", "state_warps": "state.warps", "state_stages": "state.stages",
               "wy_warps": "wy.warps", "output_block_v": "out.BV", "output_warps": "out.warps"}


def sweep_rows(seqs: int, seq_len: int) -> list[dict]:
    """Per-kernel CUDA time (kernel_split) under each row of launch knobs, and the output's distance from
    the default knobs' (launch knobs change no math: it must stay at rounding level)."""
    from rollout_kernels.chunk_gated_delta_rule import chunk_gated_delta_rule_varlen

    q, k, v, g, beta, states, cu, index = prefill_case(seqs, seq_len)
    base = chunk_gated_delta_rule_varlen(q, k, v, g, beta, states.clone(), index, cu)
    rows = []
    for i, (bv, warps, stages) in enumerate(STATE_KNOBS):
        out_bv, out_warps = OUTPUT_KNOBS[i % len(OUTPUT_KNOBS)]
        tuning = {"state_block_v": bv, "state_warps": warps, "state_stages": stages,
                  "wy_warps": WY_WARPS[i % len(WY_WARPS)], "output_block_v": out_bv, "output_warps": out_warps}
        try:
            out = chunk_gated_delta_rule_varlen(q, k, v, g, beta, states.clone(), index, cu, tuning=tuning)
            split = kernel_split(seqs, seq_len, tuning)
            times = {short: sum(us for name, us in split.items() if name.startswith(kernel))
                     for kernel, short in SHORT_NAMES.items()}
            rows.append({"seqs": seqs, "seq_len": seq_len, "tuning": tuning, **times,
                         "rel_err_vs_default": rel_err(out, base)})
        except Exception as e:  # registers or shared memory: report the row
            rows.append({"seqs": seqs, "seq_len": seq_len, "tuning": tuning, "error": str(e).splitlines()[0][:120]})
    return rows


def print_sweep(rows: list[dict]) -> None:
    """Each kernel's best knobs, then the whole table."""
    ok = [r for r in rows if "error" not in r]
    for short, keys in (("wy", ("wy_warps",)), ("state", ("state_block_v", "state_warps", "state_stages")),
                        ("output", ("output_block_v", "output_warps"))):
        best = min(ok, key=lambda r: r[short], default=None)
        if best:
            print(f"  best {short:>6}: {best[short]:>8.1f} us at {({key: best['tuning'][key] for key in keys})}")
    for r in rows:
        knobs = " ".join(f"{KNOB_LABELS[key]}={value}" for key, value in r["tuning"].items())
        shown = (f"wy {r['wy']:>7.1f} state {r['state']:>7.1f} output {r['output']:>7.1f} us  "
                 f"err {r['rel_err_vs_default']:.1e}") if "error" not in r else r["error"]
        print(f"  {r['seqs']:>3} x {r['seq_len']:>5} {knobs:<82} {shown}")


def decode_row(batch: int, hbm: float) -> dict:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    from rollout_kernels.gated_delta_rule import recurrent_gated_delta_rule_update

    q, k, v, g, beta, states = inputs(batch, batch, seed=batch)
    index = torch.arange(batch, device="cuda")
    ours_states = states.clone()
    ours = recurrent_gated_delta_rule_update(q, k, v, g, beta, ours_states, index)
    theirs, theirs_final = fla_recurrent(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None],
                                         initial_state=states.clone(), output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
    scratch = states.clone()
    ours_s = triton.testing.do_bench(lambda: recurrent_gated_delta_rule_update(q, k, v, g, beta, scratch, index),
                                     return_mode="median") * 1e-3
    theirs_s = triton.testing.do_bench(lambda: fla_recurrent(q[:, None], k[:, None], v[:, None], g=g[:, None],
                                                             beta=beta[:, None], initial_state=states,
                                                             output_final_state=True, use_qk_l2norm_in_kernel=True),
                                       return_mode="median") * 1e-3
    # bytes a step must move: the float32 state read and written, the bf16 q/k/v read and o written
    state_bytes = 2 * batch * HV * DK * DV * 4
    io_bytes = 2 * batch * (2 * HK * DK + 2 * HV * DV)
    moved = state_bytes + io_bytes
    return {"batch": batch, "ours_us": ours_s * 1e6, "fla_us": theirs_s * 1e6, "bytes": moved,
            "ours_hbm_fraction": moved / ours_s / hbm, "fla_hbm_fraction": moved / theirs_s / hbm,
            "out_rel_err": rel_err(ours, theirs[:, 0]), "state_rel_err": rel_err(ours_states, theirs_final)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true",
                        help="only our prefill's per-kernel launch knobs (no FLA needed): each kernel's time")
    args = parser.parse_args()
    if args.sweep:
        rows = []
        for seqs, seq_len in ((4, 4096), (16, 256)):
            print(f"our prefill's kernels under launch knobs, {seqs} x {seq_len}, us per call")
            shape_rows = sweep_rows(seqs, seq_len)
            print_sweep(shape_rows)
            rows += shape_rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"sweep": rows}, f, indent=1)
        return
    import fla

    hbm = measure_hbm_bandwidth(torch.device("cuda"))
    print(f"fla {fla.__version__}, copy bandwidth {hbm / 1e9:.0f} GB/s; {HK} k-heads / {HV} v-heads, {DK} x {DV}")
    rows = {"hbm_bytes_per_s": hbm, "fla_version": fla.__version__, "prefill": [], "decode": []}
    print("chunked prefill (bf16 in, float32 states, chunk 64)")
    print(f"{'seqs':>4} {'len':>5} {'ours us':>9} {'FLA us':>9} {'ours TF/s':>9} {'FLA TF/s':>8} {'o err':>8} {'S err':>8}")
    for seqs, seq_len in ((4, 1024), (4, 4096), (16, 256), (1, 16384)):
        r = prefill_row(seqs, seq_len)
        rows["prefill"].append(r)
        print(f"{seqs:>4} {seq_len:>5} {r['ours_us']:>9.1f} {r['fla_us']:>9.1f} {r['ours_tflops']:>9.1f} "
              f"{r['fla_tflops']:>8.1f} {r['out_rel_err']:>8.1e} {r['state_rel_err']:>8.1e}")
    for key, tuning in (("kernel_split", None), ("kernel_split_lowp", LOWP)):
        print(f"our prefill's kernels, 4 x 4096, us per call, {tuning or 'default'}")
        rows[key] = kernel_split(4, 4096, tuning)
        for name, us in sorted(rows[key].items(), key=lambda kv: -kv[1]):
            print(f"  {us:>9.1f}  {name[:90]}")
    print("our prefill's knobs (error: relative distance of the output from the default knobs')")
    rows["tuning"] = []
    for seqs, seq_len in ((4, 4096), (16, 256)):
        for r in tuning_rows(seqs, seq_len):
            rows["tuning"].append(r)
            shown = f"{r['us']:>9.1f} us {r['tflops']:>6.1f} TF/s err {r['rel_err_vs_default']:.1e}" if "us" in r \
                else r["error"]
            print(f"{seqs:>4} x {seq_len:>5} {str(r['tuning']):>62} {shown}")
    print("recurrent decode, one token per sequence (state read + written)")
    print(f"{'batch':>5} {'ours us':>9} {'FLA us':>9} {'ours HBM':>8} {'FLA HBM':>7} {'o err':>8} {'S err':>8}")
    for batch in (16, 64, 256):
        r = decode_row(batch, hbm)
        rows["decode"].append(r)
        print(f"{batch:>5} {r['ours_us']:>9.1f} {r['fla_us']:>9.1f} {r['ours_hbm_fraction']:>8.0%} "
              f"{r['fla_hbm_fraction']:>7.0%} {r['out_rel_err']:>8.1e} {r['state_rel_err']:>8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
