"""The serving engine: a pool, a scheduler and a model, stepped until no request is left.

``submit`` checks a request against the engine's limits (its context, the queue's capacity)
and queues it; ``step`` runs one scheduler step: a forward over the scheduled segments, one
sampled token for each request whose context was computed to its end, and finishing (max
tokens, a stop string, the end-of-sequence token) which frees its blocks at once. ``cancel``
frees a request wherever it is. ``start`` runs steps on a thread of its own; ``submit`` and
``cancel`` may be called from any thread: they hand the request (or its id) over under a small
lock, and the stepping thread takes them at the start of its next step, so a handler never waits
for a forward pass. Counters and
latencies feed ``/metrics``. Without a tokenizer, generated text is each id as `` <id>``.
Knows nothing about HTTP.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from hetplan.errors import HetplanError
from hetplan.runtime.serve.blocks import blocks_for
from hetplan.runtime.serve.metrics import TPOT_BUCKETS_S, TTFT_BUCKETS_S, Histogram, TokenRate
from hetplan.runtime.serve.sampling import SamplingParams, cut_at_stop, next_token
from hetplan.runtime.serve.scheduler import PRIORITIES, Request, Scheduler


class QueueFull(HetplanError):
    """More requests waiting than the queue holds (HTTP 429)."""


class TooLong(HetplanError):
    """A prompt (with its max_tokens) beyond the context the engine serves (HTTP 413)."""


@dataclass
class Stats:
    completed: int = 0
    cancelled: int = 0
    tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS_S))
    rate: TokenRate = field(default_factory=TokenRate)


class Engine:
    def __init__(self, model, pool, settings, tokenizer=None, mode: str = "cpu"):
        """``tokenizer``: the one beside the weights (text, chat template, end of sequence), or None.
        ``mode``: where the ``gpu`` tier is (``cuda``, ``emulated``, ``cpu``), for what is shown."""
        self.model, self.pool, self.settings = model, pool, settings
        self.tokenizer, self.mode = tokenizer, mode
        self.scheduler = Scheduler(pool, settings.max_batch, settings.prefill_chunk, settings.step_tokens,
                                   cpu_attention=settings.cpu_attention)
        if tokenizer is not None:
            self.detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        else:
            self.detokenize = lambda ids: "".join(f" {i}" for i in ids)
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        self.request_blocks = settings.gpu_blocks
        """GPU-tier blocks one request may hold at most."""
        self.request_blocks_of = ""
        """How ``request_blocks`` follows from the pool, when it is not the whole GPU tier."""
        self.requests: dict = {}
        self.stats = Stats()
        self._mail = threading.Lock()      # guards what other threads hand the stepping thread
        self._wake = threading.Condition(self._mail)
        self._arrived: list = []
        self._cancelled: set = set()
        self.waiting = 0
        """Requests queued (waiting in the scheduler, or handed over and not yet seen by it)."""
        self._thread = None
        self._stop = False
        self._ids = 0

    # -- requests ------------------------------------------------------------------------
    def submit(self, prompt: list, params: SamplingParams, priority: str = "interactive", on_token=None,
               rid: str | None = None) -> Request:
        s = self.settings
        if not prompt:
            raise HetplanError("prompt: empty; give at least one token")
        if priority not in PRIORITIES:
            raise HetplanError(f"priority {priority!r}: one of {', '.join(PRIORITIES)}")
        bad = [t for t in prompt if not 0 <= t < self.model.spec.vocab]
        if bad:
            raise HetplanError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{self.model.spec.vocab - 1})")
        need = len(prompt) + params.max_tokens
        if need > s.max_context:
            raise TooLong(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {need} tokens, "
                          f"beyond the {s.max_context}-token context this server holds; shorten the prompt or "
                          f"lower max_tokens")
        if blocks_for(need, s.block_tokens) > self.request_blocks:
            raise TooLong(f"{need} tokens need {blocks_for(need, s.block_tokens)} KV blocks, the GPU tier has "
                          f"{self.request_blocks}{self.request_blocks_of}; shorten the prompt or lower max_tokens")
        with self._mail:
            if self.waiting >= s.max_waiting:
                raise QueueFull(f"{self.waiting} requests are already waiting (queue capacity "
                                f"{s.max_waiting}); retry later")
            self._ids += 1
            req = Request(rid or f"req-{self._ids}", list(prompt), params, priority, on_token=on_token,
                          generator=params.generator(), arrived_s=time.perf_counter())
            self._arrived.append(req)
            self.waiting += 1
            self._wake.notify()
        return req

    def room_after(self, prompt_tokens: int) -> int:
        """Tokens a request with this prompt may generate at most: what is left of the context and
        of the GPU tier's positions (at least 1, so that a prompt too long is refused as such)."""
        s = self.settings
        return max(1, min(s.max_context, self.request_blocks * s.block_tokens) - prompt_tokens)

    def cancel(self, rid: str) -> None:
        """Cancel ``rid`` at the start of the next step (nothing if it has finished)."""
        with self._mail:
            self._cancelled.add(rid)
            self._wake.notify()

    def _take_mail(self) -> None:
        with self._mail:
            arrived, cancelled = self._arrived, self._cancelled
            self._arrived, self._cancelled = [], set()
        for req in arrived:
            self.requests[req.rid] = req
            self.scheduler.add(req)
        for rid in cancelled:
            req = self.requests.pop(rid, None)
            if req is not None and req.state != "finished":
                self.scheduler.remove(req)
                req.finish_reason = "cancelled"
                self.stats.cancelled += 1

    # -- steps ---------------------------------------------------------------------------
    def step(self) -> bool:
        """One step (on one thread only); False when no request is left."""
        self._take_mail()
        plan = self.scheduler.schedule()
        with self._mail:
            self.waiting = len(self.scheduler.waiting) + len(self._arrived)
        if not plan:
            if not self.scheduler.idle():  # every request would wait forever: a bug, never a spin
                raise HetplanError(f"the scheduler found nothing to run with {len(self.scheduler.waiting)} waiting "
                                   f"and {len(self.scheduler.swapped)} swapped requests")
            return False
        segments = [(r.rid, r.context[r.computed:r.computed + n], r.computed) for r, n in plan]
        with torch.inference_mode():
            logits = self.model.forward(self.pool, segments)
        now = time.perf_counter()
        for (req, n), row in zip(plan, logits):
            req.computed += n
            if req.pending == 0:
                self._sampled(req, next_token(row, req.params, req.generator), now)
        return not self.scheduler.idle()

    def _sampled(self, req: Request, token: int, now: float) -> None:
        req.generated.append(token)
        self.stats.tokens += 1
        self.stats.rate.add(now)
        if req.first_token_s is None:
            req.first_token_s = now
            self.stats.ttft.observe(now - req.arrived_s)
        else:
            self.stats.tpot.observe(now - req.last_token_s)
        req.last_token_s = now
        if self.eos_id is not None and token == self.eos_id and not req.params.ignore_eos:
            req.finish_reason = "stop"
        elif req.params.stop and cut_at_stop(self.detokenize(req.generated), req.params.stop)[1]:
            req.finish_reason = "stop"
        elif len(req.generated) >= req.params.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason:
            self.scheduler.remove(req)
            self.requests.pop(req.rid, None)
            self.stats.completed += 1
        _notify(req)

    def text(self, req: Request) -> str:
        """The request's generated text, ended before its first stop string (or its end-of-sequence token)."""
        ids = req.generated
        if ids and req.finish_reason == "stop" and self.eos_id is not None and ids[-1] == self.eos_id:
            ids = ids[:-1]
        text = self.detokenize(ids)
        return cut_at_stop(text, req.params.stop)[0] if req.params.stop else text

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise HetplanError(f"the engine did not finish its requests in {max_steps} steps")

    # -- the stepping thread -------------------------------------------------------------
    def start(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="hetplan-serve-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._mail:
                while not self._stop and self.scheduler.idle() and not self._arrived and not self._cancelled:
                    self._wake.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # the server stays up; the requests in flight end with an error
                self._fail_all(f"{type(e).__name__}: {e}")

    def _fail_all(self, message: str, say: bool = True) -> None:
        if say:
            print(f"hetplan serve: error: {message}; the requests in flight were ended", file=sys.stderr)
        self._take_mail()
        for req in list(self.requests.values()):
            self.scheduler.remove(req)
            req.finish_reason, req.error = "error", message
            _notify(req)
        self.requests.clear()

    def stop(self) -> None:
        with self._mail:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()


def _notify(req: Request) -> None:
    """Tell the request's consumer; one whose callback fails (its event loop closed at shutdown)
    does not stop the engine serving the others."""
    if req.on_token is None:
        return
    try:
        req.on_token(req)
    except RuntimeError:  # "Event loop is closed"
        pass
