"""The engine's side of sampling: each step's per-row settings, prepared once for either path.

The sampler itself lives in `kernels/`: `sampling.py` (the Triton kernel), `sampling_ref.py`
(`sample_ref`, its plain torch reference, and the host side of the random numbers) and
`sampling_rng.py` (their device side). Every row draws from its own key (seed, prompt_index,
sample_index, position of the drawn token), so a row's token depends on its logits and its key
alone, never on the rest of the batch.

A step's sampling rows become two small tables (`SamplingRows`): int64 [5, B] (the four keys and
top-k) and float32 [4, B] (temperature, top-p, min-p, raw-logprobs flag). The eager path copies
them to the device once per step; the CUDA-graph path writes them into its static input buffers
(`engine/execution/cuda_graphs.py`). Both then call `sample_rows` on the device tables, so the two paths
read the settings the same way.
"""

from __future__ import annotations

import torch

from rollout_kernels.host_to_device import to_device
from rollout_kernels.sampling_ref import as_int64_key, kept_mask_ref, sample_ref, token_logprobs_ref

# rows of the int64 table, then of the float32 table
SEED, PROMPT_INDEX, SAMPLE_INDEX, POSITION, TOP_K = range(5)
NUM_INT_ROWS = 5
TEMPERATURE, TOP_P, MIN_P, RAW_LOGPROBS = range(4)
NUM_FLOAT_ROWS = 4
# what a padding row (a CUDA-graph bucket past the batch) samples with: greedy, no filters
FLOAT_PADDING = (0.0, 1.0, 0.0, 0.0)


class SamplingRows:
    """The sampling settings of B rows, from the request and the drawn token's position of each.

    requests: objects with `params` (SamplingParams), `prompt_index` and `sample_index`.
    positions: the position of the token each row draws (its RNG key)."""

    def __init__(self, requests: list, positions: list[int]):
        self.size = len(requests)
        self.requests = requests
        self.positions = positions
        params = [r.params for r in requests]
        # one job shares one params object: fill rows with one value instead of reading B objects
        self._shared = params[0] if params and all(p is params[0] for p in params) else None
        self._params = params

    def _per_row(self, value_of, pad: int, pad_value) -> list:
        if self._shared is not None:
            return [value_of(self._shared)] * self.size + [pad_value] * pad
        return [value_of(p) for p in self._params] + [pad_value] * pad

    def int_rows(self, pad: int = 0) -> list[list[int]]:
        """[NUM_INT_ROWS][B + pad] plain ints: seed (as int64), prompt_index, sample_index, position, top_k."""
        return [
            self._per_row(lambda p: as_int64_key(p.seed), pad, 0),
            [r.prompt_index for r in self.requests] + [0] * pad,
            [r.sample_index for r in self.requests] + [0] * pad,
            list(self.positions) + [0] * pad,
            self._per_row(lambda p: p.top_k, pad, 0),
        ]

    def float_rows(self, pad: int = 0) -> list[list[float]]:
        """[NUM_FLOAT_ROWS][B + pad]: temperature, top_p, min_p, raw logprobs (1.0 / 0.0); padding
        rows get FLOAT_PADDING."""
        values = (lambda p: p.temperature, lambda p: p.top_p, lambda p: p.min_p,
                  lambda p: float(p.logprobs_mode == "raw"))
        return [self._per_row(value_of, pad, pad_value) for value_of, pad_value in zip(values, FLOAT_PADDING)]

    def to_device(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 [NUM_INT_ROWS, B], float32 [NUM_FLOAT_ROWS, B]) on `device`, for `sample_rows`."""
        return to_device(self.int_rows(), torch.int64, device), to_device(self.float_rows(), torch.float32, device)


def sample_rows(logits: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, use_triton: bool,
                per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample B rows of logits [B, V] with the settings of the tables ints [NUM_INT_ROWS, >= B] and
    floats [NUM_FLOAT_ROWS, >= B] (columns past B are ignored) -> (token ids [B] int64, logprobs [B]
    float32). `use_triton`: the fused kernel (CUDA, or its interpreter); else the torch reference.
    `per_row` (the on-policy mode, torch reference): one row at a time in fresh buffers, so no
    reduction of a row ever sees the batch's shape (as teacher_logprobs scores)."""
    if per_row:
        rows = [sample_rows(logits[i : i + 1].clone(), ints[:, i : i + 1].clone(), floats[:, i : i + 1].clone(),
                            use_triton=False) for i in range(logits.shape[0])]
        return torch.cat([t for t, _ in rows]), torch.cat([lp for _, lp in rows])
    batch = logits.shape[0]
    keys = tuple(ints[i, :batch] for i in (SEED, PROMPT_INDEX, SAMPLE_INDEX, POSITION))
    settings = (floats[TEMPERATURE, :batch], ints[TOP_K, :batch], floats[TOP_P, :batch], floats[MIN_P, :batch],
                floats[RAW_LOGPROBS, :batch] > 0.5)
    if use_triton:
        from rollout_kernels.sampling import sample  # triton is optional on the CPU's torch path

        return sample(logits, *settings, keys=keys)
    return sample_ref(logits, *settings, keys=keys)


