"""GraphRoutingBuffer (the recorder inside CUDA graphs) and RoutingPool.store: a replayed step's ids land
at its KV slots exactly as eager recording puts them."""

from __future__ import annotations

import torch

from rollout_cli.engine.execution.routing_pool import GraphRoutingBuffer, RoutingPool


def test_graph_buffer_rows_store_like_eager_recording():
    torch.manual_seed(0)
    layers, top_k, experts, tokens = 3, 2, 300, 5  # 300 experts: int16 ids
    step = [torch.randint(0, experts, (tokens, top_k), dtype=torch.int32) for _ in range(layers)]
    slots = torch.tensor([7, 2, 9, 4, 11])

    eager = RoutingPool(16, layers, top_k, experts, "cpu")
    eager.begin_step(slots)
    for layer, ids in enumerate(step):
        eager.record(layer, ids.long())

    graph_buffer = GraphRoutingBuffer(8, layers, top_k, experts, "cpu")  # 8: the largest bucket
    graph_buffer.ids.fill_(-1)
    for layer, ids in enumerate(step):
        graph_buffer.record(layer, ids)
    assert (graph_buffer.ids[tokens:] == -1).all()  # padding rows of the bucket untouched
    replayed = RoutingPool(16, layers, top_k, experts, "cpu")
    replayed.store(slots, graph_buffer.ids[:tokens])

    assert eager.ids.dtype == replayed.ids.dtype == torch.int16
    assert torch.equal(eager.ids, replayed.ids)
    got = replayed.gather([[9, 2]])[0]
    assert got.tolist() == [[step[layer][t].tolist() for layer in range(layers)] for t in (2, 1)]
