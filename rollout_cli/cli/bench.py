"""`rollout bench`: measure throughput on a synthetic workload, optionally against HF transformers."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from rollout_cli.cli import options as opt
from rollout_cli.cli.errors import user_errors
from rollout_cli.cli.rank_failure import rank_failures
from rollout_cli.cli.tensor_parallel_run import exit_rank, follow_leader, is_rank, launch_ranks, leading, rank_config
from rollout_cli.errors import RolloutError
from rollout_cli.process_gc import freeze_long_lived_objects

if TYPE_CHECKING:  # the CLI starts without torch: bench_limits imports it
    from rollout_cli.bench_limits import MatmulRates

WORKLOAD = "Workload"


@opt.with_engine_options(exclude=("weight_version",))
def bench_command(
    model: opt.Model,
    num_prompts: Annotated[int, typer.Option(help="Prompts in the workload.", rich_help_panel=WORKLOAD)] = 256,
    input_len: Annotated[int, typer.Option(help="Prompt length (random token ids).", rich_help_panel=WORKLOAD)] = 256,
    output_len: Annotated[int, typer.Option(help="Response length; eos is ignored.", rich_help_panel=WORKLOAD)] = 512,
    input_len_range: Annotated[Optional[tuple[int, int]], typer.Option(help="Uniform prompt lengths in [LO, HI] (seeded).", rich_help_panel=WORKLOAD)] = None,
    output_len_range: Annotated[Optional[tuple[int, int]], typer.Option(help="Uniform response lengths in [LO, HI] (seeded).", rich_help_panel=WORKLOAD)] = None,
    data: Annotated[Optional[str], typer.Option(help="Take prompts from this Parquet file instead of random ids.", rich_help_panel=WORKLOAD)] = None,
    prompt_key: Annotated[str, typer.Option(help="Prompt column of --data.", rich_help_panel=WORKLOAD)] = "prompt",
    n: opt.N = 1,
    turns: Annotated[int, typer.Option(help="Model turns per sample: above 1 every sample is a multi-turn episode (as rollout run --env), a synthetic environment answering each turn with --observation-len tokens; --output-len is per turn. Reports each later turn's prefill against its new tokens.", rich_help_panel=WORKLOAD)] = 1,
    observation_len: Annotated[int, typer.Option(help="With --turns: the environment's tokens after each model turn.", rich_help_panel=WORKLOAD)] = 32,
    long_tail: Annotated[Optional[float], typer.Option(help="Long-tailed output lengths: this share of the prompts run to --output-len, the rest to lengths uniform in \\[output-len/16, output-len/4].", rich_help_panel=WORKLOAD)] = None,
    carry_over: Annotated[int, typer.Option(help="Above 0: also run this many rounds of the workload twice, waiting for every sample of a round, then carrying the unfinished samples over to the next round once --carry-at of them finished (partial rollouts); prints the tail's share of the time and the throughput gain.", rich_help_panel=WORKLOAD)] = 0,
    carry_at: Annotated[float, typer.Option(help="With --carry-over: the share of a round's samples after which the rest are carried over.", rich_help_panel=WORKLOAD)] = 0.9,
    images: Annotated[int, typer.Option(help="Vision-language models: images before each prompt's text (random patch rows, each prompt its own); reports the vision tower's share of the run and its FLOP/s.", rich_help_panel=WORKLOAD)] = 0,
    image_size: Annotated[tuple[int, int], typer.Option(help="With --images: each image's width and height in pixels (multiples of patch x merge, 32 for Qwen3-VL).", rich_help_panel=WORKLOAD)] = (448, 448),
    temperature: opt.Temperature = 1.0,
    seed: opt.Seed = 0,
    baseline: Annotated[str, typer.Option(help="none, or hf: also time transformers generate on the same prompts.")] = "none",
    baseline_batch: Annotated[int, typer.Option(help="Batch size of the HF baseline.")] = 256,
    baseline_time_limit: Annotated[float, typer.Option(help="Stop the HF baseline after this many seconds (0: never) and report a bound: its throughput at most, our speedup at least.")] = 0.0,
    capture_routing: Annotated[str, typer.Option(help="MoE models: off, on (record every token's experts in the timed run), or compare (a run without, then one with: the cost of capture).")] = "off",
    json_path: Annotated[Optional[str], typer.Option("--json", help="Write the full report to this JSON file.")] = None,
    profile: Annotated[bool, typer.Option("--profile", help="Afterwards, profile a short run and print the top kernels.")] = False,
    tp: Annotated[int, typer.Option(help="Tensor parallel: split the model over N GPUs (N processes on the CPU), as `rollout run --tp`; rank 0 reports.", rich_help_panel=opt.ENGINE)] = 1,
    engine_options: Optional[dict] = None,  # filled by with_engine_options
) -> None:
    """Measure output tokens/s, TTFT, memory and the bandwidth-limit fraction.

    Example:

        rollout bench --model ckpt/ --load-format dummy --num-prompts 256 --input-len 256 --output-len 512 --baseline hf

    One model over 2 GPUs:

        rollout bench --model ckpt/ --load-format dummy --num-prompts 256 --tp 2
    """
    # heavy: torch and the model code
    from rollout_cli.bench import BenchConfig, run_hf_baseline
    from rollout_cli.bench_limits import measure_hbm_bandwidth, measure_matmul_rates
    from rollout_cli.cli.bench_workload import checked_workload
    from rollout_cli.engine.engine import Engine
    from rollout_cli.models.build import load_model_config, resolve_device, resolve_dtype

    console = Console()
    with user_errors(), rank_failures():  # rank_failures: a no-op in the command typed
        _check_json_path(json_path)  # before the model loads: the report is written only after the whole run
        cfg = BenchConfig(num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                          input_len_range=input_len_range, output_len_range=output_len_range, n=n,
                          temperature=temperature, seed=seed, baseline=baseline, baseline_batch=baseline_batch,
                          baseline_time_limit=baseline_time_limit,
                          capture_routing=capture_routing, turns=turns, observation_len=observation_len,
                          long_tail=long_tail, carry_over=carry_over, carry_at=carry_at, images=images,
                          image_size=tuple(image_size))
        engine_config = opt.engine_config(model=model, **engine_options)
        if engine_config.speculative == "mtp" and engine_config.load_format == "dummy":
            # session 35 read a random head's 1.00 tokens per verifying step as a GPU bug
            console.print("note: --load-format dummy gives the MTP head random weights, which draft nothing the "
                          "model samples: this prices the head's pass, not speculation (load the checkpoint's "
                          "weights for that)")
        hf_config = load_model_config(engine_config.model)  # a hub id's snapshot directory
        if tp != 1:
            engine_config = _tensor_parallel_rank(engine_config, hf_config, tp, cfg, lambda: checked_workload(
                cfg, engine_config, hf_config, data, prompt_key))
            if engine_config is None:
                return  # a follower: rank 0 ran the benchmark
        torch_device = resolve_device(engine_config.device)
        workload = checked_workload(cfg, engine_config, hf_config, data, prompt_key,  # before any timing
                                    pin_images=torch_device.type == "cuda")
        hbm = measure_hbm_bandwidth(torch_device)
        rates = measure_matmul_rates(torch_device, resolve_dtype(engine_config.dtype, torch_device),
                                     fp8_weights=engine_config.quantization == "fp8")
        report: dict = {"workload": {**cfg.__dict__, "prompts": len(workload.prompts)}}
        if baseline == "hf":
            with console.status("HF transformers baseline"):
                report["hf"] = run_hf_baseline(engine_config.model, engine_config.load_format, torch_device,
                                               resolve_dtype(engine_config.dtype, torch_device), workload, cfg)
        with console.status("loading engine"):
            engine = Engine(engine_config)
        freeze_long_lived_objects()
        with leading(engine):
            _bench_engine(engine, workload, cfg, hbm, report, json_path, profile, console, rates)
    if tp != 1:
        exit_rank()  # rank 0 as run's: skip interpreter finalization, which gloo's threads can abort


def _tensor_parallel_rank(engine_config, hf_config, tp: int, cfg, check_workload):
    """--tp N: in the command typed, check the inputs (check_workload() too: refused on rank 0 after
    the start, a workload left the other ranks waiting for it in the rendezvous) and start the ranks
    (exits); in a rank, its engine config, or None on the followers once they followed rank 0's
    benchmark to its end."""
    from rollout_cli.models.tensor_parallel_support import check_tensor_parallel  # heavy: torch

    if tp < 1:
        raise RolloutError("--tp must be >= 1")
    if cfg.baseline != "none":
        raise RolloutError(f"--baseline {cfg.baseline} runs transformers in one process; compare it with --tp 1")
    if not is_rank():
        check_tensor_parallel(hf_config, tp)
        check_workload()
        launch_ranks(tp, "bench", engine_config)
    engine_config, rank = rank_config(engine_config, tp, "bench")
    if rank != 0:
        follow_leader(engine_config)
        return None
    return engine_config


def _bench_engine(engine, workload, cfg, hbm, report: dict, json_path, profile: bool, console,
                  rates: MatmulRates) -> None:
    """The timed runs on a loaded engine, then the report (rank 0 of --tp N: the followers run the same steps)."""
    from rollout_cli.bench import profile_decode, run_engine  # heavy: torch
    from rollout_cli.bench_limits import bandwidth_limit
    from rollout_cli.bench_long_tail import compare_carry_over

    capture_routing = cfg.capture_routing
    report["engine_settings"] = {"device": str(engine.device), "dtype": str(engine.dtype),
                                 "kv_cache_tokens": engine.num_kv_slots - 1,
                                 "tensor_parallel": engine.config.tensor_parallel_size,
                                 "attention_backend": engine.attention_backend,
                                 "deterministic": engine.config.deterministic}
    if capture_routing == "on":
        engine.enable_routing_capture()  # a dense model is refused here, before any timing
    elif capture_routing == "compare" and not getattr(engine.model, "moe_layers", None):
        engine.enable_routing_capture()  # refuses with the one-line reason
    if capture_routing == "compare" and engine.config.deterministic:
        raise RolloutError("--capture-routing compare and --deterministic each time two settings; run them one at a time")
    if capture_routing == "compare":
        report.update(_compare_capture(engine, workload, cfg, console))
    elif engine.config.deterministic and engine.tp is None:
        report.update(_compare_modes(engine, workload, cfg, console))
    elif engine.config.speculative is not None:
        report.update(_compare_speculation(engine, workload, cfg, console))
    else:
        with console.status("engine"):
            report["rollout"] = run_engine(engine, workload, cfg, rates.flops_per_s)
    if cfg.carry_over:
        with console.status(f"long tail: {cfg.carry_over} rounds waiting, then carrying over"):
            report["long_tail"] = compare_carry_over(engine, workload, cfg, cfg.carry_over, cfg.carry_at)
    report["bandwidth"] = bandwidth_limit(engine, report["rollout"]["output_tokens_per_s"], hbm,
                                          rates.flops_per_s, rates.fp8_flops_per_s)
    if "hf" in report:
        report["speedup_vs_hf"] = report["rollout"]["output_tokens_per_s"] / report["hf"]["output_tokens_per_s"]
    report["versions"] = _versions(engine.device)
    console.print(_table(report))
    console.print(f"[dim]{report['bandwidth']['formula']}[/dim]")
    if "roofline_formula" in report["bandwidth"]:
        console.print(f"[dim]{report['bandwidth']['roofline_formula']}[/dim]")
    if json_path:  # after the table: a report that cannot be written (a full disk) leaves the run's numbers shown
        _write_report(json_path, report)
    if profile and "mode_runs" in report:  # where the on-policy cost goes: the same short run in both modes
        for on in (False, True):
            engine.set_deterministic(on)
            console.print(f"profile, {'on-policy' if on else 'default'} mode")
            console.print(profile_decode(engine, workload, cfg), soft_wrap=True)
    elif profile:
        console.print(profile_decode(engine, workload, cfg), soft_wrap=True)


def _abba(engine, workload, cfg, console, switch, label: str) -> tuple[list[dict], float, float]:
    """Four runs on one engine with a setting off, on, on, off (ABBA: a slow drift over the runs
    weighs on both sides alike); switch(on) sets it. Untimed runs of the whole workload with the
    setting on, then off, come first: run_engine's short warm-up does not reach every context length,
    and a kernel compiled inside the first timed run once cost the H200's 0.6B line a second of its 3
    (44,347 tok/s default in the last run, 32,944 in the first); the setting's own kernels (speculation's
    verify steps) compile in its first run (2.0 against 0.85 s, the first --speculative mtp line on the
    H100). -> (the four runs, seconds with it off, seconds with it on), from the sums of times."""
    from rollout_cli.bench import run_engine  # heavy: torch

    for on in (True, False):
        switch(on)
        with console.status(f"engine, {label} {'on' if on else 'off'}, warm-up run (untimed)"):
            run_engine(engine, workload, cfg)
    runs = []
    for on in (False, True, True, False):
        switch(on)
        with console.status(f"engine, {label} {'on' if on else 'off'}"):
            runs.append(run_engine(engine, workload, cfg))
    return runs, runs[0]["seconds"] + runs[3]["seconds"], runs[1]["seconds"] + runs[2]["seconds"]


def abba_spread(runs: list[dict]) -> float:
    """The larger relative difference between the two runs of one setting (runs 0 and 3, 1 and 2):
    the noise the ABBA cost carries. A spread near the cost itself makes the cost meaningless."""
    def rel(a: dict, b: dict) -> float:
        return abs(a["seconds"] - b["seconds"]) / max(a["seconds"], b["seconds"])
    return max(rel(runs[0], runs[3]), rel(runs[1], runs[2]))


def _spread_note(runs: list[dict]) -> str:
    return f"; runs of one setting differ by up to {abba_spread(runs):.1%}"


def _compare_capture(engine, workload, cfg, console) -> dict:
    """Routing capture off, on, on, off; its overhead as a share of the time."""
    def switch(on: bool) -> None:
        engine.enable_routing_capture() if on else engine.disable_routing_capture()

    runs, off_seconds, on_seconds = _abba(engine, workload, cfg, console, switch, "routing capture")
    return {"rollout": runs[3], "rollout_capture": runs[2],
            "capture_runs": [{"capture": capture, "seconds": r["seconds"], "output_tokens_per_s": r["output_tokens_per_s"]}
                             for capture, r in zip(("off", "on", "on", "off"), runs)],
            "capture_overhead": 1 - off_seconds / on_seconds, "abba_spread": abba_spread(runs)}


def _compare_modes(engine, workload, cfg, console) -> dict:
    """--deterministic: the default mode and the on-policy mode on one engine, off, on, on, off (the
    cost the issue bounds: the share of output tok/s the on-policy mode gives up); the engine ends in
    the on-policy mode and `rollout` reports its run."""
    runs, default_seconds, on_policy_seconds = _abba(engine, workload, cfg, console, engine.set_deterministic,
                                                     "--deterministic")
    engine.set_deterministic(True)
    return {"rollout": runs[2], "rollout_default": runs[3],
            "mode_runs": [{"deterministic": mode, "seconds": r["seconds"], "output_tokens_per_s": r["output_tokens_per_s"]}
                          for mode, r in zip((False, True, True, False), runs)],
            "deterministic_cost": 1 - default_seconds / on_policy_seconds, "abba_spread": abba_spread(runs)}


def _compare_speculation(engine, workload, cfg, console) -> dict:
    """--speculative: decoding without and with drafts on one engine, off, on, on, off (the speedup issue 22
    asks for: output tok/s with drafts over without); the engine ends with drafts on and `rollout`
    reports that run (its acceptance length included)."""
    from rollout_cli.bench_limits import speculation_bound  # the CLI starts without torch

    runs, plain_seconds, speculative_seconds = _abba(engine, workload, cfg, console, engine.set_speculation,
                                                     f"--speculative {engine.config.speculative}")
    engine.set_speculation(True)
    return {"rollout": runs[2], "rollout_plain": runs[3],
            "speculation_runs": [{"speculative": on, "seconds": r["seconds"], "output_tokens_per_s": r["output_tokens_per_s"]}
                                 for on, r in zip((False, True, True, False), runs)],
            "speculation_speedup": plain_seconds / speculative_seconds, "abba_spread": abba_spread(runs),
            "speculation_bound": speculation_bound(runs[3], runs[2].get("acceptance_length"))}


def _write_report(path: str, report: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)
    except OSError as err:  # a full disk or a revoked permission, found only after the whole run
        raise RolloutError(f"--json {path}: the report could not be written ({err.strerror or err}); free space "
                           "or give another path, and run the benchmark again") from err


def _check_json_path(path: str | None) -> None:
    """Refuse a --json file that cannot be written: a directory, or one in a directory that is not there."""
    if path is None:
        return
    if not path.strip():  # read as false where the report is written: the run went unreported, silently
        raise RolloutError("--json needs a file path; give one, or drop --json")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise RolloutError(f"--json {path} is a directory; give a file path for the report")
    if not os.path.isdir(parent):
        raise RolloutError(f"--json {path}: directory {parent} does not exist; create it or give another path")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise RolloutError(f"--json {path} is not writable; give a path you can write")


def _versions(device) -> dict:
    # heavy: torch, transformers (triton below: optional)
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        versions["gpu"] = torch.cuda.get_device_name(device)
    return versions


def _table(report: dict) -> Table:
    r, bw = report["rollout"], report["bandwidth"]
    table = Table(title="rollout bench", show_header=False)
    table.add_row("output tok/s", f"{r['output_tokens_per_s']:,.1f}")
    table.add_row("total tok/s", f"{r['total_tokens_per_s']:,.1f}")
    table.add_row("requests / output tokens", f"{r['requests']} / {r['output_tokens']:,}")
    table.add_row("TTFT mean / p50 / p99", f"{r['ttft_mean_s']:.3f} / {r['ttft_p50_s']:.3f} / {r['ttft_p99_s']:.3f} s")
    table.add_row("prefix hit rate", f"{r['prefix_hit_rate']:.1%}")
    if "episodes" in r:
        e = r["episodes"]
        table.add_row("episode turns / their hit rate", f"{e['turns']:,} / {e['prefix_hit_rate']:.1%}")
        table.add_row("later turns: prefilled / new", f"{e['later_turn_prefill_tokens_mean']:.1f} / "
                      f"{e['later_turn_new_tokens_mean']:.1f} tokens per turn "
                      f"({e['later_turns_prefilling_only_new_tokens']:.0%} prefilled only new tokens)")
        table.add_row("episodes open at once", f"{e['peak_open_episodes']:,} at most ({e['episode_rows_held_for_kv']:,} "
                      "prompt rows waited for KV room)")
    if r["prefill_steps"]:
        held = (f" (admission held in {r['admission_held_steps']:,} decode steps; an eager step priced at "
                f"{r['eager_step_cost']:g})" if r["admission_held_steps"] else "")
        table.add_row("prefill steps", f"{r['prefill_steps']} x {r['prefill_step_ms']:.1f} ms, the slowest "
                      f"{r['prefill_step_max_ms']:.1f} ms{held}")
    if r["decode_gpu_idle_share"] is not None:
        table.add_row("decode step / GPU idle", f"{r['decode_step_ms']:.2f} ms / {r['decode_gpu_idle_share']:.1%}")
        table.add_row("decode GPU / host busy", f"{r['decode_gpu_ms']:.2f} / {r['decode_host_busy_ms']:.2f} ms per step")
    if r["cuda_graph_capture_s"] is not None:
        table.add_row("CUDA graph capture", f"{r['cuda_graph_capture_s']:.1f} s")
    table.add_row("preemptions / recomputed tokens", f"{r['preemptions']} / {r['recomputed_tokens']:,}")
    table.add_row("peak running / last 10% of samples", f"{r['peak_running']} / {r['last_10pct_seconds']:.2f} s "
                  f"({r['last_10pct_seconds'] / r['seconds']:.0%} of the run)")
    table.add_row("KV cache", f"{r['kv_cache_tokens']:,} tokens ({r['kv_cache_dtype']})")
    if "acceptance_length" in r:
        table.add_row("speculation", f"{r['acceptance_length']:.2f} tokens per verifying step "
                      f"({r['verify_steps']:,} verify steps; {r['verify_ahead_steps']:,} steps planned ahead)")
    if "gate_drafting_steps" in r:
        drafted, plain = r["gate_drafting_steps"], r["gate_plain_steps"]
        table.add_row("speculation gate", f"drafts in {drafted:,} of {drafted + plain:,} decode steps "
                      "(the batch sizes where drafting measured faster)")
        if (bucket := r["gate_busiest_bucket"]) is not None:
            table.add_row(f"gate at batch {bucket['batch']}+", "plain {plain_ms:.2f} ms x {plain_tokens:.2f} tokens, "
                          "drafting {drafting_ms:.2f} ms x {drafting_tokens:.2f} (per step and request; "
                          "{plain_steps} / {drafting_steps} steps)".format(**bucket))
    if "images_encoded" in r:
        rate = f", {r['vision_tflops_per_s']:,.1f} TFLOP/s" if r["vision_tflops_per_s"] else ""
        peak = f" ({r['vision_peak_fraction']:.0%} of matmul peak)" if r["vision_peak_fraction"] else ""
        table.add_row("vision tower", f"{r['images_encoded']} images, {r['vision_seconds']:.2f} s "
                      f"({r['vision_share']:.1%} of the run){rate}{peak}")
    if r["peak_memory_gib"] is not None:
        table.add_row("peak memory", f"{r['peak_memory_gib']:.1f} GiB")
    if bw.get("limit_output_tokens_per_s"):
        table.add_row("bandwidth limit", f"{bw['limit_output_tokens_per_s']:,.0f} tok/s "
                      f"(HBM {bw['hbm_bytes_per_s'] / 1e12:.2f} TB/s)")
        table.add_row("fraction of limit", f"{bw['fraction_of_limit']:.1%}")
        if bw["decode_distinct_context_tokens"] < bw["decode_context_tokens"]:  # samples shared a cached prefix
            table.add_row("limit if samples re-read it", f"{bw['limit_per_sample_reads_output_tokens_per_s']:,.0f} tok/s "
                          "(every sample reading its shared prefix)")
    if bw.get("roofline_output_tokens_per_s"):
        table.add_row("roofline limit", f"{bw['roofline_output_tokens_per_s']:,.0f} tok/s "
                      f"(matmul {bw['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s"
                      + (f", e4m3 {bw['fp8_matmul_flops_per_s'] / 1e12:.0f}" if bw.get("fp8_matmul_flops_per_s") else "")
                      + ")")
        table.add_row("fraction of roofline", f"{bw['fraction_of_roofline']:.1%}")
    if "hf" in report:
        hf = report["hf"]
        bound = not hf.get("complete", True)  # stopped at --baseline-time-limit: an upper bound
        note = f"batch {hf['batch']}" + (f", experts {hf['experts_implementation']}" if hf.get("experts_implementation") else "")
        if bound:
            note += f"; stopped after {hf['seconds']:.0f} s, {hf['steps_left']} steps left: at most"
        table.add_row("HF generate", f"{'<= ' if bound else ''}{hf['output_tokens_per_s']:,.1f} tok/s ({note})")
        table.add_row("speedup vs HF", f"{'>= ' if bound else ''}{report['speedup_vs_hf']:.2f}x")
    if "rollout_capture" in report:
        table.add_row("with routing capture", f"{report['rollout_capture']['output_tokens_per_s']:,.1f} tok/s")
        runs = " / ".join(f"{r['output_tokens_per_s']:,.0f}" for r in report["capture_runs"])
        table.add_row("capture off, on, on, off", f"{runs} tok/s")
        table.add_row("capture overhead", f"{report['capture_overhead']:.1%} of the time (ABBA)"
                      + _spread_note(report["capture_runs"]))
    if "rollout_default" in report:
        table.add_row("default mode", f"{report['rollout_default']['output_tokens_per_s']:,.1f} tok/s")
        runs = " / ".join(f"{r['output_tokens_per_s']:,.0f}" for r in report["mode_runs"])
        table.add_row("default, on-policy, on-policy, default", f"{runs} tok/s")
        table.add_row("on-policy cost", f"{report['deterministic_cost']:.1%} fewer output tok/s (ABBA)"
                      + _spread_note(report["mode_runs"]))
    if "speculation_runs" in report:
        runs = " / ".join(f"{r['output_tokens_per_s']:,.0f}" for r in report["speculation_runs"])
        table.add_row("plain, drafts, drafts, plain", f"{runs} tok/s")
        bound = report["speculation_bound"]
        table.add_row("speculation speedup", f"{report['speculation_speedup']:.2f}x output tok/s (ABBA)"
                      + (f", at most {bound:.2f}x at this acceptance" if bound else "")
                      + _spread_note(report["speculation_runs"]))
    if "long_tail" in report:
        lt = report["long_tail"]
        table.add_row(f"wait for all, {lt['rounds']} rounds", f"{lt['wait']['output_tokens_per_s']:,.1f} tok/s; the last "
                      f"{1 - lt['carry_at']:.0%} of samples took {lt['wait']['tail_share_of_time']:.0%} of the time")
        table.add_row(f"carry over at {lt['carry_at']:.0%}", f"{lt['carry']['output_tokens_per_s']:,.1f} tok/s "
                      f"({lt['throughput_gain']:+.1%})")
    table.add_row("wall time", f"{r['seconds']:.1f} s")
    return table
