"""The engine of a served pipeline, on stage 0: ``Engine``'s requests, sampling and counters,
its steps issued group after group down the stages.

A step of group ``g`` (``groups``): collect the group's step in flight (wait for its logits from
the last stage, sample a token for each request that computed to its context's end), schedule
the group's next step, compute stage 0's blocks over it and send the step (``messages``: its
segments with their block tables, the block copies the group's swaps made) and stage 0's hidden
state to stage 1, posting the receive of its logits. Then the next group: while stage 1 computes
group ``g``'s step, stage 0 computes group ``g + 1``'s, so with ``S`` groups every stage can be
busy. While no request is left, a keepalive goes down the stages every ``keepalive_s``.

A failure of a message (a stage stopped, or did not answer within the run's timeout), of a stage
process (``abort``: the launcher saw it exit) or of a step ends the requests in flight with an
error and breaks the engine: ``broken`` says why in one line and ``broken_event`` is set (the
server stops on it). ``stop`` ends the stepping thread, then the pipeline: the other stages stop
(``STOP``) and report their busy time, and the process group is left; an engine does not start
again. Knows nothing about HTTP.
"""

from __future__ import annotations

import signal
import threading
import time
import weakref

import torch

from hetplan.errors import HetplanError
from hetplan.runtime.distributed.peers import leave
from hetplan.runtime.serve.engine import Engine
from hetplan.runtime.serve.pipeline.groups import Groups, Partition
from hetplan.runtime.serve.pipeline.messages import KEEPALIVE, STEP, STOP, Segment, StepMessage, encode, header
from hetplan.runtime.serve.sampling import next_token

KEEPALIVE_S = 2.0
"""Seconds between keepalives while no request is left (at most a third of the run's timeout)."""
GRACE_S = 10.0
"""How long the stage processes this one started get to stop on their own before they are ended."""


