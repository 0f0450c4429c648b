"""--speculative mtp (issue 22 item 1): drafts from the checkpoint's multi-token-prediction head.

Exactness: the tokens and logprobs of decoding without drafts (float32, CPU), dense-MLP and MoE hybrids.
The head itself: every draft the engine proposed equals the head run once over the finished sequence
(transformers' target hidden states, the head's modules under a plain causal attention), whatever the
step layout that built the head's KV (chunked prefill, one request or several at a time). Then the
refusals, each one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rollout_cli import Engine, SamplingParams
from rollout_cli.config import EngineConfig
from rollout_cli.engine.scheduling.mtp_drafts import RecordingMTPDrafter
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.errors import RolloutError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtp_fixtures import with_mtp_head  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 250, 31, 8, 9, 40, 41, 42], [7, 7, 8, 100, 42, 11], [300, 2, 4]]
ARCHS = ["qwen3_next", "qwen3_5"]


@pytest.fixture(scope="module")
def mtp_checkpoints(tiny_hybrid_checkpoints, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mtp_ckpts")
    return {arch: with_mtp_head(tiny_hybrid_checkpoints[arch], root / arch) for arch in ARCHS}


def _run(model: str, params: SamplingParams, **options):
    if options.get("speculative"):
        options.setdefault("speculative_gate", False)  # every decode step drafts: the stats below count them
    engine = Engine(model, device="cpu", dtype="float32", max_model_len=128, kv_cache_tokens=2048, **options)
    results = sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], params),
                     key=lambda t: (t.prompt_index, t.sample_index))
    return engine, results


@pytest.mark.parametrize("draft_tokens", [1, 3])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_drafts_change_no_token(arch, sampling, draft_tokens, mtp_checkpoints):
    params = (SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, n=2) if sampling == "greedy"
              else SamplingParams(temperature=1.0, seed=3, max_new_tokens=20, ignore_eos=True, n=2))
    _, want = _run(mtp_checkpoints[arch], params)
    engine, got = _run(mtp_checkpoints[arch], params, speculative="mtp", num_draft_tokens=draft_tokens)
    assert [(r.prompt_index, r.sample_index) for r in got] == [(r.prompt_index, r.sample_index) for r in want]
    for a, b in zip(got, want, strict=True):
        assert a.response_token_ids == b.response_token_ids
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-4)
    stats = engine.scheduler.stats
    assert stats.verify_steps > 0
    if draft_tokens == 1:
        assert stats.draft_tokens == stats.verify_steps  # one draft a verify step
    else:  # the chain drafts up to 3 (fewer only where max_new_tokens leaves less room)
        assert stats.verify_steps * 2 < stats.draft_tokens <= stats.verify_steps * 3
    assert engine.kv.k.shape[0] == engine.model.num_kv_layers == 2  # the full-attention layer and the head's


class _CausalAttention:
    """The head's attention over the whole sequence at once: plain causal softmax attention (GQA)."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [T, heads, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _reference_drafts(engine, model_dir: str, sequence: list[int]) -> list[int]:
    """The head's greedy guess for every position p >= 2 of `sequence` (index p - 2), from one pass."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([sequence])
    with torch.no_grad():
        hidden = hf.model(input_ids=ids).last_hidden_state[0]  # [T, H], after the final norm
        model = engine.model
        embeds = model.model.embed_tokens(ids[0, 1:])  # tokens at q + 1
        positions = torch.arange(len(sequence) - 1)
        out = model.mtp(embeds, hidden[:-1], positions, _CausalAttention())
        return model.compute_logits(out).argmax(-1).tolist()


@pytest.mark.parametrize("layout", ["one prefill", "chunked, one at a time"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_draft_is_the_heads_prediction(arch, layout, mtp_checkpoints):
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    options = {"enable_prefix_cache": False}
    if layout != "one prefill":
        options.update(max_batch_tokens=4, max_running=1)
    engine = Engine(mtp_checkpoints[arch], device="cpu", dtype="float32", max_model_len=128, kv_cache_tokens=2048,
                    speculative="mtp", **options)
    log = {}
    engine.scheduler.enable_speculation(RecordingMTPDrafter(log), 1)
    results = list(engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], params))
    checked = 0
    for result in results:
        sequence = PROMPTS[result.prompt_index] + result.response_token_ids
        reference = _reference_drafts(engine, mtp_checkpoints[arch], sequence)
        for (prompt, sample, position), token in log.items():
            if (prompt, sample) == (result.prompt_index, result.sample_index):
                assert token == reference[position - 2], (prompt, position)
                checked += 1
    assert checked >= len(results) * 5  # a draft after the prompt and after most steps


def test_above_the_max_batch_the_head_keeps_its_kv_and_drafts_resume(mtp_checkpoints):
    """--speculative-max-batch 2: while more run, steps carry no drafts but the head's pass still stores its
    KV at every position (behind each step at launch, the next step planned ahead meanwhile); once two or
    fewer run, its drafts (each checked against the one-pass reference) resume. Tokens as plain decoding's."""
    model = mtp_checkpoints["qwen3_next"]
    lengths = [6, 10, 16]  # 6 running, then 4, then 2
    prompts = [PromptInput(i, p, params=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, n=2))
               for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    options = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_tokens=2048, enable_prefix_cache=False)
    want = sorted(Engine(model, **options).stream(prompts, SamplingParams()),
                  key=lambda t: (t.prompt_index, t.sample_index))
    engine = Engine(model, speculative="mtp", speculative_max_batch=2, **options)
    log, ahead = {}, []
    engine.scheduler.enable_speculation(RecordingMTPDrafter(log), 1, 2)
    plan_ahead = engine.scheduler.schedule_ahead
    engine.scheduler.schedule_ahead = lambda prev: ahead.append(plan_ahead(prev)) or ahead[-1]
    got = sorted(engine.stream(prompts, SamplingParams()), key=lambda t: (t.prompt_index, t.sample_index))
    for a, b in zip(got, want, strict=True):
        assert a.response_token_ids == b.response_token_ids
    # steps without drafts ran the head's pass behind them at launch, so the next was planned ahead
    assert sum(out is not None for out in ahead) >= 5
    assert log and all(prompt == 2 for prompt, _, _ in log)  # proposed only while the 16-token pair ran alone
    for (prompt, sample, position), token in log.items():
        sequence = PROMPTS[prompt] + got[2 * prompt + sample].response_token_ids
        assert token == _reference_drafts(engine, model, sequence)[position - 2]
    assert engine.scheduler.stats.verify_steps > 0


