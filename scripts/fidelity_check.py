"""Issue 19's fidelity table, re-measured: does a sample depend on what runs beside it?

    python scripts/fidelity_check.py --model recipes/example_model --dtype bfloat16 --modes default,deterministic
    python scripts/fidelity_check.py --model recipes/configs/qwen3-0.6b --random-weights /tmp/q06 --num-prompts 64 \
        --n 4 --output-len 256 --max-len 512 --min-len 64 --hf      # the H200 measurement of issue 19

For each mode (default kernels, or --deterministic), one engine:
  alone vs batch   prompt 0's samples run alone, then inside the whole batch
  rerun, cache on  the whole call twice; the second call hits the prefix cache
  rerun, cache off the same on an engine without prefix cache
  score vs run     Engine.score (teacher forcing) against the run's logprobs
  HF vs run        (--hf) HF transformers' teacher forcing in the same dtype against the run's logprobs
Modes fp8 / fp8kv / fp8both (issue 20's price in fidelity): a second engine with FP8 weights
(--quantization fp8), the FP8 KV cache, or both runs the same prompts, and the first engine (--dtype,
default kernels) scores its trajectories, as `rollout score` over an FP8 run does: the logprob gap a
trainer's importance weights correct for.
--num-layers N measures on the first N layers of --model's config (a slice that fits three engines at
once: the MoE and hybrid shapes' full depth does not; with --load-format dummy).
--random-weights DIR saves a random checkpoint of --model's config.json there first (HF's init, the
final norm's weight scaled by --final-norm-scale so logits have a realistic spread instead of a
near-uniform one) and measures on it: HF can then load the same weights.
Prints one row per comparison: samples with identical tokens, and the max (or mean / p99 / max)
absolute logprob difference; differences after two samples' tokens diverge are not comparable, so
"max |dlogprob|" counts the common prefix of the two token sequences only.
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np


def _prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _compare(a: dict, b: dict) -> tuple[int, int, float]:
    """(samples with identical tokens, samples compared, max |logprob diff| over each pair's common token prefix)."""
    same, worst = 0, 0.0
    keys = sorted(a.keys() & b.keys())
    for key in keys:
        x, y = a[key], b[key]
        same += x.response_token_ids == y.response_token_ids
        common = 0
        while (common < min(len(x.response_token_ids), len(y.response_token_ids))
               and x.response_token_ids[common] == y.response_token_ids[common]):
            common += 1
        if common:
            diff = np.abs(np.asarray(x.response_logprobs[:common]) - np.asarray(y.response_logprobs[:common]))
            worst = max(worst, float(diff.max()))
    return same, len(keys), worst


def _stats(diffs: list) -> str:
    d = np.concatenate(diffs) if diffs else np.zeros(1)
    return f"mean {d.mean():.3g}, p99 {np.percentile(d, 99):.3g}, max {d.max():.3g}, bit-equal {(d == 0).mean():.1%}"


VARIANTS = {"fp8": dict(quantization="fp8"), "fp8kv": dict(kv_cache_dtype="fp8"),
            "fp8both": dict(quantization="fp8", kv_cache_dtype="fp8")}  # mode -> the second engine's options


def build_engine(args, **options):
    """One engine for every comparison and both modes (three engines did not fit the 4-layer Qwen3-Next slice
    on an 80 GB card): its pool holds the workload, not a share of the GPU, a flushed prefix cache stands for a
    fresh engine, and set_deterministic switches the mode as `rollout bench --deterministic` does."""
    from rollout_cli import Engine

    max_model_len = args.max_len + args.output_len + 1
    return Engine(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                  max_model_len=max_model_len, kv_cache_tokens=args.num_prompts * args.n * max_model_len + 1,
                  **options)


def _workload(args, engine):
    """(sampling params, prompt inputs): the same for every mode."""
    from rollout_cli import PromptInput, SamplingParams

    params = SamplingParams(n=args.n, max_new_tokens=args.output_len, temperature=1.0, seed=args.seed,
                            ignore_eos=True)
    prompts = _prompts(args.num_prompts, args.min_len, args.max_len, min(engine.hf_config.vocab_size, 32000), 7)
    return params, [PromptInput(i, p) for i, p in enumerate(prompts)]


def _score_diffs(engine, trajectories: dict, params) -> list:
    """|engine's teacher-forced logprob - the run's| per response token, one array per trajectory."""
    from rollout_cli.engine.trajectory import ScoreInput

    samples = [ScoreInput(t.prompt_index, t.sample_index, t.prompt_token_ids, t.response_token_ids)
               for t in trajectories.values()]
    scored = {(s.prompt_index, s.sample_index): s.response_logprobs for s in engine.score(samples, params)}
    return [np.abs(np.asarray(scored[k], np.float32) - np.asarray(t.response_logprobs, np.float32))
            for k, t in trajectories.items()]


def measure_price(args, engine, variant: str) -> list[tuple[str, str, str]]:
    """The variant's run (VARIANTS[variant]) scored by `engine` in --dtype with the default kernels."""
    import gc

    import torch

    engine.set_deterministic(False)
    other = build_engine(args, **VARIANTS[variant])
    params, inputs = _workload(args, other)
    run = {(t.prompt_index, t.sample_index): t for t in other.stream(inputs, params)}
    del other
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [(f"{args.dtype} score", "-", _stats(_score_diffs(engine, run, params)))]


def measure(args, engine, deterministic: bool) -> list[tuple[str, str, str]]:
    engine.set_deterministic(deterministic)
    params, inputs = _workload(args, engine)

    def run(which, cold: bool):
        if cold:
            engine.flush_cache()
        return {(t.prompt_index, t.sample_index): t for t in engine.stream([inputs[i] for i in which], params)}

    everything = range(len(inputs))
    alone = run([0], cold=True)
    first = run(everything, cold=True)
    second = run(everything, cold=False)  # its prompts come from the prefix cache
    cold_a, cold_b = run(everything, cold=True), run(everything, cold=True)
    rows = []
    for name, (a, b) in (("alone vs batch", (alone, first)), ("rerun, cache on", (first, second)),
                         ("rerun, cache off", (cold_a, cold_b))):
        same, total, worst = _compare(a, b)
        rows.append((name, f"{same} of {total}", f"max {worst:.3g}"))
    rows.append(("score vs run", "-", _stats(_score_diffs(engine, first, params))))
    if args.hf:
        rows.append(("HF vs run", "-", _stats(_hf_diffs(args, first))))
    return rows


def _hf_diffs(args, trajectories: dict) -> list:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    device = "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    if args.load_format == "dummy":
        raise SystemExit("--hf compares against the same weights: give a real checkpoint, not --load-format dummy")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, config=AutoConfig.from_pretrained(args.model))
    model = model.to(device).eval()
    diffs = []
    with torch.no_grad():
        for t in trajectories.values():
            ids = torch.tensor([t.prompt_token_ids + t.response_token_ids], device=device)
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            start = len(t.prompt_token_ids) - 1
            rows = torch.arange(start, start + len(t.response_token_ids), device=device)
            want = logp[rows, torch.tensor(t.response_token_ids, device=device)].cpu().numpy()
            diffs.append(np.abs(want - np.asarray(t.response_logprobs, np.float32)))
    return diffs


