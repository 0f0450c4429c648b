"""scripts/train_speculation_models.py (issue 22's trained models) on the CPU: its tiny pair loads into the
engine as users would run it: the hybrid with its MTP head under --speculative mtp (the head's weights
those it saved, the tokens those of plain decoding), the dense one under --speculative siblings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.trajectory import PromptInput

REPO = Path(__file__).resolve().parents[2]


def test_trained_pair_runs_speculation(tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "spec"
    subprocess.run([sys.executable, "scripts/train_speculation_models.py", "--out", str(out), "--tiny", "--device",
                    "cpu", "--num-prompts", "4", "--prompt-len", "24", "--layers", "6"], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    for model in ("hybrid", "dense"):  # --layers: the trunk's depth (the tiny size has 4)
        assert json.loads((out / model / "config.json").read_text())["num_hidden_layers"] == 6
    texts = pq.read_table(out / "prompts.parquet").column("prompt").to_pylist()
    assert len(texts) == 4 and all(texts)
    tokenizer = AutoTokenizer.from_pretrained(out / "hybrid")
    prompts = [PromptInput(i, tokenizer.encode(t)) for i, t in enumerate(texts)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", max_model_len=256)
    engine = Engine(str(out / "hybrid"), speculative="mtp", num_draft_tokens=2, speculative_gate=False, **options)
    saved = load_file(str(out / "hybrid" / "mtp.safetensors"))
    assert torch.equal(engine.model.mtp.fc.weight.to(torch.bfloat16), saved["mtp.fc.weight"])
    got = sorted(engine.stream(prompts, params), key=lambda t: t.prompt_index)
    want = sorted(Engine(str(out / "hybrid"), **options).stream(prompts, params), key=lambda t: t.prompt_index)
    assert [t.response_token_ids for t in got] == [t.response_token_ids for t in want]
    assert engine.scheduler.stats.verify_steps > 0
    dense = Engine(str(out / "dense"), speculative="siblings", **options)
    assert len(list(dense.stream(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, n=2)))) == 8
