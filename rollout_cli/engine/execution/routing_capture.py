"""Routing capture of an engine: turning it on and off, and handing out finished requests with
their expert ids without stalling the GPU.

While capture is on the model records every token's expert ids into an `engine.routing_pool.RoutingPool`
(one row per KV slot). When a step finishes requests, their rows are gathered and copied to
pinned host memory behind the step already launched ahead (`RoutingPool.gather_async`); the
requests come back from a later `finish` call (or `flush`), once the copy is done. So the host
never waits on a device-to-host copy of routing in the step loop: trajectories of a capturing
run leave the engine one step after they finished.
"""

from __future__ import annotations

from rollout_cli.engine.execution.routing_pool import RoutingPool
from rollout_cli.engine.scheduling.request import Request
from rollout_cli.errors import RolloutError
from rollout_cli.models.moe import set_routing_recorder


class RoutingCapture:
    def __init__(self):
        self.pool = None  # a routing_pool.RoutingPool while capture is on
        self._idle_pool = None  # the pool while capture is turned off again (bench compare)
        self._pending: list[tuple[list[Request], object]] = []  # (requests, moe.RoutingGather)

    def enable(self, engine) -> str:
        """Record every token's expert ids from now on; returns the routing dtype name ("uint8"/"int16").
        See Engine.enable_routing_capture."""
        moe_layers = getattr(engine.model, "moe_layers", None)
        if not moe_layers:
            raise RolloutError(f"--capture-routing needs a mixture-of-experts model; {engine.config.model} has no MoE layers")
        if self.pool is None:
            if engine.scheduler.has_work():
                raise RolloutError("cannot turn routing capture on while requests are in flight")
            if engine.scheduler.cache is not None:  # cached prefixes without routing rows
                engine.scheduler.cache.reset()
            self.pool = self._idle_pool or RoutingPool(
                engine.kv.num_slots, len(moe_layers), engine.model.top_k, engine.model.num_experts, engine.device)
            self._idle_pool = None
            set_routing_recorder(engine.model, self.pool)
            engine.runner.routing_pool = self.pool
        return str(self.pool.ids.dtype).removeprefix("torch.")

    def disable(self, engine) -> None:
        if engine.scheduler.has_work():
            raise RolloutError("cannot turn routing capture off while requests are in flight")
        if self.pool is not None:
            set_routing_recorder(engine.model, None)
            self._idle_pool, self.pool = self.pool, None
            engine.runner.routing_pool = None

    def finish(self, requests: list[Request]) -> list[tuple[Request, object]]:
        """Requests a step just finished (their slots not yet reused by any launched step) ->
        (request, routed expert ids or None) pairs ready now: those of earlier calls, and these
        ones at once when capture is off. Call before a step that can reuse the slots is launched."""
        ready = self.flush()  # earlier gathers: queued before the step that just finished, or right behind it
        if requests and self.pool is not None:
            self._pending.append((requests, self.pool.gather_async([r.final_slots for r in requests])))
        else:
            ready.extend((r, None) for r in requests)
        return ready

    def flush(self) -> list[tuple[Request, object]]:
        """Every pending request with its routing, waiting for the copies."""
        ready = []
        for requests, gather in self._pending:
            ready.extend(zip(requests, gather.wait()))
        self._pending = []
        return ready

    def gather_computed(self, requests: list[Request]) -> list:
        """Expert ids of every position each request computed so far (None each when capture is off):
        the routing of requests aborted mid-way, read before their slots are given back."""
        if self.pool is None or not requests:
            return [None] * len(requests)
        return self.pool.gather([r.slots[: r.num_computed_tokens] for r in requests])

    def drop_pending(self) -> None:
        """An abandoned stream: its pending requests are not handed out."""
        self._pending = []
