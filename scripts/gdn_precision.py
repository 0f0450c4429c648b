"""Accuracy cost of bf16 intermediates in the chunked Gated DeltaNet prefill, on the CPU (issue 25 item 5).

    python scripts/gdn_precision.py [--quick] [--json FILE] [--threads N] [--heads HV]

Our Triton prefill (kernels/chunk_gated_delta_rule*.py) keeps every intermediate in float32 and,
for bf16 inputs, runs its dots in tf32 (the UT inverse in tf32x3). flash-linear-attention (FLA)
stores the UT inverse, w/u, the per-chunk states h and v_new in bf16 and feeds bf16 operands
to every dot (fp32 accumulation). This script emulates both in plain torch on the CPU, with
rounding done exactly (bf16: `x.to(bfloat16).to(float32)`; tf32: the fp32 mantissa rounded to
10 bits), and measures each against a float64 ground truth of the same chunked math:

  float64     ground truth (every intermediate and dot in float64)
  float32     all intermediates and dots in float32 (our kernels on float32 inputs)
  tf32        our kernels on bf16 inputs: float32 intermediates, every dot's operands rounded to
              tf32 (round to nearest), the inverse itself in full float32 (the kernel's tf32x3)
  tf32_rz     the same with the tf32 operands truncated: most likely what our GPU path does, as
              Triton's plain "tf32" dot hands raw fp32 to the tensor cores, which drop the low 13 bits
              (triton issues 4574, PR 9295: rounding is opt-in); not verified on a GPU here
  fla_bf16    FLA's policy: each intermediate FLA stores or casts in bf16 rounded (all flags below)
  +<flag>     float32 plus ONE of FLA's roundings, to find the one that costs the most:
      qk      L2-normalised q, k in bf16 (FLA's l2norm output; q scaled after the dots)
      beta    the dot operands k*beta, v*beta, k*beta*exp(gc) in bf16 (recompute_w_u, kkt)
      Ainv    the UT inverse (I + A)^-1 stored in bf16 (solve_tril's output)
      wu      w and u stored in bf16
      hs      the per-chunk states h in bf16 (stored, and the operand of w h and q h)
      vnew    v_new in bf16 (stored for o; v_new * decay cast for the state update)
      scores  the (q k^T * decay) operand of the intra-chunk output dot in bf16

Every policy's output o is computed in float32 then delivered in bf16 (the input dtype); the
final state stays float32. Reported per case (length x initial state) against float64:
  o: max / mean |o - o64| in units of u = the bf16 ulp at the RMS of o64 (2^(floor(log2 rms)-7)),
     for the float32 value before the final rounding (o32) and for the delivered bf16 (o16);
     "round" is the unavoidable line: bf16(o64) itself. "!=rn" is the fraction of delivered bf16
     outputs that differ from the correctly rounded bf16(o64).
  S: relative Frobenius error of the final float32 state.
  growth: mean |o32 - o64| / u over each quarter of the sequence, over all heads and over the
     quarter of heads with the slowest decay (the long-memory heads, where a state error lives longest).
Inputs resemble a bf16 Qwen3-Next linear layer (Hk 16, Hv 32, dk = dv = 128): q, k, v ~ N(0, 1)
in bf16, g = -exp(A_log) * softplus(a + dt_bias) (models/gated_deltanet.py) with A_log ~ U(0, log 16)
and dt_bias ~ U(-5, -2) per head, a ~ N(0, 1) (median g ~ -0.12), beta = sigmoid(N(0, 1)) in bf16;
initial state zero ("zero") or the float64 state after a previous 1,024-token prefill ("warm").
Before measuring, the float32 and float64 implementations are checked against the repo's own
reference `chunk_gated_delta_rule_varlen_ref` (kernels/gated_delta_rule.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 64
FLAGS = ("qk", "beta", "Ainv", "wu", "hs", "vnew", "scores")


# ----------------------------------------------------------------------------- rounding


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x (float32 or float64) rounded to the nearest bf16 value (ties to even), same dtype back."""
    return x.to(torch.bfloat16).to(x.dtype)


def round_tf32(x: torch.Tensor, nearest: bool = True) -> torch.Tensor:
    """float32 x with its mantissa cut to tf32's 10 bits: rounded to nearest even, or truncated."""
    bits = x.contiguous().view(torch.int32)
    if nearest:  # add half an ulp (minus one when the kept lsb is 0: ties to even); acts on the magnitude
        bits = bits + (0xFFF + ((bits >> 13) & 1))
    return (bits & ~0x1FFF).view(torch.float32)


