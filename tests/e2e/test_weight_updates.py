"""Weight updates from tensors and from a broadcast, through the Engine API, on the CPU.

Correctness is HF transformers on the checkpoint the new tensors came from (greedy tokens exact,
logprobs to 1e-4). Refused updates must leave the old weights, version and cache alone. The
cross-process tests spawn a "trainer" (tests/e2e/weight_trainers.py) that serializes shared-memory
handles, or broadcasts over a gloo group.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from parity import assert_matches_hf, make_engine, prompts_of
from rollout_cli import PromptInput, SamplingParams
from rollout_cli.engine.weights.tensor_bucket import flatten_tensors
from rollout_cli.engine.weights.tensor_ipc import serialize_named_tensors
from rollout_cli.engine.weights.weight_group import broadcast_metadata
from rollout_cli.errors import RolloutError
from weight_trainers import (broadcast_order, broadcast_trainer, checkpoint_tensors, free_port, ipc_trainer,
                             perturbed_checkpoint, wait_exit, wait_shm_gone)

PROMPTS = prompts_of([5, 9, 3], seed=11)
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
FIRST_UP = "model.layers.0.mlp.up_proj.weight"
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"  # a shard of the fused qkv parameter


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoints, tmp_path_factory) -> dict[str, str]:
    """qwen3 (fused qkv and gate_up, q/k norms, tied embeddings): the base and two other weight sets."""
    root = tmp_path_factory.mktemp("weight_updates")
    base = tiny_checkpoints["qwen3"]
    return {"base": base, "new": perturbed_checkpoint(base, root / "new", seed=1),
            "newer": perturbed_checkpoint(base, root / "newer", seed=2)}


def _generate(engine):
    return engine.generate(PROMPTS, GREEDY)


def _fill_prefix_cache(engine) -> None:
    _generate(engine)
    assert engine.scheduler.cache.total_size > 0


@pytest.mark.parametrize("form", ["pairs", "dict", "bucket", "serialized", "serialized_bucket"])
def test_update_from_tensor_equals_hf_on_the_new_weights(ckpts, hf_ref, form):
    engine = make_engine(ckpts["base"])
    _fill_prefix_cache(engine)
    tensors = checkpoint_tensors(ckpts["new"])
    given = {"pairs": lambda: list(tensors.items()), "dict": lambda: tensors,
             "bucket": lambda: flatten_tensors(tensors),
             "serialized": lambda: serialize_named_tensors(tensors),
             "serialized_bucket": lambda: serialize_named_tensors(flatten_tensors(tensors))}[form]()
    assert engine.update_weights_from_tensor(given) == "1"
    assert engine.weight_version == "1"
    assert engine.scheduler.cache.total_size == 0  # flushed: its KV came from the old weights
    results = _generate(engine)
    assert_matches_hf(hf_ref, ckpts["new"], results, PROMPTS, MAX_NEW)
    assert {r.weight_version for r in results} == {"1"}


def _bad(tensors: dict, kind: str) -> dict:
    tensors = dict(tensors)
    if kind == "missing":
        tensors.pop(FIRST_UP)
    elif kind == "extra":
        tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    elif kind == "shape":
        tensors[Q_PROJ] = tensors[Q_PROJ][:-1]
    elif kind == "dtype":
        tensors[FIRST_UP] = tensors[FIRST_UP].to(torch.float16)
    elif kind == "int_dtype":
        tensors[FIRST_UP] = tensors[FIRST_UP].to(torch.int32)
    return tensors


@pytest.mark.parametrize("kind, reason", [
    ("missing", f"missing tensors: {FIRST_UP}"),
    ("extra", "unexpected tensors: model.layers.0.mlp.extra.weight"),
    ("shape", f"wrong shapes: {Q_PROJ} (127, 64) (model: (128, 64))"),
    ("dtype", f"wrong dtypes: {FIRST_UP} F16 (expected F32)"),
    ("int_dtype", f"wrong dtypes: {FIRST_UP} I32 (expected F32)"),
])
def test_bad_update_is_refused_and_changes_nothing(ckpts, hf_ref, kind, reason):
    engine = make_engine(ckpts["base"])
    _fill_prefix_cache(engine)
    cached = engine.scheduler.cache.total_size
    with pytest.raises(RolloutError) as err:
        engine.update_weights_from_tensor(_bad(checkpoint_tensors(ckpts["new"]), kind))
    message = str(err.value)
    assert reason in message and "keeps weight version 0" in message and "\n" not in message, message
    assert engine.weight_version == "0"
    assert engine.scheduler.cache.total_size == cached  # nothing flushed either
    assert_matches_hf(hf_ref, ckpts["base"], _generate(engine), PROMPTS, MAX_NEW)


def test_partial_update_needs_partial_true_and_maps_hf_names_into_fused_params(ckpts, hf_ref, tmp_path):
    """A subset (every attention tensor: q/k/v go into the fused qkv parameter) is refused by default
    and accepted with partial=True; the result equals HF on base weights with those tensors replaced."""
    from safetensors.torch import save_file

    engine = make_engine(ckpts["base"])
    new = checkpoint_tensors(ckpts["new"])
    subset = {k: v for k, v in new.items() if ".self_attn." in k}
    assert any(".q_proj." in k for k in subset) and len(subset) < len(new)
    with pytest.raises(RolloutError, match="missing tensors: model.embed_tokens.weight"):
        engine.update_weights_from_tensor(subset)
    assert engine.update_weights_from_tensor(subset, version="7", partial=True) == "7"
    mixed = perturbed_checkpoint(ckpts["base"], tmp_path / "mixed", seed=0)  # then overwrite all its tensors:
    save_file({**checkpoint_tensors(ckpts["base"]), **subset}, f"{mixed}/model.safetensors", metadata={"format": "pt"})
    assert_matches_hf(hf_ref, mixed, _generate(engine), PROMPTS, MAX_NEW)
    with pytest.raises(RolloutError, match="unexpected tensors: model.layers.0.mlp.extra.weight"):
        engine.update_weights_from_tensor(_bad(subset, "extra"), partial=True)  # still checked
    with pytest.raises(RolloutError, match="holds no tensor of the model"):
        engine.update_weights_from_tensor({}, partial=True)


def test_update_while_requests_are_in_flight_is_refused(ckpts, hf_ref):
    """Between two steps with requests running (their KV from the old weights): refused. Requests
    only waiting hold no KV and may run on new weights (what pause keep / finish rely on; each token
    records its version), so that is no refusal."""
    engine = make_engine(ckpts["base"])
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    tried = []

    def on_step():
        if not tried:
            assert engine.scheduler.running
            with pytest.raises(RolloutError, match="cannot update weights while requests are in flight"):
                engine.update_weights_from_tensor(checkpoint_tensors(ckpts["new"]))
            tried.append(engine.weight_version)

    results = list(engine.stream(inputs, GREEDY, on_step=on_step))
    assert tried == ["0"] and engine.weight_version == "0"
    assert_matches_hf(hf_ref, ckpts["base"], results, PROMPTS, MAX_NEW)  # the old weights throughout


def test_two_process_update_by_serialized_handles(ckpts, hf_ref):
    """The trainer process serializes CPU tensors (shared memory), pairs then a flattened bucket."""
    engine = make_engine(ckpts["base"])
    ctx = multiprocessing.get_context("spawn")
    for step, (model_dir, flatten) in enumerate([(ckpts["new"], False), (ckpts["newer"], True)], start=1):
        queue, done = ctx.Queue(), ctx.Event()
        trainer = ctx.Process(target=ipc_trainer, args=(model_dir, "cpu", flatten, queue, done))
        trainer.start()
        try:
            payload = queue.get(timeout=120)
            assert len(payload) < 20_000  # handles, not tensor data
            assert engine.update_weights_from_tensor(payload) == str(step)
        finally:
            done.set()
        assert wait_exit(trainer) == 0
        assert_matches_hf(hf_ref, model_dir, _generate(engine), PROMPTS, MAX_NEW)


def test_serialized_payload_of_a_dead_trainer_is_refused_in_one_line(ckpts):
    engine = make_engine(ckpts["base"])
    ctx = multiprocessing.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    trainer = ctx.Process(target=ipc_trainer, args=(ckpts["new"], "cpu", False, queue, done))
    trainer.start()
    payload = queue.get(timeout=120)
    done.set()
    assert wait_exit(trainer) == 0
    assert wait_shm_gone(trainer.pid)
    with pytest.raises(RolloutError, match="the trainer process must stay alive") as err:
        engine.update_weights_from_tensor(payload)
    assert "\n" not in str(err.value) and engine.weight_version == "0"


def test_distributed_update_over_gloo(ckpts, hf_ref):
    """Trainer rank 0 broadcasts; the engine (rank 1) receives. In order: a refused update (a wrong
    shape: received and dropped, the group stays in step), a good one, then a trainer that dies
    mid-transfer (old weights kept), then the group is destroyed."""
    engine = make_engine(ckpts["base"])
    port = free_port()
    steps = [(ckpts["newer"], Q_PROJ, "all"), (ckpts["new"], None, "all"), (ckpts["newer"], None, "half_then_exit")]
    ctx = multiprocessing.get_context("spawn")
    trainer = ctx.Process(target=broadcast_trainer, args=(port, steps))
    trainer.start()
    try:
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, "weights", backend="gloo", timeout_seconds=120)
        with pytest.raises(RolloutError, match="already exists"):
            engine.init_weights_update_group("127.0.0.1", port, 1, 2, "weights", backend="gloo")

        bad = broadcast_metadata(broadcast_order(ckpts["newer"], truncate=Q_PROJ))
        with pytest.raises(RolloutError, match=f"wrong shapes: {Q_PROJ}.*keeps weight version 0"):
            engine.update_weights_from_distributed(**bad, group_name="weights")
        assert engine.weight_version == "0"

        good = broadcast_metadata(broadcast_order(ckpts["new"]))
        assert engine.update_weights_from_distributed(**good, group_name="weights") == "1"
        assert_matches_hf(hf_ref, ckpts["new"], _generate(engine), PROMPTS, MAX_NEW)

        with pytest.raises(RolloutError, match="failed after .* tensors.*keeps weight version 1") as err:
            engine.update_weights_from_distributed(**broadcast_metadata(broadcast_order(ckpts["newer"])),
                                                   group_name="weights")
        assert "\n" not in str(err.value)
        assert engine.weight_version == "1"
        assert_matches_hf(hf_ref, ckpts["new"], _generate(engine), PROMPTS, MAX_NEW)
    finally:
        assert wait_exit(trainer) == 0
    engine.destroy_weights_update_group("weights")
    with pytest.raises(RolloutError, match="no weight update group 'weights'"):
        engine.update_weights_from_distributed(**good, group_name="weights")
    with pytest.raises(RolloutError, match="no weight update group"):
        engine.destroy_weights_update_group("weights")


def test_distributed_metadata_is_checked_first(ckpts):
    engine = make_engine(ckpts["base"])
    with pytest.raises(RolloutError, match="differ in length"):
        engine.update_weights_from_distributed(["a", "b"], ["float32"], [[1]], group_name="g")
    with pytest.raises(RolloutError, match="unknown dtype 'floaty'"):
        engine.update_weights_from_distributed(["a"], ["floaty"], [[1]], group_name="g")
    with pytest.raises(RolloutError, match="rank 0 is the trainer"):
        engine.init_weights_update_group("127.0.0.1", free_port(), 0, 2, "g", backend="gloo")
    with pytest.raises(RolloutError, match="unknown backend"):
        engine.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "g", backend="mpi")


def test_after_a_release_without_backup_only_a_full_update_makes_generation_possible(ckpts, hf_ref):
    """Released weights refuse updates (resume first); after resume the weights are stale: a partial
    update leaves them stale, a full one from tensors makes them valid (== HF on those tensors)."""
    engine = make_engine(ckpts["base"])
    new = checkpoint_tensors(ckpts["new"])
    engine.release_memory(["weights"])
    with pytest.raises(RolloutError, match="resume-memory"):
        engine.update_weights_from_tensor(new)
    assert engine.resume_memory()["weights_stale"]
    partial = {k: v for k, v in new.items() if ".self_attn." in k}
    assert engine.update_weights_from_tensor(partial, partial=True) == "1"
    with pytest.raises(RolloutError, match="not reloaded since"):
        _generate(engine)
    assert engine.update_weights_from_tensor(new) == "2"
    assert_matches_hf(hf_ref, ckpts["new"], _generate(engine), PROMPTS, MAX_NEW)
