"""The shipped example model / prompts (built by recipes/make_example_model.py) load offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MODEL_DIR = RECIPES / "example_model"
PROMPTS = RECIPES / "prompts.parquet"


def _ids(enc):
    return list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def config():
    return transformers.AutoConfig.from_pretrained(MODEL_DIR, local_files_only=True)


def test_files_present_and_small():
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (MODEL_DIR / name).is_file(), name
    total = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert total < 3 * 1024 * 1024


def test_config(config, tokenizer):
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.model_type == "qwen3"
    assert config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert config.eos_token_id == im_end
    assert config.pad_token_id == eot
    assert config.bos_token_id in (None, eot)


def test_tokenizer(tokenizer):
    special = {t: tokenizer.convert_tokens_to_ids(t)
               for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert len(set(special.values())) == 3
    assert tokenizer.unk_token is None  # byte-level BPE: every string is encodable
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = _ids(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    assert ids[0] == special["<|im_start|>"]
    assert ids.count(special["<|im_end|>"]) == 1
    assert tokenizer.decode(ids) == text
    for s in ["What is 12 + 7? The answer is 19.", "  spaces\tand\nnewlines\n", "héllo 你好 🙂", ""]:
        assert tokenizer.decode(tokenizer.encode(s, add_special_tokens=False)) == s


def test_generation_config_eos(tokenizer):
    gen = transformers.GenerationConfig.from_pretrained(MODEL_DIR, local_files_only=True)
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") in eos


def test_forward_on_chat_prompt(tokenizer, config):
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    model.eval()
    msgs = [{"role": "system", "content": "You are a helpful assistant. Answer with a number."},
            {"role": "user", "content": "What is 3 + 4?"}]
    ids = _ids(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_prompts_parquet():
    pf = pq.ParquetFile(PROMPTS)
    assert pf.metadata.num_rows == 64
    assert pf.metadata.num_row_groups >= 2
    table = pf.read()
    assert {"prompt", "data_source", "reward_model", "extra_info"} <= set(table.column_names)
    rows = table.to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == list(range(64))
    system = rows[0]["prompt"][0]
    for r in rows:
        assert r["data_source"] == "example_arithmetic"
        assert r["reward_model"]["style"] == "rule"
        msgs = r["prompt"]
        assert [m["role"] for m in msgs] == ["system", "user"]
        assert msgs[0] == system
        a, b = msgs[1]["content"].removeprefix("What is ").removesuffix("?").split(" + ")
        assert r["reward_model"]["ground_truth"] == str(int(a) + int(b))
