"""VisionPromptEncoder and image cells on a tiny Qwen3-VL checkpoint (issue 23, item 1): the ids and patch
rows of HF's own Qwen3VLProcessor for the same row, each image cell layout, and one reason per bad row.

The checkpoint's processor has 4-pixel patches and a 2 x 2 merge: a 16 x 16 image is a 4 x 4 grid,
4 image tokens; 30 x 20 resizes to 32 x 20 -> grid 5 x 8 (rounded to the merge), 10 tokens.
"""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest
import torch

from rollout_cli.errors import RolloutError
from rollout_cli.io.image_cells import holds_images, load_images
from rollout_cli.io.image_prompts import ImageCountMismatch, VisionPromptEncoder
from rollout_cli.io.prompt_encoding import InvalidPrompt, encode_prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_fixtures import (  # noqa: E402
    EXAMPLE_MODEL, IMAGE_PAD, VISION_END, VISION_START, build_tiny_vlm, png_bytes, random_image)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), "qwen3_vl")


@pytest.fixture(scope="module")
def encoder(vlm_dir):
    return VisionPromptEncoder.from_checkpoint(vlm_dir)


@pytest.fixture(scope="module")
def hf_processor(encoder):
    """HF's Qwen3VLProcessor over the checkpoint's image processor and tokenizer. Its constructor checks the
    video processor's class, which needs torchvision (not installed, on purpose): that check is skipped."""
    import transformers

    class ImagesOnly(transformers.Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None

    return ImagesOnly(image_processor=encoder.image_processor, tokenizer=encoder.tokenizer, video_processor=None,
                      chat_template=encoder.tokenizer.chat_template)


def _hf(hf_processor, encoder, messages, images):
    text = encoder.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf_processor(text=[text], images=images or None, return_tensors="pt")


def _parts(*pieces):
    return [{"type": "image"} if p is None else {"type": "text", "text": p} for p in pieces]


IMAGES = {"square": (16, 16, 0), "wide": (30, 20, 1), "tall": (12, 40, 2), "big": (64, 48, 3)}


# ---- the checkpoint -----------------------------------------------------------------------------


def test_from_checkpoint_reads_the_vision_settings(encoder):
    assert encoder.image_token_id == IMAGE_PAD and encoder.merge_size == 2 and encoder.image_token == "<|image_pad|>"
    assert type(encoder.image_processor).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision


def test_a_text_only_checkpoint_has_no_encoder():
    assert VisionPromptEncoder.from_checkpoint(EXAMPLE_MODEL) is None


def test_a_vision_checkpoint_without_preprocessor_config_is_one_line(vlm_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(vlm_dir, bare, ignore=shutil.ignore_patterns("preprocessor_config.json"))
    with pytest.raises(RolloutError, match="without preprocessor_config.json") as err:
        VisionPromptEncoder.from_checkpoint(bare)
    assert "\n" not in str(err.value)


# ---- ids and pixels as HF's processor gives them -----------------------------------------------


@pytest.mark.parametrize("names", [["square"], ["wide"], ["tall", "big"], ["square", "wide"]])
@pytest.mark.parametrize("layout", ["string", "chat string", "content parts"])
def test_ids_and_pixels_equal_hf_processor(encoder, hf_processor, names, layout):
    pictures = [random_image(*IMAGES[n]) for n in names]
    pieces = ["look at "] + sum(([None, f" then {k} "] for k in range(len(names))), [])
    text = "".join("<image>" if p is None else p for p in pieces)
    prompt = {"string": text,
              "chat string": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
              "content parts": [{"role": "user", "content": _parts(*pieces)}]}[layout]
    ids, images = encoder.encode(prompt, [{"bytes": png_bytes(p), "path": None} for p in pictures])

    system = [{"role": "system", "content": "be brief"}] if layout == "chat string" else []
    expected = _hf(hf_processor, encoder, system + [{"role": "user", "content": _parts(*pieces)}], pictures)
    assert ids == expected["input_ids"][0].tolist()
    assert [list(im.grid_thw) for im in images] == expected["image_grid_thw"].tolist()
    assert torch.equal(torch.cat([im.pixel_values for im in images]), expected["pixel_values"])


def test_each_image_becomes_its_run_of_image_tokens(encoder):
    ids, images = encoder.encode("a <image> b <image>", [png_bytes(random_image(16, 16, 0)),
                                                         png_bytes(random_image(30, 20, 1))])
    assert [im.grid_thw for im in images] == [(1, 4, 4), (1, 4, 8)]
    counts = [im.num_tokens(2) for im in images]
    assert counts == [4, 8]  # grid product / merge^2
    for count in counts:
        start = ids.index(VISION_START)
        assert ids[start + 1:start + 1 + count] == [IMAGE_PAD] * count and ids[start + 1 + count] == VISION_END
        ids = ids[start + 2 + count:]
    assert IMAGE_PAD not in ids


def test_digest_is_the_pixels(encoder):
    same = png_bytes(random_image(16, 16, 5))
    _, first = encoder.encode("<image>", [same])
    _, second = encoder.encode([{"role": "user", "content": "other text <image>"}], {"bytes": same, "path": None})
    _, other = encoder.encode("<image>", [png_bytes(random_image(16, 16, 6))])
    assert first[0].digest == second[0].digest and first[0].digest != other[0].digest


def test_validation_counts_equal_the_processor(encoder):
    sizes = [(1, 1), (3, 3), (7, 9), (16, 16), (30, 20), (33, 17), (48, 48), (100, 60), (199, 2)]
    cell = [png_bytes(random_image(w, h, i)) for i, (w, h) in enumerate(sizes)]
    assert encoder.token_counts(cell) == [im.num_tokens(2) for im in encoder.images(cell)]


@pytest.mark.parametrize("prompt", ["plain text", [{"role": "user", "content": "hello"}], [5, 6, 7]])
@pytest.mark.parametrize("cell", [None, []])
def test_a_row_without_images_is_the_text_path(encoder, prompt, cell):
    assert encoder.encode(prompt, cell) == (encode_prompt(encoder.tokenizer, prompt), ())


def test_content_parts_without_images_and_pyarrow_nulls(encoder):
    # a list<struct> column gives every part every key: text parts image=None, image parts text=None
    parts = [{"type": "text", "text": "hi ", "image": None}, {"type": "image", "text": None, "image": "x.png"}]
    ids, images = encoder.encode([{"role": "user", "content": parts, "name": None}], [png_bytes(random_image(8, 8, 1))])
    plain, _ = encoder.encode("hi <image>", [png_bytes(random_image(8, 8, 1))])
    assert ids == plain and len(images) == 1
    text_only, none = encoder.encode([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], None)
    assert none == () and IMAGE_PAD not in text_only


# ---- image cells --------------------------------------------------------------------------------


def test_image_cell_layouts(tmp_path):
    picture = random_image(10, 6, 3)
    data = png_bytes(picture)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(data)
    absolute = str(tmp_path / "sub" / "a.png")
    cells = {
        "struct": {"bytes": data, "path": None},
        "struct with a path": {"bytes": None, "path": "sub/a.png"},
        "bytes win over path": {"bytes": data, "path": "nowhere.png"},
        "list of structs": [{"bytes": data, "path": None}, {"bytes": None, "path": absolute}],
        "raw bytes": data,
        "relative path": "sub/a.png",
        "absolute path": absolute,
        "PIL image": picture,
    }
    for name, cell in cells.items():
        loaded = load_images(cell, tmp_path)
        assert len(loaded) == (2 if name == "list of structs" else 1), name
        assert all(im.mode == "RGB" and im.tobytes() == picture.tobytes() for im in loaded), name
    assert not holds_images(None) and not holds_images([]) and holds_images(data)
    assert load_images(None) == [] and load_images([]) == []


def test_grayscale_and_alpha_become_rgb():
    from PIL import Image

    for mode in ("L", "RGBA", "P"):
        buffer = io.BytesIO()
        Image.new(mode, (9, 7)).save(buffer, format="PNG")
        (image,) = load_images(buffer.getvalue())
        assert image.mode == "RGB" and image.size == (9, 7)


@pytest.mark.parametrize("cell,reason", [
    (b"not an image", "image 1 of the row cannot be decoded"),
    ([{"bytes": None, "path": None}], "image 1 of the row has neither bytes nor a path"),
    ("missing.png", "image 1 of the row: no file"),
    ([png_bytes(random_image(8, 8, 0)), "gone/missing.png"], "image 2 of the row: no file"),
    ("https://example.com/a.png", "is a URL"),
    ([7], "image 1 of the row is int"),
])
def test_bad_image_cells(tmp_path, cell, reason):
    with pytest.raises(InvalidPrompt, match=reason) as err:
        load_images(cell, tmp_path)
    assert "\n" not in str(err.value)


def test_truncated_image_is_refused():
    data = png_bytes(random_image(32, 32, 0))
    with pytest.raises(InvalidPrompt, match="cannot be decoded"):
        load_images(data[: len(data) // 2])


# ---- bad rows -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt,images,reason", [
    ("<image> and <image>", 1, "prompt has 2 image placeholders .* but the row has 1 image;"),
    ("one <image>", 2, "prompt has 1 image placeholder .* but the row has 2 images;"),
    ("no placeholder", 1, "prompt has 0 image placeholders .* but the row has 1 image;"),
    ([{"role": "user", "content": _parts("x", None)}], 0, "prompt has 1 image placeholder .* 0 images"),
    ([5, 6, 7], 1, "a prompt of token ids cannot place images"),
    ("", 1, "empty prompt"),
    (None, 1, "prompt is null"),
    ([{"role": "user", "content": [{"type": "video"}]}], 1, "has type 'video'; expected 'text' or 'image'"),
    ([{"role": "user", "content": [{"type": "text"}]}], 0, "text part without a 'text' string"),
    ([{"role": "user", "content": 3}], 1, "no 'content' string or list"),
    ("literal <|image_pad|> <image>", 1, "rendered 2 <|image_pad|> tokens for 1 image placeholder"),
    ("literal <|image_pad|>", 0, "holds the image token <|image_pad|> .* but the row has no image"),
])
def test_bad_rows_say_why(encoder, prompt, images, reason):
    cell = [png_bytes(random_image(8, 8, k)) for k in range(images)]
    with pytest.raises(InvalidPrompt, match=reason) as err:
        encoder.encode(prompt, cell)
    assert "\n" not in str(err.value)
    if "placeholder" in reason and "rendered" not in reason:
        assert isinstance(err.value, ImageCountMismatch)


def test_batch_routes_text_rows_and_passes_errors(encoder):
    bad = InvalidPrompt("prompt is not valid UTF-8")
    prompts = ["plain", "<image>", bad, "<image>"]
    counts = [[], [4], [], InvalidPrompt("image 1 of the row cannot be decoded: x")]
    out = encoder.ids_batch(prompts, counts)
    assert out[0] == encode_prompt(encoder.tokenizer, "plain")
    assert out[1].count(IMAGE_PAD) == 4 and out[2] is bad and "cannot be decoded" in str(out[3])


def test_every_vision_language_architecture_has_a_model_class():
    """The io layer reads the multimodal names from models/architectures.py (no model code imported):
    each must be a registered model class."""
    from rollout_cli.models.architectures import MULTIMODAL_ARCHITECTURES
    from rollout_cli.models.registry import MODEL_CLASSES

    assert MULTIMODAL_ARCHITECTURES and all(name in MODEL_CLASSES for name in MULTIMODAL_ARCHITECTURES)
