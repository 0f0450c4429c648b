"""The engine worker's weight-update commands: a checkpoint reload, tensors from a trainer, its
broadcast group. Outside a job they run at once; inside one only under pause keep (its running samples
are retracted first and recompute on the new weights) or a drained pause finish (server/worker.py).

A part of EngineWorker, kept in its own file: it runs on the worker thread and uses the worker's
engine control, pause mode and status.
"""

from __future__ import annotations

import logging
import time

from rollout_cli.errors import Conflict

log = logging.getLogger("rollout.serve")

IN_JOB_HINT = ("an update would mix two weight versions in it: wait for the job to finish, stop it with "
               "rollout abort, or hold it with rollout pause --mode keep (its samples then record the "
               "version of every token), then update")


class WeightCommands:
    """EngineWorker's weight-update commands (a mixin: see the module docstring)."""

    def _update_allowed_in_job(self) -> bool:
        """Under pause keep (running samples are retracted first), or pause finish once nothing runs
        (every later sample runs on the new weights)."""
        return self.pause_mode == "keep" or (self.pause_mode == "finish" and not self.engine.scheduler.running)

    def _before_update_in_job(self, in_job: bool) -> None:
        """An update inside a job only where _update_allowed_in_job: under keep its running samples
        leave the device first (retracted, to recompute on the new weights); refused otherwise (Conflict)."""
        if not in_job:
            return
        if not self._update_allowed_in_job():
            raise Conflict(f"a job is running; {IN_JOB_HINT}")
        retracted = self.engine.retract_running()
        if retracted:
            log.info("pause keep: %d running samples retracted; they recompute on the new weights", retracted)

    def _do_update_weights(self, in_job: bool, path: str, version: str | None) -> dict:
        self._before_update_in_job(in_job)
        started = time.perf_counter()
        old = self.engine.weight_version
        new = self.control.reload_weights(path, version)
        seconds = time.perf_counter() - started
        log.info("reloaded weights from %s: version %s -> %s in %.2f s", path, old, new, seconds)
        self._publish(weight_version=new, weights_path=path, memory=self.control.memory_held())
        return {"success": True, "message": f"weights loaded from {path}", "weight_version": new,
                "previous_weight_version": old, "seconds": round(seconds, 3)}

    # ---- updates from a trainer's tensors (engine/weights/weight_updates.py) -----------------------------

    def _updated(self, old: str, new: str, started: float, source: str) -> dict:
        seconds = time.perf_counter() - started
        log.info("weights updated from %s: version %s -> %s in %.2f s", source, old, new, seconds)
        self._publish(weight_version=new, weights_path=source, memory=self.control.memory_held())
        return {"success": True, "message": f"weights updated from {source}", "weight_version": new,
                "previous_weight_version": old, "seconds": round(seconds, 3)}

    def _do_update_weights_from_tensor(self, in_job: bool, serialized: str, version: str | None,
                                       partial: bool) -> dict:
        self._before_update_in_job(in_job)
        started, old = time.perf_counter(), self.engine.weight_version
        new = self.control.update_weights_from_tensor(serialized, version, partial)
        return self._updated(old, new, started, "tensors (update_weights_from_tensor)")

    def _do_init_weights_update_group(self, in_job: bool, **group) -> dict:
        if in_job:
            raise Conflict("a job is running; join the weight update group between jobs")
        self.control.init_weights_update_group(**group)
        log.info("joined weight update group %r as rank %d of %d (%s)", group["group_name"], group["rank_offset"],
                 group["world_size"], self.engine.weight_update_groups[group["group_name"]].backend)
        return {"success": True, "message": f"joined weight update group {group['group_name']}"}

    def _do_update_weights_from_distributed(self, in_job: bool, names, dtypes, shapes, group_name: str,
                                            version: str | None, partial: bool) -> dict:
        if in_job and not self._update_allowed_in_job():
            # receive and drop the broadcast (on every rank), so the trainer is not left hanging in it
            self.control.drain_broadcast(group_name, names, dtypes, shapes)
            raise Conflict(f"a job is running; the broadcast was received and dropped; {IN_JOB_HINT}")
        self._before_update_in_job(in_job)
        started, old = time.perf_counter(), self.engine.weight_version
        new = self.control.update_weights_from_distributed(names, dtypes, shapes, group_name, version, partial)
        return self._updated(old, new, started, f"broadcast of group {group_name}")

    def _do_destroy_weights_update_group(self, in_job: bool, group_name: str) -> dict:
        self.control.destroy_weights_update_group(group_name)
        return {"success": True, "message": f"destroyed weight update group {group_name}"}
