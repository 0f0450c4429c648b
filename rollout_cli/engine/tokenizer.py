"""The checkpoint's tokenizer and its end-of-sequence token ids."""

from __future__ import annotations

import os
import shutil

from rollout_cli.errors import RolloutError, one_line

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # those a tokenizer can be built from
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
    """The checkpoint's tokenizer, or None when it has no tokenizer files (token-id prompts still work,
    text is left empty). Files that exist but do not load are refused: None would blame missing files."""
    from transformers import AutoTokenizer

    # Without tokenizer files, transformers may still build a default tokenizer (with its own eos id);
    # a tokenizer_config.json alone holds no vocabulary: no tokenizer either, as before.
    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, name))]
    if not set(present) & set(VOCABULARY_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for bad files: one line
        raise RolloutError(f"cannot load the tokenizer of {model_dir} ({', '.join(present)}): {one_line(err)}; "
                           "restore the checkpoint's tokenizer files, or delete them to pass token-id prompts") from err


def checkpoint_eos_token_ids(model_dir: str, hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        from transformers import GenerationConfig

        try:
            generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        except Exception as err:  # noqa: BLE001 - OSError for bad JSON, ValueError for bad values: one line
            raise RolloutError(f"cannot load {path}: {one_line(err).rstrip('.')}; restore it from the checkpoint, "
                               "or delete it to use config.json's eos_token_id") from err
        add(generation.eos_token_id)
    if not ids and tokenizer is not None:
        add(tokenizer.eos_token_id)
    return frozenset(ids)
