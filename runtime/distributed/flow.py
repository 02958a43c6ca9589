"""The passes of one generation as one stage takes part in them, micro-batches interleaved.

``M`` micro-batches (independent groups of ``batch`` sequences, each with its own KV caches in
every stage, ``stage.StageRunner``) go through the stages in one order that every stage follows
(``passes``): the prefill of micro-batch 0, 1, ..., M-1, then decode step 1 of micro-batch 0, 1,
..., M-1, then step 2, and so on. Pass ``k`` of a stage reads the hidden state ``x`` [B, S, D]
of pass ``k`` from the stage before (the first stage: the prompt's ids, or the token that pass
``k - M``, the same micro-batch's previous one, sampled on the last stage and sent back), runs the
stage's blocks and sends the result on with ``isend`` without waiting for it to arrive. So while
stage s computes micro-batch i, stage s+1 computes micro-batch i-1, and a micro-batch's decode
step starts on the first stage as soon as its token is back (and the passes before it in the
order are done). The receive of pass ``k + 1`` is posted before pass ``k`` computes, so its
message lands while the stage computes. With ``M = 1`` the stages take turns on one batch.

Measured on each stage, on its own clock from the barrier before the timed run: every pass's
busy seconds (its blocks computing) and the time it ended. Per phase a stage's *window* runs
from the end of its previous phase (the barrier, for prefill) to the end of its last pass of the
phase, and *idle* is the window less the busy seconds: waiting for messages. On the last stage:
TTFT (micro-batch 0's first token), the prefill of every micro-batch, and the decode steps
(step ``j`` ends when every micro-batch's token ``j`` is out).

With replicas, ``rank`` and ``world`` are this stage's place in its own replica's chain; the
replicas' first stages exchange a heartbeat at each decode step (``Peers.beat``).

Knows nothing about plans or how the stage was placed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hetplan.runtime.prompt import sample


@dataclass(frozen=True)
class Pass:
    """One micro-batch through one stage: ``tokens`` new positions per sequence from ``start``."""
    phase: str
    micro: int
    start: int
    tokens: int


def passes(micro_batches: int, prompt_len: int, gen_len: int) -> list:
    """Every pass of a generation, in the order every stage runs them (pass ``k`` of a decode
    step continues pass ``k - micro_batches``)."""
    order = [Pass("prefill", i, 0, prompt_len) for i in range(micro_batches)]
    for j in range(gen_len - 1):
        order += [Pass("decode", i, prompt_len + j, 1) for i in range(micro_batches)]
    return order


class Flow:
    """This stage's part in the passes of a generation."""

    def __init__(self, runner, peers, rank: int, world: int, hidden: int, wire: torch.dtype, opts):
        """``runner``: the placed stage (``StageRunner``); ``peers``: its messages (None for a
        pipeline of one stage); ``wire``: the dtype of ``x`` between stages."""
        self.runner, self.peers, self.rank, self.world = runner, peers, rank, world
        self.hidden, self.wire, self.opts = hidden, wire, opts
        self.first, self.last = rank == 0, rank == world - 1
        self.gen = torch.Generator().manual_seed(opts.seed)
        self.micro_batches = 1

    def generate(self, groups: list, gen_len: int, progress) -> dict:
        """Generate ``gen_len`` tokens for each micro-batch (``groups``: ids [B, P] each; read
        on the first stage only) -> what this stage measured (``_measured``)."""
        if self.opts.warmup:  # one micro-batch's prefill and first decode step, untimed
            self._run(passes(1, groups[0].shape[1], min(gen_len, 2)), groups[:1], None, keep=False)
            self.gen = torch.Generator().manual_seed(self.opts.seed)
        if self.peers:
            self.peers.barrier()
        order = passes(len(groups), groups[0].shape[1], gen_len)
        return self._run(order, groups, progress, keep=True)

    def _run(self, order: list, groups: list, progress, keep: bool) -> dict:
        m, batch = len(groups), groups[0].shape[0]
        tokens, logits = [[] for _ in range(m)], [[] for _ in range(m)]
        busy, ended, back = [], [], {}   # back: pass index -> its token, on a pipeline of one stage
        t0 = time.perf_counter()
        self.micro_batches = m
        incoming = self._post(order, 0, batch)
        for k, p in enumerate(order):
            if progress and self.last and p.phase == "decode" and p.micro == 0:
                progress("decode", (k - m) // m + 1, len(order) // m)
            if self.first and self.peers and p.phase == "decode" and p.micro == 0:
                self.peers.beat()     # the other replicas', where there are any (``peers``)
            if self.first and p.phase == "prefill":
                inputs = {"ids": groups[p.micro]}
            elif self.first and self.world == 1:
                inputs = {"ids": back.pop(k)[:, None]}
            else:
                got = incoming.wait()
                inputs = {"ids": got.cpu()[:, None]} if self.first else {"x": got.to(self.runner.dtype)}
            incoming = self._post(order, k + 1, batch)
            step = self.runner.step(p.phase, p.start, p.tokens, batch, self.opts.all_logits)
            out, seconds = self.runner.forward(step, inputs, p.micro)
            if self.last:
                lg = out["logits"].to(device="cpu", dtype=torch.float32, copy=True)
                tok = sample(lg[:, -1] if lg.dim() == 3 else lg, self.opts.temperature, self.gen)
                tokens[p.micro].append(tok)
                if keep and (self.opts.keep_logits or (self.opts.all_logits and p.phase == "prefill")):
                    logits[p.micro].append(lg)
                if k + m < len(order):        # the micro-batch decodes further: its token goes back
                    if self.world > 1:
                        self.peers.send(tok, 0, f"sending the sampled token{self._of(p)} to")
                    else:
                        back[k + m] = tok
            else:
                self.peers.send(out["x"].to(self.wire), self.rank + 1,
                                f"sending the {p.phase} hidden state{self._of(p)} to")
            busy.append(seconds)
            ended.append(time.perf_counter() - t0)
        if progress and self.last:
            progress("decode", len(order) // m, len(order) // m)
        if self.peers:
            self.peers.reap(every=True)
        return _measured(order, m, busy, ended, tokens, logits, self.last)

    def _of(self, p: Pass) -> str:
        """Which micro-batch a message is of, in what a failure says (when there are several)."""
        return f" of micro-batch {p.micro}" if self.micro_batches > 1 else ""

    def _post(self, order: list, k: int, batch: int):
        """The receive pass ``k`` needs, posted (None: it needs none, or there is no pass ``k``)."""
        if k >= len(order) or self.world == 1:
            return None
        p = order[k]
        if not self.first:
            return self.peers.post((batch, p.tokens, self.hidden), self.wire, self.rank - 1,
                                   f"receiving the {p.phase} hidden state{self._of(p)} from")
        if p.phase == "decode":
            return self.peers.post((batch,), torch.int64, self.world - 1,
                                   f"receiving the sampled token{self._of(p)} from")
        return None


def _measured(order, m, busy, ended, tokens, logits, last: bool) -> dict:
    """busy_s / idle_s per phase, busy seconds per pass (means), and on the last stage the
    tokens (M x B sequences, micro-batch by micro-batch), logits per step (the micro-batches'
    concatenated along the batch), TTFT, prefill and the decode steps."""
    n_prefill = m
    window = {"prefill": ended[n_prefill - 1], "decode": ended[-1] - ended[n_prefill - 1]}
    spent = {"prefill": sum(busy[:n_prefill]), "decode": sum(busy[n_prefill:])}
    n_decode = len(order) - n_prefill
    out = {"busy_s": spent, "idle_s": {ph: max(0.0, window[ph] - spent[ph]) for ph in window},
           "busy_prefill_s": spent["prefill"] / m,
           "busy_decode_s": spent["decode"] / n_decode if n_decode else None}
    if not last:
        return out
    step_ends = [ended[n_prefill - 1]] + [ended[k + m - 1] for k in range(n_prefill, len(order), m)]
    out.update(
        tokens=[seq for i in range(m) for seq in torch.stack(tokens[i], dim=1).tolist()],
        logits=[torch.cat([logits[i][j] for i in range(m)]) for j in range(len(logits[0]))],
        ttft_s=ended[0], prefill_s=ended[n_prefill - 1], decode_s=window["decode"],
        step_s=[b - a for a, b in zip(step_ends, step_ends[1:])])
    return out