@dataclass(frozen=True)
class Policy:
    name: str
    dtype: torch.dtype = torch.float32  # intermediates and dot accumulation
    dot: str = "exact"  # dot operands: "exact" (dtype), "tf32", "tf32_rz"
    bf16: frozenset = frozenset()  # which of FLAGS are rounded to bf16

    def r(self, flag: str, x: torch.Tensor) -> torch.Tensor:
        """x rounded to bf16 if this policy stores/casts intermediate `flag` in bf16."""
        return round_bf16(x) if flag in self.bf16 else x

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b with the policy's dot operands; accumulation in self.dtype (batched matmul)."""
        if self.dot != "exact":
            nearest = self.dot == "tf32"
            a, b = round_tf32(a, nearest), round_tf32(b, nearest)
        return a @ b


def policies() -> list[Policy]:
    out = [Policy("float32"), Policy("tf32", dot="tf32"), Policy("tf32_rz", dot="tf32_rz"),
           Policy("fla_bf16", bf16=frozenset(FLAGS))]
    out += [Policy("+" + f, bf16=frozenset([f])) for f in FLAGS]
    return out


TRUTH = Policy("float64", dtype=torch.float64)


# ----------------------------------------------------------------------------- the chunked forward


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As rollout_kernels.gated_delta_rule.l2norm: x / sqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def to_chunks(x: torch.Tensor, length: int) -> torch.Tensor:
    """[L, H, d] (or [L, H]) -> heads first, zero-padded to whole chunks: [H, N, C, d] (or [H, N, C])."""
    pad = (-length) % CHUNK
    x = x.transpose(0, 1)  # [H, L, ...]
    if x.dim() == 3:
        x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(x.shape[0], -1, CHUNK, x.shape[-1])
    x = F.pad(x, (0, pad))
    return x.reshape(x.shape[0], -1, CHUNK)


