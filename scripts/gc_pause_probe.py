"""How much the cyclic garbage collector stops the engine loop, with and without
rollout_cli.process_gc.freeze_long_lived_objects (each variant in a fresh process: freezing is global).

    .venv/bin/python scripts/gc_pause_probe.py [--model recipes/example_model] [--device cpu]

Prints, per variant: the run's wall time, the collections by generation (count, ms) and the mean
time of Scheduler.schedule_ahead per call (where a collection triggered by the step's allocations
is usually paid).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time


def probe(model: str, device: str, freeze: bool) -> dict:
    from rollout_cli import Engine, SamplingParams
    from rollout_cli.engine.engine import PromptInput
    from rollout_cli.engine.scheduling import overlap_schedule
    from rollout_cli.process_gc import freeze_long_lived_objects

    engine = Engine(model, device=device, max_model_len=512, max_running=256, kv_cache_tokens=256 * 200)
    vocab = engine.hf_config.vocab_size
    rng = random.Random(0)
    prompts = [PromptInput(i, [rng.randrange(vocab) for _ in range(32)]) for i in range(256)]
    params = SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True)
    list(engine.stream(prompts[:8], params))  # warm-up
    if freeze:
        freeze_long_lived_objects()
    timed = {"seconds": 0.0, "calls": 0}
    plain = overlap_schedule.OverlapScheduling.schedule_ahead

    def schedule_ahead(self, prev):
        start = time.perf_counter()
        try:
            return plain(self, prev)
        finally:
            timed["seconds"] += time.perf_counter() - start
            timed["calls"] += 1

    overlap_schedule.OverlapScheduling.schedule_ahead = schedule_ahead
    pauses = {g: [0, 0.0] for g in range(3)}
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        else:
            pauses[info["generation"]][0] += 1
            pauses[info["generation"]][1] += 1e3 * (time.perf_counter() - started[info["generation"]])

    gc.callbacks.append(on_gc)
    start = time.perf_counter()
    list(engine.stream(prompts, params))
    wall = time.perf_counter() - start
    gc.callbacks.remove(on_gc)
    return {"freeze": freeze, "wall_s": round(wall, 3),
            "collections": {f"gen{g}": {"count": c, "ms": round(ms, 1)} for g, (c, ms) in pauses.items()},
            "schedule_ahead_ms": round(1e3 * timed["seconds"] / max(timed["calls"], 1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="recipes/example_model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variant", choices=["plain", "freeze"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(probe(args.model, args.device, args.variant == "freeze")))
        return
    for variant in ("plain", "freeze", "plain", "freeze"):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--device", args.device,
                              "--variant", variant], capture_output=True, text=True, check=True)
        print(variant, out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
