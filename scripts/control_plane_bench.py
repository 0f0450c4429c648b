"""Time the RL control plane on a GPU: reload-weights from disk, update_weights_from_tensor by CUDA
IPC from a trainer process, release-memory and resume-memory.

Writes a random Qwen3 checkpoint of the given config (default: Qwen3-8B shape, about 16 GB of
bf16 safetensors in 4 GiB shards), reads it once so it sits in the page cache, starts an Engine
on it, then times each operation and measures the engine's GPU memory from another process.

    python scripts/control_plane_bench.py --config recipes/configs/qwen3-8b --workdir /tmp/cp [--quantization fp8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


def qwen3_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF checkpoint names and shapes of a Qwen3ForCausalLM."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def write_checkpoint(config_dir: Path, out: Path, shard_bytes: int = 4 << 30) -> int:
    """Random bf16 weights (made on the GPU, saved shard by shard); returns the bytes written."""
    from safetensors.torch import save_file

    cfg = json.loads((config_dir / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_dir / "config.json", out / "config.json")
    shard, size, index, total, n = {}, 0, {}, 0, 0
    gen = torch.Generator(device="cuda").manual_seed(0)

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    for name, shape in qwen3_tensor_shapes(cfg).items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02).cpu()
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": index}))
    return total


def ipc_trainer(ckpt: str, queue, done) -> None:
    """A colocated trainer: its weights on the same GPU; only CUDA IPC handles go to the engine."""
    from safetensors.torch import load_file

    from rollout_cli.engine.weights.tensor_ipc import serialize_named_tensors

    tensors = {}
    for path in sorted(Path(ckpt).glob("*.safetensors")):
        tensors.update(load_file(str(path), device="cuda:0"))
    torch.cuda.synchronize()
    queue.put(serialize_named_tensors(list(tensors.items())))
    done.wait()  # the handles stay valid while the trainer lives


def time_ipc_update(engine, ckpt: Path) -> tuple[float, int]:
    """Seconds for engine.update_weights_from_tensor of a trainer's tensors by CUDA IPC; payload bytes."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    trainer = ctx.Process(target=ipc_trainer, args=(str(ckpt), queue, done))
    trainer.start()
    try:
        payload = queue.get(timeout=300)
        t = time.perf_counter()
        engine.update_weights_from_tensor(payload)
        torch.cuda.synchronize()
        return time.perf_counter() - t, len(payload)
    finally:
        done.set()
        trainer.join(60)


def device_used_bytes() -> int:
    code = "import torch; free, total = torch.cuda.mem_get_info(0); print(total - free)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="recipes/configs/qwen3-8b")
    parser.add_argument("--workdir", default="/tmp/control_plane")
    parser.add_argument("--quantization", default=None, help="fp8: the engine re-quantizes every reload and update "
                        "(issue 20: the cost on top of a bf16 reload)")
    args = parser.parse_args()
    from rollout_cli import Engine, SamplingParams

    ckpt = Path(args.workdir) / "ckpt"
    t = time.perf_counter()
    size = write_checkpoint(Path(args.config), ckpt)
    print(f"wrote {size / 1e9:.1f} GB of safetensors in {time.perf_counter() - t:.1f} s")
    for path in ckpt.glob("*.safetensors"):  # into the page cache, as after a trainer's save
        with open(path, "rb") as handle:
            while handle.read(1 << 26):
                pass
    torch.cuda.empty_cache()  # the writer's cached blocks must not count as the baseline
    baseline = device_used_bytes()
    t = time.perf_counter()
    # KV takes 60% of the free memory: the IPC step's trainer holds a second copy of the weights
    engine = Engine(str(ckpt), device="cuda", dtype="bfloat16", max_model_len=4096, kv_memory_fraction=0.6,
                    quantization=args.quantization)
    rows = [("engine start (load + KV + graphs)", time.perf_counter() - t, "")]
    prompts = [[(11 * i + j) % 1000 for j in range(64)] for i in range(16)]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    reference = [r.response_token_ids for r in engine.generate(prompts, params)]
    for attempt in (1, 2):
        t = time.perf_counter()
        engine.reload_weights(str(ckpt))
        rows.append((f"reload-weights #{attempt} ({size / 1e9:.1f} GB)", time.perf_counter() - t, ""))
    seconds, payload = time_ipc_update(engine, ckpt)
    rows.append((f"update_weights_from_tensor, CUDA IPC ({size / 1e9:.1f} GB)", seconds,
                 f"payload {payload / 1e3:.0f} kB of handles"))
    held = device_used_bytes() - baseline
    r = engine.release_memory()
    after = device_used_bytes() - baseline
    rows.append(("release-memory (all tags)", r["seconds"],
                 f"engine held {held / 2**30:.1f} GiB -> {after / 2**30:.2f} GiB ({after / held:.1%})"))
    r = engine.resume_memory()
    rows.append(("resume-memory (all tags)", r["seconds"],
                 f"incl. CUDA graph re-capture {r['cuda_graph_capture_seconds'] or 0:.2f} s"))
    t = time.perf_counter()
    engine.reload_weights(str(ckpt))
    rows.append(("reload-weights after resume", time.perf_counter() - t, ""))
    r = engine.release_memory("weights,kv_cache")
    rows.append(("release-memory weights,kv_cache", r["seconds"], "graphs kept"))
    r = engine.resume_memory()
    rows.append(("resume-memory weights,kv_cache", r["seconds"], "weights stale until reload"))
    engine.reload_weights(str(ckpt))
    same = [r.response_token_ids for r in engine.generate(prompts, params)] == reference
    rows.append(("greedy tokens after the cycles equal before", float(same), ""))
    print(f"quantization: {args.quantization or 'none'}")
    print(f"{'operation':48s} {'seconds':>8s}  note")
    for name, seconds, note in rows:
        print(f"{name:48s} {seconds:8.2f}  {note}")


if __name__ == "__main__":
    main()
