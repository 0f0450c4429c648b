"""PromptSource over Parquet files with images (issue 23, items 1 and 4): verl's `images` layout, HF datasets'
`image` column with content-part messages, path columns; bad rows named in one line or skipped; a text-only
model refusing an image column; and the image_grid_thw output column.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rollout_cli.engine.engine import Engine
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.request_maker import RequestMaker
from rollout_cli.engine.trajectory import PromptInput, Trajectory
from rollout_cli.errors import RolloutError
from rollout_cli.io.image_prompts import VisionPromptEncoder
from rollout_cli.io.prompts import PromptSource
from rollout_cli.io.trajectories import TrajectoryWriter
from rollout_cli.job_resume import SAMPLING_DEFAULTS, check_resume

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_fixtures import IMAGE_PAD, build_tiny_vlm, png_bytes, random_image  # noqa: E402

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
PICTURES = [random_image(16, 16, 0), random_image(30, 20, 1), random_image(12, 40, 2)]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return VisionPromptEncoder.from_checkpoint(build_tiny_vlm(tmp_path_factory.mktemp("vlm"), "qwen3_vl"))


def _image(k: int) -> dict:
    return {"bytes": png_bytes(PICTURES[k]), "path": None}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _write(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def _verl(path: Path, rows: list[tuple[str, list]]) -> Path:
    """verl's layout: prompt = chat messages with <image>, images = list<struct<bytes, path>>, an answer column."""
    return _write(path, {"prompt": pa.array([_user(text) for text, _ in rows], MESSAGES),
                         "images": pa.array([images for _, images in rows], pa.list_(IMAGE)),
                         "answer": [f"a{i}" for i in range(len(rows))]})


# ---- the layouts --------------------------------------------------------------------------------


def test_verl_layout(encoder, tmp_path):
    rows = [("one <image> here", [_image(0)]), ("two <image><image>", [_image(1), _image(2)]),
            ("same picture again <image>", [_image(0)]), ("no image at all", [])]
    source = PromptSource(_verl(tmp_path / "p.parquet", rows), encoder.tokenizer, vision=encoder, batch_rows=3)
    assert source.image_column == "images" and source.has_images
    assert source.passthrough_schema.names == ["answer"]  # image bytes are not copied to trajectories
    assert source.validate() == []
    got = list(source)
    assert [len(p.images) for p in got] == [1, 2, 1, 0]
    assert [p.passthrough for p in got] == [{"answer": f"a{i}"} for i in range(4)]
    for (text, _), prompt, pictures in zip(rows, got, [[0], [1, 2], [0], []]):
        ids, _ = encoder.encode(_user(text), [_image(k) for k in pictures])
        assert prompt.prompt_token_ids == ids
        assert prompt.prompt_token_ids.count(IMAGE_PAD) == sum(im.num_tokens(2) for im in prompt.images)
        if pictures:  # the patch rows are the image processor's, run on the decoded image directly
            direct = encoder.image_processor(images=[PICTURES[k] for k in pictures], return_tensors="pt")
            assert torch.equal(torch.cat([im.pixel_values for im in prompt.images]), direct["pixel_values"])
            assert [list(im.grid_thw) for im in prompt.images] == direct["image_grid_thw"].tolist()
    assert got[0].images[0].digest == got[2].images[0].digest != got[1].images[0].digest
    assert got[3].prompt_token_ids == encoder.tokenizer.apply_chat_template(
        _user("no image at all"), add_generation_prompt=True, tokenize=True)["input_ids"]  # the text path's ids


def test_hf_image_column_and_content_parts(encoder, tmp_path):
    # pyarrow gives every part every key (text parts image=None, image parts text=None), plus an ignored url
    part = pa.struct([("type", pa.string()), ("text", pa.string()), ("image", pa.string())])
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(part))]))
    prompts = [[{"role": "user", "content": [{"type": "image", "text": None, "image": "http://x/a.png"},
                                             {"type": "text", "text": "what is it", "image": None}]}],
               [{"role": "user", "content": [{"type": "text", "text": "just text", "image": None}]}]]
    path = _write(tmp_path / "hf.parquet", {"prompt": pa.array(prompts, messages),
                                            "image": pa.array([_image(1), None], IMAGE)})
    source = PromptSource(path, encoder.tokenizer, vision=encoder)
    assert source.image_column == "image" and source.passthrough_schema.names == []
    first, second = list(source)
    assert first.prompt_token_ids == encoder.encode("<image>what is it", _image(1))[0]
    assert [im.grid_thw for im in first.images] == [(1, 4, 8)] and second.images == ()