class PipelineEngine(Engine):
    def __init__(self, model, pool, settings, peers, stages: int, wire_dtype: torch.dtype, tokenizer=None,
                 mode: str = "cpu"):
        """``model``, ``pool``: stage 0's (``load.load_part``, the pool of ``groups.pool_blocks``);
        ``peers``: this process's ``Peers`` in the run; ``wire_dtype``: the hidden state's dtype
        between stages."""
        super().__init__(model, pool, settings, tokenizer=tokenizer, mode=mode)
        partition = Partition(settings.block_tokens, pool.alloc.n_blocks, stages)
        pool.alloc = partition
        self.scheduler = Groups(pool, partition, settings)
        self.request_blocks = partition.parts[0].n_blocks["gpu"]
        self.request_blocks_of = f" for each of the pipeline's {stages} groups of requests"
        self.peers, self.stages, self.wire_dtype = peers, stages, wire_dtype
        self.keepalive_s = min(KEEPALIVE_S, peers.timeout_s / 3)
        self.turn = 0
        self._keys = weakref.WeakKeyDictionary()
        """request -> its number in the step messages."""
        self._next_key = 0
        self.broken: str | None = None
        self.broken_event = threading.Event()
        self._abort: str | None = None
        self._closed = False
        self.children = []
        """The stage processes this process started (``launch``), watched while it serves."""
        self.overlapped_steps = 0
        """Steps issued while another group's step was in flight (stages computing at once)."""
        self.busy_s = 0.0
        """Seconds stage 0 computed its blocks."""
        self.stage_busy_s: list | None = None
        """Per stage, seconds it computed its blocks (after ``stop``)."""

    # -- steps ---------------------------------------------------------------------------
    def step(self) -> bool:
        """One group's turn (on the stepping thread only); False when no request is left."""
        self._take_mail()
        groups = self.scheduler
        g, self.turn = self.turn, (self.turn + 1) % self.stages
        if groups.in_flight[g] is not None:
            self._collect(g)
        sched = groups.schedulers[g]
        plan = sched.schedule()
        with self._mail:
            self.waiting = len(groups.waiting) + len(self._arrived)
        if plan:
            self._issue(g, plan)
        elif not sched.idle():
            raise HetplanError(f"the scheduler of group {g} found nothing to run with {len(sched.waiting)} waiting "
                               f"and {len(sched.swapped)} swapped requests")
        return not groups.idle()

    def _issue(self, g: int, plan: list) -> None:
        pool = self.scheduler.pools[g]
        segments = [(r.rid, r.context[r.computed:r.computed + n], r.computed) for r, n in plan]
        t0 = time.perf_counter()
        with torch.inference_mode():
            x = self.model.forward(pool, segments)             # [1, N, D]
        self.busy_s += time.perf_counter() - t0
        msg = StepMessage(tuple(Segment(self._key(r), start, tuple(ids), pool.alloc.table(r.rid).tier,
                                        tuple(pool.alloc.table(r.rid).blocks))
                                for (r, _), (_, ids, start) in zip(plan, segments)), pool.take_copies())
        body = encode(msg)
        self.peers.send(header(STEP, g, body.numel(), x.shape[1]), 1, "sending a step to")
        self.peers.send(body, 1, "sending a step to")
        self.peers.send(x.to(self.wire_dtype), 1, "sending the hidden state to")
        logits = self.peers.post((len(plan), self.model.spec.vocab), torch.float32, self.stages - 1,
                                 "receiving the logits from")
        if any(f is not None for f in self.scheduler.in_flight):
            self.overlapped_steps += 1
        self.scheduler.in_flight[g] = (plan, logits)

    def _collect(self, g: int) -> None:
        plan, incoming = self.scheduler.in_flight[g]
        self.scheduler.in_flight[g] = None
        logits = incoming.wait().cpu()                         # [S, V] fp32
        now = time.perf_counter()
        for (req, n), row in zip(plan, logits):
            if req.state == "finished":                        # cancelled while its step was in flight
                continue
            req.computed += n
            if req.pending == 0:
                self._sampled(req, next_token(row, req.params, req.generator), now)

    def _key(self, req) -> int:
        if req not in self._keys:
            self._keys[req] = self._next_key
            self._next_key += 1
        return self._keys[req]

    # -- the stepping thread -------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._mail:
                if not self._stop and self._abort is None and self.scheduler.idle() and not self._arrived \
                        and not self._cancelled:
                    self._wake.wait(self.keepalive_s)
                if self._stop:
                    return
                quiet = self.scheduler.idle() and not self._arrived and not self._cancelled
                abort = self._abort
            try:
                if abort is not None:
                    raise HetplanError(abort)
                if quiet:
                    self.peers.send(header(KEEPALIVE), 1, "sending a keepalive to")
                    self.peers.reap(every=True)
                else:
                    self.step()
            except Exception as e:  # noqa: BLE001 - the pipeline's state is lost: end every request
                self._break(str(e) if isinstance(e, HetplanError) else f"{type(e).__name__}: {e}")
                return

    def _break(self, message: str) -> None:
        self._fail_all(message, say=False)
        self.scheduler.in_flight = [None] * self.stages
        self.broken = f"{message}; the requests in flight were ended"
        self.broken_event.set()

    def abort(self, message: str) -> None:
        """Break the engine (from any thread) at the stepping thread's next turn."""
        with self._mail:
            self._abort = message
            self._wake.notify()
        if not self._thread or not self._thread.is_alive():
            self.broken = self.broken or message
            self.broken_event.set()

    # -- the processes -------------------------------------------------------------------
    def watch(self, children: list) -> None:
        """Watch the stage processes this one started: one that exits while serving aborts."""
        self.children = children

        def watch():
            while not self._closed:
                for s, p in enumerate(children, start=1):
                    if p.exitcode not in (None, 0):
                        self.abort(f"stage {s} {_how(p.exitcode)}; the pipeline cannot serve without it")
                        return
                time.sleep(0.2)
        threading.Thread(target=watch, name="hetplan-serve-watch", daemon=True).start()

    def stop(self) -> None:
        super().stop()
        if self._closed:
            return
        try:
            if self.broken is None:
                self._stop_stages()
        except HetplanError as e:
            self.broken = str(e)
        finally:
            self._closed = True
            leave()
            self._end_children()
            self.model.close()

    def _stop_stages(self) -> None:
        """Collect the steps in flight, stop every stage and hear how long each computed."""
        for g, flight in enumerate(self.scheduler.in_flight):
            if flight is not None:
                flight[1].wait()
                self.scheduler.in_flight[g] = None
        self.peers.send(header(STOP), 1, "sending the end to")
        busy = [self.peers.recv((1,), torch.float64, s, "receiving the busy time of").item()
                for s in range(1, self.stages)]
        self.peers.reap(every=True)
        self.stage_busy_s = [self.busy_s] + busy

    def _end_children(self) -> None:
        deadline = time.monotonic() + GRACE_S
        for p in self.children:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.children:
            if p.exitcode is None:
                p.kill()
                p.join()
        failed = [(s, p.exitcode) for s, p in enumerate(self.children, start=1) if p.exitcode not in (None, 0)]
        if failed and self.broken is None:
            self.broken = "the pipeline stopped: " + ", then ".join(f"stage {s} {_how(c)}" for s, c in failed)


def _how(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
