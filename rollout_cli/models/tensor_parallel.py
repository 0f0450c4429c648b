"""Tensor parallelism for the dense, MoE and hybrid decoders: who this process is, and the split layers.

`rollout run --tp N` starts N processes (torch.distributed.run); each builds the model with its
share of the attention heads and of the MLP's intermediate size:

    qkv_proj, gate_up_proj  column-parallel: the rank's rows of each fused shard (q heads, kv heads,
                            gate / up slices); no communication
    o_proj, down_proj       row-parallel: the rank's input columns, then an all-reduce of [T, hidden]
    kv heads                split when N <= num_kv_heads; replicated when N > num_kv_heads: each rank
                            keeps the one kv head its q heads use
    embed_tokens, lm_head   vocab-parallel: each rank holds ceil(V / N) rows of the vocabulary (the last
                            rank's tail zero-padded); the embedding looks up the ids it holds (others
                            masked to zero) and all-reduces; the head all-gathers the logits
    Gated DeltaNet          (hybrid models) 1/N of the key and of the value heads: its rows of the projections
                            and conv channels (`mark_row_pieces`), its own state pool, out_proj row-parallel
    MoE experts             every expert split like a dense MLP: w13 [E, 2 I / N, H] holds the rank's gate
                            and up rows of each expert, w2 [E, H, I / N] the matching input columns; the
                            shared expert (Qwen2-MoE) is split the same way and its down projection does
                            not reduce: the block sums routed and shared partial outputs and all-reduces
                            once. The router is replicated, so every rank routes every token alike.

The model files ask `tp_size()` / `tp_rank()` while they are built (1 / 0 unless `init_tensor_parallel`
ran), so the single-process path builds the very same modules as before, with no collectives.

Every split parameter carries `tp_split = {shard_id: (dim, start, size, full_size[, blocks])}`: the
slice of the checkpoint tensor this rank holds (shard_id None for unfused parameters); with `blocks`
the dim holds that many equal blocks and the rank holds [start, start + size) of each (the fused
`experts.gate_up_proj` [E, 2 I, H]: gate rows, then up rows). The loader checks the checkpoint
against the full shapes and reads only the slice (models/loader.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn.functional as F

from rollout_cli.errors import RolloutError
from rollout_cli.models.layers import FusedLinear, Linear, _copy_checked
from rollout_cli.models.loader import TRANSPOSED


@dataclass
class TensorParallelGroup:
    """This process's place in the tensor-parallel group.

    `group` carries the all-reduces of the forward (NCCL on CUDA, gloo on the CPU); `cpu_group` (gloo,
    its own group on the CPU too) carries the messages from rank 0 (pickled objects), so they never
    touch the GPU stream, and waits for them as long as a daemon idles (FOLLOWER_WAIT).
    """

    rank: int  # within this engine's ranks
    size: int
    group: object
    cpu_group: object
    replica: int = 0  # which engine (--tp N --dp M: 0 .. M - 1)
    num_replicas: int = 1
    leaders_group: object = None  # gloo group of the engines' rank 0s, when num_replicas > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


_GROUP: TensorParallelGroup | None = None
FOLLOWER_WAIT = timedelta(days=365)  # gloo's default, 30 minutes, would end an idle `serve --tp` daemon


def tp_group() -> TensorParallelGroup | None:
    return _GROUP


def tp_size() -> int:
    return 1 if _GROUP is None else _GROUP.size


def tp_rank() -> int:
    return 0 if _GROUP is None else _GROUP.rank


def init_tensor_parallel(size: int, device: torch.device) -> TensorParallelGroup:
    """Join the process group torchrun set up; idempotent. WORLD_SIZE is `size` (one engine) or a
    multiple of it (`--tp N --dp M`: M engines of N consecutive ranks each, e.g. ranks 0-1 and 2-3)."""
    global _GROUP
    import torch.distributed as dist

    if _GROUP is not None:
        return _GROUP
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % size or "RANK" not in os.environ:
        raise RolloutError(f"--tp {size} needs a multiple of {size} processes started by torch.distributed.run "
                           f"(found WORLD_SIZE={world}); use `rollout run --tp {size}`")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives run on the current device: this rank's GPU
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, replicas = dist.get_rank(), world // size
    replica = rank // size
    # every process creates every group, in the same order (torch.distributed requires it)
    engine_ranks = [list(range(r * size, (r + 1) * size)) for r in range(replicas)]
    groups = [dist.group.WORLD] if replicas == 1 else [dist.new_group(ranks) for ranks in engine_ranks]
    # the followers wait on this group for their leader's next message, however long a daemon sits idle
    cpu_groups = [dist.new_group(ranks, backend="gloo", timeout=FOLLOWER_WAIT) for ranks in engine_ranks]
    # the engines' leaders (ranks 0, N, 2N, ...) share the data-parallel job: its barrier and gathers
    leaders = dist.new_group([r * size for r in range(replicas)], backend="gloo") if replicas > 1 else None
    # leave only once the peers finished connecting too: gloo's connect returns on one side before the
    # other has read it, and a rank that failed right after (its shard of the checkpoint) left its peer
    # in connectFullMesh, which logs an error line of its own beside the failing rank's one line
    dist.barrier(group=cpu_groups[replica])
    if leaders is not None and rank % size == 0:
        dist.barrier(group=leaders)
    _GROUP = TensorParallelGroup(rank % size, size, groups[replica], cpu_groups[replica],
                                 replica=replica, num_replicas=replicas, leaders_group=leaders)
    return _GROUP


def close_tensor_parallel() -> None:
    global _GROUP
    import torch.distributed as dist

    _GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel ranks, in place."""
    import torch.distributed as dist

    dist.all_reduce(x, group=_GROUP.group)
    return x