def test_path_column_relative_to_the_file_and_image_key(encoder, tmp_path):
    (tmp_path / "imgs").mkdir()
    for k, picture in enumerate(PICTURES):
        picture.save(tmp_path / "imgs" / f"{k}.png")
    data = tmp_path / "data"
    data.mkdir()
    pics = [["../imgs/0.png"], [str(tmp_path / "imgs" / "1.png"), "../imgs/2.png"]]
    path = _write(data / "p.parquet", {"q": ["<image> a", "<image> b <image>"], "pics": pics,
                                       "images": ["not read", "not read"]})
    source = PromptSource(path, encoder.tokenizer, prompt_key="q", image_key="pics", vision=encoder)
    assert source.passthrough_schema.names == ["images"]  # only the chosen column is dropped
    got = list(source)
    assert [[im.digest for im in p.images] for p in got] == [
        [im.digest for im in encoder.images(cell, tmp_path / "data")] for cell in pics]
    assert [len(p.images) for p in got] == [1, 2]


def test_a_named_image_column_that_is_missing(encoder, tmp_path):
    path = _verl(tmp_path / "p.parquet", [("<image>", [_image(0)])])
    with pytest.raises(RolloutError, match=r"has no column 'pics' \(columns: prompt, images, answer\); "
                                           "pass --image-key NAME") as err:
        PromptSource(path, encoder.tokenizer, image_key="pics", vision=encoder)
    assert "\n" not in str(err.value)


# ---- bad rows -----------------------------------------------------------------------------------