def _sliced_config(config_dir: str, num_layers: int) -> str:
    """A copy of config_dir's config.json with its first num_layers layers (per-layer lists cut to match)
    in a temp dir; the path of that dir."""
    import json
    import tempfile

    with open(os.path.join(config_dir, "config.json")) as handle:
        config = json.load(handle)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    config["mlp_only_layers"] = [i for i in config.get("mlp_only_layers") or [] if i < num_layers]
    out_dir = tempfile.mkdtemp(prefix=f"fidelity_{num_layers}l_")
    with open(os.path.join(out_dir, "config.json"), "w") as handle:
        json.dump(config, handle)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=48)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="default,deterministic", help="default, deterministic, fp8, fp8kv, fp8both")
    parser.add_argument("--hf", action="store_true", help="also HF teacher forcing vs the run (real checkpoints)")
    parser.add_argument("--random-weights", metavar="DIR", help="save a random checkpoint of --model's config here and use it")
    parser.add_argument("--num-layers", type=int, help="measure on the first N layers of --model's config")
    parser.add_argument("--final-norm-scale", type=float, default=8.0, help="--random-weights: final norm weight scale")
    args = parser.parse_args()
    if args.num_layers:
        args.model = _sliced_config(args.model, args.num_layers)
    if args.random_weights:
        from random_checkpoint import random_checkpoint  # scripts/, beside this file

        args.model = random_checkpoint(args.model, args.random_weights, args.final_norm_scale, args.seed)
        args.load_format = "auto"
    engine = build_engine(args)
    table = [(mode, *row) for mode in args.modes.split(",")
             for row in (measure_price(args, engine, mode) if mode in VARIANTS
                         else measure(args, engine, mode == "deterministic"))]
    print(f"{'mode':<14} {'comparison':<17} {'identical tokens':>16}  logprob difference")
    for mode, name, same, diff in table:
        print(f"{mode:<14} {name:<17} {same:>16}  {diff}")


if __name__ == "__main__":
    main()
