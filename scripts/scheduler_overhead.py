"""Host time of the scheduler per decode step (schedule + postprocess), no model.

256 requests of 256 prompt tokens are prefilled, then 300 decode steps are timed with a fake
runner that returns one token per request; prints the mean per step.

    python scripts/scheduler_overhead.py
"""

from __future__ import annotations

import random
import time

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.request import Request
from rollout_cli.engine.scheduling.scheduler import Scheduler


def main(batch: int = 256, prompt_len: int = 256, steps: int = 300) -> None:
    params = SamplingParams(max_new_tokens=steps + 100, ignore_eos=True)
    scheduler = Scheduler(num_kv_slots=batch * (prompt_len + steps + 200), max_running=batch,
                          max_batch_tokens=8192, enable_prefix_cache=True)
    rng = random.Random(0)
    for i in range(batch):
        scheduler.add(Request(i, i, 0, [rng.randrange(1000) for _ in range(prompt_len)], params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or scheduler.waiting:
        out = scheduler.schedule()
        sampled = sum(e.sample for e in out.entries)
        scheduler.postprocess(out, [1] * sampled, [0.0] * sampled)
    schedule_s = postprocess_s = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        out = scheduler.schedule()
        middle = time.perf_counter()
        scheduler.postprocess(out, list(range(len(out.entries))), [0.0] * len(out.entries))
        end = time.perf_counter()
        schedule_s += middle - start
        postprocess_s += end - middle
    print(f"batch {len(out.entries)}: schedule {1e3 * schedule_s / steps:.2f} ms + "
          f"postprocess {1e3 * postprocess_s / steps:.2f} ms per decode step")


if __name__ == "__main__":
    main()
