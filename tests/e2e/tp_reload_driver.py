"""Run by tests/e2e/test_cli_tensor_parallel.py under torch.distributed.run with 2 processes: greedy
generation on checkpoint A under --tp 2, a refused reload, a reload of checkpoint B, greedy again, a
memory release and resume, A's tensors handed over in process, greedy again.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tp_reload_driver.py A B BAD OUT.json
"""

from __future__ import annotations

import json
import sys

from safetensors.torch import load_file

from rollout_cli import Engine, SamplingParams
from rollout_cli.cli.tensor_parallel_run import exit_rank
from rollout_cli.engine.tensor_parallel import follow
from rollout_cli.errors import RolloutError

PROMPTS = [[5, 9, 17, 33, 2], [7, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
PARAMS = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)


def greedy(engine: Engine) -> list:
    return [(r.response_token_ids, r.response_logprobs, r.weight_version) for r in engine.generate(PROMPTS, PARAMS)]


def main(model_a: str, model_b: str, bad: str, out: str) -> None:
    engine = Engine(model_a, device="cpu", max_model_len=64, max_batch_tokens=8, tensor_parallel_size=2)
    try:
        if engine.tp.rank != 0:
            follow(engine)  # no return here: the follower must reach exit_rank() below as rank 0 does
        else:
            _lead(engine, model_a, model_b, bad, out)
    finally:
        engine.control.close()  # rank 0 stops the followers; every rank leaves the process group
    exit_rank()  # as the CLI's ranks do: no interpreter finalization with gloo threads about


def _lead(engine: Engine, model_a: str, model_b: str, bad: str, out: str) -> None:
    """Rank 0's part: generate, reload, release and hand tensors over; the results go to OUT as JSON."""
    results = {"a": greedy(engine)}
    try:
        engine.reload_weights(bad)
    except RolloutError as err:
        results["refused"] = str(err)
    results["version_after_refusal"] = engine.weight_version
    results["a_again"] = greedy(engine)
    results["b_version"] = engine.reload_weights(model_b)
    results["b"] = greedy(engine)
    # the Python API on rank 0 reaches every rank too: a release without backup loses every
    # rank's weights; in-process tensors of A reach the followers as shared-memory handles
    engine.release_memory()
    results["stale"] = engine.resume_memory()["weights_stale"]
    results["a_tensors_version"] = engine.update_weights_from_tensor(load_file(f"{model_a}/model.safetensors"))
    results["a_tensors"] = greedy(engine)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