@dataclass(frozen=True)
class HeadSplit:
    """Which attention heads this rank computes.

    q heads [q_start, q_start + num_heads); kv heads [kv_start, kv_start + num_kv_heads). With
    tp > total kv heads, tp / total_kv ranks share (replicate) each kv head.
    """

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of(cls, total_heads: int, total_kv_heads: int, size: int, rank: int) -> "HeadSplit":
        if total_heads % size:
            raise RolloutError(f"--tp {size} must divide the {total_heads} attention heads; choose a divisor")
        heads = total_heads // size
        if size <= total_kv_heads:
            if total_kv_heads % size:
                raise RolloutError(f"--tp {size} must divide the {total_kv_heads} kv heads; choose a divisor")
            kv_heads = total_kv_heads // size
            return cls(heads, kv_heads, rank * heads, rank * kv_heads)
        if size % total_kv_heads:
            raise RolloutError(f"--tp {size} must be a multiple of the {total_kv_heads} kv heads when it exceeds them")
        # q head j uses kv head j // (total_heads // total_kv_heads); a rank's heads all share one
        return cls(heads, 1, rank * heads, rank // (size // total_kv_heads))


def column_parallel_qkv(hidden_size: int, split: HeadSplit, total: HeadSplit, head_dim: int,
                        bias: bool, q_rows_per_head: int = 1) -> FusedLinear:
    """qkv_proj holding this rank's q, k, v heads: weight [(r hq + 2 hkv) * head_dim, hidden], r =
    `q_rows_per_head` (2 when each q head's rows also carry its output gate: Qwen3-Next's gated attention)."""
    q = q_rows_per_head * head_dim
    sizes = {"q": split.num_heads * q, "k": split.num_kv_heads * head_dim, "v": split.num_kv_heads * head_dim}
    layer = FusedLinear(hidden_size, sizes, bias=bias)
    full = {"q": total.num_heads * q, "k": total.num_kv_heads * head_dim, "v": total.num_kv_heads * head_dim}
    starts = {"q": split.q_start * q, "k": split.kv_start * head_dim, "v": split.kv_start * head_dim}
    _mark(layer, {s: (0, starts[s], sizes[s], full[s]) for s in sizes})
    return layer


def column_parallel_gate_up(hidden_size: int, intermediate: int, size: int, rank: int, bias: bool) -> FusedLinear:
    """gate_up_proj holding this rank's slice of the intermediate size: weight [2 * I / tp, hidden]."""
    if intermediate % size:
        raise RolloutError(f"--tp {size} must divide the intermediate size {intermediate}; choose a divisor")
    local = intermediate // size
    layer = FusedLinear(hidden_size, {0: local, 1: local}, bias=bias)
    _mark(layer, {s: (0, rank * local, local, intermediate) for s in (0, 1)})
    return layer


class RowParallelLinear(Linear):
    """y = all_reduce(x_local W_local^T) + b: W_local [out, in / tp] holds this rank's input columns;
    the bias (replicated) is added once, after the sum. With reduce=False (the MoE shared expert, summed
    into the block's one all-reduce) y is this rank's partial sum, and there is no bias."""

    def __init__(self, in_features: int, out_features: int, size: int, rank: int, bias: bool = False,
                 reduce: bool = True):
        if in_features % size:
            raise RolloutError(f"--tp {size} must divide {in_features} (a row-parallel input size)")
        assert reduce or not bias, "a partial (unreduced) output cannot carry the bias"
        local = in_features // size
        super().__init__(local, out_features, bias)
        self.weight.tp_split = {None: (1, rank * local, local, in_features)}
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # [T, out]: this rank's share
        if not self.reduce:
            return y
        y = all_reduce(y)  # summed over ranks
        return y if self.bias is None else y + self.bias


def split_experts(w13: torch.nn.Parameter, w2: torch.nn.Parameter, intermediate: int, rank: int) -> None:
    """Mark stacked experts w13 [E, 2 i, H], w2 [E, H, i] (i = intermediate / tp) as this rank's slices.

    Per-expert checkpoint tensors: gate / up [I, H] give rows [rank i, rank i + i), down [H, I] the same
    columns. Fused ones: gate_up_proj [E, 2 I, H] gives those rows of both halves, down_proj [E, H, I]
    those columns; transposed ([E, H, 2 I], [E, I, H], shard id TRANSPOSED) the same along the other dim."""
    experts, local = w13.shape[0], w2.shape[2]
    start = rank * local
    w13.tp_split = {(e, part): (0, start, local, intermediate) for e in range(experts) for part in (0, 1)}
    w13.tp_split[None] = (1, start, local, 2 * intermediate, 2)
    w2.tp_split = {(e, 0): (1, start, local, intermediate) for e in range(experts)}
    w2.tp_split[None] = (2, start, local, intermediate)
    # the same stacks stored transposed (the hub's Qwen3-VL-MoE): [E, H, 2 I] and [E, I, H], the other dim
    w13.tp_split[TRANSPOSED] = (2, start, local, 2 * intermediate, 2)
    w2.tp_split[TRANSPOSED] = (1, start, local, intermediate)


class VocabParallelEmbedding(torch.nn.Module):
    """This rank's rows [start, start + size) of the [V, hidden] embedding, in a [rows, hidden] weight
    (rows = ceil(V / tp); rows past `size` stay zero). Serves as the tied head too (`vocab_parallel_logits`)."""

    def __init__(self, vocab_size: int, hidden_size: int, size: int, rank: int):
        super().__init__()
        rows = -(-vocab_size // size)
        self.vocab_size, self.start = vocab_size, min(rank * rows, vocab_size)
        self.size = min(rows, vocab_size - self.start)  # real rows here (fewer on the last rank)
        self.weight = torch.nn.Parameter(torch.zeros(rows, hidden_size), requires_grad=False)
        mark_vocab_rows(self.weight, self.start, self.size, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]: each id's row from the rank that holds it, summed over ranks."""
        here = (input_ids >= self.start) & (input_ids < self.start + self.size)  # [T] bool
        local = torch.where(here, input_ids - self.start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight) * here.unsqueeze(1).to(self.weight.dtype)
        return all_reduce(out)


def mark_vocab_rows(weight: torch.nn.Parameter, start: int, size: int, vocab_size: int) -> None:
    """Load rows [start, start + size) of a [V, hidden] checkpoint tensor into the top of `weight`."""
    weight.tp_split = {None: (0, start, size, vocab_size)}

    def load(param, tensor, shard_id=None):
        _copy_checked(param.data.narrow(0, 0, size), tensor, getattr(param, "checkpoint_name", "weight"))

    weight.weight_loader = load


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """hidden [B, hidden] x this rank's [rows, hidden] head -> the full logits [B, V] on every rank."""
    import torch.distributed as dist

    local = F.linear(hidden, weight).contiguous()  # [B, rows]
    parts = [torch.empty_like(local) for _ in range(_GROUP.size)]
    dist.all_gather(parts, local, group=_GROUP.group)
    return torch.cat(parts, dim=-1)[:, :vocab_size]  # [B, V]: the padded rows dropped


def _mark(layer: FusedLinear, split: dict) -> None:
    for param in (layer.weight, layer.bias):
        if param is not None:
            param.tp_split = split  # a bias [out] splits along dim 0 like the weight's rows


def mark_row_pieces(param: torch.nn.Parameter, pieces: dict, full_shapes: dict, dim: int = 0) -> None:
    """`param` (each of its shards) holds several pieces of the checkpoint tensor along `dim`, concatenated:
    pieces[shard_id] = [(start, size), ...], full_shapes[shard_id] the checkpoint tensor's shape (what the
    loader checks). For projections whose rank slice is not one range: Gated DeltaNet's q | k | v
    channels. The loader hands over the whole tensor (these are small) and the pieces are cut here,
    before the parameter's own weight_loader (fused shards, grouped rows) runs."""
    inner = param.weight_loader

    def load(target: torch.nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        if tuple(tensor.shape) == tuple(full_shapes[shard_id]):
            tensor = torch.cat([tensor.narrow(dim, start, size) for start, size in pieces[shard_id]], dim)
        inner(target, tensor, shard_id)

    param.shard_shape = lambda shard_id: tuple(full_shapes[shard_id])
    param.weight_loader = load
