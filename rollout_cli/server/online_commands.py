"""The engine worker's commands for online requests (the OpenAI API, server/online.py): accept one,
close a session, and the live engine stream that serves every request in flight.

A part of EngineWorker (server/worker.py), kept in its own file: it runs on the worker thread and uses
the worker's state (`live`, `sessions`, `job`, the pause and abort flags) and its `between_steps`, so
pauses, aborts and weight updates reach online requests as they reach a job.
"""

from __future__ import annotations

import logging
import traceback
from concurrent.futures import Future

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import NO_PROMPT_YET
from rollout_cli.errors import Conflict, RolloutError
from rollout_cli.server.online import OnlineRequest

log = logging.getLogger("rollout.serve")


class OnlineCommands:
    """EngineWorker's online-request commands (a mixin: see the module docstring)."""

    def submit_online(self, request: OnlineRequest) -> Future:
        """Queue an online request; the future answers once the engine thread accepted or refused it."""
        return self.submit("online", request=request)

    def _do_online(self, in_job: bool, request: OnlineRequest) -> dict:
        if self.job is not None:
            raise Conflict(f"a /generate job is running (out {self.job.job.out}); online requests are served "
                           "between jobs: wait for it, or stop it with rollout abort")
        if self._stopping:
            raise Conflict("the engine is shutting down")
        if request.request_id in self.live.by_id:
            raise Conflict(f"request id {request.request_id!r} is already in flight; give each request its own id")
        try:
            self.engine.memory.check_can_generate()
        except RolloutError as err:
            raise Conflict(str(err)) from err
        for index, ids in enumerate(request.prompts):  # refused here, not inside the stream other requests share
            self.engine.requests.check_prompt(index, ids)
        if request.session_id is not None:  # a hybrid model's turn resumes at the previous turn's snapshot
            request.conversation = self.sessions.previous_prompt_len(request.session_id)
        self.sessions.expire(self.engine.scheduler)
        self.live.add(request)  # paused: it waits for rollout continue
        return {"success": True}

    def _do_close_session(self, in_job: bool, session_id: str) -> dict:
        stats = self.sessions.close(self.engine.scheduler, session_id)
        if stats is None:
            raise RolloutError(f"no open session {session_id!r} (closed, expired after "
                               f"{self.sessions.retention_seconds:g} s, or never opened)")
        return {"success": True, **stats}

    def _session_turn(self, request: OnlineRequest, choice) -> dict:
        """A session's turn finished: the KV its next turn starts from stays pinned (engine/scheduling/sessions.py)."""
        prompt = request.prompts[choice.prompt]
        images = request.images[choice.prompt] if request.images else ()
        # pinned by its cache key: an image's placeholder tokens are cached under its pixels' digest
        return self.sessions.turn_finished(self.engine.scheduler, request.session_id,
                                           self.engine.cache_key(prompt, images), choice.token_ids,
                                           choice.cached_prompt_tokens)

    # ---- online requests (server/online.py) --------------------------------------------

    def _run_live(self) -> None:
        """Serve the online requests in flight with one engine stream; it ends when none is left (or
        on an abort), and the next request starts another."""
        engine, live = self.engine, self.live
        with self._lock:
            self._live_running = True
        self.stop_requested = False

        def source():
            while not self.stop_requested:
                prompt = live.next_prompt()
                if prompt is not None:
                    yield prompt
                elif engine.scheduler.has_work():
                    yield NO_PROMPT_YET
                else:
                    return

        def step_hook():
            live.after_step(engine.scheduler.running)
            self.between_steps(None)

        try:
            # each prompt carries its request's sampling settings; the stream's own are never used
            for trajectory in engine.stream(source(), SamplingParams(), on_step=step_hook):
                live.finish(trajectory)
            if not live.inbox and len(live):  # never expected: no caller may wait forever
                live.fail_all("internal error: the engine stream ended before every request finished")
        except RolloutError as err:
            live.fail_all(str(err))
        except Exception as err:  # noqa: BLE001 - the daemon keeps serving; the callers get the reason
            log.error("online requests failed:\n%s", traceback.format_exc())
            live.fail_all(f"internal error: {type(err).__name__}: {err}")
        finally:
            self.stop_requested = False
            self._answer_finishing()
            with self._lock:
                self._live_running = False
