"""Device check for the embedded engine: greedy tokens vs HF transformers on CUDA.

Builds a Qwen3-0.6B-shaped random checkpoint with transformers, saves it
with save_pretrained, then for a handful of token-id prompts compares the
engine's greedy tokens with HF `generate` in float32 (must match) and in
bfloat16 (reports the first position where they diverge, if any). Finally
runs `rollout run` on a Parquet of those prompts through the CLI.

    python scripts/gpu_parity.py --out-dir /tmp/gpu_parity
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from rollout_cli import Engine, SamplingParams


def qwen3_0_6b_config(tiny: bool = False) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=151936, hidden_size=64 if tiny else 1024, intermediate_size=128 if tiny else 3072,
        num_hidden_layers=2 if tiny else 28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=16 if tiny else 128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        architectures=["Qwen3ForCausalLM"], eos_token_id=151645, bos_token_id=151643,
    )


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="/tmp/gpu_parity")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--throughput-prompts", type=int, default=0,
                        help="also time N prompts x 256 in x 512 out (dummy weights, torch attention path)")
    parser.add_argument("--tiny", action="store_true", help="2-layer model: a quick check of this script on the CPU")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    ckpt = os.path.join(args.out_dir, "qwen3-0.6b-shape")

    torch.manual_seed(0)
    config = qwen3_0_6b_config(args.tiny)
    hf = Qwen3ForCausalLM(config).to(torch.bfloat16)
    hf.save_pretrained(ckpt, safe_serialization=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 151000, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 200, (args.num_prompts,), generator=gen)]
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}

    for dtype in ("float32", "bfloat16"):
        torch_dtype = getattr(torch, dtype)
        hf_model = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch_dtype).to(args.device).eval()
        hf_tokens = [hf_greedy(hf_model, p, args.max_new_tokens) for p in prompts]
        del hf_model
        engine = Engine(ckpt, device=args.device, dtype=dtype, max_model_len=1024)
        params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        results = engine.generate(prompts, params)
        rows = []
        for prompt, ref, res in zip(prompts, hf_tokens, results):
            rows.append({"prompt_len": len(prompt), "first_divergence": first_divergence(ref, res.response_token_ids),
                         "equal": ref == res.response_token_ids})
        report[dtype] = {"kv_slots": engine.num_kv_slots, "prompts": rows}
        del engine

    data = os.path.join(args.out_dir, "prompts.parquet")
    pq.write_table(pa.table({"prompt": prompts, "tag": [f"p{i}" for i in range(len(prompts))]}), data)
    out = os.path.join(args.out_dir, "traj")
    subprocess.run(["rm", "-rf", out], check=True)
    start = time.monotonic()
    cli = subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "run", "--model", ckpt, "--data", data,
                          "--out", out, "--device", args.device, "--n", "4", "--max-new-tokens", "64", "--max-model-len", "1024",
                          "--quiet"], capture_output=True, text=True)
    report["cli"] = {"returncode": cli.returncode, "stderr_tail": cli.stderr[-2000:],
                     "seconds": round(time.monotonic() - start, 1)}
    if cli.returncode == 0:
        table = pq.read_table(os.path.join(out, "trajectories"))
        manifest = json.load(open(os.path.join(out, "manifest.json")))
        report["cli"].update(rows=table.num_rows, prefix_hit_rate=manifest["prefix_hit_rate"],
                             output_tokens_per_s=manifest["output_tokens_per_s"])
    if args.throughput_prompts:
        engine = Engine(ckpt, device=args.device, load_format="dummy", max_model_len=1024)
        gen = torch.Generator().manual_seed(2)
        batch = [torch.randint(0, 151000, (256,), generator=gen).tolist() for _ in range(args.throughput_prompts)]
        params = SamplingParams(temperature=1.0, max_new_tokens=512, ignore_eos=True)
        engine.generate(batch[:8], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
        start = time.monotonic()
        results = engine.generate(batch, params)
        seconds = time.monotonic() - start
        out_tokens = sum(len(r.response_token_ids) for r in results)
        report["throughput_torch_path"] = {"prompts": len(batch), "input_len": 256, "output_len": 512,
                                           "output_tokens_per_s": round(out_tokens / seconds, 1),
                                           "seconds": round(seconds, 1)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
