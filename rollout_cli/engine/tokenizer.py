"""The checkpoint's tokenizer and its end-of-sequence token ids."""

from __future__ import annotations

import os
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# every file a checkpoint's tokenizer and chat template may live in: copied beside a checkpoint saved from
# it (the trainer's save_pretrained, the GRPO recipe, scripts/random_checkpoint.py) so that it tokenizes alike
TOKENIZER_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                        "vocab.json", "merges.txt", "tokenizer.model")


def copy_side_files(source_dir: str, out_dir: str, names: tuple[str, ...] = TOKENIZER_SIDE_FILES) -> None:
    """Copy those of `names` that source_dir holds into out_dir."""
    for name in names:
        if os.path.isfile(os.path.join(source_dir, name)):
            shutil.copy(os.path.join(source_dir, name), os.path.join(out_dir, name))


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    # Without tokenizer files, transformers may still build a default tokenizer (with its own eos id).
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception:  # no tokenizer files: token-id prompts still work, text is left empty
        return None


def checkpoint_eos_token_ids(model_dir: str, hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id)
    if not ids and tokenizer is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)
