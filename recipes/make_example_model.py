#!/usr/bin/env python
"""Build the tiny example model, tokenizer and prompt set shipped with the repo.

Everything is generated locally and deterministically (seeded); nothing is
downloaded. Outputs (overwritten on every run):

  recipes/example_model/   tiny random-init Qwen3ForCausalLM + byte-level BPE
                           tokenizer with a ChatML chat template
  recipes/prompts.parquet  64 arithmetic prompts in verl's RL layout

Usage:  python recipes/make_example_model.py [--out-dir recipes]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

SEED = 0
VOCAB_SIZE = 768  # target BPE vocab size, special tokens and 256 bytes included
NUM_PROMPTS = 64
ROW_GROUP_SIZE = 16
SYSTEM_PROMPT = "You are a helpful assistant. Answer with a number."
DATA_SOURCE = "example_arithmetic"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Qwen-style ChatML template (no tools / thinking), supports add_generation_prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

MAX_MODEL_BYTES = 3 * 1024 * 1024


# --------------------------------------------------------------------------- corpus
_NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
_THINGS = ["apples", "books", "coins", "pencils", "cookies", "marbles", "cards", "stones"]
_INSTRUCTIONS = [
    "Answer with a number.",
    "Please answer the question.",
    "Think step by step and give the final answer.",
    "Write a short sentence about the weather.",
    "Explain how to add two numbers.",
    "Summarize the text in one line.",
    "Translate the word into French.",
    "List three colors.",
    "Give a short answer.",
    "Count from one to five.",
]
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant.",
    "The answer is a number.",
    "Let me think about this step by step.",
    "Sure, here is the answer.",
    "I do not know the answer to that question.",
    "The sum of two numbers is found by adding them together.",
    "Today the weather is sunny and warm.",
    "Red, green and blue are colors.",
    "One, two, three, four, five.",
    "Hello! How can I help you today?",
    "Thank you for the question.",
]


def _arith_line(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice(["+", "-", "*"])
    ans = {"+": a + b, "-": a - b, "*": a * b}[op]
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    templates = [
        f"What is {a} {op} {b}? The answer is {ans}.",
        f"What is {a} {op} {b}?",
        f"{a} {op} {b} = {ans}",
        f"{a} {word} {b} is {ans}.",
        f"Compute {a} {op} {b}. Answer: {ans}",
        f"If you add {a} and {b}, you get {a + b}.",
        f"{rng.choice(_NAMES)} has {a} {rng.choice(_THINGS)} and gets {b} more, "
        f"so now there are {a + b}.",
    ]
    return rng.choice(templates)


def build_corpus(rng: random.Random, n: int = 4000) -> list[str]:
    lines: list[str] = []
    for i in range(n):
        kind = i % 4
        if kind == 0 or kind == 1:
            lines.append(_arith_line(rng))
        elif kind == 2:
            lines.append(f"{rng.choice(_INSTRUCTIONS)} {rng.choice(_SENTENCES)}")
        else:
            # chat-formatted sample so role names / newlines get merges too
            q = _arith_line(rng)
            lines.append(
                f"{IM_START}system\n{SYSTEM_PROMPT}{IM_END}\n"
                f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{rng.randint(0, 200)}{IM_END}\n"
            )
    return lines


# --------------------------------------------------------------------------- tokenizer
def build_tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())  # no unk token: byte-level covers everything
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,  # -> ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
        padding_side="left",
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# --------------------------------------------------------------------------- model
def build_model(vocab_size: int, ids: dict[str, int]):
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="float32",
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
    )
    return model


# --------------------------------------------------------------------------- prompts
def write_prompts(path: Path, rng: random.Random) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    msg_t = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(msg_t)),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("index", pa.int64())])),
        ]
    )
    rows = []
    for i in range(NUM_PROMPTS):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"What is {a} + {b}?"},
                ],
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": i},
            }
        )
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp, row_group_size=ROW_GROUP_SIZE, compression="zstd")
    tmp.replace(path)


# --------------------------------------------------------------------------- checks
def verify(model_dir: Path, ids: dict[str, int]) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert cfg.architectures == ["Qwen3ForCausalLM"], cfg.architectures
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT
    for name, i in ids.items():
        assert tok.convert_tokens_to_ids(name) == i
    assert len(tok) == cfg.vocab_size, (len(tok), cfg.vocab_size)

    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", repr(text)
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    prompt_ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
    assert prompt_ids[0] == ids[IM_START] and tok.decode(prompt_ids) == text

    samples = [
        "What is 12 + 7? The answer is 19.",
        "  leading spaces, trailing\ttabs\t\nand newlines\n\n",
        "Unicode: héllo wörld — 你好 🙂 ∑x²",
        "<|im_start|>user\nhi<|im_end|>\n",
        "",
    ]
    for s in samples:
        got = tok.decode(tok.encode(s, add_special_tokens=False))
        assert got == s, (s, got)

    gen = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    assert ids[IM_END] in gen.eos_token_id and ids[ENDOFTEXT] in gen.eos_token_id

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits
    assert logits.shape == (1, len(prompt_ids), cfg.vocab_size)
    assert torch.isfinite(logits).all()


def _portable_tokenizer_config(path: Path) -> None:
    """transformers 5 writes tokenizer_class "TokenizersBackend" and a list-valued
    "extra_special_tokens", which transformers 4.x cannot read. Use the spelling
    both major versions understand (v5 maps PreTrainedTokenizerFast onto its backend)."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    elif extra:
        cfg["extra_special_tokens"] = extra
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _fmt(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.2f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()
    out_dir: Path = args.out_dir
    model_dir = out_dir / "example_model"
    prompts_path = out_dir / "prompts.parquet"

    rng = random.Random(SEED)
    tok = build_tokenizer(build_corpus(rng))
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    model = build_model(len(tok), ids)

    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    _portable_tokenizer_config(model_dir / "tokenizer_config.json")
    write_prompts(prompts_path, random.Random(SEED + 1))

    verify(model_dir, ids)

    total = 0
    print(f"wrote {model_dir}/")
    for p in sorted(model_dir.iterdir()):
        size = p.stat().st_size
        total += size
        print(f"  {p.name:28s} {_fmt(size):>10s}")
    print(f"  {'(total)':28s} {_fmt(total):>10s}")
    assert total < MAX_MODEL_BYTES, f"example_model is {total} bytes, over the 3 MB budget"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"  params={n_params}  vocab_size={len(tok)}  special ids={json.dumps(ids)}")
    print(f"wrote {prompts_path}  {_fmt(prompts_path.stat().st_size)}  "
          f"({NUM_PROMPTS} rows, row groups of {ROW_GROUP_SIZE})")


if __name__ == "__main__":
    main()
