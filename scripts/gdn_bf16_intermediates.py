"""Study (issue 25 item 5): what flash-linear-attention's bf16 intermediates cost in the chunked
Gated DeltaNet prefill, against our float32 path, the exact sequential recurrence, and in logprobs.

    python scripts/gdn_bf16_intermediates.py ops   [--heads 32] [--lengths 256 1024 4096]
    python scripts/gdn_bf16_intermediates.py model [--layers 4] [--tokens 4096]

`fla_chunk_bf16` is a plain-torch copy of FLA's forward (fla-org/flash-linear-attention bc3b101d:
gated_delta_rule/chunk.py, chunk_fwd.py, wy_fast.py, common/chunk_delta_h.py, common/chunk_o.py) that
rounds to bf16 exactly where FLA stores or casts to bf16 (its tensors take k's dtype), with
bf16-valued operands in float32 matmuls standing for bf16 tensor-core dots with float32 accumulation
(the products of two bf16 are exact in float32; only the summation order differs):
  q, k       l2norm_fwd computes in float32 and writes bf16 (use_qk_l2norm_in_kernel)
  A          k k^T (bf16 dot), then * exp(g_i - g_j) * beta_i in float32 (fused kkt + solve_tril kernel)
  (I+A)^-1   16 x 16 diagonal blocks by float32 substitution, the blocks below merged with tf32 dots
             (operands truncated to tf32: Triton feeds raw float32 to the tensor cores), stored bf16
  u, w       A^-1 (bf16) @ bf16(v * beta), A^-1 @ bf16(bf16(k * beta) * exp(g)), stored bf16
  h          the running state stays float32 in registers; each chunk's h is stored in bf16 and is
             the operand of w h and q h
  v_new      u - w h in float32, stored bf16 (for o); the state update's operand is
             bf16(v_new * exp(g_last - g)), and k (bf16)
  o          (q h) * exp(g) * scale + bf16(lower(q k^T * exp(g_i - g_j))) @ v_new * scale, stored bf16
The final state is float32. g's chunk cumsum is float32 (FLA's in log2 units; same values to float32
rounding). With `bf16=False` it is the same chunked math in float32: checked against our reference first.

`ops`: per length, one sequence from a zero state, Qwen3-Next's linear-layer shape (Hk 16, Hv 32,
dk = dv = 128, recipes/configs/qwen3-next-80b-a3b-12l), inputs as scripts/gdn_precision.py makes them
(q, k, v ~ N(0, 1) in bf16, L2-normalised in the kernel; g = -exp(A_log) softplus(a + dt_bias) in
float32; beta = sigmoid in bf16). Variants, each delivering o in bf16:
  round       bf16(o of the float32 chunked reference): the output's own rounding, the floor
  ours_f32    our float32 chunked reference (kernels/gated_delta_rule.chunk_gated_delta_rule_ref) fed
              the bf16 inputs: what our Triton prefill computes, but with full float32 dots
  ours_tf32rz the same with every dot's operands truncated to tf32 and the inverse in float32
              (gdn_precision's tf32_rz: our Triton kernel on bf16 inputs, as emulated there)
  fla_bf16    FLA's bf16 intermediates (above)
against f32 (the float32 chunked reference, o before rounding), seq (recurrent_gated_delta_rule_ref:
the exact sequential recurrence in float32, the on-policy mode's prefill math) and f64 (the chunked
math in float64, gdn_precision's truth). Printed: max |o - ref|, relative Frobenius error of o, and
the same for the final state.

`model`: teacher-forced logprobs of a random Qwen3-Next slice (recipes/configs/qwen3-next-dense-mlp-12l
cut to --layers layers, every 4th full attention, vocab 32,768, HF's init with the final norm x 8 as
scripts/random_checkpoint.py does) through our engine's score(): one sample of --tokens tokens
(64 prompt + the rest scored) on the CPU torch path, with the chunked prefill's reference
(rollout_kernels.gated_delta_rule.chunk_gated_delta_rule_varlen_ref) monkeypatched. Runs: the model
in float32 or bf16 x the prefill float32 (ours), tf32rz (ours on the GPU), FLA's bf16
intermediates, or the sequential recurrence; printed: mean / p99 / max |logprob difference| between
pairs of runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch

from rollout_kernels import gated_delta_rule as gdr
from rollout_kernels.gated_delta_rule import (chunk_gated_delta_rule_ref, l2norm,
                                              recurrent_gated_delta_rule_ref)


def _script(name: str):
    """Import a sibling script (scripts/ is not a package) as a module."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


