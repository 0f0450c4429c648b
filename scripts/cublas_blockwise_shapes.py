"""Which shapes cuBLASLt's blockwise-scaled FP8 GEMM (torch._scaled_mm, 1x128 activation and 128x128
weight scales) gets right here: each (M, N, K) against the torch reference, max abs error over max abs
value. cuBLAS documents 128x128 scales as [ceil(K / 128) rounded up to 4, N / 128], K-major."""
import torch

from rollout_kernels.fp8_blockwise import BLOCK, quantize_activation, quantize_weight_blockwise
from rollout_kernels.fp8_blockwise_ref import fp8_blockwise_matmul_ref

device = torch.device("cuda", 0)
gen = torch.Generator(device=device).manual_seed(0)
for m, n, k in ((128, 256, 256), (128, 256, 512), (128, 256, 640), (128, 256, 1024), (77, 384, 1024),
                (129, 512, 2048), (256, 6144, 4096), (256, 4096, 12288), (128, 1024, 3072)):
    x_q, x_scale = quantize_activation(torch.randn(m, k, device=device, generator=gen), BLOCK, True)
    w_q, w_scale = quantize_weight_blockwise(torch.randn(n, k, device=device, generator=gen) * 0.05)
    want = fp8_blockwise_matmul_ref(x_q, x_scale, w_q, w_scale, torch.float32)
    try:
        got = torch._scaled_mm(x_q, w_q.t(), x_scale, w_scale.t(), out_dtype=torch.bfloat16).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(f"M={m} N={n} K={k} (K blocks {k // BLOCK}): relative max error {err:.2e}")
    except RuntimeError as e:
        print(f"M={m} N={n} K={k}: {str(e).splitlines()[0][:150]}")

# Rows not a multiple of 4: the activation scales with their leading dimension padded to a multiple of 4.
for m in (77, 129):
    k, n = 1024, 512
    x_q, x_scale = quantize_activation(torch.randn(m, k, device=device, generator=gen), BLOCK, True)
    w_q, w_scale = quantize_weight_blockwise(torch.randn(n, k, device=device, generator=gen) * 0.05)
    padded = torch.zeros(k // BLOCK, (m + 3) // 4 * 4, device=device)
    padded[:, :m] = x_scale.t()
    want = fp8_blockwise_matmul_ref(x_q, x_scale, w_q, w_scale, torch.float32)
    try:
        got = torch._scaled_mm(x_q, w_q.t(), padded[:, :m].t(), w_scale.t(), out_dtype=torch.bfloat16).float()
        print(f"M={m} padded scale stride {padded[:, :m].t().stride()}: error {((got - want).abs().max() / want.abs().max()).item():.2e}")
    except RuntimeError as e:
        print(f"M={m} padded: {str(e).splitlines()[0][:150]}")
