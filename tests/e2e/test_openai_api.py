"""The daemon's OpenAI-compatible API driven by the official `openai` client (issue 21): a real
daemon over TCP with a token, the example model in float32 on the CPU.

What a user of vLLM's or SGLang's server expects: completions equal `rollout run` on the same
prompts and seed; streaming gives what the whole response gives; stop strings and stop token ids cut
where they say; a request aborted by id returns exactly its tokens so far, and a continuation from
them equals the uninterrupted run; a client that goes away frees the engine; a request held by pause
keep across a weight update says which weights sampled each token.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_daemon import MODEL, Daemon, _cli, _free_port, _ok, _rows

TOKEN = "openai-test-token"
PROMPTS = ["What is 2 + 3?", "Name a color.", "Count to five:"]
# a response long enough that a request is still running when the client acts on its first chunks,
# however slow the machine (the example model allows 2,048 positions)
LONG = 1500


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("openai_api")
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    port = _free_port()
    proc = Daemon(["--host", "127.0.0.1", "--port", str(port), "--token-file", token_file,
                   "--served-model-name", "example"], work / "daemon.log")
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    try:
        proc.wait_ready(http)
        yield dict(work=work, http=http, client=client, url=url, proc=proc)
    finally:
        client.close()
        http.close()
        proc.kill()


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def _idle(http: httpx.Client, timeout: float = 60) -> None:
    """Wait until the daemon has no online request in flight."""
    deadline = time.monotonic() + timeout
    while http.get("/get_server_info").json()["online_requests"]:
        assert time.monotonic() < deadline, "online requests still in flight"
        time.sleep(0.05)


def test_models_lists_the_served_name(server):
    models = server["client"].models.list().data
    assert [m.id for m in models] == ["example"]
    with pytest.raises(openai.NotFoundError, match="is not served here; this engine serves 'example'"):
        server["client"].completions.create(model="gpt-4", prompt="hi")


def test_completions_equal_rollout_run(server):
    """n samples of three prompts at T=1 with a seed: the tokens `rollout run` writes for the same rows."""
    work = server["work"]
    data = work / "prompts.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), data)
    _ok(_cli(["run", "--model", MODEL, "--device", "cpu", "--data", data, "--out", work / "run", "--n", "2",
              "--max-new-tokens", "12", "--seed", "7", "--temperature", "1.0", "--quiet"]))
    rows = _rows(work / "run")
    response = server["client"].completions.create(
        model="example", prompt=PROMPTS, n=2, max_tokens=12, seed=7, temperature=1.0, logprobs=0,
        extra_body={"return_token_ids": True})
    assert [c.index for c in response.choices] == list(range(6))
    for choice, row in zip(response.choices, rows, strict=True):
        assert choice.model_extra["prompt_token_ids"] == row["prompt_token_ids"]
        assert _ids(choice) == row["response_token_ids"]
        assert choice.text == row["response_text"]
        assert choice.finish_reason == row["finish_reason"]
        assert choice.logprobs.token_logprobs == pytest.approx(row["response_logprobs"], abs=1e-5)
        assert choice.model_extra["weight_versions"] == row["response_weight_versions"]
    assert response.usage.prompt_tokens == sum(len(r["prompt_token_ids"]) for r in rows[::2])
    assert response.usage.completion_tokens == sum(len(r["response_token_ids"]) for r in rows)
    # token ids in, the same samples out
    by_ids = server["client"].completions.create(
        model="example", prompt=[rows[0]["prompt_token_ids"]], n=2, max_tokens=12, seed=7, temperature=1.0,
        extra_body={"return_token_ids": True})
    assert [_ids(c) for c in by_ids.choices] == [rows[0]["response_token_ids"], rows[1]["response_token_ids"]]


def test_concurrent_clients_get_what_each_gets_alone(server):
    """Requests from 8 threads at once share the engine's batches (continuous batching across clients):
    each gets the tokens it gets alone."""
    client = server["client"]
    prompts = [f"{p} ({i})" for i in range(3) for p in PROMPTS][:8]

    def ask(prompt):
        return client.completions.create(model="example", prompt=prompt, max_tokens=16, n=2, seed=11,
                                         extra_body={"return_token_ids": True})

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts))
    alone = [ask(p) for p in prompts]
    for a, b in zip(together, alone, strict=True):
        assert [_ids(c) for c in a.choices] == [_ids(c) for c in b.choices]
        assert a.id != b.id


def test_chat_streaming_gives_what_the_whole_response_gives(server):
    client = server["client"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    args = dict(model="example", messages=messages, n=2, max_tokens=20, seed=3, temperature=1.0, logprobs=True,
                extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**args)
    texts, ids, logprobs, finish, roles = ["", ""], [[], []], [[], []], [None, None], set()
    usage = None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.add(choice.delta.role)
            texts[choice.index] += choice.delta.content or ""
            ids[choice.index] += choice.model_extra.get("token_ids") or []
            logprobs[choice.index] += [t.logprob for t in (choice.logprobs.content if choice.logprobs else [])]
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert "assistant" in roles
    for i, choice in enumerate(whole.choices):
        assert texts[i] == choice.message.content
        assert ids[i] == _ids(choice) and len(ids[i]) > 0
        assert logprobs[i] == pytest.approx([t.logprob for t in choice.logprobs.content], abs=1e-5)
        assert finish[i] == choice.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens == sum(len(x) for x in ids)
    assert whole.model_extra["prompt_token_ids"] == _ids_of_chat(server, messages)


def _ids_of_chat(server, messages) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def test_stop_strings_and_stop_token_ids_cut_where_they_say(server):
    client = server["client"]
    base = dict(model="example", prompt=PROMPTS[2], max_tokens=24, temperature=0.0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.completions.create(**base).choices[0]
    full_ids, text = _ids(full), full.text
    assert len(text) > 12
    stop = text[6:9]
    cut = client.completions.create(**base, stop=[stop, "never-in-the-text"]).choices[0]
    assert cut.text == text[: text.find(stop)]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    # the ids end with the token that completed the stop string: a prefix of the full response
    kept = _ids(cut)
    assert kept == full_ids[: len(kept)] and len(kept) < len(full_ids)
    assert stop not in _decode(kept[:-1]) and stop in _decode(kept)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**base, stop=stop, stream=True)
                       if c.choices)
    assert streamed == cut.text
    # vLLM's include_stop_str_in_output: the same tokens, the text through the stop string
    keep = dict(base, extra_body={**base["extra_body"], "include_stop_str_in_output": True})
    through = client.completions.create(**keep, stop=[stop, "never-in-the-text"]).choices[0]
    assert _ids(through) == kept and through.model_extra["stop_reason"] == stop
    assert through.text == text[: text.find(stop) + len(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**keep, stop=stop, stream=True)
                       if c.choices)
    assert streamed == through.text
    token = full_ids[5]
    by_token = client.completions.create(**{**base, "extra_body": {**base["extra_body"], "stop_token_ids": [token]}})
    choice = by_token.choices[0]
    end = full_ids.index(token)
    assert _ids(choice) == full_ids[: end + 1]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == token
    assert choice.text == _decode(full_ids[:end])  # vLLM leaves a stop token's text out


def _decode(ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL)).decode(ids, skip_special_tokens=True)


def _stream_until(client, chunks_before: int, on_chunk, **args):
    """Stream a completion; after `chunks_before` chunks call on_chunk() once. -> (ids, text, finish reason)."""
    ids, text, finish, seen = [], "", None, 0
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
            text += choice.text
            finish = choice.finish_reason or finish
        seen += 1
        if seen == chunks_before:
            on_chunk()
    return ids, text, finish


def test_abort_by_id_returns_the_tokens_so_far_and_a_continuation_equals_the_whole(server):
    client, http = server["client"], server["http"]
    prompt = PROMPTS[0]
    args = dict(model="example", prompt=prompt, max_tokens=LONG, temperature=0.0,
                extra_body={"return_token_ids": True, "ignore_eos": True, "request_id": "to-abort"})
    answers = []
    ids, text, finish = _stream_until(
        client, 3, lambda: answers.append(http.post("/abort_request", json={"request_id": "to-abort"}).json()), **args)
    assert answers == [{"success": True, "aborted": 1, "job_aborted": False}]
    assert finish == "abort" and 3 <= len(ids) < LONG
    assert http.post("/abort_request", json={"request_id": "to-abort"}).json()["aborted"] == 0  # gone already
    whole = client.completions.create(model="example", prompt=prompt, max_tokens=LONG, temperature=0.0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert _ids(whole)[: len(ids)] == ids
    prompt_ids = whole.model_extra["prompt_token_ids"]
    rest = client.completions.create(model="example", prompt=prompt_ids + ids, max_tokens=LONG - len(ids),
                                     temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert ids + _ids(rest.choices[0]) == _ids(whole)


def test_a_client_that_goes_away_frees_the_engine(server):
    client, http = server["client"], server["http"]
    stream = client.completions.create(model="example", prompt=PROMPTS[1], max_tokens=2000, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    _idle(http)  # the daemon noticed and aborted the request


def test_pause_keep_across_an_update_records_each_tokens_version(server):
    """slime's loop on the OpenAI API: pause keep, new weights, continue. The request in flight goes
    on, and its weight_versions say which tokens each version sampled."""
    client, http = server["client"], server["http"]
    before = http.get("/get_weight_version").json()["weight_version"]
    answers = {}

    def update():
        answers["pause"] = http.post("/pause_generation", json={"mode": "keep"}).json()
        answers["update"] = http.post("/update_weights_from_disk",
                                      json={"model_path": str(MODEL), "weight_version": "kept-v"}).json()
        answers["continue"] = http.post("/continue_generation").json()

    chunks = []
    for chunk in client.completions.create(model="example", prompt=PROMPTS[1], max_tokens=LONG, temperature=0.0,
                                           stream=True, extra_body={"return_token_ids": True, "ignore_eos": True}):
        chunks.append(chunk)
        if len(chunks) == 3:
            update()
    assert answers["pause"]["mode"] == "keep" and answers["continue"]["state"] == "serving"
    assert answers["update"]["previous_weight_version"] == before
    final = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason][0]
    ids = [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []]
    versions = final.model_extra["weight_versions"]
    assert final.finish_reason == "length" and len(ids) == len(versions) == LONG
    switch = versions.index("kept-v")
    assert 3 <= switch < LONG and set(versions[:switch]) == {before} and set(versions[switch:]) == {"kept-v"}
    # the same checkpoint came back: the retracted request recomputed its KV and went on unchanged
    whole = client.completions.create(model="example", prompt=PROMPTS[1], max_tokens=LONG, temperature=0.0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert _ids(whole) == ids and whole.model_extra["weight_versions"] == ["kept-v"] * LONG


def test_a_job_and_online_requests_do_not_mix(server):
    client, http = server["client"], server["http"]
    work = server["work"]
    answers = []

    def try_job_then_abort():
        answers.append(http.post("/generate", json={"data": str(work / "prompts.parquet"), "out": str(work / "j")}))
        answers.append(http.post("/abort_request", json={"request_id": "running"}).json())

    ids, _, finish = _stream_until(client, 2, try_job_then_abort, model="example", prompt=PROMPTS[0],
                                   max_tokens=LONG, temperature=0.0,
                                   extra_body={"return_token_ids": True, "ignore_eos": True, "request_id": "running"})
    assert answers[0].status_code == 409 and "online requests are in flight" in answers[0].json()["error"]
    assert answers[1]["aborted"] == 1 and finish == "abort" and len(ids) < LONG
    assert not (work / "j").exists()


@pytest.mark.parametrize("args, status, message", [
    (dict(prompt="x", logprobs=21), 400, "logprobs must be in [0, 20]"),
    (dict(prompt="x", extra_body={"tempreature": 1}), 400, "did you mean temperature"),
    (dict(prompt=[99999]), 400, "token ids outside"),
    (dict(prompt="x", presence_penalty=0.5), 400, "presence_penalty"),
    (dict(prompt="x", temperature=-1), 400, "temperature must be a finite number >= 0"),
    (dict(prompt="x", n=0), 400, "n must be at least 1, got 0"),
    (dict(prompt="x", seed=-1), 400, "seed -1 is out of range"),  # was the stream of 2^64 - 1
    (dict(prompt="x", seed=2**64), 400, f"seed {2**64} is out of range"),
    (dict(prompt=["x", "y"], n=40000), 400, "asks for 80,000 samples; one request takes at most 65,536"),
])
def test_bad_requests_get_one_line(server, args, status, message):
    with pytest.raises(openai.APIStatusError) as caught:
        server["client"].completions.create(model="example", **args)
    assert caught.value.status_code == status and message in caught.value.message
    assert "\n" not in caught.value.message


def test_chat_refusals_and_the_token(server):
    client = server["client"]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs true"):
        client.chat.completions.create(model="example", messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="has image parts but the served model 'example' is text-only"):
        client.chat.completions.create(model="example", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    wrong = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="bearer token"):
        wrong.models.list()


def test_the_cli_aborts_by_id_and_shows_online_requests(server):
    address = ["--engine", server["url"], "--token-file", server["work"] / "token"]
    assert _ok(_cli(["abort", "--request-id", "nope", *address])).stdout.strip() == "no request nope in flight"
    status = _ok(_cli(["status", *address])).stdout
    assert "online requests 0 in flight" in status and "sessions open" in status



def test_a_session_keeps_the_conversation_and_its_turns_equal_one_prompt(server):
    """Five turns, token ids in and out: each turn's prompt is the conversation so far plus new tokens.
    Each turn prefills only what is new (the cache serves the rest), and the last turn equals the whole
    conversation sent as one prompt."""
    client, http = server["client"], server["http"]
    tokenizer_ids = _chat_ids_of_user_turns(5)
    conversation: list[int] = []
    answers = []
    for k, new_tokens in enumerate(tokenizer_ids):
        prompt = conversation + new_tokens
        answer = client.completions.create(model="example", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=0,
                                           extra_body={"return_token_ids": True, "session_id": "conv-1"})
        choice = answer.choices[0]
        cached = answer.usage.prompt_tokens_details.cached_tokens
        if k == 0:
            assert cached == 0
        else:  # all but the new tokens and the last response token (whose KV was never computed)
            assert cached == len(conversation) - 1
        session = answer.model_extra["session"]
        assert session["turns"] == k + 1 and session["pinned_tokens"] == len(prompt) + len(_ids(choice)) - 1
        answers.append(answer)
        conversation = prompt + _ids(choice)
    stats = http.post("/close_session", json={"session_id": "conv-1"}).json()
    total = sum(a.usage.prompt_tokens for a in answers)
    cached = sum(a.usage.prompt_tokens_details.cached_tokens for a in answers)
    assert stats["turns"] == 5 and stats["prompt_tokens"] == total and stats["cached_tokens"] == cached
    assert stats["hit_rate"] == pytest.approx(cached / total, abs=1e-4) and stats["hit_rate"] > 0.5
    again = http.post("/close_session", json={"session_id": "conv-1"})
    assert again.status_code == 400 and "no open session 'conv-1'" in again.json()["error"]
    # the whole conversation as one prompt, no session, nothing cached of it: the same last turn
    http.post("/flush_cache")
    last_prompt = answers[-1].choices[0].model_extra["prompt_token_ids"]
    whole = client.completions.create(model="example", prompt=last_prompt, max_tokens=8, temperature=0.0,
                                      logprobs=0, extra_body={"return_token_ids": True})
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert _ids(whole.choices[0]) == _ids(answers[-1].choices[0])
    assert whole.choices[0].logprobs.token_logprobs == pytest.approx(
        answers[-1].choices[0].logprobs.token_logprobs, abs=1e-5)


def test_session_requests_are_one_conversation(server):
    with pytest.raises(openai.BadRequestError, match="one turn of one conversation"):
        server["client"].completions.create(model="example", prompt="hi", n=2, extra_body={"session_id": "s"})


def _chat_ids_of_user_turns(turns: int) -> list[list[int]]:
    """Token ids of each user turn as the chat template writes it after an assistant turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    return [tokenizer.encode(f"\n<|im_start|>user\nStep {k}: add {k} to the total.<|im_end|>\n<|im_start|>assistant\n")
            for k in range(turns)]
