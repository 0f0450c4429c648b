"""Content fingerprints of a job's inputs: what --resume compares to tell the same job from another.

A path says nothing about content: `recipes/example_model/`, `recipes/example_model` and its
absolute path are one checkpoint, while a prompt file rewritten at the same path is another.
So the manifest records, and --resume compares, fingerprints of the content:

  checkpoint  every file at the top of the model directory: config, tokenizer and chat template
              files hashed whole (they decide the prompt tokens); each *.safetensors file by its
              size, its JSON header (names, dtypes, shapes, offsets) and 64 KiB samples of its
              tensor bytes at fixed offsets (another fine-tune of the same shapes differs there).
  data        the prompt file's size, row count, schema, a hash of its Parquet footer (every row
              group's offsets, sizes and column statistics) and a digest of its bytes (whole up to
              64 MiB, else sampled like the weights): a shuffled file can keep every size and
              statistic of the footer, never its bytes.

Both are cheap on purpose: a resume of a 60 GB checkpoint reads a few MB, not the weights.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollout_cli.errors import RolloutError

# Files hashed whole up to this size; larger ones (and every safetensors file) are sampled.
_WHOLE_FILE_BYTES = 64 << 20
_SAMPLE_BYTES = 64 << 10
_SAMPLES = 8
_DIGEST_CHARS = 16  # of the sha256 hex: plenty to tell two files apart, short enough to read


def _short(h: "hashlib._Hash") -> str:
    return h.hexdigest()[:_DIGEST_CHARS]


def _sampled(f, start: int, end: int, h) -> None:
    """Feed h with _SAMPLES blocks of [start, end), evenly spaced, first and last included."""
    span = end - start
    if span <= _SAMPLES * _SAMPLE_BYTES:
        f.seek(start)
        h.update(f.read(span))
        return
    step = (span - _SAMPLE_BYTES) // (_SAMPLES - 1)
    for k in range(_SAMPLES):
        f.seek(start + k * step)
        h.update(f.read(_SAMPLE_BYTES))


def file_digest(path: Path) -> str:
    """'SIZE:DIGEST' of one file (see the module docstring for what the digest reads)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header_end = min(8 + header_len, size)
            h.update(f.read(header_end - 8))  # the header: every tensor's name, dtype, shape and offsets
            _sampled(f, header_end, size, h)
        elif size <= _WHOLE_FILE_BYTES:
            h.update(f.read())
        else:
            _sampled(f, 0, size, h)
    return f"{size}:{_short(h)}"


def checkpoint_fingerprint(model_dir: str | Path) -> dict[str, Any]:
    """{"digest": one digest of the whole directory, "files": {name: "SIZE:DIGEST"}} of its top-level files."""
    directory = Path(model_dir)
    try:
        files = {p.name: file_digest(p) for p in sorted(directory.iterdir()) if p.is_file()}
    except OSError as err:
        raise RolloutError(f"cannot read the checkpoint {directory} ({err.strerror or err})") from err
    h = hashlib.sha256()
    for name, digest in files.items():
        h.update(f"{name}\0{digest}\0".encode())
    return {"digest": _short(h), "files": files}


def checkpoint_change(previous: dict[str, Any], current: dict[str, Any], weights: bool = True) -> str | None:
    """What differs between two checkpoint fingerprints, in a few words; None when they match.
    weights=False: only config, tokenizer and template files count (a later checkpoint of one model)."""
    if previous.get("digest") == current.get("digest"):
        return None
    old, new = previous.get("files", {}), current.get("files", {})
    if not weights:
        old, new = ({k: v for k, v in files.items() if not k.endswith(".safetensors")} for files in (old, new))
    parts = []
    changed = sorted(name for name in old.keys() & new.keys() if old[name] != new[name])
    if changed:
        parts.append(f"{_listed(changed)} changed")
    if new.keys() - old.keys():
        parts.append(f"{_listed(sorted(new.keys() - old.keys()))} added")
    if old.keys() - new.keys():
        parts.append(f"{_listed(sorted(old.keys() - new.keys()))} missing")
    if not weights:
        return ", ".join(parts) or None
    return ", ".join(parts) or "its files differ"


def _listed(names: list[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def data_fingerprint(path: str | Path) -> dict[str, Any]:
    """{"size", "rows", "schema", "footer", "content"} of a Parquet file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        parquet = pq.ParquetFile(path)
        with open(path, "rb") as f:
            # a Parquet file ends with the footer, its 4-byte little-endian length, then b"PAR1"
            f.seek(max(size - 8, 0))
            tail = f.read(8)
            footer_len = struct.unpack("<I", tail[:4])[0] if len(tail) == 8 else 0
            f.seek(max(size - 8 - footer_len, 0))
            footer = f.read()
        content = file_digest(path).partition(":")[2]
    except (OSError, pa.ArrowException) as err:
        raise RolloutError(f"cannot read the prompt file {path} ({err}); check the --data path") from err
    schema = parquet.schema_arrow.remove_metadata().to_string(show_schema_metadata=False)
    return {
        "size": size,
        "rows": parquet.metadata.num_rows,
        "schema": _short(hashlib.sha256(schema.encode())),
        "footer": _short(hashlib.sha256(footer)),
        "content": content,
    }


def data_change(previous: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What differs between two prompt-file fingerprints, in a few words; None when they match."""
    if previous == current:
        return None
    if previous.get("rows") != current.get("rows"):
        return f"it has {current.get('rows')} rows, the run read {previous.get('rows')}"
    if previous.get("schema") != current.get("schema"):
        return "its columns differ"
    return "same row count and columns, other content"
