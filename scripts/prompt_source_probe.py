"""Time and peak memory of `rollout run`'s input handling: PromptSource.validate() then iteration over
a generated prompt Parquet file, with the example model's tokenizer; and how many rows the tokenizer saw.

    .venv/bin/python scripts/prompt_source_probe.py [--rows 100000] [--file /tmp/prompts-100k.parquet]
    # another version of the reader, for a before/after comparison:
    git show main:rollout_cli/io/prompts.py > /tmp/prompts_main.py
    .venv/bin/python scripts/prompt_source_probe.py --prompts-module /tmp/prompts_main.py

The file is built once (string prompts of 10 to 150 words, ~200 tokens on average with the example
tokenizer, and verl-style passthrough columns) and reused when it exists. The measurement runs in a
fresh process, so its peak RSS is its own.

Measured on 2 shared CPU cores, 100k rows (19.7M prompt tokens), before (main) / after the token-id
cache: 33.2-33.8 s / 18.0-18.2 s, 200k / 100k rows tokenized, peak RSS +100 / +178-191 MiB (the
cache: 4 bytes a token); with --cache-mib 16, 30.7 s, 180k rows tokenized, +119 MiB.

Printed: the seconds of validate() and of the iteration, the rows the tokenizer encoded (the
number of rows: each row tokenized once; twice that: tokenized in both passes), and the peak RSS
above the RSS after loading the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

WORDS = ("the a of to and in is it that for on with as was by at be this from or an are which "
         "number solve find compute value answer question sum product total each many how what if "
         "then there apples train minutes hours price percent triangle circle area prime integer").split()


def build(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 150))) for _ in range(rows)]
    table = pa.table({
        "data_source": ["probe"] * rows,
        "prompt": prompts,
        "reward_model": [{"ground_truth": str(i % 97), "style": "rule"} for i in range(rows)],
        "extra_info": [{"index": i} for i in range(rows)],
    })
    pq.write_table(table, path, row_group_size=8192)


class CountingTokenizer:
    """The tokenizer, counting the rows it encodes (a batched call counts each of its strings)."""

    def __init__(self, inner):
        self._inner = inner
        self.rows = 0

    def __call__(self, texts, *args, **kwargs):
        self.rows += len(texts) if isinstance(texts, list) else 1
        return self._inner(texts, *args, **kwargs)

    def encode(self, *args, **kwargs):
        self.rows += 1
        return self._inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.rows += 1
        return self._inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _prompt_source_class(module_path: str | None):
    """This tree's PromptSource, or the one in `module_path` (an older prompts.py, loaded from its file)."""
    if module_path is None:
        from rollout_cli.io.prompts import PromptSource

        return PromptSource
    import importlib.util

    spec = importlib.util.spec_from_file_location("prompts_under_test", module_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.PromptSource


def measure(path: Path, model: str, module_path: str | None, cache_mib: int | None) -> dict:
    from rollout_cli.engine.tokenizer import load_tokenizer

    PromptSource = _prompt_source_class(module_path)  # noqa: N806 - a class
    tokenizer = CountingTokenizer(load_tokenizer(model))
    tokenizer("warm up")  # the tokenizer's lazy setup is no part of the input handling
    tokenizer.rows = 0
    base = _rss_bytes()
    start = time.perf_counter()
    config = json.loads((Path(model) / "config.json").read_text())
    budget = {} if cache_mib is None else {"cache_bytes": cache_mib * 2**20}
    source = PromptSource(path, tokenizer, max_prompt_len=config["max_position_embeddings"] - 1,
                          vocab_size=config["vocab_size"], **budget)
    source.validate()
    validated = time.perf_counter()
    rows = tokens = 0
    for row in source:
        rows += 1
        tokens += len(row.prompt_token_ids)
    end = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"rows": rows, "prompt_tokens": tokens, "validate_s": round(validated - start, 2),
            "iterate_s": round(end - validated, 2), "total_s": round(end - start, 2),
            "rows_tokenized": tokenizer.rows, "peak_rss_above_base_mib": round((peak - base) / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--file", default="/tmp/prompt_source_probe-100k.parquet")
    parser.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "recipes" / "example_model"))
    parser.add_argument("--prompts-module", help="a rollout_cli/io/prompts.py file to measure instead of this tree's")
    parser.add_argument("--cache-mib", type=int, help="PromptSource's token-id cache budget (default: its own)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    path = Path(args.file)
    if args.measure:
        print(json.dumps(measure(path, args.model, args.prompts_module, args.cache_mib)))
        return
    if not path.exists():
        build(path, args.rows)
    child = [sys.executable, __file__, "--measure", "--file", str(path), "--model", args.model]
    if args.prompts_module:
        child += ["--prompts-module", args.prompts_module]
    if args.cache_mib is not None:
        child += ["--cache-mib", str(args.cache_mib)]
    done = subprocess.run(child, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr)
    print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
