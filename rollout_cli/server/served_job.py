"""A /generate job as the daemon runs it: its handle for the HTTP side, and the engine as run_job sees it.

The worker (server/worker.py) runs a job through run_job with a JobEngine, whose stream gives the worker
a turn between engine steps (commands, pauses) and stops the job's prompts when it is aborted.
"""

from __future__ import annotations

import threading
from typing import Any

from rollout_cli.engine.scheduling.request_maker import sample_slices
from rollout_cli.errors import JobInterrupted


class JobAborted(JobInterrupted):
    """Raised out of a job's trajectory stream after its aborted samples were written."""


class JobHandle:
    """One /generate job as the HTTP side sees it: progress snapshots and the outcome."""

    def __init__(self, job, params):
        self.job = job
        self.params = params
        self.progress: dict[str, Any] = {}
        self.seq = 0  # bumped on every progress change; the HTTP stream polls it
        self.done = threading.Event()
        self.outcome: dict[str, Any] = {}  # {"event": "done"|"aborted"|"error", ...}

    def update(self, progress) -> None:
        self.progress = {
            "prompts_total": progress.prompts_total, "prompts_done": progress.prompts_done,
            "trajectories": progress.trajectories, "output_tokens": progress.output_tokens,
            "output_tokens_per_s": round(progress.output_tokens_per_s, 1),
        }
        self.seq += 1

    def finish(self, **outcome) -> None:
        self.outcome = outcome
        self.done.set()  # before the bump: a reader that sees the new seq sees done
        self.seq += 1



class JobEngine:
    """The engine as run_job sees it, with the worker's control hooks between steps.

    run_job calls only `stream` and reads attributes; everything else passes through.
    After an abort the prompt source stops, the aborted samples are yielded (so run_job writes
    them like any row), and JobAborted ends the job (manifest status `interrupted`).
    """

    def __init__(self, engine, worker):
        self._engine = engine
        self._worker = worker

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def stream(self, prompts, params, skip=frozenset(), on_step=None):
        worker = self._worker

        def source():
            # a prompt of more samples than the loop queues comes in slices (Engine.stream would cut it the
            # same way, after this check): cut here, an abort stops its next slice too. Cut there, the
            # rest of an --n 100000000 prompt ran on, and with stop_requested set no command (abort,
            # shutdown) was answered until it ended
            iterator = iter(prompts)
            while not worker.stop_requested:
                prompt = next(iterator, None)
                if prompt is None:
                    return
                for part in sample_slices((prompt,), params, 2 * self._engine.config.max_running):
                    if worker.stop_requested:
                        return
                    yield part

        def step_hook():
            if on_step is not None:
                on_step()
            worker.between_steps(on_step)

        for trajectory in self._engine.stream(source(), params, skip=skip, on_step=step_hook):
            yield trajectory
            yield from self._drain()
        yield from self._drain()
        if worker.stop_requested:
            raise JobAborted

    def _drain(self):
        while self._worker.aborted_samples:
            yield self._worker.aborted_samples.pop(0)
