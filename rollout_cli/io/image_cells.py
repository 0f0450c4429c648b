"""The images of one Parquet cell, decoded: what an image column may hold and how it becomes PIL images.

Kept apart from the prompt side (`image_prompts.py`) because it knows nothing about models or
tokenizers: it turns one cell's value into RGB images or says why it cannot (`InvalidPrompt`).

An image cell may hold
  - null, or an empty list               -> no images,
  - a struct {bytes, path}               -> one image (HF datasets' `image` column; either field may
                                            be null: bytes win, as datasets' Image feature decodes),
  - a list of such structs               -> the images in order (verl's and HF datasets' `images`),
  - raw bytes, or a path string          -> one image (a list of them: several).
Relative paths are read from the Parquet file's folder, so a data set moves with its images.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from rollout_cli.errors import RolloutError, one_line
from rollout_cli.io.prompt_encoding import InvalidPrompt

# One image of a cell before decoding: encoded bytes, a file path, or an already decoded PIL image
# (Python callers may hand those in).
Source = Any


def holds_images(cell: Any) -> bool:
    """Whether a cell names at least one image (null and empty lists name none); cheap, nothing is decoded."""
    if cell is None:
        return False
    if isinstance(cell, (list, tuple, np.ndarray)):
        return len(cell) > 0
    return True


def image_sources(cell: Any) -> list[Source]:
    """The images a cell names, in order, each as bytes, a path string or a PIL image; nothing is read yet."""
    if not holds_images(cell):
        return []
    items = list(cell) if isinstance(cell, (list, tuple, np.ndarray)) else [cell]
    return [_source(item, number) for number, item in enumerate(items, 1)]


def _source(item: Any, number: int) -> Source:
    """One list item as bytes, a path string or a PIL image; InvalidPrompt for anything else."""
    if isinstance(item, Mapping):  # {bytes, path}: a pyarrow struct gives both keys, the unused one None
        if item.get("bytes") is not None:
            return _source(item["bytes"], number)
        if item.get("path") is not None:
            return _source(item["path"], number)
        keys = ", ".join(map(str, item)) or "none"
        raise InvalidPrompt(f"image {number} of the row has neither bytes nor a path (keys: {keys}); "
                            "give each image as {bytes, path} with one of them set")
    if isinstance(item, (bytes, bytearray, memoryview, str)) or _is_pil(item):
        return item
    raise InvalidPrompt(f"image {number} of the row is {type(item).__name__}; expected encoded bytes, a path, "
                        "or a {bytes, path} struct")


def refuse_text_cells(cells: list[Any], first_row: int, path: Path, column: str) -> None:
    """A column of text named as the image column (--image-key data_source) is wrong for the whole run: refuse
    it in one line that says so, instead of each row's "no file" (or, on a text-only model, "holds an image").
    A string is text when it is neither a file nor named like an image file (a missing one.png is one row's)."""
    for offset, cell in enumerate(cells):
        items = list(cell) if isinstance(cell, (list, tuple, np.ndarray)) else [cell]
        text = next((item for item in items if isinstance(item, str) and _is_text(item, path.parent)), None)
        if text is not None:
            raise RolloutError(
                f"column {column!r} of {path} holds strings, not images (row {first_row + offset}: {_clip(text, 60)!r} "
                "is no image file); the image column must hold {bytes, path} structs (HF datasets' Image), lists of "
                "them (verl's images), encoded image bytes, or image file paths: pass --image-key with that column")


def _is_text(item: str, base_dir: Path) -> bool:
    if "://" in item:  # a URL: load_image says only local files are read
        return False
    suffix = os.path.splitext(item)[1].lower()
    return suffix not in Image.registered_extensions() and not (base_dir / item).is_file()


def _is_pil(value: Any) -> bool:
    return isinstance(value, Image.Image)


def load_images(cell: Any, base_dir: Path | None = None) -> list:
    """The cell's images as RGB PIL images, fully decoded (a truncated file fails here, not later)."""
    return [load_image(source, number, base_dir) for number, source in enumerate(image_sources(cell), 1)]


def load_image(source: Source, number: int, base_dir: Path | None = None, label: str | None = None):
    """One image (`number`, 1-based, names it in errors) as an RGB PIL image; `label` names it instead
    where it is not a row's (the daemon's chat requests: "image 2 (message 0, content part 3)")."""
    what = label or f"image {number} of the row"
    if _is_pil(source):
        return source.convert("RGB")
    if isinstance(source, str):
        if "://" in source:
            raise InvalidPrompt(f"{what} is a URL ({_clip(source)}); only local files are "
                                "read: download the images and store their bytes or paths")
        path = Path(source)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            relative = base_dir is not None and path != Path(source)
            where = f" (relative paths are read from {base_dir})" if relative else ""
            raise InvalidPrompt(f"{what}: no file {_clip(str(path))}{where}")
        try:
            data = path.read_bytes()
        except OSError as err:
            raise InvalidPrompt(f"{what}: cannot read {_clip(str(path))} "
                                f"({err.strerror or one_line(err)})") from err
    else:
        data = bytes(source)
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # decode every pixel now: a truncated file raises here
            return image.convert("RGB")
    except Image.UnidentifiedImageError as err:  # its message names a BytesIO object: say what was there
        raise InvalidPrompt(f"{what} cannot be decoded: not an image format Pillow reads "
                            f"({len(data):,} bytes starting {data[:8]!r})") from err
    except Image.DecompressionBombError as err:
        raise InvalidPrompt(f"{what} is too large to decode ({one_line(err)})") from err
    except (OSError, ValueError, SyntaxError, EOFError) as err:  # PIL's UnidentifiedImageError is an OSError
        raise InvalidPrompt(f"{what} cannot be decoded: {one_line(err)}") from err


def _clip(text: str, most: int = 200) -> str:
    return text if len(text) <= most else text[:most] + "..."
