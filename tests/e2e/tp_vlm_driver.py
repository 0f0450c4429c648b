"""Run by tests/e2e/test_vlm_tensor_parallel.py under torch.distributed.run with 2 processes: greedy
generation of image prompts on checkpoint A under --tp 2, a reload of checkpoint B (other vision-tower
weights only), the same prompts again.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tp_vlm_driver.py A B OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_fixtures import ReferencePrompts, random_image  # noqa: E402

from rollout_cli import Engine, PromptInput, SamplingParams  # noqa: E402
from rollout_cli.cli.tensor_parallel_run import exit_rank  # noqa: E402
from rollout_cli.engine.tensor_parallel import follow  # noqa: E402

PARAMS = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)


def image_prompts(model: str) -> list[PromptInput]:
    """Three prompts: one image, two images (one of them the first prompt's), and text only."""
    build = ReferencePrompts(model)
    first, second = random_image(20, 12, 1), random_image(32, 24, 2)
    prompts = [build.build([first]), build.build([second, first], "compare"), build.build([], "no picture")]
    return [PromptInput(i, ids, images=images) for i, (ids, images) in enumerate(prompts)]


def greedy(engine: Engine, prompts: list[PromptInput]) -> list:
    return [(r.prompt_index, r.response_token_ids, r.response_logprobs, r.weight_version)
            for r in sorted(engine.stream(prompts, PARAMS), key=lambda r: (r.prompt_index, r.sample_index))]


def main(model_a: str, model_b: str, out: str) -> None:
    engine = Engine(model_a, device="cpu", dtype="float32", max_model_len=256, max_batch_tokens=64,
                    tensor_parallel_size=2)
    try:
        if engine.tp.rank != 0:
            follow(engine)  # no return here: the follower must reach exit_rank() below as rank 0 does
        else:
            prompts = image_prompts(model_a)
            results = {"a": greedy(engine, prompts)}  # fills every rank's image-embedding cache with A's tower
            results["b_version"] = engine.reload_weights(model_b)
            results["b"] = greedy(engine, prompts)
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        engine.control.close()  # rank 0 stops the followers; every rank leaves the process group
    exit_rank()  # as the CLI's ranks do: no interpreter finalization with gloo threads about


if __name__ == "__main__":
    main(*sys.argv[1:4])
