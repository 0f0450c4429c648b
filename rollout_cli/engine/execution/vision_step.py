"""A step's inputs for a vision-language model: positions, and the image rows with their embeddings.

The vision tower runs in an encoder step before the forward that first needs an image, once for all
images missing from the `EncoderCache` (keyed by pixel digest: the n samples of a prompt, and prompts
that show the same image, share one run). A prefill chunk may start or stop inside an image's
placeholder run (chunked prefill, a prefix-cache hit that ends mid-image): it takes the rows of the
image it covers. The tower never runs inside a decode graph: decode steps carry no image tokens.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from rollout_cli.models.vision_language import VisionRows

# Image tokens whose vision-tower outputs the cache keeps (embeddings and deepstack features, model
# dtype): 16k tokens of an 8B-shaped model with 3 deepstack layers is 16384 x 4096 x 4 x 2 B = 512 MiB
# at most; entries go least recently used first, never those the current step needs.
DEFAULT_ENCODER_CACHE_TOKENS = 16384


class EncoderCache:
    """digest -> (embeddings [n, hidden], deepstack features [[n, hidden], ...]) of an image."""

    def __init__(self, model, device: torch.device, capacity_tokens: int = DEFAULT_ENCODER_CACHE_TOKENS):
        self.model = model
        self.device = device
        self.capacity_tokens = capacity_tokens
        self.entries: OrderedDict[int, tuple[torch.Tensor, list]] = OrderedDict()
        self.tokens = 0
        self.images_encoded = 0  # vision-tower runs, per image (the bench and tests read it)
        # `rollout bench` sets `timed`: each encoder step then waits for the device, and its time and
        # the grids it ran (for the tower's FLOPs) are added up
        self.timed = False
        self.seconds = 0.0
        self.grids: list[tuple[int, int, int]] = []

    def outputs(self, images) -> dict[int, tuple[torch.Tensor, list]]:
        """The outputs of every image in `images` (ImageInputs), running the tower once over the missing."""
        missing = list({im.digest: im for im in images if im.digest not in self.entries}.values())
        if missing:
            started = self._clock()
            for im, out in zip(missing, self.model.encode_images(missing, self.device)):
                self.entries[im.digest] = out
                self.tokens += out[0].shape[0]
            self.images_encoded += len(missing)
            if self.timed:
                self.seconds += self._clock() - started
                self.grids.extend(im.grid_thw for im in missing)
        wanted = {im.digest for im in images}
        for digest in wanted:
            self.entries.move_to_end(digest)
        self._evict(keep=wanted)
        return {digest: self.entries[digest] for digest in wanted}

    def _clock(self) -> float:
        if self.timed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _evict(self, keep: set[int]) -> None:
        for digest in list(self.entries):
            if self.tokens <= self.capacity_tokens:
                return
            if digest not in keep:
                self.tokens -= self.entries.pop(digest)[0].shape[0]

    def clear(self) -> None:
        """Forget every output (new weights change the tower's outputs)."""
        self.entries.clear()
        self.tokens = 0


def step_positions_and_images(entries, cache: EncoderCache, device: torch.device):
    """(positions [T] or [3, T] int64 on `device`, VisionRows or None) of a step's entries in order.

    Positions are 1-D unless the step holds image tokens: a text token's three positions are equal, so
    one list stands for the three until the first image token (decode steps never build three)."""
    flat: list[int] = []  # axis 0, every axis while the step has no image token
    rows3: list[list[int]] | None = None  # the three axes, from the first image token on
    pieces = []  # (first row in the step, image, first token of the image, token count)
    offset = 0
    for e in entries:
        start, end = e.start, e.start + e.num_new_tokens
        layout, delta = e.request.vision, e.request.rope_delta
        prompt_len = e.request.num_prompt_tokens if layout is not None else 0
        if start < prompt_len:  # prompt tokens: the layout's positions
            cut = min(end, prompt_len)
            for im, (s, t) in zip(layout.images, layout.spans):
                lo, hi = max(s, start), min(t, cut)
                if lo < hi:
                    pieces.append((offset + lo - start, im, lo - s, hi - lo))
            if pieces and rows3 is None:
                rows3 = [flat, list(flat), list(flat)]
            if rows3 is None:
                flat.extend(layout.positions[0, start:cut].tolist())
            else:
                for axis, row in enumerate(layout.positions[:, start:cut].tolist()):
                    rows3[axis].extend(row)
        tail = range(max(start, prompt_len) + delta, end + delta)
        for axis in rows3 or (flat,):
            axis.extend(tail)
        offset += e.num_new_tokens
    if not pieces:
        return torch.tensor(flat, device=device), None
    outputs = cache.outputs([im for _, im, _, _ in pieces])
    rows, embeds, deepstack = [], [], [[] for _ in range(cache.model.visual.num_deepstack)]
    for row, im, first, count in pieces:
        image_embeds, image_deepstack = outputs[im.digest]
        rows.extend(range(row, row + count))
        embeds.append(image_embeds[first:first + count])
        for level, features in enumerate(image_deepstack):
            deepstack[level].append(features[first:first + count])
    vision = VisionRows(torch.tensor(rows, device=device), torch.cat(embeds), [torch.cat(d) for d in deepstack])
    return torch.tensor(rows3, device=device), vision