prec = _script("gdn_precision")  # make_inputs, gating_params, round_bf16, round_tf32, Policy, chunked_forward

CHUNK = 64
SUB = 16  # FLA's fused kkt + solve_tril: 16 x 16 diagonal blocks (BC)


def _heads_first_chunks(x: torch.Tensor, length: int) -> torch.Tensor:
    """[L, H, d] or [L, H] -> zero-padded, heads first: [H, N, C, d] or [H, N, C]."""
    return prec.to_chunks(x, length)


def _unit_lower_inverse_fla(a: torch.Tensor, rnd) -> torch.Tensor:
    """(I + a)^-1 for a [..., C, C] strictly lower, as FLA's fused kernel: float32 forward substitution on
    the SUB x SUB diagonal blocks, the blocks below by block forward substitution with tf32 dots
    (Ai_ij = -Ai_ii sum_{j <= m < i} a_im Ai_mj); `rnd` rounds dot operands (tf32, or identity)."""
    C = a.shape[-1]
    nb = C // SUB
    eye = torch.eye(SUB, dtype=a.dtype)
    blocks = [[None] * nb for _ in range(nb)]
    for i in range(nb):
        d = a[..., i * SUB:(i + 1) * SUB, i * SUB:(i + 1) * SUB]
        blocks[i][i] = torch.linalg.solve_triangular(d + eye, eye.expand_as(d), upper=False, unitriangular=True)
    for i in range(1, nb):
        for j in range(i - 1, -1, -1):
            acc = 0
            for m in range(j, i):
                acc = acc + rnd(a[..., i * SUB:(i + 1) * SUB, m * SUB:(m + 1) * SUB]) @ rnd(blocks[m][j])
            blocks[i][j] = -(rnd(blocks[i][i]) @ rnd(acc))
    zero = torch.zeros_like(blocks[0][0])
    return torch.cat([torch.cat([blocks[i][j] if j <= i else zero for j in range(nb)], -1) for i in range(nb)], -2)