def sampled_top_logprobs(logits: torch.Tensor, requests, tokens: torch.Tensor, per_row: bool) -> list:
    """The most likely tokens at each sampled row (top_logprobs): logits [B, V] of the rows `requests`
    sampled `tokens` [B] from -> per row, None (params.top_logprobs 0) or up to K (token id, logprob)
    pairs, most likely first, logprobs as the sampler reports them (the request's temperature, filters
    and logprobs mode; tokens the filters drop cannot be drawn and are left out). `per_row`: each row
    alone, as the on-policy mode samples."""
    rows = SamplingRows(list(requests), [0] * len(requests))
    ints, floats = rows.to_device(logits.device)
    num_top = max(r.params.top_logprobs for r in requests)

    def top(part: slice, row_logits: torch.Tensor):
        _, ids, values = token_logprobs_ref(row_logits, tokens[part], floats[TEMPERATURE, part],
                                            floats[RAW_LOGPROBS, part] > 0.5, ints[TOP_K, part], floats[TOP_P, part],
                                            floats[MIN_P, part], num_top)
        return ids, values

    if per_row:
        parts = [top(slice(i, i + 1), logits[i : i + 1].clone()) for i in range(logits.shape[0])]
        ids, values = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
        ids, values = top(slice(None), logits)
    out = []
    for request, row_ids, row_values in zip(requests, ids.tolist(), values.tolist(), strict=True):
        k = request.params.top_logprobs
        out.append([(t, v) for t, v in zip(row_ids[:k], row_values[:k]) if v != float("-inf")] if k else None)
    return out


def kept_ids_mask(ids_per_row: list, shape: tuple[int, int], device) -> torch.Tensor:
    """bool [R, V] (`shape`), True at each row's listed token ids: recorded sampling masks (R lists of ids,
    a trajectory's response_sampling_mask) as a mask over the vocabulary."""
    rows = torch.tensor([row for row, ids in enumerate(ids_per_row) for _ in ids], dtype=torch.long, device=device)
    cols = torch.tensor([t for ids in ids_per_row for t in ids], dtype=torch.long, device=device)
    keep = torch.zeros(shape, dtype=torch.bool, device=device)
    keep[rows, cols] = True
    return keep


def sampling_masks(logits: torch.Tensor, requests, per_row: bool, use_triton: bool) -> list:
    """The sampling mask of each sampled row: logits [B, V] of the rows `requests` drew from -> per row,
    the ids (ascending) of the tokens its draw could pick (the kept set its processed logprob is
    renormalised over) for requests with params.return_sampling_mask, None for the others. The set
    of the sampler that drew: the Triton kernel's (`sampling_support.kept_mask`, same knobs as
    `sample_rows`), else the torch reference's, one row at a time under `per_row` as sample_rows."""
    rows = SamplingRows(list(requests), [0] * len(requests))
    ints, floats = rows.to_device(logits.device)
    settings = (floats[TEMPERATURE], ints[TOP_K], floats[TOP_P], floats[MIN_P])
    if per_row:
        mask = torch.cat([kept_mask_ref(logits[i : i + 1].clone(), *(s[i : i + 1].clone() for s in settings))
                          for i in range(logits.shape[0])])
    elif use_triton:
        from rollout_kernels.sampling_support import kept_mask  # triton is optional on the CPU's torch path

        mask = kept_mask(logits, *settings)
    else:
        mask = kept_mask_ref(logits, *settings)
    return [mask[i].nonzero().squeeze(-1).tolist() if r.params.return_sampling_mask else None
            for i, r in enumerate(requests)]


def sample_extras(logits: torch.Tensor, requests, tokens: torch.Tensor, per_row: bool, use_triton: bool):
    """What sampled rows report beside their token and logprob: per row (top list or None, sampling mask
    or None) as SamplingParams.top_logprobs / return_sampling_mask ask; None when no row asks for either
    (the common case: nothing computed)."""
    wants_top = any(r.params.top_logprobs for r in requests)
    wants_mask = any(r.params.return_sampling_mask for r in requests)
    if not (wants_top or wants_mask):
        return None
    tops = sampled_top_logprobs(logits, requests, tokens, per_row) if wants_top else [None] * len(requests)
    masks = sampling_masks(logits, requests, per_row, use_triton) if wants_mask else [None] * len(requests)
    return list(zip(tops, masks, strict=True))


