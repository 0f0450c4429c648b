"""Checkpoints already in FP8 (the hub's *-FP8 layout: e4m3 weights, a float32 weight_scale_inv per
128 x 128 block, quantization_config in config.json) load as they are (issue 20, item 3), on the CPU.

The engine holds the checkpoint's bytes (no rounding through bf16), runs as --quantization fp8 without
the flag, and equals HF transformers whose linear layers run the same W8A8 math on the checkpoint's own
e4m3 weights and scales: greedy tokens exact, logprobs to 1e-4, dense and hybrid. Updates in e4m3
(with their scales) or in bf16 (quantized as they arrive) both work; malformed ones are refused whole.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import HFReference
from fp8_reference import expert_block_rows, patch_experts, patch_experts_with
from parity import TOL, make_engine, prompts_of
from rollout_cli import PromptInput, SamplingParams
from rollout_cli.errors import RolloutError
from rollout_kernels.fp8_blockwise_ref import (FP8_DTYPE, fp8_blockwise_matmul_ref, quantize_activation_ref,
                                               quantize_weight_blockwise)

REPO = Path(__file__).resolve().parents[2]
BLOCK = (128, 128)
# checkpoint linear layers an FP8 checkpoint holds in e4m3 (the hub's: all but the LM head, routers,
# Gated DeltaNet's b/a projections and, here, the MoE experts, kept until their W8A8 kernel exists)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkvz", "out_proj")
PROMPTS = prompts_of([6, 11, 3], seed=4)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def _quantized(name: str, tensor: torch.Tensor, experts: bool) -> bool:
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    return tensor.dim() == 2 and leaf in QUANTIZED and (experts or ".experts." not in name)


def save_fp8_checkpoint(src: str, dst: Path, block_size=(128, 128), experts: bool = False, **config_extra) -> Path:
    """`src` quantized as the hub's FP8 checkpoints are: each linear weight (with `experts`, each MoE
    expert's too) in e4m3 with its scales."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, tensor in load_file(str(Path(src) / "model.safetensors")).items():
        if _quantized(name, tensor, experts):
            q, scale = quantize_weight_blockwise(tensor, BLOCK)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
        else:
            tensors[name] = tensor
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block_size), **config_extra}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


class CheckpointFP8HF(HFReference):
    """HF transformers on the bf16 source, every layer the checkpoint holds in e4m3 running W8A8 on the
    checkpoint's own e4m3 weight and scales (HF's rows are the checkpoint's rows: no reordering)."""

    def __init__(self, fp8_dir: Path, expert_blocks: list[int], expert_stacks: list | None = None):
        super().__init__()
        self.tensors = load_file(str(fp8_dir / "model.safetensors"))
        self.expert_blocks = expert_blocks  # the experts: bf16 in the checkpoint, W8A8 once loaded
        self.expert_stacks = expert_stacks  # or e4m3 in the checkpoint: ([w13, w13 scales, w2, w2 scales], block rows)

    def model(self, model_dir: str):
        if model_dir not in self._models:
            model = super().model(model_dir)
            for name, module in model.named_modules():
                q = self.tensors.get(name + ".weight")
                if isinstance(module, torch.nn.Linear) and q is not None and q.dtype == FP8_DTYPE:
                    _patch(module, q, self.tensors[name + ".weight_scale_inv"])
            if self.expert_stacks is None:
                patch_experts(model, self.expert_blocks)
            else:
                patch_experts_with(model, self.expert_stacks)
        return self._models[model_dir]


def _patch(linear: torch.nn.Linear, q: torch.Tensor, scale: torch.Tensor) -> None:
    def forward(x):
        flat = x.reshape(-1, x.shape[-1])
        x_q, x_scale = quantize_activation_ref(flat, BLOCK[1])
        y = fp8_blockwise_matmul_ref(x_q, x_scale, q, scale, x.dtype, linear.bias, BLOCK)
        return y.view(*x.shape[:-1], q.shape[0])

    linear.forward = forward


@pytest.fixture(scope="module")
def fp8_dirs(tiny_checkpoints, tiny_hybrid_checkpoints, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8_checkpoints")
    sources = {"qwen3": tiny_checkpoints["qwen3"], "qwen3_next": tiny_hybrid_checkpoints["qwen3_next"]}
    return {arch: (src, save_fp8_checkpoint(src, root / arch)) for arch, src in sources.items()}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])  # qwen3_next: rows regrouped by its loader
