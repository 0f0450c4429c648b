import torch, triton
from triton.testing import do_bench
from rollout_kernels.sampling import sample, sample_ref
from rollout_kernels.rmsnorm import rms_norm, fused_add_rms_norm, rms_norm_ref
from rollout_kernels.silu_mul import silu_and_mul
from rollout_kernels.rotary import apply_rotary
from rollout_kernels.kv_store import store_kv
import torch.nn.functional as F
dev = "cuda"
torch.manual_seed(0)

def t(fn):
    return do_bench(fn, warmup=25, rep=100) * 1e3  # us

V = 151936
for B in (1, 64, 256):
    logits = torch.randn(B, V, device=dev) * 4
    u = torch.rand(B, device=dev)
    raw = torch.zeros(B, dtype=torch.bool, device=dev)
    for name, (T, k, p, m) in {"greedy": (0., 0, 1., 0.), "T=1": (1., 0, 1., 0.), "top_p=0.9": (1., 0, .9, 0.),
                               "top_k=50": (1., 50, 1., 0.), "top_k=1": (1., 1, 1., 0.), "min_p=0.05": (1., 0, 1., .05),
                               "k20,p.95,m.01": (.7, 20, .95, .01)}.items():
        args = (torch.full((B,), T, device=dev), torch.full((B,), k, device=dev, dtype=torch.int64),
                torch.full((B,), p, device=dev), torch.full((B,), m, device=dev), raw)
        for ns in (16,):
            us = t(lambda: sample(logits, *args, uniform=u, num_thresholds=ns))
        ref = t(lambda: sample_ref(logits, *args, u))
        print(f"sample B={B} V={V} {name:>14}: triton {us:8.1f} us   torch ref {ref:8.1f} us")
for NT, BS in ((8, 256), (16, 256), (32, 128), (16, 512)):
    B = 256
    logits = torch.randn(B, V, device=dev) * 4
    args = (torch.full((B,), .7, device=dev), torch.full((B,), 20, device=dev, dtype=torch.int64),
            torch.full((B,), .95, device=dev), torch.full((B,), .01, device=dev), torch.zeros(B, dtype=torch.bool, device=dev))
    print(f"NT={NT} block_s={BS}: {t(lambda: sample(logits, *args, uniform=u[:1].expand(B).contiguous(), num_thresholds=NT, block_s=BS)):.1f} us")

Tn, N = 8192, 4096
x = torch.randn(Tn, N, device=dev, dtype=torch.bfloat16); r = torch.randn_like(x); w = torch.randn(N, device=dev, dtype=torch.bfloat16)
out = torch.empty_like(x); ro = torch.empty_like(x)
by = 3 * x.numel() * 2
us = t(lambda: rms_norm(x, w, 1e-6, out=out)); print(f"rms_norm {Tn}x{N} bf16: {us:.1f} us {2*x.numel()*2/us/1e3:.0f} GB/s; torch {t(lambda: rms_norm_ref(x, w, 1e-6)):.1f} us")
us = t(lambda: fused_add_rms_norm(x, r, w, 1e-6, out=out, residual_out=ro)); print(f"fused_add_rms_norm: {us:.1f} us {4*x.numel()*2/us/1e3:.0f} GB/s")
I = 12288
g = torch.randn(Tn, 2 * I, device=dev, dtype=torch.bfloat16); o = torch.empty(Tn, I, device=dev, dtype=torch.bfloat16)
us = t(lambda: silu_and_mul(g, out=o)); print(f"silu_and_mul {Tn}x{2*I}: {us:.1f} us {3*o.numel()*2/us/1e3:.0f} GB/s; torch {t(lambda: F.silu(g[:, :I]) * g[:, I:]):.1f} us")
H, KVH, D = 32, 8, 128
qkv = torch.randn(Tn, (H + 2 * KVH) * D, device=dev, dtype=torch.bfloat16)
q = qkv[:, :H*D].view(Tn, H, D); k = qkv[:, H*D:(H+KVH)*D].view(Tn, KVH, D); v = qkv[:, (H+KVH)*D:].view(Tn, KVH, D)
cos = torch.randn(32768, D, device=dev); sin = torch.randn(32768, D, device=dev)
pos = torch.randint(0, 32768, (Tn,), device=dev)
us = t(lambda: apply_rotary(q, k, pos, cos, sin)); print(f"apply_rotary T={Tn} H={H} KVH={KVH} D={D}: {us:.1f} us {2*(H+KVH)*D*Tn*2/us/1e3:.0f} GB/s")
kp = torch.empty(200000, KVH, D, device=dev, dtype=torch.bfloat16); vp = torch.empty_like(kp)
slots = torch.randperm(200000, device=dev)[:Tn]
us = t(lambda: store_kv(kp, vp, slots, k, v)); print(f"store_kv T={Tn}: {us:.1f} us {4*KVH*D*Tn*2/us/1e3:.0f} GB/s")