def prepare(q, k, v, g, beta, pol: Policy):
    """bf16 inputs q/k [L, Hk, dk], v [L, Hv, dv], beta [L, Hv]; float32 g [L, Hv]
    -> chunked, heads-first tensors in pol.dtype: q, k [Hv, N, C, dk] (L2-normalised, key head
    h // (Hv // Hk) repeated to value head h), v [Hv, N, C, dv], gc, beta [Hv, N, C]."""
    length, Hv = v.shape[0], v.shape[1]
    dt = pol.dtype
    q, k = (t.to(dt).repeat_interleave(Hv // t.shape[1], dim=1) for t in (q, k))
    q, k = pol.r("qk", l2norm(q)), pol.r("qk", l2norm(k))  # FLA's l2norm writes bf16
    q, k, v = (to_chunks(t, length) for t in (q, k, v.to(dt)))
    g, beta = to_chunks(g.to(dt), length), to_chunks(beta.to(dt), length)
    gc = g.cumsum(-1)  # [Hv, N, C] chunk-local cumulative log decay (fp32; fp64 for the truth)
    return q, k, v, gc, beta


def wy_repr(k, v, gc, beta, pol: Policy):
    """k [H, N, C, dk], v [H, N, C, dv], gc/beta [H, N, C] -> (w [H, N, C, dk], u [H, N, C, dv]):
    A = strictly_lower(diag(beta) K K^T * exp(gc_i - gc_j)), w = (I+A)^-1 (beta exp(gc) K), u = (I+A)^-1 (beta V)."""
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril(-1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~strict, float("-inf")).exp()  # [H, N, C, C]
    kb = pol.r("beta", k * beta[..., None])  # [H, N, C, dk]
    a = pol.mm(kb, k.transpose(-1, -2)) * decay  # [H, N, C, C]
    eye = torch.eye(CHUNK, dtype=a.dtype)
    # the inverse in pol.dtype (our kernel: tf32x3 ~ float32; FLA's solve_tril: ieee fp32), then stored
    inv = pol.r("Ainv", torch.linalg.solve_triangular(a + eye, eye.expand_as(a), upper=False, unitriangular=True))
    vb = pol.r("beta", v * beta[..., None])
    kbg = pol.r("beta", k * (beta * gc.exp())[..., None])
    return pol.r("wu", pol.mm(inv, kbg)), pol.r("wu", pol.mm(inv, vb))


def chunked_forward(q, k, v, g, beta, h0, pol: Policy):
    """The chunked gated delta rule (chunk_gated_delta_rule_kernels.py docstring) under policy pol.
    q/k [L, Hk, dk], v [L, Hv, dv], beta [L, Hv] bf16; g [L, Hv] float32; h0 [Hv, dk, dv] float32
    -> (o [L, Hv, dv] in pol.dtype, before any output rounding; final state [Hv, dk, dv] in pol.dtype)."""
    length, dk = v.shape[0], q.shape[-1]
    scale = dk ** -0.5
    q, k, v, gc, beta = prepare(q, k, v, g, beta, pol)
    w, u = wy_repr(k, v, gc, beta, pol)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    state = h0.to(pol.dtype).clone()  # [H, dk, dv], the running state (registers: never rounded)
    out = torch.empty_like(v)  # [H, N, C, dv]
    for i in range(q.shape[1]):
        qi, ki, gi = q[:, i], k[:, i], gc[:, i]  # [H, C, dk], [H, C, dk], [H, C]
        s_op = pol.r("hs", state)  # the stored h of this chunk: what its dots read
        v_new = u[:, i] - pol.mm(w[:, i], s_op)  # [H, C, dv]: writes corrected by the old state
        decay = (gi[:, :, None] - gi[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, C, C]
        v_op = pol.r("vnew", v_new)
        if "qk" in pol.bf16:  # FLA's order: bf16 q in the dots, exp(gc) and scale applied after
            o = pol.mm(qi, s_op) * gi.exp()[..., None]
            o = (o + pol.mm(pol.r("scores", pol.mm(qi, ki.transpose(-1, -2)) * decay), v_op)) * scale
        else:  # ours: q scaled (and decayed) before the dots
            qs = qi * scale
            o = pol.mm(qs * gi.exp()[..., None], s_op)
            o = o + pol.mm(pol.r("scores", pol.mm(qs, ki.transpose(-1, -2)) * decay), v_op)
        out[:, i] = o
        g_last = gi[:, -1]  # [H]
        to_end = (g_last[:, None] - gi).exp()[..., None]  # [H, C, 1] decay from each position to the chunk end
        if "vnew" in pol.bf16:  # FLA: the decayed v_new is cast to bf16, k stays as is
            upd = pol.mm(ki.transpose(-1, -2), pol.r("vnew", v_new * to_end))
        else:  # ours: the decay on k, v_new in float32
            upd = pol.mm((ki * to_end).transpose(-1, -2), v_new)
        state = state * g_last.exp()[:, None, None] + upd  # [H, dk, dv]
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1)  # [L, H, dv]
    return out, state


# ----------------------------------------------------------------------------- inputs


def gating_params(Hv: int, gen: torch.Generator):
    """Per value head: A_log ~ U(0, log 16), dt_bias ~ U(-5, -2) -> ([Hv], [Hv]) float32."""
    a_log = torch.rand(Hv, generator=gen) * math.log(16.0)
    dt_bias = torch.rand(Hv, generator=gen) * 3.0 - 5.0
    return a_log, dt_bias


def make_inputs(length: int, Hk: int, Hv: int, d: int, gating, gen: torch.Generator):
    """-> q, k [L, Hk, d], v [L, Hv, d], beta [L, Hv] in bf16; g [L, Hv] float32 (<= 0)."""
    a_log, dt_bias = gating
    q = torch.randn(length, Hk, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(length, Hk, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(length, Hv, d, generator=gen).to(torch.bfloat16)
    a = torch.randn(length, Hv, generator=gen).to(torch.bfloat16).float()  # the projection's a, in bf16
    b = torch.randn(length, Hv, generator=gen).to(torch.bfloat16)
    g = -a_log.exp() * F.softplus(a + dt_bias)  # as GatedDeltaNet._gating: float32
    return q, k, v, g, b.sigmoid()


# ----------------------------------------------------------------------------- checks and metrics


def check_against_repo(gen: torch.Generator) -> dict:
    """Our float32 and float64 forwards against the repo's chunk_gated_delta_rule_varlen_ref (float32 math)
    on a small case with a ragged last chunk and a nonzero initial state; asserts agreement to ~1e-5."""
    from rollout_kernels.gated_delta_rule import chunk_gated_delta_rule_varlen_ref

    Hk, Hv, d, length = 2, 4, 32, 200
    q, k, v, g, beta = make_inputs(length, Hk, Hv, d, gating_params(Hv, gen), gen)
    h0 = torch.randn(Hv, d, d, generator=gen) * 0.1
    states = h0[None].clone()
    ref = chunk_gated_delta_rule_varlen_ref(q.float(), k.float(), v.float(), g, beta.float(), states,
                                            torch.tensor([0]), [0, length])  # float32 in -> float32 o
    result = {}
    for pol in (Policy("float32"), TRUTH):
        o, s = chunked_forward(q, k, v, g, beta, h0, pol)
        err_o = (o.double() - ref.double()).abs().max().item() / ref.abs().max().item()
        err_s = (s.double() - states[0].double()).abs().max().item() / states.abs().max().item()
        assert err_o < 1e-5 and err_s < 1e-5, f"{pol.name} disagrees with the repo reference: {err_o}, {err_s}"
        result[pol.name] = {"o_max_rel": err_o, "state_max_rel": err_s}
    return result


def bf16_unit(o64: torch.Tensor) -> float:
    """The bf16 ulp at the RMS magnitude of o64: 2^(floor(log2 rms) - 7)."""
    rms = o64.pow(2).mean().sqrt().item()
    return 2.0 ** (math.floor(math.log2(rms)) - 7)


def o_metrics(o: torch.Tensor, o64: torch.Tensor, unit: float, slow: torch.Tensor) -> dict:
    """o, o64 [L, H, dv]; slow [H // 4] the slowest-decaying heads -> max/mean |o - o64| in units,
    relative Frobenius error, growth over quarters of the sequence (all heads and slow heads)."""
    err = (o.double() - o64).abs()
    return {"max_u": err.max().item() / unit, "mean_u": err.mean().item() / unit,
            "rel": ((o.double() - o64).norm() / o64.norm()).item(),
            "quarters_mean_u": [x.mean().item() / unit for x in err.chunk(4, dim=0)],
            "slow_quarters_mean_u": [x.mean().item() / unit for x in err[:, slow].chunk(4, dim=0)]}


def slow_heads(gating) -> torch.Tensor:
    """The quarter of value heads with the slowest typical decay exp(A_log) * softplus(dt_bias) -> [Hv // 4]."""
    a_log, dt_bias = gating
    rate = a_log.exp() * F.softplus(dt_bias)
    return rate.argsort()[:max(1, rate.numel() // 4)]


def run_case(length: int, warm: bool, Hk: int, Hv: int, d: int, gating, seed: int, pols) -> dict:
    """One sequence of `length` tokens from a zero or warm state, every policy against float64."""
    gen = torch.Generator().manual_seed(seed)
    h0 = torch.zeros(Hv, d, d)
    if warm:  # the state a previous 1,024-token prefill leaves, stored float32
        _, h0 = chunked_forward(*make_inputs(1024, Hk, Hv, d, gating, gen), h0, TRUTH)
        h0 = h0.float()
    q, k, v, g, beta = make_inputs(length, Hk, Hv, d, gating, gen)
    t0 = time.time()
    o64, s64 = chunked_forward(q, k, v, g, beta, h0, TRUTH)
    unit, slow = bf16_unit(o64), slow_heads(gating)
    o_rn = round_bf16(o64)  # the unavoidable error: float64 o rounded to the output dtype
    case = {"length": length, "init": "warm" if warm else "zero", "unit": unit,
            "o_rms": o64.pow(2).mean().sqrt().item(), "state_rms": s64.pow(2).mean().sqrt().item(),
            "h0_rms": h0.pow(2).mean().sqrt().item(), "round": o_metrics(o_rn, o64, unit, slow),
            "policies": {}}
    for pol in pols:
        o, s = chunked_forward(q, k, v, g, beta, h0, pol)
        o16 = round_bf16(o.float())  # delivered in bf16
        case["policies"][pol.name] = {
            "o32": o_metrics(o, o64, unit, slow), "o16": o_metrics(o16, o64, unit, slow),
            "not_rn": (o16.double() != o_rn).double().mean().item(),
            "state_rel": ((s.double() - s64).norm() / s64.norm()).item(),
            "state_max_rel": ((s.double() - s64).abs().max() / s64.abs().max()).item(),
            "slow_state_rel": ((s[slow].double() - s64[slow]).norm() / s64[slow].norm()).item()}
    case["seconds"] = time.time() - t0
    return case


# ----------------------------------------------------------------------------- report


def print_case(case: dict) -> None:
    r = case["round"]
    print(f"\n== L={case['length']} init={case['init']}  unit u={case['unit']:.3g} (o rms {case['o_rms']:.3g}), "
          f"state rms {case['state_rms']:.3g}, h0 rms {case['h0_rms']:.3g}, {case['seconds']:.0f}s")
    print(f"{'policy':10} {'o32 max/u':>9} {'o32 mean/u':>10} {'o16 max/u':>9} {'o16 mean/u':>10} {'o16 rel':>8}"
          f" {'!=rn':>6} {'S rel':>8} {'S maxrel':>8}  o32 mean/u per quarter: all heads | slow heads")
    print(f"{'round':10} {'':>9} {'':>10} {r['max_u']:9.3f} {r['mean_u']:10.4f} {r['rel']:8.2e} {0:6.3f}")
    for name, p in case["policies"].items():
        a, b = p["o32"], p["o16"]
        qs = " ".join(f"{x:.3g}" for x in a["quarters_mean_u"]) + " | " + " ".join(
            f"{x:.3g}" for x in a["slow_quarters_mean_u"])
        print(f"{name:10} {a['max_u']:9.3f} {a['mean_u']:10.4f} {b['max_u']:9.3f} {b['mean_u']:10.4f} {b['rel']:8.2e}"
              f" {p['not_rn']:6.3f} {p['state_rel']:8.2e} {p['state_max_rel']:8.2e}  {qs}")


def print_summary(cases: list[dict]) -> None:
    """One line per policy: o32 mean/u and final-state relative error per case."""
    heads = [f"{c['length']}{c['init'][0]}" for c in cases]
    print("\n== summary: mean |o - o64| / u (u: bf16 ulp at rms o) of o32 (before the output rounding) and of the"
          "\n   delivered bf16 o16 (round: bf16(o64)), and the final state's relative error; z: zero h0, w: warm h0")
    print(f"{'policy':9}" + " ".join(f"{h:>6}" for h in heads) + " |" + " ".join(f"{h:>6}" for h in heads)
          + " |" + " ".join(f"{h:>8}" for h in heads))
    print(f"{'round':9}" + " ".join(f"{'':>6}" for c in cases) + " |"
          + " ".join(f"{c['round']['mean_u']:6.3f}" for c in cases) + " |")
    for name in cases[0]["policies"]:
        ps = [c["policies"][name] for c in cases]
        print(f"{name:9}" + " ".join(f"{p['o32']['mean_u']:6.3f}" for p in ps) + " |"
              + " ".join(f"{p['o16']['mean_u']:6.3f}" for p in ps) + " |"
              + " ".join(f"{p['state_rel']:8.1e}" for p in ps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="Hv 4, lengths 256 and 1024")
    ap.add_argument("--json", help="save all numbers here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=None, help="value heads (key heads = half); default 32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Hv = args.heads or (4 if args.quick else 32)
    Hk, d = max(1, Hv // 2), 128
    lengths = [256, 1024] if args.quick else [256, 1024, 4096]
    start = time.time()
    check = check_against_repo(torch.Generator().manual_seed(args.seed))
    print("check vs chunk_gated_delta_rule_varlen_ref (max rel): "
          + ", ".join(f"{k}: o {v['o_max_rel']:.1e}, state {v['state_max_rel']:.1e}" for k, v in check.items()))
    gating = gating_params(Hv, torch.Generator().manual_seed(args.seed + 1))
    g_sample = make_inputs(4096, Hk, Hv, 8, gating, torch.Generator().manual_seed(args.seed + 2))[3]
    qs = g_sample.flatten().quantile(torch.tensor([0.01, 0.25, 0.5, 0.75, 0.99])).tolist()
    print(f"Hk {Hk}, Hv {Hv}, dk = dv = {d}; g quantiles 1/25/50/75/99%: " + " ".join(f"{x:.3g}" for x in qs))
    pols = policies()
    cases = []
    for length in lengths:
        for warm in (False, True):
            cases.append(run_case(length, warm, Hk, Hv, d, gating, args.seed + 10 * length + warm, pols))
            print_case(cases[-1])
    print_summary(cases)
    total = time.time() - start
    print(f"\ntotal {total:.0f}s on {args.threads} thread(s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"Hk": Hk, "Hv": Hv, "d": d, "g_quantiles": qs, "check": check, "cases": cases,
                       "seconds": total}, f, indent=1)


if __name__ == "__main__":
    main()