def test_an_fp8_checkpoint_runs_on_its_own_bytes_and_equals_hf_on_them(arch, fp8_dirs):
    source, fp8_dir = fp8_dirs[arch]
    engine = make_engine(str(fp8_dir))
    assert engine.config.quantization == "fp8"  # from config.json, no flag
    # the checkpoint's e4m3 bytes, and its scales per row, are what the layers hold (placed by each
    # layer's own loader: fused shards at their offsets, Qwen3-Next's in_proj_qkvz regrouped)
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    checked = 0
    for name, module in engine.model.named_modules():
        if getattr(module, "fp8_block", None) is None:
            continue
        assert module.weight.dtype == FP8_DTYPE
        place = module.weight.weight_loader.args[1]  # the layer's loader under the fp8 one
        per_row = module.weight_scale_inv.repeat_interleave(module.fp8_block[0], dim=0)
        for checkpoint_name, shard_id in _checkpoint_parts(name, module):
            offset, size = module.shard_offsets[shard_id] if shard_id is not None else (0, module.weight.shape[0])
            rows = slice(offset, offset + size)
            staging = _like(module.weight, module.weight.shape[1])
            place(staging, tensors[checkpoint_name].view(torch.uint8).float(), shard_id)
            assert torch.equal(module.weight[rows].view(torch.uint8).float(), staging[rows]), checkpoint_name
            scales = tensors[checkpoint_name + "_scale_inv"].repeat_interleave(128, dim=0)[:size]
            staging = _like(module.weight, scales.shape[1])
            place(staging, scales, shard_id)
            assert torch.equal(per_row[rows], staging[rows]), checkpoint_name
            checked += 1
    assert checked == sum(1 for n, t in tensors.items() if t.dtype == FP8_DTYPE)
    reference = CheckpointFP8HF(fp8_dir, expert_block_rows(engine))
    for traj in engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], GREEDY):
        prompt = PROMPTS[traj.prompt_index]
        assert traj.response_token_ids == reference.greedy(source, prompt, 8)
        assert traj.response_logprobs == pytest.approx(reference.logprobs(source, prompt, traj.response_token_ids),
                                                       abs=TOL)