BAD_ROWS = {
    "corrupt bytes": (("see <image>", [{"bytes": b"\x89PNG broken", "path": None}]),
                      "image 1 of the row cannot be decoded: "),
    "missing path": (("see <image>", [{"bytes": None, "path": "gone.png"}]), "image 1 of the row: no file "),
    "more placeholders": (("see <image> and <image>", [_image(0)]),
                          "prompt has 2 image placeholders (<image> or image parts) but the row has 1 image"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_fails_in_one_line_naming_it(encoder, tmp_path, case):
    row, reason = BAD_ROWS[case]
    path = _verl(tmp_path / "p.parquet", [("fine <image>", [_image(0)]), row, ("fine too", [])])
    source = PromptSource(path, encoder.tokenizer, vision=encoder)
    with pytest.raises(RolloutError) as err:
        source.validate()
    message = str(err.value)
    assert message.startswith(f"row 1 of {path}: ") and reason in message and "--skip-invalid" in message
    assert "\n" not in message


def test_skip_invalid_leaves_bad_rows_out(encoder, tmp_path):
    rows = [("fine <image>", [_image(0)])] + [BAD_ROWS[case][0] for case in sorted(BAD_ROWS)] + [("ok", [])]
    source = PromptSource(_verl(tmp_path / "p.parquet", rows), encoder.tokenizer, vision=encoder, skip_invalid=True,
                          batch_rows=2)
    skipped = source.validate()
    assert [s.prompt_index for s in skipped] == [1, 2, 3] and source.num_valid == 2
    assert all(reason in s.reason for s, (_, reason) in zip(skipped, [BAD_ROWS[c] for c in sorted(BAD_ROWS)]))
    assert [p.prompt_index for p in source] == [0, 4]


def test_placeholders_without_an_image_column_suggest_image_key(encoder, tmp_path):
    path = _write(tmp_path / "p.parquet", {"prompt": ["look <image>"], "pictures": [png_bytes(PICTURES[0])]})
    with pytest.raises(RolloutError, match="the file has no image column\\); pass --image-key NAME"):
        PromptSource(path, encoder.tokenizer, vision=encoder).validate()


def test_text_only_model_refuses_an_image_column(encoder, tmp_path):
    path = _verl(tmp_path / "p.parquet", [("plain", []), ("see <image>", [_image(0)])])
    for skip_invalid in (False, True):  # the model, not the row, is wrong: no skipping
        with pytest.raises(RolloutError) as err:
            PromptSource(path, encoder.tokenizer, skip_invalid=skip_invalid).validate()
        message = str(err.value)
        assert message.startswith(f"row 1 of {path} holds an image in column 'images', but the model is text-only")
        assert "drop that column" in message and "\n" not in message


@pytest.mark.parametrize("vision", [True, False], ids=["vision", "text_only"])
def test_a_text_column_named_as_the_image_column_says_it_holds_strings(encoder, tmp_path, vision):
    """--image-key naming a column of text: each row said "no file" (fix or skip the row), or on a text-only
    model "holds an image"; the column is wrong for the whole run, so no skipping either."""
    path = _write(tmp_path / "p.parquet", {"prompt": ["a", "b"], "source": ["gsm8k", "math"]})
    for skip_invalid in (False, True):
        with pytest.raises(RolloutError) as err:
            PromptSource(path, encoder.tokenizer, image_key="source", vision=encoder if vision else None,
                         skip_invalid=skip_invalid).validate()
        message = str(err.value)
        assert message.startswith(f"column 'source' of {path} holds strings, not images (row 0: 'gsm8k' is no "
                                  "image file); the image column must hold {bytes, path} structs"), message
        assert "image file paths: pass --image-key" in message and "\n" not in message


def test_a_missing_image_file_in_a_path_column_is_still_one_rows_problem(encoder, tmp_path):
    PICTURES[0].save(tmp_path / "0.png")
    path = _write(tmp_path / "p.parquet", {"prompt": ["<image> a", "<image> b"], "pics": ["gone.png", "0.png"]})
    source = PromptSource(path, encoder.tokenizer, image_key="pics", vision=encoder, skip_invalid=True)
    assert [(s.prompt_index, "no file" in s.reason) for s in source.validate()] == [(0, True)]


def test_text_only_model_keeps_an_empty_image_column(encoder, tmp_path):
    path = _verl(tmp_path / "p.parquet", [("plain", []), ("other", [])])
    source = PromptSource(path, encoder.tokenizer)
    assert not source.has_images and source.passthrough_schema.names == ["images", "answer"]  # as before images
    assert [p.passthrough["images"] for p in source] == [[], []]


def test_ids_past_the_cache_budget_are_encoded_again(encoder, tmp_path):
    rows = [("a <image>", [_image(0)]), ("b <image><image>", [_image(1), _image(2)]), ("c", [])]
    path = _verl(tmp_path / "p.parquet", rows)
    cached = list(PromptSource(path, encoder.tokenizer, vision=encoder))
    uncached = list(PromptSource(path, encoder.tokenizer, vision=encoder, cache_bytes=0))
    assert [p.prompt_token_ids for p in cached] == [p.prompt_token_ids for p in uncached]
    assert [[im.digest for im in p.images] for p in cached] == [[im.digest for im in p.images] for p in uncached]


# ---- the output column --------------------------------------------------------------------------


def test_requests_carry_images_and_trajectories_their_grids(encoder):
    _, images = encoder.encode("<image><image>", [_image(0), _image(1)])
    maker = RequestMaker(vocab_size=1000, eos_token_ids=frozenset(), max_model_len=512)
    requests = maker.samples(PromptInput(3, [1, 2, 3], images=images), SamplingParams(n=2), skip=set())
    layout = SimpleNamespace(images=tuple(images))  # the engine gives each sample the prompt's VisionLayout
    for request in requests:
        request.vision = layout
    assert all(r.images == tuple(images) for r in requests)
    engine = SimpleNamespace(decode=lambda ids: "", weight_version="0")
    with_images = Engine.trajectory(engine, requests[0])
    text = Engine.trajectory(engine, maker.samples(PromptInput(4, [1, 2]), SamplingParams(), skip=set())[0])
    assert with_images.image_grid_thw == [[1, 4, 4], [1, 4, 8]] and text.image_grid_thw is None
    assert with_images.to_row()["image_grid_thw"] == [[1, 4, 4], [1, 4, 8]]
    assert "image_grid_thw" not in text.to_row()  # a text run's rows keep their columns


def _trajectory(index: int, grids) -> Trajectory:
    return Trajectory(prompt_index=index, sample_index=0, prompt_token_ids=[1], response_token_ids=[2],
                      response_logprobs=[-0.5], response_text="x", finish_reason="length", weight_version="0",
                      response_weight_versions=["0"], image_grid_thw=grids)


def test_image_grid_thw_column(tmp_path):
    with TrajectoryWriter(tmp_path, pa.schema([]), images=True) as writer:
        writer.add(_trajectory(0, [[1, 4, 4], [1, 10, 6]]).to_row())
        writer.add(_trajectory(1, None).to_row())  # a text row of an image run
    table = pq.read_table(tmp_path / "trajectories")
    assert table.schema.field("image_grid_thw").type == pa.list_(pa.list_(pa.int32()))
    assert table.column("image_grid_thw").to_pylist() == [[[1, 4, 4], [1, 10, 6]], []]
    with TrajectoryWriter(tmp_path / "text", pa.schema([])) as writer:
        writer.add(_trajectory(0, None).to_row())
    assert "image_grid_thw" not in pq.read_table(tmp_path / "text" / "trajectories").schema.names


def test_resume_compares_the_image_key(tmp_path):
    job = SimpleNamespace(out=str(tmp_path), continue_aborted=False, data="p.parquet")
    settings = {"model_source": None, "image_key": "pics", "sampling": {}}
    (tmp_path / "manifest.json").write_text(json.dumps({"image_key": None, "sampling": {}}))
    with pytest.raises(RolloutError, match="made with image_key=None, this run has 'pics'"):
        check_resume(job, settings, {"weights": {"version": "0"}})
    # from before --image-key (a run's manifest always records its sampling settings)
    (tmp_path / "manifest.json").write_text(json.dumps({"prompt_key": "prompt", "sampling": SAMPLING_DEFAULTS}))
    check_resume(job, {"model_source": None, "prompt_key": "prompt", "image_key": None, "sampling": SAMPLING_DEFAULTS},
                 {"weights": {"version": "0"}})