def _reference_chain(engine, model_dir: str, sequence: list[int], start: int, first: int, length: int) -> list[int]:
    """The head's chained draft for the positions after `start` (the newest token's position, sequence
    known up to it): its guess `first` from position start - 1, then each further token from the head's
    own output and the token before, under a plain causal attention over the true rows and the chain's."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([sequence[: start + 1]])
    model, drafts = engine.model, [first]
    with torch.no_grad():
        hidden = hf.model(input_ids=ids).last_hidden_state[0, :start]  # [start, H]: target states at 0..start-1
        embeds = model.model.embed_tokens(ids[0, 1:])  # [start, H]: the tokens at q + 1
        out = model.mtp(embeds, hidden, torch.arange(start), _CausalAttention())
        while len(drafts) < length:  # one more row: (the head's last output, the last draft) at the next position
            embeds = torch.cat((embeds, model.model.embed_tokens(torch.tensor(drafts[-1:]))))
            hidden = torch.cat((hidden, out[-1:]))
            out = model.mtp(embeds, hidden, torch.arange(len(hidden)), _CausalAttention())
            drafts.append(int(model.compute_logits(out[-1:]).argmax(-1)))
    return drafts


@pytest.mark.parametrize("arch", ARCHS)
def test_longer_drafts_are_the_heads_chain(arch, mtp_checkpoints):
    """--num-draft-tokens 3: drafts 2 and 3 come from the head chained on its own output, run inside the
    verify step (MTPStep.extend_drafts); each equals the chain recomputed over the finished sequence."""
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    engine = Engine(mtp_checkpoints[arch], device="cpu", dtype="float32", max_model_len=128, kv_cache_tokens=2048,
                    speculative="mtp", num_draft_tokens=3, enable_prefix_cache=False, speculative_gate=False)
    log, extend = {}, engine.runner.mtp_step.extend_drafts

    def logging_extend(entries):
        extend(entries)
        for e in entries:
            if e.num_draft:
                log[(e.request.prompt_index, e.request.sample_index, e.start)] = list(e.token_ids[1:])

    engine.runner.mtp_step.extend_drafts = logging_extend
    results = list(engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], params))
    chains = 0
    for result in results:
        sequence = PROMPTS[result.prompt_index] + result.response_token_ids
        for (prompt, sample, start), drafts in log.items():
            if (prompt, sample) == (result.prompt_index, result.sample_index):
                assert drafts == _reference_chain(engine, mtp_checkpoints[arch], sequence, start, drafts[0],
                                                  len(drafts)), (prompt, start)
                chains += len(drafts) > 1
    assert chains >= len(results) * 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_on_policy_mode_with_mtp_drafts_bit_for_bit(arch, dtype, mtp_checkpoints):
    """--deterministic --speculative mtp: the one-token forwards keep each token's hidden state for the head's
    pass; seeded tokens and logprobs those of the on-policy mode without drafts, to the bit; the drafts are
    the head's over those states (every one checked against the one-pass reference in float32)."""
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=12, ignore_eos=True, n=2)
    options = dict(device="cpu", dtype=dtype, max_model_len=128, kv_cache_tokens=2048, deterministic=True,
                   enable_prefix_cache=False)
    model = mtp_checkpoints[arch]
    want = sorted(Engine(model, **options).stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], params),
                  key=lambda t: (t.prompt_index, t.sample_index))
    engine = Engine(model, speculative="mtp", num_draft_tokens=2, **options)
    log = {}
    engine.scheduler.enable_speculation(RecordingMTPDrafter(log), 2)
    got = sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], params),
                 key=lambda t: (t.prompt_index, t.sample_index))
    assert [t.response_token_ids for t in got] == [t.response_token_ids for t in want]
    assert [t.response_logprobs for t in got] == [t.response_logprobs for t in want]
    assert engine.scheduler.stats.verify_steps > 0 and len(log) >= len(got) * 4
    if dtype == "float32":
        for result in got:
            reference = _reference_drafts(engine, model, PROMPTS[result.prompt_index] + result.response_token_ids)
            for (prompt, sample, position), token in log.items():
                if (prompt, sample) == (result.prompt_index, result.sample_index):
                    assert token == reference[position - 2], (prompt, position)


