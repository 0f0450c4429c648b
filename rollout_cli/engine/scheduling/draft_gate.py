"""When drafts pay: the speculation gate (issue 22: speculation "must turn itself down when the batch is
compute-bound").

A decode step with drafts verifies 1 + d tokens per request in one forward. At a small batch that
forward costs about what a one-token step costs (the weights are read once either way), so every
accepted draft is a token for free. At a large batch the step is compute- or attention-bound: it costs
up to 1 + d times more, it runs eagerly or on wider graphs, and it cannot be overlapped with the next
step's planning; then drafting loses. Measured on an H100 (docs/benchmarks.md, session 27), sibling
drafts on the GRPO workload (256 running requests, 2.01 tokens per verifying step) ran at 0.43x the
output tok/s of plain decoding.

Where the crossover lies depends on the model, the GPU, the context lengths and how well the drafts
are accepted, so the gate measures instead of guessing: per batch-size bucket it keeps the wall time of
plain decode steps and of drafting steps and the tokens a request gained per step in each, and drafts
only where drafting steps gain more tokens per request per second. An unmeasured option is tried first;
the losing one is re-tried now and then (after 16 steps of the bucket, doubling up to 1,024 while it
keeps losing), since acceptance changes over a run (sibling drafts grow better as samples finish). A
re-try runs the loser for 3 steps and drops the first: a step that follows the other option's is a
transition (a plain step behind a drafting one cannot be planned ahead of it; on an H100 such lone
plain steps averaged 8.9 ms against 1.75 ms a step in the plain run, docs/benchmarks.md session 39,
keeping plain the loser for the rest of the run). The next replaces the loser's stale figures, the third
is averaged in; if that makes it the winner on lucky steps, the steps that follow average it back down
and hand the lead back. A step counts at most OUTLIER times its option's average: a step where a wave of
requests finishes (hundreds of trajectories built in one post-processing) or the collector runs costs the
same whichever option runs, and one such step made plain look 4x slower than its steps are (an H100's
siblings run at 216+ running, docs/benchmarks.md session 40); a lasting change still moves the average,
by up to SMOOTHING x (OUTLIER - 1) a step.

Which steps draft never changes a token (engine/scheduling/speculation.py): the gate only moves speed.
Pure bookkeeping, no clock of its own: the step loop reports each decode step's wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SMOOTHING = 0.3  # weight of a new step in the running averages: a few steps follow a change, one stall does not
FIRST_RETRY = 16  # steps of a bucket before its losing option is tried again
LAST_RETRY = 1024  # the longest wait between re-tries (the interval doubles while the loser keeps losing)
RETRY_STEPS = 3  # steps of one re-try; its first, a transition from the other option, is not kept
OUTLIER = 2.0  # a kept step counts at most this many times its option's average


def batch_bucket(batch: int) -> int:
    """Buckets of batch size a factor of about sqrt(2) wide (1, 2, 3, 4-5, 6-8, 9-11, 12-16, ...): step
    times within one are alike, and a run visits few."""
    return round(2 * math.log2(max(batch, 1)))


@dataclass
class StepAverage:
    """Running averages of one option's decode steps in one bucket."""

    steps: int = 0  # steps reported; the first is a warm-up (kernels compiled, graphs cold) and not kept
    seconds: float = 0.0  # a step's wall time
    tokens_per_request: float = 0.0  # tokens a running request gained in a step (1 + accepted drafts)

    @property
    def measured(self) -> bool:
        return self.steps > 1

    def add(self, seconds: float, tokens_per_request: float, fresh: bool = False) -> None:
        """One step's figures; `fresh`: they replace the averages (a re-try of the losing option, whose
        averages are as old as its last re-try)."""
        self.steps += 1
        if self.steps == 1:
            return
        weight = 1.0 if self.steps == 2 or fresh else SMOOTHING
        if weight < 1.0:  # a lone slow step (a wave of finishes, a collection) moves the average a bounded step
            seconds = min(seconds, OUTLIER * self.seconds)
        self.seconds += weight * (seconds - self.seconds)
        self.tokens_per_request += weight * (tokens_per_request - self.tokens_per_request)

    @property
    def rate(self) -> float:
        """Tokens per running request per second."""
        return self.tokens_per_request / self.seconds if self.seconds > 0 else math.inf


@dataclass
class BucketState:
    plain: StepAverage = field(default_factory=StepAverage)
    drafting: StepAverage = field(default_factory=StepAverage)
    retry_interval: int = FIRST_RETRY
    steps_to_retry: int = FIRST_RETRY
    retrying: bool | None = None  # during a re-try, the option re-tried (True: drafting), else None
    retry_steps: int = 0  # steps of the re-try run so far

    def winner_drafts(self) -> bool:
        return self.drafting.rate > self.plain.rate


class DraftGate:
    """Decides, per decode step, whether drafts pay at the current batch size (see the module doc)."""

    def __init__(self):
        self.buckets: dict[int, BucketState] = {}

    def _bucket(self, batch: int) -> BucketState:
        return self.buckets.setdefault(batch_bucket(batch), BucketState())

    def should_draft(self, batch: int) -> bool:
        """Whether a decode step of `batch` running requests should carry drafts. Depends only on what was
        reported so far, so asking twice before the next report gives the same answer."""
        state = self._bucket(batch)
        if not state.plain.measured:
            return False
        if not state.drafting.measured:
            return True
        return state.retrying if state.retrying is not None else state.winner_drafts()

    def busiest(self) -> dict | None:
        """What the gate measured in the bucket with the most decode steps (`rollout bench` shows it):
        the smallest batch of the bucket, each option's steps, step time (ms) and tokens per request, as
        the running averages stand now. None before any step."""
        if not self.buckets:
            return None
        bucket, state = max(self.buckets.items(), key=lambda kv: kv[1].plain.steps + kv[1].drafting.steps)
        batch = next(b for b in range(1, 1 << 20) if batch_bucket(b) == bucket)
        return {"batch": batch, **{f"{name}_{key}": value for name, option in
                                   (("plain", state.plain), ("drafting", state.drafting))
                                   for key, value in (("steps", option.steps), ("ms", 1e3 * option.seconds),
                                                      ("tokens", option.tokens_per_request))}}

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step of `batch` requests ran (with drafts or not), appended `tokens` tokens in all and
        took `seconds` of wall time."""
        if batch < 1 or seconds <= 0:
            return
        state = self._bucket(batch)
        option = state.drafting if drafted else state.plain
        if state.retrying is None or drafted != state.retrying:
            counts = state.plain.measured and state.drafting.measured and state.retrying is None
            option.add(seconds, tokens / batch)
            if counts:  # a step of the winner, both options measured: towards the next re-try
                state.steps_to_retry -= 1
                if state.steps_to_retry <= 0:
                    state.retrying, state.retry_steps = not state.winner_drafts(), 0
            return
        state.retry_steps += 1
        if state.retry_steps > 1:  # the first is a transition step, not kept
            option.add(seconds, tokens / batch, fresh=state.retry_steps == 2)
        if state.retry_steps == RETRY_STEPS:  # wait longer if the loser lost again, else start over
            still_losing = state.winner_drafts() != drafted
            state.retry_interval = min(2 * state.retry_interval, LAST_RETRY) if still_losing else FIRST_RETRY
            state.steps_to_retry, state.retrying = state.retry_interval, None
