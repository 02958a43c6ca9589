"""One stage of a served pipeline placed in its process, and the loop of every stage but the first.

``StagePart`` places the part of the stage's plan its process runs (``distributed.part``: the
embedding in stage 0 only, the head in the last only) as a ``PagedModel`` with a ``KVPool`` of
its own attention layers, as many blocks per tier as every other stage's (``groups.pool_blocks``).
``serve_stage`` is a later stage's whole work: receive a step from the stage before
(``messages``), replay the block copies of the swaps stage 0 made, take the step's block tables as
its pool's, compute its blocks from the hidden state, and send the hidden state on (or, the last
stage, the logits back to stage 0), until ``STOP``; then it tells stage 0 how long it computed.
It holds no allocator of its own: which blocks a request has is stage 0's to say, step by step.
Knows nothing about scheduling or HTTP.
"""

from __future__ import annotations

import time

import torch

from hetplan.errors import HetplanError
from hetplan.pipeline.record import stage_plan, whole_model
from hetplan.runtime.distributed.part import stage_part
from hetplan.runtime.serve.blocks import BlockTable
from hetplan.runtime.serve.load import load_part
from hetplan.runtime.serve.pipeline.groups import pool_blocks
from hetplan.runtime.serve.pipeline.messages import HEADER, KEEPALIVE, STEP, STOP, decode, header


class StagePart:
    """Stage ``stage`` of ``plan.pipeline``'s part, placed in ``mode`` with its pool."""

    def __init__(self, plan, stage: int, settings, weights: str, seed: int, mode: str):
        first, end = plan.pipeline["stages"][stage]["layers"]
        part = stage_part(stage_plan(plan, stage), whole_model(plan), first, end)
        self.mode = mode
        self.model, self.pool, self.tokenizer = load_part(part, weights, settings, mode, seed,
                                                          pool_blocks(settings, len(plan.pipeline["stages"])))

    def close(self) -> None:
        self.model.close()


def serve_stage(part: StagePart, peers, stage: int, stages: int, wire_dtype: torch.dtype) -> None:
    """Stage ``stage`` (> 0) of ``stages``: compute every step stage 0 issues, until ``STOP``."""
    before, last = stage - 1, stage == stages - 1
    model, pool = part.model, part.pool
    busy_s = 0.0
    try:
        while True:
            kind, group, n_body, n_tokens = peers.recv((HEADER,), torch.int64, before, "receiving a step from").tolist()
            if kind in (KEEPALIVE, STOP):
                if not last:
                    peers.send(header(kind), stage + 1, "passing a step on to")
                if kind == STOP:
                    peers.send(torch.tensor([busy_s], dtype=torch.float64), 0, "sending the busy time to")
                    peers.reap(every=True)
                    return
                continue
            if kind != STEP:
                raise HetplanError(f"stage {stage}: a message of unknown kind {kind} from stage {before}")
            body = peers.recv((n_body,), torch.int64, before, "receiving a step from")
            x = peers.recv((1, n_tokens, model.spec.hidden), wire_dtype, before, "receiving the hidden state from")
            msg = decode(body)
            t0 = time.perf_counter()
            for src, dst, pairs in msg.copies:
                pool.copy(src, dst, list(pairs))
            pool.alloc.tables = {s.key: BlockTable(s.tier, list(s.blocks)) for s in msg.segments}
            with torch.inference_mode():
                out = model.forward(pool, [(s.key, list(s.ids), s.start) for s in msg.segments], x=x.to(model.dtype))
            busy_s += time.perf_counter() - t0
            if last:                                           # [S, V] fp32
                peers.send(out, 0, "sending the logits to")
            else:                                              # [1, N, D]
                peers.send(header(STEP, group, n_body, n_tokens), stage + 1, "passing a step on to")
                peers.send(body, stage + 1, "passing a step on to")
                peers.send(out.to(wire_dtype), stage + 1, "passing the hidden state on to")
    finally:
        part.close()
