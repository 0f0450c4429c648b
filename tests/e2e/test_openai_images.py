"""Images in the daemon's OpenAI chat API (`/v1/chat/completions` image parts), the official `openai`
client against a real daemon serving a tiny Qwen3-VL checkpoint in float32 on the CPU.

What a vLLM or SGLang user expects: an image sent as a data URL, a file URL or a path gives the prompt
ids HF's processor builds for the same picture and text, and HF's greedy tokens and logprobs; text and
image parts keep their order; n, seeds, top_logprobs and streaming behave as for text; every bad image
is a 400 with one line.
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import httpx
import openai
import pytest

from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.trajectory import PromptInput
from test_daemon import Daemon, _free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_fixtures import (IMAGE_PAD, HFVisionReference, ReferencePrompts, build_tiny_vlm, png_bytes,  # noqa: E402
                          random_image)

TOKEN = "openai-images-token"
GREEDY = dict(temperature=0.0, max_tokens=8, extra_body={"return_token_ids": True, "ignore_eos": True})


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai_images")
    model = build_tiny_vlm(root / "model", "qwen3_vl")
    (root / "token").write_text(TOKEN + "\n")
    port = _free_port()
    proc = Daemon(["--host", "127.0.0.1", "--port", str(port), "--token-file", root / "token",
                   "--served-model-name", "vlm", "--dtype", "float32", "--max-model-len", "512"],
                  root / "daemon.log", model=model)
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    try:
        proc.wait_ready(http)
        yield dict(root=root, model=str(model), client=client, hf=HFVisionReference(str(model)),
                   build=ReferencePrompts(str(model)))
    finally:
        client.close()
        http.close()
        proc.kill()


def _data_url(picture) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(picture)).decode()


def _image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _chat(vlm, content, **args):
    return vlm["client"].chat.completions.create(model="vlm", messages=[{"role": "user", "content": content}],
                                                 **{**GREEDY, **args})


def _reference_ids(build: ReferencePrompts, parts: list) -> tuple[list[int], tuple]:
    """HF's prompt ids for one user message whose parts (text strings and PIL images) keep their order."""
    images = tuple(build.image(p) for p in parts if not isinstance(p, str))
    content = [_text(p) if isinstance(p, str) else {"type": "image"} for p in parts]
    ids = build.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                              tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expanded, pending = [], iter(images)
    for token in ids:
        expanded += [token] * (next(pending).num_tokens(2) if token == IMAGE_PAD else 1)
    return expanded, images


def test_one_data_url_image_matches_hf(vlm):
    picture = random_image(20, 12, 1)
    response = _chat(vlm, [_image_url(_data_url(picture)), _text("what is it")], logprobs=True, top_logprobs=2)
    ids, images = vlm["build"].build([picture], "what is it")
    assert response.model_extra["prompt_token_ids"] == ids and ids.count(IMAGE_PAD) == 4
    assert response.usage.prompt_tokens == len(ids)
    choice = response.choices[0]
    want = vlm["hf"].greedy(ids, images, 8)
    assert choice.model_extra["token_ids"] == want
    content = choice.logprobs.content
    assert [t.logprob for t in content] == pytest.approx(vlm["hf"].logprobs(ids, images, want), abs=1e-4)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content)
    # a text-only chat on the vision-language model: the text path's ids
    text = _chat(vlm, "what is it")
    assert text.model_extra["prompt_token_ids"] == vlm["build"].build([], "what is it")[0]


def test_two_images_keep_their_order_from_data_urls_files_and_paths(vlm):
    first, second = random_image(32, 24, 2), random_image(16, 40, 3)
    path = vlm["root"] / "second.png"
    second.save(path)
    response = _chat(vlm, [_text("compare "), _image_url(_data_url(first)), _text(" with "),
                           _image_url(path.as_uri()), _text(" please")])
    ids, images = _reference_ids(vlm["build"], ["compare ", first, " with ", second, " please"])
    assert images[0].grid_thw != images[1].grid_thw
    assert response.model_extra["prompt_token_ids"] == ids
    assert response.choices[0].model_extra["token_ids"] == vlm["hf"].greedy(ids, images, 8)
    # a plain path, and HF's {"type": "image"} part: the same prompt and tokens
    for part in (_image_url(str(path)), {"type": "image", "image": str(path)}):
        again = _chat(vlm, [_text("compare "), {"type": "image", "url": _data_url(first)}, _text(" with "), part,
                            _text(" please")])
        assert again.model_extra["prompt_token_ids"] == ids
        assert again.choices[0].model_extra["token_ids"] == response.choices[0].model_extra["token_ids"]