def fla_chunk_bf16(q, k, v, g, beta, h0, bf16: bool = True):
    """One sequence: q/k [L, Hk, dk], v [L, Hv, dv], beta [L, Hv] (bf16 or float32); g [L, Hv] float32;
    h0 [Hv, dk, dv] float32 -> (o [L, Hv, dv] float32, the value FLA would store before its cast; final
    state [Hv, dk, dv] float32). bf16=True rounds where FLA does (module docstring); False: all float32."""
    r = prec.round_bf16 if bf16 else (lambda x: x)
    tf32 = (lambda x: prec.round_tf32(x.contiguous(), nearest=False)) if bf16 else (lambda x: x)
    length, Hv, dk = v.shape[0], v.shape[1], q.shape[-1]
    scale = dk ** -0.5
    q, k = (t.float().repeat_interleave(Hv // t.shape[1], dim=1) for t in (q, k))
    q, k = r(l2norm(q)), r(l2norm(k))  # l2norm_fwd: float32 math, written in k's dtype
    q, k, v = (_heads_first_chunks(t, length) for t in (q, k, v.float()))  # [H, N, C, d]
    g, beta = _heads_first_chunks(g.float(), length), _heads_first_chunks(beta.float(), length)  # [H, N, C]
    gc = g.cumsum(-1)  # chunk-local cumsum, float32; padding adds 0 so g_last is the last real token's
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    diff = gc[..., :, None] - gc[..., None, :]  # [H, N, C, C]
    # fused kkt + solve_tril: bf16 dot, then gate and beta in float32; the inverse stored in k's dtype
    a = (k @ k.transpose(-1, -2)) * diff.masked_fill(~strict, float("-inf")).exp() * beta[..., :, None]
    inv = r(_unit_lower_inverse_fla(a, tf32))
    # recompute_w_u: the operands cast to bf16 before the dots (v * beta: bf16 x bf16 -> bf16)
    u = r(inv @ r(v * beta[..., None]))
    w = r(inv @ r(r(k * beta[..., None]) * gc.exp()[..., None]))
    decay_qk = diff.masked_fill(~causal, float("-inf")).exp()
    state = h0.float().clone()  # [H, dk, dv], float32 in registers
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        qi, ki, gi = q[:, i], k[:, i], gc[:, i]
        h = r(state)  # chunk_delta_h stores h in k's dtype; w h and q h read it
        v_new = u[:, i] - w[:, i] @ h  # float32
        v_store = r(v_new)  # v_new, written in u's dtype: chunk_o's operand
        g_last = gi[:, -1]
        v_dec = r(v_new * (g_last[:, None] - gi).exp()[..., None])  # b_v.to(k.dtype) before the dot
        state = state * g_last.exp()[:, None, None] + ki.transpose(-1, -2) @ v_dec
        # chunk_fwd_o: (q h) exp(g) and the gated, causal q k^T (cast to bf16) times v_new; scale last
        scores = r((qi @ ki.transpose(-1, -2)) * decay_qk[:, i])
        out[:, i] = ((qi @ h) * gi.exp()[..., None]) * scale + (scores @ v_store) * scale
    out = out.reshape(Hv, -1, out.shape[-1])[:, :length].transpose(0, 1)  # [L, H, dv]
    return out, state


def fla_chunk_bf16_varlen(q, k, v, g, beta, ssm_states, state_indices, cu_seqlens, chunk_size=64,
                          use_qk_l2norm=True):
    """chunk_gated_delta_rule_varlen_ref's contract with FLA's bf16 intermediates (for the model runs)."""
    assert chunk_size == CHUNK and use_qk_l2norm
    out = torch.empty_like(v)
    for b, slot in enumerate(state_indices.tolist()):
        s, e = cu_seqlens[b], cu_seqlens[b + 1]
        if e > s:
            o, final = fla_chunk_bf16(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], ssm_states[slot])
            out[s:e] = o.to(out.dtype)
            ssm_states[slot] = final
    return out


def tf32rz_varlen(q, k, v, g, beta, ssm_states, state_indices, cu_seqlens, chunk_size=64, use_qk_l2norm=True):
    """The same contract with gdn_precision's tf32_rz policy (our Triton prefill on bf16 inputs, emulated)."""
    pol = prec.Policy("tf32_rz", dot="tf32_rz")
    out = torch.empty_like(v)
    for b, slot in enumerate(state_indices.tolist()):
        s, e = cu_seqlens[b], cu_seqlens[b + 1]
        if e > s:
            o, final = prec.chunked_forward(q[s:e], k[s:e], v[s:e], g[s:e].float(), beta[s:e], ssm_states[slot], pol)
            out[s:e] = o.to(out.dtype)
            ssm_states[slot] = final
    return out


def recurrent_varlen(q, k, v, g, beta, ssm_states, state_indices, cu_seqlens, chunk_size=64, use_qk_l2norm=True):
    """The same contract with the exact sequential recurrence (the on-policy mode's prefill math)."""
    out = torch.empty_like(v)
    for b, slot in enumerate(state_indices.tolist()):
        s, e = cu_seqlens[b], cu_seqlens[b + 1]
        if e > s:
            o, final = recurrent_gated_delta_rule_ref(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e],
                                                      beta[None, s:e], ssm_states[slot][None], use_qk_l2norm)
            out[s:e] = o[0]
            ssm_states[slot] = final[0]
    return out


# ----------------------------------------------------------------------------- ops


def check_emulation() -> float:
    """fla_chunk_bf16(bf16=False) against our float32 chunked reference (ragged chunk, nonzero h0)."""
    gen = torch.Generator().manual_seed(7)
    Hk, Hv, d, length = 2, 4, 32, 200
    q, k, v, g, beta = prec.make_inputs(length, Hk, Hv, d, prec.gating_params(Hv, gen), gen)
    h0 = torch.randn(Hv, d, d, generator=gen) * 0.1
    o_ref, s_ref = chunk_gated_delta_rule_ref(q.float(), k.float(), v.float(), g, beta.float(), h0)
    o, s = fla_chunk_bf16(q, k, v, g, beta, h0, bf16=False)
    err = max((o - o_ref).abs().max().item() / o_ref.abs().max().item(),
              (s - s_ref).abs().max().item() / s_ref.abs().max().item())
    assert err < 1e-5, f"the emulation's float32 mode disagrees with chunk_gated_delta_rule_ref: {err}"
    return err


def errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """-> (max |x - ref|, ||x - ref|| / ||ref||)."""
    d = x.double() - ref.double()
    return d.abs().max().item(), (d.norm() / ref.double().norm()).item()


