"""Continuous batching: which requests compute which tokens in the next step.

A request's *context* is its prompt followed by the tokens generated so far; ``computed`` of
them have their K/V in the pool. A step computes each scheduled request's next ``n`` context
tokens (a prefill chunk, or the one token a decoding request sampled last) and, when that reaches
the context's end, samples one more token. Requests join and leave at every step.

Each step, in order:

1. running requests, interactive before batch, then by arrival: a decode takes one token, a
   prefill up to ``prefill_chunk`` tokens of what is left of ``step_tokens``. A request whose
   cache needs a block when the ``gpu`` tier has none preempts the last running request
   (batch before interactive, latest arrival first; itself if it is the last): swapped out to
   the ``cpu`` tier when that has room, else its blocks are freed and its context recomputed
   when it is admitted again.
2. when nothing was preempted: swapped requests come back (their blocks copied in) while the
   ``gpu`` tier keeps one free block per request already running (none when none runs, so a
   request holding every GPU block can come back);
3. then waiting requests are admitted while the running batch is under ``max_batch`` and the
   ``gpu`` tier's free blocks hold the whole context plus one token (admission control).

With ``cpu_attention``, swapped requests that are decoding also compute each step, their
attention on the CPU over their blocks in DRAM (which grow there), beside the running batch.

Before step 1, an interactive request at the head of the queue that does not fit preempts
running batch requests (latest first) until it does.

Knows nothing about tensors beyond asking the pool to move blocks, nor about HTTP.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hetplan.runtime.serve.blocks import blocks_for
from hetplan.runtime.serve.sampling import SamplingParams

PRIORITIES = ("interactive", "batch")


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list
    params: SamplingParams
    priority: str = "interactive"
    arrival: int = 0
    generated: list = field(default_factory=list)
    computed: int = 0
    state: str = "waiting"
    """waiting, running, swapped, finished."""
    finish_reason: str | None = None
    """length, stop, cancelled, or error (the engine failed; ``error`` says how)."""
    error: str | None = None
    swaps: int = 0
    recomputes: int = 0
    generator: object = None
    on_token: object = None
    """Called as on_token(request) after every sampled token and once when it finishes."""
    arrived_s: float = 0.0
    first_token_s: float | None = None
    last_token_s: float | None = None

    @property
    def context(self) -> list:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        return len(self.prompt) + len(self.generated) - self.computed

    def key(self) -> tuple:
        return (PRIORITIES.index(self.priority), self.arrival)


class Scheduler:
    def __init__(self, pool, max_batch: int, prefill_chunk: int, step_tokens: int, cpu_attention: bool = False):
        self.pool, self.alloc = pool, pool.alloc
        self.cpu_attention = cpu_attention
        self.cpu_attention_tokens = 0
        self.max_batch, self.prefill_chunk, self.step_tokens = max_batch, prefill_chunk, step_tokens
        self.waiting: list = []
        self.running: list = []
        self.swapped: list = []
        self._arrivals = itertools.count()
        self.swaps_out = self.swaps_in = self.recomputes = 0

    def add(self, req: Request) -> None:
        req.arrival = next(self._arrivals)
        req.state = "waiting"
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take ``req`` out wherever it is and free its blocks (finished or cancelled)."""
        for q in (self.waiting, self.running, self.swapped):
            if req in q:
                q.remove(req)
        self.alloc.free(req.rid)
        req.state = "finished"

    def idle(self) -> bool:
        return not (self.waiting or self.running or self.swapped)

    def schedule(self) -> list:
        """-> [(request, n tokens)] to compute this step, blocks allocated for them."""
        self.running.sort(key=Request.key)
        self._make_room_for_interactive()
        out, budget, preempted = [], self.step_tokens, False
        i = 0
        while i < len(self.running):
            req = self.running[i]
            n = 1 if req.pending == 1 else min(req.pending, self.prefill_chunk, budget)
            if n < 1:
                i += 1
                continue
            while not self.alloc.can_hold(req.rid, req.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.state != "running":
                break
            self.alloc.grow(req.rid, req.computed + n)
            out.append((req, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._swap_in(out, budget)
            budget = self._admit(out, budget)
        if self.cpu_attention:
            self._decode_in_dram(out, budget)
        return out

    def _decode_in_dram(self, out: list, budget: int) -> None:
        """Swapped requests that are decoding compute their next token where their blocks are
        (attention on the CPU), growing in the DRAM tier, until they can be swapped back in."""
        for req in sorted(self.swapped, key=Request.key):
            if budget < 1:
                return
            if req.pending == 1 and self.alloc.can_hold(req.rid, req.computed + 1):
                self.alloc.grow(req.rid, req.computed + 1)
                out.append((req, 1))
                budget -= 1
                self.cpu_attention_tokens += 1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        held = len(self.alloc.table(req.rid).blocks)
        if held <= self.alloc.free_blocks("cpu"):
            self.pool.move(req.rid, "cpu")
            req.state, req.swaps = "swapped", req.swaps + 1
            self.swaps_out += 1
            self.swapped.append(req)
        else:
            self.alloc.free(req.rid)
            req.computed, req.state, req.recomputes = 0, "waiting", req.recomputes + 1
            self.recomputes += 1
            self.waiting.append(req)

    def _make_room_for_interactive(self) -> None:
        """An interactive request waiting for room preempts running batch requests, latest first."""
        self.waiting.sort(key=Request.key)
        if not self.waiting or self.waiting[0].priority != "interactive":
            return
        need = blocks_for(len(self.waiting[0].context) + 1, self.alloc.block_tokens)
        while (need > self.alloc.free_blocks("gpu") or len(self.running) >= self.max_batch) \
                and self.running and self.running[-1].priority == "batch":
            self._preempt(self.running[-1])

    def _swap_in(self, out: list, budget: int) -> int:
        """Bring swapped requests back (each computes in this step when its blocks allow) -> budget left."""
        self.swapped.sort(key=Request.key)
        while self.swapped and len(self.running) < self.max_batch:
            req = self.swapped[0]
            if self.waiting and min(self.waiting, key=Request.key).key() < req.key():
                break
            held = len(self.alloc.table(req.rid).blocks)
            if held + len(self.running) > self.alloc.free_blocks("gpu"):
                break
            self.pool.move(req.rid, "gpu")
            self.swaps_in += 1
            self.swapped.pop(0)
            req.state = "running"
            self.running.append(req)
            n = 1 if req.pending == 1 else min(req.pending, self.prefill_chunk, budget)
            if n > 0 and self.alloc.can_hold(req.rid, req.computed + n):
                self.alloc.grow(req.rid, req.computed + n)
                out.append((req, n))
                budget -= n
        return budget

    def _admit(self, out: list, budget: int) -> int:
        self.waiting.sort(key=Request.key)
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            if self.swapped and self.swapped[0].key() < req.key():
                return budget
            need = blocks_for(len(req.context) + 1, self.alloc.block_tokens)
            if need > self.alloc.free_blocks("gpu"):
                return budget
            self.waiting.pop(0)
            req.state = "running"
            self.running.append(req)
            n = min(req.pending, self.prefill_chunk, budget)
            self.alloc.grow(req.rid, max(1, req.computed + n))
            if n > 0:
                out.append((req, n))
                budget -= n
        return budget
