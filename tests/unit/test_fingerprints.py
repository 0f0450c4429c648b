"""Content fingerprints of checkpoints and prompt files (rollout_cli/io/fingerprints.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from rollout_cli.io.fingerprints import checkpoint_change, checkpoint_fingerprint, data_change, data_fingerprint

MODEL = Path(__file__).resolve().parents[2] / "recipes" / "example_model"


def test_checkpoint_is_identified_by_content_not_by_the_path_string(tmp_path, monkeypatch):
    monkeypatch.chdir(MODEL.parents[1])
    spelled = {checkpoint_fingerprint(p)["digest"] for p in
               ("recipes/example_model", "recipes/example_model/", str(MODEL), "recipes/../recipes/example_model")}
    copy = shutil.copytree(MODEL, tmp_path / "copy")
    assert spelled == {checkpoint_fingerprint(copy)["digest"]}


def test_same_shapes_other_values_is_another_checkpoint(tmp_path):
    """A fine-tune has the same header (names, shapes, offsets): the sampled tensor bytes tell it apart."""
    other = shutil.copytree(MODEL, tmp_path / "other")
    tensors = load_file(str(other / "model.safetensors"))
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    before, after = checkpoint_fingerprint(MODEL), checkpoint_fingerprint(other)
    assert os.path.getsize(MODEL / "model.safetensors") == os.path.getsize(other / "model.safetensors")
    assert after["digest"] != before["digest"]
    assert checkpoint_change(before, after) == "model.safetensors changed"


def test_tokenizer_and_config_files_count(tmp_path):
    other = shutil.copytree(MODEL, tmp_path / "other")
    (other / "chat_template.jinja").write_text("{{ messages }}")
    (other / "tokenizer_config.json").unlink()
    (other / "extra.json").write_text("{}")
    change = checkpoint_change(checkpoint_fingerprint(MODEL), checkpoint_fingerprint(other))
    assert change == "chat_template.jinja changed, extra.json added, tokenizer_config.json missing"
    assert checkpoint_change(checkpoint_fingerprint(MODEL), checkpoint_fingerprint(MODEL)) is None


def test_large_safetensors_is_sampled_not_read_whole(tmp_path, monkeypatch):
    """Only the header and 8 x 64 KiB blocks are read, however large the file."""
    path = tmp_path / "big.safetensors"
    save_file({"w": torch.zeros(4 << 20)}, str(path))  # 16 MiB
    read = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, *a):
            return self.f.seek(*a)

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr("builtins.open", lambda p, mode="r", *a, **k: Counting(real_open(p, mode, *a, **k)))
    from rollout_cli.io.fingerprints import file_digest

    file_digest(path)
    assert sum(read) < 1 << 20


def test_prompt_file_rewritten_at_the_same_path_is_another_file(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "k": [1, 2, 3]}), path)
    first = data_fingerprint(path)
    assert first["rows"] == 3 and data_fingerprint(path) == first
    pq.write_table(pa.table({"prompt": ["c", "b", "a"], "k": [3, 2, 1]}), path)
    assert data_change(first, data_fingerprint(path)) == "same row count and columns, other content"
    pq.write_table(pa.table({"prompt": ["a", "b"], "k": [1, 2]}), path)
    assert data_change(first, data_fingerprint(path)) == "it has 2 rows, the run read 3"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "j": [1, 2, 3]}), path)
    assert data_change(first, data_fingerprint(path)) == "its columns differ"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "k": [1, 2, 3]}), path)
    assert data_change(first, data_fingerprint(path)) is None  # the same content again
