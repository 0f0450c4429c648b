"""`--quantization fp8` on the CPU (issue 20): the engine against HF transformers whose linear layers
quantize the same way (weights in the same 128-column blocks, activations per token and 128-channel
group, the kernels' torch references), in float32 math: greedy tokens exact, logprobs to 1e-4.
Then weight updates (re-quantized as they arrive; refused ones change nothing) and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import HFReference
from fp8_reference import expert_block_rows, patch_experts
from parity import TOL, make_engine, prompts_of
from rollout_cli import PromptInput, SamplingParams
from rollout_cli.errors import RolloutError
from rollout_kernels.fp8_blockwise_ref import (FP8_DTYPE, fp8_blockwise_matmul_ref, quantize_activation_ref,
                                               quantize_weight_blockwise)
from weight_trainers import checkpoint_tensors, perturbed_checkpoint

REPO = Path(__file__).resolve().parents[2]
PROMPTS = prompts_of([6, 11, 3], seed=21)
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
# HF module name -> our fused module's name part (both quantize a shard with the fused layer's block rows)
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}
QUANTIZED = set(FUSED) | {"o_proj", "down_proj", "in_proj_qkvz", "out_proj"}


class QuantizedHF(HFReference):
    """HF transformers with every linear layer the engine quantizes replaced by the same W8A8 math."""

    def __init__(self, engine):
        super().__init__()
        self.blocks = {name: m.fp8_block for name, m in engine.model.named_modules()
                       if getattr(m, "fp8_block", None) is not None}
        # the W8A8 experts' block rows, in layer order (HF's stacked experts run the same math)
        self.expert_blocks = expert_block_rows(engine)
        # rows our layer holds in another order than the checkpoint (Qwen3-Next's in_proj_qkvz,
        # regrouped at load): ours[i] = checkpoint[order[i]], from the layer's own loader
        self.row_orders = {}
        for name, m in engine.model.named_modules():
            if getattr(m, "fp8_block", None) is not None and not hasattr(m, "shard_offsets"):
                n = m.weight.shape[0]
                staging = torch.nn.Parameter(torch.empty(n, 1), requires_grad=False)
                m.weight.weight_loader.args[1](staging, torch.arange(n, dtype=torch.float32)[:, None], None)
                self.row_orders[name] = staging[:, 0].long()

    def model(self, model_dir: str):
        if model_dir not in self._models:
            model = super().model(model_dir)
            patched = 0
            for name, module in model.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if not isinstance(module, torch.nn.Linear) or leaf not in QUANTIZED or ".experts." in name:
                    continue
                ours = name.rsplit(".", 1)[0] + "." + FUSED.get(leaf, leaf)
                assert ours in self.blocks, f"{name}: no quantized engine layer {ours}"
                _patch(module, self.blocks[ours], self.row_orders.get(ours))
                patched += 1
            assert patched == len(self.blocks) + sum(  # fused layers stand for 2 or 3 HF layers
                (".qkv_proj" in n) * 2 + (".gate_up_proj" in n) for n in self.blocks)
            patch_experts(model, self.expert_blocks)
        return self._models[model_dir]


def _patch(linear: torch.nn.Linear, block: tuple[int, int], order: torch.Tensor | None) -> None:
    """The layer's forward in W8A8, its weight quantized in the engine's row order (blocks are rows)."""
    order = torch.arange(linear.weight.shape[0]) if order is None else order
    q, scale = quantize_weight_blockwise(linear.weight.data[order], block)
    bias = None if linear.bias is None else linear.bias[order]

    def forward(x):
        flat = x.reshape(-1, x.shape[-1])
        x_q, x_scale = quantize_activation_ref(flat, block[1])
        y = torch.empty(flat.shape[0], q.shape[0], dtype=x.dtype)
        y[:, order] = fp8_blockwise_matmul_ref(x_q, x_scale, q, scale, x.dtype, bias, block)
        return y.view(*x.shape[:-1], q.shape[0])

    linear.forward = forward


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_next"])
def test_fp8_engine_equals_hf_quantized_the_same_way(arch, tiny_checkpoints, tiny_moe_checkpoints,
                                                     tiny_hybrid_checkpoints):
    model_dir = {**tiny_checkpoints, **tiny_moe_checkpoints, **tiny_hybrid_checkpoints}[arch]
    engine = make_engine(model_dir, quantization="fp8")
    linears = [m for m in engine.model.modules() if getattr(m, "fp8_block", None) is not None]
    assert linears and all(m.weight.dtype == FP8_DTYPE for m in linears)
    reference = QuantizedHF(engine)
    results = list(engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], GREEDY))
    for traj in results:
        prompt = PROMPTS[traj.prompt_index]
        assert traj.response_token_ids == reference.greedy(model_dir, prompt, MAX_NEW), traj.prompt_index
        assert traj.response_logprobs == pytest.approx(
            reference.logprobs(model_dir, prompt, traj.response_token_ids), abs=TOL)


def test_the_fp8_price_on_a_tiny_model_stays_under_its_bound(example_model_dir):
    """Teacher-forced logprobs of the same samples, FP8 against the model's own float32: the gap a
    trainer would correct for. Measured 2026-12-05 (this test's samples, 128 tokens): mean 0.0052,
    p99 0.0160, max 0.0176; the bound leaves room for another BLAS's rounding, not for a wrong kernel."""
    prompts = [PromptInput(i, p) for i, p in enumerate(prompts_of([12, 30, 7, 20], seed=3, vocab=700))]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5, n=2)
    fp8 = list(make_engine(example_model_dir, quantization="fp8").stream(prompts, params))
    from rollout_cli.engine.trajectory import ScoreInput

    scores = make_engine(example_model_dir).score(
        [ScoreInput(t.prompt_index, t.sample_index, t.prompt_token_ids, t.response_token_ids) for t in fp8], params)
    by_key = {(s.prompt_index, s.sample_index): s.response_logprobs for s in scores}
    gaps = np.concatenate([np.abs(np.array(t.response_logprobs) - np.array(by_key[(t.prompt_index, t.sample_index)]))
                           for t in fp8])
    assert 0 < gaps.mean() < 0.015 and gaps.max() < 0.06


