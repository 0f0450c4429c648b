"""Where a trained MTP checkpoint's drafts go wrong on the GPU (issue 22; session 35 saw no draft accepted
on an H100 while the CPU accepts about half): greedy tokens and the head's drafts of the GPU engine (bf16,
CUDA graphs, then float32) against the CPU's torch path in float32, on a few held-out prompts.

    python scripts/diagnose_mtp.py --model /tmp/spec/hybrid --data /tmp/spec/prompts.parquet

Prints, per GPU setting, the share of greedy tokens equal to the CPU's (position by position, up to the
first difference of each prompt) and of the drafts verified at the same positions that are equal, and the
acceptance length. Equal tokens with unequal drafts point at the head's pass; unequal tokens, at the trunk.
"""

from __future__ import annotations

import argparse

import pyarrow.parquet as pq
from transformers import AutoTokenizer

from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.scheduling.mtp_drafts import RecordingMTPDrafter
from rollout_cli.engine.trajectory import PromptInput


def run(model: str, prompts: list, device: str, dtype: str, new_tokens: int, drafts: int) -> tuple[list, dict, object]:
    engine = Engine(model, device=device, dtype=dtype, max_model_len=1024, speculative="mtp", speculative_gate=False,
                    enable_prefix_cache=False)
    log = {}
    engine.scheduler.enable_speculation(RecordingMTPDrafter(log), drafts)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    results = sorted(engine.stream(prompts, params), key=lambda t: t.prompt_index)
    return [t.response_token_ids for t in results], log, engine.scheduler.stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--num-draft-tokens", type=int, default=1)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = pq.read_table(args.data).column("prompt").to_pylist()[: args.num_prompts]
    prompts = [PromptInput(i, tokenizer.encode(t)) for i, t in enumerate(texts)]
    want, want_drafts, want_stats = run(args.model, prompts, "cpu", "float32", args.new_tokens, args.num_draft_tokens)
    print(f"cpu float32 torch: acceptance {want_stats.acceptance_length:.2f}; first response "
          f"{tokenizer.decode(want[0])!r}")
    for dtype in ("bfloat16", "float32"):
        got, drafts, stats = run(args.model, prompts, "cuda", dtype, args.new_tokens, args.num_draft_tokens)
        same = total = 0
        for a, b in zip(got, want):
            agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
            same, total = same + agree, total + len(b)
        shared = drafts.keys() & want_drafts.keys()
        equal = sum(drafts[k] == want_drafts[k] for k in shared)
        print(f"cuda {dtype}: tokens equal up to the first difference {same}/{total}; drafts equal {equal}/"
              f"{len(shared)}; acceptance {stats.acceptance_length:.2f}; {stats.verify_ahead_steps} verify steps "
              f"planned ahead; first response {tokenizer.decode(got[0])!r}")


if __name__ == "__main__":
    main()
