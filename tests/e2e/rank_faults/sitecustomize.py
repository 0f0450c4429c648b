"""Test hook of tests/e2e/test_tensor_parallel_failures.py: one tensor-parallel rank fails on purpose.

On the CPU nothing real fails on one rank alone (every rank reads the same files with the same
options), so those tests put this folder on PYTHONPATH, where Python imports this file at the start
of every process, and set ROLLOUT_TEST_RANK_FAULT=RANK:POINT. In the rank named, the function at
POINT raises `fault_message(RANK, POINT)` as a RolloutError, as the real failure there would:

    rendezvous   before it joins the process group (a bad --device, a GPU missing on that rank)
    load         while its engine loads the weights (its shard of the checkpoint unreadable)
    step=N       in its N-th forward; on rank 0 after it sent the step, the followers waiting in the
                 forward's all-reduce

rollout itself never reads the variable; without this folder on PYTHONPATH nothing changes.
"""

from __future__ import annotations

import os

FAULT_ENV = "ROLLOUT_TEST_RANK_FAULT"


def fault_message(rank: int, point: str) -> str:
    return f"test fault on rank {rank} at {point}: the test asked for it; nothing to fix"


def _install(rank: int, point: str) -> None:
    # imported only in the rank that fails: the others start as without this hook
    import rollout_cli.engine.engine as engine_module
    from rollout_cli.engine.execution.model_runner import ModelRunner
    from rollout_cli.errors import RolloutError

    def fail(*args, **kwargs):
        raise RolloutError(fault_message(rank, point))

    if point == "rendezvous":
        engine_module.init_tensor_parallel = fail
    elif point == "load":
        engine_module.build_model = fail
    elif point.startswith("step="):
        forward, calls = ModelRunner._forward_logits, [0]

        def failing_forward(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == int(point.removeprefix("step=")):
                fail()
            return forward(self, *args, **kwargs)

        ModelRunner._forward_logits = failing_forward
    else:
        raise ValueError(f"{FAULT_ENV}: unknown point {point!r}")


_spec = os.environ.get(FAULT_ENV)
if _spec and "RANK" in os.environ:
    _rank, _point = _spec.split(":", 1)
    if int(_rank) == int(os.environ["RANK"]):
        _install(int(_rank), _point)
