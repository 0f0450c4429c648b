"""The host's work per engine step on the CPU, under cProfile: where planning, post-processing and the drafters
spend their time, with and without speculation. The model's forward runs too (the torch path), so read the
scheduler's, the drafters' and the runner's bookkeeping rows, not the total.

    python scripts/profile_host_steps.py --speculative siblings              # a tiny random Qwen3, 16 x n16
    python scripts/profile_host_steps.py --model .kbench/spec_tiny2/hybrid --prompts 32 --n 1 \\
        --prompt-len 256 --max-new-tokens 2 --speculative mtp --num-draft-tokens 2   # prefill steps with MTP

Prints the run's wall time and steps, then the rows of rollout_cli by cumulative time, in ms per step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import tempfile
import time


def _tiny_model(directory: str) -> str:
    """A random Qwen3 of hidden size 64 (two layers, vocab 512), saved with save_pretrained; weights large
    enough that greedy samples vary, so sibling drafts sometimes have something to propose."""
    import torch  # heavy, and only when no --model is given
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         num_hidden_layers=2, vocab_size=512, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=0.2)  # varied greedy outputs
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint directory (default: a tiny random Qwen3)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--speculative", choices=["none", "siblings", "mtp"], default="none")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--rows", type=int, default=30, help="profile rows to print")
    parser.add_argument("--sort", choices=["cumulative", "tottime"], default="cumulative",
                        help="order rows by time inside the function and its callees, or inside it alone")
    args = parser.parse_args()

    from rollout_cli import Engine, PromptInput, SamplingParams  # heavy: torch

    model = args.model or _tiny_model(tempfile.mkdtemp(prefix="profile_host_"))
    options = {}
    if args.speculative != "none":  # every decode step drafts: the drafters' cost in full
        options = dict(speculative=args.speculative, num_draft_tokens=args.num_draft_tokens, speculative_gate=False)
    engine = Engine(model, device="cpu", dtype="float32", max_running=args.max_running,
                    max_model_len=args.prompt_len + args.max_new_tokens + 8, **options)
    vocab = engine.hf_config.vocab_size
    rng = random.Random(0)
    prompts = [PromptInput(i, [rng.randrange(vocab) for _ in range(args.prompt_len)]) for i in range(args.prompts)]
    list(engine.stream(prompts[:1], SamplingParams(max_new_tokens=2)))  # warm-up: the first calls' one-time costs
    params = SamplingParams(n=args.n, temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    steps, launch = [0], engine.runner.launch

    def counted(out):  # one engine step per launch
        steps[0] += 1
        return launch(out)

    engine.runner.launch = counted
    profile = cProfile.Profile()
    begin = time.perf_counter()
    profile.enable()
    list(engine.stream(prompts, params))
    profile.disable()
    wall = time.perf_counter() - begin
    stats, steps = engine.scheduler.stats, max(1, steps[0])
    print(f"{args.speculative}: {wall:.2f} s, {steps} steps, {stats.verify_steps} request-steps verified drafts, "
          f"{stats.accepted_draft_tokens} of {stats.draft_tokens} drafts accepted")
    column = 3 if args.sort == "cumulative" else 2  # pstats rows: (calls, primitive calls, tottime, cumtime, ...)
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][column])
    print(f"{'ms / step':>10} {'calls':>8}  function ({args.sort})")
    shown = [row for row in rows if "rollout_cli" in row[0][0]][:args.rows]
    for (path, line, name), numbers in shown:
        print(f"{1e3 * numbers[column] / steps:10.3f} {numbers[1]:8d}  {path.split('rollout_cli/')[-1]}:{line}({name})")


if __name__ == "__main__":
    main()