def _checkpoint_parts(name: str, module) -> list[tuple[str, object]]:
    """(checkpoint tensor name, shard id) of each checkpoint weight a layer holds."""
    prefix = name.rsplit(".", 1)[0]
    if name.endswith("qkv_proj"):
        return [(f"{prefix}.{part}.weight", sid) for part, sid in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"))]
    if name.endswith("gate_up_proj"):
        return [(f"{prefix}.gate_proj.weight", 0), (f"{prefix}.up_proj.weight", 1)]
    return [(f"{name}.weight", None)]


def _like(weight, columns: int) -> torch.nn.Parameter:
    """A float32 staging parameter with the weight's rows (and shard offsets) and `columns` columns."""
    staging = torch.nn.Parameter(torch.zeros(weight.shape[0], columns), requires_grad=False)
    if hasattr(weight, "shard_offsets"):
        staging.shard_offsets = weight.shard_offsets
    return staging


def test_updates_in_fp8_or_bf16_land_and_bad_ones_change_nothing(fp8_dirs, tmp_path):
    source, fp8_dir = fp8_dirs["qwen3"]
    engine = make_engine(str(fp8_dir))
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    name = "model.layers.0.self_attn.k_proj.weight"
    offset, size = qkv.shard_offsets["k"]
    bf16 = load_file(str(Path(source) / "model.safetensors"))[name] * 1.5
    # e4m3 with its scales: placed as they are
    q, scale = quantize_weight_blockwise(bf16, BLOCK)
    engine.update_weights_from_tensor({name: q, name + "_scale_inv": scale}, partial=True)
    assert torch.equal(qkv.weight[offset:offset + size].view(torch.uint8), q.view(torch.uint8))
    # in the model's dtype: quantized as it arrives, with the layer's own blocks
    engine.update_weights_from_tensor({name: bf16}, partial=True)
    want_q, _ = quantize_weight_blockwise(bf16, qkv.fp8_block)
    assert torch.equal(qkv.weight[offset:offset + size].view(torch.uint8), want_q.view(torch.uint8))
    before = {n: p.float().clone() for n, p in engine.model.named_parameters()}
    version = engine.weight_version
    for bad, reason in [({name: q}, "FP8 weights without their weight_scale_inv"),
                        ({name + "_scale_inv": scale}, "weight_scale_inv without its FP8 (e4m3) weight"),
                        ({"model.norm.weight": engine.model.model.norm.weight.to(FP8_DTYPE)},
                         "FP8 tensors for layers this engine keeps in the model's dtype"),
                        ({"model.norm.weight_scale_inv": torch.ones(1)}, "unexpected tensors: model.norm.weight_scale_inv")]:
        with pytest.raises(RolloutError, match=re.escape(reason)):
            engine.update_weights_from_tensor(bad, partial=True)
    assert all(torch.equal(p.float(), before[n]) for n, p in engine.model.named_parameters())
    assert engine.weight_version == version


def test_fp8_checkpoint_refusals_are_one_line(tiny_checkpoints, tiny_moe_checkpoints, tmp_path):
    dense = tiny_checkpoints["qwen3"]
    cases = [
        (save_fp8_checkpoint(dense, tmp_path / "block", block_size=(1, 128)), "weight_block_size is [1, 128]"),
        (save_fp8_checkpoint(dense, tmp_path / "static", activation_scheme="static"), "activation_scheme is static"),
    ]
    other = save_fp8_checkpoint(dense, tmp_path / "awq")
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (other / "config.json").write_text(json.dumps(config))
    cases.append((other, "quantized with 'awq'"))
    for directory, message in cases:
        with pytest.raises(RolloutError, match=re.escape(message)):
            make_engine(str(directory))
    fp8 = save_fp8_checkpoint(dense, tmp_path / "ok")
    with pytest.raises(RolloutError, match="is an FP8 checkpoint and --deterministic"):
        make_engine(str(fp8), deterministic=True)
    # an e4m3 expert without its scales is refused by name
    moe_fp8 = save_fp8_checkpoint(tiny_moe_checkpoints["qwen3_moe"], tmp_path / "moe", experts=True)
    tensors = load_file(str(moe_fp8 / "model.safetensors"))
    expert = next(n for n in tensors if ".experts.0.gate_proj.weight_scale_inv" in n)
    del tensors[expert]
    save_file(tensors, str(moe_fp8 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RolloutError, match="FP8 weights without their weight_scale_inv: .*experts.0.gate_proj.weight"):
        make_engine(str(moe_fp8))


def test_an_fp8_moe_checkpoint_runs_its_experts_on_their_own_bytes(tiny_moe_checkpoints, tmp_path):
    """Experts in e4m3 with per-expert scales (Qwen3-30B-A3B-FP8's layout) load as they are into the
    W8A8 fused MoE, and the engine equals HF whose experts run that math on the checkpoint's bytes."""
    source = tiny_moe_checkpoints["qwen3_moe"]
    fp8_dir = save_fp8_checkpoint(source, tmp_path / "moe", experts=True)
    engine = make_engine(str(fp8_dir))
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    layers = [(i, m) for i, m in enumerate(engine.model.model.layers) if hasattr(m.mlp, "experts")]
    stacks = []
    for i, layer in layers:
        experts, rows = layer.mlp.experts, layer.mlp.experts.intermediate_size
        block = experts.fp8_block_rows
        prefix = f"model.layers.{i}.mlp.experts"
        w13, w13_s, w2, w2_s = [], [], [], []
        for e in range(experts.num_experts):
            parts = [tensors[f"{prefix}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")]
            w13.append(torch.cat(parts))
            w13_s.append(torch.cat([_block_scales(tensors[f"{prefix}.{e}.{p}.weight_scale_inv"], rows, block)
                                    for p in ("gate_proj", "up_proj")]))
            w2.append(tensors[f"{prefix}.{e}.down_proj.weight"])
            w2_s.append(_block_scales(tensors[f"{prefix}.{e}.down_proj.weight_scale_inv"], w2[-1].shape[0], block))
        stack = [torch.stack(w13), torch.stack(w13_s), torch.stack(w2), torch.stack(w2_s)]
        assert torch.equal(experts.w13.view(torch.uint8), stack[0].view(torch.uint8))
        assert torch.equal(experts.w13_weight_scale_inv, stack[1]) and torch.equal(experts.w2_weight_scale_inv, stack[3])
        stacks.append((stack, block))
    reference = CheckpointFP8HF(fp8_dir, [], expert_stacks=stacks)
    for traj in engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], GREEDY):
        prompt = PROMPTS[traj.prompt_index]
        assert traj.response_token_ids == reference.greedy(source, prompt, 8)
        assert traj.response_logprobs == pytest.approx(reference.logprobs(source, prompt, traj.response_token_ids),
                                                       abs=TOL)


def _block_scales(scale: torch.Tensor, rows: int, block: int) -> torch.Tensor:
    """A checkpoint part's 128-row scales as one per `block` rows."""
    return scale.repeat_interleave(128, dim=0)[:rows][::block]


def test_a_bf16_engine_reloads_an_fp8_checkpoint_and_the_cli_records_fp8(fp8_dirs, tmp_path):
    """--quantization fp8 on the bf16 checkpoint, then reload-weights of the FP8 one: the engine then
    holds and samples what an engine started from the FP8 checkpoint does (its blocks are finer: the
    checkpoint's scales are spread over them). `rollout run` on the FP8 checkpoint records fp8."""
    source, fp8_dir = fp8_dirs["qwen3"]
    engine = make_engine(source, quantization="fp8")
    engine.reload_weights(str(fp8_dir))
    fresh = make_engine(str(fp8_dir))
    prompts = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    got = [(t.response_token_ids, t.response_logprobs) for t in engine.stream(prompts, GREEDY)]
    assert got == [(t.response_token_ids, t.response_logprobs) for t in fresh.stream(prompts, GREEDY)]
    out, data = tmp_path / "out", tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), data)  # token ids: the tiny checkpoint has no tokenizer
    result = subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "run", "--model", str(fp8_dir),
                             "--device", "cpu", "--dtype", "float32", "--data", str(data), "--out", str(out),
                             "--max-new-tokens", "4", "--quiet"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"] == "fp8" and manifest["trajectories"] == len(PROMPTS)
