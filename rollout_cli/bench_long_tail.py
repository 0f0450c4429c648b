"""`rollout bench --carry-over ROUNDS`: the long tail of a rollout, and what carrying it over gains.

RL rollouts are long-tailed: most samples stop early, a few run to the maximum, and the last ones keep
the GPU at a small batch for a large share of the time (Seer: the last 10% of requests can take half
of a rollout). APRIL (slime) and AReaL stop a round once enough samples finished and carry the
unfinished ones over to the next round, where they continue beside the new prompts.

Both strategies run here on one engine, on the same rounds of the workload (round r: the workload's
prompts, prompt indices shifted by r so each round samples afresh):
  - wait: every round runs until all its samples finished (the offline loop's round);
  - carry: a round stops once `carry_at` of the samples it started finished; its running samples are
    aborted with their tokens so far (engine.control.abort) and continue in the next round from there
    (PartialSample: same random stream, so the same tokens), and prompts never started move too.
Reported per strategy: seconds, output tokens, output tokens/s, and for wait each round's time to
`carry_at` of its samples against its whole time (the tail's share). The gain is carry's tokens/s over
wait's. Samples still unfinished after carry's last round are not counted: their tokens are.
"""

from __future__ import annotations

import math
import time

from rollout_cli.engine.memory.memory_saver import sync_device
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import PartialSample, PromptInput


def _round_inputs(workload, cfg, round_index: int) -> list[PromptInput]:
    offset = round_index * len(workload.prompts)
    return [PromptInput(offset + i, prompt, params=SamplingParams(n=cfg.n, max_new_tokens=out_len,
                                                                  temperature=cfg.temperature, seed=cfg.seed,
                                                                  ignore_eos=True))
            for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens))]


def run_round(engine, items: list, share: float, stop_at_share: bool) -> dict:
    """One round over `items` (prompts and carried samples), until every sample finished, or with
    `stop_at_share` until `share` of them did. -> seconds, output tokens, the time to `share` of the
    samples, and what is left over: aborted samples (PartialSample) and prompts never started."""
    samples = sum(item.params.n if isinstance(item, PromptInput) else 1 for item in items)
    # a carried sample's trajectory holds its whole response: count only what this round added
    before = {(i.prompt_index, i.sample_index): len(i.response_token_ids) for i in items if isinstance(i, PartialSample)}
    target = max(1, math.ceil(samples * share))
    pending = list(reversed(items))
    stop = False
    finished = 0
    aborted: list = []
    start = time.monotonic()
    reached = None
    out_tokens = 0

    def source():
        while pending and not stop:
            yield pending.pop()

    def on_step():
        nonlocal stop
        if stop_at_share and finished >= target and not stop:
            stop = True
            aborted.extend(engine.control.abort())

    for trajectory in engine.stream(source(), SamplingParams(), on_step=on_step):
        finished += 1
        out_tokens += _added(trajectory, before)
        if reached is None and finished >= target:
            reached = time.monotonic() - start
    sync_device(engine.device)
    seconds = time.monotonic() - start
    # an aborted sample's tokens so far were generated in this round: it continues from them
    carried = [PartialSample.of(t, t.passthrough.get("_params")) for t in aborted]
    out_tokens += sum(_added(t, before) for t in aborted)
    return {"seconds": seconds, "output_tokens": out_tokens, "time_to_share_s": reached,
            "carried": carried, "not_started": list(reversed(pending))}


def _added(trajectory, before: dict) -> int:
    return len(trajectory.response_token_ids) - before.get((trajectory.prompt_index, trajectory.sample_index), 0)


def compare_carry_over(engine, workload, cfg, rounds: int, carry_at: float) -> dict:
    """wait vs carry over `rounds` rounds of the workload on one engine (see the module docstring)."""
    report = {"rounds": rounds, "carry_at": carry_at}
    for strategy in ("wait", "carry"):
        if engine.scheduler.cache is not None:
            engine.scheduler.flush_cache()  # each strategy starts cold
        leftover: list = []
        seconds = tokens = 0.0
        shares = []
        for r in range(rounds):
            items = leftover + _with_params(_round_inputs(workload, cfg, r))
            result = run_round(engine, items, carry_at, stop_at_share=strategy == "carry")
            seconds += result["seconds"]
            tokens += result["output_tokens"]
            if strategy == "wait":
                shares.append({"seconds": result["seconds"], "time_to_share_s": result["time_to_share_s"]})
            leftover = result["carried"] + result["not_started"]
        entry = {"seconds": seconds, "output_tokens": int(tokens), "output_tokens_per_s": tokens / seconds}
        if strategy == "wait":
            entry["rounds"] = shares
            entry["tail_share_of_time"] = 1 - sum(s["time_to_share_s"] for s in shares) / seconds
        else:
            entry["unfinished_after_last_round"] = len(leftover)
        report[strategy] = entry
    report["throughput_gain"] = report["carry"]["output_tokens_per_s"] / report["wait"]["output_tokens_per_s"] - 1
    return report


def _with_params(inputs: list[PromptInput]) -> list[PromptInput]:
    """Each prompt's settings also ride in its passthrough, so a sample aborted mid-round continues
    with them (a PartialSample carries the settings it is given)."""
    return [PromptInput(p.prompt_index, p.prompt_token_ids, {"_params": p.params}, p.params) for p in inputs]
