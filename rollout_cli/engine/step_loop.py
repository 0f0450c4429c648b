"""The engine's step loop: schedule, launch, post-process, until the prompts and the work run out.

With overlap (the default), while a decode step runs on the GPU the next one is scheduled ahead of its
results (Scheduler.schedule_ahead, engine/scheduling/overlap_schedule.py: its input tokens are PENDING, read
on the device from the token table the step before writes) and launched behind it; then the running step's
results are post-processed. Without overlap: schedule, launch, post-process. Between steps `on_step` (the caller's hook: the daemon's
commands, shard flushes) runs; under a pause that may change the weights (`engine.hold_requested`) the
loop finishes its step in flight and calls the hook again with none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from rollout_cli.engine.trajectory import NO_PROMPT_YET


class StepLoop:
    """One stream's loop over engine steps (Engine.stream and Engine.score run one each)."""

    def __init__(self, engine, add: Callable, on_step: Callable[[], None] | None):
        self.engine = engine
        self.add = add  # queues one prompt (or sample to score) as requests
        self.on_step = on_step
        self.last_step_done = 0.0  # perf_counter at the last post-process: steps' wall time is split there

    def run(self, prompts) -> Iterator:
        """The step loop. With overlap (the default), while a decode step runs on the GPU the next one
        is scheduled ahead of its results (Scheduler.schedule_ahead) and launched behind it; then the
        running step's results are post-processed. Otherwise: schedule, launch, post-process."""
        engine, on_step = self.engine, self.on_step
        source = iter(prompts)
        self.exhausted = False  # the prompt source ran out
        scheduler, runner = engine.scheduler, engine.runner
        inflight = None  # the launched step not yet post-processed (a model_runner.StepHandle)
        self.last_step_done = time.perf_counter()
        try:
            while True:
                self._fill_queue(source)
                ahead = None
                if inflight is not None and engine.config.overlap_schedule:
                    ahead = scheduler.schedule_ahead(inflight.out)
                if ahead is not None:  # launched behind the step in flight, which is post-processed meanwhile
                    previous, inflight = inflight, runner.launch(ahead)
                    yield from self._complete(previous)
                elif inflight is not None:  # the next step is planned on the post-processed state
                    previous, inflight = inflight, None
                    yield from self._complete(previous)
                    continue
                elif not scheduler.has_work():
                    flushed = engine.results_of(engine.routing.flush())
                    if not flushed:
                        return
                    # samples whose routing was on its way: the caller may answer them with more prompts
                    # (an episode's next turn), so the source is asked again before the loop ends
                    yield from flushed
                    continue
                else:
                    planned_at = time.perf_counter()
                    out = scheduler.schedule()
                    if not out:
                        if scheduler.admit_new or scheduler.running or on_step is None:
                            raise RuntimeError("scheduler produced an empty step with work pending")
                        on_step()  # admission closed (pause finish) and the running samples done: hold
                        continue
                    inflight = runner.launch(out)
                    # the step's wall time counts its planning: the drafts proposed there are the host's
                    # share of a drafting step, which the speculation gate must weigh (a step planned
                    # ahead was planned while the one before ran: hidden)
                    inflight.launch_time = planned_at
                if on_step is not None:
                    engine.step_in_flight = True
                    on_step()
                    engine.step_in_flight = False
                    if engine.hold_requested:
                        # a pause that may change the weights wants no step on the device: finish this
                        # one, then call again with nothing in flight (the caller holds there)
                        previous, inflight = inflight, None
                        yield from self._complete(previous)
                        on_step()
        except Exception:
            # finished samples whose routing is still on its way: hand them out before the error
            # (best effort: a device error fails the copies too, and --resume redoes them)
            try:
                pending = engine.results_of(engine.routing.flush())
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pending = []
            yield from pending
            raise
        finally:
            engine.routing.drop_pending()  # an abandoned stream's requests (slots ahead included): abort_all
            if inflight is not None:  # an abandoned or failed job: let its last step finish on the device
                runner.collect(inflight)

    def _fill_queue(self, source) -> None:
        """Queue prompts until enough wait to fill the batch (2 x max_running), the source runs out, or a
        live source has none yet (NO_PROMPT_YET: more may come at a later step)."""
        scheduler = self.engine.scheduler
        while not self.exhausted and len(scheduler.waiting) < 2 * self.engine.config.max_running:
            prompt = next(source, None)
            if prompt is None:
                self.exhausted = True
            if prompt is None or prompt is NO_PROMPT_YET:
                return
            self.add(prompt)

    def _complete(self, handle) -> list:
        """Post-process a launched step (waiting for its results); returns the trajectories it finished."""
        engine = self.engine
        tokens, logprobs = engine.runner.collect(handle)
        accepted_before = engine.scheduler.stats.accepted_draft_tokens
        # no update runs while a step is in flight (it needs no running request): the step's version is the current one
        finished = engine.scheduler.postprocess(handle.out, tokens, logprobs, handle.scores, handle.score_tops,
                                                engine.weight_version, handle.sample_extras)
        scheduler = engine.scheduler  # --speculative mtp: the head's pass
        # (no drafts to read where the next verify step was planned ahead: the device drafts its inputs)
        propose = scheduler.drafting_now() and not scheduler.verify_ahead_in_flight
        engine.runner.draft_after_step(handle.out, scheduler.drafter is not None, propose)
        now = time.perf_counter()
        wall = now - max(handle.launch_time, self.last_step_done)  # the step's share of wall time
        self.last_step_done = now
        scheduler.report_decode_step(handle.out, scheduler.stats.accepted_draft_tokens - accepted_before, wall)
        scheduler.report_step(handle.out, handle.graph_step)
        traffic = engine.runner.traffic
        if handle.timing is not None:
            traffic.wall_seconds += wall
        elif handle.prefilled:
            traffic.prefill_steps += 1
            traffic.prefill_wall_seconds += wall
            traffic.prefill_max_seconds = max(traffic.prefill_max_seconds, wall)
        # Finished requests' routing is gathered before a later step can reuse their slots (the step
        # in flight writes only slots it was given); with capture on they come back one call later.
        return engine.results_of(engine.routing.finish(finished))
