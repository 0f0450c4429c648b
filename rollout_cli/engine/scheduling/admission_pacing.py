"""When waiting requests join a batch of graph-replayed decode steps: at once, or some steps later together.

Only decode-only steps replay CUDA graphs; a step that carries a prefill runs eagerly, longer than a
replayed one by `cost` decode steps: about 2 on the Qwen3-0.6B shape (H100, 256 rows: such steps averaged
28.1 ms in a sibling-draft run, some verifying drafts, against 8.5 ms replayed), about 25 on the 59M-parameter
hybrid of issue 22 (18.5 ms against 0.73 ms: its eager steps are the host's kernel launches). Where requests
finish at staggered steps (sibling drafts accepted unevenly, episode turns, eos), admitting each waiting
request the step a seat frees makes nearly every step an eager one: session 28 measured 940 such steps in a
sibling-draft run and 1,081 in 256 ten-turn episodes.

Holding waiting requests back costs the seats left empty instead: a decode step of `running` rows makes
`running` tokens, so each empty seat forgoes 1 / running of a step's work. The rule is the ski-rental
one: admit once the seats left empty since the last admission have forgone `cost` steps of work.
Then the eager step is paid at most once per that much empty-seat work, and the empty seats never cost
more than an eager step per admission: within twice the cost of the best moment to admit, whatever the
pattern of finishes. A wave of finishes (most of the batch at once) is admitted at once: its empty seats
forgo that much within a step. And no request waits more than `max_wait_steps` steps for a free seat
(MAX_WAIT_STEPS, or 16 eager steps' worth where those cost more: one seat free in a full batch of 256 would
otherwise wait 512 steps, seconds of time to first token for a request of the daemon's online API).

`cost` comes from the engine: DecodeGraphs times one decode step of its largest bucket run eagerly and
replayed when it captures, and eager_step_cost rounds the ratio to a coarse rung. The rule itself counts
seats and steps, not wall time, so a rerun of the same command schedules the same steps (in bf16 the batch a
row runs in changes its rounding: timing-driven admission would make reruns differ); only a measurement
that lands on another rung (a ratio near a rung's edge) changes the pacing between runs.
It holds nothing while decode steps run eagerly (the CPU, --no-cuda-graphs, batches past the largest
graph): there every step costs the same and waiting only leaves seats empty.
"""

from __future__ import annotations

import math

# an admitting (eager) step's time beyond a replayed decode step's, in decode steps, until the engine measured
# its own (eager_step_cost): 2.3 measured on the 0.6B shape; larger models spend longer in each replayed step
# for the same launches, so less; small ones far more (a 59M-parameter hybrid: 25 on the H100, session 36)
EAGER_STEP_COST = 2.0
MAX_WAIT_STEPS = 32  # at most this many decode steps with a free seat and a waiting request before admitting
# ... or the decode steps worth this many eager steps, where eager steps cost more than EAGER_STEP_COST: in
# wall time the longest wait stays about 16 eager steps whatever the model
MAX_WAIT_EAGER_STEPS = 16
COST_RUNGS = (2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)


def eager_step_cost(eager_over_replay: float) -> float:
    """A decode step's time run eagerly over its time replayed from a CUDA graph (DecodeGraphs measures both
    once, at capture) -> the eager step's extra cost in decode steps, on a coarse ladder of rungs (nearest in
    log): two measurements on one machine land on the same rung, so reruns pace alike, and the rule's
    factor-of-two guarantee needs no finer figure."""
    extra = max(eager_over_replay - 1.0, 1e-3)
    return min(COST_RUNGS, key=lambda rung: abs(math.log(rung / extra)))


class AdmissionPacing:
    """Empty seats since the last admission, and whether decode steps replay graphs (engine thread only)."""

    def __init__(self, enabled: bool = True, cost: float = EAGER_STEP_COST):
        self.enabled = enabled
        self.set_cost(cost)
        self.replaying = False  # the last decode-only step replayed a CUDA graph
        self.forgone_steps = 0.0  # decode work the empty seats forwent since the last admission, in steps
        self.waited_steps = 0  # steps since the last admission that left a free seat to a waiting request

    def set_cost(self, cost: float) -> None:
        """An eager step's extra cost in decode steps."""
        self.cost = cost
        self.max_wait_steps = max(MAX_WAIT_STEPS, round(MAX_WAIT_EAGER_STEPS * cost))

    def price_eager_steps(self, eager_over_replay: float) -> None:
        """The engine's measurement at graph capture (a decode step's eager time over its replayed time)."""
        self.set_cost(eager_step_cost(eager_over_replay))

    def due(self, running: int = 0, empty_seats: int = 0) -> bool:
        """Whether waiting requests may be admitted into the next step now; with `running` / `empty_seats`:
        as step_done of the step in flight would leave it (overlap scheduling plans the next step before the
        one in flight is reported, and must decide as one-step-at-a-time scheduling would)."""
        forgone = self.forgone_steps + (empty_seats / max(running, 1) if empty_seats else 0.0)
        waited = self.waited_steps + (1 if empty_seats else 0)
        return not (self.enabled and self.replaying) or forgone >= self.cost or waited >= self.max_wait_steps

    def admitted(self) -> None:
        self.forgone_steps = 0.0
        self.waited_steps = 0

    def step_done(self, decode_only: bool, graph_step: bool, running: int, empty_seats: int) -> None:
        """A post-processed step: whether it only decoded and whether it replayed a graph, the requests
        running after it, and the seats left empty while requests waited (each forgoes a token of the next
        step's `running`)."""
        if decode_only:
            self.replaying = graph_step
        if empty_seats:
            self.forgone_steps += empty_seats / max(running, 1)
            self.waited_steps += 1


class PacedAdmission:
    """The Scheduler's side of admission pacing (a mixin, as OverlapScheduling: it reads the scheduler's
    waiting and running requests, max_running, `pacing` (an AdmissionPacing) and stats)."""

    def holds_admission(self, running: int, ahead: bool = False) -> bool:
        """Whether the next decode-only step (of `running` requests) leaves the waiting requests out though a
        seat is free: until the empty seats have cost as much as the eager step that admits them. `ahead`:
        planned before the step in flight is reported (its empty seats counted as its report will)."""
        empty = self._empty_seats(running) if ahead else 0
        if not self.waiting or running >= self.max_running or self.pacing.due(running, empty):
            return False
        self.stats.admission_held_steps += 1
        return True

    def report_step(self, out, graph_step: bool) -> None:
        """The step loop's report of a post-processed step `out` (whether it replayed a CUDA graph: such a
        step only decodes, so its entries need no reading)."""
        decode_only = graph_step or all(e.start >= e.request.num_prompt_tokens for e in out.entries)
        if decode_only:
            self.reserve.decode_step_done()  # the room kept since a preemption shrinks (decode_reserve.py)
        self.pacing.step_done(decode_only, graph_step, len(self.running), self._empty_seats(len(self.running)))

    def _empty_seats(self, running: int) -> int:
        """Seats a step of `running` requests leaves free while requests wait for one."""
        return min(self.max_running - running, len(self.waiting))
