"""Does splitting a decode step into two micro-batches on two streams pay? (issue 25 item 2)

    python scripts/bench_microbatch_overlap.py [--layers 4] [--json OUT.json]

The idea (SGLang's two-batch overlap, applied to a dense decode step): split the running batch in two
halves and run them on two CUDA streams, so that one half's attention (memory-bound: it reads the KV
cache) runs under the other half's GEMMs (compute-bound at large batches). The price: every weight
matrix is read twice per step instead of once, and each GEMM runs at half the rows.

This times the decoder layers of the Qwen3-8B and Qwen3-0.6B shapes alone, with the engine's kernels
(cuBLAS bf16 GEMMs, our Triton decode attention over a scattered KV pool with the engine's split
count, fused residual add + RMSNorm, SiLU-and-mul), each variant captured in one CUDA graph and
replayed, the median of triton.testing.do_bench:
  whole   - the batch at once, one stream (what the engine does today)
  halves  - the two halves one after the other on one stream (the split's cost alone)
  overlap - the two halves on two streams (what the split could gain)
q/k norms and rotary are left out (a few microseconds, the same in every variant). Each layer has its
own weights, so no weight matrix stays in L2 from one layer to the next.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rollout_cli.engine.execution.triton_attention import decode_kv_splits  # noqa: E402 - after the path
from rollout_kernels.decode_attention import decode_attention  # noqa: E402
from rollout_kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from rollout_kernels.silu_mul import silu_and_mul  # noqa: E402

# name: (hidden, heads, kv heads, head dim, intermediate)
SHAPES = {"qwen3-8b": (4096, 32, 8, 128, 12288), "qwen3-0.6b": (1024, 16, 8, 128, 3072)}
CASES = [("qwen3-8b", 256, 512), ("qwen3-8b", 256, 1024), ("qwen3-8b", 128, 1024),
         ("qwen3-0.6b", 256, 512), ("qwen3-0.6b", 256, 1024)]  # (shape, batch, context)


class Layers:
    """`count` decoder layers of one shape with random weights, and a KV pool holding `context` keys
    per request in scattered slots (as after a long run of the engine)."""

    def __init__(self, shape: str, count: int, batch: int, context: int, device: torch.device):
        hidden, heads, kv_heads, head_dim, inter = SHAPES[shape]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        gen = torch.Generator(device=device).manual_seed(0)

        def weight(n, k):  # scaled so activations stay finite through the layers
            return (torch.randn((n, k), device=device, generator=gen) / math.sqrt(k)).to(torch.bfloat16)

        qkv_out = (heads + 2 * kv_heads) * head_dim
        self.weights = [dict(qkv=weight(qkv_out, hidden), o=weight(hidden, heads * head_dim),
                             gate_up=weight(2 * inter, hidden), down=weight(hidden, inter),
                             norm1=torch.ones(hidden, device=device, dtype=torch.bfloat16),
                             norm2=torch.ones(hidden, device=device, dtype=torch.bfloat16))
                        for _ in range(count)]
        slots = batch * context
        self.k_pools = [torch.randn((slots, kv_heads, head_dim), device=device, generator=gen).to(torch.bfloat16)
                        for _ in range(count)]
        self.v_pools = [torch.randn_like(k) for k in self.k_pools]
        self.req_to_token = torch.randperm(slots, device=device, generator=gen).to(torch.int32).view(batch, context)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.rows = torch.arange(batch, dtype=torch.int32, device=device)
        self.x = torch.randn((batch, hidden), device=device, generator=gen).to(torch.bfloat16)
        self.splits = {b: decode_kv_splits(b, kv_heads) for b in (batch, batch // 2)}

    def forward(self, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the batch through every layer, on the current stream. Returns the hidden states."""
        x = self.x[lo:hi]
        residual = x.clone()
        h = rms_norm(x, self.weights[0]["norm1"], 1e-6)
        q_size = self.heads * self.head_dim
        for i, w in enumerate(self.weights):
            qkv = h @ w["qkv"].t()
            q = qkv[:, :q_size].view(hi - lo, self.heads, self.head_dim)
            attn = decode_attention(q, self.k_pools[i], self.v_pools[i], self.req_to_token, self.rows[lo:hi],
                                    self.seq_lens[lo:hi], 1.0 / math.sqrt(self.head_dim),
                                    num_kv_splits=self.splits[hi - lo])
            o = attn.view(hi - lo, q_size) @ w["o"].t()
            h, residual = fused_add_rms_norm(o, residual, w["norm2"], 1e-6)
            down = silu_and_mul(h @ w["gate_up"].t()) @ w["down"].t()
            nxt = self.weights[i + 1]["norm1"] if i + 1 < len(self.weights) else w["norm1"]
            h, residual = fused_add_rms_norm(down, residual, nxt, 1e-6)
        return h


def _graph(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (after a warm-up run that compiles and sizes the allocator)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def run_case(shape: str, batch: int, context: int, layers: int) -> dict:
    device = torch.device("cuda")
    model = Layers(shape, layers, batch, context, device)
    half = batch // 2
    other = torch.cuda.Stream()

    def whole():
        return model.forward(0, batch)

    def halves():
        return model.forward(0, half), model.forward(half, batch)

    def overlap():
        # fork: the second half on its own stream, joined before the step ends (graph capture records
        # the two streams as two branches of the graph)
        main = torch.cuda.current_stream()
        other.wait_stream(main)
        first = model.forward(0, half)
        with torch.cuda.stream(other):
            second = model.forward(half, batch)
        main.wait_stream(other)
        return first, second

    outputs, times = {}, {}
    for name, fn in (("whole", whole), ("halves", halves), ("overlap", overlap)):
        graph = _graph(fn)
        graph.replay()
        torch.cuda.synchronize()
        times[name] = triton.testing.do_bench(graph.replay, return_mode="median") * 1e3  # us
        out = fn()
        torch.cuda.synchronize()
        outputs[name] = out if isinstance(out, torch.Tensor) else torch.cat(out)
    # the variants compute the same rows (bf16 GEMMs at other row counts may round differently)
    agree = max((outputs[n].float() - outputs["whole"].float()).abs().max().item() for n in ("halves", "overlap"))
    scale = outputs["whole"].float().abs().max().item()
    return dict(shape=shape, batch=batch, context=context, layers=layers, max_diff=agree, max_abs=scale,
                whole_us=times["whole"] / layers, halves_us=times["halves"] / layers,
                overlap_us=times["overlap"] / layers, gain=times["whole"] / times["overlap"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark times CUDA graphs: run it on the GPU"
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rows = []
    for shape, batch, context in CASES:
        try:
            row = run_case(shape, batch, context, args.layers)
        except Exception as err:  # noqa: BLE001 - one case failing (memory, capture) leaves the others
            print(f"{shape} batch {batch} context {context}: {type(err).__name__}: {err}", flush=True)
            continue
        rows.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()
    print(f"\n{'shape':11} {'batch':>5} {'context':>7} {'whole us':>9} {'halves us':>9} {'overlap us':>10} "
          f"{'whole/overlap':>13}   (per layer)")
    for r in rows:
        print(f"{r['shape']:11} {r['batch']:5} {r['context']:7} {r['whole_us']:9.1f} {r['halves_us']:9.1f} "
              f"{r['overlap_us']:10.1f} {r['gain']:13.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