@pytest.fixture(scope="module")
def updated(tiny_checkpoints, tmp_path_factory):
    base = tiny_checkpoints["qwen3"]
    return base, perturbed_checkpoint(base, tmp_path_factory.mktemp("fp8") / "new", seed=9)


def _run(engine) -> list:
    return [(t.response_token_ids, t.response_logprobs) for t in
            engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], GREEDY)]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])  # qwen3_next: a regrouping loader under the fp8 one
def test_reload_requantizes_to_what_a_fresh_fp8_engine_holds(arch, tiny_checkpoints, tiny_hybrid_checkpoints, tmp_path):
    base = {**tiny_checkpoints, **tiny_hybrid_checkpoints}[arch]
    new = perturbed_checkpoint(base, tmp_path / "new", seed=9)
    engine = make_engine(base, quantization="fp8")
    engine.reload_weights(new)
    fresh = make_engine(new, quantization="fp8")
    live, want = dict(engine.model.named_parameters()), dict(fresh.model.named_parameters())
    assert live.keys() == want.keys()
    for name, param in live.items():
        assert param.dtype == want[name].dtype and torch.equal(param.float(), want[name].float()), name
    assert _run(engine) == _run(fresh)


def test_a_partial_update_requantizes_only_the_shard_it_brings(updated):
    base, new = updated
    engine = make_engine(base, quantization="fp8")
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    before_w, before_s = qkv.weight.float().clone(), qkv.weight_scale_inv.clone()
    k_rows = slice(*(lambda o, s: (o, o + s))(*qkv.shard_offsets["k"]))
    name = "model.layers.0.self_attn.k_proj.weight"
    engine.update_weights_from_tensor({name: checkpoint_tensors(new)[name]}, partial=True)
    want_q, want_s = quantize_weight_blockwise(checkpoint_tensors(new)[name], qkv.fp8_block)
    assert torch.equal(qkv.weight[k_rows].float(), want_q.float())
    block_rows = qkv.fp8_block[0]
    scale_rows = slice(k_rows.start // block_rows, k_rows.stop // block_rows)
    assert torch.equal(qkv.weight_scale_inv[scale_rows], want_s)
    untouched = torch.ones(qkv.weight.shape[0], dtype=torch.bool)
    untouched[k_rows] = False
    assert torch.equal(qkv.weight.float()[untouched], before_w[untouched])  # q and v kept their bits
    assert not torch.equal(qkv.weight_scale_inv, before_s)


def test_a_refused_update_leaves_the_fp8_weights(updated):
    base, _ = updated
    engine = make_engine(base, quantization="fp8")
    before = {n: p.float().clone() for n, p in engine.model.named_parameters()}
    bad = {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(RolloutError, match="wrong shapes"):
        engine.update_weights_from_tensor(bad, partial=True)
    assert all(torch.equal(p.float(), before[n]) for n, p in engine.model.named_parameters())
    assert engine.weight_version == "0"


def test_fp8_refusals_are_one_line(tiny_checkpoints):
    with pytest.raises(RolloutError, match="unknown --quantization 'int4'; choose fp8"):
        make_engine(tiny_checkpoints["qwen3"], quantization="int4")
    with pytest.raises(RolloutError, match="with --deterministic"):
        make_engine(tiny_checkpoints["qwen3"], quantization="fp8", deterministic=True)


def test_cli_run_with_fp8_records_it(example_model_dir, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "run", "--model", example_model_dir,
                             "--data", str(REPO / "recipes" / "prompts.parquet"), "--out", str(out), "--n", "2",
                             "--max-new-tokens", "8", "--limit", "3", "--quantization", "fp8", "--quiet"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"] == "fp8" and manifest["trajectories"] == 6
    resumed = subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "run", "--model", example_model_dir,
                              "--data", str(REPO / "recipes" / "prompts.parquet"), "--out", str(out), "--n", "2",
                              "--max-new-tokens", "8", "--limit", "3", "--resume", "--quiet"],
                             capture_output=True, text=True, timeout=300, cwd=REPO)
    assert resumed.returncode == 2 and len(resumed.stderr.strip().splitlines()) == 1, resumed.stderr
    assert "quantization='fp8'" in resumed.stderr  # a bf16 resume of an fp8 run is refused


def test_a_partial_update_of_one_expert_requantizes_only_its_rows(tiny_moe_checkpoints, tmp_path):
    """The W8A8 experts: an update of expert 1's up rows quantizes those rows and their scale rows;
    every other expert and part keeps its bits."""
    base = tiny_moe_checkpoints["qwen3_moe"]
    new = perturbed_checkpoint(base, tmp_path / "new", seed=3)
    engine = make_engine(base, quantization="fp8")
    experts = engine.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == FP8_DTYPE and experts.fp8_block_rows is not None
    before_w, before_s = experts.w13.float().clone(), experts.w13_weight_scale_inv.clone()
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    engine.update_weights_from_tensor({name: checkpoint_tensors(new)[name]}, partial=True)
    rows, block_rows = experts.intermediate_size, experts.fp8_block_rows
    want_q, want_s = quantize_weight_blockwise(checkpoint_tensors(new)[name], (block_rows, 128))
    assert torch.equal(experts.w13[1, rows:].float(), want_q.float())
    assert torch.equal(experts.w13_weight_scale_inv[1, rows // block_rows:], want_s)
    changed = torch.zeros_like(before_w, dtype=torch.bool)
    changed[1, rows:] = True
    assert torch.equal(experts.w13.float()[~changed], before_w[~changed])
    assert torch.equal(experts.w13_weight_scale_inv[0], before_s[0])