def test_refusals(mtp_checkpoints, tiny_hybrid_checkpoints, example_model_dir):
    with pytest.raises(RolloutError, match="holds no multi-token-prediction head"):
        Engine(tiny_hybrid_checkpoints["qwen3_next"], device="cpu", max_model_len=64, speculative="mtp")
    with pytest.raises(RolloutError, match="MTP head of Qwen3-Next / Qwen3.5 checkpoints"):
        Engine(example_model_dir, device="cpu", max_model_len=64, speculative="mtp")
    assert EngineConfig(model=example_model_dir, speculative="siblings").num_draft_tokens == 4
    assert EngineConfig(model=mtp_checkpoints["qwen3_next"], speculative="mtp").num_draft_tokens == 1
    assert EngineConfig(model=mtp_checkpoints["qwen3_next"], speculative="mtp", num_draft_tokens=3).num_draft_tokens == 3


def test_a_reload_without_the_head_keeps_it(mtp_checkpoints, tiny_hybrid_checkpoints, tmp_path):
    """Trainers often save no mtp.* tensors: such a checkpoint reloads into an mtp engine (the head keeps its
    weights and drafts on); a first load without the head is refused (test_refusals)."""
    import shutil

    from safetensors.torch import load_file, save_file

    trained = tmp_path / "trained"
    shutil.copytree(tiny_hybrid_checkpoints["qwen3_next"], trained)
    for path in trained.glob("*.safetensors"):  # new weights for the target, none for the head
        save_file({name: t * 1.01 for name, t in load_file(str(path)).items()}, str(path))
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    engine = Engine(mtp_checkpoints["qwen3_next"], device="cpu", dtype="float32", max_model_len=128,
                    kv_cache_tokens=2048, speculative="mtp", speculative_gate=False)
    head = engine.model.mtp.fc.weight.clone()
    engine.reload_weights(str(trained))
    assert torch.equal(engine.model.mtp.fc.weight, head) and engine.weight_version == "1"
    got = list(engine.stream([PromptInput(0, PROMPTS[0])], params))
    want = list(Engine(str(trained), device="cpu", dtype="float32", max_model_len=128,
                       kv_cache_tokens=2048).stream([PromptInput(0, PROMPTS[0])], params))
    assert got[0].response_token_ids == want[0].response_token_ids
    assert engine.scheduler.stats.verify_steps > 0


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_multimodal_qwen3_5_drafts_from_image_prompts(arch, tmp_path):
    """Qwen3.5 as the hub ships it (ForConditionalGeneration: the vision tower, model.language_model.*, mtp.*):
    image prompts decode the tokens of plain decoding with 2-token drafts, and every first draft is the head's
    prediction from HF's own pieces: its hidden states, its image features at the image tokens' rows and its
    3-D rotary positions (get_rope_index)."""
    from vlm_fixtures import IMAGE_PAD, HFVisionReference, ReferencePrompts, build_tiny_vlm, random_image

    model = with_mtp_head(str(build_tiny_vlm(tmp_path / "vlm", arch)), tmp_path / "mtp")
    build = ReferencePrompts(model)
    prompts = [build.build([random_image(20, 12, 1)]), build.build([random_image(32, 24, 2)], "compare"),
               build.build([], "text only")]
    inputs = [PromptInput(i, ids, images=images) for i, (ids, images) in enumerate(prompts)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    # no prefix cache: a prompt sharing the chat template's first tokens with another would keep the head's
    # KV of the last shared position, made with the other prompt's next token (it only costs acceptance)
    options = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=4096, enable_prefix_cache=False)
    want = sorted(Engine(model, **options).stream(inputs, params), key=lambda t: t.prompt_index)
    engine = Engine(model, speculative="mtp", num_draft_tokens=2, **options)
    log = {}
    engine.scheduler.enable_speculation(RecordingMTPDrafter(log), 2)
    got = sorted(engine.stream(inputs, params), key=lambda t: t.prompt_index)
    assert [t.response_token_ids for t in got] == [t.response_token_ids for t in want]
    assert engine.scheduler.stats.verify_steps > 0

    hf = HFVisionReference(model)
    checked = 0
    for result in got:
        ids, images = prompts[result.prompt_index]
        sequence = ids + result.response_token_ids
        batch = hf._inputs(sequence, images)
        with torch.no_grad():
            hidden = hf.model.model(**batch).last_hidden_state[0]  # [T, H] after the final norm
            rope, _ = hf.model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                                    batch.get("image_grid_thw"), None, batch["attention_mask"])
            embeds = engine.model.model.embed_tokens(torch.tensor(sequence[1:]))  # the tokens at q + 1
            if images:
                features = hf.model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
                embeds[torch.tensor(sequence[1:]) == IMAGE_PAD] = torch.cat(features.pooler_output)
            out = engine.model.mtp(embeds, hidden[:-1], rope[:, 0, :-1], _CausalAttention())
            reference = engine.model.compute_logits(out).argmax(-1).tolist()
        for (prompt, _, position), token in log.items():
            if prompt == result.prompt_index:
                assert token == reference[position - 2], (prompt, position)
                checked += 1
    assert checked >= len(got) * 4