def _sampled(vlm, picture, **args):
    return _chat(vlm, [_text("describe"), _image_url(_data_url(picture))], n=2, temperature=1.0, seed=5,
                 logprobs=True, **args)


def test_n_samples_with_a_seed_equal_the_engines(vlm):
    picture = random_image(24, 24, 4)
    response = _sampled(vlm, picture)
    assert [c.index for c in response.choices] == [0, 1]
    ids, images = _reference_ids(vlm["build"], ["describe", picture])
    assert response.model_extra["prompt_token_ids"] == ids
    engine = Engine(vlm["model"], device="cpu", dtype="float32", max_model_len=512, kv_cache_tokens=4096)
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_new_tokens=8, ignore_eos=True)
    ours = sorted(engine.stream([PromptInput(0, ids, images=images)], params), key=lambda t: t.sample_index)
    for choice, trajectory in zip(response.choices, ours, strict=True):
        assert choice.model_extra["token_ids"] == trajectory.response_token_ids
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(trajectory.response_logprobs, abs=1e-5)


def test_streaming_gives_what_the_whole_response_gives(vlm):
    picture = random_image(24, 24, 4)
    whole = _sampled(vlm, picture)
    texts, ids, logprobs, usage = ["", ""], [[], []], [[], []], None
    for chunk in _sampled(vlm, picture, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            ids[choice.index] += choice.model_extra.get("token_ids") or []
            logprobs[choice.index] += [t.logprob for t in (choice.logprobs.content if choice.logprobs else [])]
    for i, choice in enumerate(whole.choices):
        assert texts[i] == choice.message.content and ids[i] == choice.model_extra["token_ids"]
        assert logprobs[i] == pytest.approx([t.logprob for t in choice.logprobs.content], abs=1e-5)
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 16


def _bad_parts(root: Path) -> dict:
    (root / "not_an_image.png").write_bytes(b"plain text, not a picture")
    garbage = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    return {
        "http": (_image_url("https://example.com/cat.png"), "does not fetch from the network"),
        "base64": (_image_url("data:image/png;base64,@@not base64@@"), "base64 payload is invalid"),
        "not base64": (_image_url("data:image/png,rawbytes"), "without a base64 payload"),
        "undecodable": (_image_url(garbage), "cannot be decoded"),
        "undecodable file": (_image_url(str(root / "not_an_image.png")), "cannot be decoded"),
        "missing": (_image_url(str(root / "missing.png")), "no file"),
        "relative": (_image_url("cat.png"), "relative path"),
        "no url": ({"type": "image"}, "names no image"),
        "audio": ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "takes text and image"),
    }


@pytest.mark.parametrize("case", ["http", "base64", "not base64", "undecodable", "undecodable file", "missing",
                                  "relative", "no url", "audio"])
def test_bad_images_get_400_and_one_line(vlm, case):
    part, message = _bad_parts(vlm["root"])[case]
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(vlm, [_text("look: "), part])
    assert message in caught.value.message and "\n" not in caught.value.message
    assert case == "audio" or "image 1 (message 0, content part 1)" in caught.value.message


def test_a_session_with_images_pins_its_image_tokens(vlm):
    """Two turns of one session, the client resending the conversation with its image: the first turn's KV,
    image tokens included (cached under the image's pixels), stays pinned and serves the second's prefill."""
    picture = _data_url(random_image(16, 16, 6))
    messages = [{"role": "user", "content": [_image_url(picture), _text("look")]}]
    args = {**GREEDY, "extra_body": {"session_id": "s-img", "return_token_ids": True, "ignore_eos": True}}
    first = vlm["client"].chat.completions.create(model="vlm", messages=messages, **args)
    prompt, answer = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    assert first.model_extra["session"]["pinned_tokens"] == len(prompt) + len(answer) - 1
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": [_text("and now")]}]
    second = vlm["client"].chat.completions.create(model="vlm", messages=messages, **args)
    stats = second.model_extra["session"]
    assert stats["turns"] == 2 and stats["cached_tokens"] >= prompt.count(IMAGE_PAD) + prompt.index(IMAGE_PAD)
