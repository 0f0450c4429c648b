"""The daemon's engine thread: it alone builds, steps and changes the Engine.

HTTP handlers never touch the engine. They put a Command on `commands` and wait on its
Future; the worker takes commands while idle, and between engine steps while a job runs
(through the job's on_step hook). Status is answered from `snapshot()`, plain values the
worker publishes under a lock, so `rollout status` never waits behind a step.

Online requests (the OpenAI API, server/online.py) are served by a live engine stream the worker
runs while any is in flight; pauses, aborts and weight updates reach it between steps as they reach a
job. A /generate job and online requests do not run at the same time: each is refused while the other runs.

The commands for online requests and for weight updates are in online_commands.py and
weight_commands.py, parts of EngineWorker.

Every operation on the engine goes through its control API (`engine.control`, engine/control.py),
as the CLI's and the Python Engine's do. Under `serve --tp N` this is rank 0: its engine's steps,
weight updates and memory releases reach the other ranks through that API; at shutdown it
releases them.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rollout_cli.engine.engine import Engine
from rollout_cli.engine.scheduling.sessions import DEFAULT_RETENTION_SECONDS, Sessions
from rollout_cli.errors import Conflict, RolloutError
from rollout_cli.io.output_dir import read_manifest
from rollout_cli.job import run_job
from rollout_cli.peer_failure import PeerFailed, a_peer_failed, caused_by_peer
from rollout_cli.process_gc import freeze_long_lived_objects
from rollout_cli.server.online import LiveRequests
from rollout_cli.server.online_commands import OnlineCommands
from rollout_cli.server.served_job import JobAborted, JobEngine, JobHandle
from rollout_cli.server.weight_commands import WeightCommands

log = logging.getLogger("rollout.serve")

# abort: end the job; wait: hold it between steps, its requests and KV kept, weight updates refused
# (one version per job); keep: hold it with nothing on the device and accept weight updates, after
# which its running samples recompute their KV on the new weights and go on (per-token versions);
# finish: start no new sample, let the running ones finish (the pause answers then), then hold and
# accept weight updates (every sample still comes from one version)
PAUSE_MODES = ("abort", "wait", "keep", "finish")
SESSION_SWEEP_SECONDS = 1.0  # how often an idle worker looks for sessions past their retention time

@dataclass
class Command:
    name: str
    args: dict[str, Any] = field(default_factory=dict)
    future: Future = field(default_factory=Future)


class EngineWorker(OnlineCommands, WeightCommands, threading.Thread):
    def __init__(self, engine_config, weights_path: str, session_retention_seconds: float = DEFAULT_RETENTION_SECONDS):
        super().__init__(name="engine", daemon=True)
        self.engine_config = engine_config
        self.commands: queue.Queue[Command] = queue.Queue()
        self.engine = None
        self.load_error: str | None = None
        self.load_error_told = False  # another rank's failure, which that rank prints (peer_failure)
        self.ready = threading.Event()  # set when the engine loaded, or failed to
        self._lock = threading.Lock()
        self._info: dict[str, Any] = {"model": engine_config.model, "weights_path": weights_path,
                                      "weight_version": engine_config.weight_version, "state": "loading",
                                      "memory": {}, "job": None,
                                      "tensor_parallel": engine_config.tensor_parallel_size}
        self.job: JobHandle | None = None  # set under _lock by submit_job, cleared by the worker
        self.pause_mode: str | None = None  # the current pause's mode (PAUSE_MODES); None: not paused
        self._finishing: Command | None = None  # a pause finish answered once the running samples finished
        self._stopping = False
        self.stop_requested = False  # the running job must end after its in-flight samples are written
        self.aborted_samples: list = []  # trajectories finished with "abort", not yet yielded to the writer
        self._abort_reason = "abort"  # or "shutdown": unfinished samples are dropped for --resume
        self.sessions = Sessions(session_retention_seconds)  # multi-turn conversations' pinned KV (engine thread)
        self.live = LiveRequests(self._session_turn)  # online requests in flight (engine thread)
        self._live_running = False  # the live stream runs (set under _lock: a job is refused meanwhile)

    @property
    def paused(self) -> bool:
        return self.pause_mode is not None

    # ---- HTTP side (any thread) ------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            info = dict(self._info)
            job = self.job
        if job is not None:
            info["job"] = {"data": job.job.data, "out": job.job.out, **job.progress}
        info["online_requests"] = len(self.live)
        info["sessions"] = len(self.sessions)
        return info

    def submit(self, name: str, **args) -> Future:
        command = Command(name, args)
        self.commands.put(command)
        return command.future

    def submit_job(self, job, params) -> JobHandle:
        with self._lock:
            if self.load_error is not None:
                raise Conflict(f"the engine failed to load: {self.load_error}")
            if self._stopping:
                raise Conflict("the engine is shutting down")
            if self.job is not None:
                p = self.job.progress
                raise Conflict(
                    f"a job is already running (out {self.job.job.out}, prompts "
                    f"{p.get('prompts_done', 0)}/{p.get('prompts_total', '?')}); the engine runs one job at a time: "
                    "wait for it, or stop it with rollout abort"
                )
            if self.paused:
                raise Conflict("generation is paused; resume it with rollout continue")
            if self._live_running or len(self.live):
                raise Conflict(f"{len(self.live)} online requests are in flight; a /generate job runs once "
                               "they finish (or abort them with rollout abort)")
            if self.engine is not None:
                try:
                    self.engine.memory.check_can_generate()
                except RolloutError as err:
                    raise Conflict(str(err)) from err
            handle = self.job = JobHandle(job, params)
        self.commands.put(Command("generate", {"handle": handle}))
        return handle

    # ---- worker thread -----------------------------------------------------------

    def run(self) -> None:
        try:
            self._load()
        except BaseException as err:  # noqa: BLE001 - reported to the daemon, which exits
            # serve --tp: gloo's "connection closed" here means a follower failed to load; its line is the error
            err = caused_by_peer(err)
            self.load_error_told = isinstance(err, PeerFailed)
            self.load_error = str(err) if isinstance(err, RolloutError) else f"{type(err).__name__}: {err}"
            if not isinstance(err, RolloutError):
                log.error("engine failed to load:\n%s", traceback.format_exc())
            self._publish(state="failed")
            self.ready.set()
            self._drain_failed()
            return
        self.ready.set()
        try:
            while not self._stopping:
                if self.live.inbox and not self.paused:
                    self._run_live()
                    continue
                try:  # idle: wake now and then to end sessions past their retention time
                    command = self.commands.get(timeout=SESSION_SWEEP_SECONDS if len(self.sessions) else None)
                except queue.Empty:
                    self.sessions.expire(self.engine.scheduler)
                    continue
                self._handle(command, in_job=False)
        finally:
            self.live.fail_all("the engine is shutting down")
            if not a_peer_failed():  # else (--tp) the failed rank is gone and the others leave on its claim
                self.engine.control.close()  # this rank's weight update groups; --tp: the other ranks exit
        self._drain_failed()

    def _load(self) -> None:
        self.engine = Engine(self.engine_config)
        self.sessions.fit_pool(self.engine.num_kv_slots)
        freeze_long_lived_objects()
        self.control = self.engine.control
        self._publish(state="paused" if self.paused else "serving", memory=self.control.memory_held(),
                      weight_version=self.engine.weight_version)

    def _drain_failed(self) -> None:
        """Answer whatever is still queued once the worker no longer runs commands."""
        reason = f"the engine failed to load: {self.load_error}" if self.load_error else "the engine is shutting down"
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if command.name == "generate":
                command.args["handle"].finish(event="error", message=reason)
            elif command.name == "online":
                command.args["request"].fail(reason)
                command.future.set_exception(Conflict(reason))
            elif command.name == "shutdown":
                command.future.set_result({"success": True})
            else:
                command.future.set_exception(Conflict(reason))

    def _publish(self, **values) -> None:
        with self._lock:
            self._info.update(values)

    def _handle(self, command: Command, in_job: bool) -> None:
        if command.name == "generate":
            if in_job:  # submit_job refuses a job while online requests run; this closes the race
                command.args["handle"].finish(event="error", message="online requests are in flight; retry the job "
                                              "once they finish")
                with self._lock:
                    self.job = None
                return
            self._run_job(command.args["handle"])
            return
        if command.name == "pause" and command.args.get("mode") == "finish" and in_job \
                and self.engine.scheduler.running and self._finishing is None:
            self._do_pause(in_job, "finish")
            self._finishing = command  # answered by between_steps once the running samples finished
            return
        try:
            result = getattr(self, f"_do_{command.name}")(in_job=in_job, **command.args)
        except RolloutError as err:
            log.warning("%s refused: %s", command.name, err)
            command.future.set_exception(err)
        except Exception as err:  # noqa: BLE001 - the daemon keeps serving; the client gets the reason
            log.error("%s failed:\n%s", command.name, traceback.format_exc())
            command.future.set_exception(RolloutError(f"{command.name} failed: {type(err).__name__}: {err}"))
        else:
            command.future.set_result(result)

    def _do_release_memory(self, in_job: bool, tags) -> dict:
        if in_job:
            raise Conflict("a job is running; stop it first (rollout pause --mode abort, or rollout abort), "
                           "then release memory")
        result = self.control.release_memory(tags)
        log.info("released %s in %.2f s", ",".join(result["released"]) or "nothing", result["seconds"])
        self._publish(state="released" if self.engine.memory.released else self._idle_state(),
                      memory=self.control.memory_held())
        return {"success": True, **result, "seconds": round(result["seconds"], 3)}

    def _do_resume_memory(self, in_job: bool, tags) -> dict:
        result = self.control.resume_memory(tags)
        log.info("resumed %s in %.2f s", ",".join(result["resumed"]) or "nothing", result["seconds"])
        self._publish(state="released" if self.engine.memory.released else self._idle_state(),
                      memory=self.control.memory_held())
        return {"success": True, **result, "seconds": round(result["seconds"], 3)}

    def _idle_state(self) -> str:
        return "paused" if self.paused else "serving"

    def _do_flush_cache(self, in_job: bool) -> dict:
        if in_job:
            raise Conflict("a job is running and its requests hold cached prefixes; flush after it ends")
        self.control.flush_cache()
        return {"success": True, "message": "prefix cache flushed"}

    def _do_pause(self, in_job: bool, mode: str) -> dict:
        if mode not in PAUSE_MODES:
            raise RolloutError(f"unknown pause mode {mode!r}; choose abort, wait, keep or finish")
        self._set_pause(mode)
        aborted = 0
        if mode == "abort":  # the running job or online requests, or online requests queued while idle
            aborted = self._abort_in_flight() if in_job else self.live.abort_queued()
        self._publish(state="released" if self.engine.memory.released else "paused")
        return {"success": True, "state": "paused", "mode": mode, "aborted": aborted}

    def _do_continue(self, in_job: bool) -> dict:
        self._set_pause(None)
        state = "released" if self.engine.memory.released else "serving"
        self._publish(state=state)
        return {"success": True, "state": state}

    def _do_abort(self, in_job: bool, request_id: str | None = None) -> dict:
        if request_id is not None:
            return {"success": True, "aborted": self.live.abort(self.control, request_id), "job_aborted": False}
        job = in_job and self.job is not None
        aborted = self._abort_in_flight() if in_job else self.live.abort_queued()
        return {"success": True, "aborted": aborted, "job_aborted": job}

    def _do_shutdown(self, in_job: bool) -> dict:
        # Like Ctrl-C of an embedded run: unfinished samples are dropped, not written, so
        # `rollout run --resume` generates them later; finished rows are already in shards.
        aborted = self._abort_in_flight(write=False) if in_job else 0
        self._stopping = True
        self._set_pause(None)
        self._publish(state="stopping")
        return {"success": True, "aborted": aborted}

    def _set_pause(self, mode: str | None) -> None:
        """Enter pause `mode`, or leave the pause (None): the engine's side of each mode is set here only."""
        self.pause_mode = mode
        self.engine.hold_requested = mode == "keep"  # keep: the engine finishes its step in flight and holds
        self.engine.scheduler.admit_new = mode != "finish"
        if mode is None:
            self._answer_finishing()

    def _answer_finishing(self) -> None:
        """Answer a pending pause finish: the running samples finished (or the job ended)."""
        if self._finishing is not None:
            self._finishing.future.set_result({"success": True, "state": "paused", "mode": "finish", "aborted": 0})
            self._finishing = None

    def _abort_in_flight(self, write: bool = True) -> int:
        """End the running job: its unfinished samples finish with "abort" and are written
        (`write`), or are dropped so a later --resume generates them (shutdown)."""
        if self.stop_requested:
            return 0
        self.stop_requested = True
        self._abort_reason = "abort" if write else "shutdown"
        if self._live_running:  # online requests: each caller gets its samples so far
            count = self.live.abort(self.control)
            log.info("%d online samples aborted", count)
            return count
        aborted = self.control.abort()
        if write:
            self.aborted_samples.extend(aborted)
            log.info("job aborted: %d in-flight samples finish with finish_reason abort", len(aborted))
        else:
            log.info("job interrupted by shutdown: %d unfinished samples left for --resume", len(aborted))
        return len(aborted)

    # ---- one job -------------------------------------------------------------------

    def _run_job(self, handle: JobHandle) -> None:
        self.sessions.expire(self.engine.scheduler)  # pins past their time leave room for the job
        self.stop_requested = False
        self.aborted_samples = []
        log.info("job started: %s -> %s", handle.job.data, handle.job.out)
        try:
            manifest = run_job(JobEngine(self.engine, self), handle.params, handle.job,
                               on_progress=handle.update, weights_path=self.snapshot()["weights_path"])
        except JobAborted:
            manifest = read_manifest(handle.job.out) or {}
            log.info("job aborted after %s trajectories", manifest.get("trajectories"))
            handle.finish(event="aborted", reason=self._abort_reason, manifest=manifest)
        except RolloutError as err:
            handle.finish(event="error", message=str(err))
        except BaseException as err:  # noqa: BLE001 - one bad job must not take the daemon down; a
            # SystemExit let through would end this thread quietly, every later command waiting on it
            log.error("job failed:\n%s", traceback.format_exc())
            handle.finish(event="error", message=f"internal error: {type(err).__name__}: {err}")
        else:
            log.info("job finished: %s trajectories in %s s", manifest.get("trajectories"), manifest.get("wall_seconds"))
            handle.finish(event="done", manifest=manifest)
        finally:
            self.stop_requested = False
            self._answer_finishing()  # a job that ended (abort, error) while a pause finish waited
            with self._lock:
                self.job = None

    def between_steps(self, on_step) -> None:
        """Run queued commands; while paused, block here with the requests' KV kept (wait), or, under
        keep, return at once while the engine has a step in flight: it finishes it and calls again."""
        while not self.stop_requested:
            if self.paused and self.engine.hold_requested and self.engine.step_in_flight:
                return
            # pause finish holds only once nothing runs; until then the engine steps on
            holding = self.paused and not (self.pause_mode == "finish" and self.engine.scheduler.running)
            if holding:
                self._answer_finishing()
            try:
                command = self.commands.get(timeout=1.0) if holding else self.commands.get_nowait()
            except queue.Empty:
                if not holding:
                    return
                if on_step is not None:
                    on_step()  # keeps closing shards on time while the job is held
                continue
            self._handle(command, in_job=True)