def teacher_logprobs(logits: torch.Tensor, entries, per_row: bool, use_triton: bool = False):
    """Scoring (teacher forcing): logits [S, V] of the scored rows of `entries` (engine.schedule_output
    BatchEntry with score_targets, in order) -> [S] float32 logprobs of their targets, reported as the
    sampler reports a drawn token (the request's temperature and logprobs mode); with the requests'
    score_top_k > 0, (logprobs, top ids [S, K], top logprobs [S, K]). `per_row`: one row at a time, as
    the on-policy mode samples, so a row's bits never depend on the others. `use_triton`: the targets'
    logprobs from the fused sampler's forced-token mode (`sampling_score.score_tokens`), bit for bit
    what `sample_rows(use_triton=True)` reported when it drew them; the top list (if asked) stays the
    torch reference's."""
    targets = [t for e in entries for t in e.score_targets]
    rows = SamplingRows([e.request for e in entries for _ in e.score_targets], [0] * len(targets))
    ints, floats = rows.to_device(logits.device)  # the requests' settings, as the sampler reads them
    targets = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    num_top = max(e.request.score_top_k for e in entries)
    chosen = None
    if use_triton:
        from rollout_kernels.sampling_score import score_tokens  # triton is optional on the CPU's torch path

        # one launch, per_row or not: the kernel's rows never depend on the batch (one program per row,
        # chunks fixed by V alone), as sample_rows' kernel rows do not
        chosen = score_tokens(logits, targets, floats[TEMPERATURE], ints[TOP_K], floats[TOP_P], floats[MIN_P],
                              floats[RAW_LOGPROBS] > 0.5)
        if not num_top:
            return _over_masks(logits, entries, targets, floats, chosen, num_top)

    def score(rows: slice, row_logits: torch.Tensor):
        return token_logprobs_ref(row_logits, targets[rows], floats[TEMPERATURE, rows],
                                  floats[RAW_LOGPROBS, rows] > 0.5, ints[TOP_K, rows], floats[TOP_P, rows],
                                  floats[MIN_P, rows], num_top)

    if not per_row:
        scored = score(slice(None), logits)
    else:
        # each row alone, in a fresh buffer, as the sampler's rows are (sample_rows with per_row)
        parts = [score(slice(i, i + 1), logits[i : i + 1].clone()) for i in range(logits.shape[0])]
        scored = torch.cat(parts) if not num_top else tuple(torch.cat(column) for column in zip(*parts))
    if chosen is not None:  # the top list from the reference, the targets' logprobs from the kernel
        scored = (chosen, *scored[1:])
    return _over_masks(logits, entries, targets, floats, scored, num_top)


def _over_masks(logits: torch.Tensor, entries, targets: torch.Tensor, floats: torch.Tensor, scored, num_top: int):
    """teacher_logprobs' result with the rows of requests that carry score_masks (`score --sampling-mask`)
    replaced: their processed logprobs renormalised over the given kept ids (the torch sampler's
    expression: log_softmax(logits / T) minus the log of the kept probabilities' sum, -inf outside),
    instead of over the set the filters cut from these logits; raw rows are left as they are."""
    rows, masks = [], []
    row = 0
    for e in entries:
        if e.request.score_masks is not None:
            first = e.first_scored
            rows += range(row, row + len(e.score_targets))
            masks += e.request.score_masks[first : first + len(e.score_targets)]
        row += len(e.score_targets)
    if not rows:
        return scored
    index = torch.tensor(rows, device=logits.device)
    temperature = floats[TEMPERATURE, index]
    temperature = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
    processed = torch.log_softmax(logits[index].float() / temperature[:, None], dim=-1)  # [M, V]
    keep = kept_ids_mask(masks, processed.shape, logits.device)
    kept = torch.where(keep, processed.exp(), torch.zeros_like(processed)).sum(dim=-1, keepdim=True)
    reported = torch.where(keep, processed - kept.log(), torch.full_like(processed, float("-inf")))
    processed_rows = floats[RAW_LOGPROBS, index] <= 0.5  # raw logprobs have no kept set
    index, reported = index[processed_rows], reported[processed_rows]
    chosen = scored[0].clone() if num_top else scored.clone()
    chosen[index] = reported.gather(-1, targets[index][:, None]).squeeze(-1)
    if not num_top:
        return chosen
    ids, values = scored[1].clone(), scored[2].clone()
    top = reported.topk(ids.shape[1], dim=-1)
    ids[index], values[index] = top.indices, top.values
    return chosen, ids, values