def run_ops(args) -> dict:
    Hv, d = args.heads, 128
    Hk = max(1, Hv // 2)
    print(f"emulation check (float32 mode vs chunk_gated_delta_rule_ref, max rel): {check_emulation():.1e}")
    gating = prec.gating_params(Hv, torch.Generator().manual_seed(args.seed + 1))
    results = []
    for length in args.lengths:
        t0 = time.time()
        gen = torch.Generator().manual_seed(args.seed + length)
        q, k, v, g, beta = prec.make_inputs(length, Hk, Hv, d, gating, gen)  # bf16 (g float32)
        h0 = torch.zeros(Hv, d, d)
        o32, s32 = chunk_gated_delta_rule_ref(q.float(), k.float(), v.float(), g, beta.float(), h0)
        oseq, sseq = recurrent_gated_delta_rule_ref(q.float()[None], k.float()[None], v.float()[None], g[None],
                                                    beta.float()[None], h0[None])
        oseq, sseq = oseq[0], sseq[0]
        o64, s64 = prec.chunked_forward(q, k, v, g, beta, h0, prec.TRUTH)
        o_tf, s_tf = prec.chunked_forward(q, k, v, g, beta, h0, prec.Policy("tf32_rz", dot="tf32_rz"))
        o_fla, s_fla = fla_chunk_bf16(q, k, v, g, beta, h0)
        variants = {  # o delivered in bf16, final state float32
            "round": (o32.to(torch.bfloat16), s32),
            "ours_f32": chunk_gated_delta_rule_ref(q, k, v, g, beta, h0),  # bf16 in -> bf16 o
            "ours_tf32rz": (o_tf.float().to(torch.bfloat16), s_tf),
            "fla_bf16": (o_fla.to(torch.bfloat16), s_fla),
        }
        refs = {"f32": (o32, s32), "seq": (oseq, sseq), "f64": (o64, s64)}
        case = {"length": length, "o_rms": o64.pow(2).mean().sqrt().item(),
                "state_rms": s64.pow(2).mean().sqrt().item(),
                "f32_vs_seq": {"o": errors(o32, oseq), "state": errors(s32, sseq)}, "variants": {}}
        for name, (o, s) in variants.items():
            case["variants"][name] = {ref: {"o": errors(o, ro), "state": errors(s, rs)}
                                      for ref, (ro, rs) in refs.items()}
        case["seconds"] = time.time() - t0
        results.append(case)
        print_ops_case(case)
    return {"Hk": Hk, "Hv": Hv, "d": d, "cases": results}


def print_ops_case(case: dict) -> None:
    f = case["f32_vs_seq"]
    print(f"\n== L={case['length']}: o rms {case['o_rms']:.3g}, state rms {case['state_rms']:.3g}; float32 chunked"
          f" vs sequential (before output rounding): o max {f['o'][0]:.2e} rel {f['o'][1]:.2e}, state max"
          f" {f['state'][0]:.2e} rel {f['state'][1]:.2e} ({case['seconds']:.0f}s)")
    print(f"{'variant':12} {'ref':4} {'o max':>9} {'o rel':>9} {'S max':>9} {'S rel':>9}")
    for name, per_ref in case["variants"].items():
        for ref, e in per_ref.items():
            print(f"{name:12} {ref:4} {e['o'][0]:9.2e} {e['o'][1]:9.2e} {e['state'][0]:9.2e} {e['state'][1]:9.2e}")


# ----------------------------------------------------------------------------- model


PREFILLS = {"f32": None, "tf32rz": tf32rz_varlen, "fla": fla_chunk_bf16_varlen, "seq": recurrent_varlen}


def make_checkpoint(layers: int, vocab: int, out_dir: str) -> str:
    """A random bf16 Qwen3-Next slice (dense MLP) of `layers` layers: scripts/random_checkpoint.py's recipe."""
    import transformers

    cfg_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "configs",
                           "qwen3-next-dense-mlp-12l")
    with open(os.path.join(cfg_dir, "config.json")) as fh:
        cfg = json.load(fh)
    cfg.update(num_hidden_layers=layers, vocab_size=vocab, mlp_only_layers=list(range(layers)),
               bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    cfg.pop("layer_types", None)
    tmp_cfg = os.path.join(out_dir, "cfg")
    os.makedirs(tmp_cfg, exist_ok=True)
    with open(os.path.join(tmp_cfg, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    config = transformers.AutoConfig.from_pretrained(tmp_cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)  # realistic logit spread (random_checkpoint.py's default)
    ckpt = os.path.join(out_dir, "ckpt")
    model.save_pretrained(ckpt)
    return ckpt


def score_run(ckpt: str, dtype: str, prefill: str, prompt: list[int], response: list[int]) -> list[float]:
    from rollout_cli import Engine, SamplingParams
    from rollout_cli.engine.trajectory import ScoreInput

    original = gdr.chunk_gated_delta_rule_varlen_ref
    if PREFILLS[prefill] is not None:
        gdr.chunk_gated_delta_rule_varlen_ref = PREFILLS[prefill]
    try:
        total = len(prompt) + len(response)
        engine = Engine(model=ckpt, device="cpu", dtype=dtype, max_model_len=total + 8, max_batch_tokens=total + 8,
                        max_running=1)
        (score,) = list(engine.score([ScoreInput(0, 0, prompt, response)], SamplingParams(temperature=1.0)))
    finally:
        gdr.chunk_gated_delta_rule_varlen_ref = original
    return score.response_logprobs


def run_model(args) -> dict:
    import random

    rng = random.Random(args.seed)
    tokens = [rng.randrange(args.vocab) for _ in range(args.tokens)]
    prompt, response = tokens[:64], tokens[64:]
    runs = [("float32", "f32"), ("float32", "fla"), ("bfloat16", "f32"), ("bfloat16", "tf32rz"),
            ("bfloat16", "fla"), ("bfloat16", "seq")]
    logprobs = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        ckpt = make_checkpoint(args.layers, args.vocab, tmp)
        print(f"checkpoint: {args.layers} layers, vocab {args.vocab} ({time.time() - t0:.0f}s)")
        for dtype, prefill in runs:
            t0 = time.time()
            lp = torch.tensor(score_run(ckpt, dtype, prefill, prompt, response), dtype=torch.float64)
            logprobs[f"{dtype}/{prefill}"] = lp
            print(f"  {dtype:8} {prefill:6} mean logprob {lp.mean().item():.4f} ({time.time() - t0:.0f}s)")
    pairs = [("bfloat16/f32", "float32/f32", "bf16 model, our float32 prefill vs all-float32 (bf16 elsewhere)"),
             ("float32/fla", "float32/f32", "float32 model, FLA bf16 prefill vs float32 prefill (the kernel alone)"),
             ("bfloat16/fla", "bfloat16/f32", "bf16 model, FLA bf16 prefill vs our float32 prefill (the switch)"),
             ("bfloat16/tf32rz", "bfloat16/f32", "bf16 model, tf32rz (our GPU kernel) vs float32 prefill"),
             ("bfloat16/fla", "bfloat16/tf32rz", "bf16 model, FLA bf16 prefill vs tf32rz"),
             ("bfloat16/seq", "bfloat16/f32", "bf16 model, sequential (on-policy) vs float32 chunked prefill"),
             ("bfloat16/fla", "float32/f32", "bf16 model + FLA bf16 prefill vs all-float32"),
             ("bfloat16/tf32rz", "float32/f32", "bf16 model + tf32rz vs all-float32")]
    print(f"\n|logprob difference| over {len(response)} teacher-forced tokens:")
    print(f"{'run':18} {'vs':18} {'mean':>9} {'p99':>9} {'max':>9}  what")
    table = []
    for a, b, what in pairs:
        d = (logprobs[a] - logprobs[b]).abs()
        row = {"run": a, "vs": b, "mean": d.mean().item(), "p99": d.quantile(0.99).item(), "max": d.max().item(),
               "what": what}
        table.append(row)
        print(f"{a:18} {b:18} {row['mean']:9.2e} {row['p99']:9.2e} {row['max']:9.2e}  {what}")
    return {"layers": args.layers, "vocab": args.vocab, "tokens": args.tokens, "pairs": table,
            "mean_logprob": {k: v.mean().item() for k, v in logprobs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["ops", "model"])
    ap.add_argument("--heads", type=int, default=32, help="ops: value heads (key heads = half)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096], help="ops: sequence lengths")
    ap.add_argument("--layers", type=int, default=4, help="model: layers (every 4th full attention)")
    ap.add_argument("--tokens", type=int, default=4096, help="model: prompt (64) + scored tokens")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="save the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    result = run_ops(args) if args.what == "ops" else run_model(args)
    print(f"\ntotal {time.time() - start:.0f}s on {args.threads} thread(s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
