"""A random bf16 checkpoint of a config directory, for device measurements that need real weights (HF
loads the same ones) without downloading any:

    python scripts/random_checkpoint.py recipes/configs/qwen3-0.6b /tmp/q06 --tokenizer-from recipes/example_model

HF's init, then the final norm's weight scaled by --final-norm-scale so that logits have a realistic
spread instead of a near-uniform one. --tokenizer-from copies a tokenizer's files beside the weights so
that `rollout run` can read chat prompts (ids past that tokenizer's vocabulary decode to nothing).
"""

from __future__ import annotations

import argparse

from rollout_cli.engine.tokenizer import copy_side_files


def random_checkpoint(config_dir: str, out_dir: str, norm_scale: float = 8.0, seed: int = 0,
                      tokenizer_from: str | None = None) -> str:
    """Save a random checkpoint of config_dir's config.json in out_dir (save_pretrained); returns out_dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.mul_(norm_scale)
    model.save_pretrained(out_dir)
    if tokenizer_from:
        copy_side_files(tokenizer_from, out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--final-norm-scale", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", metavar="DIR", help="copy this directory's tokenizer files too")
    args = parser.parse_args()
    print(random_checkpoint(args.config_dir, args.out_dir, args.final_norm_scale, args.seed, args.tokenizer_from))


if __name__ == "__main__":
    main()
